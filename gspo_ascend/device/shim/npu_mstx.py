"""Stand-in for ``torch_npu.npu.mstx``, the MindStudio Tools Extension markers (torch_npu/npu/mstx.py).

MindSpeed core_r0.16.0 reads it while its adaptor registers patches: ``torch.cuda.nvtx.range_push`` becomes
``torch_npu.npu.mstx.range_start`` and ``range_pop`` becomes ``mstx.range_end``
(features_manager/megatron_basic/requirements_basic.py:34-36). The 0.12.1 branches never touched it.

What it emulates, from the pinned wheel's Python (torch-npu 2.10.0.post4): the class ``mstx`` of static methods and
their checks (an empty or non-string message or domain warns and returns the real one's fallback value: 0 from
``range_start``, -1 from ``range_push`` / ``range_pop``, None from the others), and the real decorator
``_no_exception_func``, which catches every exception a marker call raises, a missing argument included, and logs
it (so MindSpeed's ``range_pop()`` -> ``range_end()`` without a range id is logged, not raised, as on the NPU).
How it differs: the real calls go to torch_npu._C._mstx, which hands the markers to the profiler (msprof) when it
runs and does nothing otherwise; here there is no profiler, so a marker is only counted and ids come from a counter.
A ``stream`` is taken only as the shim's own Stream (the real one takes only torch_npu's Stream).
"""

from __future__ import annotations

import functools
import itertools
import logging
import sys
import warnings
from typing import Any

_log = logging.getLogger(__name__)
_ids = itertools.count(1)
_open: dict[str, list[int]] = {}  # domain -> range ids pushed and not yet popped (range_push / range_pop)


def _no_exception_func(default_ret: Any = None):
    """The real module's decorator: a marker never raises into the caller; the failure is logged."""

    def decorator(func):
        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            try:
                return func(*args, **kwargs)
            except Exception as ex:  # noqa: BLE001 - what the real decorator catches
                _log.error("Call %s failed. Exception: %s", func.__name__, ex)
                return default_ret

        return wrapper

    return decorator


def _valid(value: Any) -> bool:
    return bool(value) and isinstance(value, str)


def _stream_ok(stream: Any) -> bool:
    """The real check: ``isinstance(stream, torch_npu.npu.streams.Stream)``, the torch_npu of the process (here the
    shim's, installed in sys.modules)."""
    torch_npu = sys.modules.get("torch_npu")
    return not stream or (torch_npu is not None and isinstance(stream, torch_npu.npu.streams.Stream))


class mstx:  # noqa: N801 - torch_npu's name
    @staticmethod
    @_no_exception_func()
    def mark(message: str, stream: Any = None, domain: str = "default") -> None:
        if not _valid(message) or not isinstance(domain, str) or not _stream_ok(stream):
            warnings.warn("Invalid argument for mstx.mark func.", stacklevel=3)

    @staticmethod
    @_no_exception_func()
    def range_push(message: str, stream: Any = None, domain: str = "default") -> int:
        if not _valid(message) or not _valid(domain) or not _stream_ok(stream):
            warnings.warn("Invalid argument for mstx.range_push func.", stacklevel=3)
            return -1
        range_id = next(_ids)
        _open.setdefault(domain, []).append(range_id)
        return range_id

    @staticmethod
    @_no_exception_func()
    def range_pop(domain: str = "default") -> int:
        if not _valid(domain):
            warnings.warn("Invalid domain for mstx.range_pop func.", stacklevel=3)
            return -1
        stack = _open.get(domain)
        return stack.pop() if stack else -1

    @staticmethod
    @_no_exception_func()
    def range_start(message: str, stream: Any = None, domain: str = "default") -> int:
        if not _valid(message) or not _valid(domain) or not _stream_ok(stream):
            warnings.warn("Invalid argument for mstx.range_start func.", stacklevel=3)
            return 0
        return next(_ids)

    @staticmethod
    @_no_exception_func()
    def range_end(range_id: int, domain: str = "default") -> None:
        if not isinstance(range_id, int) or not _valid(domain):
            warnings.warn("Invalid argument for mstx.range_end func.", stacklevel=3)

    @staticmethod
    @_no_exception_func()
    def mstx_range(message: str, stream: Any = None, domain: str = "default"):
        def wrapper(func):
            def inner(*args, **kwargs):
                range_id = mstx.range_start(message, stream, domain)
                result = func(*args, **kwargs)
                mstx.range_end(range_id, domain)
                return result

            return inner

        return wrapper
