"""The scheduler's step lines at INFO in SGLang's wording (a prefill line per batch: new requests, new and
cached tokens, token usage, running and queued requests; health probes only at DEBUG), and the weight
loader's final line against the checkpoint's own parameter count. Tiny random model, in-process."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from tests.scheduler_harness import Harness
from tokenloom.config import ServerArgs
from tokenloom.distributed.parallel_state import SINGLE_PROCESS
from tokenloom.models.loader import load_model, resolve_model_source

GREEDY = {"temperature": 0, "ignore_eos": True}
POOL = 1000
PREFILL = re.compile(r"^Prefill batch\. #new-seq: (\d+), #new-token: (\d+), #cached-token: (\d+), "
                     r"token usage: (\d\.\d\d), #running-req: (\d+), #queue-req: (\d+)$")


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return tiny_model_dir("llama")


def prefill_lines(caplog, level: int = logging.INFO) -> list[tuple[int, ...]]:
    found = []
    for record in caplog.records:
        match = PREFILL.match(record.getMessage())
        if match and record.levelno == level:
            found.append(tuple(float(g) if "." in g else int(g) for g in match.groups()))
    return found


def test_prefill_lines(tiny, caplog):
    prompt = list(range(1, 101))
    h = Harness(tiny[0], max_total_tokens=POOL, max_running_requests=2, decode_slot_run=1)
    with caplog.at_level(logging.INFO, logger="tokenloom.scheduler"):
        h.submit("a", prompt, dict(GREEDY, max_new_tokens=40))
        h.run(until=lambda hh: len(hh.scheduler.running) == 1)
        # b shares a's cached prompt; c waits for a request slot (2) behind b, d behind c
        h.submit("b", prompt + [7] * 20, dict(GREEDY, max_new_tokens=2))
        h.submit("c", [9] * 30, dict(GREEDY, max_new_tokens=2))
        h.submit("d", [8] * 30, dict(GREEDY, max_new_tokens=2))
        h.run(until=lambda hh: "b" in hh.results and len(hh.scheduler.running) == 2)
    lines = prefill_lines(caplog)
    assert lines[0] == (1, 100, 0, 0.10, 0, 0)  # 100 of 1000 KV tokens once its prompt is allocated
    new_seq, new, cached, usage, running, queued = lines[1]
    assert (new_seq, new, cached, running, queued) == (1, 20, 100, 1, 2)
    decoded = len(next(r for r in h.scheduler.running if r.rid == "a").output_ids)  # at least as many as then
    assert 120 / POOL <= usage <= (120 + decoded + 1) / POOL + 0.005
    h.run()


def test_health_probe_prefills_are_debug_only(tiny, caplog):
    h = Harness(tiny[0], max_total_tokens=POOL)
    with caplog.at_level(logging.DEBUG, logger="tokenloom.scheduler"):
        h.submit("HEALTH_CHECK_1", [0], {"max_new_tokens": 1, "temperature": 0})
        h.run()
        h.submit("user", [5, 6, 7], {"max_new_tokens": 1, "temperature": 0})
        h.run()
    assert prefill_lines(caplog, logging.DEBUG) == [(1, 1, 0, 0.0, 0, 0)]
    assert [line[:3] for line in prefill_lines(caplog, logging.INFO)] == [(1, 3, 0)]


def test_loader_reports_the_checkpoints_parameters(tiny, caplog):
    folder, reference = tiny
    source = resolve_model_source(ServerArgs(model_path=folder))
    with caplog.at_level(logging.INFO, logger="tokenloom.models.loader"):
        model = load_model(source, torch.float32, torch.device("cpu"), SINGLE_PROCESS)
    params = sum(p.numel() for p in reference.parameters())  # transformers' count of the same checkpoint
    assert sum(p.numel() for p in model.parameters()) == params
    final = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Loaded weights")]
    assert len(final) == 1
    assert re.fullmatch(rf"Loaded weights: 2/2 layers, {params / 1000:.1f}K parameters \(float32\), 0\.00 GiB in "
                        r"memory, in \d+\.\d s", final[0]), final[0]
