"""``gspo-ascend doctor``: checks this machine (or a planned one) and prints a paste-ready block for bug reports.

Checks, in order: Python and package versions against the compatibility matrix (:mod:`.matrix`, data),
the device the trainer would pick, accelerators from npu-smi / nvidia-smi (:mod:`.hardware`), the Ascend
driver / firmware / CANN / set_env / ATB / torch_npu install read from files (:mod:`.ascend`), Ascend
environment variables (:mod:`.envrules`, a rule table), the NPU performance profile in effect
(:mod:`.profile`), a running Ray cluster (:mod:`.raycheck`) and, with
``--config``, the config preflight (:mod:`.preflight`). Every finding is a :class:`Check`: ok / warn / fail,
one line found, one line fix. Exit status 1 when anything fails.

Peers check little of this: verl and MindSpeed-RL document the Ascend version pairings and environment
variables in prose and fail at run time; no peer inspects an Atlas host (or a planned stack via
``--versions``) against them, and none ships a memory planner (``gspo-ascend plan``, :mod:`.planner`).
"""

from __future__ import annotations

import json

from .check import STATUSES, Check
from .context import Context

__all__ = ["Check", "Context", "STATUSES", "check_device", "exit_code", "render_json", "render_text", "run_checks"]


def check_device(ctx: Context) -> list[Check]:
    """What ``trainer.device=auto`` resolves to in this process, and the CPU shim (always available)."""
    from ..device import get_backend
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
    checks.append(Check("cpu-shim", "ok", "CPU device shim available (GSPO_DEVICE_SHIM=1 trainer.device=npu)"))
    return checks


def run_checks(ctx: Context | None = None, config_checks: list[Check] | None = None) -> list[Check]:
    """Every doctor check for ``ctx``; ``config_checks`` are preflight findings of an already loaded config."""
    from .ascend import ascend_checks
    from .envrules import env_checks
    from .hardware import check_hardware
    from .packages import package_checks
    from .preflight import devices_check
    from .profile import profile_checks
    from .raycheck import ray_checks

    ctx = ctx or Context()
    checks = package_checks(ctx)
    if ctx.probe_device:
        checks += check_device(ctx)
    checks += check_hardware(ctx.hardware) + ascend_checks(ctx) + env_checks(ctx) + profile_checks(ctx)
    checks += ray_checks(ctx)
    if config_checks is not None:
        checks += config_checks
        checks += devices_check(ctx.config, ctx.hardware) if ctx.config is not None else []
    return checks


def exit_code(results: list[Check]) -> int:
    return 1 if any(r.status == "fail" for r in results) else 0


def render_text(results: list[Check], title: str = "gspo-ascend doctor") -> str:
    from .. import __version__

    lines = [f"{title} (gspo-ascend {__version__}); paste this block into bug reports"]
    for r in results:
        lines.append(f"[{r.status:>4}] {r.name}: {r.finding}")
        if r.fix and r.status != "ok":
            lines.append(f"       fix: {r.fix}")
    counts = {s: sum(r.status == s for r in results) for s in STATUSES}
    lines.append("summary: " + ", ".join(f"{n} {s}" for s, n in counts.items()))
    return "\n".join(lines)


def render_json(results: list[Check]) -> str:
    return json.dumps([r.as_dict() for r in results], indent=2)
