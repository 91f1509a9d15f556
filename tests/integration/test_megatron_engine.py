"""The ``megatron`` train engine on CPU (megatron-core over gloo through the device shim, mbridge for the weights).

Two launches of megatron_engine_worker.py run every case (one process, then two gloo processes); the test
process builds the inputs first (the sampled batches and a tiny Qwen3 with two KV heads, which TP=2 needs) and
computes every reference independently: log-probs from a plain transformers forward per sample, weights from the
checkpoint and from the fsdp engine run on the same batch. Checked:

* log-probs == HF log-probs (fp32, <= 1e-5) for dense Qwen3 at TP=1, TP=2, PP=2 and Qwen3-MoE at TP=1, EP=2, on
  packed THD micro-batches (the default), and on right-padded ones at TP=1 (dense and MoE);
* one GSPO update (two minibatches, warm-up, clipping) == the fsdp engine's (one process, whole batch): loss and
  every metric, gradient norm, every updated weight (<= 1e-5; Adam moves each weight by about lr, so lr = 1e-5
  makes a sign error in any update show as a 2e-5 difference, and the gradient norm checks magnitudes), at TP=1,
  TP=2, PP=2, DP=2 (distributed optimizer), padded, and with the KL term (a reference model inside the engine) and
  the token budget sized by the planner (auto);
* export_weights == the HF state_dict exactly (names, shapes, values; MoE experts fused as transformers 5 holds
  them), with TP / PP / EP shards gathered; save_hf loads in transformers and reproduces the engine's log-probs;
* checkpoint -> resume -> next update bitwise equal (MoE, EP=2, distributed optimizer sharded over DP=2; and
  bf16 with float32 main weights);
* a NaN loss skips the optimizer and warm-up step; actor.offload frees the buffers and changes nothing.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch
import transformers

from tests.integration.launch import MEGATRON_TESTS, launch_ranks, rank_results

pytestmark = MEGATRON_TESTS

WORKER = Path(__file__).with_name("megatron_engine_worker.py")
TIMEOUT_S = 400
TOL = 1e-5
ONE_PROCESS = [
    "fsdp_dense",
    "fsdp_kv2",
    "fsdp_kl",
    "dense_tp1",
    "dense_kl",
    "dense_nan",
    "dense_offload",
    "dense_bf16",
    "moe_tp1",
    "dense_padded",
    "moe_padded",
]
TWO_PROCESSES = ["dense_tp2", "dense_tp2_kv1", "dense_pp2", "dense_dp2", "moe_ep2"]
MODEL_OF = {"moe_tp1": "moe", "moe_padded": "moe", "moe_ep2": "moe", "dense_tp2": "dense_kv2", "fsdp_kv2": "dense_kv2"}


def _launch(world_size: int, cases: list[str], out_dir: Path) -> None:
    argv = [str(WORKER), "--cases", ",".join(cases), "--out", str(out_dir)]
    launch_ranks(world_size, argv, f"world{world_size}", out_dir, TIMEOUT_S)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(out dir, {case: {rank: result}}), produced once for the module."""
    from tests.integration import megatron_engine_worker as worker

    out = tmp_path_factory.mktemp("megatron_engine")
    worker.make_batches(out / "batches.pt")
    worker.make_kv2_model(out)
    _launch(1, ONE_PROCESS, out)
    _launch(2, TWO_PROCESSES, out)
    return out, rank_results(out)


@pytest.fixture(scope="module")
def batch(run):
    return torch.load(run[0] / "batches.pt", weights_only=False)["main"]


def _hf_model(kind: str, out: Path, path: str | None = None):
    from transformers import AutoModelForCausalLM

    from tests.integration.megatron_engine_worker import model_path

    return AutoModelForCausalLM.from_pretrained(path or model_path(kind, out), dtype=torch.float32).eval()


