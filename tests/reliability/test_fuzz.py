"""Fuzzing a live server (issue 20): hypothesis over sampling parameters and the bodies of every route, and
schemathesis over the app's own OpenAPI schema. The property everywhere: no answer is a 5xx and no process
crashes. A refusal is a 4xx whose JSON body carries a message; a valid request generates what it asked for.

One server (the tiny random model, a small KV pool) serves the whole module over HTTP, so a crash of any of its
processes shows. Afterwards its processes are the same ones, /health is 200, its log holds no traceback and the
KV pool is full again. Examples are derandomized (the same ones every run); `TOKENLOOM_TEST_LONG=1` runs
`LONG_FACTOR` times as many, and `-s` prints how many requests were sent and what they got.
"""

from __future__ import annotations

import json
import os
import signal
import urllib.parse
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable

from tests.e2e.server_process import ServerProcess, http
from tests.reliability import fuzz_strategies as fs

LONG = os.environ.get("TOKENLOOM_TEST_LONG") == "1"
LONG_FACTOR = 20
FUZZ_FLAGS = ("--max-total-tokens", "3000", "--max-running-requests", "8", "--max-queued-requests", "16",
              "--context-length", str(fs.CONTEXT), "--dtype", "float32", "--num-threads", "1", "--enable-metrics")
NOT_FUZZED = frozenset({"/start_profile", "/stop_profile"})  # they write trace files to a folder the body names
JSON = {"Content-Type": "application/json"}


def fuzz(examples: int) -> settings:
    """Reproducible settings: derandomized, no example database, `examples` (x LONG_FACTOR in the long form)."""
    return settings(max_examples=examples * (LONG_FACTOR if LONG else 1), deadline=None, derandomize=True,
                    database=None, print_blob=False, suppress_health_check=list(HealthCheck))


@dataclass
class FuzzTarget:
    """The fuzzed server, the processes it ran when the fuzzing started, and a tally of the answers' statuses."""

    server: ServerProcess
    processes: set[int]
    statuses: Counter = field(default_factory=Counter)

    def call(self, method: str, path: str, body: Any = None, raw: bytes | None = None,
             headers: dict[str, str] | None = None) -> tuple[int, Any]:
        status, out = http(method, self.server.url + path, body, raw=raw, headers=headers, timeout=60)
        self.statuses[status] += 1
        return status, out


def assert_unharmed(target: FuzzTarget) -> None:
    server = target.server
    assert server.proc.poll() is None, f"the server exited with {server.proc.returncode}:\n{server.logs()}"
    assert set(server.children()) == target.processes, "a child process died or was replaced"
    assert http("GET", server.url + "/health")[0] == 200
    server.wait_idle_and_pool_full()
    assert "Traceback" not in server.logs(), server.logs()


@pytest.fixture(scope="module")
def target(tiny_runtime_model):
    server = ServerProcess("--model-path", tiny_runtime_model, *FUZZ_FLAGS).wait_healthy()
    fuzzed = FuzzTarget(server, set(server.children()))
    try:
        yield fuzzed
        assert_unharmed(fuzzed)
        tally = dict(sorted(fuzzed.statuses.items()))
        print(f"\nfuzzing sent {sum(tally.values())} requests; statuses {tally}")
    finally:
        code = server.stop(signal.SIGTERM)
    assert code in (0, -signal.SIGTERM), f"exit status {code}:\n{server.logs()}"
    assert not server.children(), "child processes survived the server"


def error_message(out: Any) -> str | None:
    """The message of any of the server's error shapes: OpenAI/SGLang body errors, native errors, FastAPI's."""
    if not isinstance(out, dict):
        return None
    error = out.get("error")
    if isinstance(error, dict):
        return error.get("message")
    return out.get("message") or out.get("detail")


