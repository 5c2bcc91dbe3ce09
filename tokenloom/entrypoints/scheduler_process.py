"""Scheduler process entry (one per rank): join the world, load this rank's shard of the weights, build the
rank's `KVMemory` once and hand it to both the model runner and the scheduler, wrap the runner in the
worker, report readiness, run the loop.

At tp_size > 1 (launched by `tokenloom/entrypoints/launcher.py`, one process per rank):
- `init_distributed` joins the rendezvous at `dist_init_addr` and builds the rank's `ParallelContext`;
- the KV capacity and request slots are MIN-reduced over the world before the pool is built, so every rank
  holds pools of the same size and schedules within the same limits;
- only the entry rank (tp 0) binds the socket the tokenizer manager sends to, and only its outputs go to the
  detokenizer; every rank runs the same loop over the entry's broadcast messages (scheduler/rank_sync.py);
- sampling: every rank samples from the same all-gathered float32 logits with the same seeds (the Sampler's
  generator is seeded from --random-seed and advanced by the same calls; per-request seeds hash the request's
  seed and position), so every rank draws the same tokens without a broadcast. Checked with temperature > 0
  in tests/integration/test_tensor_parallel.py.

At pp_size > 1 each stage loads only its layers (`pp_partition.stage_layers`) and holds KV for them only;
every stage runs a `PipelineLoop` (scheduler/pipeline_loop.py) with pp_size + --pp-async-batch-depth lanes;
only stage 0 reads requests (its TP ranks through the broadcast inbox) and passes them down the stages.
With either, the entry rank alone decides when a request waiting for its grammar is let in or refused, and
its decisions join the messages it shares (scheduler/grammar_sync.py).

A hung peer: collectives wait at most --dist-timeout (default 300 s); a rank whose collective failed names
the peers whose heartbeat stopped (distributed/heartbeat.py) in its error. A hung forward on this rank (a
stuck kernel, a deadlocked collective): once serving, the rank's `ForwardWatchdog` (scheduler/watchdog.py,
--watchdog-timeout, default 300 s) trips after a step has run that long; the rank logs every thread's stack,
reports "watchdog: a forward step has not returned for N s" like any failure below (on a socket of its
own: the hung threads may hold the others) and exits 1 at once, without unwinding the hung threads.

Readiness is reported through a pipe as {"status": "ready", "max_total_num_tokens", "max_req_input_len",
"context_len", "vocab_size", "native_decode_max_batch", and what the rank measured while starting:
scheduler/rank_report.py} (or {"status": "error", ...}); after that, a fatal
error is reported to the engine as a `ProcessFailed` message (naming the rank) through the detokenizer before
the process exits non-zero. Every rank on node 0 has that failure channel; only the entry rank sends outputs
on it.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import time
from typing import Any

from tokenloom.config import ServerArgs

WATCHDOG_EXIT_CODE = 1
RENDEZVOUS_TIMEOUT_S = 120.0
# How long a collective waits for its peers once the world is assembled (--dist-timeout): it bounds how long a
# hung or unreachable rank can stall the others, and must cover the longest legitimate wait between ranks
# (one rank still loading weights while the others wait in the start-up MIN-reduce).
DEFAULT_DIST_TIMEOUT_S = 300.0


class ForwardHungError(RuntimeError):
    """A forward step outlived --watchdog-timeout (raised nowhere: it names the failure in the report)."""


def rank_label(rank: int, tp_size: int, pp_size: int) -> str:
    """How logs and errors name a scheduler rank: "scheduler" alone in a one-rank world."""
    if tp_size * pp_size == 1:
        return "scheduler"
    return f"scheduler rank {rank} (tp {rank % tp_size}, pp {rank // tp_size})"


def exit_hung(name: str, reason: str, ready: Any, ctx: Any, addresses: Any) -> None:
    """The watchdog tripped (on its own thread; the forward, and maybe more, is stuck): log every thread's
    stack, report the reason through a new socket (the hung threads may hold the loop's) and the ready pipe,
    and exit without unwinding the stuck threads."""
    from tokenloom.frontend.process_utils import report_failure
    from tokenloom.ipc import Sender

    logging.getLogger(name).error("%s: %s; the stacks of its threads:", name, reason)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    report_failure(name, ForwardHungError(reason), ready,
                   Sender(ctx, addresses.detokenizer) if addresses is not None else None)
    os._exit(WATCHDOG_EXIT_CODE)


def run_scheduler_process(args: ServerArgs, addresses: Any, ready: Any, rank: int = 0,
                          dist_init_addr: str | None = None, cpu_cores: list[int] | None = None) -> None:
    bind_error: Exception | None = None
    if cpu_cores is not None:  # before any thread starts (torch's, gloo's, ZMQ's): they all inherit it
        from tokenloom.distributed.cpu_binding import CoreBindingError, bind_this_process

        try:
            bind_this_process(cpu_cores)
        except CoreBindingError as e:  # raised again below, where every start-up failure is reported
            bind_error = e
    import zmq

    from tokenloom.device import resolve_device
    from tokenloom.distributed.comm import all_equal, all_gather_pyobj, min_reduce_ints
    from tokenloom.distributed.groups import init_distributed
    from tokenloom.distributed.heartbeat import Heartbeat, name_silent_peers
    from tokenloom.distributed.pp_partition import partition_from_env, stage_layers
    from tokenloom.executor.model_runner import LoadedModel, ModelRunner
    from tokenloom.executor.worker import ModelWorker
    from tokenloom.frontend.process_utils import child_process_setup, report_failure
    from tokenloom.ipc import Receiver, Sender
    from tokenloom.models.loader import resolve_model_source
    from tokenloom.scheduler.grammar_sync import lockstep_grammar
    from tokenloom.scheduler.loops import make_event_loop
    from tokenloom.scheduler.profiler import TraceProfiler
    from tokenloom.scheduler.rank_report import rank_report
    from tokenloom.scheduler.rank_sync import BroadcastInbox, discard
    from tokenloom.scheduler.scheduler import Scheduler
    from tokenloom.scheduler.watchdog import ForwardWatchdog
    from tokenloom.tokenizer import eos_token_ids, load_tokenizer

    if args.disaggregation_mode == "decode" and not args.disable_radix_cache:
        import dataclasses  # as SGLang: a decode server's KV arrives per request and is never shared

        args = dataclasses.replace(args, disable_radix_cache=True)
    name = rank_label(rank, args.tp_size, args.pp_size)
    child_process_setup("scheduler" if args.tp_size * args.pp_size == 1 else f"scheduler-r{rank}", args.log_level)
    ctx = zmq.Context()
    # ranks on nodes other than 0 have no IPC addresses: their failures reach node 0 through their launcher
    sender = Sender(ctx, addresses.detokenizer) if addresses is not None else None
    world = args.tp_size * args.pp_size
    heartbeat = None
    try:
        if bind_error is not None:
            raise bind_error
        parallel = init_distributed(args.tp_size, args.pp_size, rank, dist_init_addr, resolve_device(args.device),
                                    init_timeout_s=RENDEZVOUS_TIMEOUT_S,
                                    op_timeout_s=args.dist_timeout or DEFAULT_DIST_TIMEOUT_S,
                                    shared_memory=not args.disable_custom_all_reduce)
        if world > 1:  # lets a rank whose collective failed name a hung peer (distributed/heartbeat.py)
            heartbeat = Heartbeat(dist_init_addr, rank).start()
        source = resolve_model_source(args)
        start_layer, end_layer = stage_layers(source.config.num_hidden_layers, parallel.pp_rank, parallel.pp_size,
                                              partition_from_env())
        load_start = time.perf_counter()
        loaded = LoadedModel.load(args, parallel, source, start_layer, end_layer)  # only this stage's layers
        load_seconds = time.perf_counter() - load_start
        # sized beside the loaded weights, at the world's smallest capacity; the one owner of the KV memory
        memory = loaded.kv_memory(args, parallel, agree=lambda values: min_reduce_ints(values, parallel))
        runner = ModelRunner(args, parallel, loaded=loaded, memory=memory)
        tokenizer = load_tokenizer(runner.source, args.tokenizer_path)
        worker = ModelWorker(runner, eos_token_ids(runner.source, tokenizer))
        agree = (lambda value: all_equal(value, parallel)) if parallel.tp_size > 1 else None
        lanes = parallel.pp_size + args.pp_async_batch_depth if parallel.pp_size > 1 else 1
        scheduler = Scheduler(args, worker, tokenizer, sender.send if parallel.is_entry else discard, memory,
                              ranks_agree=agree, num_lanes=lanes,
                              trace_profiler=TraceProfiler(parallel.tp_rank, parallel.pp_rank, parallel.pp_size))
        inbox: Any = Receiver(ctx, addresses.scheduler) if parallel.is_entry else None
        if world > 1:  # the entry rank decides when a request with a grammar gets in; every rank follows
            inbox = lockstep_grammar(scheduler, inbox, parallel.is_entry, lambda obj: all_gather_pyobj(obj, parallel))
        if parallel.tp_size > 1 and parallel.is_first_stage:  # later stages get requests from the previous one
            inbox = BroadcastInbox(inbox, parallel)
        if args.disaggregation_mode != "null":  # a prefill or decode server's rank (disaggregation/rank_setup.py)
            from tokenloom.disaggregation.rank_setup import attach_disaggregation

            attach_disaggregation(args, parallel, scheduler, memory, source.config.num_hidden_layers,
                                  source.config.num_key_value_heads,
                                  addresses.scheduler if parallel.is_entry else None)
        ready.send({"status": "ready", "max_total_num_tokens": scheduler.max_total_num_tokens,
                    "max_req_input_len": scheduler.max_req_input_len, "context_len": runner.context_len,
                    "max_running_requests": scheduler.max_running_requests,
                    "vocab_size": runner.vocab_size,
                    "native_decode_max_batch": 0 if runner.native_decode is None else runner.native_decode.max_batch,
                    **rank_report(loaded.model, loaded.dtype, memory.kv_pool.nbytes(), load_seconds)})
        watchdog = ForwardWatchdog(args.watchdog_timeout, lambda reason: exit_hung(name, reason, ready, ctx,
                                                                                   addresses)).start()
        make_event_loop(args, scheduler, inbox, forward_on_caller=True, parallel=parallel,
                        watchdog=watchdog).run_forever()
    except Exception as e:
        error = name_silent_peers(heartbeat, range(world), lambda r: rank_label(r, args.tp_size, args.pp_size), e)
        report_failure(name, error, ready, sender)
        raise SystemExit(1) from None