def _hf_log_probs(model, batch, temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) at each response token, one plain forward per sample: independent of our code."""
    from gspo_ascend.selftest.fixtures import hf_log_probs

    return hf_log_probs(model, batch, temperature)


@pytest.fixture(scope="module")
def hf_log_probs(run, batch):
    from tests.integration.megatron_engine_worker import TEMPERATURE

    return {kind: _hf_log_probs(_hf_model(kind, run[0]), batch, TEMPERATURE) for kind in ("dense", "dense_kv2", "moe")}


@pytest.mark.parametrize(
    "case",
    ["dense_tp1", "moe_tp1", "dense_padded", "moe_padded", "dense_tp2", "dense_tp2_kv1", "dense_pp2", "dense_dp2",
     "moe_ep2"],
)  # fmt: skip
def test_log_probs_match_hugging_face(run, hf_log_probs, batch, case):
    assert_rank_log_probs(run[1][case], hf_log_probs[MODEL_OF.get(case, "dense")], batch)


def assert_rank_log_probs(ranks: dict, reference: torch.Tensor, batch) -> None:
    """Each rank's log-probs == the reference on the rows it holds (TOL), exactly 0 at padding and not vacuous;
    the rows are split evenly over the ranks. Shared by the megatron, CP and MindSpeed engine tests."""
    for result in ranks.values():
        start, stop = result["rows"]
        ours = result["log_probs"]
        assert ours.shape == (stop - start, batch.response_ids.shape[1]) and ours.dtype == torch.float32
        assert (ours - reference[start:stop]).abs().max() <= TOL
        assert torch.all(ours[batch.response_mask[start:stop] == 0] == 0)  # padding is exactly 0
        assert ours.abs().max() > 0.1  # real log-probs, not a vacuous match
    assert sorted(r["rows"][0] for r in ranks.values()) == [i * len(batch) // len(ranks) for i in range(len(ranks))]


def _metric_close(a: float, b: float) -> bool:
    return abs(a - b) <= TOL * max(1.0, abs(b))


def assert_update_matches(ranks: dict, reference: dict) -> None:
    """Every rank's update metrics == the reference run's (TOL, relative above 1); rank 0's weights == its
    weights. ``actor/micro_batches`` is left out: fsdp counts per rank, megatron counts passes."""
    theirs_w, theirs_m = reference["weights"], reference["metrics"]
    for rank, result in ranks.items():
        ours_m = result["metrics"]
        assert ours_m["actor/nan_steps_skipped"] == 0 and ours_m["actor/grad_norm"] > 1.0
        assert abs(ours_m["actor/pg_loss"] - theirs_m["actor/pg_loss"]) <= TOL
        differing = {k: (ours_m[k], theirs_m[k]) for k in theirs_m if not _metric_close(ours_m[k], theirs_m[k])}
        differing.pop("actor/micro_batches", None)
        assert not differing, differing
        if rank == 0:
            ours_w = result["weights"]
            assert {n: t.shape for n, t in ours_w.items()} == {n: t.shape for n, t in theirs_w.items()}
            assert max(float((ours_w[n] - theirs_w[n]).abs().max()) for n in theirs_w) <= TOL


@pytest.mark.parametrize(
    ("case", "reference"),
    [
        ("dense_tp1", "fsdp_dense"),
        ("dense_padded", "fsdp_dense"),
        ("dense_tp2", "fsdp_kv2"),
        ("dense_tp2_kv1", "fsdp_dense"),  # the one KV head on both TP ranks (megatron-core 0.16 replicates it)
        ("dense_pp2", "fsdp_dense"),
        ("dense_dp2", "fsdp_dense"),
        ("dense_kl", "fsdp_kl"),
    ],
)
def test_gspo_update_matches_fsdp(run, case, reference):
    out, results = run
    ref = results[reference][0]
    if case == "dense_kl":  # actor.max_tokens_per_micro_batch=auto, sized at start: the host's budget
        from gspo_ascend.doctor.planner import HOST_TOKEN_BUDGET

        assert results[case][0]["token_budget"] == HOST_TOKEN_BUDGET
    theirs_w = ref["weights"]
    assert_update_matches(results[case], ref)
    initial = _hf_model(MODEL_OF.get(case, "dense"), out).state_dict()
    moved = max(float((theirs_w[n] - initial[n]).abs().max()) for n in initial)
    assert moved > 1e-5  # the update really moved the weights (two Adam steps at lr 5e-6 then 1e-5)
    if "kl" in case:
        assert ref["metrics"]["actor/kl_ref"] > 0


@pytest.mark.parametrize("case", ["dense_tp1", "moe_tp1", "dense_tp2", "dense_tp2_kv1", "dense_pp2", "moe_ep2"])
def test_export_weights_is_the_hf_state_dict(run, case):
    out, results = run
    exported = results[case][0]["initial_weights"]
    expected = _hf_model(MODEL_OF.get(case, "dense"), out).state_dict()
    assert list(exported) and set(exported) == set(expected)
    for name, tensor in expected.items():
        assert exported[name].shape == tensor.shape, name
        assert torch.equal(exported[name], tensor), name  # a pure relayout: bit for bit
    if "moe" in case:  # transformers 5 fuses the experts; 4.57 keeps one Linear per expert (exported 1:1)
        fused = int(transformers.__version__.split(".")[0]) >= 5
        assert any(name.endswith("mlp.experts.gate_up_proj") for name in exported) == fused


def test_save_hf_loads_in_transformers(run, batch):
    from tests.integration.megatron_engine_worker import TEMPERATURE

    out, results = run
    result = results["dense_tp1"][0]
    model = _hf_model("dense", out, str(out / "dense_tp1.hf"))
    state = model.state_dict()
    assert set(state) == set(result["weights"])
    assert all(torch.equal(state[n], result["weights"][n]) for n in state)
    assert (out / "dense_tp1.hf" / "generation_config.json").is_file()
    reloaded = _hf_log_probs(model, batch, TEMPERATURE)
    assert (reloaded - result["log_probs_after"]).abs().max() <= TOL
    assert (reloaded - result["log_probs"]).abs().max() > TOL  # the saved model is the updated one


@pytest.mark.parametrize("case", ["moe_ep2", "dense_bf16"])
def test_checkpoint_round_trip_is_bitwise(run, case):
    for result in run[1][case].values():
        resumed, uninterrupted = result["ckpt_metrics"]
        assert result["ckpt_weights_equal"]
        assert resumed == uninterrupted
        assert resumed["actor/nan_steps_skipped"] == 0 and resumed["actor/grad_norm"] > 0


def test_nan_loss_skips_the_step_and_the_warmup(run):
    result = run[1]["dense_nan"][0]
    metrics = result["nan_metrics"]
    assert metrics["actor/nan_steps_skipped"] == 1.0
    assert result["steps"] == 1  # only the second minibatch stepped
    assert metrics["actor/lr"] == pytest.approx(5e-6)  # warm-up step 0 of 2: the skipped step did not advance it
    assert result["nan_finite"] and result["nan_changed_tensors"] > 0


def test_offload_frees_buffers_and_changes_nothing(run):
    offloaded, plain = run[1]["dense_offload"][0], run[1]["dense_tp1"][0]
    assert offloaded["offloaded_bytes"] and all(size == 0 for size in offloaded["offloaded_bytes"])
    assert torch.equal(offloaded["log_probs"], plain["log_probs"])
    assert all(torch.equal(offloaded["weights"][n], plain["weights"][n]) for n in plain["weights"])
    assert offloaded["metrics"] == plain["metrics"]


def test_offload_has_only_the_parameters_on_the_device_during_a_weight_export(run):
    """Issue #25: the sync's export ran with the fp32 gradient buffers and the optimizer state brought back (the
    30B layout's sync: 64.6 GiB on a 64 GiB 910B). Measured from the engine's own offload accounting: flat
    buffers by their storage (really freed on the CPU), the rest by which parts were brought up."""
    result = run[1]["dense_offload"][0]
    phases, full = result["phases"], result["update_phase"][-1]  # the last loss: AdamW's state exists by then
    assert set(phases["idle"].values()) == {0} and set(phases["after_export"].values()) == {0}
    assert phases["export"] == {"params": full["params"], "grads": 0, "optimizer": 0}
    # an update has everything up: fp32 weights here, so fp32 gradients of the same size, and AdamW's two moments
    assert full["params"] > 0 and full["grads"] == full["params"] and full["optimizer"] == 2 * full["params"]


def test_the_planner_sizes_each_phase_as_the_engine_measures_it(run):
    """gspo-ascend plan for the tiny model at the dense_offload case's config, against the engine's measured
    bytes: training (weights, fp32 gradients, optimizer) = what an update has up; the sync's actor state = what
    an export has up. Hand check: 426,880 parameters x 4 B (fp32) = 1,707,520."""
    from gspo_ascend.config import load_config
    from gspo_ascend.doctor.hardware import profile
    from gspo_ascend.doctor.modelspec import load_spec
    from gspo_ascend.doctor.planner import plan
    from gspo_ascend.tiny import ensure_tiny_model
    from tests.integration.megatron_engine_worker import BASE, CASES

    cfg = load_config(None, [*BASE, *CASES["dense_offload"][1], f"model.path={ensure_tiny_model()}"])
    p = plan(cfg, load_spec(cfg.model.path), profile("atlas-800t-a2"))
    result = run[1]["dense_offload"][0]
    measured, export = result["update_phase"][-1], result["phases"]["export"]
    assert measured["params"] == 1_707_520
    planned = {"params": p.train.parts["weights"], "grads": p.train.parts["gradients"]}
    assert planned | {"optimizer": p.train.parts["optimizer"]} == measured
    assert p.sync.parts["actor state"] == export["params"] and export["grads"] == export["optimizer"] == 0


# ----------------------------------------------------------------------------------------------- in-process pieces


def test_local_spec_names_map_to_the_te_names_mbridge_knows():
    from gspo_ascend.engines.megatron_bridge import te_name

    layer = "decoder.layers.3."
    assert te_name(layer + "input_layernorm.weight", moe=False) == layer + "self_attention.linear_qkv.layer_norm_weight"
    assert te_name(layer + "pre_mlp_layernorm.weight", moe=False) == layer + "mlp.linear_fc1.layer_norm_weight"
    assert te_name(layer + "pre_mlp_layernorm.weight", moe=True) == layer + "pre_mlp_layernorm.weight"
    assert te_name(layer + "mlp.experts.local_experts.5.linear_fc2.weight", moe=True) == (
        layer + "mlp.experts.linear_fc2.weight5"
    )
    for same in ("embedding.word_embeddings.weight", layer + "self_attention.linear_qkv.weight", "output_layer.weight"):
        assert te_name(same, moe=False) == same


def _moe_layout():
    from gspo_ascend.engines.megatron_bridge import HFLayout, load_hf_config
    from gspo_ascend.tiny import ensure_tiny_model

    return HFLayout(load_hf_config(str(ensure_tiny_model(moe=True))))


@pytest.mark.skipif(
    int(transformers.__version__.split(".")[0]) < 5,
    reason=f"transformers {transformers.__version__} keeps one Linear per expert: no fused layout to convert to",
)
def test_hf_layout_fuses_checkpoint_experts_like_transformers():
    layout = _moe_layout()
    g = torch.Generator().manual_seed(0)
    stream, experts = [], {}
    for name, shape in layout.shapes.items():
        if name.endswith("experts.gate_up_proj"):
            prefix = name[: -len(".gate_up_proj")]
            for e in range(shape[0]):  # checkpoint layout: one Linear per expert, as mbridge exports them
                for proj, rows in (("gate_proj", shape[1] // 2), ("up_proj", shape[1] // 2)):
                    experts[prefix, proj, e] = torch.randn(rows, shape[2], generator=g)
                    stream.append((f"{prefix}.{e}.{proj}.weight", experts[prefix, proj, e]))
        elif name.endswith("experts.down_proj"):
            prefix = name[: -len(".down_proj")]
            for e in range(shape[0]):
                experts[prefix, "down_proj", e] = torch.randn(shape[1], shape[2], generator=g)
                stream.append((f"{prefix}.{e}.down_proj.weight", experts[prefix, "down_proj", e]))
        else:
            stream.append((name, torch.randn(shape, generator=g)))
    out = dict(layout.convert(stream))
    assert set(out) == set(layout.shapes)
    prefix = "model.layers.1.mlp.experts"
    e = 2
    expected = torch.cat([experts[prefix, "gate_proj", e], experts[prefix, "up_proj", e]], 0)
    assert torch.equal(out[f"{prefix}.gate_up_proj"][e], expected)
    assert torch.equal(out[f"{prefix}.down_proj"][e], experts[prefix, "down_proj", e])
    with pytest.raises(ValueError, match="left out"):
        list(layout.convert(stream[1:]))
    with pytest.raises(ValueError, match="does not have"):
        list(layout.convert([("model.layers.0.mlp.bogus.weight", torch.zeros(1))]))


def _cfg(*overrides: str):
    from gspo_ascend.config import load_config

    return load_config(None, ["actor.engine=megatron", *overrides])


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["model.dtype=float16"], "model.dtype"),
        (["actor.context_parallel_size=2", "actor.pipeline_parallel_size=2"], "actor.context_parallel_size"),
        (["actor.sequence_parallel=true"], "actor.sequence_parallel"),
        (["actor.use_mc2=true"], "actor.use_mc2"),
        (["model.gradient_checkpointing=true"], "actor.recompute"),
    ],
)
def test_settings_the_cpu_path_cannot_run_are_refused_by_key(overrides, key):
    from gspo_ascend.device import get_backend
    from gspo_ascend.engines.megatron import _check_config
    from gspo_ascend.errors import ConfigError

    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        _check_config(_cfg(*overrides), get_backend("cpu"))


@pytest.mark.parametrize(
    ("moe", "kv_heads", "overrides", "world", "problem"),
    [
        (False, 2, ["actor.tensor_parallel_size=4"], 4, "num_attention_heads"),  # 2 heads over TP 4
        (False, 1, ["actor.expert_parallel_size=2"], 2, "need a MoE model"),
        (True, 1, ["actor.expert_parallel_size=3"], 3, "num_experts"),
        (False, 1, ["actor.pipeline_parallel_size=2"], 3, "multiple of TP x PP"),
        (True, 2, ["actor.tensor_parallel_size=2"], 2, "needs actor.sequence_parallel=true"),
        (True, 2, ["actor.tensor_parallel_size=2", "actor.sequence_parallel=true"], 2, "impossible on CPU"),
    ],
)
def test_parallel_sizes_that_do_not_fit_the_model_are_refused(moe, kv_heads, overrides, world, problem):
    from gspo_ascend.engines.megatron import _check_model
    from gspo_ascend.engines.megatron_bridge import load_hf_config
    from gspo_ascend.errors import ConfigError
    from gspo_ascend.tiny import ensure_tiny_model

    hf = load_hf_config(str(ensure_tiny_model(moe=moe)))
    hf.num_key_value_heads = kv_heads
    with pytest.raises(ConfigError, match=problem):
        _check_model(_cfg(*overrides), hf, world, on_cpu=True)


def test_planner_counts_what_replicated_kv_heads_keep_for_backward(run):
    """The planner's attention activations against autograd's saved storages, measured in the first layer: TP 2
    over the one KV head (replicated: megatron-core 0.16 keeps the whole all-gathered QKV projection, 2 + 2 x 1
    heads) against TP 2 over two (each rank its own: 1 + 2 x 1); same hidden size, MLP and query heads per rank,
    so the difference is the replication's, 1 x head_dim x 4 bytes a token by hand."""
    from gspo_ascend.doctor.modelspec import load_spec
    from gspo_ascend.doctor.planner import layer_activation
    from tests.integration.megatron_engine_worker import model_path

    out, results = run
    cfg = _cfg("actor.tensor_parallel_size=2", "model.dtype=float32")
    planned = {kind: layer_activation(cfg, load_spec(model_path(kind, out)), 0, 2) for kind in ("dense", "dense_kv2")}
    measured = {case: results[case][0]["attention_saved_per_token"] for case in ("dense_tp2_kv1", "dense_tp2")}
    head_dim = load_spec(model_path("dense", out)).head_dim
    assert planned["dense"] - planned["dense_kv2"] == head_dim * 4
    assert measured["dense_tp2_kv1"] - measured["dense_tp2"] == head_dim * 4


