"""The device contract: every other module reaches the accelerator through here.

A backend is vendor facts as data (:class:`Backend`: torch device type, collective backend, the
visible-devices variable, Ray's resource name, the variable that stops Ray from rewriting visible devices,
the compile policy) plus the handful of runtime operations the toolkit calls (set_device, synchronize,
empty_cache, memory stats, manual_seed, bf16 support). Compare slime's ``Accelerator`` and torchtune's
``DeviceSupport``; unlike verl we never branch on ``is_npu_available`` outside this package.

Backends are chosen lazily (``get_backend``), never at import time, so ``import gspo_ascend`` works on a bare
CPU box and with a broken torch_npu. With the CPU shim installed, "npu" is emulated: tensors live on the CPU
(``torch_device_type == "cpu"``) and the HCCL collective backend runs as gloo.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from ..errors import DeviceError

VALID_NAMES = ("auto", "cpu", "cuda", "npu")


@dataclass(frozen=True)
class Backend:
    name: str  # cpu | cuda | npu
    torch_device_type: str  # what torch.device() gets: "cpu" also for the emulated npu
    comm_backend: str  # torch.distributed backend: gloo | nccl | hccl
    visible_devices_env: str | None  # CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES
    ray_resource: str | None  # Ray resource name: GPU / NPU (None on CPU: Ray schedules CPUs)
    ray_noset_visible_env: str | None  # stops Ray from overwriting the visible-devices variable
    compile_by_default: bool  # torch.compile policy for trainer.compile=auto; eager on NPU
    emulated: bool = False  # True when the npu backend runs on the CPU shim

    # -- runtime operations (thin; the vendor module is looked up at call time) --------------------------

    def module(self) -> Any | None:
        """torch.cuda / torch.npu, or None on CPU (and for the emulated npu, the shim's module)."""
        import torch

        return getattr(torch, self.name, None) if self.name != "cpu" else None

    def device(self, index: int | None = None):
        import torch

        if self.torch_device_type == "cpu" or index is None:
            return torch.device(self.torch_device_type)
        return torch.device(self.torch_device_type, index)

    def device_count(self) -> int:
        mod = self.module()
        return mod.device_count() if mod is not None else 1

    def set_device(self, index: int) -> None:
        mod = self.module()
        if mod is not None:
            mod.set_device(index)

    def synchronize(self) -> None:
        mod = self.module()
        if mod is not None:
            mod.synchronize()

    def empty_cache(self) -> None:
        mod = self.module()
        if mod is not None:
            mod.empty_cache()

    def device_name(self, index: int = 0) -> str:
        """The accelerator's name as its runtime reports it ("NVIDIA H100 80GB HBM3"); "cpu" on a host."""
        mod = self.module()
        return str(mod.get_device_name(index)) if mod is not None else "cpu"

    def memory_stats(self) -> dict[str, int]:
        """Allocated / peak / reserved bytes of this process on the current device; host RSS peak on CPU."""
        mod = self.module()
        if mod is None or self.emulated:
            import resource

            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
            return {"allocated": 0, "peak_allocated": peak, "reserved": 0}
        return {
            "allocated": mod.memory_allocated(),
            "peak_allocated": mod.max_memory_allocated(),
            "reserved": mod.memory_reserved(),
        }

    def compute_capability(self, index: int = 0) -> tuple[int, int] | None:
        """CUDA's (major, minor) of device ``index`` ((9, 0) on an H100 or H20, (10, 0) on a B200); None elsewhere:
        vLLM picks its MoE kernel by it (engines/vllm_env.py::cuda_route_moe_backend)."""
        mod = self.module()
        if self.name != "cuda" or mod is None or self.emulated:
            return None
        major, minor = mod.get_device_capability(index)
        return int(major), int(minor)

    def total_memory(self, index: int = 0) -> int | None:
        """Bytes of memory of device ``index``; None on the host and the emulated NPU (no device memory to plan by)."""
        mod = self.module()
        if mod is None or self.emulated:
            return None
        return int(mod.get_device_properties(index).total_memory)

    def avoid_per_shape_attention_plans(self) -> bool:
        """Keep SDPA off backends that build a plan per shape; returns whether anything was switched (process-wide).

        On CUDA, SDPA's cuDNN backend (first in torch's priority on sm90+) builds and caches an execution plan per
        exact sizes and strides of q / k / v (aten/src/ATen/native/cudnn/MHA.cpp). RL's shapes change every
        micro-batch and the packed path's per-sequence views carry the row's strides, so every call built one: the
        H100's 9.5-13.2 s update of a 22M model that fp32 (no cuDNN) ran in 0.7-0.9 s (docs/results/gpu/README.md).
        The flash and memory-efficient backends keep no plan. NPU's fused attention and CPU have no such cache."""
        if self.name != "cuda" or self.emulated:
            return False
        import torch

        torch.backends.cuda.enable_cudnn_sdp(False)
        return True

    @contextlib.contextmanager
    def counting_syncs(self) -> Iterator[list[str] | None]:
        """The host synchronisations the runtime reports in the body (each one's message, in a list filled when the
        body ends), through its sync debug mode: ``torch.cuda`` / ``torch.npu.set_sync_debug_mode("warn")`` (torch_npu
        2.7.1 and 2.10 have it: torch_npu/npu/utils.py) warns "called a synchronizing CUDA / NPU operation" at each.
        None on the host and the emulated NPU: nothing to wait for there (tests/unit/test_host_syncs.py follows the
        data instead). Both runtimes call it experimental: not every synchronising call warns."""
        mod = self.module()
        if mod is None or self.emulated or not hasattr(mod, "get_sync_debug_mode"):
            yield None
            return
        import warnings

        seen: list[str] = []
        before = mod.get_sync_debug_mode()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mod.set_sync_debug_mode("warn")
            try:
                yield seen
            finally:
                mod.set_sync_debug_mode(before)
                seen += [str(w.message) for w in caught if "synchronizing" in str(w.message)]

    def manual_seed(self, seed: int) -> None:
        import torch

        torch.manual_seed(seed)  # seeds the CPU generator and, on torch >= 2.x, every accelerator's
        mod = self.module()
        if mod is not None:
            mod.manual_seed_all(seed)

    def is_bf16_supported(self) -> bool:
        mod = self.module()
        return True if mod is None else bool(mod.is_bf16_supported())

    def use_compile(self, setting: str = "auto") -> bool:
        """trainer.compile: on / off / auto (= this backend's policy: never on NPU, see docs/troubleshooting.md)."""
        if setting == "auto":
            return self.compile_by_default
        return setting == "on"


CPU = Backend("cpu", "cpu", "gloo", None, None, None, compile_by_default=False)
CUDA = Backend(
    "cuda",
    "cuda",
    "nccl",
    "CUDA_VISIBLE_DEVICES",
    "GPU",
    "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES",
    compile_by_default=False,  # opt-in: RL step shapes vary, recompiles cost more than they save at our sizes
)
# Graph mode (torch.compile / dynamo) is not usable for RL on NPU (field failure #2); MindSpeed patches
# torch.compile into a pass-through for the same reason.
NPU = Backend(
    "npu",
    "npu",
    "hccl",
    "ASCEND_RT_VISIBLE_DEVICES",
    "NPU",
    "RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES",
    compile_by_default=False,
)
# The emulated NPU: same vendor facts (env vars, Ray resource) so launch logic is exercised, but tensors on
# the CPU and gloo underneath the "hccl" name.
NPU_SHIM = replace(NPU, torch_device_type="cpu", comm_backend="gloo", emulated=True)


def upload(tensor, device):
    """A host tensor on ``device`` without waiting for the device: staged in pinned host memory and copied
    ``non_blocking`` (torch's caching host allocator keeps the staging block until the copy has run). A plain
    ``.to(device)`` or ``torch.tensor(..., device=device)`` from pageable memory is a copy followed by a stream
    synchronisation on CUDA and NPU: the host then waits for every kernel queued before it, and cannot run ahead
    to queue the next micro-batch (issue #43: ~11 such copies per micro-batch). On the host (CPU, the emulated NPU),
    or for a tensor already on an accelerator, a plain ``.to``. Do not write into the tensor while the copy may run
    (a tensor already pinned is copied from in place)."""
    import torch

    device = torch.device(device)
    if tensor.device.type != "cpu" or device.type == "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def download(tensor):
    """A device tensor's host copy without waiting: into pinned memory, ``non_blocking``. Its values are there only once
    the device has run the copy: read it after :meth:`Backend.synchronize` (or any later blocking read). The device
    tensor may be freed at once (its memory is reused in stream order). On the host the tensor itself."""
    import torch

    if tensor.device.type == "cpu":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


def shim_requested() -> bool:
    return os.environ.get("GSPO_DEVICE_SHIM", "0").lower() in ("1", "true", "yes", "on")


def get_backend(name: str = "auto") -> Backend:
    """Resolve ``trainer.device`` (auto | cpu | cuda | npu) to a usable backend, or raise a one-line DeviceError.

    ``auto`` honours env ``GSPO_DEVICE``, then prefers a real NPU, then CUDA, then CPU. ``npu`` accepts the
    CPU shim when it is installed or requested with ``GSPO_DEVICE_SHIM=1`` (which installs it here).
    """
    from . import detect

    if name == "auto":
        name = os.environ.get("GSPO_DEVICE", "auto") or "auto"
        if name not in VALID_NAMES:
            raise DeviceError(f"env GSPO_DEVICE='{name}' is not a device; valid names: {', '.join(VALID_NAMES)}")
    if name not in VALID_NAMES:
        raise DeviceError(f"unknown device '{name}' (trainer.device); valid names: {', '.join(VALID_NAMES)}")
    if name == "auto":
        from . import shim

        if shim_requested() or shim.is_installed("npu"):
            return _npu()
        return NPU if detect.npu_status().available else CUDA if detect.cuda_available() else CPU
    if name == "cpu":
        return CPU
    if name == "cuda":
        if not detect.cuda_available():
            raise DeviceError(
                "trainer.device=cuda but torch sees no CUDA device; install a CUDA build of torch "
                "(requirements-gpu.txt) or use trainer.device=cpu"
            )
        return CUDA
    return _npu()


def _npu() -> Backend:
    from . import detect, shim

    if shim.is_installed("npu"):
        return NPU_SHIM
    if shim_requested():
        shim.install(npu=True)
        return NPU_SHIM
    status = detect.npu_status()
    if status.available:
        return NPU
    raise DeviceError(
        f"trainer.device=npu but no usable NPU ({status.reason}); on an Atlas host install CANN + torch_npu "
        "and `source /usr/local/Ascend/ascend-toolkit/set_env.sh` (docs/install-npu.md), or set "
        "GSPO_DEVICE_SHIM=1 to emulate the NPU on the CPU"
    )


__all__ = [
    "Backend",
    "CPU",
    "CUDA",
    "NPU",
    "NPU_SHIM",
    "VALID_NAMES",
    "download",
    "get_backend",
    "shim_requested",
    "upload",
]
