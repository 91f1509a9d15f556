"""Bookkeeping shared by the patch modules: reversible attribute swaps, version gates, the patch summary.

Nothing here patches anything by itself. The patch modules (``npu_fused_ops``, ``npu_moe``, ``npu_attention``)
describe *what* to replace; :mod:`.transformers_npu` decides *whether* (family, version, backend) and calls
:func:`swap_attr` / :func:`swap_item`, which remember the exact original object so that :func:`restore`
puts it back (identity, not a copy). Applying twice is a no-op: a slot that already holds our replacement
is reported as "already applied" and its recorded original stays the true original.

torch_npu is reached only through :func:`torch_npu`, i.e. ``importlib.import_module("torch_npu")`` at call
time: the project bans ``import torch_npu`` outside ``gspo_ascend.device`` (ruff TID251) because importing a
CANN-less torch_npu can break ``import torch``; here it only runs after the caller chose the npu backend.
"""

from __future__ import annotations

import importlib
import weakref
from dataclasses import dataclass, field
from typing import Any

from gspo_ascend.errors import UserError

_MISSING = object()

APPLIED = "applied"
ALREADY = "already applied"
SKIPPED = "skipped"


# ---------------------------------------------------------------------------------------------------------
# torch_npu and version facts
# ---------------------------------------------------------------------------------------------------------


def torch_npu() -> Any:
    """The torch_npu module (real, or the CPU shim's stand-in), imported lazily at call time."""
    return importlib.import_module("torch_npu")


def require_torch_npu() -> Any:
    """torch_npu, or a one-line UserError saying how to get it (apply time, so failures are early and clear).

    The guarded import itself is the device layer's (ImportError / OSError / RuntimeError of a CANN-less wheel).
    """
    from gspo_ascend.device.detect import import_torch_npu

    module, reason = import_torch_npu()
    if module is None:
        raise UserError(
            f"NPU patches need torch_npu: {reason}; on an Atlas host install CANN + torch_npu and "
            "`source /usr/local/Ascend/ascend-toolkit/set_env.sh` (docs/install-npu.md), or install the CPU shim "
            "(GSPO_DEVICE_SHIM=1)"
        )
    return module


def npu_description(module: Any) -> str:
    version = getattr(module, "__version__", "?")
    return f"torch_npu {version}" + (" (CPU shim)" if getattr(module, "_gspo_shim", False) else "")


def transformers_version() -> str:
    """The version of the transformers that is imported (not the metadata of some other install on sys.path)."""
    import transformers

    return transformers.__version__


def version_in(version: str, spec: str) -> bool:
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    return Version(version) in SpecifierSet(spec)


# ---------------------------------------------------------------------------------------------------------
# Reversible swaps
# ---------------------------------------------------------------------------------------------------------


@dataclass
class _Record:
    owner: Any  # a module, a class or a dict (e.g. AttentionInterface._global_mapping)
    key: str
    original: Any  # _MISSING when the slot did not exist
    replacement: Any
    family: str
    is_item: bool  # dict item instead of attribute


_RECORDS: dict[tuple[int, str, bool], _Record] = {}
# per-model attention switches: (weakref to the config, the implementation it had, family)
_CONFIG_SWITCHES: list[tuple[weakref.ref, str | None, str]] = []


def _own(owner: Any, key: str) -> Any:
    """The slot's own value: a class's ``__dict__`` entry, not an inherited attribute (restore must be exact)."""
    if isinstance(owner, dict):
        return owner.get(key, _MISSING)
    return vars(owner).get(key, _MISSING)


def _swap(owner: Any, key: str, replacement: Any, family: str, is_item: bool) -> str:
    slot = (id(owner), key, is_item)
    record = _RECORDS.get(slot)
    if record is not None and _own(owner, key) is record.replacement:
        return ALREADY
    _RECORDS[slot] = _Record(owner, key, _own(owner, key), replacement, family, is_item)
    if is_item:
        owner[key] = replacement
    else:
        setattr(owner, key, replacement)
    return APPLIED


def swap_attr(owner: Any, name: str, replacement: Any, family: str) -> str:
    """Replace ``owner.name`` (module function or class method), remembering the original. Returns the status."""
    return _swap(owner, name, replacement, family, is_item=False)


def swap_item(mapping: dict, key: str, replacement: Any, family: str) -> str:
    """Set ``mapping[key]`` (a registry dict such as AttentionInterface._global_mapping), remembering the original."""
    return _swap(mapping, key, replacement, family, is_item=True)


def original_of(owner: Any, name: str) -> Any:
    """What ``owner.name`` was before we patched it (or is now, when unpatched)."""
    record = _RECORDS.get((id(owner), name, False))
    return record.original if record is not None else getattr(owner, name)


