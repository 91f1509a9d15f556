"""The fsdp train engine, its log-prob forward and its micro-batching.

Expected values come from independent computations: one plain (unsharded, unpacked) Hugging Face forward per
sample with a full log_softmax, the policy loss evaluated once on the whole minibatch, hand-derived plans.
"""

from __future__ import annotations

import math
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from gspo_ascend.algorithms import AGG_MODES, agg_loss, get_policy_loss, kl_penalty
from gspo_ascend.device import get_backend
from gspo_ascend.engines.base import SampleBatch
from gspo_ascend.engines.fsdp import FSDP_PARTS
from gspo_ascend.engines.logprobs import forward_log_probs, token_log_probs
from gspo_ascend.engines.microbatch import dp_shard, plan_micro_batches
from gspo_ascend.errors import ConfigError, UserError
from tests.conftest import REPO
from tests.unit.fsdp_worker import (
    batch_to_dict,
    engine_config,
    make_batch,
    reference_log_probs,
    with_old_log_probs,
)

R = 6  # response width of the test batches


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def model_path() -> str:
    from gspo_ascend.tiny import ensure_tiny_model

    return str(ensure_tiny_model())


def plain_model(path: str, dtype=torch.float32, attn: str = "sdpa"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn)


def make_engine(model_path: str, *overrides: str, master_dtype=torch.float32):
    from gspo_ascend.engines.fsdp import FSDPEngine

    base = ["data.train_batch_size=8", "algorithm.minibatches_per_rollout=1", "actor.lr=1e-3"]
    return FSDPEngine(engine_config(*base, *overrides), get_backend("cpu"), model_path, master_dtype=master_dtype)


def full_weights(engine) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in engine.export_weights()}


def full_grads(engine) -> dict[str, torch.Tensor]:
    return {n: p.grad.full_tensor().clone() for n, p in engine.model.named_parameters() if p.grad is not None}


def parked_engine(model_path: str, *overrides: str):
    """An engine with actor.offload driven through a lossless float32 (device) / float64 (host) round trip: on a CPU
    box host == device, so the same Module.to / optimizer-state moves are made visible by dtype. Parked on the host."""
    engine = make_engine(model_path, "actor.offload=true", *overrides)
    assert engine._offload_to is None  # nothing to do on the CPU backend
    engine._onload_to, engine._offload_to = {"dtype": torch.float32}, {"dtype": torch.float64}
    for part in FSDP_PARTS:
        engine._place(part, device=False)
    return engine


def rollout(model_path: str, n: int, seed: int, noise: float = 1e-4, group: int = 1) -> SampleBatch:
    """A batch whose old_log_probs are the initial policy's (independent reference) plus small noise; ``group``
    consecutive samples share a prompt (GSPO's groups)."""
    batch = make_batch(n, R, seed)
    if group > 1:
        batch = batch.replace(prompt_ids=[batch.prompt_ids[i - i % group] for i in range(n)])
    with torch.no_grad():
        current = reference_log_probs(plain_model(model_path), batch, 1.0)
    return with_old_log_probs(batch, current, noise, seed)


# ----------------------------------------------------------------------------------------------- micro-batches


def test_fixed_size_micro_batches_are_contiguous_chunks():
    batch = make_batch(7, R, seed=0)
    assert plan_micro_batches(batch, micro_batch_size=3).groups == [[0, 1, 2], [3, 4, 5], [6]]
    assert plan_micro_batches(batch, micro_batch_size=10).groups == [list(range(7))]


