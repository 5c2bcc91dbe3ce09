"""`Engine`: the in-process API. Same runtime as the server (scheduler subprocesses over ZMQ; detokenizing on
the tokenizer manager's receive thread, or in a subprocess with --detokenizer-process) without HTTP.

    with tokenloom.Engine(dtype="float32", chunked_prefill_size=64) as engine:
        out = engine.generate("The capital of France is", {"max_new_tokens": 16, "temperature": 0})
        outs = engine.generate(["a", "b"], [{"temperature": 0}, {"temperature": 0.7}])
        for chunk in engine.generate("Hi", stream=True): ...

Keyword arguments are the server flags in snake_case. `generate` returns the `/generate` response shape
(a dict, or a list for a batch): {"text", "output_ids", "meta_info": {id, finish_reason, prompt_tokens,
completion_tokens, cached_tokens, total_retractions, e2e_latency}}.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

from tokenloom.config import ServerArgs, check_device, warn_ignored_flags
from tokenloom.entrypoints.runtime import start_tokenizer_manager
from tokenloom.protocol import TokenizedRequest


class Engine:
    def __init__(self, model_path: str | None = None, **server_args: Any) -> None:
        self.server_args = ServerArgs.from_kwargs(model_path=model_path, **server_args)
        check_device(self.server_args)
        warn_ignored_flags(self.server_args)
        self.tokenizer_manager = start_tokenizer_manager(self.server_args)
        self.tokenizer = self.tokenizer_manager.tokenizer
        self._loop = asyncio.new_event_loop()
        self._loop_lock = threading.Lock()
        self._closed = False

    # --- public API ---------------------------------------------------------------------------------
    def generate(self, prompt: str | list[str] | None = None, sampling_params: dict | list[dict] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None, rid: str | list[str] | None = None,
                 stream: bool = False, return_logprob: bool = False, top_logprobs_num: int = 0,
                 logprob_start_len: int = -1, token_ids_logprob: list[int] | list[list[int]] | None = None) -> Any:
        """Blocking generate; with stream=True an iterator of cumulative outputs (single prompt only).
        With return_logprob, `logprob_start_len` k >= 0 adds prompt logprobs from position k on and
        `token_ids_logprob` the logprobs of those ids at every position (SGLang's meta_info keys)."""
        reqs, batch = self.tokenizer_manager.tokenize_batch(
            prompt, input_ids, sampling_params, rid, stream=stream, return_logprob=return_logprob,
            top_logprobs_num=top_logprobs_num, logprob_start_len=logprob_start_len,
            token_ids_logprob=token_ids_logprob)
        if stream:
            if batch:
                raise ValueError("stream=True supports a single prompt")
            return self._sync_stream(reqs[0])
        results = self._run(self._collect(reqs))
        return results if batch else results[0]

    async def async_generate(self, prompt: str | list[str] | None = None, sampling_params: Any = None,
                             input_ids: Any = None, rid: Any = None, stream: bool = False,
                             return_logprob: bool = False, top_logprobs_num: int = 0, logprob_start_len: int = -1,
                             token_ids_logprob: Any = None) -> Any:
        """Like `generate`, in the caller's event loop; with stream=True an async iterator."""
        reqs, batch = self.tokenizer_manager.tokenize_batch(
            prompt, input_ids, sampling_params, rid, stream=stream, return_logprob=return_logprob,
            top_logprobs_num=top_logprobs_num, logprob_start_len=logprob_start_len,
            token_ids_logprob=token_ids_logprob)
        if stream:
            if batch:
                raise ValueError("stream=True supports a single prompt")
            return self.tokenizer_manager.generate_request(reqs[0])
        results = await self._collect(reqs)
        return results if batch else results[0]

    def abort(self, rid: str) -> None:
        self.tokenizer_manager.abort(rid)

    def flush_cache(self) -> dict[str, Any]:
        reply = self._run(self.tokenizer_manager.flush_cache())
        return {"success": reply.success, "message": reply.message}

    def get_server_info(self) -> dict[str, Any]:
        return self._run(self.async_get_server_info())

    async def async_get_server_info(self) -> dict[str, Any]:
        """Like `get_server_info`, in the caller's event loop (e.g. sampled while `async_generate` runs)."""
        state = await self.tokenizer_manager.get_internal_state()
        return {**vars(self.server_args), **state}

    def run(self, coro: Any) -> Any:
        """Run a coroutine of this engine's async API (`async_generate`, `async_get_server_info`, ...) on the
        engine's event loop, blocking; the synchronous methods do the same."""
        return self._run(coro)

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self.tokenizer_manager.shutdown()
            self._loop.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # --- plumbing -----------------------------------------------------------------------------------
    async def _collect(self, reqs: list[TokenizedRequest]) -> list[dict[str, Any]]:
        async def one(req: TokenizedRequest) -> dict[str, Any]:
            async for out in self.tokenizer_manager.generate_request(req):
                last = out
            return last

        return list(await asyncio.gather(*(one(r) for r in reqs)))

    def _run(self, coro: Any) -> Any:
        with self._loop_lock:
            return self._loop.run_until_complete(coro)

    def _sync_stream(self, req: TokenizedRequest) -> Iterator[dict[str, Any]]:
        agen: AsyncIterator = self.tokenizer_manager.generate_request(req)
        try:
            while True:
                try:
                    yield self._run(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self._run(agen.aclose())
