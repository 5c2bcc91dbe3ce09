"""The two engines `bench/forward.py` drives step by step on the same SmolLM2 weights: tokenloom's `ModelRunner`
with hand-built `ForwardBatch`es over a KV pool filled directly, and transformers with a `DynamicCache`
pre-filled to the same context. Both write random data into every KV slot a point reads (untouched pages
would all hit the kernel's shared zero page and stay in cache)."""

from __future__ import annotations

import functools
import gc
import os

import torch

from bench.common import _fill_random
from tokenloom.config import ServerArgs
from tokenloom.executor.model_runner import ModelRunner
from tokenloom.forward_batch import ForwardBatch, ForwardMode
from tokenloom.models.default_model import default_model_file

# --------------------------------------------------------------------------------------------------------
# tokenloom


class TokenloomEngine:
    """ModelRunner driven with hand-built ForwardBatches; KV slots filled directly (no prefill)."""

    def __init__(self, dtype: str, max_total_tokens: int, max_requests: int, threads: int,
                 kv_cache_dtype: str = "auto", attention_backend: str = "auto") -> None:
        args = ServerArgs(dtype=dtype, max_total_tokens=max_total_tokens, max_running_requests=max_requests,
                          num_threads=threads, kv_cache_dtype=kv_cache_dtype, attention_backend=attention_backend)
        self.runner = ModelRunner(args)
        torch.set_num_threads(threads)
        self.dtype = self.runner.dtype
        self.vocab = self.runner.vocab_size
        self._filled_rows = 1  # KV pool rows [0, _filled_rows) hold written (non-zero-page) data
        self._gen = torch.Generator().manual_seed(0)
        self._state: dict | None = None

    def _touch_kv(self, hi: int) -> None:
        """Write random data into pool rows below `hi` (each row once over the engine's life)."""
        if hi <= self._filled_rows:
            return
        pool = self.runner.kv_pool
        for buf in pool.k_buffers + pool.v_buffers:  # [kv_heads, rows, head_dim]
            for head in buf:
                _fill_random(head[self._filled_rows: hi])
        self._filled_rows = hi

    def _reset(self) -> None:
        self.runner.token_allocator.clear()
        self.runner.req_to_token_pool.clear()

    # decode ------------------------------------------------------------------------------------------
    def setup_decode(self, batch: int, context: int, extra_steps: int) -> None:
        """`batch` requests with `context` tokens already in the KV pool, room for `extra_steps` more."""
        self._reset()
        runner = self.runner
        rows = runner.req_to_token_pool.alloc(batch)
        total = context + extra_steps
        if total > runner.context_len:
            raise ValueError(f"context {total} exceeds the model's {runner.context_len}")
        slots = runner.token_allocator.alloc(batch * total)
        if rows is None or slots is None:
            raise RuntimeError(f"KV pool too small for batch {batch} x {total}")
        slots = slots.view(batch, total)
        rows_t = torch.tensor(rows, dtype=torch.int64)
        runner.req_to_token_pool.req_to_token[rows_t, :context] = slots[:, :context].to(torch.int32)
        self._touch_kv(int(slots.max()) + 1)
        self._state = {"rows": rows_t, "slots": slots, "context": context, "step": 0, "batch": batch}

    def decode_step(self) -> None:
        st = self._state
        pos = st["context"] + st["step"]
        batch = st["batch"]
        ids = torch.randint(0, self.vocab, (batch,), generator=self._gen)
        seq_lens = torch.full((batch,), pos + 1, dtype=torch.int64)
        fb = ForwardBatch.build(ForwardMode.DECODE, ids, st["rows"], seq_lens - 1, seq_lens,
                                st["slots"][:, pos].contiguous())
        self.runner.forward(fb)
        st["step"] += 1

    def teardown(self) -> None:
        self._state = None
        self._reset()

    # prefill -----------------------------------------------------------------------------------------
    def prefill(self, batch: int, length: int) -> None:
        self._reset()
        runner = self.runner
        rows = runner.req_to_token_pool.alloc(batch)
        slots = runner.token_allocator.alloc(batch * length)
        if rows is None or slots is None:
            raise RuntimeError(f"KV pool too small for prefill {batch} x {length}")
        ids = torch.randint(0, self.vocab, (batch * length,), generator=self._gen)
        seq_lens = torch.full((batch,), length, dtype=torch.int64)
        fb = ForwardBatch.build(ForwardMode.EXTEND, ids, torch.tensor(rows, dtype=torch.int64),
                                torch.zeros(batch, dtype=torch.int64), seq_lens, slots)
        runner.forward(fb)
        self._reset()


# --------------------------------------------------------------------------------------------------------
# transformers


class HFEngine:
    """transformers on the same GGUF: one-token forwards on a DynamicCache pre-filled to the context."""

    def __init__(self, dtype: torch.dtype, threads: int) -> None:
        import inspect

        import transformers
        from transformers import AutoModelForCausalLM

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
        try:  # the GGUF de-quantization loop uses a bare tqdm that ignores the switch above
            from transformers import modeling_gguf_pytorch_utils as gguf_utils

            gguf_utils.tqdm = functools.partial(gguf_utils.tqdm, disable=True)
        except (ImportError, AttributeError):
            pass
        path = default_model_file()
        self.model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=dtype).eval()
        torch.set_num_threads(threads)
        cfg = self.model.config
        self.cfg = cfg
        self.dtype = dtype
        self.vocab = cfg.vocab_size
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.layers = cfg.num_hidden_layers
        self._gen = torch.Generator().manual_seed(1)
        self._state: dict | None = None
        # transformers 5.x renamed `past_key_values` to `cache` (the old name warns).
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        linears = [m for m in self.model.modules() if isinstance(m, torch.nn.Linear)]
        self.describe = (f"{len(linears)} x {type(linears[0]).__module__}.{type(linears[0]).__name__}, "
                         f"weights {linears[0].weight.dtype}, attn_implementation="
                         f"{self.model.config._attn_implementation}")

    def setup_decode(self, batch: int, context: int) -> None:
        from transformers import DynamicCache

        cache = DynamicCache(config=self.cfg)
        for layer in range(self.layers):
            k = torch.empty(batch, self.kv_heads, context, self.head_dim, dtype=self.dtype)
            v = torch.empty_like(k)
            _fill_random(k)
            _fill_random(v)
            cache.update(k, v, layer)
        self._state = {"cache": cache, "batch": batch}

    @torch.inference_mode()
    def decode_step(self) -> None:
        st = self._state
        ids = torch.randint(0, self.vocab, (st["batch"], 1), generator=self._gen)
        self.model(input_ids=ids, use_cache=True, **{self._cache_kw: st["cache"]})

    def teardown(self) -> None:
        self._state = None
        gc.collect()

    @torch.inference_mode()
    def prefill(self, batch: int, length: int) -> None:
        ids = torch.randint(0, self.vocab, (batch, length), generator=self._gen)
        # logits_to_keep=1: the LM head on the last token only, as generate() and tokenloom do.
        self.model(input_ids=ids, use_cache=True, logits_to_keep=1)
