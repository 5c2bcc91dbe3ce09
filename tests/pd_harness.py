"""A prefill and a decode scheduler in one process, paired the way two disaggregated servers are: real
`Scheduler`s, `KVMemory`s, event loops, `TransferAgent`s (ZMQ control, sender thread) and bootstrap server;
the fake worker of tests/unit/test_scheduler_fake_runner.py (its next token is the sum of the sequence read
back through the KV slots, so KV that did not arrive intact changes the tokens) or a real model's; and, in place
of a transfer engine, `MemmoveEngine` (both pools live in this process, so a write is a memmove).

`PDPair.submit` sends a request with one bootstrap room to both sides, as SGLang's router does; `run` steps
both loops until every submitted request finished on the decode side (the answer clients get) and both sides
are idle, then checks both pools are full."""

from __future__ import annotations

import ctypes
import random
import threading
import time
from typing import Any

import torch

from tests.scheduler_harness import LoopHarness, Result
from tokenloom.cache.kv_memory import KVMemory
from tokenloom.config import ServerArgs
from tokenloom.disaggregation.agent_config import SENDER_THREADS, AgentConfig
from tokenloom.disaggregation.aux_buffer import AuxBuffer
from tokenloom.disaggregation.bootstrap_server import BootstrapServer, register_rank
from tokenloom.disaggregation.decode import DecodeDisaggregation
from tokenloom.disaggregation.decode_agent import DecodeAgent
from tokenloom.disaggregation.pairing import topology_ranks
from tokenloom.disaggregation.prefill import PrefillDisaggregation
from tokenloom.disaggregation.prefill_agent import PrefillAgent
from tokenloom.disaggregation.transfer.base import TransferError
from tokenloom.ipc import IpcAddresses, Receiver
from tokenloom.protocol import Bootstrap, TokenizedRequest
from tokenloom.sampling.sampling_params import SamplingParams


class MemmoveEngine:
    """The `TransferEngine` interface within one process: a write copies the runs with memmove. `fail_next`
    makes the next writes raise, as a dead peer would."""

    backend = "memmove"

    def __init__(self) -> None:
        self.fail_next = 0
        self.writes = 0
        self.delay_s = 0.0  # each write takes this long (a slow link)
        self.tamper: Any = None  # called with the runs after they were copied (to corrupt a destination)
        # a write for which `hold_when(runs)` is true waits until `gate` is set (a transfer held back for as long
        # as a test needs)
        self.hold_when: Any = None
        self.gate = threading.Event()
        self.holding = threading.Event()  # set once a write waits at the gate (it is running, not queued)

    def register(self, addr: int, nbytes: int) -> None:
        pass

    def descriptor(self) -> str:
        return "local"

    def write(self, peer: str, runs: list[tuple[int, int, int]], timeout_s: float) -> None:
        if self.fail_next:
            self.fail_next -= 1
            raise TransferError("injected: the peer is gone")
        if self.hold_when is not None and self.hold_when(runs):
            self.holding.set()
            self.gate.wait()
        if self.delay_s:
            time.sleep(self.delay_s)
        for src, dst, n in runs:
            ctypes.memmove(dst, src, n)
        if self.tamper is not None:
            self.tamper(runs)
        self.writes += 1

    def expect_incoming(self, active: bool) -> None:
        pass

    def close(self) -> None:
        pass


class MergedInbox:
    """The loop's inbox: what the test sends (a `LocalChannel`) and what the agent pushes (ZMQ)."""

    def __init__(self, local: Any, events: Receiver) -> None:
        self.local, self.events = local, events

    def recv_all(self, timeout_ms: int = 0) -> list[Any]:
        return self.local.recv_all() + self.events.recv_all()


