"""NPU fused attention for transformers models, and the flash_attention_2 guard.

What it replaces / adds:
  * Registers ``"npu_fusion"`` in transformers' ``AttentionInterface`` (the attention function) and
    ``AttentionMaskInterface`` (its mask builder), and switches the given model's ``config._attn_implementation``
    to it (from eager / sdpa / flash_attention_2). The function calls ``torch_npu.npu_fusion_attention``:
      - plain batch: layout BSND, causal via ``sparse_mode=3`` with the compressed 2048x2048 ``triu`` mask
        (``atten_mask`` True = masked);
      - padded batch (2-D attention mask with zeros): the real tokens are gathered into layout TND with
        ``actual_seq_qlen/kvlen`` = cumulative lengths per row (no leading 0) and scattered back, pad rows 0;
      - packed / padding-free batch (no mask; ``position_ids`` restart, or ``cu_seq_lens_q/k`` given): TND with
        one sequence per run of consecutive positions. These are the same rules as transformers'
        flash-attention path (so a packed batch never attends across sequences);
      - decoding against a KV cache with padding, or a caller's 4-D mask: BSND with an explicit
        [B, 1, Sq, Skv] mask and ``sparse_mode=0``.
  * flash_attention_2 guard: a model that asks for ``flash_attention_2`` on NPU is routed to ``"npu_fusion"``;
    when the attention patch is excluded and transformers' own FA2 path cannot run on this NPU (the versions in
    :data:`FA2_NEEDS_FLASH_ATTN`, or a process where transformers' cached NPU detection is off, as happens
    with the CPU shim installed after transformers looked), the model falls back to ``sdpa``. The summary
    says which. :func:`resolve_attn_implementation` gives engines the value to pass to ``from_pretrained``
    (loading itself runs the failing check on those versions).
Why: sdpa/eager on NPU materialise the S x S scores; npu_fusion_attention is the Ascend flash kernel, and the
varlen (TND) form makes padding-free packed training possible. transformers 4.53.0 / 4.55.3 raise
``PackageNotFoundError: No package metadata was found for flash_attn`` for flash_attention_2 on NPU (field
failure #1): flash-attn cannot be installed on Ascend.
Upstream reference: transformers ``integrations/npu_flash_attention.py`` (its FA2-on-NPU mapping, semantics
read), transformers PRs #39844 / #40151 and issue #40262 (the regression and the missed 4.55.3 cherry-pick);
op semantics from Ascend op-plugin ``torch_npu-npu_fusion_attention.md`` (reference/npu_api.md §1).
Version gates: the interfaces exist in both layouts; tested in CI on 5.19 (mask builders there receive
``q_length``), written for 4.57.x (``cache_position``) by accepting any keywords; the v4 path was checked once by
hand against 4.57.6 on the shim. Sliding-window attention is not routed (Qwen2.5 / Qwen3 ship with it off): a
model with ``config.sliding_window`` set keeps its implementation, and the function refuses a window.
When to remove: the guard when no supported stack pins a transformers in :data:`FA2_NEEDS_FLASH_ATTN` (verl's NPU
image uses 4.57.6, which is fixed); the attention function when transformers' own NPU FA2 path handles packed
sequences and masks the way this one does and is verified equal by tests/unit/test_patches_npu.py.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch

from ._core import (
    ALREADY,
    APPLIED,
    SKIPPED,
    PatchContext,
    PatchEntry,
    swap_item,
    switch_attn_implementation,
    switched_from,
    torch_npu,
    version_in,
)

NAME = "npu_fusion"
_TND_MAX_SEQS = 1024  # torch_npu 2.7.1: "varlen场景下长度最大支持1K" sequences per call
# transformers releases whose flash_attention_2 path insists on the flash_attn package even on NPU (PR #39474 /
# #40002 introduced it, #39844 / #40151 fixed it, 4.55.3 missed the cherry-pick: issue #40262). Field reports
# hit it on 4.53.x; 4.55.1 / 4.55.2 may be fixed but are not verified, so the whole span is treated as broken.
FA2_NEEDS_FLASH_ATTN = ">=4.53.0,<4.56.0"
_ROUTABLE = ("eager", "sdpa", "flash_attention_2", NAME)
_COMPRESSED = 2048  # sparse modes 2/3/4 take this fixed triu mask whatever the sequence length


def fa2_needs_flash_attn_package(version: str) -> bool:
    """Whether this transformers' flash_attention_2 path fails on NPU for want of the flash_attn package."""
    return version_in(version, FA2_NEEDS_FLASH_ATTN)


