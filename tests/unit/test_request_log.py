"""`--log-requests` / `--log-requests-level` (frontend/request_log.py): what each level logs when a request
arrives and when it finishes, truncation at level 2, nothing at all without the flag or for health probes."""

from __future__ import annotations

import logging

import pytest

from tokenloom.config import ConfigError, ServerArgs
from tokenloom.frontend.request_log import TRUNCATE_AT, log_finished, log_received
from tokenloom.protocol import TokenizedRequest
from tokenloom.sampling.sampling_params import SamplingParams

PROMPT = "The secret prompt"
OUTPUT = "the model's answer"


def request(text: str | None = PROMPT, ids: list[int] | None = None, rid: str = "r1") -> TokenizedRequest:
    return TokenizedRequest(rid=rid, input_text=text, input_ids=ids or [5, 6, 7],
                            sampling_params=SamplingParams.from_dict({"temperature": 0.5, "max_new_tokens": 9}))


def output(text: str = OUTPUT, ids: list[int] | None = None) -> dict:
    return {"text": text, "output_ids": ids or [11, 12], "meta_info": {
        "finish_reason": {"type": "length", "length": 9}, "prompt_tokens": 3, "completion_tokens": 2,
        "cached_tokens": 0, "e2e_latency": 0.123456}}


def lines(caplog, args: ServerArgs, req: TokenizedRequest, out: dict | None) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tokenloom.requests"):
        log_received(args, req)
        log_finished(args, req, out)
    return [r.getMessage() for r in caplog.records if r.name == "tokenloom.requests"]


@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_without_the_flag_nothing_is_logged_at_any_level(caplog, level):
    assert lines(caplog, ServerArgs(log_requests_level=level), request(), output()) == []


def test_level_0_is_metadata_only(caplog):
    receive, finish = lines(caplog, ServerArgs(log_requests=True, log_requests_level=0), request(), output())
    assert receive == "Receive: rid='r1', input_tokens=3, stream=False, return_logprob=False"
    assert finish == ("Finish: rid='r1', finish_reason='length', prompt_tokens=3, completion_tokens=2, "
                      "cached_tokens=0, e2e_latency=0.1235")


def test_level_1_adds_the_sampling_parameters_set(caplog):
    receive, finish = lines(caplog, ServerArgs(log_requests=True, log_requests_level=1), request(), output())
    assert receive.endswith("sampling_params={'max_new_tokens': 9, 'temperature': 0.5}")
    assert "finish_reason={'type': 'length', 'length': 9}" in finish
    assert PROMPT not in receive and OUTPUT not in finish and "[11, 12]" not in finish


@pytest.mark.parametrize("level", [2, 3])
def test_levels_2_and_3_add_input_and_output(caplog, level):
    receive, finish = lines(caplog, ServerArgs(log_requests=True, log_requests_level=level), request(), output())
    assert receive.endswith(f"text='{PROMPT}'") and "input_ids" not in receive
    assert finish.endswith(f"text=\"{OUTPUT}\", output_ids=[11, 12]")
    receive, _ = lines(caplog, ServerArgs(log_requests=True, log_requests_level=level), request(None, [1, 2]), output())
    assert receive.endswith("input_ids=[1, 2]")  # no text: the token ids


def test_level_2_cuts_long_inputs_and_outputs_and_level_3_does_not(caplog):
    long_text, long_ids = "x" * (TRUNCATE_AT + 500), list(range(TRUNCATE_AT + 7))
    receive, finish = lines(caplog, ServerArgs(log_requests=True, log_requests_level=2), request(long_text),
                            output(long_text, long_ids))
    assert f"text='{'x' * TRUNCATE_AT}... ({TRUNCATE_AT + 500} characters)'" in receive
    assert "x" * (TRUNCATE_AT + 1) not in receive + finish
    assert f"{TRUNCATE_AT - 1}, '... ({TRUNCATE_AT + 7} items)']" in finish and f", {TRUNCATE_AT}," not in finish
    receive, finish = lines(caplog, ServerArgs(log_requests=True, log_requests_level=3), request(long_text),
                            output(long_text, long_ids))
    assert f"text='{long_text}'" in receive and str(long_ids) in finish


def test_a_request_that_ends_without_output(caplog):
    _, finish = lines(caplog, ServerArgs(log_requests=True), request(), None)
    assert finish == "Finish: rid='r1', finish_reason='ended without an output'"


def test_health_probes_are_never_logged(caplog):
    args = ServerArgs(log_requests=True, log_requests_level=3)
    assert lines(caplog, args, request(rid="HEALTH_CHECK_0123"), output()) == []
    assert len(lines(caplog, args, request(rid="WARMUP_0123"), output())) == 2


def test_the_flags():
    assert (ServerArgs().log_requests, ServerArgs().log_requests_level) == (False, 2)
    for bad in (-1, 4):
        with pytest.raises(ConfigError, match="--log-requests-level must be 0, 1, 2 or 3"):
            ServerArgs(log_requests_level=bad)
