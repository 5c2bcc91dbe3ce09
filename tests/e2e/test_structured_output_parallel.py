"""Structured output, forced tool calls and reasoning under pipeline parallelism and in a prefill/decode pair,
end to end with the real `openai` client (and a slow grammar under TP and PP):
- `--pp-size 2`: the last stage samples under the grammar's mask and advances the matchers; stage 0 applies the
  outputs (a grammar's end included) it receives;
- a PD pair (mooncake) behind SGLang's router: the prefill server samples the first token under the grammar,
  the decode server compiles the same grammar, advances its matcher by that token and continues from there.

Judges: `jsonschema` and `re.fullmatch` on every answer, and the unified session server (`tiny_server`: same
weights and flags): a greedy constrained answer equals its answer token for token, i.e. the decode side's
grammar state after the prefill side's token is the one a single server has. The regex `YES_NO` starts with a
choice of words, so a decode side that restarted its grammar (or ran without one) after the prefill's first
token would fail the full match. Bad grammars are 400s naming the problem, and every pool ends full (each PP
stage's; the prefill and the decode server's, with no queue or transfer record left).

A grammar slow to compile stalls no other request under `--tp-size 2` or `--pp-size 2` (issue 32: the entry
rank decides when it is let in, scheduler/grammar_sync.py): the TP and PP servers run with the compiler's
test hook (TOKENLOOM_TEST_SLOW_GRAMMAR, grammar/compiler.py) holding every compile of `SLOW_REGEX` for
`SLOW_S` seconds on every rank, while an unconstrained stream's tokens must keep arriving.

The four servers start together (module scope); the tool-calling template is test_tool_calls.py's
(`--chat-template`).
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.e2e.conftest import TINY_FLAGS
from tests.e2e.server_process import ServerProcess, free_port, http
from tests.e2e.test_disaggregation import Router, _assert_idle_and_full
from tests.e2e.test_structured_output import SCHEMAS
from tests.e2e.test_tool_calls import template_file  # noqa: F401 (a fixture)
from tests.e2e.tool_checks import TOOLS, USER, check_calls

jsonschema = pytest.importorskip("jsonschema")

FLAGS = (*TINY_FLAGS, "--tool-call-parser", "qwen25", "--reasoning-parser", "qwen3")
TARGETS = ["pp", "pd"]
YES_NO = r"(yes|no): [a-z]{2,6}( [a-z]{2,6}){0,2}\."
SLOW_S = 3.0  # how long each rank's compile of SLOW_REGEX sleeps (the test hook)
SLOW_REGEX = r"(slowgrammar )?(yes|no): [a-z]{2,6}( [a-z]{2,6}){0,2}\."  # the hook matches "slowgrammar"
SLOW_ENV = {"TOKENLOOM_TEST_SLOW_GRAMMAR": f"{SLOW_S}:slowgrammar"}
REASONING = r"<think>\n[a-z]{2,6}( [a-z]{2,6}){1,3}\n</think>\n\n[A-Z][a-z]{2,6}( [a-z]{2,6}){0,3}\."


@pytest.fixture(scope="module")
def stack(tiny_runtime_model, template_file, request):  # noqa: F811 (template_file: the fixture imported above)
    """{"pp", "pd", "tp", "unified"}: base URLs, and the servers (pp, prefill, decode, tp)."""
    bootstrap = free_port()
    flags = ("--model-path", tiny_runtime_model, "--chat-template", template_file, *FLAGS)
    pp = ServerProcess(*flags, "--pp-size", "2", env=SLOW_ENV)
    tp = ServerProcess(*flags, "--tp-size", "2", "--dist-init-addr", f"127.0.0.1:{free_port()}", env=SLOW_ENV)
    prefill = ServerProcess(*flags, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
                            str(bootstrap))
    decode = ServerProcess(*flags, "--disaggregation-mode", "decode")
    servers, router = (pp, prefill, decode, tp), None
    try:
        unified = request.getfixturevalue("tiny_server")  # (while the three start)
        for server in servers:
            server.wait_healthy(timeout=900)
        router = Router(prefill, bootstrap, decode).wait_ready()
        yield {"pp": pp.url, "pd": router.url, "tp": tp.url, "unified": unified.url}, servers
    finally:
        if router is not None:
            router.stop()
        for server in servers:
            server.stop()
    for server in servers:
        assert "Traceback" not in server.logs(), server.logs()


def _client(url: str):
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def _generate(url: str, text: str, **params) -> dict:
    status, body = http("POST", url + "/generate", {"text": text, "sampling_params": params}, timeout=120)
    assert status == 200, body
    return body


@pytest.mark.parametrize("target", TARGETS)
def test_generate_greedy_equals_the_unified_server_and_sampled_answers_fullmatch(stack, target):
    urls, _ = stack
    schema = json.dumps(SCHEMAS["nested"])
    for text, params in (("Answer:", {"regex": YES_NO, "max_new_tokens": 40}),
                         ("Person:", {"json_schema": schema, "max_new_tokens": 120})):
        want = _generate(urls["unified"], text, temperature=0, **params)
        got = _generate(urls[target], text, temperature=0, **params)
        assert got["text"] == want["text"], (got["text"], want["text"])
        assert got["meta_info"]["completion_tokens"] == want["meta_info"]["completion_tokens"]
        assert got["meta_info"]["finish_reason"]["type"] == "stop", got["meta_info"]
    jsonschema.validate(json.loads(got["text"]), SCHEMAS["nested"])
    with ThreadPoolExecutor(4) as pool:
        sampled = list(pool.map(lambda seed: _generate(urls[target], "Answer:", regex=YES_NO, max_new_tokens=40,
                                                       temperature=1.0, sampling_seed=seed), range(4)))
    for body in sampled:
        assert re.fullmatch(YES_NO, body["text"]), body["text"]
        assert body["meta_info"]["finish_reason"]["type"] == "stop"


@pytest.mark.parametrize("target", TARGETS)
def test_response_format_json_schema_validates(stack, target):
    urls, _ = stack
    jobs = [(name, knobs) for name in ("flat", "enum_anyof", "pattern_optional")
            for knobs in ({"temperature": 0}, {"temperature": 1.0, "seed": 7})]
    with _client(urls[target]) as oai, ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda job: oai.chat.completions.create(
            model="m", messages=[{"role": "user", "content": f"Describe {job[0]}"}], max_tokens=120,
            response_format={"type": "json_schema", "json_schema": {"name": job[0], "schema": SCHEMAS[job[0]],
                                                                    "strict": True}}, **job[1]), jobs))
    for (name, _), answer in zip(jobs, answers, strict=True):
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", (name, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])


@pytest.mark.parametrize("target", TARGETS)
def test_forced_tool_calls_and_reasoning(stack, target):
    urls, _ = stack
    with _client(urls[target]) as oai:
        for seed in (1, 2):
            choice = oai.chat.completions.create(model="m", messages=USER, tools=TOOLS, tool_choice="required",
                                                 temperature=1.0, seed=seed, max_tokens=200,
                                                 parallel_tool_calls=False).choices[0]
            assert choice.finish_reason == "tool_calls", choice
            check_calls(choice.message.tool_calls, {"get_weather", "add"})
        named = oai.chat.completions.create(model="m", messages=USER, tools=TOOLS, temperature=1.0, seed=9,
                                            max_tokens=200, parallel_tool_calls=False,
                                            tool_choice={"type": "function", "function": {"name": "add"}})
        check_calls(named.choices[0].message.tool_calls, {"add"})
        kwargs = dict(model="m", messages=USER, temperature=1.0, seed=3, max_tokens=80, extra_body={"regex": REASONING})
        msg = oai.chat.completions.create(**kwargs).choices[0].message
        assert re.fullmatch(r"[a-z]{2,6}( [a-z]{2,6}){1,3}\n", msg.reasoning_content), msg
        assert re.fullmatch(r"[A-Z][a-z]{2,6}( [a-z]{2,6}){0,3}\.", msg.content), msg
        reasoning = content = ""
        for chunk in oai.chat.completions.create(stream=True, **kwargs):
            if chunk.choices:
                reasoning += getattr(chunk.choices[0].delta, "reasoning_content", None) or ""
                content += chunk.choices[0].delta.content or ""
        assert (reasoning, content) == (msg.reasoning_content, msg.content)


@pytest.mark.parametrize("target", TARGETS)
def test_bad_grammars_are_400s_and_every_pool_ends_full(stack, target):
    import openai

    urls, (pp, prefill, decode, _) = stack
    status, body = http("POST", urls[target] + "/generate", {"text": "x", "sampling_params": {"regex": "a("}})
    assert status == 400 and "invalid regex" in json.dumps(body), (status, body)
    with _client(urls[target]) as oai, pytest.raises(openai.BadRequestError, match="required must be an array"):
        oai.chat.completions.create(model="m", messages=USER, max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object", "required": 5}}})
    assert _generate(urls[target], "Answer:", regex=YES_NO, max_new_tokens=40)["text"]  # still serving
    if target == "pp":
        info = pp.wait_idle_and_pool_full()
        assert all(s["available_kv_tokens"] + s["evictable_kv_tokens"] == s["max_total_num_tokens"]
                   for s in info["pp_stages"]), info["pp_stages"]
    else:
        _assert_idle_and_full(prefill)
        _assert_idle_and_full(decode)


def _stream_times(url: str, started: threading.Event, stop: threading.Event, times: list[float]) -> None:
    """Stream a long unconstrained /generate, appending each event's arrival time, until `stop`; then drop the
    connection (the server aborts the request)."""
    body = {"text": "Once upon a time", "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 6000, "ignore_eos": True}}
    request = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        for raw in response:
            if raw.startswith(b"data:") and raw.strip() != b"data: [DONE]":
                times.append(time.monotonic())
                started.set()
            if stop.is_set():
                break


@pytest.mark.parametrize("target", ["tp", "pp"])
def test_a_slow_grammar_compile_stalls_no_other_request(stack, target):
    """While every rank's compile of SLOW_REGEX sleeps SLOW_S seconds, an unconstrained stream's tokens keep
    arriving (its largest gap stays far below SLOW_S); then the constrained request is served, its greedy
    answer the unified server's, every rank agreeing and every pool full."""
    urls, (pp, _, _, tp) = stack
    want = _generate(urls["unified"], "Answer:", regex=SLOW_REGEX, temperature=0, max_new_tokens=40)
    times: list[float] = []
    started, stop = threading.Event(), threading.Event()
    streamer = threading.Thread(target=_stream_times, args=(urls[target], started, stop, times), daemon=True)
    streamer.start()
    try:
        assert started.wait(60), "the stream never started"
        start = time.monotonic()
        got = _generate(urls[target], "Answer:", regex=SLOW_REGEX, temperature=0, max_new_tokens=40)
        end = time.monotonic()
    finally:
        stop.set()
        streamer.join(60)
    assert end - start >= SLOW_S, "the grammar was not held in compilation (the test hook)"
    during = [t for t in times if start <= t <= start + SLOW_S]
    gaps = [b - a for a, b in zip([start, *during], [*during, start + SLOW_S], strict=True)]
    print(f"{target}: {len(during)} stream events in the {SLOW_S:g} s compile, largest gap {max(gaps):.3f} s")
    assert len(during) >= 10 and max(gaps) < SLOW_S / 3, (len(during), max(gaps))
    assert got["text"] == want["text"] and re.fullmatch(SLOW_REGEX, got["text"]), (got["text"], want["text"])
    assert got["meta_info"]["finish_reason"]["type"] == "stop", got["meta_info"]
    server = tp if target == "tp" else pp
    info = server.wait_idle_and_pool_full()
    if target == "tp":
        assert info["tp_ranks_agree"] is True
    else:
        assert all(s["available_kv_tokens"] + s["evictable_kv_tokens"] == s["max_total_num_tokens"]
                   for s in info["pp_stages"]), info["pp_stages"]
