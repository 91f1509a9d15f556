"""Qwen3-MoE experts on grouped matmuls: token permute -> gmm -> swiglu -> gmm -> unpermute.

What it replaces:
  * layout v5 (transformers >=5.0,<5.20): ``Qwen3MoeExperts.forward(hidden [T, H], top_k_index [T, k],
    top_k_weights [T, k])``. Experts are one fused module (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``);
    routing stays in HF's ``Qwen3MoeTopKRouter`` (softmax in fp32, top-k, ``norm_topk_prob``), so the
    router-logits recording used by the aux loss is untouched. Tested in CI on 5.19 with the CPU shim.
  * layout v4 (transformers >=4.51,<5.0): ``Qwen3MoeSparseMoeBlock.forward``, which there does its own routing
    (``gate`` is an ``nn.Linear``, ``experts`` an ``nn.ModuleList`` of ``Qwen3MoeMLP``) and returns
    ``(hidden, router_logits)``. The replacement routes exactly as HF does and stacks the per-expert weights
    (differentiable) into the fused layout, which costs one copy of the layer's expert weights per step.
    Written for the NPU stack's 4.57.x; not run in CI (checked once by hand against 4.57.6 on the shim).
  The expert computation is ``npu_moe_token_permute`` (tokens grouped by expert), two grouped matmuls around
  ``npu_swiglu``, and ``npu_moe_token_unpermute`` weighted by the routing probabilities. Each grouped matmul is
  :class:`GroupedLinear`, an autograd Function: forward and dx are M-split grouped matmuls; dW is one matmul per
  expert (``dy_e^T @ x_e``), because torch_npu 2.7.1 refuses the K-split gmm (``group_type=2``) that verl's
  recipe uses for it ("group_type only support -1 and 0", its meta registration; later post builds accept it).
  torch_npu 2.7.1's permute / unpermute take bfloat16 tokens and probs and int64 indices only (op docs), so
  they run when the activations are bf16 (the NPU training dtype); other dtypes (fp32 checks) group tokens with
  the same stable sort in plain torch, which the shim's tests hold equal to the fused ops.
Why: HF loops over experts in Python (one small matmul per expert and a host sync for ``nonzero``); on NPU
that is hundreds of tiny kernel launches per layer for Qwen3-30B-A3B (128 experts).
Routing ops: ``npu_moe_gating_top_k_softmax`` is not used: Ascend documents it for inference and it has no
documented backward, while the router weight needs the gradient through the top-k probabilities.
Weights are handed to gmm as a transposed *view* of the stored parameter (no copy, none saved for backward);
if a torch_npu build rejects non-contiguous weights, a ``.contiguous()`` there is the fix (untested on hardware).
Upstream reference: verl ``verl/models/transformers/npu_patch.py`` (``NPUGmmFunction``, MoE block) for the
recipe; Ascend op-plugin docs for ``npu_grouped_matmul`` / ``npu_moe_token_permute`` / ``_unpermute``.
Limitation: expert ids outside [0, E) (expert-parallel masking) are not supported: such rows are not covered by
any group (HF skips them; the NPU requires full coverage).
When to remove: when transformers' experts interface gains an NPU implementation (``ALL_EXPERTS_FUNCTIONS`` has
grouped_mm / batched_mm but no npu entry as of 5.19), or when MoE training runs only on Megatron + MindSpeed
(``moe_grouped_gemm``, ``fused_permute_unpermute``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ._core import SKIPPED, PatchContext, PatchEntry, original_of, swap_attr, torch_npu
from .npu_fused_ops import is_silu


class GroupedLinear(torch.autograd.Function):
    """Rows of ``x`` grouped by expert, each group times its expert's weight in ``nn.Linear`` layout.

    ``x [M, K]`` (rows sorted by expert), ``weight [E, N, K]``, ``counts [E]`` rows per expert ->
    ``y [M, N]`` with ``y[g] = x[g] @ weight[e]^T`` for group g of expert e.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight, counts)
        gmm = torch_npu().npu_grouped_matmul
        # M-split (group_type=0) with per-group counts (group_list_type=1); split_item=2 -> one [M, N] tensor.
        return gmm([x], [weight.transpose(1, 2)], group_list=counts, split_item=2, group_type=0, group_list_type=1)[0]

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight, counts = ctx.saved_tensors
        gmm = torch_npu().npu_grouped_matmul
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:  # dx[g] = dy[g] @ W_e: gmm wants [E, in=N, out=K], the stored layout as is
            grad_x = gmm([grad_out], [weight], group_list=counts, split_item=2, group_type=0, group_list_type=1)[0]
        if ctx.needs_input_grad[1]:  # dW_e = dy[g]^T @ x[g] per expert (2.7.1 has no K-split gmm, see above)
            sizes = counts.tolist()  # one host sync per backward, as the forward's group_list already needs
            grad_w = torch.stack(
                [dy.t() @ xe for dy, xe in zip(grad_out.split(sizes), x.split(sizes), strict=True)]
            ).to(weight.dtype)  # [E, N, K]
        return grad_x, grad_w, None


