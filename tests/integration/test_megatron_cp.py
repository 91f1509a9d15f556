"""Context parallelism in the ``megatron`` engine on CPU: two gloo ranks, CP = 2 (one data-parallel replica).

One launch of megatron_cp_worker.py (cases registered into megatron_engine_worker.py's machinery) runs the fsdp
engine over the same two ranks as the reference, then the megatron engine at ``actor.context_parallel_size=2``
(every micro-batch split into 4 chunks, rank r holding chunks r and 3 - r; K/V all-gathered by
megatron_cp.AllGatherKVAttention). The test process computes every other reference independently, with the
helpers of test_megatron_engine.py. Checked:

* log-probs == a plain transformers forward per sample (fp32, <= 1e-5) for dense Qwen3 and Qwen3-MoE at CP=2,
  each rank returning its own rows, padding exactly 0;
* one GSPO update (two minibatches, warm-up, clipping), with and without the KL term (a frozen reference model
  also run under CP), at CP=2 == the fsdp engine's on the same batch: loss, every metric, gradient norm and every
  updated weight (<= 1e-5 at lr 1e-5). A gradient counted on every CP rank (a plain differentiable all-reduce)
  doubles the gradient norm; one missing a rank's tokens changes the update's direction;
* the export at CP=2 is the HF state_dict bit for bit (CP shards no weights).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.integration.launch import MEGATRON_TESTS, launch_ranks, rank_results
from tests.integration.test_megatron_engine import (
    _hf_log_probs,
    _hf_model,
    assert_rank_log_probs,
    assert_update_matches,
)

pytestmark = MEGATRON_TESTS

WORKER = Path(__file__).with_name("megatron_cp_worker.py")
TIMEOUT_S = 300
# the fsdp cases first: they must run before the megatron engine installs the shim
CASES = ["fsdp_cp_ref", "fsdp_cp_kl", "dense_cp2", "dense_cp2_kl", "moe_cp2"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(out dir, {case: {rank: result}}), produced once for the module."""
    from tests.integration import megatron_engine_worker as worker

    out = tmp_path_factory.mktemp("megatron_cp")
    worker.make_batches(out / "batches.pt")
    launch_ranks(2, [str(WORKER), "--cases", ",".join(CASES), "--out", str(out)], "cp2", out, TIMEOUT_S)
    return out, rank_results(out)


@pytest.fixture(scope="module")
def batch(run):
    return torch.load(run[0] / "batches.pt", weights_only=False)["main"]


@pytest.mark.parametrize(("case", "kind"), [("dense_cp2", "dense"), ("moe_cp2", "moe")])
def test_cp2_log_probs_match_hugging_face(run, batch, case, kind):
    from tests.integration.megatron_engine_worker import TEMPERATURE

    reference = _hf_log_probs(_hf_model(kind, run[0]), batch, TEMPERATURE)
    ranks = run[1][case]
    assert sorted(ranks) == [0, 1]
    assert_rank_log_probs(ranks, reference, batch)


@pytest.mark.parametrize(("case", "reference"), [("dense_cp2", "fsdp_cp_ref"), ("dense_cp2_kl", "fsdp_cp_kl")])
def test_cp2_gspo_update_matches_fsdp(run, case, reference):
    out, results = run
    ref = results[reference][0]
    theirs_w, theirs_m = ref["weights"], ref["metrics"]
    assert sorted(results[case]) == [0, 1]
    assert_update_matches(results[case], ref)
    initial = _hf_model("dense", out).state_dict()
    assert max(float((theirs_w[n] - initial[n]).abs().max()) for n in initial) > 1e-5  # the update moved them
    if "kl" in case:
        assert theirs_m["actor/kl_ref"] > 0


def test_cp2_export_is_the_hf_state_dict(run):
    out, results = run
    exported = results["dense_cp2"][0]["initial_weights"]
    expected = _hf_model("dense", out).state_dict()
    assert set(exported) == set(expected)
    assert all(torch.equal(exported[n], t) for n, t in expected.items())
