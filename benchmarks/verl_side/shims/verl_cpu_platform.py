"""A CPU platform for verl 0.9.1 (shim P1 of benchmarks/verl_side/README.md): the benchmark's verl side only.

verl 0.9.1 ships nvidia, npu and rocm platforms and falls back to nvidia, so every call goes to ``torch.cuda``. This
module registers a ``cpu`` platform through verl's own extension points: it is imported in every verl process by
``VERL_USE_EXTERNAL_MODULES=verl_cpu_platform`` and chosen by ``VERL_PLATFORM=cpu`` (both set by the side's
launcher). No verl file is changed. What it answers and why:

- ``current_device()`` is ``"cpu"``, not ``0``: verl moves tensors with ``.to(get_device_id())``, and an int means
  ``cuda:<int>``;
- ``communication_backend_name()`` is ``gloo`` (the FSDP engine runs one rank on CPU);
- the Ray resource is ``GPU``, backed by a fake GPU (``ray_init.num_gpus=1``), so verl's placement is unchanged;
- ``is_ipc_supported()`` is False, so verl syncs weights to vLLM through shared memory, not CUDA IPC;
- every memory, seed and profiler call that has no CPU meaning is a no-op (CPU seeding is ``torch.manual_seed``,
  which verl calls itself).
"""

from __future__ import annotations

import contextlib
from types import ModuleType

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry


def _no_op(*_args, **_kwargs):
    return None


# verl's device module on CPU is torch.cpu itself (verl tests ``get_torch_device() == torch.cpu`` to skip its FLOPs
# and memory reports); what verl also calls and torch.cpu lacks is added as a no-op (memory counters: 0).
_MISSING = {
    "empty_cache": _no_op,
    "manual_seed": _no_op,
    "manual_seed_all": _no_op,
    "memory_allocated": lambda *a, **k: 0,
    "memory_reserved": lambda *a, **k: 0,
    "max_memory_allocated": lambda *a, **k: 0,
    "max_memory_reserved": lambda *a, **k: 0,
    "reset_peak_memory_stats": _no_op,
    "mem_get_info": lambda *a, **k: (0, 0),
    "get_rng_state": lambda *a, **k: torch.get_rng_state(),
    "set_rng_state": lambda state, *a, **k: torch.set_rng_state(state),
}
for _name, _fn in _MISSING.items():
    if not hasattr(torch.cpu, _name):
        setattr(torch.cpu, _name, _fn)


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> ModuleType:
        return torch.cpu

    def is_available(self) -> bool:
        return True

    def current_device(self):
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index) -> None:
        return None

    def synchronize(self, device_index=None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        return None

    def manual_seed_all(self, seed: int) -> None:
        return None

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0):
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"  # what Ray sets for the fake GPU; nothing reads it on CPU

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self):
        return None
