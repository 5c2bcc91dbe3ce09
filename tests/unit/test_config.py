"""ServerArgs: validation errors name the flag, every value of every flag, refused flags with their reason, the
accepted-but-ignored SGLang flags and their one warning line each, the device check, from_kwargs, and the
generated argparse parser."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os

import pytest
import torch

from tokenloom.config import ConfigError, ServerArgs, check_device, ignored_flag_warnings, warn_ignored_flags

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(p)
    return p


@pytest.mark.parametrize("kwargs, flag", [
    ({"dtype": "float64"}, "--dtype"),
    ({"dtype": "fp16"}, "--dtype"),
    ({"load_format": "pt"}, "--load-format"),
    ({"quantization": "fp8"}, "--quantization"),
    ({"quantization": "awq", "load_format": "dummy"}, "--quantization"),
    ({"torchao_config": "int4wo-100"}, "--torchao-config"),
    ({"torchao_config": "int8wo", "quantization": "gguf"}, "--torchao-config"),
    ({"quantization": "int4"}, "--quantization"),
    ({"quantization": "gguf", "load_format": "dummy"}, "--quantization"),
    ({"attention_backend": "flashinfer"}, "--attention-backend"),
    ({"page_size": 0}, "--page-size"),
    ({"page_size": -4}, "--page-size"),
    ({"max_total_tokens": 1}, "--max-total-tokens"),
    ({"max_total_tokens": 31, "page_size": 16}, "--max-total-tokens"),
    ({"mem_fraction_static": 0.0}, "--mem-fraction-static"),
    ({"mem_fraction_static": 1.0}, "--mem-fraction-static"),
    ({"mem_fraction_static": 1.5}, "--mem-fraction-static"),
    ({"mem_fraction_static": -0.1}, "--mem-fraction-static"),
    ({"max_running_requests": 0}, "--max-running-requests"),
    ({"context_length": 1}, "--context-length"),
    ({"tp_size": 0}, "--tp-size"),
    ({"pp_async_batch_depth": -1}, "--pp-async-batch-depth"),
    ({"pp_max_micro_batch_size": 0}, "--pp-max-micro-batch-size"),
    ({"pp_size": 0}, "--pp-size"),
    ({"nnodes": 0}, "--nnodes"),
    ({"nnodes": 2, "tp_size": 2}, "--nnodes"),
    ({"nnodes": 2, "tp_size": 3}, "--nnodes"),
    ({"node_rank": 1}, "--node-rank"),
    ({"dist_init_addr": "localhost"}, "--dist-init-addr"),
    ({"dist_init_addr": "::1:80"}, "--dist-init-addr"),
    ({"device": "tpu"}, "--device"),
    ({"kv_cache_dtype": "int4"}, "--kv-cache-dtype must be one of auto, fp8_e4m3, fp8_e5m2"),
    ({"kv_cache_dtype": "bfloat16"}, "--kv-cache-dtype"),
    ({"num_threads": 0}, "--num-threads"),
    ({"cuda_graph_max_bs": 0}, "--cuda-graph-max-bs"),
    ({"random_seed": -1}, "--random-seed"),
    ({"random_seed": 2**64}, "--random-seed"),
    ({"decode_slot_run": 0}, "--decode-slot-run"),
    ({"chunked_prefill_size": 0}, "--chunked-prefill-size"),
    ({"chunked_prefill_size": -2}, "--chunked-prefill-size"),
    ({"chunked_prefill_size": 8, "page_size": 16}, "--chunked-prefill-size"),
    ({"max_prefill_tokens": 0}, "--max-prefill-tokens"),
    ({"schedule_conservativeness": 0.0}, "--schedule-conservativeness"),
    ({"max_queued_requests": 0}, "--max-queued-requests"),
    ({"stream_interval": 0}, "--stream-interval"),
    ({"decode_log_interval": 0}, "--decode-log-interval"),
    ({"schedule_policy": "lifo"}, "--schedule-policy"),
    ({"overlap_schedule": "maybe"}, "--overlap-schedule"),
    ({"log_level": "trace"}, "--log-level"),
    ({"port": 0}, "--port"),
    ({"port": 65536}, "--port"),
    ({"host": ""}, "--host"),
    ({"api_key": "  "}, "--api-key"),
    ({"log_requests_level": 4}, "--log-requests-level"),
    ({"log_requests_level": -1}, "--log-requests-level"),
    ({"max_request_body_bytes": 0}, "--max-request-body-bytes"),
    ({"watchdog_timeout": 0}, "--watchdog-timeout"),
    ({"watchdog_timeout": -3.0}, "--watchdog-timeout"),
    ({"watchdog_timeout": float("nan")}, "--watchdog-timeout"),
])
def test_bad_values_raise_config_error_naming_flag(kwargs, flag):
    with pytest.raises(ConfigError, match=flag):
        ServerArgs(**kwargs)
    with pytest.raises(ConfigError, match=flag):
        ServerArgs.from_kwargs(**kwargs)


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize("kwargs", [
    {}, {"dtype": "float32"}, {"dtype": "bfloat16"}, {"page_size": 16, "max_total_tokens": 32},
    {"mem_fraction_static": 0.5}, {"device": "cuda"}, {"device": "cuda:1"}, {"load_format": "dummy"},
    {"quantization": "gguf"}, {"quantization": "none"}, {"quantization": "none", "load_format": "dummy"},
    {"quantization": "gptq"}, {"quantization": "awq"}, {"torchao_config": "int8wo"}, {"quantization": "w8a8_int8"},
    {"torchao_config": "int4wo-32"}, {"torchao_config": "int4wo-256", "quantization": "none"},
    {"max_running_requests": 1}, {"context_length": 2}, {"tp_size": 1},
    {"port": 1}, {"port": 65535}, {"host": "0.0.0.0"}, {"api_key": "k"}, {"enable_metrics": True},
    {"mem_fraction_static": 0.88}, {"kv_cache_dtype": "auto"}, {"num_threads": 1}, {"cuda_graph_max_bs": 8},
    {"random_seed": 2**64 - 1}, {"decode_slot_run": 1}, {"chunked_prefill_size": -1},
    {"chunked_prefill_size": 16, "page_size": 16}, {"max_prefill_tokens": 1}, {"schedule_conservativeness": 0.3},
    {"max_queued_requests": 1}, {"stream_interval": 4}, {"decode_log_interval": 1},
    {"trust_remote_code": True}, {"disable_cuda_graph": True}, {"enable_torch_compile": True},
    {"log_requests": True}, {"log_requests_level": 0}, {"log_requests_level": 3}, {"max_request_body_bytes": 1},
    {"watchdog_timeout": 0.5},
])
def test_good_values_accepted(kwargs):
    args = ServerArgs.from_kwargs(**kwargs)
    for k, v in kwargs.items():
        assert getattr(args, k) == v


def test_defaults():
    a = ServerArgs()
    assert (a.dtype, a.page_size, a.device, a.attention_backend, a.load_format, a.tp_size) == \
        ("auto", 1, "cpu", "auto", "auto", 1)
    assert a.model_path is None and a.max_total_tokens is None and a.random_seed == 0


def test_watchdog_timeout_is_sglangs_float_flag():
    assert ServerArgs().watchdog_timeout == 300.0  # SGLang's default
    args = ServerArgs.from_cli_namespace(parser().parse_args(["--watchdog-timeout", "2.5"]))
    assert args.watchdog_timeout == 2.5


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ServerArgs().page_size = 4  # type: ignore[misc]


def test_from_kwargs_rejects_unknown_keys():
    with pytest.raises(ConfigError, match="pagesize") as err:
        ServerArgs.from_kwargs(pagesize=16, dtype="float32", zzz=1)
    assert "zzz" in str(err.value) and "dtype" not in str(err.value)


def test_cli_defaults_round_trip():
    ns = parser().parse_args([])
    assert ServerArgs.from_cli_namespace(ns) == ServerArgs()
    for f in dataclasses.fields(ServerArgs):
        assert getattr(ns, f.name) == f.default, f.name


def test_cli_parses_flags_and_aliases():
    ns = parser().parse_args(["--page-size", "16", "--dtype", "float32", "--model", "x"])
    args = ServerArgs.from_cli_namespace(ns)
    assert args == ServerArgs(page_size=16, dtype="float32", model_path="x")
    assert isinstance(args.page_size, int)
    ns = parser().parse_args(["--model-path", "y", "--mem-fraction-static", "0.4", "--max-total-tokens", "64",
                              "--tensor-parallel-size", "1", "--random-seed", "7", "--context-length", "128"])
    args = ServerArgs.from_cli_namespace(ns)
    assert (args.model_path, args.mem_fraction_static, args.max_total_tokens, args.tp_size,
            args.random_seed, args.context_length) == ("y", 0.4, 64, 1, 7, 128)
    assert isinstance(args.mem_fraction_static, float) and isinstance(args.max_total_tokens, int)


def test_cli_every_field_has_a_dashed_flag():
    p = parser()
    options = {s for a in p._actions for s in a.option_strings}
    for f in dataclasses.fields(ServerArgs):
        assert "--" + f.name.replace("_", "-") in options


def test_cli_rejects_bad_choice_and_type():
    with pytest.raises(argparse.ArgumentError, match="dtype"):
        parser().parse_args(["--dtype", "float64"])
    with pytest.raises(argparse.ArgumentError, match="page-size"):
        parser().parse_args(["--page-size", "big"])


def test_cli_value_checks_happen_in_validate():
    ns = parser().parse_args(["--page-size", "0"])
    with pytest.raises(ConfigError, match="--page-size"):
        ServerArgs.from_cli_namespace(ns)


def test_from_cli_namespace_ignores_foreign_attributes():
    ns = parser().parse_args(["--dtype", "float16"])
    ns.port = 30000  # another component's flag on the same parser
    assert ServerArgs.from_cli_namespace(ns).dtype == "float16"


def test_cli_bool_fields_are_switches():
    bools = [f for f in dataclasses.fields(ServerArgs) if f.type in ("bool", bool)]
    for f in bools:
        assert getattr(parser().parse_args([]), f.name) is False
        ns = parser().parse_args(["--" + f.name.replace("_", "-")])
        assert getattr(ServerArgs.from_cli_namespace(ns), f.name) is True


# Choices SGLang has that tokenloom parses (so a copied command line gets a reason, not argparse's
# "invalid choice") and refuses at validation, naming what to use instead.
REFUSED_CHOICES: dict[tuple[str, str], str] = {}  # (flag, choice) parsed for SGLang's sake but refused: the reason


@pytest.mark.parametrize("field, choice", [
    (f.name, c) for f in dataclasses.fields(ServerArgs) for c in (f.metadata.get("choices") or ())])
def test_every_choice_of_every_choice_flag_is_accepted(field, choice):
    if (field, choice) in REFUSED_CHOICES:
        ns = parser().parse_args([f"--{field.replace('_', '-')}", choice])
        with pytest.raises(ConfigError, match=REFUSED_CHOICES[field, choice]):
            ServerArgs.from_cli_namespace(ns)
        return
    assert getattr(ServerArgs(**{field: choice}), field) == choice
    ns = parser().parse_args([f"--{field.replace('_', '-')}", choice])
    assert getattr(ServerArgs.from_cli_namespace(ns), field) == choice


@pytest.mark.parametrize("flags", [["--tp-size", "2"], ["--tensor-parallel-size", "2"], ["--tp", "2"]])
def test_tensor_parallel_size_flags(flags):
    ns = parser().parse_args(flags)  # argparse also takes SGLang's `--tp` (an unambiguous prefix)
    assert ServerArgs.from_cli_namespace(ns).tp_size == 2


@pytest.mark.parametrize("flags, match", [
    (["--pipeline-parallel-size", "0"], "--pp-size must be >= 1"),
    (["--pp-size", "2", "--pp-async-batch-depth", "-1"], "--pp-async-batch-depth must be >= 0"),
    (["--tp-size", "2", "--nnodes", "2"], "--nnodes 2 needs --dist-init-addr host:port"),
    (["--dist-timeout", "0"], "--dist-timeout must be >= 1"),
    (["--tp-size", "3", "--nnodes", "2"], r"--tp-size x --pp-size \(3\) must be divisible by --nnodes \(2\)"),
    (["--disaggregation-mode", "prefill", "--disaggregation-decode-dp", "2"],
     "--disaggregation-decode-dp 2: only 1 is implemented"),
    (["--disaggregation-mode", "decode", "--nnodes", "2", "--tp-size", "2", "--dist-init-addr", "127.0.0.1:5000"],
     "--disaggregation-mode with --nnodes > 1 is not implemented"),
    (["--disaggregation-bootstrap-port", "0"], "--disaggregation-bootstrap-port must be in"),
])
def test_unimplemented_topologies_are_refused_with_the_reason(flags, match):
    with pytest.raises(ConfigError, match=match):
        ServerArgs.from_cli_namespace(parser().parse_args(flags))


def test_dist_init_addr_is_checked():
    assert ServerArgs(tp_size=2, dist_init_addr="127.0.0.1:29500").dist_init_addr == "127.0.0.1:29500"
    assert ServerArgs(dist_init_addr="[::1]:29500").dist_init_addr == "[::1]:29500"
    with pytest.raises(ConfigError, match="expected host:port"):
        ServerArgs(dist_init_addr="127.0.0.1:0")


@pytest.mark.parametrize("tp, heads, kv_heads, inter, problem", [
    (2, 4, 1, 128, None),  # kv heads replicated
    (2, 4, 2, 128, None),
    (4, 8, 2, 128, None),  # 2 replicas of each kv head
    (2, 9, 3, 128, "its 9 attention heads"),
    (4, 8, 6, 128, "its 6 KV heads are not divisible"),
    (4, 8, 3, 128, "its 3 KV heads .fewer than the ranks"),
    (2, 4, 2, 127, "intermediate features"),
])
def test_model_split_over_tp_is_checked(tp, heads, kv_heads, inter, problem):
    from tokenloom.config import check_parallel_fits
    from tokenloom.model_config import ModelConfig

    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=heads * 16,
                         intermediate_size=inter, num_hidden_layers=2, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                         max_position_embeddings=128,
                         tie_word_embeddings=True, attention_bias=False)
    if problem is None:
        check_parallel_fits(ServerArgs(tp_size=tp), config)
    else:
        with pytest.raises(ConfigError, match=f"--tp-size {tp} cannot split the model: .*{problem}"):
            check_parallel_fits(ServerArgs(tp_size=tp), config)


def test_kv_cache_dtype_values():
    """SGLang's fp8 values are accepted (the pool's dtype: tests/unit/test_kv_memory.py); others are refused
    with the accepted list, by ServerArgs and by the CLI parser."""
    for value in ("fp8_e4m3", "fp8_e5m2"):
        assert ServerArgs(kv_cache_dtype=value).kv_cache_dtype == value
        assert ServerArgs.from_cli_namespace(parser().parse_args(["--kv-cache-dtype", value])).kv_cache_dtype == value
    with pytest.raises(ConfigError, match="--kv-cache-dtype must be one of auto, fp8_e4m3, fp8_e5m2; got 'fp8'"):
        ServerArgs(kv_cache_dtype="fp8")
    assert ServerArgs.from_cli_namespace(parser().parse_args(["--kv-cache-dtype", "auto"])) == ServerArgs()


IGNORED = {"trust_remote_code": True, "disable_cuda_graph": True, "cuda_graph_max_bs": 16,
           "enable_torch_compile": True}


def test_no_warning_without_ignored_flags():
    assert ignored_flag_warnings(ServerArgs()) == []
    assert ignored_flag_warnings(ServerArgs(dtype="float32", page_size=16, max_total_tokens=64)) == []


@pytest.mark.parametrize("field", sorted(IGNORED))
def test_each_ignored_flag_gives_exactly_one_warning_line(field):
    flag = "--" + field.replace("_", "-")
    lines = ignored_flag_warnings(ServerArgs(**{field: IGNORED[field]}))
    assert len(lines) == 1 and lines[0].startswith(f"{flag} has no effect") and lines[0].endswith("; ignored")
    assert "\n" not in lines[0]


def test_warn_ignored_flags_logs_one_warning_per_flag(caplog):
    args = ServerArgs(**IGNORED)
    with caplog.at_level(logging.WARNING, logger="tokenloom.config"):
        lines = warn_ignored_flags(args)
    assert len(lines) == len(IGNORED) == len(caplog.records)
    assert [r.getMessage() for r in caplog.records] == lines
    assert all(r.levelno == logging.WARNING for r in caplog.records)
    assert {line.split()[0] for line in lines} == {"--" + f.replace("_", "-") for f in IGNORED}
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tokenloom.config"):
        assert warn_ignored_flags(ServerArgs()) == []
    assert caplog.records == []


def test_ignored_flags_parse_from_the_cli():
    ns = parser().parse_args(["--trust-remote-code", "--disable-cuda-graph", "--cuda-graph-max-bs", "16",
                              "--enable-torch-compile"])
    assert ServerArgs.from_cli_namespace(ns) == ServerArgs(**IGNORED)


def test_check_device_cpu_always_passes():
    check_device(ServerArgs(device="cpu"))


def test_check_device_refuses_cuda_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in ("cuda", "cuda:0"):
        with pytest.raises(ConfigError, match=f"--device {device}: no CUDA device .*--device cpu"):
            check_device(ServerArgs(device=device))


def test_check_device_refuses_a_gpu_index_past_the_last(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_device(ServerArgs(device="cuda"))
    check_device(ServerArgs(device="cuda:1"))
    with pytest.raises(ConfigError, match="--device cuda:2: there is no CUDA device 2 .*has 2"):
        check_device(ServerArgs(device="cuda:2"))


# Where each flag's effect is tested (besides its values here). A new flag must be added, with a test.
EFFECT_TESTS = {
    "model_path": "tests/integration/test_load_errors.py",
    "tokenizer_path": "tests/integration/test_server_flags.py",
    "load_format": "tests/integration/test_server_flags.py",
    "dtype": "tests/integration/test_server_flags.py",
    "quantization": "tests/integration/test_server_flags.py",
    "torchao_config": "tests/integration/test_hf_quant.py",
    "context_length": "tests/integration/test_scheduler_abort_stop.py",
    "served_model_name": "tests/unit/test_http_asgi.py",
    "random_seed": "tests/integration/test_server_flags.py",
    "trust_remote_code": "tests/unit/test_config.py",
    "page_size": "tests/integration/test_scheduler_equivalence.py",
    "decode_slot_run": "tests/integration/test_server_flags.py",
    "max_total_tokens": "tests/integration/test_server_flags.py",
    "mem_fraction_static": "tests/integration/test_server_flags.py",
    "kv_cache_dtype": "tests/unit/test_config.py",
    "max_running_requests": "tests/integration/test_scheduler_abort_stop.py",
    "device": "tests/e2e/test_launch_cli.py",
    "attention_backend": "tests/integration/test_forward_consistency.py",
    "tp_size": "tests/integration/test_tensor_parallel.py",
    "pp_size": "tests/integration/test_pipeline_loop.py",
    "pp_async_batch_depth": "tests/integration/test_pipeline_loop.py",
    "pp_max_micro_batch_size": "tests/unit/test_scheduler_lanes.py",
    "nnodes": "tests/e2e/test_multi_node.py",
    "node_rank": "tests/e2e/test_multi_node.py",
    "dist_timeout": "tests/e2e/test_tensor_parallel_server.py",
    "watchdog_timeout": "tests/e2e/test_watchdog.py",
    "dist_init_addr": "tests/e2e/test_tensor_parallel_server.py",
    "num_threads": "tests/integration/test_server_flags.py",
    "cpu_threads_policy": "tests/integration/test_server_flags.py",
    "disable_cuda_graph": "tests/unit/test_config.py",
    "cuda_graph_max_bs": "tests/unit/test_config.py",
    "enable_torch_compile": "tests/unit/test_config.py",
    "disable_native_decode": "tests/integration/test_native_decode.py",
    "disable_custom_all_reduce": "tests/integration/test_tensor_parallel.py",
    "disable_cascade_attention": "tests/integration/test_cascade_decode.py",
    "chunked_prefill_size": "tests/integration/test_scheduler_equivalence.py",
    "max_prefill_tokens": "tests/integration/test_scheduler_equivalence.py",
    "schedule_policy": "tests/integration/test_scheduler_equivalence.py",
    "schedule_conservativeness": "tests/integration/test_scheduler_equivalence.py",
    "disable_radix_cache": "tests/integration/test_scheduler_equivalence.py",
    "overlap_schedule": "tests/integration/test_overlap_scheduler.py",
    "disable_overlap_schedule": "tests/integration/test_overlap_scheduler.py",
    "enable_step_profile": "tests/integration/test_overlap_scheduler.py",
    "max_queued_requests": "tests/integration/test_scheduler_abort_stop.py",
    "max_logprobs": "tests/e2e/test_bad_input.py",
    "stream_interval": "tests/integration/test_server_flags.py",
    "detokenizer_process": "tests/reliability/test_soak.py",
    "decode_log_interval": "tests/integration/test_scheduler_abort_stop.py",
    "log_level": "tests/integration/test_engine.py",
    "host": "tests/e2e/test_launch_cli.py",
    "port": "tests/e2e/test_launch_cli.py",
    "api_key": "tests/unit/test_http_asgi.py",
    "enable_metrics": "tests/unit/test_http_asgi.py",
    "log_requests": "tests/e2e/test_server_logs.py",
    "log_requests_level": "tests/unit/test_request_log.py",
    "max_request_body_bytes": "tests/e2e/test_server_logs.py",
    "disaggregation_mode": "tests/e2e/test_disaggregation.py",
    "disaggregation_bootstrap_port": "tests/e2e/test_disaggregation.py",
    "disaggregation_transfer_backend": "tests/e2e/test_disaggregation.py",
    "disaggregation_decode_tp": "tests/unit/test_pd_scheduling.py",
    "disaggregation_decode_dp": "tests/unit/test_config.py",
    "disaggregation_decode_polling_interval": "tests/unit/test_pd_scheduling.py",
    "num_reserved_decode_tokens": "tests/unit/test_pd_scheduling.py",
    "disable_hybrid_swa_memory": "tests/integration/test_sliding_window_pool.py",
    "swa_full_tokens_ratio": "tests/integration/test_sliding_window_pool.py",
    "tool_call_parser": "tests/e2e/test_tool_calls.py",
    "chat_template": "tests/e2e/test_tool_calls.py",
    "reasoning_parser": "tests/e2e/test_tool_calls.py",
    "ep_size": "tests/e2e/test_moe_server.py",
    "enable_ep_moe": "tests/e2e/test_moe_server.py",
    "grammar_backend": "tests/unit/test_grammar.py",
    "grammar_compile_timeout": "tests/unit/test_grammar.py",
    "enable_jump_forward": "tests/integration/test_jump_forward.py",
}


def test_every_flag_has_an_effect_test():
    assert set(EFFECT_TESTS) == {f.name for f in dataclasses.fields(ServerArgs)}
    for name, path in EFFECT_TESTS.items():
        with open(os.path.join(REPO, path)) as f:
            text = f.read()
        assert name in text or f"--{name.replace('_', '-')}" in text, (name, path)


def test_chat_template_must_be_a_file_that_parses(tmp_path):
    from tokenloom.tokenizer import read_chat_template

    with pytest.raises(ConfigError, match="--chat-template 'chatml' is not a file"):
        ServerArgs(chat_template="chatml")
    good, bad = tmp_path / "good.jinja", tmp_path / "bad.jinja"
    good.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    bad.write_text("{% for m in messages %}{{ m.content }}")
    assert ServerArgs(chat_template=str(good)).chat_template == str(good)
    assert read_chat_template(str(good)) == good.read_text()
    with pytest.raises(ValueError, match=r"--chat-template .*bad.jinja: line 1: .*endfor"):
        read_chat_template(str(bad))


def test_enable_ep_moe_is_ep_size_equal_to_tp_size():
    assert ServerArgs(tp_size=2, enable_ep_moe=True).moe_ep_size == ServerArgs(tp_size=2, ep_size=2).moe_ep_size == 2
    assert ServerArgs(tp_size=2).moe_ep_size == 1  # default: each rank a slice of every expert


@pytest.mark.parametrize("flag,method", [("gptq_marlin", "gptq"), ("awq_marlin", "awq")])
def test_sglangs_marlin_quantization_names_load_the_checkpoint_format(flag, method):
    """An SGLang launch line with --quantization gptq_marlin / awq_marlin (its CUDA kernels for the same
    checkpoints) loads the checkpoint as gptq / awq, and says so once at start; plain marlin stays refused."""
    args = ServerArgs(**vars(parser().parse_args(["--quantization", flag])))
    assert args.quantization == method
    assert ignored_flag_warnings(args) == [f"--quantization {flag}: Marlin is a CUDA kernel; the {method} "
                                           f"checkpoint loads as --quantization {method}"]
    with pytest.raises(ConfigError, match="--quantization marlin is not implemented"):
        ServerArgs(quantization="marlin")
