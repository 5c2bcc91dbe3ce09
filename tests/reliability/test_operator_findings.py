"""What issue 20's operator found against a small-pool server, each fixed and checked black-box through HTTP:
a valid request bigger than the KV pool, a prompt of megabytes, a fan-out beyond what the server holds, a
stream refused for a full queue. After each the server still serves and its pool is full again."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import aiohttp

from tests.e2e.server_process import http

VOCAB = 49152


def greedy(max_new_tokens: int) -> dict:
    return {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}


def assert_serving(server) -> None:
    status, out = http("POST", server.url + "/generate", {"text": "Still there?", "sampling_params": greedy(3)})
    assert status == 200 and out["meta_info"]["completion_tokens"] == 3, out
    server.wait_idle_and_pool_full()


def test_a_request_bigger_than_the_kv_pool_is_clamped_to_it_and_the_server_lives(small_pool_server):
    # 2,898 prompt tokens + 302 new ones: each within the limits, together more than the 3,000-slot pool. It used
    # to run until the pool ran out, answer 500 "Out of memory even after retracting" and take the server down.
    pool = small_pool_server.server_info()["max_total_num_tokens"]
    ids = [random.Random(7).randrange(1, VOCAB) for _ in range(2898)]
    status, out = http("POST", small_pool_server.url + "/generate", {"input_ids": ids, "sampling_params": greedy(302)})
    assert status == 200, out
    assert out["meta_info"]["finish_reason"]["type"] == "length", out["meta_info"]
    assert out["meta_info"]["completion_tokens"] == pool - 2898 - 1  # SGLang's clamp: prompt + outputs < pool
    assert small_pool_server.proc.poll() is None
    assert_serving(small_pool_server)


def test_a_prompt_of_megabytes_is_refused_at_once_and_tokenizing_never_blocks_other_requests(small_pool_server):
    url = small_pool_server.url
    started = time.monotonic()
    status, out = http("POST", url + "/generate", {"text": "lorem ipsum " * 420_000})  # 5 MB
    assert status == 400 and "characters) is longer than the model's context length" in out["error"]["message"]
    assert time.monotonic() - started < 2.0  # it took 4 s of tokenizing before (refused on its length now)
    # A prompt just short of that bound is tokenized (~0.5 s here), off the event loop: a request sent while it
    # is being tokenized is answered first. On the loop, nothing else would run until its 400.
    bound_chars = 4096 * 81  # context x the longest SmolLM2 vocabulary entry
    text = " ".join(str(i) for i in range(bound_chars // 7))[: bound_chars - 10]
    order: list[str] = []

    def long_prompt() -> None:
        status, out = http("POST", url + "/generate", {"text": text})
        assert status == 400 and "tokens) is longer than the model's context length" in out["error"]["message"]
        order.append("long prompt refused")

    worker = threading.Thread(target=long_prompt)
    worker.start()
    time.sleep(0.15)
    status, _ = http("GET", url + "/get_model_info")
    order.append("model info answered")
    worker.join()
    assert status == 200
    assert order == ["model info answered", "long prompt refused"]
    assert_serving(small_pool_server)


def test_a_fan_out_beyond_what_the_server_can_hold_is_a_400_at_once(small_pool_server):
    url = small_pool_server.url  # 48 queued at most: a request's generations all arrive in the queue together
    started = time.monotonic()
    status, out = http("POST", url + "/generate", {"text": "Hi", "sampling_params": {"n": 100}})
    assert status == 400 and "asks for 100 generations" in out["error"]["message"], out
    status, out = http("POST", url + "/generate", {"text": ["Hi"] * 80})
    assert status == 400 and "asks for 80 generations" in out["error"]["message"], out
    status, out = http("POST", url + "/v1/completions", {"prompt": "Hi", "n": 49})
    assert status == 400 and "asks for 49 generations" in out["message"], out
    assert time.monotonic() - started < 2.0  # no queueing before the answer
    status, out = http("POST", url + "/generate", {"text": "Hi", "sampling_params": {**greedy(2), "n": 48}})
    assert status == 200 and len(out) == 48  # exactly the queue is fine
    assert_serving(small_pool_server)


def test_a_stream_refused_for_a_full_queue_gets_503_not_a_200_stream(small_pool_server):
    url = small_pool_server.url

    async def scenario() -> list[tuple[int, str]]:
        async with aiohttp.ClientSession() as session:
            body = {"text": "Keep going", "sampling_params": greedy(3000)}

            async def hold() -> int:
                async with session.post(url + "/generate", json=body) as resp:
                    await resp.read()
                    return resp.status

            # 24 fill the running batch, 48 the queue. Requests that arrive together can all be queued before
            # the scheduler admits any (the later ones are then refused) and retraction moves running ones back
            # to the queue, so the queue is topped up until it holds 48.
            holders = [asyncio.ensure_future(hold()) for _ in range(24 + 48)]
            deadline = time.monotonic() + 60
            while True:
                await asyncio.sleep(0.5)
                async with session.get(url + "/get_server_info") as resp:
                    info = await resp.json()
                state = {key: info[key] for key in ("num_running_reqs", "num_waiting_reqs")}
                if state["num_waiting_reqs"] >= 48:
                    break
                assert time.monotonic() < deadline, state
                in_flight = sum(not holder.done() for holder in holders)
                holders += [asyncio.ensure_future(hold()) for _ in range(24 + 48 - in_flight)]
            answers = []
            for route, stream_body in (("/generate", {"text": "Hi", "stream": True}),
                                       ("/v1/completions", {"prompt": "Hi", "stream": True}),
                                       ("/v1/chat/completions",
                                        {"messages": [{"role": "user", "content": "Hi"}], "stream": True})):
                async with session.post(url + route, json=stream_body) as resp:
                    answers.append((resp.status, await resp.text()))
            async with session.post(url + "/abort_request", json={"abort_all": True}) as resp:
                assert resp.status == 200
            statuses = await asyncio.gather(*holders)
            # aborted by the client: a normal answer; or refused (retracted requests count as queued as well)
            assert set(statuses) <= {200, 503} and statuses.count(200) >= 24, statuses
            return answers

    answers = asyncio.run(scenario())
    for status, text in answers:
        assert status == 503 and "queue is full" in text, (status, text)
    assert_serving(small_pool_server)
