"""CPU reference implementations of the torch_npu fused ops this project calls.

Each function has torch_npu's name, argument names and defaults, and follows the semantics documented by
torch_npu (Ascend/op-plugin ``docs/.../torch_npu-<op>.md`` and the meta registrations; summarised in
``reference/npu_api.md`` §1 and §8). They are written as plain differentiable torch compositions, so autograd
works without hand-written backward kernels.

How the emulation differs from the hardware, for every op:

* Numerics: low-precision inputs (fp16/bf16) are upcast to fp32 for the arithmetic and the result is cast back,
  the way the fused kernels accumulate; fp64 inputs stay fp64 (the tests compare gradients in fp64). Results
  therefore agree with the NPU to rounding, not bit for bit.
* Speed and memory: these are reference implementations (attention materialises the full score matrix).
* Arguments that only steer the hardware (tiling hints, ``gen_mask_parallel``, ``sync``, ``inner_precise``)
  are accepted and ignored; arguments whose semantics are not emulated (dropout, ``pse``, quantisation)
  raise ``ValueError`` rather than silently computing something else.

Conformance to the pinned torch-npu 2.7.1 (issue #14): every signature here is the Python signature torchgen
derives from the op's schema in the 2.7.1 wheel (``torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml``;
``Tensor self`` becomes ``input``), and the ops refuse what 2.7.1 refuses: the checks of its meta registrations
(``op_plugin/meta/_meta_registrations.py``) and the dtype / shape limits its op docs state
(``_op_plugin_docs.py``), each cited where it is enforced. ``tests/conformance/`` downloads the wheel and
checks both against it, and replays every call our code makes through the real meta functions. The one
deliberate widening is float64, which no NPU kernel takes: :func:`float64_reference` admits it for exact
gradient checks in tests.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F

__all__ = [
    "npu_fusion_attention",
    "npu_fusion_attention_grad",
    "npu_grouped_matmul",
    "npu_moe_finalize_routing",
    "npu_moe_gating_top_k_softmax",
    "npu_moe_init_routing",
    "npu_moe_token_permute",
    "npu_moe_token_unpermute",
    "npu_rms_norm",
    "npu_rotary_mul",
    "npu_swiglu",
    "npu_top_k_top_p",
]

_INT32_MAX = 2147483647
_COMPRESSED_MASK_SIZE = 2048
_STAT_REPLICAS = 8  # softmax_max / softmax_sum are replicated 8 times in the last dim (one 32-byte block)
_FA_LAYOUTS = ("BSH", "SBH", "BSND", "BNSD", "TND")


_NPU_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_float64_ok = False


@contextlib.contextmanager
def float64_reference() -> Iterator[None]:
    """Admit float64 inputs inside the block: for exact gradient checks of the references in tests.

    No torch_npu 2.7.1 fused op takes float64 (their op docs list fp16 / bf16 / fp32 at most), so outside this
    block the shim refuses it as the NPU would.
    """
    global _float64_ok
    before, _float64_ok = _float64_ok, True
    try:
        yield
    finally:
        _float64_ok = before


def _check_dtype(op: str, name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...] = _NPU_FLOATS) -> None:
    if t.dtype in allowed or (_float64_ok and t.dtype == torch.float64 and any(d.is_floating_point for d in allowed)):
        return
    names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
    raise ValueError(f"{op}: {name} must be {names} in torch_npu 2.7.1, got {str(t.dtype).removeprefix('torch.')}")


def _check_dims(op: str, name: str, t: torch.Tensor, lo: int, hi: int) -> None:
    if not lo <= t.dim() <= hi:
        span = f"{lo}-D" if lo == hi else f"{lo}-D to {hi}-D"
        raise ValueError(f"{op}: {name} must be {span} in torch_npu 2.7.1, got shape {tuple(t.shape)}")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for fp16/bf16/fp32 (the kernels accumulate in fp32), fp64 stays fp64."""
    return torch.promote_types(dtype, torch.float32)


# ---------------------------------------------------------------------------------------------------------
# Normalisation, rotary embedding, activation
# ---------------------------------------------------------------------------------------------------------


