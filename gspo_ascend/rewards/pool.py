"""Reward worker processes: used when scoring is called off the main thread, or to score in parallel.

Each worker scores in its own main thread, so the per-sample ``SIGALRM`` limit of
:mod:`gspo_ascend.rewards.scoring` works there. The parent adds a batch deadline on top: code stuck inside one
C call (a huge integer power, a regex) does not see the signal, so when results stop arriving in time the
parent kills the workers, counts the missing samples as timeouts and starts fresh workers.

Workers are spawned (not forked): the trainer process holds torch / Ray threads, which fork would copy in an
undefined state. How we differ from verl: verl scores in the driver thread, or in a thread pool where
math-verify's alarm cannot work, and has no guard for a scorer that hangs.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import queue
import time

from .scoring import ERROR, TIMEOUT, SampleResult, score_sample

_START_TIMEOUT_S = 120.0  # spawning + importing sympy/math-verify; generous for a loaded CI machine
_POLL_S = 0.5  # how often the parent checks that its workers are alive
_DEADLINE_GRACE_S = 10.0  # slack on top of the per-sample limits before the parent declares workers stuck


def _worker_main(tasks, results) -> None:
    from .math_answer import warm_up

    warm_up()  # import math-verify and build its grammar before saying ready: not part of any sample's time
    results.put(("ready", None))
    while True:
        item = tasks.get()
        if item is None:
            return
        index, args, timeout_s = item
        results.put((index, score_sample(*args, timeout_s)))


class WorkerPool:
    """``num_workers`` spawned scorer processes; :meth:`run` keeps input order and never hangs past its deadline."""

    def __init__(self, num_workers: int):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.num_workers = num_workers
        self.restarts = 0
        self._procs: list = []
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._tasks, self._results = ctx.Queue(), ctx.Queue()
        self._procs = [
            ctx.Process(target=_worker_main, args=(self._tasks, self._results), daemon=True, name=f"gspo-reward-{i}")
            for i in range(self.num_workers)
        ]
        for proc in self._procs:
            proc.start()
        for _ in self._procs:
            self._results.get(timeout=_START_TIMEOUT_S)

    def _kill(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5)
        self._procs = []

    def restart(self) -> None:
        self._kill()
        self.restarts += 1
        self._start()

    def close(self) -> None:
        for _ in self._procs:
            self._tasks.put(None)
        for proc in self._procs:
            proc.join(timeout=2)
        self._kill()

    def run(self, tasks: list[tuple], timeout_s: float | None) -> list[SampleResult]:
        """Score ``tasks`` (argument tuples of :func:`score_sample` without the timeout), in order."""
        for index, args in enumerate(tasks):
            self._tasks.put((index, args, timeout_s))
        rounds = math.ceil(len(tasks) / self.num_workers)
        deadline = None if not timeout_s else time.monotonic() + rounds * (timeout_s + 1.0) + _DEADLINE_GRACE_S
        done: dict[int, SampleResult] = {}
        missing = SampleResult(0.0, 0.0, TIMEOUT, "no result before the batch deadline; reward workers restarted")
        while len(done) < len(tasks):
            if deadline is not None and time.monotonic() > deadline:
                break
            if not all(proc.is_alive() for proc in self._procs):  # crashed (segfault, OOM kill): results never come
                missing = SampleResult(0.0, 0.0, ERROR, "a reward worker process died; reward workers restarted")
                break
            try:
                index, result = self._results.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            done[index] = result
        if len(done) < len(tasks):
            self.restart()  # the queues may hold stale tasks/results for this batch: start clean
        return [done.get(i, missing) for i in range(len(tasks))]
