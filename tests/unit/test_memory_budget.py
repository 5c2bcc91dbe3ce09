"""`--mem-fraction-static` with SGLang's meaning (weights + KV take that share of the memory available at
start), the CPU default (a quarter of what the weights left), checked against hand arithmetic; and
`model_nbytes`, which must count the packed weight copies and shared storage once."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tokenloom.cache.memory_budget import CPU_KV_SHARE_OF_FREE, MemoryBudgetError, kv_pool_bytes, model_nbytes
from tokenloom.device import default_mem_fraction_static

GIB = 2**30


@pytest.mark.parametrize("memory, weights, fraction, expected", [
    (100 * GIB, 10 * GIB, 0.85, 75 * GIB),        # 85 GiB static - 10 GiB weights
    (100 * GIB, 10 * GIB, 0.9, 80 * GIB),
    (16 * GIB, 270 * 2**20, 0.8, int(0.8 * 16 * GIB) - 270 * 2**20),
    (1000, 100, 0.5, 400),
    (1001, 0, 0.5, 500),                          # floor of 500.5
])
def test_fraction_is_the_share_for_weights_plus_kv(memory, weights, fraction, expected):
    assert kv_pool_bytes(memory, weights, fraction) == expected


@pytest.mark.parametrize("memory, weights, expected", [
    (100 * GIB, 10 * GIB, int(90 * GIB * 0.25)),  # a quarter of the 90 GiB the weights left
    (1000, 200, 200),
    (1000, 1000, 0),
    (1000, 4000, 0),                              # never negative; the runner reports the empty pool
])
def test_cpu_default_is_a_quarter_of_what_the_weights_left(memory, weights, expected):
    assert CPU_KV_SHARE_OF_FREE == 0.25
    assert kv_pool_bytes(memory, weights, None) == expected


@pytest.mark.parametrize("memory, weights, fraction", [(10 * GIB, 9 * GIB, 0.85), (1000, 500, 0.5),
                                                       (1000, 900, 0.1)])
def test_weights_larger_than_the_static_share_are_a_clear_error(memory, weights, fraction):
    with pytest.raises(MemoryBudgetError, match=rf"--mem-fraction-static {fraction} .*the weights alone take") as e:
        kv_pool_bytes(memory, weights, fraction)
    assert "--max-total-tokens" in str(e.value)


def test_device_defaults():
    assert default_mem_fraction_static(torch.device("cpu")) is None
    assert default_mem_fraction_static(torch.device("cuda")) == 0.85


@dataclass
class _Packed:
    copy: torch.Tensor
    other: torch.Tensor | None = None


class _Toy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 4, bias=True)                          # 32 + 4 floats
        self.b = torch.nn.Linear(8, 4, bias=False)
        self.b.weight = self.a.weight                                       # tied: counted once
        self.register_buffer("table", torch.zeros(10, dtype=torch.float64))  # 80 bytes
        self.a.packed = _Packed(torch.zeros(6, dtype=torch.bfloat16))       # 12 bytes, in a dataclass
        self.cache = torch.zeros(3, dtype=torch.int32)                      # 12 bytes, a plain attribute
        self.view = self.cache[1:]                                          # same storage: not again


def test_model_nbytes_counts_params_buffers_and_packed_copies_once():
    assert model_nbytes(_Toy()) == (32 + 4) * 4 + 80 + 12 + 12


def test_model_nbytes_counts_opaque_onednn_tensors():
    w = torch.randn(16, 32, dtype=torch.bfloat16)
    try:
        opaque = torch.ops.mkldnn._reorder_linear_weight(w, None)
    except (RuntimeError, AttributeError):
        pytest.skip("no oneDNN bf16 reorder in this torch build")
    m = torch.nn.Module()
    m.packed = _Packed(opaque)
    assert model_nbytes(m) == 16 * 32 * 2
