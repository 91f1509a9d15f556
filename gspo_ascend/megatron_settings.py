"""The settings the megatron engine builds megatron-core's DDP with, in one torch-free place: the engine
(engines/megatron.py) passes them to megatron, and the memory planner (doctor/planner.py) sizes the gradient
buffers from them, so `gspo-ascend plan` needs no torch and cannot drift from the engine (issue #25: it had sized
gradients at the model dtype while the engine keeps them in fp32)."""

from __future__ import annotations

# fp32 gradient buffers: a bf16 reduce of many small per-token terms loses the GSPO update's low bits
GRAD_REDUCE_IN_FP32 = True


def ddp_config(use_distributed_optimizer: bool) -> dict[str, bool]:
    return {
        "grad_reduce_in_fp32": GRAD_REDUCE_IN_FP32,
        "use_distributed_optimizer": use_distributed_optimizer,
        "overlap_grad_reduce": False,
        "average_in_collective": False,
    }


def grad_bytes_per_param(model_dtype_bytes: int) -> int:
    """Bytes of megatron's gradient buffer per parameter (param_and_grad_buffer.py: torch.float when
    ``grad_reduce_in_fp32``, the parameter dtype otherwise)."""
    return 4 if GRAD_REDUCE_IN_FP32 else model_dtype_bytes
