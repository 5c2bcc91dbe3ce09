"""`ForwardThread`: runs prepared steps one after another on a dedicated thread.

torch releases the GIL inside its ops, so while this thread computes batch k the scheduler thread plans
batch k+1 and processes batch k-1's results. Steps run strictly in submission order (one worker), which is
what makes future-token placeholders and slot reuse safe. On CUDA the steps run on a dedicated stream that
waits for the scheduler's preparation (`device.ForwardStream`). The thread's intra-op thread count is set
once, in the thread. `busy_s` accumulates the time spent executing steps (for idle-fraction reporting).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from tokenloom.device import ForwardStream, configure_threads
from tokenloom.executor.worker import ForwardOutput, ModelWorker, PreparedStep


class ForwardThread:
    def __init__(self, worker: ModelWorker, num_threads: int | None = None) -> None:
        self.worker = worker
        self.stream = ForwardStream(worker.runner.device)
        threads = num_threads if num_threads is not None else torch.get_num_threads()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tokenloom-forward",
                                        initializer=configure_threads, initargs=(threads,))
        self.busy_s = 0.0

    def submit(self, step: PreparedStep) -> Future[ForwardOutput]:
        return self._pool.submit(self._run, step, self.stream.handoff())

    def _run(self, step: PreparedStep, mark: object | None) -> ForwardOutput:
        start = time.perf_counter()
        try:
            with self.stream.context(mark):
                out = self.worker.execute(step)
            self.stream.finish()
            return out
        finally:
            self.busy_s += time.perf_counter() - start

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
