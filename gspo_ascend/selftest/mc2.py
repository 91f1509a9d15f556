"""Layer 2, Ascend only: MC2, the matmuls fused with the tensor-parallel collective, across the node's NPUs.

MindSpeed's ``--use-ascend-mc2`` (our ``actor.use_mc2``) replaces the sequence-parallel column / row
linears by torch_npu's ``npu_all_gather_base_mm`` (all-gather the sequence shards, then matmul) and
``npu_mm_reduce_scatter_base`` (matmul, then reduce-scatter), each addressing the TP group by its HCCL
communicator name. Those kernels fail on a node where the collectives themselves pass: an HCCL buffer too small for
the fused tiles (``HCCL_BUFFSIZE``), a CANN without the MC2 kernels, a SoC without them (they need Atlas A2 / A3).
So this check runs both ops the way MindSpeed calls them, on one process per device over the world group, against
the unfused result computed with the same collectives: ``all_gather`` then ``@``, ``@`` then ``reduce_scatter``.

The inputs are bf16 (MC2 takes fp16 / bf16 only) with 0 / 1 entries and at most 32 ones per row, so every sum,
over k = 256 and over up to 8 ranks, is an integer <= 256 that bf16 holds exactly: the comparison is exact on any
accumulation order. torch-npu 2.7.1 runs MC2 on 2, 4 or 8 ranks; other counts are a skip. On the emulated NPU
(``GSPO_DEVICE_SHIM=1``) the ops are the shim's references of those kernels over gloo
(``device/shim/npu_mc2_ops.py``), and the communicator names come from the shim's HCCL backend stand-in.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .launch import host_threads, launch_ranks
from .report import CheckFailed, CheckSkipped

FIX = (
    "docs/troubleshooting.md#selftest-mc2: MC2 needs Atlas A2 / A3 and CANN >= 8.0.RC2 (doctor: mc2-cann); raise "
    "HCCL_BUFFSIZE, or set actor.use_mc2=false"
)
OPS = ("npu_all_gather_base_mm", "npu_mm_reduce_scatter_base")
WORLD_SIZES = (2, 4, 8)  # torch-npu 2.7.1's op docs: "world_size ... 仅支持为2、4、8"
M, K, N = 64, 256, 128  # rows per rank, the contraction (k >= 256 in 2.7.1), columns
ONES_PER_ROW = 32  # 8 ranks x 32 <= 256: every sum is an integer bf16 holds exactly
TIMEOUT_S = 300


def check_mc2(backend, devices: int, out: Path) -> str:
    if backend.name != "npu":
        raise CheckSkipped(f"MC2 is torch_npu's (Ascend); this is a {backend.name} node")
    if devices not in WORLD_SIZES:
        raise CheckSkipped(f"MC2 runs on 2, 4 or 8 devices in torch-npu 2.7.1 (--devices {devices})")
    out.mkdir(parents=True, exist_ok=True)
    env = host_threads(backend.emulated) | ({"GSPO_DEVICE_SHIM": "1"} if backend.emulated else {})
    run = launch_ranks(devices, "mc2", ["--device", backend.name], out, env, TIMEOUT_S)
    if not run.ok:
        raise CheckFailed(run.failure(), FIX)
    ranks = [json.loads((out / f"mc2.rank{r}.json").read_text()) for r in range(devices)]
    errors = [e for r in ranks for e in r["errors"]]
    if errors:
        raise CheckFailed(f"{len(errors)} wrong result(s), first: {errors[0]}", FIX)
    return (
        f"{' and '.join(OPS)} exact on {devices} ranks (bf16 [{M}x{devices}, {K}] @ [{K}, {N}]) against the "
        f"unfused collectives over {backend.comm_backend}"
    )


# ----------------------------------------------------------------------------------------------- one rank


def _operands(rank: int, world: int, device):
    """This rank's x [M, K] and the shared w [K, N]: 0 / 1 bf16, at most ONES_PER_ROW ones per row of x."""
    import torch

    g = torch.Generator().manual_seed(1234)
    w = (torch.rand(K, N, generator=g) < 0.5).to(torch.bfloat16)
    xs = torch.zeros(world, M, K)
    cols = torch.rand(world, M, K, generator=g).argsort(-1)[..., :ONES_PER_ROW]
    xs.scatter_(-1, cols, 1.0)
    return xs[rank].to(torch.bfloat16).to(device), w.to(device)


def _compare(name: str, got, want, rank: int) -> list[str]:
    if got.shape != want.shape:
        return [f"{name} on rank {rank}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"]
    diff = (got.float() - want.float()).abs()
    if bool(diff.gt(0).any()):
        return [f"{name} on rank {rank}: {int(diff.gt(0).sum())} elements differ, max |fused - unfused| = "
                f"{diff.max().item():.3g}"]  # fmt: skip
    return []


def _mc2_errors(device, rank: int, world: int) -> list[str]:
    import torch
    import torch.distributed as dist

    from ..device.detect import import_torch_npu

    torch_npu, reason = import_torch_npu()  # the real one on an Atlas host, the shim's when GSPO_DEVICE_SHIM=1
    if torch_npu is None:
        return [f"torch_npu is not usable on rank {rank}: {reason}"]
    group = dist.distributed_c10d._get_default_group()
    # as MindSpeed's MC2 linears address the TP group (mc2_feature/linear_function.py), by its global rank
    hcom = group._get_backend(torch.device("npu")).get_hccl_comm_name(dist.get_global_rank(group, rank))
    x, w = _operands(rank, world, device)
    gathered = torch.empty(world * M, K, dtype=x.dtype, device=device)
    dist.all_gather_into_tensor(gathered, x)
    out, gathered_out = torch_npu.npu_all_gather_base_mm(x, w, hcom, world, bias=None, gather_index=0, comm_turn=0)
    errors = _compare("npu_all_gather_base_mm output", out.cpu(), (gathered.float() @ w.float()).cpu(), rank)
    errors += _compare("npu_all_gather_base_mm gathered input", gathered_out.cpu(), gathered.cpu(), rank)

    full = torch.cat([x] * world)  # [world * M, K]: a reduce-scatter's m divisible by world
    partial = (full.float() @ w.float()).to(torch.bfloat16)
    want = torch.empty(M, N, dtype=torch.bfloat16, device=device)
    dist.reduce_scatter_tensor(want, partial)
    got = torch_npu.npu_mm_reduce_scatter_base(full, w, hcom, world, reduce_op="sum", bias=None, comm_turn=0)
    return errors + _compare("npu_mm_reduce_scatter_base", got.cpu(), want.cpu(), rank)


def rank_main(backend, out: Path, argv: list[str]) -> None:
    import os

    from ..device.shim import selftest_fault
    from ..engines.train_common import select_device

    argparse.ArgumentParser().parse_args(argv)
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    device = select_device(backend, int(os.environ.get("LOCAL_RANK", rank)))
    with selftest_fault.perturbed_ops():  # test-only: GSPO_SELFTEST_FAULT=<one of OPS> must fail this check
        errors = _mc2_errors(device, rank, world)
    (out / f"mc2.rank{rank}.json").write_text(json.dumps({"errors": errors}))
