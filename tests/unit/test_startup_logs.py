"""The logs of a server's start: the start-up summary (API key redacted, the entry rank's numbers), weight
loading progress (a few lines, never one per tensor, counting only the tensors a stage needs), the first-run
kernel build announcement, and the access-log filter that drops health probes and metric scrapes."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from tokenloom.config import ServerArgs
from tokenloom.entrypoints.launch_server import QuietProbesFilter, quiet_probe_access_lines
from tokenloom.entrypoints.startup_summary import startup_summary
from tokenloom.kernels import cpu_build
from tokenloom.models import load_progress
from tokenloom.models.load_progress import LoadProgress, format_count

READY = {"status": "ready", "max_total_num_tokens": 123456, "max_running_requests": 64, "model_dtype": "bfloat16",
         "num_parameters": 134_515_008, "weight_bytes": 3 * 2**29, "weight_load_s": 2.345,
         "kv_pool_bytes": 5 * 2**30, "threads_per_rank": 8, "cpu_features": {"avx512_bf16": True, "amx": False}}


def test_startup_summary_lines():
    args = ServerArgs(api_key="sup3r-secret", tp_size=1, port=8000)
    lines = startup_summary(args, "/models/smol", "LlamaForCausalLM", READY)
    assert lines[:3] == [
        "Model: /models/smol (LlamaForCausalLM), bfloat16, 134.5M parameters, weights loaded in 2.3 s",
        "Memory: weights 1.50 GiB, KV pool 5.00 GiB (123456 tokens), 64 request slots",
        "Device: cpu (AVX512-BF16: yes, AMX: no), 8 threads per rank, TP 1 x PP 1 on 1 node"]
    assert lines[3].startswith("Server args: model_path=None, ") and "port=8000" in lines[3]
    assert "api_key='<redacted>'" in lines[3] and all("sup3r-secret" not in line for line in lines)
    assert len(lines) == 4


def test_startup_summary_names_the_quantized_types_kept():
    info = {**READY, "weight_quantization": "Q4_1 x 210, Q8_0 x 1", "weight_bytes": 96 * 2**20}
    lines = startup_summary(ServerArgs(), "/m.gguf", "LlamaForCausalLM", info)
    assert lines[0] == ("Model: /m.gguf (LlamaForCausalLM), bfloat16, 134.5M parameters (kept quantized: Q4_1 x "
                        "210, Q8_0 x 1), weights loaded in 2.3 s")
    assert lines[1].startswith("Memory: weights 0.09 GiB,")


def test_startup_summary_reports_huge_pages():
    info = {**READY, "thp_mode": "madvise", "anon_huge_mib": 636.0}
    lines = startup_summary(ServerArgs(), "/m.gguf", "LlamaForCausalLM", info)
    assert lines[1] == ("Memory: weights 1.50 GiB, KV pool 5.00 GiB (123456 tokens), 64 request slots, huge pages "
                        "0.62 GiB (THP madvise)")
    lines = startup_summary(ServerArgs(), "/m.gguf", "LlamaForCausalLM", {**READY, "thp_mode": "never",
                                                                          "anon_huge_mib": None})
    assert lines[1].endswith("64 request slots, huge pages ? (THP never)")


def test_startup_summary_says_whose_numbers_at_tp_and_missing_fields():
    lines = startup_summary(ServerArgs(tp_size=2, pp_size=2), "/m", "Qwen2ForCausalLM", {"status": "ready"})
    assert lines[0] == "Model: /m (Qwen2ForCausalLM), ?, ? parameters (rank 0's share), weights loaded in ? s"
    assert lines[1] == "Memory (rank 0's share): weights ?, KV pool ? (? tokens), ? request slots"
    assert lines[2].endswith("(AVX512-BF16: ?, AMX: ?), ? threads per rank, TP 2 x PP 2 on 1 node")


@pytest.mark.parametrize("n, text", [(0, "0"), (999, "999"), (1000, "1.0K"), (106_816, "106.8K"),
                                     (134_515_008, "134.5M"), (7_241_732_096, "7.2B")])
def test_format_count(n, text):
    assert format_count(n) == text


def access_record(path: str) -> logging.LogRecord:
    """A record as uvicorn's access logger makes it."""
    return logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                             ("127.0.0.1:5000", "GET", path, "1.1", 200), None)


@pytest.mark.parametrize("path, kept", [
    ("/health", False), ("/health_generate", False), ("/metrics", False), ("/health?x=1", False),
    ("/generate", True), ("/v1/models", True), ("/healthz", True), ("/metrics/x", True), ("/", True),
])
def test_access_log_filter(path, kept):
    assert QuietProbesFilter().filter(access_record(path)) is kept


