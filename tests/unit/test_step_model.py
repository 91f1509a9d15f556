"""benchmarks/step_model.py: the discrete-event step-time model against hand-derived values (closed forms, a
two-replica toy, a partial-rollout toy, an obvious split). No timing assertions: every time here is simulated."""

from __future__ import annotations

import math

import pytest

from tests.conftest import REPO, script_module

SCRIPT = REPO / "benchmarks" / "step_model.py"


@pytest.fixture(scope="module")
def sm():
    with script_module(SCRIPT, "step_model") as module:
        yield module


def toy(sm, **kw):
    """Constant lengths, a throughput that does not depend on concurrency (50 tokens/s per replica), no prompt."""
    base = dict(
        name="toy", prompts_per_step=4, group_size=2, prompt_tokens=0.0, max_response=100, decode_batch=(1, 1000),
        decode_tps=(50.0, 50.0), prefill_tps=math.inf, train_tps=100.0, old_logprob_tps=math.inf, weight_bytes=0.0,
        sync_gbps=1.0, colocated_sync_gbps=1.0, total_devices=2, rollout_tp=1, max_concurrency=1000,
        max_concurrency_disagg=1000, length_samples=(100,),
    )  # fmt: skip
    base.update(kw)
    return sm.Inputs(**base)


def test_replica_toy_by_hand(sm):
    # 10 tokens/s alone, 16 at two: a step takes 0.1 s at concurrency 1 and 0.125 s at 2
    inp = toy(sm, decode_batch=(1, 2), decode_tps=(10.0, 16.0), prefill_tps=100.0)
    dec = sm.np.array([4, 2, 3, 1])
    zero = sm.np.zeros(4)
    # replica A serves 4 and 2: 2 steps at two (0.25 s), then 2 steps alone (0.2 s); B serves 3 and 1: 1 step at
    # two (0.125 s), then 2 alone (0.2 s)
    assert sm.round_time(inp, dec, zero, replicas=2, cap=2) == pytest.approx([0.45, 0.325])
    # one sequence at a time: A runs 4 + 2 steps alone; a prefill of 10 tokens at 100 tokens/s adds 0.1 s
    assert sm.replica_time(inp, dec[:2], zero[:2], cap=1) == pytest.approx(0.6)
    assert sm.replica_time(inp, dec[:2], sm.np.array([10.0, 0.0]), cap=2) == pytest.approx(0.55)
    # the slowest replica ends the round; the imbalance is the others' wait
    assert sm.replica_time(inp, dec[2:], zero[2:], cap=2) == pytest.approx(0.325)


def test_colocated_closed_form(sm):
    # B n = 8 samples of 100 tokens over 2 replicas: 400 tokens each at 50 tokens/s = 8 s; 800 trained tokens at
    # 100 tokens/s x 2 devices = 4 s, old log-probs at 400 x 2 = 1 s; sync 1 GB at 2 GB/s + switch 0.25 s
    inp = toy(sm, old_logprob_tps=400.0, weight_bytes=1e9, colocated_sync_gbps=2.0, colocated_switch_s=0.25)
    s = sm.simulate(inp, "colocated", 2, 2, steps=5)
    for r in s.steps:
        assert (r.gen_s, r.train_s, r.sync_s) == pytest.approx((8.0, 5.0, 0.75))
        assert r.wall_s == pytest.approx(r.gen_s + r.train_s + r.sync_s) and r.wall_s == pytest.approx(13.75)
    assert s.step_s == pytest.approx(13.75) and s.replica_idle == 0.0


def test_one_step_off_closed_form_rollout_bound(sm):
    # one replica: 800 tokens at 50 tokens/s = 16 s; train 800 / 100 = 8 s; transfer 1 GB at 4 GB/s = 0.25 s,
    # trainer-side export 0.5 s, rollout-side load 0.1 s: step = max(16 + 0.35, 8 + 0.75) = 16.35
    inp = toy(sm, weight_bytes=1e9, sync_gbps=4.0, sync_trainer_extra_s=0.5, sync_rollout_extra_s=0.1)
    s = sm.simulate(inp, "one-step-off", 1, 1, steps=6)
    for r in s.steps:
        assert (r.gen_s, r.train_s, r.sync_s, r.wall_s) == pytest.approx((16.0, 8.0, 0.25, 16.35))
        assert (r.trainer_idle_s, r.rollout_idle_s) == pytest.approx((16.35 - 8.75, 0.0))
    assert s.trainer_idle == pytest.approx(7.6 / 16.35) and s.rollout_idle == pytest.approx(0.0)


def test_one_step_off_closed_form_trainer_bound(sm):
    # train 800 / 25 = 32 s > gen 16 s: step = 32 + 0.25 + 0.5; the rollout pool waits
    inp = toy(sm, train_tps=25.0, weight_bytes=1e9, sync_gbps=4.0, sync_trainer_extra_s=0.5)
    s = sm.simulate(inp, "one-step-off", 1, 1, steps=4)
    assert s.step_s == pytest.approx(32.75)
    assert s.rollout_idle == pytest.approx((32.75 - 16.25) / 32.75) and s.trainer_idle == pytest.approx(0.0)