def test_token_budget_first_fit_decreasing_by_hand():
    # costs = prompt + response tokens: 5, 9, 3, 12, 4, 6 (sample 3 alone exceeds the budget of 10)
    prompts = [[5] * p for p in (2, 4, 1, 6, 2, 3)]
    lengths = torch.tensor([3, 5, 2, 6, 2, 3])
    mask = (torch.arange(R)[None, :] < lengths[:, None]).float()
    batch = SampleBatch(prompts, torch.where(mask.bool(), 7, 0), mask)
    plan = plan_micro_batches(batch, micro_batch_size=2, max_tokens=10)  # the budget wins over the size
    # decreasing: 3(12) alone, 1(9), 5(6), 0(5), 4(4), 2(3): 1 | 5+4 | 0+2 (+ nothing fits) -> by first index
    assert plan.groups == [[0, 2], [1], [3], [4, 5]]
    assert plan.oversized == 1
    assert plan_micro_batches(batch, max_tokens=10).groups == plan.groups  # deterministic
    assert sorted(i for g in plan.groups for i in g) == list(range(6))


def test_dp_shard_puts_each_global_minibatch_on_the_ranks():
    batch = make_batch(12, R, seed=1)
    shards = [dp_shard(batch, rank, 2, 3) for rank in range(2)]
    for j, global_mb in enumerate(batch.split(3)):
        parts = SampleBatch.concat([s.split(3)[j] for s in shards])
        assert parts.prompt_ids == global_mb.prompt_ids
        assert torch.equal(parts.response_ids, global_mb.response_ids)
    with pytest.raises(ValueError, match="cannot be cut"):
        dp_shard(batch, 0, 5, 1)


# ----------------------------------------------------------------------------------------------- log-probs


def test_token_log_probs_is_log_softmax_at_the_label(monkeypatch):
    import gspo_ascend.engines.logprobs as logprobs

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 11, (3, 5), generator=g)
    expected = torch.log_softmax(logits / 0.6, -1).gather(-1, labels[..., None]).squeeze(-1)
    assert torch.allclose(token_log_probs(logits, labels, 0.6), expected, atol=1e-12, rtol=0)
    monkeypatch.setattr(logprobs, "LOGSUMEXP_CHUNK", 4)  # 15 rows in chunks of 4, 4, 4, 3
    assert torch.allclose(token_log_probs(logits, labels, 0.6), expected, atol=1e-12, rtol=0)
    half = token_log_probs(logits.bfloat16(), labels, 1.0)
    assert half.dtype == torch.float32
    with pytest.raises(ValueError, match="temperature"):
        token_log_probs(logits, labels, 0.0)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_equals_padded_equals_per_sample(model_path, attn):
    batch = make_batch(6, R, seed=2)
    assert int(batch.response_mask.sum(-1).min()) == 0  # an empty response is in the batch
    # float64: the layouts are the same computation, so only summation order differs (eager's softmax runs
    # in float32 whatever the model dtype, hence its looser bound); a leak across packed sequences or into
    # padding would be O(0.1)
    model = plain_model(model_path, torch.float64, attn).eval()
    with torch.no_grad():
        expected = reference_log_probs(model, batch, 0.7)
        packed = forward_log_probs(model, batch, 0.7, packed=True)
        padded = forward_log_probs(model, batch, 0.7, packed=False)
    tol = 1e-12 if attn == "sdpa" else 1e-5
    assert (packed - expected).abs().max() <= tol
    assert (padded - expected).abs().max() <= tol
    assert torch.equal(packed[batch.response_mask == 0], torch.zeros(int((batch.response_mask == 0).sum())))
    # float32: log-probs reach -24 here, where 1e-6 is below one ulp, so the bound is relative
    model = plain_model(model_path, torch.float32, attn).eval()
    with torch.no_grad():
        expected = reference_log_probs(model, batch, 0.7)
        for packed_layout in (True, False):
            got = forward_log_probs(model, batch, 0.7, packed=packed_layout)
            assert got.dtype == torch.float32
            assert ((got - expected).abs() <= 1e-6 * expected.abs().clamp_min(1.0)).all()


def test_log_probs_refuse_left_padded_masks(model_path):
    batch = make_batch(2, R, seed=3, min_response=3)
    batch.response_mask[0, 0] = 0  # a hole at the start: not right-padded
    with pytest.raises(ValueError, match="prefix"):
        forward_log_probs(plain_model(model_path), batch, 1.0, packed=True)