def npu_rms_norm(input: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6):  # input: torchgen's `self`
    """RMSNorm: ``y = x * rsqrt(mean(x^2) + eps) * gamma`` over the trailing ``gamma.dim()`` dims.

    torch_npu returns a tuple ``(y, rstd)``: ``y`` has the dtype and shape of ``x``; ``rstd`` is float32 with
    shape ``x.shape[:x.dim()-gamma.dim()] + [1]*gamma.dim()`` (keepdim, as the 2.7.1 meta registration builds
    it). The arithmetic is fp32 (as in torch_npu's inductor decomposition).

    2.7.1's limits (op docs): x is fp16 / bf16 / fp32 and 2-D to 8-D; gamma has x's dtype ("数据类型需要和self
    保持一致"), so a caller with bf16 activations casts an fp32 weight first.

    Emulation difference: ``rstd`` is returned detached. On the NPU it is a saved activation consumed by
    ``npu_rms_norm_backward(dy, x, gamma, rstd)``; gradients flow to ``x`` and ``gamma`` only through ``y``.
    """
    x = input  # [..., *gamma.shape]
    _check_dtype("npu_rms_norm", "input", x)
    _check_dims("npu_rms_norm", "input", x, 2, 8)
    if gamma.dtype != x.dtype:
        raise ValueError(f"npu_rms_norm: gamma dtype {gamma.dtype} must equal the input's {x.dtype} (torch_npu 2.7.1)")
    if gamma.dim() < 1 or tuple(x.shape[x.dim() - gamma.dim() :]) != tuple(gamma.shape):
        raise ValueError(
            f"npu_rms_norm: gamma shape {tuple(gamma.shape)} must match the trailing dims of x {tuple(x.shape)}"
        )
    cdt = _compute_dtype(x.dtype)
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    x32 = x.to(cdt)
    rstd = torch.rsqrt(x32.pow(2).mean(dim=dims, keepdim=True) + epsilon)  # [..., 1, ..., 1]
    y = (x32 * rstd * gamma.to(cdt)).to(x.dtype)
    return y, rstd.detach().to(torch.float32)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotate_interleave(x: torch.Tensor) -> torch.Tensor:
    # pairs (x0, x1), (x2, x3), ... become (-x1, x0), (-x3, x2), ...
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


# Layouts npu_rotary_mul takes (4-D only), as (B axis, N axis, S axis), and the r1/r2 shapes allowed for each in
# half mode: 'S' = x's S, 'D' = x's D, 'B'/'N' = x's B/N, '1' = 1 (2.7.1 op docs, 约束说明, jit_compile=False).
_ROTARY_LAYOUTS = {"BNSD": (0, 1, 2), "BSND": (0, 2, 1), "SBND": (1, 2, 0)}
_ROTARY_R_SHAPES = {
    "half": {"BNSD": ("11SD", "B1SD", "BNSD"), "BSND": ("1S1D", "BS1D", "BSND"), "SBND": ("S11D", "SB1D", "SBND")},
    "interleave": {"BNSD": ("11SD",), "BSND": ("1S1D",), "SBND": ("S11D",)},
}


def _rotary_layouts(x: torch.Tensor, r: torch.Tensor, mode: str) -> list[tuple[int, int]]:
    """(B, N) of every layout under which x and r1/r2 are a documented combination."""
    found = []
    for layout, (b_ax, n_ax, s_ax) in _ROTARY_LAYOUTS.items():
        sizes = {"B": x.shape[b_ax], "N": x.shape[n_ax], "S": x.shape[s_ax], "D": x.shape[3], "1": 1}
        if any(tuple(r.shape) == tuple(sizes[c] for c in pattern) for pattern in _ROTARY_R_SHAPES[mode][layout]):
            found.append((sizes["B"], sizes["N"]))
    return found


def _check_rotary(x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, mode: str) -> None:
    """torch_npu 2.7.1's limits for npu_rotary_mul (op docs, jit_compile=False, the default on A2)."""
    op = "npu_rotary_mul"
    if mode not in _ROTARY_R_SHAPES:
        raise ValueError(f"{op}: rotary_mode must be 'half' or 'interleave' in torch_npu 2.7.1, got {mode!r}")
    for name, t in (("input", x), ("r1", r1), ("r2", r2)):
        _check_dtype(op, name, t)
        _check_dims(op, name, t, 4, 4)
    d = x.shape[-1]
    if d % 2 or d >= 896:
        raise ValueError(f"{op}: the head dim D must be even and < 896 in torch_npu 2.7.1, got {d}")
    if r1.shape != r2.shape:
        raise ValueError(f"{op}: r1 {tuple(r1.shape)} and r2 {tuple(r2.shape)} must have one shape")
    layouts = _rotary_layouts(x, r1, mode)
    if not layouts:
        allowed = "; ".join(f"{k}: {', '.join(v)}" for k, v in _ROTARY_R_SHAPES[mode].items())
        raise ValueError(f"{op}: r1/r2 shape {tuple(r1.shape)} does not fit x {tuple(x.shape)} ({mode}: {allowed})")
    needs_r_grad = r1.requires_grad or r2.requires_grad
    if mode == "half":
        ok = [(b, n) for b, n in layouts if b < 1000 and n < 1000 and (not needs_r_grad or b * n <= 1024)]
        limit = "B, N < 1000" + (" and B*N <= 1024 (r1/r2 need gradients)" if needs_r_grad else "")
    else:
        ok, limit = [(b, n) for b, n in layouts if b * n < 1000], "B*N < 1000"
    if not ok:
        raise ValueError(f"{op}: x {tuple(x.shape)} breaks torch_npu 2.7.1's {mode}-mode limit {limit}")