class PDSide:
    def __init__(self, role: str, harness: LoopHarness, bootstrap_port: int, kv_dtype: str | None = None,
                 **agent_config: Any) -> None:
        """`kv_dtype`: what the agent registers / expects (default: its pool's dtype, as rank_setup.py does)."""
        self.role, self.h = role, harness
        kv_dtype = kv_dtype or str(harness.memory.kv_pool.dtype).removeprefix("torch.")
        addresses = IpcAddresses.fresh()
        self.events = Receiver(harness.scheduler_ctx, addresses.scheduler)
        harness.loop.inbox = MergedInbox(harness.inbox, self.events)
        pool = harness.memory.kv_pool
        world = topology_ranks(pool.end_layer, pool.num_kv_heads, 1, 1)  # one rank holding the whole pool
        config = AgentConfig(role=role, me=world[0], world=world, host="127.0.0.1", page_size=harness.args.page_size,
                             kv_dtype=kv_dtype, events_address=addresses.scheduler, **agent_config)
        memory = harness.memory
        self.aux = AuxBuffer(memory.request_slots if role == "decode" else SENDER_THREADS)
        self.engine = MemmoveEngine()
        agent_class = PrefillAgent if role == "prefill" else DecodeAgent
        self.agent = agent_class(config, self.engine, memory.kv_pool.layout(0), self.aux)
        self.agent.set_world_control([self.agent.control_address])
        if isinstance(self.agent, PrefillAgent):
            register_rank("127.0.0.1", bootstrap_port, self.agent.registration(1, 1))
            self.side: Any = PrefillDisaggregation(harness.scheduler, self.agent)
        else:
            assert isinstance(self.agent, DecodeAgent)
            self.side = DecodeDisaggregation(harness.scheduler, self.agent, self.aux)
        harness.scheduler.set_port(self.side)

    def close(self) -> None:
        self.agent.close()


class PDPair:
    def __init__(self, make_harness: Any, prefill_args: dict[str, Any] | None = None,
                 decode_args: dict[str, Any] | None = None, decode_kv_dtype: str | None = None,
                 **agent_config: Any) -> None:
        """`make_harness(**server_args) -> (LoopHarness, worker)`: builds one side (the test's fake)."""
        import zmq

        self.bootstrap = BootstrapServer("127.0.0.1", 0, expected_ranks=1)
        self.bootstrap.start()
        self.ctx = zmq.Context()
        self.prefill_h, self.prefill_worker = make_harness(disaggregation_mode="prefill", **(prefill_args or {}))
        self.decode_h, self.decode_worker = make_harness(disaggregation_mode="decode", disable_radix_cache=True,
                                                         **(decode_args or {}))
        for h in (self.prefill_h, self.decode_h):
            h.scheduler_ctx = self.ctx
        port = self.bootstrap.port
        self.prefill = PDSide("prefill", self.prefill_h, port, **agent_config)
        self.decode = PDSide("decode", self.decode_h, port, kv_dtype=decode_kv_dtype, **agent_config)
        self.rooms: dict[str, int] = {}

    def submit(self, rid: str, ids: list[int], params: dict[str, Any], to: tuple[str, ...] = ("prefill", "decode"),
               host: str = "127.0.0.1", **kw: Any) -> None:
        room = self.rooms.setdefault(rid, random.getrandbits(62) + 1)
        for name in to:
            h = self.prefill_h if name == "prefill" else self.decode_h
            sp = SamplingParams.from_dict(params, h.vocab_size)
            h.inbox.send(TokenizedRequest(rid, None, list(ids), sp, bootstrap=Bootstrap(host, self.bootstrap.port,
                                                                                       room), **kw))

    def abort(self, rid: str, on: str) -> None:
        (self.prefill_h if on == "prefill" else self.decode_h).abort(rid)

    def step(self) -> bool:
        busy = False
        for h in (self.prefill_h, self.decode_h):
            busy |= bool(h.loop.run_once())
            h._collect()
        return busy

    def run(self, rids: list[str] | None = None, timeout_s: float = 30.0) -> dict[str, Result]:
        """Step until every rid (default: all submitted) finished on the decode side and both sides idle."""
        wanted = list(self.rooms) if rids is None else rids
        deadline = time.monotonic() + timeout_s
        while True:
            busy = self.step()
            done = all(self.decode_h.results.get(r) is not None and self.decode_h.results[r].finish_reason
                       is not None for r in wanted)
            if done and self.prefill_h.scheduler.is_idle() and self.decode_h.scheduler.is_idle():
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"not done: decode {self.decode_h.results}, prefill {self.prefill_h.results}, "
                                     f"prefill {self.prefill.side.info()}, decode {self.decode.side.info()}")
            if not busy:
                time.sleep(0.002)
        self.step()  # a final pass lets the idle checks run
        for h in (self.prefill_h, self.decode_h):
            h.scheduler.check_idle_integrity()
        return self.decode_h.results

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()
        self.bootstrap.stop()
        self.ctx.destroy(linger=0)


def small_memory(args: ServerArgs, tokens: int, context: int) -> KVMemory:
    return KVMemory.build(tokens=tokens, request_slots=args.max_running_requests, context_len=context,
                          page_size=args.page_size, num_kv_heads=1, head_dim=1, dtype=torch.float32,
                          device=torch.device("cpu"), start_layer=0, end_layer=1,
                          disable_radix_cache=args.disable_radix_cache)
