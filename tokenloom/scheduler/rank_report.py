"""What a scheduler rank measured while starting, added to its ready message (entrypoints/scheduler_process.py): the
model dtype, this rank's parameters and weight bytes, how long its weights took to load, its KV pool's bytes, its
torch threads, the cores it may run on (None where its affinity mask cannot be read), the CPU's native-kernel
features, the libgomp wait settings its environment had when torch loaded (`rank_omp_env`, set by the launcher),
its huge pages (`huge_page_report`: the THP mode, THP_MEM_ALLOC_ENABLE, GLIBC_TUNABLES, the MiB huge pages back
once its weights and KV pool are allocated), the root of the server's processes it counts as its own
(`server_root_pid`: the launcher's pid in a spawned rank, executor/process_tree.py) and the quantized weight types
kept (`weight_quantization`: "Q4_1 x 210, Q8_0 x 1", or None).
The launcher keeps the entry rank's message (`TokenizerManager.scheduler_info`); the server's start-up
summary (entrypoints/startup_summary.py) and `/get_server_info` show it. At TP/PP > 1 the numbers are the entry
rank's (its shard, its layers).

Keys never collide with a `ServerArgs` field (`/get_server_info` merges both): `model_dtype`, not `dtype`.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from tokenloom.cache.memory_budget import model_nbytes
from tokenloom.distributed.cpu_binding import allowed_cores
from tokenloom.executor.cpu_threads import OMP_WAIT_VARS
from tokenloom.executor.huge_pages import huge_page_report
from tokenloom.executor.process_tree import server_root_pid
from tokenloom.kernels.cpu_build import cpu_features
from tokenloom.layers.quant_linear import format_types, quantized_weights


def rank_report(model: torch.nn.Module, dtype: torch.dtype, kv_pool_bytes: int, load_seconds: float
                ) -> dict[str, Any]:
    quant_params, types = quantized_weights(model)
    return {"model_dtype": str(dtype).removeprefix("torch."),
            "num_parameters": sum(p.numel() for p in model.parameters()) + quant_params,
            "weight_quantization": format_types(types) or None,
            "weight_bytes": model_nbytes(model), "weight_load_s": round(load_seconds, 3),
            "kv_pool_bytes": kv_pool_bytes, "threads_per_rank": torch.get_num_threads(),
            "rank_cpu_cores": allowed_cores(), "cpu_features": cpu_features(),
            "rank_omp_env": {name: os.environ.get(name) for name in OMP_WAIT_VARS},
            "server_root_pid": server_root_pid(), **huge_page_report()}