def npu_rotary_mul(
    input: torch.Tensor,  # torchgen's Python name for the schema's `self`
    r1: torch.Tensor,
    r2: torch.Tensor,
    rotary_mode: str = "half",
) -> torch.Tensor:
    """Rotary position embedding: ``out = x * r1 + rotate(x) * r2`` (r1 = cos, r2 = sin).

    * ``rotary_mode='half'``: ``rotate(x) = cat(-x2, x1)`` with ``x1, x2 = chunk(x, 2, -1)`` (HF rotate_half).
    * ``rotary_mode='interleave'``: ``rotate(x) = stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)``.

    torch_npu 2.7.1's limits, enforced: x, r1, r2 are 4-D fp16 / bf16 / fp32 (BNSD, BSND or SBND); D even and
    < 896; r1/r2 broadcast as the docs list per layout (half: 11SD / B1SD / BNSD for BNSD, ...; interleave:
    11SD / 1S1D / S11D only); half mode needs B, N < 1000 and B*N <= 1024 when r1/r2 need gradients;
    interleave needs B*N < 1000. (Later builds add a ``rotate`` matrix argument and 3-D inputs; 2.7.1 has
    neither.) The output has the shape and dtype of ``x``.

    Emulation difference: the hardware requires r1/r2 in [-1, 1] (true of cos / sin); that is not checked.
    """
    x = input  # [B, N, S, D] (or BSND / SBND)
    _check_rotary(x, r1, r2, rotary_mode)
    cdt = _compute_dtype(x.dtype)
    xc = x.to(cdt)
    rotated = _rotate_half(xc) if rotary_mode == "half" else _rotate_interleave(xc)
    return (xc * r1.to(cdt) + rotated * r2.to(cdt)).to(x.dtype)


def npu_swiglu(input: torch.Tensor, dim: int = -1) -> torch.Tensor:  # input: torchgen's `self`
    """SwiGLU: ``a, b = chunk(x, 2, dim); out = silu(a) * b``. The first half is the gate.

    The output is half the size of ``x`` along ``dim`` (verl passes ``cat(gate_proj, up_proj)``). Computed in
    fp32 and cast back to ``x``'s dtype. 2.7.1 (op docs): x is 1-D to 8-D, fp32 / fp16 / bf16.
    """
    x = input  # [..., 2*I, ...] along dim
    _check_dtype("npu_swiglu", "input", x)
    _check_dims("npu_swiglu", "input", x, 1, 8)
    if x.shape[dim] % 2:
        raise ValueError(f"npu_swiglu: size {x.shape[dim]} along dim {dim} must be even")
    a, b = torch.chunk(x.to(_compute_dtype(x.dtype)), 2, dim=dim)
    return (F.silu(a) * b).to(x.dtype)


def npu_top_k_top_p(logits: torch.Tensor, p: torch.Tensor | None = None, k: torch.Tensor | None = None):
    """Top-k then top-p filtering of ``logits [B, V]``: filtered entries become ``-inf`` (torch_npu's formula).

    Per row, ascending stable sort; entries below the k-th largest value are masked; softmax over what is left;
    entries whose ascending cumulative probability is <= 1 - p are masked, the largest always kept; the result is
    put back in the original order (the docs write that step as an index by ``sortedIndices``; the inverse
    permutation is meant, as in vLLM's ``apply_top_k_top_p`` that this op replaces). vllm-ascend's sampler calls
    it on 910B for rollout top-k / top-p.

    torch_npu 2.7.1's limits (op docs), enforced: logits 2-D fp16 / bf16 / fp32; p in logits' dtype, 1-D of
    length B; k int32, 1-D of length B, values in [1, 1024] and <= V; p and k not both None.
    """
    op = "npu_top_k_top_p"
    _check_dtype(op, "logits", logits)
    _check_dims(op, "logits", logits, 2, 2)
    if p is None and k is None:
        raise ValueError(f"{op}: p and k cannot both be None (torch_npu 2.7.1)")
    rows, vocab = logits.shape
    for name, t, dtypes in (("p", p, (logits.dtype,)), ("k", k, (torch.int32,))):
        if t is not None:
            _check_dtype(op, name, t, dtypes)
            if t.shape != (rows,):
                raise ValueError(f"{op}: {name} must be 1-D of length {rows}, got {tuple(t.shape)}")
    if k is not None and not bool(((k >= 1) & (k <= min(1024, vocab))).all()):
        raise ValueError(f"{op}: k must be in [1, min(1024, {vocab})], got {k.tolist()}")
    values, order = torch.sort(logits, dim=-1, descending=False, stable=True)  # [B, V] ascending
    if k is not None:
        threshold = values.gather(-1, (vocab - k.long()).unsqueeze(-1))  # the k-th largest
        values = values.masked_fill(values < threshold, float("-inf"))
    if p is not None:
        cumulative = torch.softmax(values.to(_compute_dtype(values.dtype)), dim=-1).cumsum(dim=-1)
        drop = cumulative <= (1 - p.to(cumulative.dtype)).unsqueeze(-1)
        drop[:, -1] = False  # at least one entry per row survives
        values = values.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, values)


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