@pytest.mark.parametrize(("version", "refused"), [("0.12.1", True), ("0.15.0", True), ("0.16.0", False), (None, True)])
def test_tp_over_more_ranks_than_kv_heads_needs_megatron_core_0_16(monkeypatch, version, refused):
    """The tiny Qwen3's one KV head at TP 2: megatron-core 0.16.0 replicates it (dense_tp2_kv1 above runs it), the
    releases before refuse it in TransformerConfig, which the engine says first, in one line."""
    from gspo_ascend.engines import megatron_setup
    from gspo_ascend.engines.megatron_bridge import load_hf_config
    from gspo_ascend.errors import ConfigError
    from gspo_ascend.tiny import ensure_tiny_model

    monkeypatch.setattr(megatron_setup, "megatron_core_version", lambda: version)
    hf = load_hf_config(str(ensure_tiny_model()))
    assert (hf.num_attention_heads, hf.num_key_value_heads) == (2, 1)
    cfg = _cfg("actor.tensor_parallel_size=2")
    if not refused:
        megatron_setup._check_model(cfg, hf, 2, on_cpu=True)
        return
    said = f"megatron-core {version or 'of unknown version'} cannot replicate them (0.16.0 and later can)"
    with pytest.raises(ConfigError, match=re.escape(f"num_key_value_heads (1) must divide by TP: {said}")):
        megatron_setup._check_model(cfg, hf, 2, on_cpu=True)


