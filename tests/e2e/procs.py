"""Process-tree lookups of the e2e fault tests (psutil, which Ray already needs): the descendants of a pid and a
process's command line (Ray's workers show their actor and method there, e.g. ``ray::PolicyWorker.update``)."""

from __future__ import annotations

import psutil


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` ([] once ``pid`` is gone: its children were re-parented)."""
    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def cmdline(pid: int) -> str:
    """The command line of ``pid``, its arguments joined by spaces; "" when it is gone or unreadable."""
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return ""
