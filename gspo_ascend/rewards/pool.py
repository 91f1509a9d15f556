"""Reward worker processes: used when scoring is called off the main thread, or to score in parallel.

Each worker scores in its own main thread, so the per-sample ``SIGALRM`` limit of
:mod:`gspo_ascend.rewards.scoring` works there. The parent adds a batch deadline on top: code stuck inside one
C call (a huge integer power, a regex) does not see the signal, so when results stop arriving in time the
parent kills the workers, counts the missing samples as timeouts and starts fresh workers.

Workers are spawned (not forked): the trainer process holds torch / Ray threads, which fork would copy in an
undefined state. How we differ from verl: verl scores in the driver thread, or in a thread pool where
math-verify's alarm cannot work, and has no guard for a scorer that hangs.

Workers die with their parent. A driver killed with SIGKILL (or ended by Ray when the GCS is lost) runs no
``atexit``, and the workers, blocked on their task queue, used to live on with PPID 1 (with them
multiprocessing's resource tracker, which exits only when every holder of its pipe is gone). On Linux each
worker asks the kernel for SIGKILL when its parent goes (``prctl(PR_SET_PDEATHSIG)``; the "parent" is the thread
that spawned it, so only a pool created on the main thread uses it); everywhere a watcher thread also exits the
worker once its parent pid changes. Workers ignore SIGINT: Ctrl-C reaches the whole process group, and the
parent, which owns the run, decides (it stops the workers on its way out).

``run(..., max_failures=k)`` stops waiting as soon as more than ``k`` samples have failed (error or timeout):
the caller is going to stop the run, and a scorer that always times out would otherwise cost
``n x timeout_s / num_workers`` first. The samples not scored then come back as ``None``.
"""

from __future__ import annotations

import ctypes
import math
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
import time

from .scoring import ERROR, TIMEOUT, SampleResult, score_sample

_START_TIMEOUT_S = 120.0  # spawning + importing sympy/math-verify; generous for a loaded CI machine
_POLL_S = 0.5  # how often the parent checks that its workers are alive
_DEADLINE_GRACE_S = 10.0  # slack on top of the per-sample limits before the parent declares workers stuck
_PARENT_POLL_S = 1.0  # how often a worker's watcher thread checks that its parent is still there
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _die_with_parent(parent_pid: int, use_pdeathsig: bool) -> None:
    """End this process when ``parent_pid`` goes: the kernel's death signal where there is one, and a watcher
    thread (a scorer stuck in C holding the GIL blocks the thread, not the signal)."""
    if use_pdeathsig and sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # no prctl in this libc: the watcher below still ends the worker
    if os.getppid() != parent_pid:  # the parent died before the death signal was armed
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(_PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="gspo-reward-parent-watch", daemon=True).start()


def _worker_main(tasks, results, parent_pid: int, use_pdeathsig: bool) -> None:
    from .math_answer import warm_up

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(parent_pid, use_pdeathsig)
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
        args = (self._tasks, self._results, os.getpid(), threading.current_thread() is threading.main_thread())
        self._procs = [
            ctx.Process(target=_worker_main, args=args, daemon=True, name=f"gspo-reward-{i}")
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
        """Kill the workers; fresh ones start with the next :meth:`run` (not now: after a failure limit the run is
        about to stop, and starting workers costs seconds)."""
        self._kill()
        self.restarts += 1

    def close(self) -> None:
        for _ in self._procs:
            self._tasks.put(None)
        for proc in self._procs:
            proc.join(timeout=2)
        self._kill()

    def run(
        self, tasks: list[tuple], timeout_s: float | None, max_failures: int | None = None
    ) -> list[SampleResult | None]:
        """Score ``tasks`` (argument tuples of :func:`score_sample` without the timeout), in order. With
        ``max_failures``, stop once more samples than that failed; the ones not scored then are ``None``."""
        if not self._procs:
            self._start()
        for index, args in enumerate(tasks):
            self._tasks.put((index, args, timeout_s))
        rounds = math.ceil(len(tasks) / self.num_workers)
        deadline = None if not timeout_s else time.monotonic() + rounds * (timeout_s + 1.0) + _DEADLINE_GRACE_S
        done: dict[int, SampleResult] = {}
        missing: SampleResult | None = SampleResult(
            0.0, 0.0, TIMEOUT, "no result before the batch deadline; reward workers restarted"
        )
        failures = 0
        while len(done) < len(tasks):
            if deadline is not None and time.monotonic() > deadline:
                break
            if max_failures is not None and failures > max_failures:
                missing = None  # not scored: the caller stops the run
                break
            if not all(proc.is_alive() for proc in self._procs):  # crashed (segfault, OOM kill): results never come
                missing = SampleResult(0.0, 0.0, ERROR, "a reward worker process died; reward workers restarted")
                break
            try:
                index, result = self._results.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            done[index] = result
            failures += result.status in (ERROR, TIMEOUT)
        if len(done) < len(tasks):
            self.restart()  # the queues may hold stale tasks/results for this batch: start clean
        return [done.get(i, missing) for i in range(len(tasks))]
