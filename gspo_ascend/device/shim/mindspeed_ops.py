"""CPU references for MindSpeed's own fused ops (the ones its op builders JIT-compile against CANN).

MindSpeed 2.2.0 builds some kernels itself: ``mindspeed/op_builder/*.py`` compile ``mindspeed/ops/csrc`` with
``torch.utils.cpp_extension.load`` against torch_npu's headers and CANN (or ATB) libraries the first time an op is
used, and cache the loaded module in ``MindSpeedOpBuilder._loaded_ops[name]``. Without CANN that compile step
cannot run. :data:`OP_MODULES` holds, per builder ``OP_NAME``, a module-like namespace with the CPU reference of
each function the compiled module exports; :mod:`.mindspeed_support` puts them into that cache when MindSpeed's
builder module is imported, so ``builder.load()`` returns them and MindSpeed's Python code runs unchanged.

Only ops that our engine's MindSpeed configuration reaches get a reference (docs/device-shim.md lists every
builder and which ones our path needs). An op without one fails inside MindSpeed's builder, as on a machine
without CANN (``TypeError: expected str, bytes or os.PathLike object, not NoneType``: no ``ASCEND_HOME_PATH``).

Same standard as :mod:`.npu_ops`: differentiable torch compositions computed in fp32 for fp16 / bf16 inputs,
and the input checks of the op's C++ source enforced (cited per op); float64 only inside
``npu_ops.float64_reference()``.
"""

from __future__ import annotations

import types

import torch

from . import npu_ops, npu_ops_common

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_ROTATE_HALF, _ROTATE_INTERLEAVED = 0, 1
_BROADCAST_LIMIT = 1024


def _check_float(op: str, name: str, t: torch.Tensor) -> None:
    if t.dtype in _FLOATS or (t.dtype == torch.float64 and npu_ops_common.float64_allowed()):
        return
    raise ValueError(f"{op}: {name} dtype {t.dtype} is invalid, should be float32, float16 or bfloat16 (MindSpeed)")


def npu_rotary_position_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: int = 0):
    """MindSpeed's ``npu_rotary_position_embedding(x, cos, sin, mode)`` (``ops/csrc/cann/npu_rotary_position_
    embedding.cpp``, aclnnRotaryPositionEmbedding): ``y = x * cos + rotate(x) * sin``.

    * ``mode=0`` (rotate half): ``rotate(x) = cat(-x2, x1)``, ``x1, x2 = chunk(x, 2, -1)``.
    * ``mode=1`` (interleaved): pairs ``(x0, x1)`` become ``(-x1, x0)``.

    Checks of the C++ source, enforced: x, cos, sin are fp16 / bf16 / fp32 and 4-D; the last dim of x is even;
    cos and sin have the same shape; mode is 0 or 1. Its backward refuses, when cos and sin both need gradients,
    broadcasting over more than 1024 elements (product of the dims where x and cos differ); this reference
    checks that at the forward, where the graph is recorded. cos / sin broadcast against x (the op's doc lists
    ``1S1D`` / ``11SD`` / ``S11D`` and the full shape; other broadcastable shapes are not refused here).
    The output has x's shape and dtype (cos / sin are cast to the compute dtype).
    """
    op = "npu_rotary_position_embedding"
    for name, t in (("x", x), ("cos", cos), ("sin", sin)):
        _check_float(op, name, t)
        if t.dim() != 4:
            raise ValueError(f"{op}: the dims of input {name} should be 4 dimensional, but got {t.dim()}-dimensional")
    if x.shape[3] % 2:
        raise ValueError(f"{op}: the head_dim length of input must be an even number, but got {x.shape[3]}")
    if cos.shape != sin.shape:
        raise ValueError(f"{op}: the shape of input Tensor cos and sin should be same")
    if mode not in (_ROTATE_HALF, _ROTATE_INTERLEAVED):
        raise ValueError(f"{op}: the mode of rotate should be 0 (rotate_half) or 1 (rotate_interleaved), got {mode}")
    if torch.is_grad_enabled() and cos.requires_grad and sin.requires_grad:
        broadcast = 1
        for i in range(4):
            if x.shape[i] != cos.shape[i]:
                broadcast *= x.shape[i]
        if broadcast > _BROADCAST_LIMIT:
            raise ValueError(f"{op}: the broadcast shape [{broadcast}] > 1024 is too large for the backward")
    cdt = npu_ops._compute_dtype(x.dtype)
    xc = x.to(cdt)
    rotated = npu_ops._rotate_half(xc) if mode == _ROTATE_HALF else npu_ops._rotate_interleave(xc)
    return (xc * cos.to(cdt) + rotated * sin.to(cdt)).to(x.dtype)


# ---------------------------------------------------------------------------------------------------------
# grouped matmul (builder "grouped_matmul": ops/csrc/cann/gmm.cpp, aclnnGroupedMatmulV4 with split_item 3)
# ---------------------------------------------------------------------------------------------------------


