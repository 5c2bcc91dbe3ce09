"""Messages between the engine/server process, the scheduler and (with --detokenizer-process) the detokenizer
process, pickled over ZMQ.

The chain of a request: `GenerateRequest` (HTTP body / Engine arguments, validated in the tokenizer manager)
→ `TokenizedRequest` (engine → scheduler) → `Req` (scheduler state) → `ScheduleBatch` → `ForwardBatch`
→ `ForwardOutput` → `BatchTokenOutput` (scheduler → detokenizer: by default the engine's receive thread)
→ `BatchStrOutput` (detokenizer → engine: in the same thread by default) → `ReqState` → response.

Control messages (`AbortRequest`, `FlushCacheRequest`, `GetInternalStateRequest`, `StartProfileRequest`,
`StopProfileRequest`) travel engine → scheduler (every rank, the way requests do); their replies travel
scheduler → (a detokenizer process forwards them unchanged) → engine (the entry rank's only). `TransferEvent`s
(prefill/decode disaggregation) travel from the entry rank's transfer agent into its own scheduler inbox, then the path
requests take to every rank, so all ranks act on them at the same iteration. `GrammarDecision`s (TP, PP) are
the entry rank's own: it appends them to the message list it shares, so every rank admits or refuses a request
that waited for its grammar at the same iteration.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenloom.sampling.sampling_params import SamplingParams

# SGLang's bootstrap host for requests that need no peer (warm-up, health checks): served without a transfer.
FAKE_BOOTSTRAP_HOST = "2.2.2.2"


@dataclass(frozen=True)
class Bootstrap:
    """Where a disaggregated request's prefill server is (`bootstrap_host`, `bootstrap_port`) and the room
    (a 63-bit id the router draws) both servers know the request by."""

    host: str
    port: int
    room: int

    @property
    def is_fake(self) -> bool:
        return self.host == FAKE_BOOTSTRAP_HOST


@dataclass
class TransferEvent:
    """A room's transfer moved on (agent → scheduler). Prefill side: "ready" (every decode rank sent where
    its KV goes), "sent" (every prefill rank finished writing), "failed". Decode side: "bootstrapped" (the
    prefill's layout is known and compatible), "arrived" (every decode rank holds its KV and metadata),
    "failed". `detail`: the reason of a failure."""

    room: int
    kind: str
    detail: str = ""
    data: Any = None  # "bootstrapped": the prefill server's layout (its bootstrap answer), the same for every rank


@dataclass
class GrammarDecision:
    """Entry rank → every rank of a TP/PP server, in the shared message list (scheduler/grammar_sync.py): the
    requests whose grammar compiled on the entry rank (`ready`: every rank admits them, each with its own
    compile of the same grammar) and those refused (`failed`: (rid, reason), a failed compile or
    --grammar-compile-timeout; a 400 on every rank)."""

    ready: tuple[str, ...] = ()
    failed: tuple[tuple[str, str], ...] = ()


@dataclass
class TokenizedRequest:
    rid: str
    input_text: str | None
    input_ids: list[int]
    sampling_params: SamplingParams
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1  # with return_logprob: prompt logprobs from this position on; -1: none
    top_logprobs_num: int = 0
    arrival_time: float = 0.0
    token_ids_logprob: list[int] | None = None  # with return_logprob: logprobs of these ids at every position
    bootstrap: Bootstrap | None = None  # prefill/decode disaggregation: the pair's room (None on a unified server)


# The rids the HTTP server gives its own requests: /health probes and the start-up warm-up. Metrics, request
# logs and step logs leave them out.
HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK_"
WARMUP_RID_PREFIX = "WARMUP_"


@dataclass
class RequestAccepted:
    """Scheduler → (detokenizer, forwarded) → TokenizerManager: a streaming request passed the scheduler's
    checks and is queued (a refused one gets its finished abort output instead), so its HTTP answer can start
    as a 200 stream before the first token, and a refusal can still be an HTTP error status."""

    rid: str


@dataclass
class AbortRequest:
    rid: str
    message: str = "Aborted by the client."


@dataclass
class FlushCacheRequest:
    pass


@dataclass
class FlushCacheReply:
    success: bool
    message: str


@dataclass
class GetInternalStateRequest:
    pass


@dataclass
class InternalStateReply:
    state: dict[str, Any]


@dataclass
class StartProfileRequest:
    """/start_profile, checked by the tokenizer manager (scheduler/profiler.py `start_profile_request`): every
    rank records a torch.profiler trace into `output_dir` (one file per rank, named with `profile_id` and the
    rank), from after `start_step` steps since start (None: now), for `num_steps` steps (None: until
    `StopProfileRequest`)."""

    output_dir: str
    profile_id: str
    num_steps: int | None = None
    start_step: int | None = None
    activities: tuple[str, ...] = ("CPU",)
    with_stack: bool = True
    record_shapes: bool = False
    profile_prefix: str = ""


@dataclass
class StopProfileRequest:
    pass


@dataclass
class ProfileReply:
    """Whether a start or stop was done; `message` says what happened (where the traces are) or why not."""

    success: bool
    message: str


@dataclass
class BatchTokenOutput:
    """New tokens of some requests since their last output, plus finish information.

    Per request i: `new_token_ids[i]` (may be empty for a finish-only message), `finished_reasons[i]`
    (None while running; a dict shaped like SGLang's finish_reason otherwise), and `meta[i]` with
    prompt_tokens, completion_tokens, cached_tokens, total_retractions (and logprob lists when asked:
    output ones per message for its new tokens, prompt ones once, in the first message after the prefill).
    """

    rids: list[str]
    new_token_ids: list[list[int]]
    finished_reasons: list[dict[str, Any] | None]
    meta: list[dict[str, Any]]
    # Detokenization options per request (the detokenizer has no other copy of the sampling params).
    skip_special_tokens: list[bool] = field(default_factory=list)
    stop_strings: list[list[str]] = field(default_factory=list)
    no_stop_trim: list[bool] = field(default_factory=list)


@dataclass
class BatchStrOutput:
    """Cumulative text and output ids of some requests (what the client sees so far)."""

    rids: list[str]
    texts: list[str]
    output_ids: list[list[int]]
    finished_reasons: list[dict[str, Any] | None]
    meta: list[dict[str, Any]]


@dataclass
class ProcessFailed:
    """A child process hit an unrecoverable error; sent before it exits so callers fail fast."""

    process: str
    error: str
