"""A stand-in ``torch_npu`` package and ``torch.npu`` device module for CPU-only hosts.

:func:`install_npu` puts two module objects into place:

* ``torch_npu`` (``sys.modules["torch_npu"]``): the fused ops of :mod:`.npu_ops` as attributes, ``npu`` (the
  device module), ``__version__ = "2.10.0.post4+cpushim"`` and ``_gspo_shim = True`` so code can tell it is emulated.
* the device module: ``torch.npu``, ``sys.modules["torch.npu"]`` and ``sys.modules["torch_npu.npu"]``, with
  the documented ``torch_npu.npu`` API (device, memory, RNG, streams/events, AMP, info functions).

It also registers the ``"hccl"`` process-group backend so that ``init_process_group("hccl")`` and
``new_group(..., backend="hccl")`` run on gloo.

How this differs from real torch_npu:

* Tensors live on the CPU. torch's PrivateUse1 backend is NOT renamed to "npu" (after a rename CPU torch cannot
  allocate on "npu"; npu_api.md §2), so ``torch.device("npu")`` still fails; the device layer maps "npu" to
  "cpu" instead.
* ``device_count()`` is ``GSPO_SHIM_NPU_COUNT`` (default 8, the NPUs of an Atlas 800T A2) filtered through
  ``ASCEND_RT_VISIBLE_DEVICES`` with the documented rule (see :func:`device_count`).
* Memory functions report 0 bytes allocated/reserved (there is no device allocator); ``mem_get_info`` reports
  the host's available and total memory.
* The RNG functions drive the CPU generator (there is no separate device generator).
* Streams and events are synchronous stand-ins: work is done when the call returns; events time with the
  host clock.
* The "hccl" backend stays registered after :func:`uninstall_npu`: torch.distributed has no public way to
  unregister a backend, and a registered name is harmless on a CPU host (real torch_npu would re-register it).
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.machinery
import os
import sys
import threading
import time
import types
from typing import Any

import torch

from . import npu_ops

SHIM_VERSION = "2.10.0.post4+cpushim"  # the pinned torch_npu (requirements-npu.txt), whose ops the shim emulates
DEVICE_NAME = "Ascend910B-cpushim"
SOC_VERSION = 220  # Ascend910B1; the A2 range is 220-225
DEFAULT_DEVICE_COUNT = 8
COUNT_ENV = "GSPO_SHIM_NPU_COUNT"
VISIBLE_ENV = "ASCEND_RT_VISIBLE_DEVICES"

_MISSING = object()
_SWAPPED_MODULES = ("torch_npu", "torch_npu.npu", "torch.npu", "torch_npu.npu.streams")
_saved: dict[str, Any] | None = None  # what install_npu replaced; None when not installed
_state = threading.local()  # per-thread current device and stream, like CUDA's
_amp = {"enabled": False, "dtype": torch.float16}  # torch_npu's autocast default dtype is float16


# ---------------------------------------------------------------------------------------------------------
# Device selection
# ---------------------------------------------------------------------------------------------------------


def _physical_count() -> int:
    raw = os.environ.get(COUNT_ENV, str(DEFAULT_DEVICE_COUNT))
    try:
        return max(0, int(raw))
    except ValueError:
        raise ValueError(f"env {COUNT_ENV}={raw!r} must be a non-negative integer (emulated NPUs per host)") from None


def _visible_ids() -> list[int]:
    """Physical ids visible to this process, following ASCEND_RT_VISIBLE_DEVICES' documented rule.

    Logical ids are listed comma-separated in ascending order; parsing stops at the first invalid character,
    the first id that is not larger than the previous one, or the first id >= the physical count. So with 8
    devices "0,1,3" -> [0, 1, 3], "1,0" -> [1], "0,2x,5" -> [0, 2], "" -> [] (unset -> all). Whitespace around
    an id is tolerated (an assumption; the vendor docs do not say).
    """
    total = _physical_count()
    raw = os.environ.get(VISIBLE_ENV)
    if raw is None:
        return list(range(total))
    ids: list[int] = []
    for token in raw.strip().split(","):
        digits = ""
        for char in token.strip():
            if not char.isdigit():
                break
            digits += char
        if not digits:
            break
        value = int(digits)
        if value >= total or (ids and value <= ids[-1]):
            break
        ids.append(value)
        if digits != token.strip():  # an invalid character ended this token: stop after it
            break
    return ids


def device_count() -> int:
    """Number of visible emulated NPUs (``GSPO_SHIM_NPU_COUNT``, default 8, filtered by ASCEND_RT_VISIBLE_DEVICES)."""
    return len(_visible_ids())


def is_available() -> bool:
    """Always True: the emulated NPU is always there (even if ASCEND_RT_VISIBLE_DEVICES hides every device)."""
    return True


def is_initialized() -> bool:
    return True


def init() -> None:
    """No-op: there is no runtime to initialise."""


def _index(device: Any) -> int:
    """Device index from an int, "npu", "npu:1", a torch.device-like object or None (= current)."""
    if device is None:
        return current_device()
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        kind, _, idx = device.partition(":")
        if kind not in ("npu", "cpu"):
            raise ValueError(f"expected an npu device, got {device!r}")
        return int(idx) if idx else current_device()
    idx = getattr(device, "index", None)
    return current_device() if idx is None else int(idx)


def set_device(device: Any) -> None:
    """Select the current (logical) device; raises like torch_npu when the index is not visible."""
    idx = _index(device)
    count = device_count()
    if not 0 <= idx < count:
        raise RuntimeError(f"invalid NPU device index {idx}: {count} emulated NPU(s) visible ({VISIBLE_ENV})")
    _state.device = idx


def current_device() -> int:
    return getattr(_state, "device", 0)


class device:  # noqa: N801 (torch_npu.npu.device is a lower-case context manager class)
    """Context manager that selects a device and restores the previous one."""

    def __init__(self, device: Any):
        self.idx = _index(device)
        self.prev = -1

    def __enter__(self):
        self.prev = current_device()
        set_device(self.idx)

    def __exit__(self, *exc: object) -> None:
        set_device(self.prev)


def synchronize(device: Any = None) -> None:
    """No-op: CPU work is complete when the call returns."""


# ---------------------------------------------------------------------------------------------------------
# Memory (there is no device allocator: the counters are 0, the capacity is the host's)
# ---------------------------------------------------------------------------------------------------------


def memory_allocated(device: Any = None) -> int:
    return 0


def max_memory_allocated(device: Any = None) -> int:
    return 0


def memory_reserved(device: Any = None) -> int:
    return 0


def max_memory_reserved(device: Any = None) -> int:
    return 0


def reset_peak_memory_stats(device: Any = None) -> None:
    """No-op: there are no device peaks to reset."""


def reset_max_memory_allocated(device: Any = None) -> None:
    """No-op: there are no device peaks to reset."""


def empty_cache() -> None:
    """No-op: there is no caching allocator."""


def memory_stats(device: Any = None) -> dict[str, int]:
    """The keys callers usually read from the caching allocator's stats, all 0."""
    keys = ("allocated_bytes", "reserved_bytes", "active_bytes", "inactive_split_bytes")
    return {f"{key}.all.{kind}": 0 for key in keys for kind in ("current", "peak", "allocated", "freed")}


