"""The issue 30 arithmetic of `bench/gguf_bound.py` and `bench/gguf_pairs.py` and the file engines of
`bench/peer_engines.py`, without running a server: which tensors a decode step reads (checked against the
default GGUF's bytes computed independently from its shape and the GGUF block sizes), the bound, llama-server's
reported weight memory, medians over rounds, the same-file ratios, the slowdown under load, and that a
tokenloom engine and a llama.cpp engine of one file kind get the same file."""

from __future__ import annotations

import stat

import pytest

from bench import gguf_bound, gguf_pairs, peer_engines


def test_step_bytes_rule():
    tied = [("token_embd.weight", 1000), ("blk.0.attn_q.weight", 10), ("blk.0.attn_norm.weight", 1),
            ("blk.11.ffn_down.weight", 20), ("output_norm.weight", 2), ("rope_freqs.weight", 500)]
    assert gguf_bound.step_weight_bytes(tied) == 1000 + 10 + 1 + 20 + 2  # tied: the embedding is the head
    untied = [*tied, ("output.weight", 300)]
    assert gguf_bound.step_weight_bytes(untied) == 300 + 10 + 1 + 20 + 2  # the embedding is a lookup
    with pytest.raises(ValueError, match="no LM head"):
        gguf_bound.step_weight_bytes([("blk.0.attn_q.weight", 10)])


def test_step_bytes_of_the_default_gguf_match_its_shape():
    """Q4_1 layers (20 bytes / 32 weights), the tied Q8_0 embedding as the head (34 / 32), F32 norms."""
    from bench.common import ModelShape
    from tokenloom.models.default_model import default_model_file

    m = ModelShape.smollm2()
    layer_matmuls = m.matmul_params - m.vocab * m.hidden
    expected = layer_matmuls * 20 // 32 + m.vocab * m.hidden * 34 // 32 + (2 * m.layers + 1) * m.hidden * 4
    assert gguf_bound.gguf_step_bytes(default_model_file()) == expected


def test_bound_ms():
    assert gguf_bound.bound_ms(2_000_000_000, 20.0) == pytest.approx(100.0)
    with pytest.raises(ValueError, match="positive"):
        gguf_bound.bound_ms(1, 0.0)


def test_llama_server_weight_bytes():
    log = ("load_tensors: loading model tensors\nload_tensors:   CPU_Mapped model buffer size =   100.50 MiB\n"
           "load_tensors:  CPU_REPACK model buffer size =    10.00 MiB\n")
    assert gguf_bound.llama_server_weight_bytes(log) == round(110.5 * 2**20)
    assert gguf_bound.llama_server_weight_bytes("no sizes here") is None


def test_median_runs():
    runs = [{"mean_tpot_ms": 10.0, "output_throughput": 100.0}, {"error": "boom"},
            {"mean_tpot_ms": 30.0, "output_throughput": 90.0}, {"mean_tpot_ms": 12.0, "output_throughput": 95.0}]
    m = gguf_pairs.median_runs(runs)
    assert (m["mean_tpot_ms"], m["output_throughput"], m["rounds"], m["failed_rounds"]) == (12.0, 95.0, 3, 1)
    assert m["tpot_rounds"] == [10.0, 30.0, 12.0]
    assert gguf_pairs.median_runs([{"error": "boom"}]) == {"error": "boom", "rounds": 0, "failed_rounds": 1}


def test_pair_ratios():
    one = {"tokenloom-q4_1": {"mean_tpot_ms": 5.0, "mean_ttft_ms": 40.0},
           "llama.cpp-q4_1": {"mean_tpot_ms": 10.0, "mean_ttft_ms": 20.0},
           "tokenloom-q8_0": {"mean_tpot_ms": 5.0}}
    many = {"tokenloom-q4_1": {"output_throughput": 300.0}, "llama.cpp-q4_1": {"output_throughput": 100.0}}
    r = gguf_pairs.pair_ratios(one, many, ["q4_1", "q8_0", "1b-q8_0"])
    assert r == {"q4_1": {"itl_speedup": 2.0, "ttft_ratio": 0.5, "throughput_ratio": 3.0}}  # q8_0: no peer