# ----------------------------------------------------------------------------------------------- gradients


def reference_loss(model, batch, loss_name, agg_mode, ref_model=None, kl_coef=0.0, estimator="k3"):
    """The loss of the whole minibatch in one call, local counts = global counts."""
    log_prob = reference_log_probs(model, batch, 1.0)
    loss, metrics = get_policy_loss(loss_name)(
        log_prob,
        batch.old_log_probs,
        batch.advantages,
        batch.response_mask,
        clip_low=3e-4,
        clip_high=4e-4,
        agg_mode=agg_mode,
        norm_length=R,
    )
    if ref_model is not None:
        with torch.no_grad():
            ref = reference_log_probs(ref_model, batch, 1.0)
        kl = agg_loss(kl_penalty(estimator, log_prob, ref, batch.response_mask), batch.response_mask, agg_mode)
        loss = loss + kl_coef * kl
    return loss, metrics


def reference_grads(model, loss) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_close_dicts(got: dict, want: dict, atol: float) -> None:
    assert got.keys() == want.keys()
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert worst <= atol, f"max abs difference {worst:.3g} > {atol}"


# Gradient equivalences run in float64: in float32 two correct computations of these gradients (max ~5) already
# differ by ~7e-6 (summation order), above the 1e-6 we want to hold them to.
F64 = {"master_dtype": torch.float64}


@pytest.mark.parametrize("agg_mode", AGG_MODES)
def test_micro_batched_gradients_equal_full_batch_gradient(model_path, agg_mode):
    batch = rollout(model_path, 8, seed=4)
    model = plain_model(model_path, torch.float64)
    engine = make_engine(model_path, f"algorithm.loss_agg_mode={agg_mode}", **F64)
    splits = [("actor.micro_batch_size", 3, True), ("actor.max_tokens_per_micro_batch", 20, False)]
    for loss_name in ("gspo", "grpo"):
        engine.policy_loss = get_policy_loss(loss_name)
        loss, _ = reference_loss(model, batch, loss_name, agg_mode)
        want = reference_grads(model, loss)
        assert max(g.abs().max().item() for g in want.values()) > 1e-3  # a gradient worth comparing
        for key, value, packed in splits:
            engine.cfg.actor.micro_batch_size = value if key == "actor.micro_batch_size" else None
            engine.cfg.actor.max_tokens_per_micro_batch = value if key != "actor.micro_batch_size" else None
            engine.cfg.actor.use_remove_padding = packed
            record = engine.backward_minibatch(batch, 1.0)
            assert record.passes >= 3  # really micro-batched
            assert_close_dicts(full_grads(engine), want, atol=1e-10)
            engine.optimizer.zero_grad(set_to_none=True)


def test_update_metrics_equal_full_batch_loss_metrics(model_path):
    batch = rollout(model_path, 8, seed=5, noise=3e-4)  # enough noise to clip some sequences/tokens
    _, want = reference_loss(plain_model(model_path, torch.float64), batch, "grpo", "token-mean")
    engine = make_engine(model_path, "algorithm.loss=grpo", "algorithm.loss_agg_mode=token-mean", **F64)
    metrics = engine.update(batch, 1.0)
    assert 0 < want["clipfrac_token"] < 1
    for key, value in want.items():
        assert metrics[f"actor/{key}"] == pytest.approx(float(value), abs=1e-12), key
    assert metrics["actor/micro_batches"] == 2  # 8 samples, micro_batch_size 4
    assert metrics["actor/nan_steps_skipped"] == 0
    assert metrics["actor/lr"] == pytest.approx(1e-3)
    assert math.isfinite(metrics["actor/grad_norm"]) and metrics["actor/grad_norm"] > 0


