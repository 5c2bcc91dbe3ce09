"""Scheduler process entry: load the weights, build the rank's `KVMemory` once and hand it to both the model
runner and the scheduler, wrap the runner in the worker, report readiness, run the loop.

Readiness is reported through a pipe as {"status": "ready", "max_total_num_tokens", "max_req_input_len",
"context_len", "vocab_size"} (or {"status": "error", ...}); after that, a fatal error is reported to the
engine as a `ProcessFailed` message through the detokenizer before the process exits non-zero.
"""

from __future__ import annotations

from typing import Any

from tokenloom.config import ServerArgs


def run_scheduler_process(args: ServerArgs, addresses: Any, ready: Any) -> None:
    import zmq

    from tokenloom.executor.model_runner import LoadedModel, ModelRunner
    from tokenloom.executor.worker import ModelWorker
    from tokenloom.frontend.process_utils import child_process_setup, report_failure
    from tokenloom.ipc import Receiver, Sender
    from tokenloom.scheduler.loops import make_event_loop
    from tokenloom.scheduler.scheduler import Scheduler
    from tokenloom.tokenizer import eos_token_ids, load_tokenizer

    child_process_setup("scheduler", args.log_level)
    ctx = zmq.Context()
    sender = Sender(ctx, addresses.detokenizer)
    try:
        loaded = LoadedModel.load(args)
        memory = loaded.kv_memory(args)  # sized beside the loaded weights; the one owner of the KV memory
        runner = ModelRunner(args, loaded=loaded, memory=memory)
        tokenizer = load_tokenizer(runner.source, args.tokenizer_path)
        worker = ModelWorker(runner, eos_token_ids(runner.source, tokenizer))
        scheduler = Scheduler(args, worker, tokenizer, sender.send, memory)
        receiver = Receiver(ctx, addresses.scheduler)
        ready.send({"status": "ready", "max_total_num_tokens": scheduler.max_total_num_tokens,
                    "max_req_input_len": scheduler.max_req_input_len, "context_len": runner.context_len,
                    "vocab_size": runner.vocab_size})
        make_event_loop(args, scheduler, receiver, forward_on_caller=True).run_forever()
    except Exception as e:
        report_failure("scheduler", e, ready, sender)
        raise SystemExit(1) from None