def test_bound_rows():
    rows = gguf_pairs.bound_rows({"tokenloom-q4_1": {"mean_tpot_ms": 20.0}}, {"tokenloom-q4_1": "/f.gguf",
                                  "llama.cpp-q4_1": "/f.gguf"}, {"/f.gguf": 100_000_000}, {"/f.gguf": 120_000_000},
                                 {"tokenloom-q4_1": 110_000_000}, 10.0)
    tl, ll = rows
    assert tl["bound_ms"] == pytest.approx(10.0) and tl["itl_over_bound"] == pytest.approx(2.0)
    assert tl["weights_over_file"] == pytest.approx(110 / 120)
    assert ll["itl_ms"] is None and ll["itl_over_bound"] is None and ll["weights_over_file"] is None


def test_degradation():
    res = {"a": {"output_throughput": 100.0, "mean_tpot_ms": 10.0},
           "a+load": {"output_throughput": 50.0, "mean_tpot_ms": 30.0},
           "b": {"output_throughput": 100.0}, "b+load": {"output_throughput": 80.0}, "c": {"output_throughput": 1.0}}
    d = gguf_pairs.degradation(res, ["a", "b", "c"])
    assert d["a"]["throughput_slowdown"] == 2.0 and d["a"]["itl_slowdown"] == 3.0 and not d["a"]["met"]
    assert d["b"]["throughput_slowdown"] == 1.25 and d["b"]["itl_slowdown"] is None and d["b"]["met"]
    assert "c" not in d  # no loaded run


def test_busy_process_is_stopped():
    with gguf_pairs.busy_process(True) as proc:
        assert proc is not None and proc.poll() is None
    assert proc.poll() is not None
    with gguf_pairs.busy_process(False) as none:
        assert none is None


