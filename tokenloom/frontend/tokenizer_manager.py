"""`TokenizerManager`: the engine/server side of the runtime. It is handed the processes behind it (a
`RuntimeProcesses`: the scheduler ranks, the detokenizer with --detokenizer-process, and on a prefill server
the bootstrap service; the entry points build them, entrypoints/runtime.py) and starts them; it validates and
tokenizes requests, sends them to the scheduler's entry rank, and routes outputs coming back to the waiting
caller (one `ReqState` per request id, frontend/request_state.py).

Detokenizing: by default the scheduler's token outputs come straight here and the receiver thread turns them
into text (`DetokenizerManager`, frontend/detokenizer.py); with --detokenizer-process a process of its own
does that (SGLang's layout) and text arrives. On a CPU the server's processes share the cores the forward
runs on, and every process hop of a streamed token costs wake-ups and cold caches there: the hop saved made a
batch-1 token ~4% faster on two cores (bench/ab_serve.py). A batch whose detokenization raises fails its own
requests (`DetokenizeError`: HTTP 500, or a stream's closing error event) and aborts them; the thread goes on.

Threads: a receiver thread reads the incoming socket and hands each output to the caller's asyncio loop
(`call_soon_threadsafe`), so the same manager serves a private loop (Engine.generate) and any user loop
(async_generate). The HTTP server's loop takes the socket over for its lifetime (`receive_on_loop`,
frontend/socket_reader.py) and puts outputs into its requests' queues directly: a wake-up and a thread switch
fewer per streamed token. The receiver thread also watches the children (`runtime.dead()`): if one
dies (a scheduler rank is named by rank, e.g. "scheduler rank 1 (tp 1, pp 0)"), every pending
request fails with a clear error (a rank's own report of why it failed, a `ProcessFailed` sent before it
exits, wins over its exit code: an exit waits a moment for it), new requests are refused, and `on_dead` (if
set; the HTTP server sets it to exit non-zero) is called once, from the receiver thread (or, for a failure
reported to the HTTP server's loop, from a thread of its own: naming the dead rank waits, and stopping the
ranks blocks).

Request lifecycle: `generate_request` registers a `ReqState`, sends the `TokenizedRequest`, yields outputs
until one carries a finish reason, and removes the state. If the caller goes away first (cancelled task,
closed stream), the request is aborted so its KV is freed. Logprobs are accumulated per request
(`LogprobAccumulator`), so every output carries all of them so far in SGLang's shape. An abort the client
asked for (`abort`) finishes with a finish reason without a status code, so callers return it as a normal
response; scheduler-side aborts keep theirs (400/503/500).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import multiprocessing as mp
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import zmq

from tokenloom.config import ServerArgs
from tokenloom.disaggregation.bootstrap_fields import bootstraps_for
from tokenloom.frontend.batch_fields import batch_rids, check_logprob_start_len, common_n, per_prompt_token_ids
from tokenloom.frontend.detokenizer import DetokenizerManager
from tokenloom.frontend.logprob_accumulator import LogprobAccumulator
from tokenloom.frontend.request_log import log_finished, log_received
from tokenloom.frontend.request_metrics import ServingMetrics
from tokenloom.frontend.request_state import ReqState
from tokenloom.frontend.socket_reader import SocketReader
from tokenloom.grammar.spec import GrammarSpec, spec_from_params, validate_spec
from tokenloom.ipc import IpcAddresses, Receiver, Sender
from tokenloom.models.loader import ModelSource
from tokenloom.protocol import (
    AbortRequest,
    BatchStrOutput,
    BatchTokenOutput,
    FlushCacheReply,
    FlushCacheRequest,
    GetInternalStateRequest,
    InternalStateReply,
    ProcessFailed,
    ProfileReply,
    RequestAccepted,
    StopProfileRequest,
    TokenizedRequest,
)
from tokenloom.sampling.sampling_params import SamplingParams
from tokenloom.sampling.stopping import new_token_room
from tokenloom.scheduler.profiler import start_profile_request
from tokenloom.tokenizer import TokenizerLoad, longest_token_chars, read_chat_template

logger = logging.getLogger(__name__)

CHILD_CHECK_S = 0.5
DEAD_PEER_WAIT_S = 1.0
ACCEPTED: Any = {"accepted": True}  # `generate_request`'s marker: the scheduler queued the streaming request
MAX_TOKEN_IDS_LOGPROB = 256  # each id adds a logprob per scored position to the answer


class DetokenizeError(RuntimeError):
    """A request's output could not be turned into text (a bug, not the client's fault: HTTP 500)."""


class EngineDeadError(RuntimeError):
    """A runtime process died; the engine cannot serve any more requests."""


class RuntimeProcesses(Protocol):
    """The processes behind a tokenizer manager, built by the entry point over the same `IpcAddresses`."""

    processes: dict[str, mp.Process]  # by name ("scheduler", "scheduler1", ..., "detokenizer"), filled as they start

    def start(self) -> dict[str, Any]:
        """Start every process and wait until the scheduler ranks are ready; their capacities (rank 0's)."""

    def dead(self) -> str | None:
        """What died or hung ("scheduler rank 1 (tp 1, pp 0) exited with code -9"), or None."""

    def dead_besides(self, name: str) -> list[str]:
        """The processes other than `name` that are dead, each described as `dead` does."""

    def stop_all(self, clean: bool = False) -> None:
        """Stop every process still running (`clean`: a deliberate shutdown, not a failure); idempotent."""


class TokenizerManager:
    def __init__(self, args: ServerArgs, source: ModelSource, addresses: IpcAddresses,
                 runtime: RuntimeProcesses) -> None:
        """`runtime` is started here, after this side's sockets are bound (`addresses`); if it fails to
        start, what started is stopped and the error raised."""
        self.args = args
        self.source = source
        # The tokenizer loads (seconds of CPU: transformers' imports) while the children start, not before them.
        loading = TokenizerLoad(source, args.tokenizer_path)
        self.context_len = self.source.config.context_length
        self.vocab_size = self.source.config.vocab_size
        # tokenizing (and chat templates) run here, off the HTTP event loop (the tokenizer releases the GIL)
        self.tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="tokenloom-tokenize")
        self._valid_grammars: OrderedDict[GrammarSpec, None] = OrderedDict()  # specs that parsed (tokenize thread)
        self.addresses = addresses
        self.zmq_ctx = zmq.Context()
        self.receiver = Receiver(self.zmq_ctx, self.addresses.engine)
        self.reader = SocketReader(self.receiver)  # the receiver thread's, or a loop's (`receive_on_loop`)
        self.sender = Sender(self.zmq_ctx, self.addresses.scheduler)
        self._send_lock = threading.Lock()
        self.rid_to_state: dict[str, ReqState] = {}
        self._control_waiters: dict[type, list[tuple[asyncio.AbstractEventLoop, asyncio.Future]]] = {}
        self.dead_error: str | None = None
        self._stopping = threading.Event()
        self._failure_reported = threading.Event()  # a ProcessFailed arrived (it, not an exit code, names why)
        self.runtime = runtime
        self.processes = runtime.processes  # filled as they start
        self.scheduler_info: dict[str, Any] = {}
        self.on_dead: Callable[[str], None] | None = None
        self.last_output_time = 0.0  # time.monotonic() of the last output from the runtime
        self.metrics = ServingMetrics(args.enable_metrics)  # /metrics (frontend/request_metrics.py)
        self._launch()
        try:
            self.tokenizer = loading.result()
            if args.chat_template:
                self.tokenizer.chat_template = read_chat_template(args.chat_template)
        except BaseException:
            self.shutdown()
            raise
        self.max_prompt_chars = self.context_len * longest_token_chars(self.tokenizer)
        # without --detokenizer-process the scheduler's token outputs come here and the receive thread
        # detokenizes them: one process hop and its wake-ups fewer per streamed token
        self.detokenizer = None if args.detokenizer_process else DetokenizerManager(self.tokenizer)
        self._thread = threading.Thread(target=self._receive_loop, name="tokenloom-receiver", daemon=True)
        self._thread.start()

    # --- processes ----------------------------------------------------------------------------------
    def _launch(self) -> None:
        try:
            self.scheduler_info = self.runtime.start()
        except BaseException:
            self.shutdown()
            raise

    def shutdown(self) -> None:
        """Stop the children and close the sockets; idempotent."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self.runtime.stop_all(clean=self.dead_error is None)
        self._fail_all("the engine was shut down")
        if hasattr(self, "tokenize_pool"):
            self.tokenize_pool.shutdown(wait=False, cancel_futures=True)
        if hasattr(self, "_thread") and self._thread is not threading.current_thread():
            self._thread.join(timeout=2)
        self.receiver.close()
        self.sender.close()
        self.zmq_ctx.term()

    # --- receiving ----------------------------------------------------------------------------------
    def _receive_loop(self) -> None:
        """The receiver thread: reads the incoming socket unless a loop took it over, and watches the
        children either way."""
        last_check = time.monotonic()
        while not self._stopping.is_set():
            try:
                self.reader.read_on_thread(100, self._dispatch)
            except zmq.ZMQError:
                return
            if time.monotonic() - last_check > CHILD_CHECK_S:
                last_check = time.monotonic()
                reason = self.runtime.dead()
                if reason is None or self._stopping.is_set() or self._report_follows():
                    continue
                if not self._stopping.is_set():  # a shutdown while waiting for the report is no failure
                    self._mark_dead(f"the {reason}")

    def _report_follows(self) -> bool:
        """A child has exited: whether a ProcessFailed arrives within DEAD_PEER_WAIT_S (a rank reports why before
        it exits, e.g. that a peer stopped responding; the loop may hold the report unread); reads meanwhile."""
        deadline = time.monotonic() + DEAD_PEER_WAIT_S
        while not self._failure_reported.is_set() and not self._stopping.is_set() and time.monotonic() < deadline:
            self.reader.read_on_thread(50, self._dispatch)
        return self._failure_reported.is_set()

    def receive_on_loop(self) -> None:
        """From now on the running event loop (the HTTP server's) receives the runtime's outputs and puts each
        in its request's queue itself (socket_reader.py says why); `receive_on_thread` hands them back."""
        self.reader.move_to_loop(asyncio.get_running_loop(), self._dispatch)

    def receive_on_thread(self) -> None:
        """The receiver thread receives again (the loop that `receive_on_loop` gave them to is stopping)."""
        self.reader.move_to_thread()

    def _deliver(self, state: ReqState, item: Any) -> None:
        """`item` into the request's queue (only `_dispatch` delivers: it runs on the reader's loop while one
        reads, else on the receiver thread): directly when that is the request's loop, else through it."""
        if state.loop is self.reader.loop:
            state.queue.put_nowait(item)
        else:
            state.loop.call_soon_threadsafe(state.queue.put_nowait, item)

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, BatchTokenOutput):
            msg = self._detokenize(msg)
        if isinstance(msg, BatchStrOutput):
            self.last_output_time = time.monotonic()
            for i, rid in enumerate(msg.rids):
                state = self.rid_to_state.get(rid)
                if state is None:
                    continue
                out = state.response(msg, i)
                if out["meta_info"]["finish_reason"] is not None:
                    state.finished = True
                    self.rid_to_state.pop(rid, None)
                self._deliver(state, out)
        elif isinstance(msg, RequestAccepted):
            state = self.rid_to_state.get(msg.rid)
            if state is not None:
                self._deliver(state, ACCEPTED)
        elif isinstance(msg, ProcessFailed):
            self._failure_reported.set()
            if self.reader.loop is not None:  # naming the dead rank waits and stopping the ranks blocks: not on a loop
                threading.Thread(target=lambda: self._mark_dead(self._failure_reason(msg)), daemon=True).start()
            else:
                self._mark_dead(self._failure_reason(msg))
        elif isinstance(msg, FlushCacheReply | InternalStateReply | ProfileReply):
            waiters = self._control_waiters.get(type(msg), [])
            if waiters:
                loop, future = waiters.pop(0)
                loop.call_soon_threadsafe(_resolve, future, msg)

    def _detokenize(self, msg: BatchTokenOutput) -> BatchStrOutput | None:
        """The text of the scheduler's token outputs (no --detokenizer-process). A batch whose detokenization
        raises fails its own requests with the error; the thread and every other request go on."""
        try:
            return self.detokenizer.handle(msg)
        except Exception as e:  # noqa: BLE001 - reported to the requests it belongs to
            logger.exception("detokenizing outputs of %d request(s) failed", len(msg.rids))
            for rid, finished in zip(msg.rids, msg.finished_reasons, strict=True):
                self.detokenizer.states.pop(rid, None)
                state = self.rid_to_state.pop(rid, None)
                if state is None:
                    continue
                state.finished = True
                self._deliver(state, DetokenizeError(f"detokenizing the output failed: {e}"))
                if finished is None and self.dead_error is None:  # still running: free its KV
                    self._send(AbortRequest(rid, "detokenizing the output failed"))
            return None

    def _failure_reason(self, msg: ProcessFailed) -> str:
        """With several ranks, a rank that died makes its peers fail in their next collective; name the
        dead one first (it has exited by the time a peer's report arrives; allow a moment for the OS)."""
        if self.args.tp_size * self.args.pp_size > 1 and msg.process.startswith("scheduler"):
            deadline = time.monotonic() + DEAD_PEER_WAIT_S
            while True:
                dead = self.runtime.dead_besides(msg.process)
                if dead or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            if dead:
                return f"the {'; the '.join(dead)}; then {msg.process} failed: {msg.error}"
        return f"the {msg.process} process failed: {msg.error}"

    def _mark_dead(self, reason: str) -> None:
        first = self.dead_error is None
        if first:
            self.dead_error = reason
            logger.error("tokenloom engine is dead: %s", reason)
        self._fail_all(reason)  # answer first: stopping a hung rank takes the runtime's grace period
        if first and self.args.tp_size * self.args.pp_size > 1:
            self.runtime.stop_all()  # the other ranks would wait forever in their collectives
        if first and self.on_dead is not None:
            self.on_dead(reason)

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
                         top_logprobs_num: int = 0, logprob_start_len: int = -1,
                         token_ids_logprob: list[int] | None = None) -> TokenizedRequest:
        """Validate one request and tokenize it; raises ValueError with a client-facing message."""
        if text is None and input_ids is None:
            raise ValueError("Either text, input_ids or input_embeds should be provided.")
        if text is not None:
            if not isinstance(text, str):
                raise ValueError("text must be a string")
            if text == "":
                raise ValueError("text cannot be empty.")
            if len(text) > self.max_prompt_chars:  # refused without tokenizing it (seconds for megabytes)
                raise ValueError(f"The input ({len(text)} characters) is longer than the model's context length "
                                 f"({self.context_len} tokens) could hold whatever its tokenization.")
            input_ids = self.tokenizer(text).input_ids
        if not input_ids:
            raise ValueError("input_ids cannot be empty.")
        if not isinstance(input_ids, list):
            raise ValueError("input_ids must be a list of integers")
        self._check_input_len(len(input_ids))  # before any per-token work
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in input_ids):
            raise ValueError("input_ids must be a list of integers")
        bad = [t for t in input_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"input_ids contain token id {bad[0]} outside the vocabulary [0, {self.vocab_size})")
        params = SamplingParams.from_dict(sampling, self.vocab_size)
        self._check_length(len(input_ids), params)
        if params.has_grammar:
            self._check_grammar(params)
        if not isinstance(top_logprobs_num, int) or top_logprobs_num < 0:
            raise ValueError("top_logprobs_num must be a non-negative integer")
        check_logprob_start_len(logprob_start_len)
        if return_logprob and logprob_start_len >= len(input_ids):
            raise ValueError(f"logprob_start_len ({logprob_start_len}) must be smaller than the number of input "
                             f"tokens ({len(input_ids)}). Please use a smaller logprob_start_len.")
        token_ids_logprob = self._check_token_ids(token_ids_logprob)
        return TokenizedRequest(rid=rid or uuid.uuid4().hex, input_text=text, input_ids=list(input_ids),
                                sampling_params=params, stream=stream, return_logprob=return_logprob,
                                logprob_start_len=logprob_start_len if return_logprob else -1,
                                top_logprobs_num=top_logprobs_num, arrival_time=time.time(),
                                token_ids_logprob=token_ids_logprob if return_logprob else None)

    def _check_grammar(self, params: SamplingParams) -> None:
        """A request's grammar parses (a 400 naming the problem otherwise, before anything is queued); the
        scheduler compiles it against the vocabulary off its critical path. Specs that passed are remembered."""
        if self.args.grammar_backend == "none":
            raise ValueError("constrained decoding (json_schema, regex, ebnf, structural_tag, response_format) is "
                             "off: the server runs with --grammar-backend none")
        spec = spec_from_params(params.json_schema, params.regex, params.ebnf, params.structural_tag)
        if spec.kind == "structural_tag" and self.args.grammar_backend != "xgrammar":
            raise ValueError("structural_tag needs --grammar-backend xgrammar")
        if spec in self._valid_grammars:
            self._valid_grammars.move_to_end(spec)
            return
        validate_spec(spec)  # a grammar that does not parse is named as such, whatever the backend
        if spec.kind == "ebnf" and self.args.grammar_backend == "outlines":
            raise ValueError("ebnf needs --grammar-backend xgrammar or llguidance (outlines compiles JSON schemas "
                             "and regexes)")
        self._valid_grammars[spec] = None
        if len(self._valid_grammars) > 1024:
            self._valid_grammars.popitem(last=False)

    async def off_loop(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)` on the tokenizing thread (validation and tokenization of a request: a long
        prompt takes a while, and the event loop must keep serving meanwhile); its exceptions propagate."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool,
                                                                functools.partial(fn, *args, **kwargs))

    def _check_token_ids(self, token_ids: Any) -> list[int] | None:
        if token_ids is None:
            return None
        if not isinstance(token_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                      for t in token_ids):
            raise ValueError("token_ids_logprob must be a list of token ids (or one such list per prompt)")
        if len(token_ids) > MAX_TOKEN_IDS_LOGPROB:
            raise ValueError(f"token_ids_logprob may list at most {MAX_TOKEN_IDS_LOGPROB} token ids, got "
                             f"{len(token_ids)}")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token_ids_logprob contains token id {bad[0]} outside the vocabulary "
                             f"[0, {self.vocab_size})")
        return list(token_ids)

    def tokenize_batch(self, text: Any, input_ids: Any, sampling_params: Any = None, rid: Any = None, *,
                       stream: bool = False, return_logprob: bool = False, top_logprobs_num: int = 0,
                       logprob_start_len: int = -1, token_ids_logprob: Any = None,
                       bootstrap: tuple[Any, Any, Any] = (None, None, None)
                       ) -> tuple[list[TokenizedRequest], bool]:
        """Validate and tokenize a `/generate`-shaped input (one prompt or a batch; text wins over
        input_ids). `n > 1` expands each prompt n times, prompt-major. `token_ids_logprob` is one list of
        ids for every prompt, or for a batch one list per prompt. Returns the requests and whether the
        answer is a list. `bootstrap`: the body's (bootstrap_host, bootstrap_port, bootstrap_room), required on a
        disaggregated server (disaggregation/bootstrap_fields.py). Raises ValueError with a client-facing
        message before anything is sent."""
        if text is not None:
            is_batch = isinstance(text, list)
            texts, ids_list = (text if is_batch else [text]), None
        elif input_ids is not None:
            if not isinstance(input_ids, list):
                raise ValueError("input_ids must be a list of token ids, or a list of such lists for a batch")
            is_batch = bool(input_ids) and isinstance(input_ids[0], list)
            ids_list, texts = (input_ids if is_batch else [input_ids]), None
        else:
            raise ValueError("Either text, input_ids or input_embeds should be provided.")
        count = len(texts if texts is not None else ids_list)
        if count == 0:
            raise ValueError("The prompt list is empty.")
        params = self._batch_params(sampling_params, count, is_batch)
        rids = batch_rids(rid, count, is_batch)
        n = common_n(params)
        self._check_fan_out(count, n)
        check_logprob_start_len(logprob_start_len)
        token_ids = per_prompt_token_ids(token_ids_logprob, count, is_batch)
        rooms = bootstraps_for(self.args.disaggregation_mode, *bootstrap, count, n)
        top_max = min(self.args.max_logprobs, self.vocab_size)
        if not isinstance(top_logprobs_num, int) or isinstance(top_logprobs_num, bool) or \
                not 0 <= top_logprobs_num <= top_max:
            raise ValueError(f"top_logprobs_num must be an integer in [0, {top_max}] (--max-logprobs), "
                             f"got {top_logprobs_num!r}")
        reqs = []
        for i in range(count):
            for copy in range(n):
                this_rid = rids[i] if n == 1 or rids[i] is None else f"{rids[i]}-{copy}"
                reqs.append(self.tokenize_request(
                    texts[i] if texts is not None else None, ids_list[i] if ids_list is not None else None,
                    {**params[i], "n": 1}, rid=this_rid, stream=stream, return_logprob=bool(return_logprob),
                    top_logprobs_num=top_logprobs_num, logprob_start_len=logprob_start_len,
                    token_ids_logprob=token_ids[i]))
                reqs[-1].bootstrap = rooms[i]
        given = [r for r in rids if r is not None]
        duplicate = next((r.rid for r in reqs if r.rid in self.rid_to_state), None)
        if len(set(given)) != len(given) or duplicate is not None:
            raise ValueError(f"Duplicate request id {duplicate or given!r}")
        return reqs, is_batch or n > 1

    def _batch_params(self, sampling_params: Any, count: int, is_batch: bool) -> list[dict[str, Any]]:
        if isinstance(sampling_params, list):
            if not is_batch:
                raise ValueError("sampling_params must be an object for a single prompt")
            if len(sampling_params) != count:
                raise ValueError(f"Got {len(sampling_params)} sampling_params for {count} prompts")
            params = sampling_params
        else:
            params = [sampling_params] * count
        if not all(p is None or isinstance(p, dict) for p in params):
            raise ValueError("sampling_params must be an object (or a list of objects, one per prompt)")
        return [dict(p or {}) for p in params]

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **template_options: Any) -> tuple[str, list[int]]:
        """The model's chat template, by default with the generation prompt appended: (prompt text, token
        ids). `template_options` go to the template renderer (continue_final_message, documents, and the
        variables a template reads, e.g. enable_thinking)."""
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt, **template_options)
        except Exception as e:  # noqa: BLE001 - template errors (no template, bad roles) are client-facing
            raise ValueError(f"Cannot apply the model's chat template: {e}") from None
        return text, self.tokenizer(text, add_special_tokens=False).input_ids

    def token_texts(self, token_ids: list[int]) -> list[str]:
        """Each token decoded on its own (the token strings of logprob listings)."""
        return [self.tokenizer.decode([t]) for t in token_ids]

    def _check_fan_out(self, prompts: int, n: int) -> None:
        """A request of `prompts` × `n` generations that the server could never take at once is refused now
        instead of being queued piecemeal until the queue overflows: with --max-queued-requests, its
        generations arrive together in the waiting queue, so more than that many can never all be admitted."""
        queued = self.args.max_queued_requests
        if queued is not None and prompts * n > queued:
            raise ValueError(f"This request asks for {prompts * n} generations ({prompts} prompt(s) × n={n}); "
                             f"the server queues at most {queued} requests (--max-queued-requests).")

    def _check_input_len(self, n: int) -> None:
        if n >= self.context_len:
            raise ValueError(f"The input ({n} tokens) is longer than the model's context length "
                             f"({self.context_len} tokens).")
        limit = self.scheduler_info.get("max_req_input_len")
        if limit is not None and n > limit:
            raise ValueError(f"The input ({n} tokens) is longer than the KV cache can hold for one request "
                             f"({limit} tokens).")

    def _check_length(self, n: int, params: SamplingParams) -> None:
        """Prompt plus max_new_tokens within the context (a 400, as vLLM answers); the KV pool clamps
        max_new_tokens instead (the scheduler, as SGLang). Both measure the room with `new_token_room`."""
        self._check_input_len(n)
        if params.max_new_tokens is not None and params.max_new_tokens > new_token_room(n, self.context_len):
            raise ValueError(
                f"Requested token count exceeds the model's maximum context length of {self.context_len} tokens. "
                f"You requested a total of {n + params.max_new_tokens} tokens: {n} tokens from the input messages "
                f"and {params.max_new_tokens} tokens for the completion. Please reduce the number of tokens in "
                f"the input messages or the completion to fit within the limit.")

    async def generate_request(self, req: TokenizedRequest, announce_acceptance: bool = False
                               ) -> AsyncIterator[dict[str, Any]]:
        """Yield outputs of one request (every one when streaming, else only the final one). With
        `announce_acceptance`, a streaming request first yields `ACCEPTED` once the scheduler has queued it
        (a refused one yields its finished output instead)."""
        if req.rid in self.rid_to_state:
            raise ValueError(f"Duplicate request id {req.rid!r}")
        logprobs = LogprobAccumulator(req.return_logprob and req.logprob_start_len >= 0, req.top_logprobs_num > 0,
                                      req.token_ids_logprob)
        state = ReqState(req.rid, asyncio.get_running_loop(), asyncio.Queue(), logprobs=logprobs)
        self.rid_to_state[req.rid] = state
        log_received(self.args, req)  # --log-requests only (frontend/request_log.py)
        timer = self.metrics.track(req.rid, req.stream)
        try:
            self._send(req)
            while True:
                item = await state.queue.get()
                if isinstance(item, Exception):
                    raise item
                if item is ACCEPTED:
                    if announce_acceptance:
                        yield item
                    continue
                timer.on_output(item)  # the final one closes the request's metrics
                if item["meta_info"]["finish_reason"] is not None:
                    log_finished(self.args, req, item)
                    yield item
                    return
                if req.stream:
                    yield item
        finally:
            if not state.finished and self.rid_to_state.pop(req.rid, None) is not None:
                timer.on_abandoned()
                log_finished(self.args, req, None)
                self.abort(req.rid)

    def abort(self, rid: str, message: str = "Aborted by the client.") -> None:
        state = self.rid_to_state.get(rid)
        if state is not None:
            state.aborted_by_client = True
        if self.dead_error is None:
            self._send(AbortRequest(rid, message))

    def abort_all(self, message: str = "Aborted by the client.") -> None:
        for rid in list(self.rid_to_state):
            self.abort(rid, message)

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

    async def start_profile(self, **options: Any) -> ProfileReply:
        """SGLang's start_profile (`options`: /start_profile's body fields, scheduler/profiler.py): every rank
        starts a torch.profiler trace; ValueError naming an option this server cannot honour."""
        return await self._control(start_profile_request(self.args.device, **options), ProfileReply)

    async def stop_profile(self) -> ProfileReply:
        """End the profile started by `start_profile`; every rank writes its trace."""
        return await self._control(StopProfileRequest(), ProfileReply)


def _resolve(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _fail(future: asyncio.Future, error: Exception) -> None:
    if not future.done():
        future.set_exception(error)