# torch_npu 2.7.1's npu_fusion_attention limits (op docs, 约束说明): head dim 1-768 with Dq = Dk >= Dv, Nq 1-256,
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
        raise ValueError(f"{op}: head_num must be 1-{_FA_MAX_HEADS} in torch_npu 2.7.1, got {head_num}")
    if input_layout == "TND":
        n_seq = len(_as_int_list(seq_q))
        if n_seq > _FA_MAX_VARLEN_SEQS:
            raise ValueError(f"{op}: TND takes at most {_FA_MAX_VARLEN_SEQS} sequences per call, got {n_seq}")
        if query.shape[0] > _FA_MAX_TOKENS:
            raise ValueError(f"{op}: TND takes at most {_FA_MAX_TOKENS} tokens, got {query.shape[0]}")


def _check_fusion_attention_args(query, key, value, head_num, input_layout, pse, padding_mask, keep_prob):
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
    if input_layout not in ("BSH", "SBH") and key.shape[:-1] != value.shape[:-1]:
        raise ValueError(f"npu_fusion_attention: key {tuple(key.shape)} and value {tuple(value.shape)} disagree")
    nkv, d, dv = _head_dims(query, key, value, head_num, input_layout)
    if nkv < 1 or head_num % nkv:
        raise ValueError(f"npu_fusion_attention: head_num={head_num} is not a multiple of the {nkv} KV heads")
    if dv > d:
        raise ValueError(f"npu_fusion_attention: value head dim {dv} exceeds query/key head dim {d} (needs Dk >= Dv)")
    if not 1 <= d <= _FA_MAX_HEAD_DIM:
        raise ValueError(f"npu_fusion_attention: head dim must be 1-{_FA_MAX_HEAD_DIM} in torch_npu 2.7.1, got {d}")
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

    torch_npu 2.7.1's limits, enforced: q/k/v one dtype of fp16 / bf16 / fp32; mask bool or uint8; head dim
    1-768 with Dk >= Dv; 1-256 query heads; TND with at most 1024 sequences and 1M tokens. 2.7.1 has no
    ``sink``, ``dropout_mask``, ``seed`` or ``offset`` argument (later builds add them): passing one is a
    TypeError, as on the NPU.

    Emulation differences: dropout (``keep_prob != 1``), ``pse`` and sparse modes 5-8 raise
    ``ValueError``. Fully masked query rows give 0 (undocumented on the NPU). ``softmax_max``/``softmax_sum``
    are detached (the NPU backward kernel consumes them, autograd here does not need them); for TND with the
    default ``softmax_layout=""`` they are returned in the documented [T, N, 8] shape but with the documented
    NTD storage order (a reshape of [N, T, 8]), exactly as the NPU does; ``softmax_layout="TND"`` gives a true
    [T, N, 8]. ``softmax_out`` is an empty reserved tensor; ``seed``, ``offset`` and ``numels`` are 0 (the dropout RNG
    state the NPU returns; no dropout here).
    """
    nkv = _check_fusion_attention_args(query, key, value, head_num, input_layout, pse, padding_mask, keep_prob)
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
):
    """Backward of :func:`npu_fusion_attention` (torch_npu semantics): ``(dq, dk, dv, dpse)`` for the cotangent
    ``dy`` of its output, in the layouts of ``query`` / ``key`` / ``value`` and in query's dtype (2.7.1's meta
    registration); ``dpse`` is an empty tensor (no ``pse``).

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
    nkv = _check_fusion_attention_args(query, key, value, head_num, input_layout, pse, padding_mask, keep_prob)
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
    return dq.to(dtype), dk.to(dtype), dv.to(dtype), query.new_empty(0)


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


# ---------------------------------------------------------------------------------------------------------
# npu_grouped_matmul
# ---------------------------------------------------------------------------------------------------------


def _group_ends(group_list, group_list_type: int, total: int) -> list[int]:
    """Cumulative group ends from ``group_list``: type 0 = cumsum (as given), type 1 = per-group counts."""
    values = [int(v) for v in (group_list.tolist() if isinstance(group_list, torch.Tensor) else group_list)]
    if group_list_type == 0:
        ends = values
        if any(b < a for a, b in zip([0, *ends], ends, strict=False)):
            raise ValueError(f"npu_grouped_matmul: group_list_type=0 needs a non-decreasing cumsum, got {values}")
    elif group_list_type == 1:
        if any(v < 0 for v in values):
            raise ValueError(f"npu_grouped_matmul: group_list_type=1 needs non-negative counts, got {values}")
        ends = [sum(values[: i + 1]) for i in range(len(values))]
    else:
        raise ValueError(
            f"npu_grouped_matmul: group_list_type={group_list_type} is not emulated (0 and 1 are; 2 is int8-only)"
        )
    if ends and ends[-1] > total:
        raise ValueError(f"npu_grouped_matmul: group_list covers {ends[-1]} rows but the split axis has {total}")
    return ends