def test_unsupported_model_families_are_refused(tmp_path):
    from transformers import LlamaConfig

    from gspo_ascend.engines.megatron_bridge import load_hf_config
    from gspo_ascend.errors import UserError

    LlamaConfig(num_hidden_layers=1, hidden_size=16, intermediate_size=32, num_attention_heads=2).save_pretrained(
        tmp_path
    )
    with pytest.raises(UserError, match="supports qwen2, qwen3, qwen3_moe"):
        load_hf_config(str(tmp_path))


def test_npu_without_mindspeed_is_a_one_line_error():
    from gspo_ascend.device import NPU
    from gspo_ascend.engines.megatron import _import_megatron
    from gspo_ascend.errors import UserError

    if importlib.util.find_spec("mindspeed") and importlib.util.find_spec("mindspeed.megatron_adaptor"):
        pytest.skip("a real MindSpeed is installed")
    with pytest.raises(UserError, match="from source.*docs/install-npu.md"):
        _import_megatron(NPU)


def test_mindspeed_switches_on_the_local_spec():
    """Under MindSpeed (a real NPU here) two megatron fields switch its features on the local spec: grouped GEMM
    (GroupedMLP -> MindSpeedGmmExperts) and bias_activation_fusion (the dense MLP's fused SwiGLU). MindSpeed's own
    keys reach the TransformerConfig through mindspeed_setup.apply, not these overrides (tests/mindspeed)."""
    from gspo_ascend.device import NPU, get_backend
    from gspo_ascend.engines.megatron import _transformer_overrides

    npu = _transformer_overrides(_cfg(), NPU, moe=True, use_te=False)
    assert npu["moe_grouped_gemm"] and npu["bias_activation_fusion"]
    assert "use_flash_attn" not in npu
    cpu = _transformer_overrides(_cfg(), get_backend("cpu"), moe=True, use_te=False)
    assert not cpu["moe_grouped_gemm"] and not cpu["bias_activation_fusion"]


def test_te_fuses_rope_so_packed_boundaries_stay_on_the_device():
    """With Transformer Engine, RoPE is TE's fused kernel (it takes the packed THD boundaries on the device);
    megatron's unfused THD RoPE would read them back to the host in every layer. Without TE, the unfused one (its
    boundaries are on the host there: megatron_train._placed)."""
    from gspo_ascend.device import get_backend
    from gspo_ascend.engines.megatron import _transformer_overrides

    cuda = type("Cuda", (), {"name": "cuda", "torch_device_type": "cuda", "emulated": False})()
    assert _transformer_overrides(_cfg(), cuda, moe=False, use_te=True)["apply_rope_fusion"] is True
    assert _transformer_overrides(_cfg(), get_backend("cpu"), moe=False, use_te=False)["apply_rope_fusion"] is False
