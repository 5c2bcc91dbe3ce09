"""ServerArgs: validation errors name the flag, from_kwargs, and the generated argparse parser."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from tokenloom.config import ConfigError, ServerArgs


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(p)
    return p


@pytest.mark.parametrize("kwargs, flag", [
    ({"dtype": "float64"}, "--dtype"),
    ({"dtype": "fp16"}, "--dtype"),
    ({"load_format": "pt"}, "--load-format"),
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
    ({"device": "tpu"}, "--device"),
    ({"port": 0}, "--port"),
    ({"port": 65536}, "--port"),
    ({"host": ""}, "--host"),
    ({"api_key": "  "}, "--api-key"),
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
    {"max_running_requests": 1}, {"context_length": 2}, {"tp_size": 2},
    {"port": 1}, {"port": 65535}, {"host": "0.0.0.0"}, {"api_key": "k"}, {"enable_metrics": True},
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
                              "--tensor-parallel-size", "2", "--random-seed", "7", "--context-length", "128"])
    args = ServerArgs.from_cli_namespace(ns)
    assert (args.model_path, args.mem_fraction_static, args.max_total_tokens, args.tp_size,
            args.random_seed, args.context_length) == ("y", 0.4, 64, 2, 7, 128)
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
