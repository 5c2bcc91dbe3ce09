"""The start-up summary a server logs at INFO once its runtime is ready (before it binds and warms up):

    Model: /models/smollm2 (LlamaForCausalLM), bfloat16, 134.5M parameters (kept quantized: Q4_1 x 210,
        Q8_0 x 1), weights loaded in 2.1 s
    Memory: weights 0.25 GiB, KV pool 1.50 GiB (2000000 tokens), 64 request slots, huge pages 1.70 GiB
        (THP madvise)
    Device: cpu (AVX512-BF16: yes, AMX: no), 2 threads per rank, TP 1 x PP 1 on 1 node
    Server args: model_path=None, ..., api_key='<redacted>', ...

The numbers come from the entry rank's ready message (scheduler/rank_report.py); at TP/PP > 1 they are that
rank's share, and the lines say so. The API key never appears (`public_server_args` redacts it).
"""

from __future__ import annotations

import logging
from typing import Any

from tokenloom.config import ServerArgs
from tokenloom.entrypoints.http_server import public_server_args
from tokenloom.models.load_progress import format_count

logger = logging.getLogger("tokenloom.server")


def startup_summary(args: ServerArgs, model_path: str, architecture: str, info: dict[str, Any]) -> list[str]:
    """The summary's lines. `info`: the entry rank's ready message (fields it lacks show as '?')."""
    world = args.tp_size * args.pp_size
    share = " (rank 0's share)" if world > 1 else ""
    params = info.get("num_parameters")
    features = info.get("cpu_features") or {}
    return [
        f"Model: {model_path} ({architecture}), {info.get('model_dtype', '?')}, "
        f"{format_count(params) if params is not None else '?'} parameters{share}"
        f"{_quantized(info.get('weight_quantization'))}, weights loaded in "
        f"{_number(info.get('weight_load_s'), '.1f')} s",
        f"Memory{share}: weights {_gigabytes(info.get('weight_bytes'))}, KV pool "
        f"{_gigabytes(info.get('kv_pool_bytes'))} ({info.get('max_total_num_tokens', '?')} tokens), "
        f"{info.get('max_running_requests', '?')} request slots{_huge_pages(info)}",
        f"Device: {args.device} (AVX512-BF16: {_yes_no(features.get('avx512_bf16'))}, AMX: "
        f"{_yes_no(features.get('amx'))}), {info.get('threads_per_rank', '?')} threads per rank"
        f"{_cores(info.get('rank_cpu_cores'), world)}, "
        f"TP {args.tp_size} x PP {args.pp_size} on {args.nnodes} node{'s' if args.nnodes > 1 else ''}",
        "Server args: " + ", ".join(f"{key}={value!r}" for key, value in public_server_args(args).items()),
    ]


def log_startup_summary(args: ServerArgs, model_path: str, architecture: str, info: dict[str, Any]) -> None:
    for line in startup_summary(args, model_path, architecture, info):
        logger.info("%s", line)


def _quantized(types: Any) -> str:
    return f" (kept quantized: {types})" if types else ""


def _huge_pages(info: dict[str, Any]) -> str:
    """', huge pages 0.62 GiB (THP madvise)' where the rank reported them (executor/huge_pages.py)."""
    mib, mode = info.get("anon_huge_mib"), info.get("thp_mode")
    if mib is None and mode is None:
        return ""
    amount = "?" if mib is None else _gigabytes(mib * 2**20)
    return f", huge pages {amount} (THP {mode or '?'})"


def _cores(cores: Any, world: int) -> str:
    """' (rank 0 on cores 0-3)' when ranks share a machine (the binding, TOKENLOOM_CPU_OMP_THREADS_BIND)."""
    if world == 1 or not cores:
        return ""
    if len(cores) == 1:
        return f" (rank 0 on core {cores[0]})"
    if cores == list(range(cores[0], cores[-1] + 1)):
        return f" (rank 0 on cores {cores[0]}-{cores[-1]})"
    return f" (rank 0 on cores {','.join(map(str, cores))})"


def _gigabytes(nbytes: Any) -> str:
    return "?" if nbytes is None else f"{nbytes / 2**30:.2f} GiB"


def _number(value: Any, spec: str) -> str:
    return "?" if value is None else format(value, spec)


def _yes_no(flag: Any) -> str:
    return "?" if flag is None else ("yes" if flag else "no")