def test_kl_term_gradient_against_a_frozen_initial_reference(model_path):
    engine = make_engine(model_path, "algorithm.kl_coef=0.5", "algorithm.kl_estimator=k2", **F64)
    first = rollout(model_path, 8, seed=6)
    metrics = engine.update(first, 1.0)
    assert metrics["actor/kl_ref"] == 0.0  # the policy is the reference before its first step
    # after one step the policy moved, the reference did not: compare the gradient with an independent one
    moved = plain_model(model_path, torch.float64)
    moved.load_state_dict(full_weights(engine))
    batch = rollout(model_path, 8, seed=7)
    ref = plain_model(model_path, torch.float64)
    loss, _ = reference_loss(moved, batch, "gspo", "seq-mean-token-mean", ref, 0.5, "k2")
    want = reference_grads(moved, loss)
    engine.backward_minibatch(batch, 1.0)
    assert_close_dicts(full_grads(engine), want, atol=1e-10)
    engine.optimizer.zero_grad(set_to_none=True)
    assert engine.update(batch, 1.0)["actor/kl_ref"] > 0


def test_gradient_checkpointing_gives_the_same_gradients(model_path):
    batch = rollout(model_path, 4, seed=8)
    grads = []
    for flag in ("false", "true"):
        engine = make_engine(model_path, f"model.gradient_checkpointing={flag}", **F64)
        engine.model.train()  # transformers only checkpoints in training mode
        assert engine.model.is_gradient_checkpointing == (flag == "true")
        engine.backward_minibatch(batch, 1.0)
        grads.append(full_grads(engine))
    assert_close_dicts(grads[1], grads[0], atol=1e-12)


# ----------------------------------------------------------------------------------------------- data parallel


@pytest.mark.slow
# DP2 on the host: auto reshards (ZeRO-3); off keeps the layers gathered and defers the reduction, dummy passes
# included (the default on a device where it fits). ``group`` 2: samples 2i and 2i + 1 share a prompt, which
# dp_shard keeps on one rank, so actor.shared_prefix (auto: on on the host) shares it there, at DP2 and at DP1.
@pytest.mark.parametrize("reshard, group", [("auto", 2), ("off", 1)])
def test_dp2_update_equals_dp1_update(model_path, reshard, group):
    overrides = [
        "data.train_batch_size=8",
        "algorithm.minibatches_per_rollout=2",
        "actor.lr=1e-3",
        "actor.max_tokens_per_micro_batch=14",  # ranks get different micro-batch counts: dummies pad them
        "algorithm.loss_agg_mode=token-mean",
        f"actor.fsdp_reshard_after_forward={reshard}",
    ]
    batch = rollout(model_path, 8, seed=9, group=group)
    shards = [dp_shard(batch, r, 2, 2) for r in range(2)]
    shared = group > 1
    counts = [[len(plan_micro_batches(mb, max_tokens=14, shared_prefix=shared)) for mb in s.split(2)] for s in shards]
    assert counts[0] != counts[1]  # so the zero-weight dummy passes are exercised
    if shared:  # each rank's minibatch holds a pair of one prompt, which shares one row in 3 of the 4
        assert all(mb.prompt_ids[0] == mb.prompt_ids[1] for s in shards for mb in s.split(2))
        assert counts == [[2, 1], [1, 1]]
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(batch_to_dict(batch), f"{tmp}/batch.pt")
        cmd = [sys.executable, "-m", "tests.unit.fsdp_worker", "2", tmp, *overrides]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        ranks = [torch.load(f"{tmp}/out{r}.pt", weights_only=True) for r in range(2)]
    from gspo_ascend.engines.fsdp import FSDPEngine

    engine = FSDPEngine(engine_config(*overrides), get_backend("cpu"), model_path)
    assert engine.shared_prefix  # auto, on the host
    log_probs = engine.compute_log_probs(batch, 1.0)
    metrics = engine.update(batch, 1.0)
    for r in range(2):
        shard_log_probs = dp_shard(batch.replace(old_log_probs=log_probs), r, 2, 2).old_log_probs
        # float32 with different micro-batch shapes: equal to ~1 ulp of log-probs that reach -20
        assert ((ranks[r]["log_probs"] - shard_log_probs).abs() <= 1e-6 * shard_log_probs.abs().clamp_min(1)).all()
        # two AdamW steps of lr 1e-3 from float32 gradients summed in other orders: the fused kernel's rounding gave
        # 1.3e-6 (auto) and 1.2e-6 (off) where foreach gave 6.6e-7; a wrong reduction moves weights by O(lr) = 1e-3
        assert_close_dicts(ranks[r]["weights"], full_weights(engine), atol=2e-6)
    # AdamW's step is invariant to a uniform gradient scale, so grad_norm is what pins the loss * DP scaling
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/num_tokens", "actor/clipfrac_token"):
        # pg_loss is near 0 (centred advantages: 1.5e-3 here) and its second minibatch is taken at the weights after
        # step 1, which agree to 2e-6 (above): it agrees absolutely, to ~1e-6 (torch 2.11's gloo: 3.0e-7 apart), not
        # relatively; a wrong loss scale or reduction moves it by its own size
        tol = {"abs": 1e-6} if key == "actor/pg_loss" else {"rel": 1e-5, "abs": 1e-7}
        assert ranks[0]["metrics"][key] == pytest.approx(metrics[key], **tol), key
    assert ranks[0]["metrics"]["actor/micro_batches"] == ranks[1]["metrics"]["actor/micro_batches"]


