"""CPU references of torch_npu 2.10.0.post4's MC2 ops (a matmul fused with the tensor-parallel collective) and the HCCL
communicator names they address.

MindSpeed's ``use_ascend_mc2`` (``core/tensor_parallel/mc2_feature/linear_function.py``) replaces megatron's
sequence-parallel column / row linears by ``npu_all_gather_base_mm`` (all-gather the sequence shards, then
matmul) and ``npu_mm_reduce_scatter_base`` (matmul, then reduce-scatter over the sequence), addressing the TP
group by its HCCL communicator name, ``group._get_backend(torch.device("npu")).get_hccl_comm_name(rank)``.

How the emulation differs from the hardware:

* The collective is torch.distributed's (gloo on CPU) over the process group the name was handed out for
  (:func:`comm_name`); the kernel overlaps communication and computation in tiles, this runs them one after the
  other. The matmul runs in fp32 and the result is rounded once to the input dtype; the reduce-scatter sums fp32
  partial products (the kernel's accumulation order is not documented, so results agree to rounding).
* Quantisation (``x1_scale``, ``x2_scale``, ``output_dtype``, int8) is not emulated and raises; the NZ format and
  ``comm_mode`` only steer the hardware and are accepted.
* The limits are torch-npu 2.10.0.post4's op docs (``_op_plugin_docs.py``): fp16 / bf16 (int8 quantised) 2-D inputs
  only (no fp32: MC2 needs a half-precision model), ``k`` in [256, 65535), ``world_size`` 2, 4 or 8,
  ``gather_index`` and ``comm_turn`` 0, no non-zero ``bias``, ``reduce_op`` 'sum', a reduce-scatter's ``m``
  divisible by ``world_size``, and an untransposed ``input``. Output shapes are the meta registrations'.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .npu_ops_common import _check_dims, _check_dtype

_HALF = (torch.float16, torch.bfloat16)
_K_RANGE = (256, 65535)  # "k轴取值范围为[256, 65535)"
_WORLD_SIZES = (2, 4, 8)  # "world_size: ... 仅支持为2、4、8"
_groups: dict[str, Any] = {}  # process groups live as long as the process; a handful per run


def comm_name(group: Any) -> str:
    """The HCCL communicator name of ``group`` under the shim (what torch_npu's ``get_hccl_comm_name`` returns
    for the group's HCCL backend): a process-local handle the MC2 ops resolve back to the group."""
    name = f"gspo_shim_hccl_{id(group):x}"
    _groups[name] = group
    return name


class EmulatedHcclBackend:
    """What ``ProcessGroup._get_backend(torch.device("npu"))`` returns under the shim: the one method of
    torch_npu's ``ProcessGroupHCCL`` that MindSpeed calls there. Real HCCL names a communicator per group; the
    ``rank`` argument (the caller's global rank) selects nothing here."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def get_hccl_comm_name(self, rank: int) -> str:
        del rank
        return comm_name(self.group)


def _group(op: str, hcom: str, world_size: int) -> Any:
    group = _groups.get(hcom)
    if group is None:
        raise ValueError(f"{op}: hcom {hcom!r} names no communicator (get it from get_hccl_comm_name)")
    if world_size not in _WORLD_SIZES:
        raise ValueError(f"{op}: world_size must be 2, 4 or 8 in torch_npu 2.10.0.post4, got {world_size}")
    if dist.get_world_size(group) != world_size:
        raise ValueError(f"{op}: world_size {world_size} is not the size of communicator {hcom}")
    return group


def _check_operands(op: str, input: torch.Tensor, x2: torch.Tensor, bias: Any, extra: dict[str, Any]) -> None:
    quantised = {k: v for k, v in extra.items() if v is not None}
    if quantised:
        raise ValueError(f"{op}: quantisation ({', '.join(quantised)}) is not emulated by the shim")
    _check_dtype(op, "input", input, _HALF)
    _check_dtype(op, "x2", x2, (input.dtype,))
    _check_dims(op, "input", input, 2, 2)
    _check_dims(op, "x2", x2, 2, 2)
    if not input.is_contiguous():
        raise ValueError(f"{op}: input must not be a transposed tensor in torch_npu 2.10.0.post4 (x2 may be)")
    k = input.shape[1]
    if x2.shape[0] != k or not _K_RANGE[0] <= k < _K_RANGE[1]:
        raise ValueError(
            f"{op}: input {tuple(input.shape)} @ x2 {tuple(x2.shape)} needs equal k in [256, 65535) in torch_npu"
        )
    if bias is not None and bool(bias.ne(0).any()):
        raise ValueError(f"{op}: a non-zero bias is not supported in torch_npu 2.10.0.post4")


def npu_all_gather_base_mm(
    input: torch.Tensor,  # torchgen's `self`
    x2: torch.Tensor,
    hcom: str,
    world_size: int,
    *,
    bias: torch.Tensor | None = None,
    x1_scale: torch.Tensor | None = None,
    x2_scale: torch.Tensor | None = None,
    gather_index: int = 0,
    gather_output: bool = True,
    comm_turn: int = 0,
    output_dtype: torch.dtype | None = None,
    comm_mode: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(all_gather(input) @ x2, all_gather(input)), gathered along dim 0 in rank order over ``hcom``'s group; the
    second output is empty when ``gather_output`` is false."""
    op = "npu_all_gather_base_mm"
    _check_operands(op, input, x2, bias, {"x1_scale": x1_scale, "x2_scale": x2_scale, "output_dtype": output_dtype})
    if gather_index != 0 or comm_turn != 0:
        raise ValueError(f"{op}: gather_index and comm_turn must be 0 in torch_npu 2.10.0.post4")
    group = _group(op, hcom, world_size)
    gathered = input.new_empty((input.shape[0] * world_size, input.shape[1]))
    dist.all_gather_into_tensor(gathered, input, group=group)
    out = (gathered.float() @ x2.float()).to(input.dtype)
    return out, gathered if gather_output else input.new_empty(0)


def npu_mm_reduce_scatter_base(
    input: torch.Tensor,  # torchgen's `self`
    x2: torch.Tensor,
    hcom: str,
    world_size: int,
    *,
    reduce_op: str = "sum",
    bias: torch.Tensor | None = None,
    x1_scale: torch.Tensor | None = None,
    x2_scale: torch.Tensor | None = None,
    comm_turn: int = 0,
    output_dtype: torch.dtype | None = None,
    comm_mode: str | None = None,
) -> torch.Tensor:
    """reduce_scatter(input @ x2) along dim 0 over ``hcom``'s group: this rank's [m / world_size, n] block of the
    sum of every rank's product."""
    op = "npu_mm_reduce_scatter_base"
    _check_operands(op, input, x2, bias, {"x1_scale": x1_scale, "x2_scale": x2_scale, "output_dtype": output_dtype})
    if reduce_op != "sum" or comm_turn != 0:
        raise ValueError(f"{op}: reduce_op must be 'sum' and comm_turn 0 in torch_npu 2.10.0.post4")
    group = _group(op, hcom, world_size)
    if input.shape[0] % world_size:
        raise ValueError(
            f"{op}: m ({input.shape[0]}) must be divisible by world_size {world_size} in torch_npu 2.10.0.post4"
        )
    full = input.float() @ x2.float()
    out = full.new_empty((input.shape[0] // world_size, x2.shape[1]))
    dist.reduce_scatter_tensor(out, full, group=group)
    return out.to(input.dtype)