def _group_weight(weight: list[torch.Tensor], e: int) -> torch.Tensor:
    if len(weight) == 1 and weight[0].dim() == 3:  # one [E, K, N] tensor
        return weight[0][e]
    return weight[e]  # E tensors of [K, N]


def _group_bias(bias: list[torch.Tensor] | None, e: int) -> torch.Tensor | None:
    if bias is None:
        return None
    if len(bias) == 1 and bias[0].dim() == 2:  # one [E, N] tensor
        return bias[0][e]
    return bias[e]  # E tensors of [N]


def _matmul_bias(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, cdt: torch.dtype) -> torch.Tensor:
    y = x.to(cdt) @ w.to(cdt)
    return y if b is None else y + b.to(cdt)


def _gmm_m_split(x, weight, bias, group_list, group_list_type, cdt) -> list[torch.Tensor]:
    """One x [M, K] split along M by group_list; group e uses weight e: outputs [m_e, N]."""
    if len(x) != 1 or x[0].dim() != 2:
        raise ValueError("npu_grouped_matmul: an M-split takes a single 2-D x [M, K]")
    ends = _group_ends(group_list, group_list_type, x[0].shape[0])
    n_weights = weight[0].shape[0] if len(weight) == 1 and weight[0].dim() == 3 else len(weight)
    if n_weights != len(ends):
        raise ValueError(f"npu_grouped_matmul: {len(ends)} groups in group_list but {n_weights} weights")
    starts = [0, *ends[:-1]]
    return [
        _matmul_bias(x[0][s:e], _group_weight(weight, g), _group_bias(bias, g), cdt)
        for g, (s, e) in enumerate(zip(starts, ends, strict=True))
    ]


def _gmm_pairwise(x, weight, bias, group_list, group_list_type, cdt) -> list[torch.Tensor]:
    """No grouping axis: ``y_i = x_i @ w_i + b_i`` for each pair (group_list, if given, must match x_i rows)."""
    if len(x) != len(weight):
        raise ValueError(f"npu_grouped_matmul: {len(x)} x tensors but {len(weight)} weights")
    if group_list is not None:
        ends = _group_ends(group_list, group_list_type, sum(t.shape[0] for t in x))
        sizes = [e - s for s, e in zip([0, *ends[:-1]], ends, strict=True)]
        if sizes != [t.shape[0] for t in x]:
            raise ValueError(f"npu_grouped_matmul: group sizes {sizes} do not match the x row counts")
    return [_matmul_bias(xi, wi, _group_bias(bias, i), cdt) for i, (xi, wi) in enumerate(zip(x, weight, strict=True))]


def npu_grouped_matmul(
    x: Sequence[torch.Tensor],
    weight: Sequence[torch.Tensor],
    *,
    bias: Sequence[torch.Tensor] | None = None,
    scale: Sequence[torch.Tensor] | None = None,
    offset: Sequence[torch.Tensor] | None = None,
    antiquant_scale: Sequence[torch.Tensor] | None = None,
    antiquant_offset: Sequence[torch.Tensor] | None = None,
    per_token_scale: Sequence[torch.Tensor] | None = None,
    group_list=None,
    activation_input: Sequence[torch.Tensor] | None = None,
    activation_quant_scale: Sequence[torch.Tensor] | None = None,
    activation_quant_offset: Sequence[torch.Tensor] | None = None,
    split_item: int = 0,
    group_type: int | None = None,
    group_list_type: int = 0,
    act_type: int = 0,
    tuning_config: Sequence[int] | None = None,
    output_dtype: torch.dtype | None = None,
) -> list[torch.Tensor]:
    """Grouped GEMM ``y_i = x_i @ weight_i + bias_i`` (torch_npu, non-quantised formula).

    * ``group_type=0`` (or None with a ``group_list``): split a single ``x [M, K]`` along M; weight is one
      ``[E, K, N]`` tensor or E ``[K, N]`` tensors; bias one ``[E, N]`` or E ``[N]``. Output ``[M, N]`` as a
      single tensor (split_item 2/3) or E tensors ``[m_e, N]`` (split_item 0/1).
    * ``group_type`` None/-1 without group_list: one matmul per (x_i, weight_i) pair; split_item 2/3
      concatenates the results along dim 0.
    * ``group_list_type`` 0 = cumulative ends, 1 = per-group counts (``group_list`` a list or 1-D tensor).

    torch_npu 2.7.1's limits, enforced: ``group_type`` is -1 or 0 (its meta registration: "group_type only
    support -1 and 0"; the K-split ``group_type=2`` of later builds is refused); x and weight fp16 / bf16 /
    fp32; at most 128 tensors per list; every x and weight last dim < 65536 (the A2 inner-axis limit); a
    tensor ``group_list`` is int64 and, with ``group_list_type=1``, longer than 1 (op docs).
    ``group_type=None`` is accepted as "no group axis given" (the meta registration, which only FakeTensor
    tracing runs, refuses it; eager 2.7.1's C++ check could not be read here).

    Emulation differences: quantisation arguments and ``act_type != 0`` raise ``ValueError``;
    ``tuning_config`` is ignored. Where ``group_list`` covers fewer rows than x has (the NPU requires it to
    cover all of them) the uncovered output rows are 0. Arithmetic is fp32 for fp16/bf16 inputs.
    """
    quant = [name for name, value in (
        ("scale", scale), ("offset", offset), ("antiquant_scale", antiquant_scale),
        ("antiquant_offset", antiquant_offset), ("per_token_scale", per_token_scale),
        ("activation_input", activation_input), ("activation_quant_scale", activation_quant_scale),
        ("activation_quant_offset", activation_quant_offset),
    ) if value is not None]  # fmt: skip
    if quant:
        raise ValueError(f"npu_grouped_matmul: quantisation arguments are not emulated on the CPU shim: {quant}")
    if act_type != 0:
        raise ValueError(f"npu_grouped_matmul: act_type={act_type} is not emulated (only 0, no activation)")
    if split_item not in (0, 1, 2, 3):
        raise ValueError(f"npu_grouped_matmul: split_item must be 0-3, got {split_item}")
    x, weight = list(x), list(weight)
    bias = None if bias is None else list(bias)
    _check_gmm_limits(x, weight, group_list, group_type, group_list_type)
    cdt = _compute_dtype(x[0].dtype)
    out_dtype = output_dtype or x[0].dtype
    if group_type == -1 or len(x) > 1 or group_list is None:
        pieces = _gmm_pairwise(x, weight, bias, group_list, group_list_type, cdt)
    else:
        pieces = _gmm_m_split(x, weight, bias, group_list, group_list_type, cdt)
    pieces = [p.to(out_dtype) for p in pieces]
    if split_item in (0, 1):
        return pieces
    covered = sum(p.shape[0] for p in pieces)
    if len(x) == 1 and covered < x[0].shape[0]:
        pieces.append(pieces[0].new_zeros(x[0].shape[0] - covered, pieces[0].shape[1]))
    return [torch.cat(pieces, dim=0)]  # [M, N]


