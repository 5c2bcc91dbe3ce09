"""The bodies SGLang's router, SGLang's bench_serving and vLLM's benchmark client send (tests/client_payloads.py)
against the tiny server: every one is served, a feature tokenloom lacks is a 400 naming the field in the
route's error shape, hints and unknown fields change nothing; the fields tokenloom implements beyond the
basics (prompt token ids, chat template controls, pre-rendered chat ids, include_stop_str_in_output,
sampling_seed) are checked against an independent path; and the load routes routers poll report the load."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from transformers import AutoTokenizer

from tests.client_payloads import ACCEPTED, IGNORED_CASES, PROMPT, UNSUPPORTED_CASES, USER
from tests.e2e.server_process import http

GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def url(tiny_server):
    return tiny_server.url


@pytest.fixture(scope="module")
def tokenizer(tiny_runtime_model):
    return AutoTokenizer.from_pretrained(tiny_runtime_model)


def sse_events(text: str) -> list[Any]:
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def check_answer(route: str, body: dict[str, Any], out: Any) -> None:
    if body.get("stream"):
        events = sse_events(out)
        assert events[-1] == "[DONE]" and len(events) > 1, out
        assert not any("error" in e for e in events[:-1]), out
        return
    outs = out if isinstance(out, list) else [out]
    if route == "/generate":
        assert all(o["meta_info"]["finish_reason"]["type"] in ("length", "stop") for o in outs), out
    else:
        assert out["object"] == ("text_completion" if route == "/v1/completions" else "chat.completion"), out
        assert out["choices"] and out["usage"]["completion_tokens"] > 0, out


@pytest.mark.parametrize("route, body", ACCEPTED + IGNORED_CASES,
                         ids=[f"{r}-{i}" for i, (r, _) in enumerate(ACCEPTED + IGNORED_CASES)])
def test_client_bodies_are_served(url, route, body):
    status, out = http("POST", url + route, body)
    assert status == 200, out
    check_answer(route, body, out)


@pytest.mark.parametrize("route, body, field", UNSUPPORTED_CASES, ids=[f"{c[0]}-{c[2]}" for c in UNSUPPORTED_CASES])
def test_unsupported_values_are_a_400_naming_the_field(url, route, body, field):
    status, out = http("POST", url + route, body)
    assert status == 400, out
    message = out["error"]["message"] if route == "/generate" else out["message"]
    assert message.startswith(field), out
    assert route == "/generate" or (out["object"] == "error" and out["code"] == 400), out


def test_hints_and_unknown_fields_change_nothing(url):
    plain = http("POST", url + "/generate", {"text": PROMPT, "sampling_params": GREEDY})[1]
    hinted = http("POST", url + "/generate", {"text": PROMPT, "sampling_params": GREEDY, "priority": 9,
                                              "no_logs": True, "sampling_param": {"max_new_tokens": 1}})[1]
    assert hinted["output_ids"] == plain["output_ids"] and len(plain["output_ids"]) == 8


def test_return_prompt_token_ids(url, tokenizer):
    expected = tokenizer(PROMPT).input_ids
    status, out = http("POST", url + "/generate", {"text": PROMPT, "sampling_params": GREEDY,
                                                   "return_prompt_token_ids": True})
    assert status == 200 and out["prompt_token_ids"] == expected
    _, batch = http("POST", url + "/generate", {"input_ids": [[5, 6], [7, 8, 9]], "sampling_params": GREEDY,
                                                "return_prompt_token_ids": True})
    assert [o["prompt_token_ids"] for o in batch] == [[5, 6], [7, 8, 9]]
    _, text = http("POST", url + "/generate", {"text": PROMPT, "sampling_params": GREEDY, "stream": True,
                                               "return_prompt_token_ids": True})
    events = sse_events(text)[:-1]
    assert events and all(e["prompt_token_ids"] == expected for e in events)
    assert "prompt_token_ids" not in http("POST", url + "/generate", {"text": PROMPT, "sampling_params": GREEDY})[1]


def greedy_ids(url: str, ids: list[int], n: int = 8) -> list[int]:
    status, out = http("POST", url + "/generate", {"input_ids": ids, "sampling_params": dict(GREEDY,
                                                                                              max_new_tokens=n)})
    assert status == 200, out
    return out["output_ids"]


def test_continue_final_message_and_template_kwargs(url, tokenizer):
    messages = USER + [{"role": "assistant", "content": "It is"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    ids = tokenizer(rendered, add_special_tokens=False).input_ids
    status, out = http("POST", url + "/v1/chat/completions", {
        "messages": messages, "continue_final_message": True, "max_tokens": 8, "temperature": 0,
        "ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}})
    assert status == 200, out
    assert out["usage"]["prompt_tokens"] == len(ids)
    assert out["choices"][0]["message"]["content"] == tokenizer.decode(greedy_ids(url, ids))
    status, out = http("POST", url + "/v1/chat/completions", {"messages": USER, "add_generation_prompt": False,
                                                              "max_tokens": 2})
    no_prompt = tokenizer.apply_chat_template(USER, tokenize=False, add_generation_prompt=False)
    assert status == 200 and out["usage"]["prompt_tokens"] == len(tokenizer(no_prompt, add_special_tokens=False)
                                                                   .input_ids)


def test_chat_with_prerendered_input_ids(url, tokenizer):
    ids = tokenizer(PROMPT).input_ids
    status, out = http("POST", url + "/v1/chat/completions", {"messages": USER, "input_ids": ids, "max_tokens": 8,
                                                              "temperature": 0, "ignore_eos": True})
    assert status == 200, out
    assert out["usage"]["prompt_tokens"] == len(ids)
    assert out["choices"][0]["message"]["content"] == tokenizer.decode(greedy_ids(url, ids))


def test_include_stop_str_in_output(url):
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    full = http("POST", url + "/v1/completions", {**body, "ignore_eos": True})[1]["choices"][0]["text"]
    stop = full[len(full) // 2:len(full) // 2 + 2]
    assert stop.strip(), full
    trimmed = http("POST", url + "/v1/completions", {**body, "stop": [stop]})[1]["choices"][0]
    kept = http("POST", url + "/v1/completions", {**body, "stop": [stop], "include_stop_str_in_output": True})[1]
    cut = full.index(stop)
    assert trimmed["text"] == full[:cut] and trimmed["finish_reason"] == "stop"
    assert kept["choices"][0]["text"] == full[:cut + len(stop)]
    _, text = http("POST", url + "/v1/completions", {**body, "stop": [stop], "include_stop_str_in_output": True,
                                                     "stream": True})
    assert "".join(e["choices"][0]["text"] for e in sse_events(text)[:-1]) == full[:cut + len(stop)]
    no_trim = http("POST", url + "/v1/completions", {**body, "stop": [stop], "no_stop_trim": True})[1]
    assert no_trim["choices"][0]["text"].startswith(full[:cut + len(stop)])  # SGLang's: the whole last token


def test_sampling_seed_is_seed(url):
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "ignore_eos": True}
    by_seed = http("POST", url + "/v1/completions", {**body, "seed": 11})[1]["choices"][0]["text"]
    by_sampling_seed = http("POST", url + "/v1/completions", {**body, "sampling_seed": 11})[1]["choices"][0]["text"]
    other = http("POST", url + "/v1/completions", {**body, "sampling_seed": 12})[1]["choices"][0]["text"]
    assert by_seed == by_sampling_seed and other != by_seed


def test_load_routes_report_the_load(url, tiny_server):
    status, idle = http("GET", url + "/get_load")
    assert status == 200 and idle[0]["dp_rank"] == 0 and idle[0]["num_reqs"] == 0 and idle[0]["num_tokens"] == 0

    async def scenario(s: aiohttp.ClientSession) -> tuple[Any, Any]:
        long = {"text": PROMPT, "rid": "load-probe", "sampling_params": {"max_new_tokens": None, "ignore_eos": True}}
        task = asyncio.ensure_future(s.post(url + "/generate", json=long))
        busy = report = None
        for _ in range(400):
            await asyncio.sleep(0.05)
            async with s.get(url + "/get_load") as resp:
                busy = (await resp.json())[0]
            if busy["num_reqs"] == 1 and busy["num_tokens"] > 0:
                async with s.get(url + "/v1/loads?include=core") as resp:
                    report = await resp.json()
                break
        async with s.post(url + "/abort_request", json={"rid": "load-probe"}):
            pass
        (await task).close()
        return busy, report

    async def run() -> tuple[Any, Any]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            return await scenario(s)

    busy, report = asyncio.run(run())
    assert busy["num_reqs"] == 1 and busy["num_waiting_reqs"] == 0 and busy["num_tokens"] > 0, busy
    load = report["loads"][0]
    assert report["dp_rank_count"] == 1 and load["num_running_reqs"] == 1 and load["num_used_tokens"] > 0
    assert load["max_total_num_tokens"] == 16384 and 0 < load["token_usage"] < 1
    assert report["aggregate"]["total_reqs"] == 1
    tiny_server.wait_idle_and_pool_full()
    status, idle = http("GET", url + "/v1/loads")
    assert status == 200 and idle["loads"][0]["num_total_reqs"] == 0
    assert http("GET", url + "/v1/loads?dp_rank=1")[1]["loads"] == []
    status, text = http("GET", url + "/v1/loads?format=prometheus")
    assert status == 200 and 'tokenloom_max_total_num_tokens{dp_rank="0"} 16384' in text
    assert http("GET", url + "/v1/loads?include=bogus")[0] == 400
    assert http("GET", url + "/v1/loads?format=xml")[0] == 400
