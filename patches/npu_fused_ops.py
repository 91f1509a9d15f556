"""Fused-op patches for Qwen2 / Qwen2.5 / Qwen3 / Qwen3-MoE: RMSNorm, rotary embedding, SwiGLU MLP.

What it replaces (in ``transformers.models.{qwen2,qwen3,qwen3_moe}.modeling_*``):
  * ``<Prefix>RMSNorm.forward``   -> ``torch_npu.npu_rms_norm(x, weight, eps)[0]`` (one kernel instead of ~6).
  * ``apply_rotary_pos_emb``      -> ``torch_npu.npu_rotary_mul(t, cos.unsqueeze(d), sin.unsqueeze(d))`` for q and k
    (the op's default "half" mode is HF's ``rotate_half``).
  * ``<Prefix>MLP.forward``       -> ``down_proj(torch_npu.npu_swiglu(cat(gate_proj(x), up_proj(x))))``.
Why: on Ascend each unfused elementwise op is a separate kernel launch through the task queue; these three run
in every layer and dominate step time of small/medium dense models in eager mode (graph mode is not available
for RL on NPU: field failure #2).
Upstream reference: verl ``verl/models/transformers/npu_patch.py`` applies the same replacements (semantics
read, code not copied); op semantics from Ascend op-plugin docs (``torch_npu-npu_rms_norm.md``,
``torch_npu-npu_rotary_mul.md``, ``torch_npu-npu_swiglu.md``; summary in reference/npu_api.md §1).
Version gates (chosen by :mod:`.transformers_npu`):
  * layout v5 (transformers >=5.0,<5.20): ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)``.
    Tested in CI on 5.19 with the CPU shim.
  * layout v4 (transformers >=4.51,<5.0): ``apply_rotary_pos_emb(q, k, cos, sin, position_ids=None,
    unsqueeze_dim=1)``; RMSNorm / MLP are unchanged. Written for the NPU stack's 4.57.x; not run in CI (checked
    once by hand against 4.57.6 on the shim).
  Every point also checks the structure it relies on (signature, attributes) and is skipped, with the reason
  in the summary, when that does not hold.
Numerics: fp32 runs are identical to HF up to rounding. HF's RMSNorm rounds twice in low precision (normalised
x cast to the input dtype, then times weight); the fused op computes ``x * rstd * weight`` in fp32 and rounds
once. The output dtype is HF's: ``promote(weight.dtype, x.dtype)``.
When to remove: when transformers dispatches these layers to NPU kernels itself (its ``kernels`` hub mapping
for "RMSNorm" / "rotary_pos_emb" has no npu entry as of 5.19), or when FSDP training is retired in favour of
Megatron + MindSpeed's own fused kernels.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ._core import SKIPPED, PatchContext, PatchEntry, original_of, swap_attr, torch_npu

ROTARY_PARAMS = {
    "v5": ["q", "k", "cos", "sin", "unsqueeze_dim"],
    "v4": ["q", "k", "cos", "sin", "position_ids", "unsqueeze_dim"],
}


# ---------------------------------------------------------------------------------------------------------
# RMSNorm
# ---------------------------------------------------------------------------------------------------------


def npu_rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """RMSNorm through ``npu_rms_norm``; HF's output dtype (``weight * normed.to(input_dtype)`` promotes)."""
    out_dtype = torch.promote_types(self.weight.dtype, hidden_states.dtype)
    # Both operands in the output dtype: the fused op returns x's dtype and computes in fp32 internally.
    return torch_npu().npu_rms_norm(hidden_states.to(out_dtype), self.weight.to(out_dtype), self.variance_epsilon)[0]


def patch_rms_norm(ctx: PatchContext) -> PatchEntry:
    cls = ctx.cls("RMSNorm")
    target = f"{ctx.prefix}RMSNorm.forward"
    if skipped := ctx.excluded("rms_norm", target):
        return skipped
    if cls is None:
        return PatchEntry("rms_norm", target, SKIPPED, f"{ctx.module.__name__} has no {ctx.prefix}RMSNorm")
    odd = [m for m in ctx.instances("RMSNorm") if not hasattr(m, "variance_epsilon") or m.weight.dim() != 1]
    if odd:
        return PatchEntry("rms_norm", target, SKIPPED, "RMSNorm without variance_epsilon / 1-D weight")
    status = swap_attr(cls, "forward", npu_rms_norm_forward, ctx.family)
    return PatchEntry("rms_norm", target, status, "npu_rms_norm(x, weight, eps)[0]")


# ---------------------------------------------------------------------------------------------------------
# Rotary embedding
# ---------------------------------------------------------------------------------------------------------


def _rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int):
    # q [B, N, S, D], k [B, Nkv, S, D], cos/sin [B, S, D] -> [B, 1, S, D] (broadcast over heads).
    # The mode argument is left at its default ("half" = HF rotate_half): older torch_npu builds lack it.
    npu = torch_npu()
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return npu.npu_rotary_mul(q, cos, sin), npu.npu_rotary_mul(k, cos, sin)