def test_partial_round_at_least_the_limit_is_synchronous(sm):
    # long-tailed random lengths, concurrency-dependent throughput, a KV cap and prefill: one full round with no
    # extra groups draws and generates exactly what the synchronous step does, time for time
    inp = toy(
        sm, prompts_per_step=8, max_response=512, length_samples=(), length_median=77, length_sigma=0.8,
        decode_batch=(1, 8, 64), decode_tps=(20.0, 150.0, 800.0), prefill_tps=5000.0, prompt_tokens=30.0,
        max_concurrency=12, max_concurrency_disagg=12,
    )  # fmt: skip
    for schedule, r, t in (("colocated", 2, 2), ("one-step-off", 1, 1)):
        sync = sm.simulate(inp, schedule, r, t, steps=8, seed=3)
        part = sm.simulate(inp.with_partial(512, extra_groups=0), schedule, r, t, steps=8, seed=3)
        assert [x.wall_s for x in part.steps] == [x.wall_s for x in sync.steps]
        assert part.partial and not sync.partial and part.rounds == 1.0


def test_partial_rounds_by_hand(sm):
    # B = 1 group of 2 samples of 100 tokens, round 60, max_rounds 2, one extra group; one replica at 50 tokens/s
    # (any concurrency), continuations re-prefill their 60 tokens at 60 tokens/s, prompts are empty
    inp = toy(sm, prompts_per_step=1, prefill_tps=60.0).with_partial(60)
    gen = sm.Generator(inp, replicas=1, cap=100, rng=sm.np.random.default_rng(0))
    first, second, third = gen.step(), gen.step(), gen.step()
    # step 1: two groups admitted; round 1: 4 x 60 tokens (4.8 s); the oldest group is unfinished, so round 2,
    # its last: 4 x 40 tokens (3.2 s) after re-prefilling 4 x 60 tokens (4 s)
    assert (first.gen_s, first.rounds, first.trained_tokens) == pytest.approx((12.0, 2, 200.0))
    # step 2: group 2 finished already; one round for the new group 3: 2 x 60 tokens
    assert (second.gen_s, second.rounds) == pytest.approx((2.4, 1))
    # step 3 (steady state): group 3's last 2 x 40 (+ 2 x 60 re-prefilled: 2 s) and group 4's first 2 x 60
    assert (third.gen_s, third.rounds) == pytest.approx((6.0, 1))


def test_recommend_split_obvious(sm):
    # gen is 800 token-s of one replica (16 s), train 800 / 50 = 16 device-s: on 4 devices 2:2 balances (8 s each)
    inp = toy(sm, train_tps=50.0, total_devices=4)
    rec = sm.recommend_split(inp, steps=4, partial=False)
    assert (rec.rollout_devices, rec.trainer_devices, rec.partial) == (2, 2, False)
    assert rec.step_s == pytest.approx(8.0) and rec.trainer_idle == pytest.approx(0.0)
    assert rec.colocated_step_s == pytest.approx(8.0) and rec.speedup == pytest.approx(1.0)
    # a trainer that needs 3 devices leaves one replica: 1:3, rollout-bound (16 s against 16 / 3)
    rec = sm.recommend_split(toy(sm, train_tps=50.0, total_devices=4, min_trainer_devices=3), steps=4, partial=False)
    assert (rec.rollout_devices, rec.trainer_devices) == (1, 3) and rec.step_s == pytest.approx(16.0)
    assert rec.trainer_idle == pytest.approx(1 - (16 / 3) / 16)
    with pytest.raises(ValueError, match="no split"):
        sm.recommend_split(toy(sm, total_devices=4, min_trainer_devices=4), steps=2)


def test_lognormal_fit_and_roofline(sm):
    sigma = sm.fit_sigma(77, 105, 512)
    assert sm.clipped_lognormal_mean(77, sigma, 512) == pytest.approx(105, rel=1e-6)
    assert sm.clipped_lognormal_mean(77, 1e-9, 512) == pytest.approx(77, rel=1e-6)  # no spread: the median
    # one dense replica: 1 GB of weights at 1 TB/s = 1 ms per step, no KV, no overhead: b tokens per ms
    tps = sm.roofline_decode(
        (1, 4), dense_bytes=1e9, kv_bytes_per_token=0, context=0, hbm_bytes_s=1e12, flops_per_token=0, flops_s=1,
        overhead_s=0,
    )  # fmt: skip
    assert tps == pytest.approx((1000.0, 4000.0))
    # MoE: one token touches top_k / experts of the expert weights, many tokens nearly all of them
    one, many = sm.roofline_decode(
        (1, 10_000), dense_bytes=0, expert_bytes=1e9, experts=128, top_k=8, kv_bytes_per_token=0, context=0,
        hbm_bytes_s=1e12, flops_per_token=0, flops_s=1, overhead_s=0,
    )  # fmt: skip
    assert one == pytest.approx(1 / (1e9 * 8 / 128 / 1e12)) and many == pytest.approx(10_000 / 1e-3)


def test_measurements_and_presets_run(sm, capsys):
    rows = sm.simulate_from_measurements(
        steps=4, prompts_per_step=4, group_size=2, prompt_tokens=10, max_response=64, lengths=(10, 20, 64),
        decode_fixed_s=0.01, decode_per_seq_s=0.001, prefill_tps=1000.0, update_s=2.0, update_tokens=500,
        sync_s=0.3, total_devices=2,
    )  # fmt: skip
    assert [(s.schedule, s.partial) for s in rows] == [
        ("colocated", False), ("one-step-off", False), ("colocated", True), ("one-step-off", True),
    ]  # fmt: skip
    assert all(s.step_s > 0 and s.sync_s == pytest.approx(0.3) for s in rows)
    for name in sm.PRESETS:
        inp = sm.PRESETS[name]()
        assert {"prompts_per_step", "lengths", "decode", "train_tps", "sync_gbps"} <= set(inp.sources)
    assert sm.main(["--preset", "realistic-cpu", "--steps", "4"]) == 0
    out = capsys.readouterr().out
    assert "a model, not a measurement" in out and "recommendation:" in out and "source:" in out
