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

Conformance to the pinned torch-npu 2.10.0.post4 (issue #14; 2.7.1 before issue #41): every signature here is the
Python signature torchgen derives from the op's schema in the 2.10.0.post4 wheel
(``torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml``; ``Tensor self`` becomes ``input``), and the ops
refuse what it refuses: the checks of its meta registrations (``op_plugin/meta/_meta_registrations.py``) and the
dtype / shape limits its op docs state (``_op_plugin_docs.py``), each cited where it is enforced.
``tests/conformance/`` downloads the wheel and checks both against it, and replays every call our code makes through
the real meta functions. The one deliberate widening is float64, which no NPU kernel takes:
:func:`float64_reference` admits it for exact gradient checks in tests.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .npu_attention_ops import npu_fusion_attention, npu_fusion_attention_grad
from .npu_mc2_ops import npu_all_gather_base_mm, npu_mm_reduce_scatter_base
from .npu_ops_common import _check_dims, _check_dtype, _compute_dtype
from .npu_ops_common import float64_reference as float64_reference  # part of this module's interface

__all__ = [
    "npu_all_gather_base_mm",
    "npu_fusion_attention",
    "npu_fusion_attention_grad",
    "npu_grouped_matmul",
    "npu_mm_reduce_scatter_base",
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


# ---------------------------------------------------------------------------------------------------------
# Normalisation, rotary embedding, activation
# ---------------------------------------------------------------------------------------------------------


def npu_rms_norm(input: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6):  # input: torchgen's `self`
    """RMSNorm: ``y = x * rsqrt(mean(x^2) + eps) * gamma`` over the trailing ``gamma.dim()`` dims.

    torch_npu returns a tuple ``(y, rstd)``: ``y`` has the dtype and shape of ``x``; ``rstd`` is float32 with
    shape ``x.shape[:x.dim()-gamma.dim()] + [1]*gamma.dim()`` (keepdim, as the meta registration builds
    it). The arithmetic is fp32 (as in torch_npu's inductor decomposition).

    torch_npu's limits (op docs): x is fp16 / bf16 / fp32 and 2-D to 8-D; gamma has x's dtype ("数据类型需要和self
    保持一致"), so a caller with bf16 activations casts an fp32 weight first.

    Emulation difference: ``rstd`` is returned detached. On the NPU it is a saved activation consumed by
    ``npu_rms_norm_backward(dy, x, gamma, rstd)``; gradients flow to ``x`` and ``gamma`` only through ``y``.
    """
    x = input  # [..., *gamma.shape]
    _check_dtype("npu_rms_norm", "input", x)
    _check_dims("npu_rms_norm", "input", x, 2, 8)
    if gamma.dtype != x.dtype:
        raise ValueError(
            f"npu_rms_norm: gamma dtype {gamma.dtype} must equal the input's {x.dtype} (torch_npu 2.10.0.post4)"
        )
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
# half mode: 'S' = x's S, 'D' = x's D, 'B'/'N' = x's B/N, '1' = 1 (op docs, 约束说明, jit_compile=False).
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
    """torch_npu 2.10.0.post4's limits for npu_rotary_mul (op docs, jit_compile=False, the default on A2)."""
    op = "npu_rotary_mul"
    if mode not in _ROTARY_R_SHAPES:
        raise ValueError(f"{op}: rotary_mode must be 'half' or 'interleave' in torch_npu 2.10.0.post4, got {mode!r}")
    for name, t in (("input", x), ("r1", r1), ("r2", r2)):
        _check_dtype(op, name, t)
        _check_dims(op, name, t, 4, 4)
    d = x.shape[-1]
    if d % 2 or d >= 896:
        raise ValueError(f"{op}: the head dim D must be even and < 896 in torch_npu 2.10.0.post4, got {d}")
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
        raise ValueError(f"{op}: x {tuple(x.shape)} breaks torch_npu's {mode}-mode limit {limit}")


def npu_rotary_mul(
    input: torch.Tensor,  # torchgen's Python name for the schema's `self`
    r1: torch.Tensor,
    r2: torch.Tensor,
    rotary_mode: str = "half",
    rotate: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotary position embedding: ``out = x * r1 + rotate(x) * r2`` (r1 = cos, r2 = sin).

    * ``rotary_mode='half'``: ``rotate(x) = cat(-x2, x1)`` with ``x1, x2 = chunk(x, 2, -1)`` (HF rotate_half).
    * ``rotary_mode='interleave'``: ``rotate(x) = stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)``.

    torch_npu 2.10.0.post4's limits, enforced: x, r1, r2 are 4-D fp16 / bf16 / fp32 (BNSD, BSND or SBND); D even and
    < 896; r1/r2 broadcast as the docs list per layout (half: 11SD / B1SD / BNSD for BNSD, ...; interleave:
    11SD / 1S1D / S11D only); half mode needs B, N < 1000 and B*N <= 1024 when r1/r2 need gradients;
    interleave needs B*N < 1000. The output has the shape and dtype of ``x``.

    Emulation differences: the hardware requires r1/r2 in [-1, 1] (true of cos / sin); that is not checked.
    2.10's ``rotate`` (a caller-given rotation matrix replacing the fixed rotate-half / interleave; its schema
    ``Tensor? rotate=None``) is not emulated and raises ``ValueError`` when given.
    """
    if rotate is not None:
        raise ValueError("npu_rotary_mul: rotate (a rotation matrix) is not emulated on the CPU shim")
    x = input  # [B, N, S, D] (or BSND / SBND)
    _check_rotary(x, r1, r2, rotary_mode)
    cdt = _compute_dtype(x.dtype)
    xc = x.to(cdt)
    rotated = _rotate_half(xc) if rotary_mode == "half" else _rotate_interleave(xc)
    return (xc * r1.to(cdt) + rotated * r2.to(cdt)).to(x.dtype)


def npu_swiglu(input: torch.Tensor, dim: int = -1) -> torch.Tensor:  # input: torchgen's `self`
    """SwiGLU: ``a, b = chunk(x, 2, dim); out = silu(a) * b``. The first half is the gate.

    The output is half the size of ``x`` along ``dim`` (verl passes ``cat(gate_proj, up_proj)``). Computed in
    fp32 and cast back to ``x``'s dtype. torch_npu (op docs): x is 1-D to 8-D, fp32 / fp16 / bf16.
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

    torch_npu 2.10.0.post4's limits (op docs), enforced: logits 2-D fp16 / bf16 / fp32; p in logits' dtype, 1-D of
    length B; k int32, 1-D of length B, values in [1, 1024] and <= V; p and k not both None.
    """
    op = "npu_top_k_top_p"
    _check_dtype(op, "logits", logits)
    _check_dims(op, "logits", logits, 2, 2)
    if p is None and k is None:
        raise ValueError(f"{op}: p and k cannot both be None (torch_npu 2.10.0.post4)")
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
    output_dtype: int | None = None,
    x_dtype: int | None = None,
    weight_dtype: int | None = None,
    scale_dtype: int | None = None,
    per_token_scale_dtype: int | None = None,
) -> list[torch.Tensor]:
    """Grouped GEMM ``y_i = x_i @ weight_i + bias_i`` (torch_npu, non-quantised formula).

    * ``group_type=0`` (or None with a ``group_list``): split a single ``x [M, K]`` along M; weight is one
      ``[E, K, N]`` tensor or E ``[K, N]`` tensors; bias one ``[E, N]`` or E ``[N]``. Output ``[M, N]`` as a
      single tensor (split_item 2/3) or E tensors ``[m_e, N]`` (split_item 0/1).
    * ``group_type`` None/-1 without group_list: one matmul per (x_i, weight_i) pair; split_item 2/3
      concatenates the results along dim 0.
    * ``group_list_type`` 0 = cumulative ends, 1 = per-group counts (``group_list`` a list or 1-D tensor).

    torch_npu 2.10.0.post4's limits, enforced: ``group_type`` is -1, 0 or 2 (its meta registration: "group_type
    only supports -1, 0 and 2"); x and weight fp16 / bf16 / fp32; at most 128 tensors per list; every x and
    weight last dim < 65536 (the A2 inner-axis limit); a tensor ``group_list`` is int64 and, with
    ``group_list_type=1``, longer than 1 (op docs). ``group_type=None`` is accepted as "no group axis given"
    (the meta registration, which only FakeTensor tracing runs, refuses it unless group_list is a list; eager's
    C++ check could not be read here). ``output_dtype`` is an ``int`` since 2.10 (schema ``int? output_dtype``,
    was ``ScalarType?``): torch_npu's dtype enum value, of which the meta takes 5 / 15 / 6 / 3 (fp16 / bf16 /
    fp32 / int32; ``gmm_get_dtype``, ``_meta_registrations.py:3524-3530``); a ``torch.dtype`` is a TypeError,
    as the int argument is on the NPU.

    Emulation differences: quantisation arguments (2.10's ``x_dtype`` / ``weight_dtype`` / ``scale_dtype`` /
    ``per_token_scale_dtype`` among them), an int32 ``output_dtype`` and ``act_type != 0`` raise ``ValueError``;
    the K-split ``group_type=2`` (what MindSpeed's TE grouped experts take the weight gradient with) is accepted
    by 2.10 but not emulated here and raises ``ValueError``; ``tuning_config`` is ignored. Where ``group_list``
    covers fewer rows than x has (the NPU requires it to cover all of them) the uncovered output rows are 0.
    Arithmetic is fp32 for fp16/bf16 inputs.
    """
    quant = [name for name, value in (
        ("scale", scale), ("offset", offset), ("antiquant_scale", antiquant_scale),
        ("antiquant_offset", antiquant_offset), ("per_token_scale", per_token_scale),
        ("activation_input", activation_input), ("activation_quant_scale", activation_quant_scale),
        ("activation_quant_offset", activation_quant_offset), ("x_dtype", x_dtype), ("weight_dtype", weight_dtype),
        ("scale_dtype", scale_dtype), ("per_token_scale_dtype", per_token_scale_dtype),
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
    out_dtype = _gmm_output_dtype(output_dtype) or x[0].dtype
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


# torch_npu's dtype enum values npu_grouped_matmul's output_dtype takes (2.10 meta: TORCH_DTYPE_MAP, gmm_get_dtype)
_GMM_OUTPUT_DTYPES = {5: torch.float16, 15: torch.bfloat16, 6: torch.float32}
_GMM_INT32_OUTPUT = 3  # int32: the quantised (a8w8) output, not emulated


def _gmm_output_dtype(output_dtype: int | None) -> torch.dtype | None:
    op = "npu_grouped_matmul"
    if output_dtype is None or output_dtype == 0:  # gmm_get_dtype: ``if not output_dtype`` keeps x's dtype
        return None
    if isinstance(output_dtype, bool) or not isinstance(output_dtype, int):
        raise TypeError(f"{op}: output_dtype must be an int (torch_npu's dtype enum, e.g. 15 = bf16) since 2.10, "
                        f"got {output_dtype!r}")  # fmt: skip
    if output_dtype == _GMM_INT32_OUTPUT:
        raise ValueError(f"{op}: output_dtype={output_dtype} (int32, quantised output) is not emulated on the CPU shim")
    if output_dtype not in _GMM_OUTPUT_DTYPES:
        raise ValueError(f"{op}: the output dtype {output_dtype} is not supported (torch_npu takes 5, 15, 6, 3)")
    return _GMM_OUTPUT_DTYPES[output_dtype]


_GMM_MAX_TENSORS = 128  # "列表最大长度为128"
_GMM_INNER_LIMIT = 65536  # A2 InnerLimit: each x / weight last dim must be below it


def _check_gmm_limits(x, weight, group_list, group_type, group_list_type) -> None:
    op = "npu_grouped_matmul"
    if group_type not in (None, -1, 0, 2):
        raise ValueError(f"{op}: group_type only supports -1, 0 and 2 in torch_npu, got {group_type}")
    if group_type == 2:  # accepted by 2.10's meta, but its K-split output [E, M, N] is not emulated
        raise ValueError(f"{op}: group_type=2 (K-split) is not emulated on the CPU shim (only -1 and 0)")
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
            raise ValueError(f"{op}: with group_list_type=1 the group_list cannot have length 1 (torch_npu op docs)")


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

    torch_npu 2.10.0.post4's limits, enforced (op docs): tokens bfloat16 ("当前版本permuted_tokens仅支持bfloat16"),
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

    torch_npu 2.10.0.post4's limits, enforced: permuted_tokens and probs bfloat16 (op docs); permuted_tokens 2-D,
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