_GMM_MAX_TENSORS = 128  # "列表最大长度为128"
_GMM_INNER_LIMIT = 65536  # A2 InnerLimit: each x / weight last dim must be below it


def _check_gmm_limits(x, weight, group_list, group_type, group_list_type) -> None:
    op = "npu_grouped_matmul"
    if group_type not in (None, -1, 0):
        raise ValueError(f"{op}: group_type only support -1 and 0 in torch_npu 2.7.1, got {group_type}")
    if not x or not weight or len(x) > _GMM_MAX_TENSORS or len(weight) > _GMM_MAX_TENSORS:
        raise ValueError(f"{op}: x and weight lists take 1-{_GMM_MAX_TENSORS} tensors, got {len(x)} and {len(weight)}")
    for name, tensors in (("x", x), ("weight", weight)):
        for t in tensors:
            _check_dtype(op, name, t)
            if t.shape[-1] >= _GMM_INNER_LIMIT:
                raise ValueError(f"{op}: {name} last dim {t.shape[-1]} must be < {_GMM_INNER_LIMIT} (A2 inner limit)")
    if isinstance(group_list, torch.Tensor):
        _check_dtype(op, "group_list", group_list, (torch.int64,))
        if group_list_type == 1 and group_list.numel() == 1:
            raise ValueError(f"{op}: with group_list_type=1 the group_list cannot have length 1 (torch_npu 2.7.1)")


# ---------------------------------------------------------------------------------------------------------
# MoE routing
# ---------------------------------------------------------------------------------------------------------


