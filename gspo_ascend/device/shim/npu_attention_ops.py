"""CPU references of torch_npu 2.10.0.post4's ``npu_fusion_attention`` and ``npu_fusion_attention_grad``.

Part of the shim's op references (:mod:`.npu_ops`, which exports them and states how the emulation differs from
the hardware); a module of its own because the two attention ops are half of all the reference code.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from .npu_ops_common import _check_dtype, _compute_dtype

__all__ = ["npu_fusion_attention", "npu_fusion_attention_grad"]

_INT32_MAX = 2147483647
_COMPRESSED_MASK_SIZE = 2048
_STAT_REPLICAS = 8  # softmax_max / softmax_sum are replicated 8 times in the last dim (one 32-byte block)
_FA_LAYOUTS = ("BSH", "SBH", "BSND", "BNSD", "TND")


# ---------------------------------------------------------------------------------------------------------
# npu_fusion_attention
# ---------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _compressed_causal_mask() -> torch.Tensor:
    return torch.triu(torch.ones(_COMPRESSED_MASK_SIZE, _COMPRESSED_MASK_SIZE, dtype=torch.bool), diagonal=1)


def _check_compressed_mask(mask: torch.Tensor, sparse_mode: int) -> None:
    """Modes 2/3/4 take the compressed ``triu(ones(2048, 2048), 1)`` mask; anything else is a caller bug.

    On the NPU a wrong mask gives silently wrong results; refusing it here surfaces the bug on CPU.
    """
    leading_ones = mask.dim() > 2 and all(size == 1 for size in mask.shape[:-2])
    squeezed = mask.reshape(mask.shape[-2:]) if leading_ones else mask
    if squeezed.dim() != 2 or not torch.equal(squeezed.cpu(), _compressed_causal_mask()):
        raise ValueError(
            f"npu_fusion_attention: sparse_mode={sparse_mode} expects the compressed mask "
            f"torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1), got shape {tuple(mask.shape)}"
        )


def _band(sq: int, skv: int, pre: int, nxt: int, offset: int, device: torch.device) -> torch.Tensor:
    """Keep ``-pre <= (j - i - offset) <= nxt``; offset 0 = top-left origin, ``skv - sq`` = bottom-right."""
    i = torch.arange(sq, device=device).unsqueeze(1)
    j = torch.arange(skv, device=device).unsqueeze(0)
    d = j - i - offset
    return (d <= nxt) & (d >= -pre)  # [Sq, Skv]


def _keep_mask(
    atten_mask: torch.Tensor | None, sq: int, skv: int, sparse_mode: int, pre: int, nxt: int, varlen: bool
) -> torch.Tensor | None:
    """Boolean keep-mask (True = attend) broadcastable to ``[B, N, Sq, Skv]``, or None for full attention.

    Keep rules by sparse_mode (npu_api.md §8): 0 = ~mask within the band -pre <= j-i <= next (top-left origin);
    1 = ~mask; 2 = j <= i; 3 = j <= i + Skv - Sq; 4 = the band around the bottom-right diagonal. A None mask
    means full attention: sparse_mode and pre/next are then ignored (documented).
    """
    if atten_mask is None:
        return None
    mask = atten_mask if atten_mask.dtype == torch.bool else atten_mask != 0  # True/1 = masked out
    device = mask.device
    if sparse_mode in (0, 1):
        if varlen:  # varlen takes only an SS mask of [maxSq, maxSkv]; each sequence uses its top-left block
            if mask.dim() != 2 or mask.shape[0] < sq or mask.shape[1] < skv:
                raise ValueError(
                    f"npu_fusion_attention: TND takes an SS mask covering [{sq}, {skv}], got {tuple(mask.shape)}"
                )
            mask = mask[:sq, :skv]
        elif mask.dim() not in (2, 4) or tuple(mask.shape[-2:]) != (sq, skv):
            raise ValueError(
                f"npu_fusion_attention: atten_mask must be BNSS, B1SS, 11SS or SS with S dims ({sq}, {skv}), "
                f"got {tuple(mask.shape)}"
            )
        keep = ~mask
        if sparse_mode == 0:
            keep = keep & _band(sq, skv, pre, nxt, 0, device)
        return keep
    if sparse_mode in (2, 3, 4):
        _check_compressed_mask(mask, sparse_mode)
        if sparse_mode == 2:
            return _band(sq, skv, _INT32_MAX, 0, 0, device)
        if sparse_mode == 3:
            return _band(sq, skv, _INT32_MAX, 0, skv - sq, device)
        return _band(sq, skv, pre, nxt, skv - sq, device)
    raise ValueError(
        f"npu_fusion_attention: sparse_mode={sparse_mode} is not emulated (0-4 are; 5/6 prefix and 7/8 "
        "varlen split modes are not)"
    )


def _attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None, scale: float):
    """``softmax(mask(scale * q k^T)) v`` for BNSD tensors; returns (out, row_max, row_sum).

    q: [B, N, Sq, D], k: [B, Nkv, Skv, D], v: [B, Nkv, Skv, Dv]; KV heads are expanded with
    repeat_interleave(N / Nkv) (GQA). Rows with every key masked give 0 (an assumption: the NPU docs only say
    such rows lose precision unless inner_precise=2). row_max / row_sum are the softmax statistics of the
    scaled scores, [B, N, Sq] in fp32.
    """
    cdt = _compute_dtype(q.dtype)
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q.to(cdt), k.to(cdt).transpose(-1, -2)) * scale  # [B, N, Sq, Skv]
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    # softmax is shift invariant, so the max can be detached without changing any gradient.
    row_max = scores.detach().amax(dim=-1, keepdim=True)  # [B, N, Sq, 1]
    empty_row = row_max == float("-inf")
    p = torch.exp(scores - torch.where(empty_row, torch.zeros_like(row_max), row_max))
    row_sum = p.sum(dim=-1, keepdim=True)
    probs = p / torch.where(row_sum == 0, torch.ones_like(row_sum), row_sum)
    out = torch.matmul(probs, v.to(cdt)).to(q.dtype)  # [B, N, Sq, Dv]
    # Fully masked rows: a very negative finite max keeps ring-attention style updates (exp(m_old - m_new))
    # free of NaN; the NPU's exact value for such rows is undocumented.
    stat_max = torch.where(empty_row, torch.full_like(row_max, torch.finfo(torch.float32).min), row_max)
    return out, stat_max.squeeze(-1).float(), row_sum.detach().squeeze(-1).float()


def _head_dims(query, key, value, head_num: int, layout: str) -> tuple[int, int, int]:
    """(Nkv, D, Dv) from the inputs; for BSH/SBH the head split is implied by ``head_num``."""
    if layout in ("BSH", "SBH"):
        if query.shape[-1] % head_num:
            raise ValueError(f"npu_fusion_attention: hidden {query.shape[-1]} is not divisible by head_num={head_num}")
        d = query.shape[-1] // head_num
        if key.shape[-1] % d:
            raise ValueError(f"npu_fusion_attention: key hidden {key.shape[-1]} is not a multiple of head dim {d}")
        nkv = key.shape[-1] // d
        return nkv, d, value.shape[-1] // nkv
    n_axis = {"BSND": 2, "BNSD": 1, "TND": 1}[layout]
    if query.shape[n_axis] != head_num:
        raise ValueError(f"npu_fusion_attention: query has {query.shape[n_axis]} heads, head_num={head_num}")
    return key.shape[n_axis], query.shape[-1], value.shape[-1]


def _to_bnsd(t: torch.Tensor, layout: str, heads: int) -> torch.Tensor:
    if layout == "BNSD":
        return t
    if layout == "BSND":
        return t.transpose(1, 2)
    if layout == "BSH":  # [B, S, N*D]
        b, s, h = t.shape
        return t.reshape(b, s, heads, h // heads).transpose(1, 2)
    s, b, h = t.shape  # SBH: [S, B, N*D]
    return t.reshape(s, b, heads, h // heads).permute(1, 2, 0, 3)


def _from_bnsd(t: torch.Tensor, layout: str) -> torch.Tensor:
    b, n, s, d = t.shape  # [B, N, S, Dv]
    if layout == "BNSD":
        return t
    if layout == "BSND":
        return t.transpose(1, 2)
    if layout == "BSH":
        return t.transpose(1, 2).reshape(b, s, n * d)
    return t.permute(2, 0, 1, 3).reshape(s, b, n * d)  # SBH


def _seq_bounds(cumulative: Sequence[int], total: int, name: str) -> list[tuple[int, int]]:
    """Cumulative ends without a leading 0 -> [(start, end)]; trailing zeros skip the remaining batches."""
    bounds, prev = [], 0
    for end in (int(e) for e in cumulative):
        if end < prev:  # documented: trailing zeros mark batches that do not take part
            break
        bounds.append((prev, end))
        prev = end
    if prev > total:
        raise ValueError(f"npu_fusion_attention: {name} ends at {prev} but the tensor has only {total} tokens")
    return bounds


def _as_int_list(values) -> list[int]:
    if values is None:
        raise ValueError("npu_fusion_attention: input_layout='TND' requires actual_seq_qlen and actual_seq_kvlen")
    return [int(v) for v in (values.tolist() if isinstance(values, torch.Tensor) else values)]


def _fusion_attention_varlen(query, key, value, head_num, atten_mask, scale, pre, nxt, seq_q, seq_kv, sparse_mode):
    """TND: q [T, N, D], k/v [Tkv, Nkv, D(v)]; each sequence attends only within itself.

    Returns out [T, N, Dv] and the statistics [N, T] (rows past the last sequence are 0 / fully masked).
    """
    q_bounds = _seq_bounds(_as_int_list(seq_q), query.shape[0], "actual_seq_qlen")
    kv_bounds = _seq_bounds(_as_int_list(seq_kv), key.shape[0], "actual_seq_kvlen")
    if len(q_bounds) != len(kv_bounds):
        raise ValueError(f"npu_fusion_attention: {len(q_bounds)} query sequences but {len(kv_bounds)} key sequences")
    n, dv = query.shape[1], value.shape[-1]
    outs, maxes, sums = [], [], []
    for (qs, qe), (ks, ke) in zip(q_bounds, kv_bounds, strict=True):
        sq, skv = qe - qs, ke - ks
        if sq == 0:
            continue
        if skv == 0:  # nothing to attend to: fully masked rows
            outs.append(query.new_zeros(sq, n, dv))
            maxes.append(torch.full((n, sq), torch.finfo(torch.float32).min))
            sums.append(torch.zeros(n, sq))
            continue
        keep = _keep_mask(atten_mask, sq, skv, sparse_mode, pre, nxt, varlen=True)
        qi, ki, vi = (t.permute(1, 0, 2).unsqueeze(0) for t in (query[qs:qe], key[ks:ke], value[ks:ke]))
        o, m, s = _attention_core(qi, ki, vi, keep, scale)  # [1, N, sq, Dv], [1, N, sq]
        outs.append(o[0].permute(1, 0, 2))
        maxes.append(m[0])
        sums.append(s[0])
    tail = query.shape[0] - (q_bounds[-1][1] if q_bounds else 0)
    if tail:
        outs.append(query.new_zeros(tail, n, dv))
        maxes.append(torch.full((n, tail), torch.finfo(torch.float32).min))
        sums.append(torch.zeros(n, tail))
    return torch.cat(outs, 0), torch.cat(maxes, 1), torch.cat(sums, 1)


# torch_npu 2.10.0.post4's npu_fusion_attention limits (op docs, 约束说明): head dim 1-768 with Dq = Dk >= Dv, Nq 1-256,
# B up to 2M (2K in varlen), at most 1K sequences in a varlen (TND) call, T = B*S up to 1M.
_FA_MAX_HEAD_DIM = 768
_FA_MAX_HEADS = 256
_FA_MAX_VARLEN_SEQS = 1024
_FA_MAX_TOKENS = 1 << 20


def _check_fusion_attention_limits(query, key, value, head_num, input_layout, atten_mask, seq_q) -> None:
    op = "npu_fusion_attention"
    for name, t in (("query", query), ("key", key), ("value", value)):
        _check_dtype(op, name, t)
    if not query.dtype == key.dtype == value.dtype:
        dtypes = f"{query.dtype}, {key.dtype}, {value.dtype}"
        raise ValueError(f"{op}: query, key and value must share one dtype, got {dtypes}")
    if atten_mask is not None:
        _check_dtype(op, "atten_mask", atten_mask, (torch.bool, torch.uint8))
    if not 1 <= head_num <= _FA_MAX_HEADS:
        raise ValueError(f"{op}: head_num must be 1-{_FA_MAX_HEADS}, got {head_num}")
    if input_layout == "TND":
        n_seq = len(_as_int_list(seq_q))
        if n_seq > _FA_MAX_VARLEN_SEQS:
            raise ValueError(f"{op}: TND takes at most {_FA_MAX_VARLEN_SEQS} sequences per call, got {n_seq}")
        if query.shape[0] > _FA_MAX_TOKENS:
            raise ValueError(f"{op}: TND takes at most {_FA_MAX_TOKENS} tokens, got {query.shape[0]}")


def _check_fusion_attention_args(
    query, key, value, head_num, input_layout, pse, padding_mask, keep_prob, sink=None, dropout_mask=None
):
    if input_layout not in _FA_LAYOUTS:
        raise ValueError(f"npu_fusion_attention: input_layout must be one of {_FA_LAYOUTS}, got {input_layout!r}")
    if keep_prob != 1.0:
        raise ValueError(
            f"npu_fusion_attention: keep_prob={keep_prob} (dropout) is not emulated on the CPU shim; use 1.0"
        )
    if pse is not None:
        raise ValueError("npu_fusion_attention: pse (positional bias) is not emulated on the CPU shim")
    if padding_mask is not None:
        raise ValueError("npu_fusion_attention: padding_mask is not supported (torch_npu documents it as unsupported)")
    if sink is not None:
        raise ValueError("npu_fusion_attention: sink (attention-sink logits) is not emulated on the CPU shim")
    if dropout_mask is not None:
        raise ValueError("npu_fusion_attention: dropout_mask (dropout) is not emulated on the CPU shim")
    if input_layout not in ("BSH", "SBH") and key.shape[:-1] != value.shape[:-1]:
        raise ValueError(f"npu_fusion_attention: key {tuple(key.shape)} and value {tuple(value.shape)} disagree")
    nkv, d, dv = _head_dims(query, key, value, head_num, input_layout)
    if nkv < 1 or head_num % nkv:
        raise ValueError(f"npu_fusion_attention: head_num={head_num} is not a multiple of the {nkv} KV heads")
    if dv > d:
        raise ValueError(f"npu_fusion_attention: value head dim {dv} exceeds query/key head dim {d} (needs Dk >= Dv)")
    if not 1 <= d <= _FA_MAX_HEAD_DIM:
        raise ValueError(f"npu_fusion_attention: head dim must be 1-{_FA_MAX_HEAD_DIM} in torch_npu, got {d}")
    return nkv


def _replicate_stat(stat: torch.Tensor) -> torch.Tensor:
    """[..., S] -> [..., S, 8]: the NPU stores each softmax statistic 8 times (one 32-byte block)."""
    return stat.unsqueeze(-1).expand(*stat.shape, _STAT_REPLICAS).contiguous()


def npu_fusion_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    head_num: int,
    input_layout: str,
    pse: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    scale: float = 1.0,
    keep_prob: float = 1.0,
    pre_tockens: int = _INT32_MAX,
    next_tockens: int = _INT32_MAX,
    inner_precise: int = 0,
    prefix: Sequence[int] | None = None,
    actual_seq_qlen: Sequence[int] | None = None,
    actual_seq_kvlen: Sequence[int] | None = None,
    sparse_mode: int = 0,
    gen_mask_parallel: bool = True,
    sync: bool = False,
    softmax_layout: str = "",
    sink: torch.Tensor | None = None,
    dropout_mask: torch.Tensor | None = None,
    seed: int = 0,
    offset: int = 0,
):
    """Fused attention ``Dropout(Softmax(Mask(scale * (pse + Q K^T))), keep_prob) V`` (torch_npu semantics).

    Returns the 7-tuple ``(out, softmax_max, softmax_sum, softmax_out, seed, offset, numels)``:

    ==========  ===============  ==================================
    layout      out              softmax_max / softmax_sum (fp32)
    ==========  ===============  ==================================
    BSH         [B, S, N*Dv]     [B, N, S, 8]
    SBH         [S, B, N*Dv]     [B, N, S, 8]
    BSND        [B, S, N, Dv]    [B, N, S, 8]
    BNSD        [B, N, S, Dv]    [B, N, S, 8]
    TND         [T, N, Dv]       [T, N, 8]
    ==========  ===============  ==================================

    ``atten_mask``: True/1 = masked out; BNSS, B1SS, 11SS or SS (TND: SS only). ``sparse_mode`` 0-4 follow the
    keep rules in :func:`_keep_mask`; modes 2/3/4 require the compressed 2048x2048 ``triu(ones, 1)`` mask.
    ``atten_mask=None`` means full attention whatever sparse_mode says. TND takes cumulative
    ``actual_seq_qlen``/``actual_seq_kvlen`` ends without a leading 0 (lengths [2, 2, 2] -> [2, 4, 6]);
    trailing zeros skip batches. GQA: N / Nkv must be an integer; KV heads are repeat_interleave'd.

    torch_npu's limits (its 2.10.0.post4 op docs), enforced: q/k/v one dtype of fp16 / bf16 / fp32; mask bool or
    uint8; head dim 1-768 with Dk >= Dv; 1-256 query heads; TND with at most 1024 sequences and 1M tokens.

    2.10 added four trailing arguments (its schema; 2.7.1 had none of them): ``sink`` (per-head attention-sink
    logits) and ``dropout_mask`` (a caller-made dropout mask) are not emulated and raise ``ValueError`` when
    given; ``seed`` / ``offset`` seed the dropout RNG, so with dropout off (``keep_prob=1``, the only value
    emulated) they change nothing on the NPU either, and are accepted and ignored.

    Emulation differences: dropout (``keep_prob != 1``), ``pse``, ``sink``, ``dropout_mask`` and sparse modes
    5-8 raise ``ValueError``. Fully masked query rows give 0 (undocumented on the NPU). ``softmax_max``/``softmax_sum``
    are detached (the NPU backward kernel consumes them, autograd here does not need them); for TND with the
    default ``softmax_layout=""`` they are returned in the documented [T, N, 8] shape but with the documented
    NTD storage order (a reshape of [N, T, 8]), exactly as the NPU does; ``softmax_layout="TND"`` gives a true
    [T, N, 8]. ``softmax_out`` is an empty reserved tensor; ``seed``, ``offset`` and ``numels`` are 0 (the dropout RNG
    state the NPU returns; no dropout here).
    """
    nkv = _check_fusion_attention_args(
        query, key, value, head_num, input_layout, pse, padding_mask, keep_prob, sink, dropout_mask
    )
    _check_fusion_attention_limits(query, key, value, head_num, input_layout, atten_mask, actual_seq_qlen)
    if input_layout == "TND":
        out, smax, ssum = _fusion_attention_varlen(
            query, key, value, head_num, atten_mask, scale, pre_tockens, next_tockens,
            actual_seq_qlen, actual_seq_kvlen, sparse_mode,
        )  # fmt: skip
        stat_shape = (query.shape[0], head_num, _STAT_REPLICAS)  # [T, N, 8]
        if softmax_layout == "TND":
            smax, ssum = _replicate_stat(smax.transpose(0, 1)), _replicate_stat(ssum.transpose(0, 1))
        else:  # default: NTD storage order under the documented [T, N, 8] shape
            smax, ssum = _replicate_stat(smax).view(stat_shape), _replicate_stat(ssum).view(stat_shape)
    else:
        q = _to_bnsd(query, input_layout, head_num)  # [B, N, Sq, D]
        k = _to_bnsd(key, input_layout, nkv)  # [B, Nkv, Skv, D]
        v = _to_bnsd(value, input_layout, nkv)  # [B, Nkv, Skv, Dv]
        keep = _keep_mask(atten_mask, q.shape[2], k.shape[2], sparse_mode, pre_tockens, next_tockens, varlen=False)
        out_bnsd, smax, ssum = _attention_core(q, k, v, keep, scale)
        out = _from_bnsd(out_bnsd, input_layout)
        smax, ssum = _replicate_stat(smax), _replicate_stat(ssum)  # [B, N, Sq, 8]
    softmax_out = query.new_empty(0)
    return out, smax, ssum, softmax_out, 0, 0, 0


def _attention_grad_core(q, k, v, dy, keep, scale: float, row_max, row_sum, out):
    """Flash-attention backward for BNSD tensors with the given softmax statistics: (dq, dk, dv).

    ``P = exp(scale * q k^T - row_max) / row_sum`` (masked entries 0), ``dv = P^T dy``, ``dP = dy v^T``,
    ``dS = P * (dP - rowsum(dy * out))``, ``dq = scale * dS k``, ``dk = scale * dS^T q``; GQA sums dk / dv over
    each KV head's query heads. ``row_max`` / ``row_sum`` [B, N, Sq] and ``out`` [B, N, Sq, Dv] are the
    forward's statistics and output; given the statistics of a *larger* attention (more keys than ``k``, as a
    ring attention passes the combined ones), the result is this block's share of that attention's gradient.
    None = this call's own softmax, recomputed in the compute dtype (then the result is the gradient of
    ``npu_fusion_attention`` itself; with the forward's statistics, which are fp32, it is that to fp32 rounding).
    """
    cdt = _compute_dtype(q.dtype)
    n, nkv = q.shape[1], k.shape[1]
    group = n // nkv
    qc, kc, vc, dyc = (t.to(cdt) for t in (q, k, v, dy))
    ke = kc.repeat_interleave(group, dim=1) if group > 1 else kc
    ve = vc.repeat_interleave(group, dim=1) if group > 1 else vc
    scores = torch.matmul(qc, ke.transpose(-1, -2)) * scale  # [B, N, Sq, Skv]
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    if row_max is None:  # this call's own softmax, in the compute dtype (the forward returns fp32 statistics)
        m = scores.amax(dim=-1, keepdim=True)
        m = torch.where(m == float("-inf"), torch.zeros_like(m), m)
        out = None
    else:
        m = row_max.to(cdt).unsqueeze(-1)
    p = torch.exp(scores - m)
    total = p.sum(dim=-1, keepdim=True) if row_sum is None else row_sum.to(cdt).unsqueeze(-1)
    probs = p / torch.where(total == 0, torch.ones_like(total), total)  # fully masked rows: 0
    if out is None:
        out = torch.matmul(probs, ve)
    dv = torch.matmul(probs.transpose(-1, -2), dyc)  # [B, N, Skv, Dv]
    dp = torch.matmul(dyc, ve.transpose(-1, -2))  # [B, N, Sq, Skv]
    ds = probs * (dp - (dyc * out.to(cdt)).sum(-1, keepdim=True))
    dq = torch.matmul(ds, ke) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qc) * scale  # [B, N, Skv, D]
    if group > 1:
        b, _, skv, _ = dk.shape
        dk = dk.view(b, nkv, group, skv, -1).sum(2)
        dv = dv.view(b, nkv, group, skv, -1).sum(2)
    return dq, dk, dv


def _stat_bnsd(stat: torch.Tensor | None, layout: str, softmax_layout: str, heads: int) -> torch.Tensor | None:
    """A forward softmax statistic (``npu_fusion_attention``'s output 1 or 2) -> [B, N, Sq] (TND: [N, T])."""
    if stat is None:
        return None
    if layout != "TND":
        return stat[..., 0]  # [B, N, Sq, 8]: 8 identical copies
    if softmax_layout == "TND":
        return stat[..., 0].transpose(0, 1)  # a true [T, N, 8]
    return stat.reshape(heads, -1, _STAT_REPLICAS)[..., 0]  # [T, N, 8] shape in NTD storage order


def npu_fusion_attention_grad(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dy: torch.Tensor,
    head_num: int,
    input_layout: str,
    *,
    pse: torch.Tensor | None = None,
    padding_mask: torch.Tensor | None = None,
    atten_mask: torch.Tensor | None = None,
    softmax_max: torch.Tensor | None = None,
    softmax_sum: torch.Tensor | None = None,
    softmax_in: torch.Tensor | None = None,
    attention_in: torch.Tensor | None = None,
    scale_value: float = 1.0,
    keep_prob: float = 1.0,
    pre_tockens: int = _INT32_MAX,
    next_tockens: int = _INT32_MAX,
    inner_precise: int = 0,
    seed: int = 0,
    offset: int = 0,
    numels: int = 0,
    prefix: Sequence[int] | None = None,
    actual_seq_qlen: Sequence[int] | None = None,
    actual_seq_kvlen: Sequence[int] | None = None,
    sparse_mode: int = 0,
    gen_mask_parallel: bool = True,
    sync: bool = False,
    softmax_layout: str = "",
    sink: torch.Tensor | None = None,
):
    """Backward of :func:`npu_fusion_attention` (torch_npu semantics): ``(dq, dk, dv, dpse, dsink)`` for the
    cotangent ``dy`` of its output, dq / dk / dv in the layouts of ``query`` / ``key`` / ``value`` and in query's
    dtype (2.10.0.post4's meta registration, ``_meta_registrations.py:2211-2226``, which added ``dsink`` to 2.7.1's
    four outputs); ``dpse`` is an empty tensor (no ``pse``) and ``dsink`` the empty fp32 tensor the meta gives
    without a ``sink``. ``sink`` itself (2.10's keyword) is not emulated and raises ``ValueError``.

    The arguments mean what they mean for the forward (same layouts, masks, ``sparse_mode`` keep rules,
    ``scale_value`` = the forward's ``scale``). ``softmax_max`` / ``softmax_sum`` / ``attention_in`` are the
    forward's outputs 1, 2 and 0: the kernel recomputes the probabilities from them instead of re-running the
    softmax, which is what lets a ring attention (MindSpeed's CP) pass the statistics and output of the *whole*
    attention while giving one KV block: the result is then that block's share of the gradient. Without them the
    reference recomputes this call's own forward (the gradient of ``npu_fusion_attention`` itself).

    Same limits and emulation differences as the forward: dropout (``keep_prob != 1``; ``seed`` / ``offset`` /
    ``numels`` are its RNG state), ``pse`` and sparse modes 5-8 raise; ``softmax_in``, ``inner_precise``,
    ``prefix``, ``gen_mask_parallel`` and ``sync`` change nothing here. Computed in fp32 for fp16 / bf16 inputs.
    """
    nkv = _check_fusion_attention_args(query, key, value, head_num, input_layout, pse, padding_mask, keep_prob, sink)
    _check_fusion_attention_limits(query, key, value, head_num, input_layout, atten_mask, actual_seq_qlen)
    _check_dtype("npu_fusion_attention_grad", "dy", dy)
    stats = [_stat_bnsd(t, input_layout, softmax_layout, head_num) for t in (softmax_max, softmax_sum)]
    if (stats[0] is None) != (stats[1] is None) or (stats[0] is not None and attention_in is None):
        raise ValueError(
            "npu_fusion_attention_grad: pass softmax_max, softmax_sum and attention_in together (or none of them)"
        )
    if input_layout == "TND":
        dq, dk, dv = _fusion_attention_grad_varlen(
            query, key, value, dy, atten_mask, scale_value, pre_tockens, next_tockens, actual_seq_qlen,
            actual_seq_kvlen, sparse_mode, stats, attention_in,
        )  # fmt: skip
    else:
        q = _to_bnsd(query, input_layout, head_num)
        k, v = _to_bnsd(key, input_layout, nkv), _to_bnsd(value, input_layout, nkv)
        out = None if attention_in is None else _to_bnsd(attention_in, input_layout, head_num)
        keep = _keep_mask(atten_mask, q.shape[2], k.shape[2], sparse_mode, pre_tockens, next_tockens, varlen=False)
        dq, dk, dv = _attention_grad_core(
            q, k, v, _to_bnsd(dy, input_layout, head_num), keep, scale_value, stats[0], stats[1], out
        )
        dq, dk, dv = _from_bnsd(dq, input_layout), _from_bnsd(dk, input_layout), _from_bnsd(dv, input_layout)
    dtype = query.dtype
    dsink = torch.empty(0, device=query.device)  # the meta's ``torch.empty([0])``: fp32 whatever query is
    return dq.to(dtype), dk.to(dtype), dv.to(dtype), query.new_empty(0), dsink


def _fusion_attention_grad_varlen(query, key, value, dy, atten_mask, scale, pre, nxt, seq_q, seq_kv, sparse_mode,
                                  stats, attention_in):  # fmt: skip
    """TND backward: each sequence's block of q / k / v, as :func:`_fusion_attention_varlen` runs the forward."""
    q_bounds = _seq_bounds(_as_int_list(seq_q), query.shape[0], "actual_seq_qlen")
    kv_bounds = _seq_bounds(_as_int_list(seq_kv), key.shape[0], "actual_seq_kvlen")
    if len(q_bounds) != len(kv_bounds):
        raise ValueError(f"npu_fusion_attention: {len(q_bounds)} query sequences but {len(kv_bounds)} key sequences")
    cdt = _compute_dtype(query.dtype)
    dq = torch.zeros(query.shape, dtype=cdt, device=query.device)
    dk = torch.zeros(key.shape, dtype=cdt, device=key.device)
    dv = torch.zeros(value.shape, dtype=cdt, device=value.device)
    for (qs, qe), (ks, ke) in zip(q_bounds, kv_bounds, strict=True):
        if qe == qs or ke == ks:  # no queries, or nothing to attend to (fully masked rows: zero gradient)
            continue
        keep = _keep_mask(atten_mask, qe - qs, ke - ks, sparse_mode, pre, nxt, varlen=True)

        def bnsd(t, start, end):
            return t[start:end].permute(1, 0, 2).unsqueeze(0)  # [S, N, D] -> [1, N, S, D]

        row_max = None if stats[0] is None else stats[0][:, qs:qe].unsqueeze(0)
        row_sum = None if stats[1] is None else stats[1][:, qs:qe].unsqueeze(0)
        out = None if attention_in is None else bnsd(attention_in, qs, qe)
        gq, gk, gv = _attention_grad_core(
            bnsd(query, qs, qe), bnsd(key, ks, ke), bnsd(value, ks, ke), bnsd(dy, qs, qe), keep, scale,
            row_max, row_sum, out,
        )  # fmt: skip
        dq[qs:qe] += gq[0].permute(1, 0, 2)
        dk[ks:ke] += gk[0].permute(1, 0, 2)
        dv[ks:ke] += gv[0].permute(1, 0, 2)
    return dq, dk, dv