def tokens_per_expert(top_k_index: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E] int64 counts of (token, slot) pairs per expert; histc on floats is the NPU-friendly histogram."""
    counts = torch.histc(top_k_index.float(), bins=num_experts, min=0, max=num_experts - 1)
    return counts.to(torch.int64)


def _permute(npu: Any, hidden: torch.Tensor, top_k_index: torch.Tensor):
    """Tokens grouped by expert -> (permuted [T*k, H], row_map [T*k]); row_map[p] = output row of flat slot p."""
    if hidden.dtype == torch.bfloat16:  # the only dtype torch_npu 2.7.1's permute takes; indices int64
        return npu.npu_moe_token_permute(hidden, top_k_index.to(torch.int64))
    order = torch.argsort(top_k_index.reshape(-1), stable=True)  # the op's documented stable sort
    return hidden.index_select(0, order // top_k_index.shape[1]), torch.argsort(order)


def _unpermute(npu: Any, out: torch.Tensor, row_map: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Expert outputs back in token order, weighted by probs [T, k] and summed over the k slots -> [T, H]."""
    if out.dtype == torch.bfloat16:
        return npu.npu_moe_token_unpermute(out, row_map, probs=probs.to(torch.bfloat16))
    rows = out.index_select(0, row_map.long()).view(*probs.shape, out.shape[-1])  # [T, k, H]
    return (rows * probs.unsqueeze(-1).to(out.dtype)).sum(dim=1)


def fused_experts(hidden, top_k_index, top_k_weights, gate_up, down) -> torch.Tensor:
    """Experts output for hidden [T, H] routed to top_k_index [T, k] with weights [T, k].

    gate_up [E, 2I, H] (gate rows first), down [E, H, I]: the nn.Linear layouts transformers 5 stores.
    """
    npu = torch_npu()
    permuted, row_map = _permute(npu, hidden, top_k_index)  # [T*k, H]
    counts = tokens_per_expert(top_k_index, gate_up.shape[0])
    act = npu.npu_swiglu(GroupedLinear.apply(permuted, gate_up, counts), dim=-1)  # [T*k, I]
    out = GroupedLinear.apply(act, down, counts)  # [T*k, H]
    return _unpermute(npu, out, row_map, top_k_weights)  # [T, H]


def _make_experts_forward_v5(original: Any):
    def npu_experts_forward(self, hidden_states, top_k_index, top_k_weights):
        if not is_silu(self.act_fn):
            return original(self, hidden_states, top_k_index, top_k_weights)
        return fused_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj)

    npu_experts_forward.__doc__ = "Qwen3MoeExperts through torch_npu grouped matmuls (gspo_ascend patch)."
    return npu_experts_forward


def _make_block_forward_v4(original: Any):
    def npu_moe_block_forward(self, hidden_states: torch.Tensor):
        """HF 4.x routing (softmax fp32, top-k, norm_topk_prob), then the fused experts; -> (out, router_logits)."""
        if not is_silu(self.experts[0].act_fn):
            return original(self, hidden_states)
        batch, seq, hidden_dim = hidden_states.shape
        x = hidden_states.view(-1, hidden_dim)  # [T, H]
        router_logits = self.gate(x)  # [T, E]
        probs = F.softmax(router_logits, dim=1, dtype=torch.float)
        weights, selected = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        # Stacking keeps autograd to every expert's own Linear weight; [E, 2I, H] and [E, H, I] as in v5.
        gate_up = torch.stack([torch.cat((e.gate_proj.weight, e.up_proj.weight), dim=0) for e in self.experts])
        down = torch.stack([e.down_proj.weight for e in self.experts])
        out = fused_experts(x, selected, weights, gate_up, down)
        return out.view(batch, seq, hidden_dim), router_logits

    return npu_moe_block_forward


def _v5_layout_problem(experts: Any) -> str | None:
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor):
        return "experts have no gate_up_proj / down_proj tensors"
    if getattr(experts, "is_transposed", False) or not getattr(experts, "is_concatenated", True):
        return "experts store transposed or interleaved gate/up weights"
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[1] != 2 * down.shape[2]:
        return f"unexpected expert shapes gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)}"
    if getattr(experts, "has_bias", False):
        return "experts with biases are not handled"
    return None


def _layout_problem(module: Any, layout: str) -> str | None:
    """Why this experts module (v5) / sparse block (v4) cannot take the fused path, or None."""
    if layout == "v5":
        problem, act = _v5_layout_problem(module), getattr(module, "act_fn", None)
    else:
        experts = getattr(module, "experts", None)
        if not isinstance(experts, torch.nn.ModuleList) or not all(hasattr(module, a) for a in ("gate", "top_k")):
            return "not the v4 layout (gate + ModuleList of expert MLPs)"
        problem, act = None, getattr(experts[0], "act_fn", None)
    if problem is None and not is_silu(act):
        problem = "expert activation is not silu (npu_swiglu is silu-gated)"
    return problem


def patch_moe(ctx: PatchContext) -> PatchEntry:
    """The v5 experts forward or the v4 sparse-block forward (see the module docstring)."""
    suffix = "Experts" if ctx.layout == "v5" else "SparseMoeBlock"
    cls = ctx.cls(suffix)
    target = f"{ctx.prefix}{suffix}.forward"
    if skipped := ctx.excluded("moe", target):
        return skipped
    if cls is None:
        return PatchEntry("moe", target, SKIPPED, f"{ctx.module.__name__} has no {ctx.prefix}{suffix}")
    for module in ctx.instances(suffix):
        if problem := _layout_problem(module, ctx.layout):
            return PatchEntry("moe", target, SKIPPED, problem)
    make = _make_experts_forward_v5 if ctx.layout == "v5" else _make_block_forward_v4
    replacement = make(original_of(cls, "forward"))
    status = swap_attr(cls, "forward", replacement, ctx.family)
    return PatchEntry("moe", target, status, "permute + grouped matmul fwd/bwd + unpermute")