@functools.lru_cache(maxsize=8)
def _compressed_causal_mask(device: torch.device) -> torch.Tensor:
    return torch.triu(torch.ones(_COMPRESSED, _COMPRESSED, dtype=torch.bool, device=device), diagonal=1)


# ---------------------------------------------------------------------------------------------------------
# Mask builder (AttentionMaskInterface)
# ---------------------------------------------------------------------------------------------------------


def npu_fusion_mask(*args: Any, attention_mask: torch.Tensor | None = None, kv_length: int | None = None, **kwargs):
    """The 2-D padding mask [B, kv_length] (True = token) when there is padding, else None.

    Like transformers' flash-attention mask builder: the causal / packed structure is not materialised here
    but derived in the attention function (compressed causal mask, sequence boundaries).
    """
    if attention_mask is None or attention_mask.dim() != 2:
        return attention_mask
    if kv_length is not None:
        attention_mask = attention_mask[:, -kv_length:]
    return None if bool(attention_mask.all()) else attention_mask.bool()


# ---------------------------------------------------------------------------------------------------------
# Attention function (AttentionInterface)
# ---------------------------------------------------------------------------------------------------------


def _packed_ends(position_ids: torch.Tensor, batch: int, seq: int) -> list[int] | None:
    """Cumulative sequence ends over the flattened [B*S] tokens, or None when every row is one sequence.

    A sequence starts at each row start and wherever the position is not the previous one + 1 (the rule of
    transformers' packed-sequence detection).
    """
    pos = position_ids.expand(batch, -1).reshape(-1)  # [B*S]
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[1:] = pos[1:] != pos[:-1] + 1
    starts[::seq] = True
    start_idx = starts.nonzero().squeeze(-1).tolist()
    if len(start_idx) == batch:
        return None
    return start_idx[1:] + [batch * seq]


def _sequence_plan(query, key, attention_mask, position_ids, kwargs) -> tuple[torch.Tensor | None, list, list] | None:
    """(token indices or None, q ends, kv ends) for the TND layout, or None for the dense BSND layout."""
    batch, _, seq, _ = query.shape
    if seq != key.shape[2]:
        return None  # queries against a longer KV cache: dense
    if attention_mask is not None:  # [B, S] True = token: gather the tokens, one sequence per row
        lengths = attention_mask.sum(-1)
        ends = lengths[lengths > 0].cumsum(0).tolist()
        return attention_mask.reshape(-1).nonzero().squeeze(-1), ends, ends
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None and cu_k is not None:  # precomputed by a padding-free collator (with a leading 0)
        return None, [int(e) for e in cu_q[1:].tolist()], [int(e) for e in cu_k[1:].tolist()]
    if position_ids is None:
        return None
    ends = _packed_ends(position_ids, batch, seq)
    return None if ends is None else (None, ends, ends)


_last_plan: dict[str, Any] = {"source": None, "key": None, "plan": None}


def _cached_sequence_plan(query, key, attention_mask, position_ids, kwargs):
    """:func:`_sequence_plan`, computed once per forward instead of once per layer.

    Every layer of one forward gets the same mask / position_ids tensor; the plan needs host syncs (nonzero,
    tolist), which are costly on NPU. The entry is keyed on a weak reference to that tensor (a freed tensor
    cannot alias a new one), its in-place version counter and the shapes.
    """
    source = attention_mask if attention_mask is not None else kwargs.get("cu_seq_lens_q")
    source = source if source is not None else position_ids
    if source is None:
        return _sequence_plan(query, key, attention_mask, position_ids, kwargs)
    cache_key = (source._version, tuple(query.shape[:3]), key.shape[2], attention_mask is None)
    ref = _last_plan["source"]
    if ref is not None and ref() is source and _last_plan["key"] == cache_key:
        return _last_plan["plan"]
    plan = _sequence_plan(query, key, attention_mask, position_ids, kwargs)
    _last_plan.update(source=weakref.ref(source), key=cache_key, plan=plan)
    return plan


def _explicit_mask(attention_mask: torch.Tensor, sq: int, skv: int, causal: bool) -> torch.Tensor:
    """[B, 1, Sq, Skv] bool, True = masked (npu_fusion_attention's convention)."""
    if attention_mask.dim() == 4:  # the caller's own mask: bool True = attend, or additive (0 = attend)
        return ~attention_mask if attention_mask.dtype == torch.bool else attention_mask < 0
    masked = ~attention_mask[:, None, None, -skv:].bool()  # [B, 1, 1, Skv]
    if causal:  # bottom-right aligned: query i sits at key position i + Skv - Sq
        i = torch.arange(sq, device=masked.device)[:, None]
        j = torch.arange(skv, device=masked.device)[None, :]
        masked = masked | (j > i + (skv - sq))
    return masked