def assert_answered(status: int, out: Any, request: Any, plain_text: bool = False) -> None:
    """Not a server error; a refusal carries a message (in JSON, or with `plain_text` as the body: /flush_cache
    answers in text, as SGLang's does); a stream ends with [DONE] and holds no server error."""
    assert status < 500, f"{request!r} -> {status}: {out!r}"
    if status >= 400:
        message = out if plain_text and isinstance(out, str) else error_message(out)
        assert isinstance(message, str) and message, f"{request!r} -> {status} without a message: {out!r}"
    elif isinstance(out, str) and out.startswith("data: "):
        events = [line.removeprefix("data: ") for line in out.split("\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]", f"{request!r}: the stream did not end with [DONE]: {out!r}"
        for event in map(json.loads, events[:-1]):
            error = event.get("error") if isinstance(event, dict) else None
            if isinstance(error, dict):
                assert int(error.get("code") or 400) < 500, f"{request!r}: a server error in the stream: {event}"


# --- sampling parameters -------------------------------------------------------------------------------
@fuzz(40)
@given(params=fs.valid_sampling_params(), prompt=st.one_of(st.text(min_size=1, max_size=24),
                                                           st.lists(fs.token_ids, min_size=1, max_size=12)))
def test_valid_sampling_params_always_generate_what_they_ask(target, params, prompt):
    body = {"text" if isinstance(prompt, str) else "input_ids": prompt, "sampling_params": params}
    status, out = target.call("POST", "/generate", body)
    assert status == 200, f"{body!r} -> {status}: {out!r}"
    outs = out if params.get("n", 1) > 1 else [out]
    assert isinstance(outs, list) and len(outs) == params.get("n", 1), out
    for one in outs:
        meta = one["meta_info"]
        assert len(one["output_ids"]) == meta["completion_tokens"] <= params["max_new_tokens"], meta
        assert all(0 <= t < fs.VOCAB for t in one["output_ids"])
        finish = meta["finish_reason"]
        assert finish["type"] in ("length", "stop"), finish
        if finish["type"] == "length":
            assert meta["completion_tokens"] == params["max_new_tokens"], meta
        elif isinstance(finish.get("matched"), int):  # EOS or a stop id: masked below min_new_tokens
            assert meta["completion_tokens"] >= params.get("min_new_tokens", 0), meta


@fuzz(120)
@given(params=fs.any_sampling_params())
@example(params={"max_new_tokens": 2, "skip_special_tokens": [1]}).via("killed the detokenizer")
@example(params={"max_new_tokens": 2, "logit_bias": {"5": 1e308}}).via("killed the scheduler")
@example(params={"max_new_tokens": 2, "temperature": 10**400}).via("OverflowError")
def test_any_sampling_params_are_served_or_refused_with_a_message(target, params):
    body = {"text": "Hello", "sampling_params": fs.keep_fast(params, "max_new_tokens")}
    assert_answered(*target.call("POST", "/generate", body), body)


@pytest.mark.parametrize("key", fs.SAMPLING_KEYS)
@fuzz(12)
@given(data=st.data())
def test_each_sampling_key_over_its_values(target, key, data):
    # one key at a time (valid, boundary, invalid or junk), next to valid values of the others
    value = data.draw(st.one_of(fs.VALID[key], fs.INVALID[key], fs.junk), label=key)
    params = {**data.draw(fs.valid_sampling_params(), label="others"), key: value}
    body = {"text": "Hello", "sampling_params": fs.keep_fast(params, "max_new_tokens")}
    assert_answered(*target.call("POST", "/generate", body), body)


def test_a_logit_bias_beyond_openais_range_is_clamped_to_it(target):
    # A bias past float32's range used to kill the scheduler (an overflow filling the bias tensor); clamped to
    # [-100, 100] as vLLM does, +1e308 still forces its token and -1e308 still bans it.
    def greedy(bias: dict[str, float] | None = None) -> list[int]:
        params = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True, "logit_bias": bias}
        status, out = target.call("POST", "/generate", {"text": "Hello", "sampling_params": params})
        assert status == 200, out
        return out["output_ids"]

    assert greedy({"1234": 1e308}) == [1234] * 3
    first = greedy()[0]
    assert greedy({str(first): -1e308})[0] != first


# --- route bodies --------------------------------------------------------------------------------------
@fuzz(120)
@given(body=fs.generate_bodies(), method=st.sampled_from(["POST", "PUT"]))
@example(body={"text": "\ud800"}, method="POST").via("a lone surrogate: TypeError in the tokenizer")
@example(body={"text": "hi", "rid": "\udfff"}, method="POST").via("UnicodeEncodeError rendering the answer")
def test_generate_bodies(target, body, method):
    assert_answered(*target.call(method, "/generate", body), body)


@fuzz(100)
@given(body=fs.completion_bodies())
@example(body={"prompt": "hi", "max_tokens": 2, "model": "\ud800"}).via("UnicodeEncodeError in the answer")
def test_completion_bodies(target, body):
    assert_answered(*target.call("POST", "/v1/completions", body, headers=JSON), body)


@fuzz(100)
@given(body=fs.chat_bodies())
@example(body={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
               "chat_template_kwargs": {"messages": 1}}).via("TypeError: multiple values for 'messages'")
def test_chat_bodies(target, body):
    assert_answered(*target.call("POST", "/v1/chat/completions", body, headers=JSON), body)


ROUTE_FIELDS = {"/generate": fs.GENERATE_FIELDS, "/v1/completions": fs.COMPLETION_FIELDS,
                "/v1/chat/completions": fs.CHAT_FIELDS}
VALID_BODY = {"/generate": {"text": "Hello", "sampling_params": {"max_new_tokens": 2}},
              "/v1/completions": {"prompt": "Hello", "max_tokens": 2},
              "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}}


@pytest.mark.parametrize("route, name", [(route, name) for route, fields in ROUTE_FIELDS.items() for name in fields])
@fuzz(8)
@given(data=st.data())
def test_each_body_field_over_bad_values(target, route, name, data):
    # one bad field at a time in an otherwise valid body (the valid values get mixed in by the body tests)
    body = fs.fast_body(route, {**VALID_BODY[route], name: data.draw(ROUTE_FIELDS[route][name][1], label=name)})
    assert_answered(*target.call("POST", route, body, headers=JSON), body)


@fuzz(50)
@given(data=st.data())
def test_control_routes(target, data):
    route = data.draw(st.sampled_from(["abort", "flush", "loads", "model", "info"]))
    if route == "abort":
        body = data.draw(fs.abort_bodies)
        request = ("POST", "/abort_request", body)
    elif route == "flush":
        request = (data.draw(st.sampled_from(["GET", "POST"])), "/flush_cache", None)
    elif route == "loads":
        query = urllib.parse.urlencode(data.draw(fs.loads_queries))
        request = ("GET", f"/v1/loads?{query}", None)
    elif route == "model":
        request = ("GET", "/v1/models/" + urllib.parse.quote(data.draw(st.text(max_size=8)), safe=""), None)
    else:
        request = ("GET", data.draw(st.sampled_from(["/get_server_info", "/get_model_info", "/get_load",
                                                     "/v1/models", "/metrics", "/health_generate"])), None)
    assert_answered(*target.call(*request), request, plain_text=route == "flush")


HUGE_NUMBER_BODY = b'{"a": 1' + b"1" * 5000 + b"}"  # more digits than Python converts to an int
JSONISH = st.one_of(
    st.binary(max_size=40), fs.unicode_text.map(lambda s: s.encode("utf-8", "surrogatepass")),
    st.sampled_from([b"{", b"[]", b"null", b'{"text": NaN}', b"\xef\xbb\xbf{}", HUGE_NUMBER_BODY,
                     b'{"text": "\\ud800"}', b'{"messages": [{"role": "\xed\xa0\x80"}]}',
                     b"[" * 5000, '{"text": "hi"}'.encode("utf-16")]))


@fuzz(50)
@given(route=st.sampled_from(["/generate", "/v1/completions", "/v1/chat/completions", "/abort_request"]),
       raw=JSONISH, content_type=st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded",
                                                  "application/json; charset=latin-1", "", "application/vnd+json"]))
