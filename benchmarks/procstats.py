"""The benchmark sides' processes, read from /proc and psutil: their peak memory and the Ray actors among them.
Shared by e2e_sides.py and verl_side/side.py (which e2e_sides starts), so neither imports the other for them."""

from __future__ import annotations

import os
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
