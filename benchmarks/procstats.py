"""The benchmark sides' processes, read from /proc and psutil: their peak memory and the Ray actors among them.
Shared by e2e_sides.py and verl_side/side.py (which e2e_sides starts), so neither imports the other for them."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def peak_rss_mib(pids: list[int]) -> float:
    """Sum of the processes' peak resident set sizes (VmHWM), MiB; 0 for a process that is gone."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1])  # kB
        except OSError:
            continue
    return total / 1024


def descendants(pid: int) -> list[int]:
    import psutil

    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process and its descendants have used so far; 0 once it is gone. An ended
    descendant counts through the ``children_*`` times of the parent that reaped it, so the sum only grows while the
    top process lives (a descendant whose parent ended first is lost: the difference undercounts then)."""
    import psutil

    total = 0.0
    for p in (pid, *descendants(pid)):
        try:
            t = psutil.Process(p).cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.Error:
            continue
    return total


@contextmanager
def paused(pids: list[int]) -> Iterator[list[int]]:
    """The processes and their descendants stopped (SIGSTOP) for the block and continued (SIGCONT) after it, also
    when it raises; yields the pids it stopped. The benchmark's waiting sides: idle, verl's ~10 Ray processes and
    its vLLM server still kept 0.2 of a core busy on a 2-core box (``others_cores``), taken from the side in its turn.
    A descendant started after the call is not stopped (a side that waits for ``go`` starts none). A SIGKILL of the
    caller leaves them stopped: ``kill -CONT`` them (or kill them)."""
    held: list[int] = []
    try:
        for pid in pids:
            for p in (pid, *descendants(pid)):  # listed first: a stopped parent still lists its children
                try:
                    os.kill(p, signal.SIGSTOP)
                    held.append(p)
                except ProcessLookupError:
                    continue
        _until_stopped(held)
        yield held
    finally:
        for p in reversed(held):
            try:
                os.kill(p, signal.SIGCONT)
            except ProcessLookupError:
                continue


def _until_stopped(pids: list[int], timeout_s: float = 2.0) -> None:
    """Wait (at most ``timeout_s``) until the kernel has stopped every process: SIGSTOP reaches one running on
    another core at its next entry into the kernel, not when ``kill`` returns."""
    import psutil

    halted = {psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD}  # an unreaped child cannot stop
    deadline = time.monotonic() + timeout_s
    for pid in pids:
        try:
            while psutil.Process(pid).status() not in halted and time.monotonic() < deadline:
                time.sleep(0.001)
        except psutil.Error:
            continue


def ray_workers(prefix: str | tuple[str, ...] = "ray::PolicyWorker") -> list[int]:
    """The Ray actor processes named ``prefix`` (one or several) among this process's descendants, and their
    children (vLLM's engine core): ours by default, verl's model holders for its side (verl_side/side.py)."""
    import psutil

    pids = []
    for pid in descendants(os.getpid()):
        try:
            if " ".join(psutil.Process(pid).cmdline()).startswith(prefix):
                pids += [pid, *descendants(pid)]
        except psutil.Error:
            continue
    return sorted(set(pids))
