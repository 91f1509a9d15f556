"""Loading a transformers causal LM for an engine; on NPU with the fused-op patches applied.

On the npu backend (a real Atlas device, or the CPU shim) every HF model an engine loads (the fsdp actor, its
reference, the hf rollout model) goes through ``gspo_ascend.patches.apply_npu_patches`` unless
``model.npu_patches=false``: RMSNorm, rotary, SwiGLU, Qwen3-MoE experts and attention on torch_npu's fused ops
(docs/npu-patches.md). The patch summary is printed once per process, by rank 0, where Ray forwards it to the
driver's console. A model family without patches runs plain transformers ops, said in one line.

How we differ from verl: verl applies its NPU patches as an import side effect of its FSDP workers; here the
engine applies them explicitly after loading, so a CPU or GPU run never touches them and a test can compare a
patched model with an unpatched one in one process.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..device import Backend

_summary_printed = False


def _rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


def _say_once(text: str) -> None:
    global _summary_printed
    if not _summary_printed and _rank() == 0:
        print(text, flush=True)
    _summary_printed = True


def load_causal_lm(path: str, *, dtype: torch.dtype, attn_implementation: str, backend: Backend, npu_patches: bool):
    """``AutoModelForCausalLM.from_pretrained``; on npu with ``npu_patches`` the fused-op patches are applied."""
    from transformers import AutoModelForCausalLM

    patch = npu_patches and backend.name == "npu"
    if patch:
        from ..patches import resolve_attn_implementation

        # flash_attention_2 is loaded as sdpa where transformers' own FA2 check fails on NPU; the attention
        # patch then routes the model to npu_fusion either way.
        attn_implementation = resolve_attn_implementation(attn_implementation, backend)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    if patch:
        apply_patches(model, backend)
    return model


def apply_patches(model: Any, backend: Backend) -> None:
    from ..patches import FAMILIES, apply_npu_patches

    family = getattr(model.config, "model_type", "?")
    if family not in FAMILIES:
        _say_once(f"NPU patches: model type '{family}' has none (covered: {', '.join(FAMILIES)}); plain ops")
        return
    _say_once(apply_npu_patches(model, backend=backend).render())