def mem_get_info(device: Any = None) -> tuple[int, int]:
    """(free, total) bytes: the host's available and total memory (psutil if importable, else sysconf)."""
    try:
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)
    except ImportError:
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


# ---------------------------------------------------------------------------------------------------------
# RNG: the CPU generator underneath (no separate device generator exists)
# ---------------------------------------------------------------------------------------------------------


def manual_seed(seed: int) -> None:
    torch.manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    torch.manual_seed(int(seed))


def seed() -> None:
    torch.seed()


def seed_all() -> None:
    torch.seed()


def initial_seed() -> int:
    return torch.initial_seed()


def get_rng_state(device: Any = "npu") -> torch.Tensor:
    return torch.get_rng_state()


def get_rng_state_all() -> list[torch.Tensor]:
    return [torch.get_rng_state() for _ in range(max(1, device_count()))]


def set_rng_state(new_state: torch.Tensor, device: Any = "npu") -> None:
    torch.set_rng_state(new_state)


def set_rng_state_all(new_states: list[torch.Tensor]) -> None:
    if new_states:
        torch.set_rng_state(new_states[0])


# ---------------------------------------------------------------------------------------------------------
# Streams and events: synchronous stand-ins (all work is complete when a call returns)
# ---------------------------------------------------------------------------------------------------------