def _varlen(npu, query, key, value, plan, scale: float, keep_prob: float, causal: bool) -> torch.Tensor:
    """TND attention over the sequences of ``plan``; returns [B, S, N, Dv]."""
    indices, ends_q, ends_k = plan
    batch, heads, seq, _ = query.shape

    def tokens(t: torch.Tensor) -> torch.Tensor:  # [B, N, S, D] -> [B*S, N, D] (-> real tokens only)
        flat = t.transpose(1, 2).reshape(batch * seq, t.shape[1], t.shape[-1])
        return flat if indices is None else flat.index_select(0, indices)

    mask = {"atten_mask": _compressed_causal_mask(query.device), "sparse_mode": 3} if causal else {}
    q, k, v = tokens(query), tokens(key), tokens(value)
    outs = []
    # torch_npu 2.7.1 takes at most 1024 sequences per TND call (op docs): longer plans go in chunks.
    for first in range(0, len(ends_q), _TND_MAX_SEQS):
        cq, ck = ends_q[first : first + _TND_MAX_SEQS], ends_k[first : first + _TND_MAX_SEQS]
        q0, k0 = (ends_q[first - 1], ends_k[first - 1]) if first else (0, 0)
        outs.append(npu.npu_fusion_attention(
            q[q0 : cq[-1]], k[k0 : ck[-1]], v[k0 : ck[-1]], heads, "TND", scale=scale, keep_prob=keep_prob,
            actual_seq_qlen=[e - q0 for e in cq], actual_seq_kvlen=[e - k0 for e in ck], **mask,
        )[0])  # [t, N, Dv]  # fmt: skip
    if (tail := q.shape[0] - ends_q[-1]) > 0:  # tokens after the last sequence attend to nothing: 0, as before
        outs.append(outs[0].new_zeros(tail, *outs[0].shape[1:]))
    out = torch.cat(outs) if len(outs) > 1 else outs[0]  # [T, N, Dv]
    if indices is not None:  # pad rows get 0, as transformers' flash path does
        out = out.new_zeros(batch * seq, heads, out.shape[-1]).index_copy(0, indices, out)
    return out.view(batch, seq, heads, -1)