def npu_moe_token_permute(
    tokens: torch.Tensor, indices: torch.Tensor, num_out_tokens: int | None = None, padded_mode: bool = False
):
    """Group tokens by expert (Megatron ``permute``): ``permuted = tokens[argsort(indices.flatten()) // topk]``.

    tokens [N, H]; indices [N, topk] (or [N], topk = 1) of expert ids. Returns ``(permuted [n_out, H],
    sorted_indices [N*topk] int32)``. As in torch_npu (not Megatron) ``sorted_indices`` is the *inverse*
    permutation: ``sorted_indices[p]`` is the output row of flattened position p (torch_npu's own test
    compares it with ``argsort(megatron_sorted_indices)``), and it is never sliced.
    ``num_out_tokens``: None/0 keeps all N*topk rows, n > 0 keeps min(n, N*topk), n < 0 keeps N*topk + n
    (torch_npu's rule); dropped positions map to rows >= n_out.

    torch_npu 2.7.1's limits, enforced (op docs): tokens bfloat16 ("当前版本permuted_tokens仅支持bfloat16"),
    indices int64 with fewer than 16777215 elements, top-k <= 512; tokens 2-D and indices 1-D or 2-D (its meta
    registration's checks). Like the NPU, ``padded_mode=True`` raises.
    """
    op = "npu_moe_token_permute"
    if padded_mode:
        raise ValueError(f"{op}: padded_mode=True is not supported (torch_npu supports only False)")
    if tokens.dim() != 2 or indices.dim() not in (1, 2):
        raise ValueError(f"{op}: tokens must be [N, H] and indices [N] or [N, topk], got "
                         f"{tuple(tokens.shape)} and {tuple(indices.shape)}")  # fmt: skip
    _check_dtype(op, "tokens", tokens, (torch.bfloat16,))
    _check_dtype(op, "indices", indices, (torch.int64,))
    topk = 1 if indices.dim() == 1 else indices.shape[1]
    if topk > 512 or indices.numel() >= 16777215:
        raise ValueError(f"{op}: top-k must be <= 512 and indices hold < 16777215 elements, got {tuple(indices.shape)}")
    flat = indices.reshape(-1)  # [N*topk]
    n_flat = flat.numel()
    n = num_out_tokens or 0
    n_out = min(n, n_flat) if n > 0 else n_flat + n
    order = torch.argsort(flat, stable=True)  # Megatron's sorted_indices: output row r <- flat position
    inverse = torch.argsort(order).to(torch.int32)  # flat position -> output row
    permuted = tokens.index_select(0, order[:n_out] // topk)  # [n_out, H]
    return permuted, inverse


def npu_moe_token_unpermute(
    permuted_tokens: torch.Tensor,
    sorted_indices: torch.Tensor,
    probs: torch.Tensor | None = None,
    padded_mode: bool = False,
    restore_shape=None,
) -> torch.Tensor:
    """Inverse of :func:`npu_moe_token_permute` (Megatron ``unpermute``), merging the top-k copies.

    ``sorted_indices`` is the int32 inverse permutation returned by the permute op. Each flattened position p
    takes row ``permuted_tokens[sorted_indices[p]]`` (0 if that row was dropped by ``num_out_tokens``); the
    result is reshaped to [N, topk, H], multiplied by ``probs [N, topk]`` and summed over topk. Without probs
    topk = 1 and the output is [N*topk, H] (no merge), as torch_npu's output-size rule states.

    torch_npu 2.7.1's limits, enforced: permuted_tokens and probs bfloat16 (op docs); permuted_tokens 2-D,
    sorted_indices 1-D, probs 2-D (meta registration). The docs give sorted_indices as int64 while the permute
    op returns int32 and the docs' own example passes that int32 tensor: both are accepted.
    """
    op = "npu_moe_token_unpermute"
    if padded_mode:
        raise ValueError(f"{op}: padded_mode=True is not supported (torch_npu supports only False)")
    if permuted_tokens.dim() != 2 or sorted_indices.dim() != 1 or (probs is not None and probs.dim() != 2):
        raise ValueError(f"{op}: permuted_tokens must be 2-D, sorted_indices 1-D and probs 2-D")
    _check_dtype(op, "permuted_tokens", permuted_tokens, (torch.bfloat16,))
    _check_dtype(op, "sorted_indices", sorted_indices, (torch.int32, torch.int64))
    if probs is not None:
        _check_dtype(op, "probs", probs, (torch.bfloat16,))
    topk = 1 if probs is None else probs.shape[1]
    hidden = permuted_tokens.shape[-1]
    idx = sorted_indices.long()  # [N*topk]
    valid = idx < permuted_tokens.shape[0]
    rows = permuted_tokens.index_select(0, torch.where(valid, idx, torch.zeros_like(idx)))  # [N*topk, H]
    rows = rows * valid.unsqueeze(-1).to(rows.dtype)
    rows = rows.reshape(-1, topk, hidden)  # [N, topk, H]
    if probs is not None:
        rows = rows * probs.unsqueeze(-1).to(rows.dtype)
    return rows.sum(dim=1)  # [N, H]


def npu_moe_gating_top_k_softmax(x: torch.Tensor, finished: torch.Tensor | None = None, k: int = 1):
    """``softmax(x, -1)`` then top-k: returns ``(y, expert_idx int32, row_idx int32)``, each ``[..., k]``.

    ``y`` is the top-k of the softmax and is NOT renormalised (apply Qwen3's ``norm_topk_prob`` yourself).
    ``row_idx = arange(N*k).view(k, N).T`` with N the number of rows (leading dims flattened).

    Emulation differences: ``finished`` (bool, shape ``x.shape[:-1]``) is not specified by the torch_npu docs
    beyond "rows that take part"; here a finished row keeps its values but its expert ids are set to E (the
    number of experts, i.e. no expert), which is what the TensorRT-LLM kernel this op derives from does. The NPU
    op is inference-only; here autograd flows through ``y``.
    """
    if not 0 < k <= x.shape[-1]:
        raise ValueError(f"npu_moe_gating_top_k_softmax: k={k} must be in [1, {x.shape[-1]}]")
    probs = torch.softmax(x.to(_compute_dtype(x.dtype)), dim=-1)  # [..., E]
    y, expert_idx = torch.topk(probs, k, dim=-1)  # [..., k]
    expert_idx = expert_idx.to(torch.int32)
    if finished is not None:
        expert_idx = torch.where(finished.bool().unsqueeze(-1), torch.full_like(expert_idx, x.shape[-1]), expert_idx)
    n_rows = expert_idx.numel() // k
    row_idx = torch.arange(n_rows * k, dtype=torch.int32, device=x.device).view(k, n_rows).t()
    return y.to(x.dtype), expert_idx, row_idx.reshape(expert_idx.shape).contiguous()


def npu_moe_init_routing(x: torch.Tensor, row_idx: torch.Tensor, expert_idx: torch.Tensor, active_num: int):
    """Expand and sort tokens by expert (torch_npu ``MoeInitRouting``).

    With ``order = stable_argsort(expert_idx.flatten())`` (row-major over [N, k]) and
    ``sorted_row = row_idx.flatten()[order]``: ``expanded_expert_idx = expert_idx.flatten()[order]``,
    ``expanded_row_idx[sorted_row[i]] = i`` and ``expanded_x[i] = x[sorted_row[i] % N]`` for the first
    ``min(N, active_num) * k`` rows. Returns ``(expanded_x [min(N, active_num)*k, H], expanded_row_idx [N*k]
    int32, expanded_expert_idx [N*k] int32)``.

    Emulation difference: the NPU op is inference-only; here autograd flows to ``x``.
    """
    n_rows, k = expert_idx.shape  # x: [N, H]
    flat_expert = expert_idx.reshape(-1)
    order = torch.argsort(flat_expert, stable=True)
    sorted_row = row_idx.reshape(-1).long()[order]  # [N*k]
    expanded_row_idx = torch.empty_like(sorted_row)
    expanded_row_idx[sorted_row] = torch.arange(sorted_row.numel(), device=sorted_row.device)
    active = min(n_rows, int(active_num)) * k
    expanded_x = x.index_select(0, sorted_row[:active] % n_rows)  # [active, H]
    return expanded_x, expanded_row_idx.to(torch.int32), flat_expert[order].to(torch.int32)


def npu_moe_finalize_routing(
    expanded_permuted_rows: torch.Tensor,
    skip1: torch.Tensor | None,
    skip2: torch.Tensor | None,
    bias: torch.Tensor | None,
    scales: torch.Tensor | None,
    expanded_src_to_dst_row: torch.Tensor,
    export_for_source_row: torch.Tensor | None,
    drop_pad_mode: int = 0,
) -> torch.Tensor:
    """Combine expert outputs: ``out[i] = skip1[i] + skip2[i] + sum_k scales[i,k] * (rows[dst(i,k)] + bias[e(i,k)])``.

    ``e(i,k) = export_for_source_row[i, k]``. ``dst(i,k) = expanded_src_to_dst_row[i + k*N]`` for
    drop_pad_mode 0/1 (column order, as produced by :func:`npu_moe_init_routing`) and ``[i*K + k]`` for 2/3
    (row order). Modes 0/2 take rows [N*K, H]; modes 1/3 (drop-pad) take rows [E, C, H] and
    ``dst = -1`` marks a dropped token. Returns [N, H] in the rows' dtype.

    Emulation differences: a dropped (-1) entry contributes nothing, bias included (not stated by the docs);
    ``scales=None`` means weight 1. The NPU op is inference-only; here autograd works.
    """
    if drop_pad_mode not in (0, 1, 2, 3):
        raise ValueError(f"npu_moe_finalize_routing: drop_pad_mode must be 0-3, got {drop_pad_mode}")
    if bias is not None and export_for_source_row is None:
        raise ValueError("npu_moe_finalize_routing: bias needs export_for_source_row (the expert of each row)")
    rows = expanded_permuted_rows
    if drop_pad_mode in (1, 3):
        rows = rows.reshape(-1, rows.shape[-1])  # [E*C, H]
    hidden = rows.shape[-1]
    dst = expanded_src_to_dst_row.long()  # [N*K]
    if scales is not None:
        n_rows, k = scales.shape
    elif export_for_source_row is not None:
        n_rows, k = export_for_source_row.shape
    else:
        raise ValueError("npu_moe_finalize_routing: pass scales or export_for_source_row so N and K are known")
    dst = dst.view(k, n_rows).t() if drop_pad_mode in (0, 1) else dst.view(n_rows, k)  # [N, K]
    valid = dst >= 0
    gathered = rows.index_select(0, torch.where(valid, dst, torch.zeros_like(dst)).reshape(-1)).view(n_rows, k, hidden)
    if bias is not None:
        gathered = gathered + bias.index_select(0, export_for_source_row.long().reshape(-1)).view(n_rows, k, hidden)
    weights = valid.to(rows.dtype) if scales is None else scales.to(rows.dtype) * valid.to(rows.dtype)
    out = (gathered * weights.unsqueeze(-1)).sum(dim=1)  # [N, H]
    for skip in (skip1, skip2):
        if skip is not None:
            out = out + skip
    return out
