"""The shim's MC2 ops (``npu_all_gather_base_mm``, ``npu_mm_reduce_scatter_base``: what MindSpeed's
``use_ascend_mc2`` linears call) against the pinned torch-npu wheel (2.10.0.post4) and against plain collectives.

Two gloo ranks, bf16: each op == the collective and the matmul done separately (the fp32 product rounded once);
output shapes == the wheel's real meta functions; the limits the shim enforces are sentences of its op docs,
and each is refused. The engine-level run (MindSpeed's MC2 linears at TP 2 with sequence parallelism, equal to the
same layout without MC2) is ``tests/mindspeed/test_mindspeed_engine.py``.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gspo_ascend.device.shim import npu_mc2_ops
from gspo_ascend.selftest.launch import free_port

from . import torch_npu_real as real
from .test_torch_npu_conformance import PINNED, _op_doc

M, K, N = 4, 256, 8  # k = 256: the smallest the kernels take


def _operands(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
    w = torch.randn(N, K, generator=torch.Generator().manual_seed(99)).to(torch.bfloat16)  # one weight for all
    return x, w


def _rank(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        x, w = _operands(rank)
        hcom = npu_mc2_ops.EmulatedHcclBackend(dist.group.WORLD).get_hccl_comm_name(rank)
        gathered_mm, gathered = npu_mc2_ops.npu_all_gather_base_mm(x, w.t(), hcom, 2)  # x2 transposed: allowed
        _, empty = npu_mc2_ops.npu_all_gather_base_mm(x, w.t(), hcom, 2, gather_output=False)
        scattered = npu_mc2_ops.npu_mm_reduce_scatter_base(x, w.t(), hcom, 2)
        refusals = {}
        for name, call in {
            "fp32": lambda: npu_mc2_ops.npu_all_gather_base_mm(x.float(), w.t().float(), hcom, 2),
            "k": lambda: npu_mc2_ops.npu_mm_reduce_scatter_base(x[:, :128].contiguous(), w[:, :128].t(), hcom, 2),
            "world_size": lambda: npu_mc2_ops.npu_all_gather_base_mm(x, w.t(), hcom, 3),
            "transposed input": lambda: npu_mc2_ops.npu_all_gather_base_mm(w.t().t().t(), x, hcom, 2),
            "m": lambda: npu_mc2_ops.npu_mm_reduce_scatter_base(x[:3], w.t(), hcom, 2),
            "bias": lambda: npu_mc2_ops.npu_all_gather_base_mm(x, w.t(), hcom, 2, bias=torch.ones(N).bfloat16()),
            "hcom": lambda: npu_mc2_ops.npu_all_gather_base_mm(x, w.t(), "no-such-comm", 2),
        }.items():
            try:
                call()
                refusals[name] = None
            except ValueError as exc:
                refusals[name] = str(exc)
        torch.save(
            {"ag_mm": gathered_mm, "ag": gathered, "empty": empty, "rs": scattered, "refusals": refusals},
            os.path.join(out_dir, f"rank{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("mc2")
    mp.spawn(_rank, args=(free_port(), str(out)), nprocs=2)
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


def test_all_gather_matmul_is_gather_then_matmul(results):
    xs = [_operands(r)[0] for r in range(2)]
    w = _operands(0)[1]
    gathered = torch.cat(xs)  # rank order along dim 0
    want = (gathered.float() @ w.t().float()).bfloat16()
    for r in results:
        assert torch.equal(r["ag"], gathered) and torch.equal(r["ag_mm"], want)
        assert r["empty"].numel() == 0


def test_matmul_reduce_scatter_is_matmul_then_reduce_scatter(results):
    w = _operands(0)[1]
    total = sum(_operands(r)[0].float() @ w.t().float() for r in range(2))  # fp32 sum, rounded once
    for rank, r in enumerate(results):
        assert torch.equal(r["rs"], total[rank * M // 2 : (rank + 1) * M // 2].bfloat16())


def test_output_shapes_are_the_real_meta_functions():
    meta = real.meta_functions()
    x, w2 = torch.empty(M, K, device="meta", dtype=torch.bfloat16), torch.empty(K, N, device="meta")
    out, gathered = meta["npu_all_gather_base_mm"](x, w2, "hcom", 2)
    assert (tuple(out.shape), tuple(gathered.shape)) == ((2 * M, N), (2 * M, K))
    _, none = meta["npu_all_gather_base_mm"](x, w2, "hcom", 2, gather_output=False)
    assert none.numel() == 0
    assert tuple(meta["npu_mm_reduce_scatter_base"](x, w2, "hcom", 2).shape) == (M // 2, N)


@pytest.mark.parametrize(
    ("op", "facts"),
    [
        ("npu_all_gather_base_mm", ["数据类型支持float16、bfloat16、int8", "k轴取值范围为[256, 65535)",
                                    "仅支持为2、4、8", "当前版本仅支持输入0", "当前版本暂不支持bias输入为非0的场景",
                                    "input不支持输入转置后的tensor"]),
        ("npu_mm_reduce_scatter_base", ["数据类型支持float16、bfloat16、int8", "m轴需要整除world_size",
                                        "当前仅支持'sum'", "仅支持为2、4、8"]),
    ],
)  # fmt: skip
def test_the_limits_are_sentences_of_the_pinned_op_docs(op, facts):
    doc = _op_doc(op)
    for fact in facts:
        assert fact in doc, f"torch-npu {PINNED}'s doc of {op} no longer states {fact!r}; re-derive the shim's limit"


def test_what_the_docs_refuse_is_refused(results):
    for r in results:
        refusals = r["refusals"]
        assert all(refusals.values()), refusals
        assert "must be float16, bfloat16" in refusals["fp32"]
        assert "k in [256, 65535)" in refusals["k"]
        assert "world_size must be 2, 4 or 8" in refusals["world_size"]
        assert "transposed" in refusals["transposed input"]
        assert "divisible by world_size" in refusals["m"]
        assert "non-zero bias" in refusals["bias"]
        assert "names no communicator" in refusals["hcom"]