def npu_fusion_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, N, Sq, D]
    key: torch.Tensor,  # [B, Nkv, Skv, D]
    value: torch.Tensor,  # [B, Nkv, Skv, Dv]
    attention_mask: torch.Tensor | None,  # from npu_fusion_mask: [B, Skv] bool, or None; or a caller's 4-D mask
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention-interface function on ``torch_npu.npu_fusion_attention``; returns ([B, Sq, N, Dv], None).

    GQA needs no key/value repetition: the op takes Nq / Nkv heads directly.
    """
    if sliding_window is not None:
        raise ValueError(
            f"attn_implementation='{NAME}' does not implement sliding-window attention (window {sliding_window}); "
            "use sdpa for this model"
        )
    npu = torch_npu()
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    keep_prob = 1.0 - (dropout if module.training else 0.0)  # the op's keep_prob is the kept fraction
    heads, sq, skv = query.shape[1], query.shape[2], key.shape[2]
    plan = None
    if attention_mask is None or attention_mask.dim() == 2:
        plan = _cached_sequence_plan(query, key, attention_mask, kwargs.get("position_ids"), kwargs)
    if plan is not None:
        return _varlen(npu, query, key, value, plan, scale, keep_prob, causal), None
    if attention_mask is not None:
        mask = {"atten_mask": _explicit_mask(attention_mask, sq, skv, causal), "sparse_mode": 0}
    elif causal:
        mask = {"atten_mask": _compressed_causal_mask(query.device), "sparse_mode": 3}
    else:
        mask = {}
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # BSND: contiguous for projections' output
    out = npu.npu_fusion_attention(q, k, v, heads, "BSND", scale=scale, keep_prob=keep_prob, **mask)[0]
    return out, None  # [B, Sq, N, Dv]


# ---------------------------------------------------------------------------------------------------------
# Patch points: attention + flash_attention_2 guard
# ---------------------------------------------------------------------------------------------------------


def resolve_attn_implementation(requested: str | None, backend: Any) -> str | None:
    """What to pass to ``from_pretrained(attn_implementation=...)`` on ``backend``.

    On NPU, flash_attention_2 is loaded as sdpa when transformers' own FA2 path cannot run there (loading runs
    its flash-attn checks: the versions in FA2_NEEDS_FLASH_ATTN, or a transformers that does not detect
    torch_npu); apply_npu_patches then switches the model to npu_fusion. Everything else passes through.
    """
    if getattr(backend, "name", None) != "npu" or requested != "flash_attention_2":
        return requested
    from . import _core

    return "sdpa" if fa2_problem(_core.transformers_version()) else requested


def _register(ctx: PatchContext) -> str:
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    statuses = {
        swap_item(AttentionInterface._global_mapping, NAME, npu_fusion_attention_forward, ctx.family),
        swap_item(AttentionMaskInterface._global_mapping, NAME, npu_fusion_mask, ctx.family),
    }
    return APPLIED if APPLIED in statuses else ALREADY


def _attention_entry(ctx: PatchContext) -> PatchEntry:
    target = "AttentionInterface"
    if skipped := ctx.excluded("attention", target):
        return skipped
    status = _register(ctx)
    if ctx.model is None:
        return PatchEntry("attention", target, status, f"registered '{NAME}'; load with attn_implementation='{NAME}'")
    config = ctx.model.config
    current = config._attn_implementation
    if (window := getattr(config, "sliding_window", None)) is not None:
        return PatchEntry("attention", target, SKIPPED, f"sliding window {window}: model keeps {current}")
    if current not in _ROUTABLE:
        return PatchEntry("attention", target, SKIPPED, f"model uses {current!r}; left unchanged")
    if problem := _fa_limit_problem(config):
        return PatchEntry("attention", target, SKIPPED, f"{problem}: model keeps {current}")
    switch, before = switch_attn_implementation(config, NAME, ctx.family)
    status = APPLIED if APPLIED in (status, switch) else ALREADY
    return PatchEntry("attention", target, status, f"npu_fusion_attention; model {before} -> {NAME}")


def _fa_limit_problem(config: Any) -> str | None:
    """Why npu_fusion_attention (torch_npu 2.7.1 op docs: head dim 1-768, 1-256 query heads) cannot take it."""
    heads = getattr(config, "num_attention_heads", 0)
    head_dim = getattr(config, "head_dim", None) or getattr(config, "hidden_size", 0) // max(heads, 1)
    if not (1 <= head_dim <= 768 and 1 <= heads <= 256):
        return f"head dim {head_dim} / {heads} heads outside npu_fusion_attention's 768 / 256"
    return None


def _transformers_sees_npu() -> bool:
    """Whether transformers' own NPU detection is on (it is process-wide and cached by transformers)."""
    try:
        from transformers.utils import is_torch_npu_available

        return bool(is_torch_npu_available())
    except Exception:  # an old or broken install: then its NPU flash path cannot be relied on either
        return False


def fa2_problem(version: str) -> str | None:
    """Why transformers' flash_attention_2 cannot run on this NPU, or None when it can."""
    if fa2_needs_flash_attn_package(version):
        return f"transformers {version}'s FA2 needs flash_attn"
    if not _transformers_sees_npu():  # then FA2 looks for the flash_attn package / a hub kernel
        return "transformers does not detect torch_npu"
    return None


def _guard_entry(ctx: PatchContext, requested: str | None, attention: PatchEntry) -> PatchEntry:
    target = "attn_implementation"
    if skipped := ctx.excluded("flash_attn_guard", target):
        return skipped
    if ctx.model is None:
        return PatchEntry("flash_attn_guard", target, SKIPPED, "no model given (see resolve_attn_implementation)")
    if requested != "flash_attention_2":
        return PatchEntry("flash_attn_guard", target, SKIPPED, f"model requests {requested!r}, not flash_attention_2")
    why = fa2_problem(ctx.version)
    config = ctx.model.config
    if config._attn_implementation == NAME:  # the attention point routed it
        detail = f"flash_attention_2 -> {NAME}" + (f" ({why})" if why else "")
        return PatchEntry("flash_attn_guard", target, attention.status, detail)
    if why is None:
        return PatchEntry("flash_attn_guard", target, SKIPPED, f"transformers {ctx.version} runs FA2 on NPU itself")
    status, _ = switch_attn_implementation(config, "sdpa", ctx.family)
    return PatchEntry("flash_attn_guard", target, status, f"flash_attention_2 -> sdpa ({why})")


def patch_attention(ctx: PatchContext) -> list[PatchEntry]:
    """The attention point and the flash_attention_2 guard (the guard needs to know what attention did)."""
    requested = None
    if ctx.model is not None:
        config = ctx.model.config
        requested = switched_from(config) or config._attn_implementation  # what the user asked for originally
    attention = _attention_entry(ctx)
    return [attention, _guard_entry(ctx, requested, attention)]
