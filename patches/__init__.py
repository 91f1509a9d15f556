"""Runtime patches shipped inside the wheel as ``gspo_ascend.patches``.

Each patch module explains itself (what, why, upstream reference, version gate, when to remove) and is
applied by an explicit call from an engine, never as an import side effect.
"""

from ._core import PatchEntry, PatchSummary
from .npu_attention import resolve_attn_implementation
from .transformers_npu import FAMILIES, POINTS, apply_npu_patches, remove_npu_patches, supported_families

__all__ = [
    "FAMILIES",
    "POINTS",
    "PatchEntry",
    "PatchSummary",
    "apply_npu_patches",
    "remove_npu_patches",
    "resolve_attn_implementation",
    "supported_families",
]