# ----------------------------------------------------------------------------------------------- NaN steps


def test_non_finite_minibatch_is_skipped_and_counted(model_path):
    batch = rollout(model_path, 6, seed=10)
    common = ["actor.micro_batch_size=2"]  # one micro-batch per minibatch: policy-loss call i = minibatch i
    poisoned = make_engine(model_path, "data.train_batch_size=6", "algorithm.minibatches_per_rollout=3", *common)
    calls = []
    loss_fn = poisoned.policy_loss

    def nan_in_second_minibatch(*args, **kwargs):
        loss, metrics = loss_fn(*args, **kwargs)
        calls.append(1)
        return (loss * math.nan if len(calls) == 2 else loss), metrics

    poisoned.policy_loss = nan_in_second_minibatch
    metrics = poisoned.update(batch, 1.0)
    assert metrics["actor/nan_steps_skipped"] == 1 and poisoned.nan_steps_total == 1
    assert math.isfinite(metrics["actor/pg_loss"]) and math.isfinite(metrics["actor/grad_norm"])
    # the same as an engine that only ever saw minibatches 0 and 2: the skipped step left no trace
    mbs = batch.split(3)
    clean = make_engine(model_path, "data.train_batch_size=4", "algorithm.minibatches_per_rollout=2", *common)
    clean.update(SampleBatch.concat([mbs[0], mbs[2]]), 1.0)
    assert_close_dicts(full_weights(poisoned), full_weights(clean), atol=0.0)
    steps = {int(s["step"]) for s in poisoned.optimizer.state.values()}
    assert steps == {2}


# ----------------------------------------------------------------------------------------------- lr, checkpoints


def test_linear_warmup_then_constant(model_path):
    from gspo_ascend.engines.train_common import warmup_factor

    assert [warmup_factor(4)(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert warmup_factor(0)(0) == 1.0
    engine = make_engine(model_path, "actor.warmup_steps=3", "data.train_batch_size=2")
    lrs = [engine.update(rollout(model_path, 2, seed=11 + i), 1.0)["actor/lr"] for i in range(4)]
    assert lrs == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3, 1e-3], rel=1e-12)


