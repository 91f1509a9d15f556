"""Layer 2, Ascend only: MC2, the matmuls fused with the tensor-parallel collective, across the node's NPUs.

MindSpeed's ``--use-ascend-mc2`` (our ``actor.use_mc2``) replaces the sequence-parallel column / row
linears by torch_npu's ``npu_all_gather_base_mm`` (all-gather the sequence shards, then matmul) and
``npu_mm_reduce_scatter_base`` (matmul, then reduce-scatter), each addressing the TP group by its HCCL
communicator name. Those kernels fail on a node where the collectives themselves pass: an HCCL buffer too small for
the fused tiles (``HCCL_BUFFSIZE``), a CANN without the MC2 kernels, a SoC without them (they need Atlas A2 / A3).
So this check runs both ops the way MindSpeed calls them, one process per device over the world group, and compares
them with results each rank computes on its own from the seeded inputs of every rank (no collective: a broken
collective is the ``collectives`` check's to name): the gathered shards and their product, and this rank's block of
the sum of every rank's product. Each rank's inputs differ, so a block sent to the wrong rank is a difference.

The inputs are bf16 (MC2 takes fp16 / bf16 only) with 0 / 1 entries and exactly 32 ones per row, so every sum,
over k = 256 and over up to 8 ranks, is an integer <= 256 that bf16 holds exactly: the comparison is exact on any
accumulation order. torch-npu 2.7.1 documents MC2 for 2, 4 or 8 ranks (16 on Atlas A3), so the check runs on the
largest of 2, 4, 8 that the node's devices allow, and says so when that is fewer than all of them. On the emulated
NPU (``GSPO_DEVICE_SHIM=1``) the ops are the shim's references of those kernels over gloo
(``device/shim/npu_mc2_ops.py``), and the communicator names come from the shim's HCCL backend stand-in.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..doctor.preflight import MC2_TP_A2
from .launch import rank_records
from .report import CheckSkipped

FIX = (
    "docs/troubleshooting.md#selftest-mc2: MC2 needs Atlas A2 / A3 and CANN >= 8.0.RC2 (doctor: mc2-cann); raise "
    "HCCL_BUFFSIZE, or set actor.use_mc2=false"
)
OPS = ("npu_all_gather_base_mm", "npu_mm_reduce_scatter_base")
WORLD_SIZES = MC2_TP_A2  # torch-npu 2.7.1's op docs: "world_size ... 仅支持为2、4、8" (A3 adds 16)
M, K, N = 64, 256, 128  # rows per rank, the contraction (k >= 256 in 2.7.1), columns
ONES_PER_ROW = 32  # 8 ranks x 32 <= 256: every sum is an integer bf16 holds exactly
TIMEOUT_S = 300


def check_mc2(backend, devices: int, out: Path) -> str:
    if backend.name != "npu":
        raise CheckSkipped(f"MC2 is torch_npu's (Ascend); this is a {backend.name} node")
    if devices < min(WORLD_SIZES):
        raise CheckSkipped(f"needs at least 2 devices (--devices {devices})")
    world = max(w for w in WORLD_SIZES if w <= devices)
    rank_records(backend, world, "mc2", [], out, TIMEOUT_S, FIX)
    ranks = f"{world} ranks" if world == devices else f"{world} of {devices} devices (MC2 takes 2, 4 or 8 ranks)"
    return (
        f"{' and '.join(OPS)} exact on {ranks} (bf16 [{M}x{world}, {K}] @ [{K}, {N}]) against the unfused results "
        f"computed on each rank"
    )


# ----------------------------------------------------------------------------------------------- one rank


def _sparse_rows(g, *shape: int):
    """0 / 1 bf16 of ``shape + (K,)``, ONES_PER_ROW ones per row."""
    import torch

    cols = torch.rand(*shape, K, generator=g).argsort(-1)[..., :ONES_PER_ROW]
    return torch.zeros(*shape, K).scatter_(-1, cols, 1.0).to(torch.bfloat16)


def _operands(world: int):
    """Every rank's inputs, the same on every rank (one seed): the all-gather shards xs [world, M, K], the
    reduce-scatter inputs ys [world, world * M, K] (m divisible by world), and the shared w [K, N]."""
    import torch

    g = torch.Generator().manual_seed(1234)
    w = (torch.rand(K, N, generator=g) < 0.5).to(torch.bfloat16)
    return _sparse_rows(g, world, M), _sparse_rows(g, world, world * M), w


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
    xs, ys, w = _operands(world)
    wd = w.to(device)
    out, gathered = torch_npu.npu_all_gather_base_mm(
        xs[rank].to(device), wd, hcom, world, bias=None, gather_index=0, comm_turn=0
    )
    want_gathered = xs.reshape(world * M, K)
    errors = _compare("npu_all_gather_base_mm output", out.cpu(), want_gathered.float() @ w.float(), rank)
    errors += _compare("npu_all_gather_base_mm gathered input", gathered.cpu(), want_gathered, rank)
    got = torch_npu.npu_mm_reduce_scatter_base(ys[rank].to(device), wd, hcom, world, reduce_op="sum", bias=None)
    want = ys[:, rank * M : (rank + 1) * M].float().sum(0) @ w.float()  # this rank's block of the sum over ranks
    return errors + _compare("npu_mm_reduce_scatter_base", got.cpu(), want, rank)


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
