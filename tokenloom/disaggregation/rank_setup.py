"""Making a scheduler rank one rank of a prefill or decode server (called by entrypoints/scheduler_process.py).

Per rank: the transfer engine (`--disaggregation-transfer-backend`); the metadata buffer (decode: one slot
per request row; prefill: a staging slot per sender thread); the role's agent (`PrefillAgent` / `DecodeAgent`)
with this rank's KV pool registered; the control addresses of every rank of the server (all-gathered over the
world CPU group); the prefill ranks' registration with the bootstrap service the prefill server's HTTP process
runs; and the role's side (`PrefillDisaggregation` / `DecodeDisaggregation`), made the scheduler's request port.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

import torch

from tokenloom.cache.kv_memory import KVMemory
from tokenloom.config import ServerArgs
from tokenloom.disaggregation.agent import TransferAgent
from tokenloom.disaggregation.agent_config import SENDER_THREADS, AgentConfig
from tokenloom.disaggregation.aux_buffer import AuxBuffer
from tokenloom.disaggregation.bootstrap_server import register_rank
from tokenloom.disaggregation.decode import DecodeDisaggregation
from tokenloom.disaggregation.decode_agent import DecodeAgent
from tokenloom.disaggregation.pairing import topology_ranks
from tokenloom.disaggregation.prefill import PrefillDisaggregation
from tokenloom.disaggregation.prefill_agent import PrefillAgent
from tokenloom.disaggregation.transfer.factory import make_engine
from tokenloom.distributed.parallel_state import ParallelContext
from tokenloom.distributed.pp_partition import partition_from_env
from tokenloom.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


def advertised_host(host: str) -> str:
    """The address peers on other machines reach this one at: `--host`, or this machine's name's address
    when the server listens on every interface."""
    if host in ("0.0.0.0", "::", ""):
        return socket.gethostbyname(socket.gethostname())
    return host


def attach_disaggregation(args: ServerArgs, parallel: ParallelContext, scheduler: Scheduler, memory: KVMemory,
                          num_layers: int, num_kv_heads: int, events_address: str | None) -> TransferAgent:
    """Build this rank's agent and side and make the side `scheduler`'s request port; returns the agent (closed by the
    caller at exit). `events_address`: the entry rank's scheduler inbox (None on every other rank)."""
    world = topology_ranks(num_layers, num_kv_heads, parallel.tp_size, parallel.pp_size, partition_from_env())
    me = world[parallel.rank]
    host = advertised_host(args.host)
    decode = args.disaggregation_mode == "decode"
    aux = AuxBuffer(memory.request_slots if decode else SENDER_THREADS)  # prefill: a staging slot per sender
    engine = make_engine(args.disaggregation_transfer_backend, host)
    config = AgentConfig(role=args.disaggregation_mode, me=me, world=world, host=host, page_size=args.page_size,
                         kv_dtype=str(memory.kv_pool.dtype).removeprefix("torch."),
                         events_address=events_address if parallel.is_entry else None,
                         expected_decode_tp=args.disaggregation_decode_tp)
    agent_class = DecodeAgent if decode else PrefillAgent
    agent = agent_class(config, engine, memory.kv_pool.layout(me.head_start), aux)
    addresses = [agent.control_address]
    if parallel.world_size > 1:
        gathered: list[Any] = [None] * parallel.world_size
        torch.distributed.all_gather_object(gathered, agent.control_address, group=parallel.world_cpu_group)
        addresses = gathered
    agent.set_world_control(addresses)
    if isinstance(agent, DecodeAgent):
        scheduler.set_port(DecodeDisaggregation(scheduler, agent, aux))
    else:
        assert isinstance(agent, PrefillAgent)
        local = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host  # the HTTP process, same node
        register_rank(local, args.disaggregation_bootstrap_port, agent.registration(parallel.tp_size,
                                                                                         parallel.pp_size))
        scheduler.set_port(PrefillDisaggregation(scheduler, agent))
    logger.info("Disaggregation: %s rank %d, %s transfer engine, control %s", args.disaggregation_mode,
                parallel.rank, engine.backend, agent.control_address)
    return agent
