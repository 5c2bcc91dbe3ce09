"""`python -m tokenloom.bench_serving` as a subprocess against the live tiny server: every backend family
(native /generate, /v1/completions, /v1/chat/completions) with model and tokenizer discovered from the server,
and bad input (unreachable server, bad dataset path, bad flags) ending in one clear line, no traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.e2e.server_process import REPO, free_port

CLIENT = [sys.executable, "-m", "tokenloom.bench_serving"]


def bench(*flags: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*CLIENT, *flags], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def block_rows(stdout: str) -> dict[str, str]:
    start = stdout.index("============ Serving Benchmark Result ============")
    rows = {}
    for line in stdout[start:].splitlines()[1:]:
        if line.startswith("="):
            break
        if not line.startswith("-"):
            rows[line[:40].strip()] = line[41:].strip()
    return rows


@pytest.mark.parametrize("backend,dataset,extra", [
    ("tokenloom", "random-ids", ["--plot", "PLOT"]),
    ("sglang-oai", "random-ids", ["--request-rate", "50", "--max-concurrency", "2"]),
    ("sglang-oai-chat", "random", ["--disable-stream"]),
    ("sglang-oai", "random-ids", ["--extra-request-body",
                                  '{"stream_options": {"include_usage": true, "continuous_usage_stats": true}}']),
])
def test_backends(tiny_server, tmp_path, backend, dataset, extra):
    out_file = tmp_path / "out.jsonl"
    extra = [str(tmp_path / "plot.png") if x == "PLOT" else x for x in extra]
    result = bench("--base-url", tiny_server.url, "--backend", backend, "--dataset-name", dataset,
                   "--num-prompts", "4", "--random-input-len", "24", "--random-output-len", "6",
                   "--random-range-ratio", "1", "--output-file", str(out_file), "--output-details",
                   "--disable-tqdm", *extra)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    rows = block_rows(result.stdout)
    assert rows["Backend:"] == backend
    assert rows["Successful requests:"] == "4"
    assert "Failed requests:" not in rows
    assert rows["Total generated tokens:"] == "24"  # ignore_eos: every request makes exactly 6 tokens
    assert rows["Total input tokens:"] == "96"
    assert float(rows["Output token throughput (tok/s):"]) > 0
    line = json.loads(out_file.read_text().splitlines()[-1])
    assert line["completed"] == 4 and line["failed"] == 0 and line["output_lens"] == [6, 6, 6, 6]
    assert line["server_info"]["served_model_name"]
    if backend == "tokenloom":
        assert "Cache hit rate (%):" in rows  # native meta_info carries cached_tokens
        assert all(len(itl) == 5 for itl in line["itls"])
        assert (tmp_path / "plot.png").stat().st_size > 0
    elif "--disable-stream" in extra:
        assert line["itls"] == [[], [], [], []]
        assert line["mean_ttft_ms"] == pytest.approx(line["mean_e2e_latency_ms"])
    elif "--extra-request-body" in extra:
        # per-chunk usage gives each chunk's token count: per-token ITL, 5 gaps for 6 tokens as on /generate
        assert all(len(itl) == 5 for itl in line["itls"])
    else:
        assert float(rows["Peak concurrent requests:"]) <= 4 and line["max_concurrency"] == 2


def assert_one_line_error(result: subprocess.CompletedProcess, code: int, text: str) -> None:
    assert result.returncode == code, result.stdout + result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    lines = [x for x in result.stderr.splitlines() if x.strip()]
    assert lines and text in lines[-1], result.stderr


def test_unreachable_server():
    url = f"http://127.0.0.1:{free_port()}"
    result = bench("--base-url", url, "--dataset-name", "random-ids", "--num-prompts", "2")
    assert_one_line_error(result, 1, f"bench_serving: error: cannot reach the server at {url}/v1/models")
    result = bench("--base-url", url, "--model", "smollm2", "--num-prompts", "2")
    assert_one_line_error(result, 1, "cannot reach the server")


def test_bad_dataset_path(tiny_server, tmp_path):
    missing = os.path.join(str(tmp_path), "missing.json")
    result = bench("--base-url", tiny_server.url, "--dataset-name", "sharegpt", "--dataset-path", missing,
                   "--num-prompts", "2")
    assert_one_line_error(result, 1, f"bench_serving: error: dataset file not found: {missing}")


@pytest.mark.parametrize("flags,code,text", [
    (["--request-rate", "0"], 1, "--request-rate must be > 0"),
    (["--num-prompts", "0"], 1, "--num-prompts must be at least 1"),
    (["--random-range-ratio", "2"], 1, "--random-range-ratio must be in [0, 1]"),
    (["--extra-request-body", "{oops"], 1, "--extra-request-body is not valid JSON"),
    (["--backend", "sglang-oai", "--tokenize-prompt"], 1, "--tokenize-prompt needs a native backend"),
    (["--backend", "nope"], 2, "invalid choice: 'nope'"),
])
def test_bad_flags(flags, code, text):
    assert_one_line_error(bench("--port", str(free_port()), *flags), code, text)
