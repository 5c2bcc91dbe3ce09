"""`TokenizerManager`: the engine/server side of the runtime. It launches the scheduler and detokenizer
processes, validates and tokenizes requests, sends them to the scheduler, and routes outputs coming back
from the detokenizer to the waiting caller (one `ReqState` per request id).

Threads: a receiver thread owns the incoming socket and hands each output to the caller's asyncio loop
(`call_soon_threadsafe`), so the same manager serves a private loop (Engine.generate) and any user or
server loop (async_generate, the HTTP server). It also watches the children: if one dies, every pending
request fails with a clear error and new requests are refused.

Request lifecycle: `generate_request` registers a `ReqState`, sends the `TokenizedRequest`, yields outputs
until one carries a finish reason, and removes the state. If the caller goes away first (cancelled task,
closed stream), the request is aborted so its KV is freed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing as mp
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import zmq

from tokenloom.config import ServerArgs
from tokenloom.frontend.detokenizer import run_detokenizer_process
from tokenloom.ipc import IpcAddresses, Receiver, Sender
from tokenloom.models.loader import resolve_model_source
from tokenloom.protocol import (
    AbortRequest,
    BatchStrOutput,
    FlushCacheReply,
    FlushCacheRequest,
    GetInternalStateRequest,
    InternalStateReply,
    ProcessFailed,
    TokenizedRequest,
)
from tokenloom.sampling.sampling_params import SamplingParams
from tokenloom.scheduler.process import run_scheduler_process
from tokenloom.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 900
CHILD_CHECK_S = 0.5


class EngineDeadError(RuntimeError):
    """A runtime process died; the engine cannot serve any more requests."""


@dataclass
class ReqState:
    rid: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    created: float = field(default_factory=time.perf_counter)
    finished: bool = False


class TokenizerManager:
    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.source = resolve_model_source(args)
        self.tokenizer = load_tokenizer(self.source, args.tokenizer_path)
        self.context_len = self.source.config.context_length
        self.vocab_size = self.source.config.vocab_size
        self.addresses = IpcAddresses.fresh()
        self.zmq_ctx = zmq.Context()
        self.receiver = Receiver(self.zmq_ctx, self.addresses.engine)
        self.sender = Sender(self.zmq_ctx, self.addresses.scheduler)
        self._send_lock = threading.Lock()
        self.rid_to_state: dict[str, ReqState] = {}
        self._control_waiters: dict[type, list[tuple[asyncio.AbstractEventLoop, asyncio.Future]]] = {}
        self.dead_error: str | None = None
        self._stopping = threading.Event()
        self.processes: dict[str, mp.Process] = {}
        self.scheduler_info: dict[str, Any] = {}
        self._launch()
        self._thread = threading.Thread(target=self._receive_loop, name="tokenloom-receiver", daemon=True)
        self._thread.start()

    # --- processes ----------------------------------------------------------------------------------
    def _launch(self) -> None:
        ctx = mp.get_context("spawn")
        pipes = {}
        targets = {
            "scheduler": (run_scheduler_process, (self.args, self.addresses)),
            "detokenizer": (run_detokenizer_process, (dataclasses.replace(self.source, gguf=None),
                                                      self.args.tokenizer_path, self.addresses)),
        }
        for name, (target, args) in targets.items():
            reader, writer = ctx.Pipe(duplex=False)
            extra = (self.args.log_level,) if name == "detokenizer" else ()
            proc = ctx.Process(target=target, args=(*args, writer, *extra), name=f"tokenloom-{name}", daemon=True)
            proc.start()
            writer.close()
            self.processes[name], pipes[name] = proc, reader
        try:
            for name, pipe in pipes.items():
                info = self._wait_ready(name, pipe)
                if name == "scheduler":
                    self.scheduler_info = info
        except Exception:
            self.shutdown()
            raise

    def _wait_ready(self, name: str, pipe: Any) -> dict[str, Any]:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        proc = self.processes[name]
        while time.monotonic() < deadline:
            if pipe.poll(0.2):
                try:
                    info = pipe.recv()
                except EOFError:
                    break
                if info.get("status") == "ready":
                    return info
                raise RuntimeError(f"{name} process failed to start: {info.get('error')}")
            if not proc.is_alive():
                break
        proc.join(timeout=2)
        if proc.exitcode is not None:
            raise RuntimeError(f"{name} process exited during startup (exit code {proc.exitcode}); see its log "
                               "above (a script using the Engine needs an `if __name__ == '__main__':` guard)")
        raise RuntimeError(f"{name} process did not start in {STARTUP_TIMEOUT_S} s")

    def shutdown(self) -> None:
        self._stopping.set()
        for proc in self.processes.values():
            if proc.is_alive():
                proc.terminate()
        for proc in self.processes.values():
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        self._fail_all("the engine was shut down")
        if hasattr(self, "_thread") and self._thread is not threading.current_thread():
            self._thread.join(timeout=2)
        self.receiver.close()
        self.sender.close()
        self.zmq_ctx.term()

    # --- receiving ----------------------------------------------------------------------------------
    def _receive_loop(self) -> None:
        last_check = time.monotonic()
        while not self._stopping.is_set():
            try:
                messages = self.receiver.recv_all(timeout_ms=100)
            except zmq.ZMQError:
                return
            for msg in messages:
                self._dispatch(msg)
            if time.monotonic() - last_check > CHILD_CHECK_S:
                last_check = time.monotonic()
                for name, proc in self.processes.items():
                    if not proc.is_alive() and not self._stopping.is_set():
                        self._mark_dead(f"the {name} process died (exit code {proc.exitcode})")

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, BatchStrOutput):
            for i, rid in enumerate(msg.rids):
                state = self.rid_to_state.get(rid)
                if state is None:
                    continue
                out = _response(msg, i, state)
                if out["meta_info"]["finish_reason"] is not None:
                    state.finished = True
                    self.rid_to_state.pop(rid, None)
                state.loop.call_soon_threadsafe(state.queue.put_nowait, out)
        elif isinstance(msg, ProcessFailed):
            self._mark_dead(f"the {msg.process} process failed: {msg.error}")
        elif isinstance(msg, FlushCacheReply | InternalStateReply):
            waiters = self._control_waiters.get(type(msg), [])
            if waiters:
                loop, future = waiters.pop(0)
                loop.call_soon_threadsafe(_resolve, future, msg)

    def _mark_dead(self, reason: str) -> None:
        if self.dead_error is None:
            self.dead_error = reason
            logger.error("tokenloom engine is dead: %s", reason)
        self._fail_all(reason)

    def _fail_all(self, reason: str) -> None:
        for state in list(self.rid_to_state.values()):
            state.loop.call_soon_threadsafe(state.queue.put_nowait, EngineDeadError(reason))
        self.rid_to_state.clear()
        for waiters in self._control_waiters.values():
            for loop, future in waiters:
                loop.call_soon_threadsafe(_fail, future, EngineDeadError(reason))
            waiters.clear()

    # --- requests -----------------------------------------------------------------------------------
    def _send(self, obj: Any) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(self.dead_error)
        with self._send_lock:
            self.sender.send(obj)

    def tokenize_request(self, text: str | None, input_ids: list[int] | None, sampling: dict[str, Any] | None,
                         rid: str | None = None, stream: bool = False, return_logprob: bool = False,
                         top_logprobs_num: int = 0, logprob_start_len: int = -1) -> TokenizedRequest:
        """Validate one request and tokenize it; raises ValueError with a client-facing message."""
        if text is None and input_ids is None:
            raise ValueError("Either text, input_ids or input_embeds should be provided.")
        if text is not None:
            if not isinstance(text, str):
                raise ValueError("text must be a string")
            if text == "":
                raise ValueError("text cannot be empty.")
            input_ids = self.tokenizer(text).input_ids
        if not input_ids:
            raise ValueError("input_ids cannot be empty.")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in input_ids):
            raise ValueError("input_ids must be a list of integers")
        bad = [t for t in input_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"input_ids contain token id {bad[0]} outside the vocabulary [0, {self.vocab_size})")
        params = SamplingParams.from_dict(sampling, self.vocab_size)
        self._check_length(len(input_ids), params)
        if not isinstance(top_logprobs_num, int) or top_logprobs_num < 0:
            raise ValueError("top_logprobs_num must be a non-negative integer")
        return TokenizedRequest(rid=rid or uuid.uuid4().hex, input_text=text, input_ids=list(input_ids),
                                sampling_params=params, stream=stream, return_logprob=return_logprob,
                                logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
                                arrival_time=time.time())

    def _check_length(self, n: int, params: SamplingParams) -> None:
        if n >= self.context_len:
            raise ValueError(f"The input ({n} tokens) is longer than the model's context length "
                             f"({self.context_len} tokens).")
        limit = self.scheduler_info.get("max_req_input_len")
        if limit is not None and n > limit:
            raise ValueError(f"The input ({n} tokens) is longer than the KV cache can hold for one request "
                             f"({limit} tokens).")
        if params.max_new_tokens is not None and n + params.max_new_tokens >= self.context_len:
            raise ValueError(
                f"Requested token count exceeds the model's maximum context length of {self.context_len} tokens. "
                f"You requested a total of {n + params.max_new_tokens} tokens: {n} tokens from the input messages "
                f"and {params.max_new_tokens} tokens for the completion. Please reduce the number of tokens in "
                f"the input messages or the completion to fit within the limit.")

    async def generate_request(self, req: TokenizedRequest) -> AsyncIterator[dict[str, Any]]:
        """Yield outputs of one request (every one when streaming, else only the final one)."""
        if req.rid in self.rid_to_state:
            raise ValueError(f"Duplicate request id {req.rid!r}")
        state = ReqState(req.rid, asyncio.get_running_loop(), asyncio.Queue())
        self.rid_to_state[req.rid] = state
        try:
            self._send(req)
            while True:
                item = await state.queue.get()
                if isinstance(item, Exception):
                    raise item
                if req.stream or item["meta_info"]["finish_reason"] is not None:
                    yield item
                if item["meta_info"]["finish_reason"] is not None:
                    return
        finally:
            if not state.finished and self.rid_to_state.pop(req.rid, None) is not None:
                self.abort(req.rid)

    def abort(self, rid: str, message: str = "Aborted by the client.") -> None:
        if self.dead_error is None:
            self._send(AbortRequest(rid, message))

    async def _control(self, request: Any, reply_type: type) -> Any:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._control_waiters.setdefault(reply_type, []).append((loop, future))
        self._send(request)
        return await future

    async def flush_cache(self) -> FlushCacheReply:
        return await self._control(FlushCacheRequest(), FlushCacheReply)

    async def get_internal_state(self) -> dict[str, Any]:
        return (await self._control(GetInternalStateRequest(), InternalStateReply)).state


def _response(msg: BatchStrOutput, i: int, state: ReqState) -> dict[str, Any]:
    meta = dict(msg.meta[i])
    meta["finish_reason"] = msg.finished_reasons[i]
    if msg.finished_reasons[i] is not None:
        meta["e2e_latency"] = time.perf_counter() - state.created
    return {"text": msg.texts[i], "output_ids": msg.output_ids[i], "meta_info": meta}


def _resolve(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _fail(future: asyncio.Future, error: Exception) -> None:
    if not future.done():
        future.set_exception(error)
