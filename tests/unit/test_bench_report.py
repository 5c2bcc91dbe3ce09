"""The "Serving Benchmark Result" block (SGLang's layout: rows, order, widths, number formats, conditional
rows/sections), the error summary, the JSON line and its default file name, and the plot."""

from __future__ import annotations

import json
from types import SimpleNamespace

from tokenloom.bench.bench_serving import build_parser
from tokenloom.bench.metrics import BenchmarkMetrics, RequestOutput, calculate_metrics
from tokenloom.bench.report import append_json_line, default_output_file, format_block, format_errors, result_dict

ORDER = [
    "Backend:", "Traffic request rate:", "Max request concurrency:", "Successful requests:",
    "Benchmark duration (s):", "Total input tokens:", "Total input text tokens:", "Total generated tokens:",
    "Total generated tokens (retokenized):", "Request throughput (req/s):", "Input token throughput (tok/s):",
    "Output token throughput (tok/s):", "Peak output token throughput (tok/s):", "Peak concurrent requests:",
    "Total token throughput (tok/s):", "Concurrency:", "End-to-End Latency", "Mean E2E Latency (ms):",
    "Median E2E Latency (ms):", "P90 E2E Latency (ms):", "P99 E2E Latency (ms):", "Time to First Token",
    "Mean TTFT (ms):", "Median TTFT (ms):", "P99 TTFT (ms):", "Time per Output Token (excl. 1st token)",
    "Mean TPOT (ms):", "Median TPOT (ms):", "P99 TPOT (ms):", "Inter-Token Latency", "Mean ITL (ms):",
    "Median ITL (ms):", "P95 ITL (ms):", "P99 ITL (ms):", "Max ITL (ms):",
]


def outputs(fail: bool = False, cached: bool = False) -> list[RequestOutput]:
    outs = [RequestOutput(success=True, prompt_len=16, output_len=4, generated_text="a b c d", ttft=0.25,
                          latency=0.55, itl=[0.1, 0.1, 0.1], token_times=[0.25, 0.35, 0.45, 0.55], start_time=0.0,
                          cached_tokens=8 if cached else None, server_prompt_tokens=16 if cached else None)]
    if fail:
        outs.append(RequestOutput(error="HTTP 400: bad"))
    return outs


def metrics(**kw) -> BenchmarkMetrics:
    class Tok:
        def encode(self, text, add_special_tokens=False):
            return text.split()

    return calculate_metrics(outputs(**kw), 1.25, Tok())


def test_block_layout():
    block = format_block(metrics(), "tokenloom", float("inf"), None).splitlines()
    assert block[0] == "============ Serving Benchmark Result ============"
    assert block[-1] == "=" * 50
    labels = [line[:40].strip() if not line.startswith("-") else line.strip("-") for line in block[1:-1]]
    assert labels == ORDER
    rows = {line[:40].strip(): line[41:] for line in block if not line.startswith(("-", "="))}
    for line in block[1:-1]:
        if not line.startswith("-"):
            assert len(line) == 51 and line[40] == " ", repr(line)  # 40-wide label, space, 10-wide value
        else:
            assert len(line) == 50
    assert rows["Backend:"] == "tokenloom "
    assert rows["Traffic request rate:"] == "inf       "
    assert rows["Max request concurrency:"] == "not set   "
    assert rows["Successful requests:"] == "1         "
    assert rows["Benchmark duration (s):"] == "1.25      "
    assert rows["Total generated tokens:"] == "4         "
    assert rows["Output token throughput (tok/s):"] == "3.20      "
    assert rows["Peak concurrent requests:"] == "1.00      "
    assert rows["Mean TTFT (ms):"] == "250.00    "
    assert rows["Mean TPOT (ms):"] == "100.00    "
    assert "-----Time per Output Token (excl. 1st token)------" in block
    assert "----------------End-to-End Latency----------------" in block


def test_block_rate_concurrency_failed_and_cache_rows():
    block = format_block(metrics(fail=True, cached=True), "sglang-oai", 4.0, 8)
    assert "Traffic request rate:                    4.0       " in block
    assert "Max request concurrency:                 8         " in block
    lines = block.splitlines()
    assert lines[lines.index("Successful requests:                     1         ") + 1] == \
           "Failed requests:                         1         "
    assert "-------------------Prefix Cache-------------------" in lines
    assert "Cache hit rate (%):                      50.00     " in lines
    clean = format_block(metrics(), "tokenloom", 4.0, None)
    assert "Failed requests" not in clean and "Prefix Cache" not in clean


def test_error_summary():
    assert format_errors(metrics()) == ""
    text = format_errors(metrics(fail=True))
    assert text.splitlines() == ["1 request(s) failed:", "  [1x] HTTP 400: bad"]


def test_json_line_and_details(tmp_path):
    args = build_parser().parse_args(["--dataset-name", "random-ids", "--num-prompts", "2"])
    m = metrics(fail=True)
    result = result_dict(m, args, {"version": "x"})
    assert result["completed"] == 1 and result["failed"] == 1 and result["error_counts"] == {"HTTP 400: bad": 1}
    assert result["request_rate"] == "inf" and result["server_info"] == {"version": "x"}
    assert result["mean_ttft_ms"] == 250.0 and result["p99_itl_ms"] == 100.0 and "ttfts" not in result
    detailed = result_dict(m, args, None, outputs(fail=True))
    assert detailed["output_lens"] == [4, 0] and detailed["errors"] == ["", "HTTP 400: bad"]
    assert detailed["itls"][0] == [0.1, 0.1, 0.1] and detailed["generated_texts"][0] == "a b c d"
    path = tmp_path / "sub" / "out.jsonl"
    append_json_line(str(path), result)
    append_json_line(str(path), detailed)
    lines = path.read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[1])["input_lens"] == [16, 0]


def test_default_output_file():
    args = SimpleNamespace(backend="tokenloom", dataset_name="random", num_prompts=10, random_input_len=256,
                           random_output_len=128)
    assert default_output_file(args, "1129") == "tokenloom_1129_10_256_128.jsonl"
    args.dataset_name = "sharegpt"
    assert default_output_file(args, "1129") == "tokenloom_1129_sharegpt.jsonl"


def test_plot_writes_png(tmp_path):
    from tokenloom.bench.plot import save_plot

    path = tmp_path / "p.png"
    save_plot(outputs(), metrics(), str(path), "test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