def test_access_log_filter_passes_other_records_and_installs_once():
    assert QuietProbesFilter().filter(logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, "plain",
                                                        None, None))
    access = logging.getLogger("test.uvicorn.access")
    quiet_probe_access_lines(access)
    quiet_probe_access_lines(access)
    assert sum(isinstance(f, QuietProbesFilter) for f in access.filters) == 1


def layer_names(layers: range) -> list[str]:
    return [f"model.layers.{i}.{p}" for i in layers for p in ("q.weight", "k.weight", "norm.weight")]


def progress_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "tokenloom.models.loader"]


def test_load_progress_counts_only_required_tensors_and_logs_tenths(caplog, monkeypatch):
    monkeypatch.setattr(load_progress, "MIN_GAP_S", 0.0)
    required = {"model.embed_tokens.weight", *layer_names(range(4, 8))}  # a pipeline stage's layers 4-7
    stream = ["model.norm.weight", *layer_names(range(12)), "model.embed_tokens.weight"]
    random.Random(0).shuffle(stream)
    stream += layer_names(range(4, 5))  # a repeated name counts once
    model = torch.nn.Linear(10, 10)  # 110 parameters
    progress = LoadProgress(required)
    with caplog.at_level(logging.INFO, logger="tokenloom.models.loader"):
        assert [name for name, _ in progress.track((n, torch.zeros(1)) for n in stream)] == stream
        progress.finished(model, torch.bfloat16, 3 * 2**30)
    lines = progress_lines(caplog)
    steps = [int(line.split(": ")[1].split("%")[0]) for line in lines[:-1]]
    assert lines[:-1] and all(line.startswith("Loading weights: ") for line in lines[:-1])
    assert steps == sorted(set(steps)) and steps[0] >= 10 and steps[-1] < 100 and len(steps) <= 9
    assert all("/4 layers" in line for line in lines[:-1])
    assert lines[-1].startswith("Loaded weights: 4/4 layers, 110 parameters (bfloat16), 3.00 GiB in memory, in ")


def test_load_progress_lines_are_at_most_one_a_second(caplog):
    progress = LoadProgress(set(layer_names(range(30))))
    with caplog.at_level(logging.INFO, logger="tokenloom.models.loader"):
        for _ in progress.track((n, torch.zeros(1)) for n in layer_names(range(30))):
            pass
        progress.finished(torch.nn.Linear(1, 1), torch.float32, 0, what="random, --load-format dummy")
    assert progress_lines(caplog) == [progress_lines(caplog)[-1]]  # a load faster than a second: one line
    assert progress_lines(caplog)[-1].startswith("Loaded weights (random, --load-format dummy): 30/30 layers, 2 ")


def test_first_kernel_build_is_announced_and_a_cached_one_is_not(tmp_path, monkeypatch, caplog):
    source = tmp_path / "csrc"
    source.mkdir()
    (source / "tiny.c").write_text("int tiny_answer(void) { return 42; }\n")
    monkeypatch.setattr(cpu_build, "CSRC", str(source))
    monkeypatch.setenv("TOKENLOOM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TOKENLOOM_DISABLE_C_KERNELS", raising=False)
    cpu_build._sources_digest.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="tokenloom.kernels.cpu_build"):
            lib = cpu_build.load_library.__wrapped__("tiny")
            first = [r.getMessage() for r in caplog.records]
            caplog.clear()
            again = cpu_build.load_library.__wrapped__("tiny")
            second = [r.getMessage() for r in caplog.records]
    finally:
        cpu_build._sources_digest.cache_clear()  # the real csrc/ digest for every later test
    assert lib is not None and lib.tiny_answer() == 42 and again.tiny_answer() == 42
    assert first[0] == f"Building native CPU kernels (first run, ~{cpu_build.BUILD_ESTIMATE_S} s)..."
    assert first[1].startswith("Native CPU kernels built in ") and len(first) == 2
    assert second == []


def test_startup_summary_names_rank_0s_cores_when_ranks_share_the_machine():
    lines = startup_summary(ServerArgs(pp_size=2), "/m", "LlamaForCausalLM", {**READY, "threads_per_rank": 1,
                                                                            "rank_cpu_cores": [0]})
    assert lines[2] == "Device: cpu (AVX512-BF16: yes, AMX: no), 1 threads per rank (rank 0 on core 0), TP 1 x " \
                       "PP 2 on 1 node"
    lines = startup_summary(ServerArgs(tp_size=2), "/m", "LlamaForCausalLM", {**READY, "rank_cpu_cores": [0, 2]})
    assert "8 threads per rank (rank 0 on cores 0,2), TP 2" in lines[2]
    lines = startup_summary(ServerArgs(), "/m", "LlamaForCausalLM", {**READY, "rank_cpu_cores": [0, 1]})
    assert "8 threads per rank, TP 1" in lines[2]  # one rank: nothing to say