@example(route="/generate", raw=HUGE_NUMBER_BODY, content_type="application/json").via(
    "ValueError: an integer of more than 4300 digits")
def test_raw_bodies(target, route, raw, content_type):
    headers = {"Content-Type": content_type} if content_type else {}
    assert_answered(*target.call("POST", route, raw=raw, headers=headers), (route, raw[:80], content_type))


CONCURRENT = st.lists(st.one_of(st.tuples(st.just("/generate"), fs.generate_bodies()),
                                 st.tuples(st.just("/v1/completions"), fs.completion_bodies()),
                                 st.tuples(st.just("/v1/chat/completions"), fs.chat_bodies()),
                                 st.tuples(st.just("/abort_request"), st.just({"abort_all": True})),
                                 st.tuples(st.just("/flush_cache"), st.none())), min_size=2, max_size=6)


@fuzz(25)
@given(requests=CONCURRENT)
def test_concurrent_bodies_aborts_and_flushes(target, requests):
    # the same bodies at once, with aborts and cache flushes among them; a full queue is a fair 503 here
    def send(request: tuple[str, Any]) -> tuple[int, Any]:
        route, body = request
        return target.call("POST", route, body, headers=JSON)

    with ThreadPoolExecutor(len(requests)) as pool:
        answers = list(pool.map(send, requests))
    for request, (status, out) in zip(requests, answers, strict=True):
        if status == 503 and "queue is full" in (error_message(out) or ""):
            continue
        assert_answered(status, out, request, plain_text=request[0] == "/flush_cache")


# --- the OpenAPI schema ---------------------------------------------------------------------------------
def test_openapi_schema_fuzzing(target):
    """schemathesis, from the app's own /openapi.json, positive and negative cases of every operation; the check
    is schemathesis' `not_a_server_error`."""
    import schemathesis
    from schemathesis.checks import not_a_server_error

    schema = schemathesis.openapi.from_url(target.server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    fuzzed = [op for op in operations if op.path not in NOT_FUZZED]
    documented = {op.path for op in fuzzed if op.body}
    assert {"/generate", "/v1/completions", "/v1/chat/completions", "/abort_request"} <= documented, documented
    for operation in fuzzed:
        takes_input = bool(operation.body or operation.query or operation.path_parameters)
        modes = list(schemathesis.GenerationMode) if takes_input else [schemathesis.GenerationMode.POSITIVE]
        for mode in modes:  # negative: what the schema forbids (an operation without inputs has nothing to break)
            @fuzz(10)
            @given(case=operation.as_strategy(generation_mode=mode))
            def call(case):
                if case.path in fs.GENERATING_ROUTES:
                    fs.fast_body(case.path, case.body)
                response = case.call(base_url=target.server.url, timeout=60)
                target.statuses[response.status_code] += 1
                case.validate_response(response, checks=[not_a_server_error])

            try:
                call()
            except Unsatisfiable:  # a string path or query parameter: no value HTTP carries breaks its schema
                if mode is schemathesis.GenerationMode.POSITIVE:
                    raise
    assert_unharmed(target)


def test_the_server_survived_the_fuzzing(target):
    assert not [s for s in target.statuses if s >= 500], target.statuses
    assert_unharmed(target)