def test_checkpoint_round_trip_is_bitwise(model_path, tmp_path):
    overrides = ["actor.warmup_steps=3", "algorithm.minibatches_per_rollout=2"]
    b1, b2 = rollout(model_path, 8, seed=20), rollout(model_path, 8, seed=21)
    first = make_engine(model_path, *overrides)
    first.save_checkpoint(str(tmp_path / "c0"))  # before any step: no optimizer state to save yet
    m1 = first.update(b1, 1.0)
    w1 = full_weights(first)
    torch.manual_seed(1234)
    rng = torch.get_rng_state()
    first.save_checkpoint(str(tmp_path / "c1"))
    m2 = first.update(b2, 1.0)
    w2 = full_weights(first)

    torch.manual_seed(99)  # a different RNG state that the load must undo
    second = make_engine(model_path, *overrides)
    second.load_checkpoint(str(tmp_path / "c0"))
    assert second.update(b1, 1.0) == m1
    assert_close_dicts(full_weights(second), w1, atol=0.0)
    second.load_checkpoint(str(tmp_path / "c1"))
    assert torch.equal(torch.get_rng_state(), rng)
    assert second.update(b2, 1.0) == m2
    assert_close_dicts(full_weights(second), w2, atol=0.0)
    assert m2["actor/lr"] == pytest.approx(1e-3)  # the scheduler resumed at step 3 of the warm-up
    with pytest.raises(UserError, match="engine_rank0.pt"):
        second.load_checkpoint(str(tmp_path))


def test_resume_with_a_changed_lr_trains_at_the_new_lr(model_path, tmp_path):
    """Issue 18, defect 4: actor.lr is one of the keys that may change on resume (gspo_ascend/resume.py); the saved
    optimizer / scheduler state must not silently put the old lr back. The warm-up position is kept."""
    overrides = ["actor.warmup_steps=4", "algorithm.minibatches_per_rollout=2"]
    first = make_engine(model_path, "actor.lr=1e-3", *overrides)
    first.update(rollout(model_path, 8, seed=30), 1.0)  # 2 optimizer steps: the scheduler is at warm-up step 2
    first.save_checkpoint(str(tmp_path / "c"))
    second = make_engine(model_path, "actor.lr=4e-4", *overrides)
    second.load_checkpoint(str(tmp_path / "c"))
    assert second.optimizer.param_groups[0]["lr"] == pytest.approx(4e-4 * 3 / 4, rel=1e-12)
    lrs = second.update(rollout(model_path, 8, seed=31), 1.0)["actor/lr"]  # warm-up steps 3 and 4 (of 4)
    assert lrs == pytest.approx(4e-4, rel=1e-12)


# ----------------------------------------------------------------------------------------------- export, save_hf


def test_export_weights_names_and_values_are_the_hf_state_dict(model_path):
    engine = make_engine(model_path)
    exported = full_weights(engine)
    want = plain_model(model_path).state_dict()
    assert list(exported) == list(want)
    assert_close_dicts(exported, want, atol=0.0)


