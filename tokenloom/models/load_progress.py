"""`LoadProgress`: INFO lines while a stage's weights stream into the model, a few per load, never one per
tensor: "Loading weights: 40% (12/30 layers, 3.1 s)" at each tenth of the tensors this stage needs (at most
one line a second), then "Loaded weights: 30/30 layers, 134.5M parameters (bfloat16), 0.50 GiB in memory, in
11.7 s" (the memory counts the packed copies the CPU kernels keep beside the weights, as the KV budget does);
with quantized weights kept (--quantization gguf) the line names them: "134.5M parameters (bfloat16
activations; kept quantized: Q4_1 x 210, Q8_0 x 1)", the count of file tensors of each type.

Progress counts the tensors the model requires (`required_weight_names`), so a TP shard or a pipeline stage
that skips other stages' tensors still reaches 100%; a layer is done when all its required tensors are.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable, Iterator

import torch

from tokenloom.layers.quant_linear import format_types, quantized_weights

logger = logging.getLogger("tokenloom.models.loader")

STEPS = 10  # progress lines at each tenth of the tensors
MIN_GAP_S = 1.0  # between two progress lines (a fast load prints only the final one)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class LoadProgress:
    def __init__(self, required: set[str]) -> None:
        """`required`: the HF names the model needs (a rank's lines are named by its process's log prefix)."""
        self.required = set(required)
        self.start = time.perf_counter()
        self.loaded = 0
        self.per_layer: dict[int, int] = {}  # layer -> required tensors not loaded yet
        for name in self.required:
            match = _LAYER.match(name)
            if match:
                layer = int(match.group(1))
                self.per_layer[layer] = self.per_layer.get(layer, 0) + 1
        self.num_layers = len(self.per_layer)
        self.layers_done = 0
        self.next_step = 1
        self.last_line = self.start

    def track(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield `weights` unchanged, counting each required tensor once the model has taken it."""
        for name, tensor in weights:
            yield name, tensor
            self._taken(name)

    def _taken(self, name: str) -> None:
        if name not in self.required:
            return
        self.required.discard(name)  # a name counts once, however often a checkpoint repeats it
        self.loaded += 1
        match = _LAYER.match(name)
        if match:
            layer = int(match.group(1))
            self.per_layer[layer] -= 1
            self.layers_done += self.per_layer[layer] == 0
        total = self.loaded + len(self.required)
        if self.loaded * STEPS < self.next_step * total:
            return
        self.next_step = self.loaded * STEPS // total + 1
        now = time.perf_counter()
        if self.required and now - self.last_line >= MIN_GAP_S:
            self.last_line = now
            logger.info("Loading weights: %d%% (%d/%d layers, %.1f s)", 100 * self.loaded // total,
                        self.layers_done, self.num_layers, now - self.start)

    def finished(self, model: torch.nn.Module, dtype: torch.dtype, nbytes: int, what: str = "") -> float:
        """Log the final line (`what`: how the weights were made, for dummy weights); returns the seconds."""
        seconds = time.perf_counter() - self.start
        quant_params, types = quantized_weights(model)
        params = sum(p.numel() for p in model.parameters()) + quant_params
        kind = str(dtype).removeprefix("torch.")
        if types:
            kind += f" activations; kept quantized: {format_types(types)}"
        logger.info("Loaded weights%s: %d/%d layers, %s parameters (%s), %.2f GiB in memory, in %.1f s",
                    f" ({what})" if what else "", self.layers_done if not what else self.num_layers,
                    self.num_layers, format_count(params), kind, nbytes / 2**30, seconds)
        return seconds


def format_count(n: int) -> str:
    """134515008 -> "134.5M" (K, M, B)."""
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)
