"""MoE routing replay on the megatron engine under the real MindSpeed (emulated NPU), where sequence parallelism runs:
TP 2 with SP on the tiny Qwen3-MoE with two KV heads (tests/mindspeed/engine_worker.py's ``moe_kv2``), MindSpeed's
grouped-GEMM experts and alltoall dispatcher; and r3 on the shipped 30B training layout scaled down
(engine_worker.LAYOUT: TP 2 + SP x PP 2 x EP 2, full recompute, offload, the distributed optimizer) on four ranks,
each pipeline stage's MoE layer replaying the rollout's experts at its TP rank's rows, in forward and in recompute.

Each TP rank's routers see its contiguous half of the rows of each packed THD micro-batch (MindSpeed's flash
attention runs it as TND): the replayed experts must be the
rollout's (r3) or the old forward's (r2) at exactly those rows, with recompute in backward (r3), and the old forward's
routes kept per sample must be whole (gathered over TP) and the same on both ranks. The worker is
tests/unit/test_megatron_routing.py's, run with ``device=npu`` on this model; the checks are read as there.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from tests.mindspeed.engine_worker import LAYOUT
from tests.unit import test_megatron_routing as base

SP2 = ["actor.tensor_parallel_size=2", "actor.sequence_parallel=true"]
CASES = {
    "ms_r3_sp2": ("r3", [*SP2, "actor.recompute=full"], "moved"),
    "ms_r2_sp2": ("r2", SP2, "clean"),
}
LAYOUT_CASES = {"ms_r3_layout": ("r3", LAYOUT, "moved")}  # four ranks: TP 2 x PP 2, EP 2 folded into each stage
base.CASES.update(CASES)
base.CASES.update(LAYOUT_CASES)
TIMEOUT_S = 1200  # a hang guard (test_mindspeed_engine.py's TIMEOUT_S says why so long)


def _has_router_replay() -> bool:
    """megatron-core 0.16 and later (the core_r0.16.0 branch's line); the 0.12.1 branches' has no RouterReplay, and
    their transformers 4.57 router is a plain Linear the hf rollout does not record (engines/routing.py)."""
    import importlib.metadata

    try:
        major, minor = (int(x) for x in importlib.metadata.version("megatron-core").split(".")[:2])
    except importlib.metadata.PackageNotFoundError:
        return False
    return (major, minor) >= (0, 16)


pytestmark = [
    pytest.mark.slow,
    base.MEGATRON,
    pytest.mark.skipif(not _has_router_replay(), reason="routing replay needs megatron-core >= 0.16 (RouterReplay)"),
]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """The model with two KV heads and the hf rollout's batches (routes recorded), once for both fixtures."""
    from tests.mindspeed import engine_worker

    out = tmp_path_factory.mktemp("mindspeed_routing")
    engine_worker.make_moe_kv2_model(out)
    base.sample_batches(str(out / engine_worker.MOE_KV2_DIR), out)
    return out


def _run(out: Path, world: int, cases: list[str]) -> list[dict]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("GSPO_DEVICE_SHIM", "1")  # trainer.device=npu is the emulated NPU
        env.setenv("TORCH_EXTENSIONS_DIR", str(out / "torch_extensions"))  # MindSpeed creates it at import
        return base.run_ranks(out, world, cases, __file__, TIMEOUT_S)


@pytest.fixture(scope="module")
def ranks(prepared) -> list[dict]:
    return _run(prepared, 2, list(CASES))


@pytest.fixture(scope="module")
def layout_ranks(prepared) -> list[dict]:
    return _run(prepared, 4, list(LAYOUT_CASES))


def summed(ranks: list[dict], case: str, phase: str) -> dict:
    """A phase's counts over both TP ranks: the first half of a sequence may hold no filler row (no padding)."""
    counts = [found[case][phase] for found in ranks]
    return {key: sum(c[key] for c in counts) for key in counts[0]}


def test_r3_under_sequence_parallelism_replays_each_tp_ranks_rows(ranks):
    for phase in ("old", "update", "update_backward"):
        base.assert_exact(summed(ranks, "ms_r3_sp2", phase))
    for found in ranks:
        r3 = found["ms_r3_sp2"]
        for phase in ("old", "update", "update_backward"):
            assert r3[phase]["mismatched"] == 0 and r3[phase]["filler_mismatched"] == 0 and r3[phase]["checked"] > 0
        assert r3["update_backward"]["calls"] == r3["update"]["calls"] == 2 * 3  # 2 layers x 3 micro-batches
        assert r3["metrics"]["routing/rollout_agreement_mean"] < 0.9  # the rollout's routers were moved
        error, calls = r3["gates"]
        assert error < 1e-6 and calls == 2 * 2 * 3


def test_r2_under_sequence_parallelism_keeps_whole_sequences_and_replays_them(ranks):
    kept = [found["ms_r2_sp2"]["kept"] for found in ranks]
    assert all(torch.equal(a, b) for a, b in zip(*kept, strict=True))  # gathered over TP: the same on both ranks
    for found in ranks:
        r2 = found["ms_r2_sp2"]
        assert r2["old"]["mismatched"] == 0 and r2["old"]["checked"] > 0  # each rank's half == what it used
        assert r2["kept_lengths"][0] == r2["kept_lengths"][1]
        assert r2["update"]["mismatched"] == 0 and r2["update"]["filler_mismatched"] == 0
        assert r2["metrics"]["routing/update_agreement_mean"] < 0.9
        assert r2["metrics"]["routing/rollout_agreement_mean"] >= 0.99
    base.assert_exact(summed(ranks, "ms_r2_sp2", "update"), filler=None)  # packed: filler only where SP pads


def test_r3_on_the_30b_layout_replays_every_stages_rows_in_forward_and_recompute(layout_ranks):
    """The scaled-down 30B layout (issue #42's must-show "under the scaled-down 30B layout on the real MindSpeed"):
    DP 1, so every rank trains all 8 samples in 3 micro-batches; ranks 0, 1 are stage 0 (MoE layer 0), 2, 3 stage 1
    (layer 1), the two ranks of a stage each routing their half of every packed row (SP). Each rank's dispatcher
    gets exactly the rollout's experts at its rows, in the old forward, the update's forwards (1F1B) and their
    recompute in backward; gate weights are the current router's over those experts."""
    stages = [found["ms_r3_layout"]["layers"] for found in layout_ranks]
    assert stages == [[0], [0], [1], [1]]
    for found in layout_ranks:
        r3 = found["ms_r3_layout"]
        for phase in ("old", "update", "update_backward"):
            assert r3[phase]["mismatched"] == 0 and r3[phase]["filler_mismatched"] == 0 and r3[phase]["checked"] > 0
        assert r3["update_backward"]["calls"] == r3["update"]["calls"] == 3  # 1 layer a stage x 3 micro-batches
        error, calls = r3["gates"]
        assert error < 1e-6 and calls == 2 * 3  # forward and recompute
        assert r3["metrics"]["routing/rollout_agreement_mean"] < 0.9  # the rollout's routers were moved
    for stage in ((0, 1), (2, 3)):  # a stage's two TP ranks together check every row of its layer
        for phase in ("old", "update", "update_backward"):
            counts = [layout_ranks[r]["ms_r3_layout"][phase] for r in stage]
            base.assert_exact({key: sum(c[key] for c in counts) for key in counts[0]})


if __name__ == "__main__":
    from tests.mindspeed.engine_worker import MOE_KV2_DIR

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cases", required=True)
    args = parser.parse_args()
    base.worker(args.out, args.cases.split(","), model=str(args.out / MOE_KV2_DIR), device="npu")
