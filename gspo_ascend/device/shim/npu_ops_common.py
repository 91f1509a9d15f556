"""Shared pieces of the shim's torch_npu op references: dtype / rank checks against torch-npu 2.10.0.post4's limits,
the compute dtype, and :func:`float64_reference` (see :mod:`.npu_ops`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_NPU_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_float64_ok = False


@contextlib.contextmanager
def float64_reference() -> Iterator[None]:
    """Admit float64 inputs inside the block: for exact gradient checks of the references in tests.

    No torch_npu 2.10.0.post4 fused op takes float64 (their op docs list fp16 / bf16 / fp32 at most), so outside this
    block the shim refuses it as the NPU would.
    """
    global _float64_ok
    before, _float64_ok = _float64_ok, True
    try:
        yield
    finally:
        _float64_ok = before


def float64_allowed() -> bool:
    """Whether a :func:`float64_reference` block is active (other shim op references check it too)."""
    return _float64_ok


def _check_dtype(op: str, name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...] = _NPU_FLOATS) -> None:
    if t.dtype in allowed or (_float64_ok and t.dtype == torch.float64 and any(d.is_floating_point for d in allowed)):
        return
    names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
    raise ValueError(
        f"{op}: {name} must be {names} in torch_npu 2.10.0.post4, got {str(t.dtype).removeprefix('torch.')}"
    )


def _check_dims(op: str, name: str, t: torch.Tensor, lo: int, hi: int) -> None:
    if not lo <= t.dim() <= hi:
        span = f"{lo}-D" if lo == hi else f"{lo}-D to {hi}-D"
        raise ValueError(f"{op}: {name} must be {span} in torch_npu 2.10.0.post4, got shape {tuple(t.shape)}")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for fp16/bf16/fp32 (the kernels accumulate in fp32), fp64 stays fp64."""
    return torch.promote_types(dtype, torch.float32)