def _make_rotary(original: Any, layout: str):
    """The replacement for ``apply_rotary_pos_emb`` with the gated version's exact signature."""

    def _usable(q: torch.Tensor, cos: torch.Tensor, unsqueeze_dim: int) -> bool:
        # Partial rotary (cos narrower than the head) is not what npu_rotary_mul computes: keep HF's code. So do
        # shapes outside torch_npu 2.7.1's half-mode limits (op docs): 4-D (BNSD, or BSND for unsqueeze_dim=2),
        # D even and < 896, B, N < 1000, B*N <= 1024 when cos / sin need gradients (not so in HF's rotary).
        if cos.shape[-1] != q.shape[-1] or q.dim() != 4 or q.shape[-1] % 2 or q.shape[-1] >= 896:
            return False
        b, n = q.shape[0], q.shape[1 if unsqueeze_dim == 1 else 2]
        return b < 1000 and n < 1000 and (not cos.requires_grad or b * n <= 1024)

    if layout == "v4":

        def npu_apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
            if not _usable(q, cos, unsqueeze_dim):
                return original(q, k, cos, sin, position_ids, unsqueeze_dim)
            return _rotate(q, k, cos, sin, unsqueeze_dim)

    else:

        def npu_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
            if not _usable(q, cos, unsqueeze_dim):
                return original(q, k, cos, sin, unsqueeze_dim)
            return _rotate(q, k, cos, sin, unsqueeze_dim)

    npu_apply_rotary_pos_emb.__doc__ = "apply_rotary_pos_emb through torch_npu.npu_rotary_mul (gspo_ascend patch)."
    return npu_apply_rotary_pos_emb


def patch_rotary(ctx: PatchContext) -> PatchEntry:
    target = "apply_rotary_pos_emb"  # module-level function of the family's modeling module
    if skipped := ctx.excluded("rotary", target):
        return skipped
    current = getattr(ctx.module, "apply_rotary_pos_emb", None)
    if current is None:
        return PatchEntry("rotary", target, SKIPPED, "the modeling module has no apply_rotary_pos_emb")
    original = original_of(ctx.module, "apply_rotary_pos_emb")  # HF's, also when we patched it before
    params = list(inspect.signature(original).parameters)
    if params != ROTARY_PARAMS[ctx.layout]:
        return PatchEntry("rotary", target, SKIPPED, f"signature {params} is not the {ctx.layout} layout's")
    status = swap_attr(ctx.module, "apply_rotary_pos_emb", _make_rotary(original, ctx.layout), ctx.family)
    return PatchEntry("rotary", target, status, "npu_rotary_mul(q / k, cos, sin), half mode")


# ---------------------------------------------------------------------------------------------------------
# SwiGLU MLP
# ---------------------------------------------------------------------------------------------------------


def is_silu(act: Any) -> bool:
    """npu_swiglu is silu(gate) * up; any other activation must keep HF's code."""
    return isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"


def _make_mlp_forward(original: Any):
    def npu_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
        if not is_silu(self.act_fn):
            return original(self, x)
        # The projections stay module calls (not a concatenated weight) so LoRA / FSDP hooks on them still run.
        gate_up = torch.cat((self.gate_proj(x), self.up_proj(x)), dim=-1)  # [..., 2I], gate first
        return self.down_proj(torch_npu().npu_swiglu(gate_up, dim=-1))

    npu_mlp_forward.__doc__ = "MLP through torch_npu.npu_swiglu (gspo_ascend patch)."
    return npu_mlp_forward


def patch_mlp(ctx: PatchContext) -> PatchEntry:
    cls = ctx.cls("MLP")
    target = f"{ctx.prefix}MLP.forward"
    if skipped := ctx.excluded("mlp", target):
        return skipped
    if cls is None:
        return PatchEntry("mlp", target, SKIPPED, f"{ctx.module.__name__} has no {ctx.prefix}MLP")
    instances = ctx.instances("MLP")
    if any(not all(hasattr(m, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn")) for m in instances):
        return PatchEntry("mlp", target, SKIPPED, "MLP without gate_proj / up_proj / down_proj / act_fn")
    if instances and not any(is_silu(m.act_fn) for m in instances):
        return PatchEntry("mlp", target, SKIPPED, "hidden_act is not silu (npu_swiglu is silu-gated)")
    status = swap_attr(cls, "forward", _make_mlp_forward(original_of(cls, "forward")), ctx.family)
    detail = "down_proj(npu_swiglu(cat(gate_proj, up_proj)))"
    if ctx.model is not None and not instances:
        detail = "class patched; this model has no dense MLP layer"
    return PatchEntry("mlp", target, status, detail)