class Stream:
    """A stream handle. Every operation already ran to completion, so waiting and syncing are no-ops."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any):
        self.device_index = _index(device)
        self.priority = priority

    @property
    def device(self) -> str:
        return f"npu:{self.device_index}"

    def wait_stream(self, stream: Stream) -> None:
        """No-op: the other stream's work is already done."""

    def wait_event(self, event: Event) -> None:
        """No-op: the event's work is already done."""

    def record_event(self, event: Event | None = None) -> Event:
        event = event if event is not None else Event()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        """No-op: the stream is always idle."""

    def __repr__(self) -> str:
        return f"<torch_npu.npu.Stream (cpushim) device={self.device} priority={self.priority}>"


class Event:
    """An event that records the host clock; ``elapsed_time`` is in milliseconds, as in torch_npu."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.enable_timing = enable_timing
        self.blocking = blocking
        self.interprocess = interprocess
        self._time: float | None = None

    def record(self, stream: Stream | None = None) -> None:
        self._time = time.perf_counter()

    def wait(self, stream: Stream | None = None) -> None:
        """No-op: the recorded work is already done."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        """No-op: the recorded work is already done."""

    def elapsed_time(self, end_event: Event) -> float:
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self._time is None or end_event._time is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        return (end_event._time - self._time) * 1000.0


def _default_streams() -> dict[int, Stream]:
    if not hasattr(_state, "default_streams"):
        _state.default_streams = {}
    return _state.default_streams


def default_stream(device: Any = None) -> Stream:
    idx = _index(device)
    return _default_streams().setdefault(idx, Stream(idx))


def current_stream(device: Any = None) -> Stream:
    idx = _index(device)
    current = getattr(_state, "streams", {}).get(idx)
    return current if current is not None else default_stream(idx)


def set_stream(stream: Stream) -> None:
    if not hasattr(_state, "streams"):
        _state.streams = {}
    _state.streams[stream.device_index] = stream


@contextlib.contextmanager
def stream(stream: Stream | None):
    """Make ``stream`` current inside the block (None: leave the current stream unchanged)."""
    if stream is None:
        yield
        return
    previous = current_stream(stream.device_index)
    set_stream(stream)
    try:
        yield
    finally:
        set_stream(previous)


# ---------------------------------------------------------------------------------------------------------
# Device information and AMP
# ---------------------------------------------------------------------------------------------------------


def is_bf16_supported() -> bool:
    return True  # the 910B supports bf16


def get_device_name(device: Any = None) -> str:
    return DEVICE_NAME


def get_soc_version() -> int:
    return SOC_VERSION


def get_device_properties(device: Any = None) -> types.SimpleNamespace:
    """Name and total memory (the host's) of the emulated device."""
    return types.SimpleNamespace(name=DEVICE_NAME, total_memory=mem_get_info()[1], soc_version=SOC_VERSION)


def get_amp_supported_dtype() -> list[torch.dtype]:
    return [torch.float16, torch.bfloat16]


def is_autocast_enabled() -> bool:
    return _amp["enabled"]


def set_autocast_enabled(enabled: bool) -> None:
    _amp["enabled"] = bool(enabled)


def get_autocast_dtype() -> torch.dtype:
    return _amp["dtype"]


def set_autocast_dtype(dtype: torch.dtype) -> None:
    _amp["dtype"] = dtype


# Only names the pinned torch_npu's (2.10.0.post4) torch_npu.npu binds (its __all__ and imports, star imports included:
# get_soc_version comes from `from ._backends import *`; tests/conformance checks it against the wheel).
_DEVICE_API = (
    "is_available", "is_initialized", "init", "device_count", "set_device", "current_device", "device",
    "synchronize", "memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved",
    "reset_peak_memory_stats", "reset_max_memory_allocated", "empty_cache", "memory_stats", "mem_get_info",
    "manual_seed", "manual_seed_all", "seed", "seed_all", "initial_seed", "get_rng_state", "get_rng_state_all",
    "set_rng_state", "set_rng_state_all", "Stream", "Event", "current_stream", "default_stream", "set_stream",
    "stream", "is_bf16_supported", "get_device_name", "get_soc_version", "get_device_properties",
    "get_amp_supported_dtype", "is_autocast_enabled", "set_autocast_enabled", "get_autocast_dtype",
    "set_autocast_dtype",
)  # fmt: skip


# ---------------------------------------------------------------------------------------------------------
# The "hccl" process-group backend, run as gloo
# ---------------------------------------------------------------------------------------------------------


def _create_hccl_as_gloo(dist_backend_opts: Any, backend_options: Any) -> Any:
    """Backend creator (extended API): a gloo process group for the group described by ``dist_backend_opts``.

    Mirrors what torch.distributed does for a "gloo" group (options carry the global ranks and group name).
    """
    from torch.distributed import ProcessGroupGloo

    timeout = dist_backend_opts.timeout
    if not isinstance(timeout, datetime.timedelta):
        timeout = datetime.timedelta(seconds=float(timeout))
    pg = ProcessGroupGloo(dist_backend_opts.store, dist_backend_opts.group_rank, dist_backend_opts.group_size, timeout)
    pg.options.global_ranks_in_group = list(dist_backend_opts.global_ranks_in_group)
    pg.options.group_name = dist_backend_opts.group_id
    return pg


def register_hccl_backend() -> None:
    """Register "hccl" with torch.distributed (idempotent) so that it runs on gloo for CPU tensors."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        return
    if "hccl" in dist.Backend.backend_list:
        return
    # devices=["cpu"]: the emulated NPU's tensors are CPU tensors; "npu" is not a torch device type here.
    dist.Backend.register_backend("hccl", _create_hccl_as_gloo, extended_api=True, devices=["cpu"])


# ---------------------------------------------------------------------------------------------------------
# Install / uninstall
# ---------------------------------------------------------------------------------------------------------


def _new_module(name: str, doc: str) -> types.ModuleType:
    module = types.ModuleType(name, doc)
    # importlib.util.find_spec() raises on a sys.modules entry without __spec__; give it one.
    module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None)
    return module


def build_device_module() -> types.ModuleType:
    """A fresh ``torch_npu.npu`` stand-in populated with this module's device API."""
    module = _new_module("torch_npu.npu", "CPU-shim stand-in for torch_npu.npu (see gspo_ascend.device.shim).")
    namespace = globals()
    for name in _DEVICE_API:
        setattr(module, name, namespace[name])
    module.__all__ = list(_DEVICE_API)
    module._gspo_shim = True
    module.__path__ = []  # a package: torch_npu.npu.streams resolves through sys.modules
    # torch_npu.npu.streams: where torch_npu (2.7.1, 2.10.0.post4) defines Stream / Event (vllm-ascend imports Event)
    module.streams = _new_module("torch_npu.npu.streams", "CPU-shim stand-in for torch_npu.npu.streams.")
    module.streams.Stream, module.streams.Event = Stream, Event
    # torch_npu.npu.mstx (`from .mstx import mstx` in torch_npu/npu/__init__.py): a class, not a module
    from .npu_mstx import mstx

    module.mstx = mstx
    return module


def build_torch_npu_module(device_module: types.ModuleType) -> types.ModuleType:
    """A fresh ``torch_npu`` stand-in: the reference fused ops plus ``npu`` = ``device_module``."""
    module = _new_module("torch_npu", "CPU-shim stand-in for torch_npu (see gspo_ascend.device.shim).")
    module.__path__ = []  # a package, so "import torch_npu.npu" resolves through sys.modules
    for name in npu_ops.__all__:
        setattr(module, name, getattr(npu_ops, name))
    module.npu = device_module
    module.__version__ = SHIM_VERSION
    module._gspo_shim = True
    return module


def install_npu() -> None:
    """Install ``torch_npu`` / ``torch.npu`` stand-ins and the "hccl" backend (idempotent)."""
    global _saved
    if _saved is not None:
        return
    saved: dict[str, Any] = {name: sys.modules.get(name, _MISSING) for name in _SWAPPED_MODULES}
    saved["torch.npu attribute"] = torch.__dict__.get("npu", _MISSING)
    device_module = build_device_module()
    torch_npu = build_torch_npu_module(device_module)
    sys.modules["torch_npu"] = torch_npu
    sys.modules["torch_npu.npu"] = device_module
    sys.modules["torch.npu"] = device_module
    sys.modules["torch_npu.npu.streams"] = device_module.streams
    torch.npu = device_module
    _saved = saved
    register_hccl_backend()


def uninstall_npu() -> None:
    """Restore ``sys.modules`` and ``torch.npu`` exactly as they were before :func:`install_npu`.

    The "hccl" backend registration is left in place (torch.distributed offers no way to unregister).
    """
    global _saved
    if _saved is None:
        return
    for name in _SWAPPED_MODULES:
        previous = _saved[name]
        if previous is _MISSING:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = previous
    previous_attr = _saved["torch.npu attribute"]
    if previous_attr is _MISSING:
        torch.__dict__.pop("npu", None)
    else:
        torch.npu = previous_attr
    _saved = None