def test_save_hf_loads_with_identical_logits(model_path, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    engine = make_engine(model_path)
    batch = rollout(model_path, 8, seed=30)
    engine.update(batch, 1.0)
    engine.save_hf(str(tmp_path / "hf"), AutoTokenizer.from_pretrained(model_path))
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    expected = plain_model(model_path).eval()
    expected.load_state_dict(full_weights(engine))
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    ids = torch.tensor([batch.prompt_ids[0] + batch.prompt_ids[1]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, expected(ids).logits)
        assert not torch.equal(loaded(ids).logits, plain_model(model_path)(ids).logits)  # the update is in it
        assert torch.allclose(
            engine.compute_log_probs(batch, 1.0), reference_log_probs(loaded, batch, 1.0), atol=1e-5, rtol=0
        )


def test_offload_round_trip_between_calls_changes_nothing(model_path):
    b1, b2 = rollout(model_path, 8, seed=60), rollout(model_path, 8, seed=61)
    plain, offloaded = make_engine(model_path), parked_engine(model_path)
    for engine in (plain, offloaded):
        engine.compute_log_probs(b1, 1.0)
        engine.update(b1, 1.0)
        engine.update(b2, 1.0)
    assert {p.dtype for p in offloaded.model.parameters()} == {torch.float64}  # parked between calls
    assert {s["exp_avg"].dtype for s in offloaded.optimizer.state.values()} == {torch.float64}
    assert torch.equal(offloaded.compute_log_probs(b2, 1.0), plain.compute_log_probs(b2, 1.0))
    assert_close_dicts(full_weights(offloaded), full_weights(plain), atol=0.0)
    assert {p.dtype for p in offloaded.model.parameters()} == {torch.float64}


def test_offload_brings_up_only_the_parameters_for_a_weight_export(model_path):
    """Issue #25: the sync runs beside the rollout engine's weights, so an export must not bring the optimizer
    state (2x the parameters) to the device. Measured by dtype: the test's device is float32, the host float64
    (the round trip of the test above), so where each tensor is can be read off it."""
    engine = parked_engine(model_path, "algorithm.kl_coef=0.1")
    batch = rollout(model_path, 8, seed=62)
    engine.update(batch, 1.0)

    def where() -> dict[str, set]:
        return {
            "params": {p.dtype for p in engine.model.parameters()},
            "ref": {p.dtype for p in engine.ref_model.parameters()},
            "optimizer": {s["exp_avg"].dtype for s in engine.optimizer.state.values()},
        }

    parked = {"params": {torch.float64}, "ref": {torch.float64}, "optimizer": {torch.float64}}
    assert where() == parked
    stream = engine.export_weights()
    next(stream)  # inside the export: its first tensor is out
    assert where() == parked | {"params": {torch.float32}}
    assert (
        engine.resident_bytes()["optimizer"] == engine.resident_bytes()["ref"] == 0 < engine.resident_bytes()["params"]
    )
    for _ in stream:
        pass
    assert where() == parked and set(engine.resident_bytes().values()) == {0}
    seen = []
    loss = engine.policy_loss
    engine.policy_loss = lambda *a, **k: seen.append(where()) or loss(*a, **k)
    engine.update(batch, 1.0)
    assert seen and seen[0] == {part: {torch.float32} for part in FSDP_PARTS}  # an update has everything up


# ----------------------------------------------------------------------------------------------- bf16, errors


def test_bf16_runs_one_update_with_float32_master_weights(model_path):
    engine = make_engine(model_path, "model.dtype=bfloat16")
    batch = rollout(model_path, 8, seed=40, noise=0.0)
    before = {n: p.full_tensor().clone() for n, p in engine.model.named_parameters()}
    log_probs = engine.compute_log_probs(batch, 1.0)
    assert (log_probs - batch.old_log_probs).abs().max() < 0.25  # bf16 forward ~ the float32 one
    metrics = engine.update(batch.replace(old_log_probs=log_probs), 1.0)
    assert all(math.isfinite(v) for v in metrics.values())
    assert all(p.dtype == torch.float32 for p in engine.model.parameters())
    exported = dict(engine.export_weights())
    assert exported["lm_head.weight"].dtype == torch.bfloat16
    after = {n: p.full_tensor() for n, p in engine.model.named_parameters()}
    assert all(not torch.equal(before[n], after[n]) for n in before if n != "model.embed_tokens.weight")


def test_bad_input_is_refused_with_a_named_key(model_path):
    from gspo_ascend.engines.fsdp import FSDPEngine

    with pytest.raises(ConfigError, match="model.dtype"):
        make_engine(model_path, "model.dtype=float16")
    with pytest.raises(ConfigError, match="actor.tensor_parallel_size"):
        make_engine(model_path, "actor.tensor_parallel_size=2")
    with pytest.raises(ConfigError, match="model.gradient_checkpointing"):
        make_engine(model_path, "actor.recompute=full")
    with pytest.raises(UserError, match="model.path"):
        FSDPEngine(engine_config(), get_backend("cpu"), str(Path(model_path) / "missing"))
    engine = make_engine(model_path, "algorithm.minibatches_per_rollout=3", "data.train_batch_size=6")
    batch = rollout(model_path, 4, seed=50)
    with pytest.raises(UserError, match="minibatches_per_rollout"):
        engine.update(batch, 1.0)
    with pytest.raises(ValueError, match="advantages"):
        engine.update(batch.replace(advantages=None), 1.0)


def test_trainer_compile_on_compiles_the_engines_policy_loss(model_path):
    """trainer.compile did nothing before (no engine called compile.maybe_compile); now the engine's loss is the
    compiled wrapper with trainer.compile=on and the plain function otherwise (compiled == eager: test_compile.py)."""
    from gspo_ascend.compile import EagerFallback

    assert make_engine(model_path).policy_loss is get_policy_loss("gspo")
    on = make_engine(model_path, "trainer.compile=on").policy_loss
    assert isinstance(on, EagerFallback) and on.fn is get_policy_loss("gspo")


def test_compiled_layers_equal_eager_and_compile_once(model_path):
    """actor.compile_layers=on (engines/compiled_layers.py): every RMSNorm and MLP runs compiled, with log-probs and
    gradients equal to eager's in float32, and batches of other lengths compile six graphs in all (norm over hidden,
    norm over head_dim, MLP; each without grad for the log-probs and with it for the update): none per length."""
    from torch._dynamo.utils import counters

    from gspo_ascend.engines.compiled_layers import compiled_count

    torch._dynamo.reset()
    counters.clear()
    try:
        _compiled_layers_equal_eager(model_path, counters, compiled_count)
    finally:  # compiled code and dynamo's caches must not outlive the test (later tests in this worker compare eager)
        torch._dynamo.reset()


def _compiled_layers_equal_eager(model_path, counters, compiled_count):
    batches = [rollout(model_path, 4, seed=8), rollout(model_path, 6, seed=11)]
    assert batches[0].response_mask.sum(1).tolist() != batches[1].response_mask.sum(1).tolist()
    results = {}
    for mode in ("off", "on"):
        engine = make_engine(model_path, f"actor.compile_layers={mode}")
        engine.model.train()
        log_probs = [engine.compute_log_probs(b, 1.0) for b in batches]
        for b in batches:
            engine.backward_minibatch(b, 1.0)
        results[mode] = (engine, log_probs, full_grads(engine))
    eager, on = results["off"], results["on"]
    assert eager[0].compiled_layers == []
    layers = on[0].model.config.num_hidden_layers
    # per decoder layer: input / post-attention norms, q / k norms, the MLP; then the final norm
    assert len(on[0].compiled_layers) == 5 * layers + 1
    assert compiled_count(on[0].compiled_layers) == 5 * layers + 1  # none fell back to eager
    assert counters["stats"]["unique_graphs"] == 6
    for got, want in zip(on[1], eager[1], strict=True):
        assert ((got - want).abs() <= 1e-6 * want.abs().clamp_min(1)).all()
    scale = max(g.abs().max().item() for g in eager[2].values())
    assert_close_dicts(on[2], eager[2], atol=1e-5 * scale)
    # activation checkpointing stops its recomputation by raising through the compiled forward: torch's control flow,
    # which the eager fallback must pass on (retrying it eagerly broke the checkpoint's hooks)
    engine = make_engine(model_path, "actor.compile_layers=on", "model.gradient_checkpointing=true")
    engine.model.train()
    for b in batches:
        engine.backward_minibatch(b, 1.0)
    assert compiled_count(engine.compiled_layers) == 5 * layers + 1
    assert_close_dicts(full_grads(engine), eager[2], atol=1e-5 * scale)


def test_compiled_layers_never_on_npu_and_megatron_refuses_the_key():
    from gspo_ascend.config import load_config
    from gspo_ascend.device import NPU
    from gspo_ascend.engines.compiled_layers import compile_layers

    model = torch.nn.Sequential(plain_model_norm())
    forward = model[0].forward
    assert compile_layers(model, NPU, "on") == [] and model[0].forward == forward
    with pytest.raises(ConfigError, match="actor.compile_layers"):
        load_config(overrides=["actor.engine=megatron", "actor.compile_layers=on"])


def plain_model_norm() -> torch.nn.Module:
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    return Qwen3RMSNorm(8)