def _group_bounds(group_list, group_list_type: int, op: str) -> list[tuple[int, int]]:
    """[start, end) rows of each group: group_list holds cumulative ends (type 0) or counts (type 1)."""
    if group_list is None:
        raise ValueError(f"{op}: group_list is required (the reference emulates grouped calls only)")
    values = [int(v) for v in (group_list.tolist() if isinstance(group_list, torch.Tensor) else group_list)]
    if group_list_type not in (0, 1):
        raise ValueError(f"{op}: group_list_type must be 0 or 1, got {group_list_type}")
    ends = values if group_list_type == 0 else [sum(values[: i + 1]) for i in range(len(values))]
    if any(b < a for a, b in zip([0, *ends], ends, strict=False)):
        raise ValueError(f"{op}: group_list {values} (type {group_list_type}) does not describe ascending groups")
    return list(zip([0, *ends[:-1]], ends, strict=True))


def _gmm(x: torch.Tensor, weight: torch.Tensor, bounds: list[tuple[int, int]], group_type: int, op: str):
    """One grouped matmul in the compute dtype. group_type 0 (M-split): x [M, K], weight [E, K, N] (or a list
    stacked to it) -> [M, N], rows of group e times weight[e]; group_type 2 (K-split): x [K, M], weight [M, N]
    -> [E, K, N], x's columns of group e times weight's rows of group e (the dW of the backward)."""
    cdt = npu_ops._compute_dtype(x.dtype)
    if group_type == 0:
        if weight.dim() != 3 or weight.shape[0] != len(bounds):
            raise ValueError(f"{op}: weight {tuple(weight.shape)} must be [E, K, N] with E = len(group_list)")
        out = x.new_zeros((x.shape[0], weight.shape[-1]), dtype=cdt)  # rows no group covers stay 0
        for e, (start, end) in enumerate(bounds):
            out[start:end] = x[start:end].to(cdt) @ weight[e].to(cdt)
        return out
    if group_type == 2:
        return torch.stack([x[:, s:t].to(cdt) @ weight[s:t].to(cdt) for s, t in bounds])
    raise ValueError(f"{op}: group_type {group_type} is not emulated (0: M-split, 2: K-split)")


def npu_gmm(x, weight, bias, group_list, group_type=-1, group_list_type=0):
    """The compiled module's ``npu_gmm(x: list, weight: list, bias: list, group_list, group_type,
    group_list_type) -> [y]`` (``ops/csrc/cann/gmm.cpp``), as ``mindspeed.ops.gmm.GMMFunction`` calls it.

    One output tensor (split_item 3). group_type 0: ``x[0]`` [M, K] split into row groups by ``group_list``,
    ``weight`` one [E, K, N] tensor (or E [K, N] tensors), ``y`` [M, N]; group_type 2: ``x[0]`` [K, M] split
    along M, ``weight[0]`` [M, N], ``y`` [E, K, N]. ``group_list`` (tensor or list) holds cumulative ends
    (group_list_type 0) or counts (1). Checks of the C++ source: x and weight not empty. Emulation differences:
    fp16 / bf16 are computed in fp32; rows beyond the last group are 0 (CANN requires the groups to cover x);
    bias, group_type -1 (pairwise lists) and quantised variants raise (MindSpeed's experts pass none of them).
    """
    op = "npu_gmm"
    if not x or not weight:
        raise ValueError(f"{op}: neither x nor weight could be empty")
    for name, t in (("x", x[0]), *((f"weight[{i}]", w) for i, w in enumerate(weight))):
        _check_float(op, name, t)
    if bias:
        raise ValueError(f"{op}: bias is not emulated by the CPU reference")
    w = weight[0] if len(weight) == 1 else torch.stack(list(weight))
    bounds = _group_bounds(group_list, group_list_type, op)
    return [_gmm(x[0], w, bounds, group_type, op).to(x[0].dtype)]


def npu_gmm_backward(grad, x, weight, group_list, group_list_type=0):
    """The compiled module's ``npu_gmm_backward(grad, x, weight, group_list, group_list_type) -> (dx, dw, dbias)``
    (lists, dbias empty) for an M-split forward: ``dx = gmm(grad, weight^T)`` (M-split), ``dw[e] =
    x_e^T grad_e`` (the K-split gmm), reshaped to each weight's shape, in the inputs' dtypes."""
    op = "npu_gmm_backward"
    w = weight[0] if len(weight) == 1 else torch.stack(list(weight))
    bounds = _group_bounds(group_list, group_list_type, op)
    dx = _gmm(grad[0], w.transpose(-1, -2), bounds, 0, op).to(grad[0].dtype)
    dw = _gmm(x[0].transpose(0, 1), grad[0], bounds, 2, op).to(w.dtype)
    dws = [dw.reshape(weight[0].shape)] if len(weight) == 1 else [dw[e].reshape(t.shape) for e, t in enumerate(weight)]
    return [dx], dws, []


def _module(name: str, **functions) -> types.SimpleNamespace:
    return types.SimpleNamespace(__name__=f"{name} (CPU reference, gspo_ascend.device.shim)", **functions)


# builder OP_NAME -> what its compiled extension module would be
OP_MODULES: dict[str, types.SimpleNamespace] = {
    "npu_rotary_position_embedding": _module(
        "npu_rotary_position_embedding", npu_rotary_position_embedding=npu_rotary_position_embedding
    ),
    # GMMOpBuilder (group_list_type 0, the path of MindSpeed's grouped-GEMM experts); GMMV2OpBuilder
    # ("grouped_matmul_v2", group_list_type 1) exports the same functions but our path does not reach it.
    "grouped_matmul": _module("grouped_matmul", npu_gmm=npu_gmm, npu_gmm_backward=npu_gmm_backward),
}