def switch_attn_implementation(config: Any, new: str, family: str) -> tuple[str, str | None]:
    """Set ``config._attn_implementation`` (reversibly); returns (status, the implementation before our switch)."""
    for ref, previous, _ in _CONFIG_SWITCHES:
        if ref() is config and config._attn_implementation == new:
            return ALREADY, previous
    previous = config._attn_implementation
    _CONFIG_SWITCHES.append((weakref.ref(config), previous, family))
    config._attn_implementation = new
    return APPLIED, previous


def switched_from(config: Any) -> str | None:
    """The implementation a config had before our switch, or None when we never switched it."""
    for ref, previous, _ in _CONFIG_SWITCHES:
        if ref() is config:
            return previous
    return None


def restore(family: str | None = None) -> int:
    """Undo every swap (of one family, or all) in reverse order; returns how many slots were restored."""
    count = 0
    for ref, previous, fam in reversed(list(_CONFIG_SWITCHES)):
        if family is None or fam == family:
            config = ref()
            if config is not None:
                config._attn_implementation = previous
                count += 1
            _CONFIG_SWITCHES.remove((ref, previous, fam))
    for slot, record in reversed(list(_RECORDS.items())):
        if family is not None and record.family != family:
            continue
        if record.original is _MISSING:
            if record.is_item:
                record.owner.pop(record.key, None)
            else:
                delattr(record.owner, record.key)
        elif record.is_item:
            record.owner[record.key] = record.original
        else:
            setattr(record.owner, record.key, record.original)
        del _RECORDS[slot]
        count += 1
    return count


def patched_families() -> set[str]:
    return {r.family for r in _RECORDS.values()} | {fam for _, _, fam in _CONFIG_SWITCHES}


# ---------------------------------------------------------------------------------------------------------
# Summary
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PatchEntry:
    """One patch point: what it targets, whether it was applied, and why (not)."""

    point: str  # rms_norm | rotary | mlp | moe | attention | flash_attn_guard
    target: str  # e.g. "Qwen3RMSNorm.forward"
    status: str  # applied | already applied | skipped
    detail: str


@dataclass
class PatchSummary:
    """What :func:`apply_npu_patches` did; ``render()`` is the one-screen text the trainer prints at start."""

    family: str
    transformers: str
    layout: str | None  # "v4" (transformers 4.51-4.57 module layout) | "v5" | None (outside every gate)
    npu: str  # e.g. "torch_npu 2.7.1 (CPU shim)", or why torch_npu was not looked at
    entries: list[PatchEntry] = field(default_factory=list)

    def status(self, point: str) -> str:
        return next(e.status for e in self.entries if e.point == point)

    def entry(self, point: str) -> PatchEntry:
        return next(e for e in self.entries if e.point == point)

    @property
    def points(self) -> list[str]:
        return [e.point for e in self.entries]

    @property
    def applied(self) -> list[str]:
        return [e.point for e in self.entries if e.status in (APPLIED, ALREADY)]

    def render(self) -> str:
        layout = f"layout {self.layout}" if self.layout else "no layout gate matched"
        lines = [f"NPU patches for {self.family}: transformers {self.transformers} ({layout}), {self.npu}"]
        width_point = max([len(e.point) for e in self.entries] + [5])
        width_target = max([len(e.target) for e in self.entries] + [6])
        for e in self.entries:
            lines.append(f"  {e.point:<{width_point}}  {e.status:<15}  {e.target:<{width_target}}  {e.detail}")
        return "\n".join(lines)

    __str__ = render


@dataclass
class PatchContext:
    """What a patch point needs to decide and act: the family's modeling module, the model (if any), the gate."""

    family: str  # canonical family name: qwen2 | qwen3 | qwen3_moe
    prefix: str  # class-name prefix in the modeling module: Qwen2 | Qwen3 | Qwen3Moe
    module: Any  # transformers.models.<family>.modeling_<family>
    model: Any | None  # the model instance, when apply_npu_patches got one
    layout: str  # "v4" | "v5"
    version: str  # transformers version
    exclude: frozenset[str]

    def cls(self, suffix: str) -> Any:
        return getattr(self.module, self.prefix + suffix, None)

    def instances(self, suffix: str) -> list[Any]:
        cls = self.cls(suffix)
        if self.model is None or cls is None:
            return []
        return [m for m in self.model.modules() if isinstance(m, cls)]

    def excluded(self, point: str, target: str) -> PatchEntry | None:
        if point in self.exclude:
            return PatchEntry(point, target, SKIPPED, "excluded by the caller")
        return None
