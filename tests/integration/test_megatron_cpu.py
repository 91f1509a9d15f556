"""Unmodified megatron-core trains on CPU over gloo through the CUDA->CPU redirection of the device shim.

Two jobs of megatron_worker.py (each rank installs the redirection before importing megatron.core):

* a single process: the TP=1, PP=1 reference on the full global batch;
* two gloo processes that run, in turn, TP=2 (with activation recomputation), PP=2 with the 1F1B schedule,
  and a 4-expert MoE with EP=2, the alltoall token dispatcher and the distributed optimizer.

The dense jobs load the same reference weights and see the same micro-batches, so their per-step losses must
agree to float32 round-off; everything else (schedules, optimizer, DDP, RNG tracker) is megatron's own.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from tests.integration.launch import launch_ranks

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"),
]

WORKER = Path(__file__).with_name("megatron_worker.py")
TIMEOUT_S = 300
TOLERANCE = 1e-5


def _launch(world_size: int, jobs: list[str], out_dir: Path) -> None:
    argv = [str(WORKER), "--jobs", ",".join(jobs), "--out", str(out_dir)]
    launch_ranks(world_size, argv, "-".join(jobs), out_dir, TIMEOUT_S)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    """{job: {rank: result}} for every job, produced once for the whole module."""
    out = tmp_path_factory.mktemp("megatron_cpu")
    _launch(1, ["dense_ref"], out)
    _launch(2, ["dense_tp2", "dense_pp2", "moe_ep2"], out)
    found: dict = {}
    for path in out.glob("*.json"):
        job, rank = path.stem.rsplit(".rank", 1)
        found.setdefault(job, {})[int(rank)] = json.loads(path.read_text())
    return found


def _max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b) and a, (a, b)
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_reference_run_learns(results):
    losses = results["dense_ref"][0]["losses"]
    assert len(losses) == 4 and abs(losses[0] - math.log(128)) < 0.1  # untrained: ~uniform over the vocab
    assert losses[-1] < losses[0] - 0.3


def test_tensor_parallel_2_matches_tp1(results):
    reference = results["dense_ref"][0]["losses"]
    for rank in (0, 1):  # both TP ranks see the (tensor-parallel) cross entropy's full loss
        assert _max_diff(results["dense_tp2"][rank]["losses"], reference) < TOLERANCE


def test_rng_tracker_really_forks_and_restores(results):
    """GPU-style init under TP=2: split weights differ per TP rank (forked per-rank seeds), replicated ones agree
    (the default state was restored after every fork)."""
    for rank in (0, 1):
        assert results["dense_tp2"][rank]["rng_tracker"] == {"replicated_equal": True, "split_equal": False}


def test_pipeline_parallel_2_runs_1f1b_and_matches_pp1(results):
    first, last = results["dense_pp2"][0], results["dense_pp2"][1]
    assert first["forward_backward"] == last["forward_backward"] == "forward_backward_pipelining_without_interleaving"
    assert first["losses"] == []  # only the last stage computes the loss
    assert _max_diff(last["losses"], results["dense_ref"][0]["losses"]) < TOLERANCE


def test_moe_expert_parallel_with_distributed_optimizer_trains(results):
    for rank in (0, 1):
        result = results["moe_ep2"][rank]
        assert result["optimizers"] == ["DistributedOptimizer", "DistributedOptimizer"]  # dense + expert params
        assert result["dispatcher"] == "MoEAlltoAllTokenDispatcher" and result["local_experts"] == 2
        losses = result["losses"]
        assert all(math.isfinite(x) for x in losses)
        assert all(later < earlier for earlier, later in zip(losses, losses[1:], strict=False)), losses