def test_same_file_for_both_servers(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENLOOM_CACHE_DIR", str(tmp_path / "cache"))
    server = tmp_path / "llama-server"
    server.write_text("#!/bin/sh\n")
    server.chmod(server.stat().st_mode | stat.S_IXUSR)
    q8 = tmp_path / "cache" / "gguf" / "m-q8_0.gguf"
    q8.parent.mkdir(parents=True)
    q8.write_text("q8")
    (q8.parent / "m-bf16.gguf").write_text("bf16")
    notes: list[str] = []
    source = str(tmp_path / "m.Q4_1.gguf")
    engines = peer_engines.build_engines(peer_engines.expand_engine_names("pairs"), "/hf", source, str(server), notes)
    by_name = {e.name: e for e in engines}
    assert list(by_name) == ["tokenloom-q4_1", "llama.cpp-q4_1", "tokenloom-q8_0", "llama.cpp-q8_0", "tokenloom-bf16"]
    assert by_name["tokenloom-q4_1"].file == by_name["llama.cpp-q4_1"].file == source
    assert by_name["tokenloom-q8_0"].file == by_name["llama.cpp-q8_0"].file == str(q8)
    tl = by_name["tokenloom-q8_0"].cmd
    assert tl[tl.index("--model-path") + 1] == str(q8) and "--quantization" not in tl  # the file's types: default
    assert tl[tl.index("--max-total-tokens") + 1] == "{ctx}"  # llama-server's KV capacity (-c {ctx})
    assert by_name["llama.cpp-q8_0"].cmd[by_name["llama.cpp-q8_0"].cmd.index("-c") + 1] == "{ctx}"
    assert by_name["tokenloom-bf16"].file is None and by_name["tokenloom-bf16"].model == "/hf"
    assert notes == []


def test_token_work_and_workload_flops():
    """Per-token multiply-adds from the tensor shapes (2-D block weights, the head once), attention's per
    context position, and a request's FLOPs counted position by position."""
    from bench import gguf_ceiling

    shapes = {"token_embd.weight": (8, 100), "blk.0.attn_q.weight": (8, 8), "blk.0.ffn_down.weight": (16, 8),
              "blk.0.attn_norm.weight": (8,), "blk.1.attn_q.weight": (8, 8), "output_norm.weight": (8,)}
    work = gguf_ceiling.token_work(shapes, layers=2, heads=2, head_dim=4)
    assert work == gguf_ceiling.TokenWork(block_macs=64 + 128 + 64, head_macs=800, attn_macs_per_ctx=2 * 2 * 2 * 4)
    untied = gguf_ceiling.token_work({**shapes, "output.weight": (8, 50)}, layers=2, heads=2, head_dim=4)
    assert untied.head_macs == 400
    by_hand = 0  # 3 prompt + 2 output tokens: positions 1..4 through the blocks, 2 heads
    for ctx in range(1, 5):
        by_hand += work.block_macs + ctx * work.attn_macs_per_ctx
    by_hand += 2 * work.head_macs
    assert gguf_ceiling.workload_flops(work, 5, 3, 2) == 2.0 * 5 * by_hand
    assert gguf_ceiling.ceiling_tok_s(2e9, 10, 4.0) == pytest.approx(20.0)
    with pytest.raises(ValueError, match="experts"):
        gguf_ceiling.token_work({**shapes, "blk.0.ffn_up_exps.weight": (8, 16, 4)}, 2, 2, 4)
    with pytest.raises(ValueError, match="no LM head"):
        gguf_ceiling.token_work({"blk.0.attn_q.weight": (8, 8)}, 1, 1, 8)


def test_token_work_of_the_default_gguf_matches_its_shape():
    """SmolLM2's per-token work read from the packaged GGUF equals what its config shape gives."""
    from bench import gguf_ceiling
    from bench.common import ModelShape
    from tokenloom.models.default_model import default_model_file

    m = ModelShape.smollm2()
    work = gguf_ceiling.gguf_token_work(default_model_file())
    assert work.head_macs == m.vocab * m.hidden
    assert work.block_macs == m.matmul_params - m.vocab * m.hidden
    assert work.attn_macs_per_ctx == 2 * m.layers * m.heads * m.head_dim


def test_ceiling_rows():
    """The ceiling per tokenloom engine, llama-server's best on a file of the same model (same FLOPs) and the
    target's need: 3x on the default model, 2x on the ~1B one."""
    files = {"tokenloom-q4_1": "a.gguf", "llama.cpp-q4_1": "a.gguf", "llama.cpp-bf16": "b.gguf",
             "tokenloom-1b-q8_0": "c.gguf", "llama.cpp-1b-q8_0": "c.gguf"}
    flops = {"a.gguf": 8e12, "b.gguf": 8e12, "c.gguf": 80e12}
    many = {"tokenloom-q4_1": {"output_throughput": 300.0}, "llama.cpp-q4_1": {"output_throughput": 100.0},
            "llama.cpp-bf16": {"output_throughput": 180.0}, "tokenloom-1b-q8_0": {"output_throughput": 40.0},
            "llama.cpp-1b-q8_0": {"output_throughput": 30.0}}
    rows = {r["engine"]: r for r in gguf_pairs.ceiling_rows(many, files, flops, 8000, 400.0)}
    assert set(rows) == {"tokenloom-q4_1", "tokenloom-1b-q8_0"}
    small = rows["tokenloom-q4_1"]  # 8 TFLOP at 400 GFLOP/s: 20 s for 8000 tokens
    assert small["ceiling_tok_s"] == pytest.approx(400.0) and small["share_of_ceiling"] == pytest.approx(0.75)
    assert small["peer_best_tok_s"] == 180.0 and small["needed_tok_s"] == pytest.approx(540.0)
    assert small["reachable"] is False and small["ceiling_over_peer"] == pytest.approx(400 / 180)
    big = rows["tokenloom-1b-q8_0"]  # 200 s: 40 tok/s, the target needs 60
    assert big["ceiling_tok_s"] == pytest.approx(40.0) and big["target"] == 2.0 and big["reachable"] is False
