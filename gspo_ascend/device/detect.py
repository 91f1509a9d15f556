"""Guarded probes of the vendor stacks; nothing here runs at import time.

A torch_npu wheel installed without CANN fails on import with ImportError (``libhccl.so``), OSError (a
shared library that does not load) or RuntimeError (raised from its init), and its auto-load entry point
breaks plain ``import torch`` unless ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``. Every probe catches all three
and returns a reason instead, so the caller can print one actionable line.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from types import ModuleType

_IMPORT_FAILURES = (ImportError, OSError, RuntimeError)


@dataclass(frozen=True)
class NpuStatus:
    available: bool
    reason: str  # why not, or "ok"
    emulated: bool = False


def import_torch_npu() -> tuple[ModuleType | None, str]:
    """Import torch_npu if possible: (module, "ok") or (None, one-line reason). Never raises."""
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    try:
        module = importlib.import_module("torch_npu")
    except _IMPORT_FAILURES as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        if isinstance(exc, ModuleNotFoundError) and exc.name == "torch_npu":
            return None, "torch_npu is not installed"
        return (
            None,
            f"torch_npu failed to import ({type(exc).__name__}: {first}); is CANN installed and set_env.sh sourced?",
        )
    return module, "ok"


def npu_status() -> NpuStatus:
    """Is a real (or shim-emulated) NPU usable in this process?"""
    if "torch_npu" not in sys.modules and importlib.util.find_spec("torch_npu") is None:
        return NpuStatus(False, "torch_npu is not installed")
    module, reason = import_torch_npu()
    if module is None:
        return NpuStatus(False, reason)
    emulated = bool(getattr(module, "_gspo_shim", False))
    try:
        import torch

        count = torch.npu.device_count()
    except (AttributeError, *_IMPORT_FAILURES) as exc:
        return NpuStatus(False, f"torch.npu is not usable ({type(exc).__name__}: {exc})", emulated)
    if count < 1:
        return NpuStatus(False, "torch_npu sees no NPU (check npu-smi info and ASCEND_RT_VISIBLE_DEVICES)", emulated)
    return NpuStatus(True, "ok", emulated)


def cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())
