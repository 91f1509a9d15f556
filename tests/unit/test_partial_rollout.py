"""Partial rollout and dynamic sampling (gspo_ascend/partial_rollout.py) against a deterministic fake engine.

The fake engine's response to a prompt is a pure function of the prefix: every next token and whether it is EOS
are hashes of the tokens so far, and the first response token depends on the request seed (so the n samples of a
group differ). A response continued over rounds must therefore equal the response generated in one go, which is
what the property test checks, with the scheduler's invariants, under random lengths, budgets and rewards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import random

import pytest
import torch

from gspo_ascend.config import ConfigError, load_config
from gspo_ascend.engines.base import Request, SampleBatch, SamplingParams, requests_for
from gspo_ascend.partial_rollout import RolloutScheduler

EOS, PAD, VOCAB = 1, 0, 50


def _h(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little")


class FakeEngine:
    """Long-tailed responses: EOS after each token with probability ``stop`` (a hash of the prefix decides)."""

    def __init__(self, stop: float, routes: bool = False) -> None:
        self.stop, self.calls, self.routes = stop, [], routes

    def next_token(self, prefix: tuple[int, ...], seed: int | None) -> int:
        if seed is not None:  # the first token of a fresh sample: the seed tells the n samples apart
            return 2 + _h("first", prefix, seed) % (VOCAB - 3)
        if _h("stop", prefix) % 10_000 < self.stop * 10_000:
            return EOS
        return 2 + _h("tok", prefix) % (VOCAB - 3)

    def one(self, prompt: tuple[int, ...], budget: int, seed: int, fresh: bool) -> list[int]:
        out: list[int] = []
        while len(out) < budget:
            t = self.next_token(prompt + tuple(out), seed if fresh and not out else None)
            out.append(t)
            if t == EOS:
                break
        return out

    def __call__(self, requests: list[Request], params: SamplingParams) -> SampleBatch:
        self.calls.append(list(requests))
        rows = []
        for j, q in enumerate(requests):
            for child in range(q.n):
                # a continuation (n = 1 on a prompt that is not a training prompt) goes on from its prefix
                fresh = q.prompt_ids[-1] == PROMPT_END
                rows.append((j, q, self.one(tuple(q.prompt_ids), q.max_new_tokens, q.seed + child, fresh)))
        r = params.max_new_tokens
        ids = torch.full((len(rows), r), PAD, dtype=torch.long)
        mask, logps = torch.zeros(len(rows), r), torch.zeros(len(rows), r)
        for i, (_, _, toks) in enumerate(rows):
            ids[i, : len(toks)] = torch.tensor(toks)
            mask[i, : len(toks)] = 1
            logps[i, : len(toks)] = -0.5
        # routes, like a real engine's, over every token fed (prompt + response - 1): [t, 0] = the call that fed
        # token t, [t, 1] = t, so a test sees which round each token's route came from and that it lines up
        fed = [len(q.prompt_ids) + len(toks) - 1 for _, q, toks in rows]
        call = len(self.calls) % 256
        routes = [torch.stack([torch.full((n,), call), torch.arange(n) % 256], 1)[:, None].to(torch.uint8) for n in fed]
        return SampleBatch(
            routed_experts=routes if self.routes else None,
            prompt_ids=[list(q.prompt_ids) for _, q, _ in rows],
            response_ids=ids,
            response_mask=mask,
            rollout_log_probs=logps,
            group_index=torch.tensor([j for j, _, _ in rows]),
            finished=torch.tensor([bool(t) and t[-1] == EOS for _, _, t in rows]),
        )


PROMPT_END = 49  # every training prompt ends with this token; a continuation ends with a response token (< 49)


class Sampler:
    def __init__(self, batch: int) -> None:
        self.batch, self.drawn = batch, 0

    def next_batch(self) -> list[int]:
        rows = list(range(self.drawn, self.drawn + self.batch))
        self.drawn += self.batch
        return rows


def prompt_of(row: int) -> list[int]:
    return [2 + row % 40, 3 + row % 7, PROMPT_END]


def null_timer(_name: str):
    return contextlib.nullcontext()


def scheduler(sampler: Sampler, **kw) -> RolloutScheduler:
    args = dict(batch_groups=sampler.batch, n=4, width=32, round_tokens=8, max_rounds=2, extra_groups=None)
    args |= kw
    if args["extra_groups"] is None:
        from gspo_ascend.config import effective_rounds

        args["extra_groups"] = (effective_rounds(args["round_tokens"], args["max_rounds"], args["width"]) - 1) * (
            args["batch_groups"]
        )
    args.setdefault("dynamic", False)
    args.setdefault("max_draws", 10)
    return RolloutScheduler(draw=sampler.next_batch, prompt_of=prompt_of, **args)


def reward_fn(seed: int, flat_share: float):
    def score(batch: SampleBatch, rows: list[int], step: int):
        n = len(batch) // len(rows)
        out = []
        for row in rows:
            if _h("flat", seed, row) % 100 < flat_share * 100:
                out += [float(_h("v", row) % 2)] * n  # all equal: zero variance
            else:
                out += [float(i % 2) for i in range(n)]
        return torch.tensor(out), {"reward/mean": sum(out) / len(out), "reward/errors": 0.0}

    return score


def test_conservation_staleness_and_continuation_under_random_schedules():
    """Every drawn prompt's n samples are trained exactly once (or dropped whole by dynamic sampling), no trained
    token is more than max_rounds - 1 versions old, and a sample continued over rounds is the one-round sample."""
    rng = random.Random(0)
    seen = {"partial/continued_samples": 0.0, "dynamic/dropped_groups": 0.0, "dynamic/bound_hit": 0.0}
    for case in range(60):
        b, n, width = rng.choice([1, 2, 3]), rng.choice([1, 2, 4]), rng.choice([8, 16, 40])
        round_tokens, max_rounds = rng.randint(1, width + 4), rng.randint(1, 4)
        from gspo_ascend.config import effective_rounds

        most = (effective_rounds(round_tokens, max_rounds, width) - 1) * b
        extra, dynamic = rng.randint(0, most), rng.random() < 0.5
        engine, sampler = FakeEngine(stop=rng.choice([0.02, 0.1, 0.3])), Sampler(b)
        s = scheduler(
            sampler,
            n=n,
            width=width,
            round_tokens=round_tokens,
            max_rounds=max_rounds,
            extra_groups=extra,
            dynamic=dynamic,
            max_draws=rng.randint(1, 3),
        )
        score = reward_fn(case, flat_share=rng.choice([0.0, 0.5, 0.9]))
        trained: list[int] = []
        for step in range(1, 9):
            params = SamplingParams(n=n, max_new_tokens=width, seed=1000 * case + step)
            got = s.collect(step, params, engine, score, null_timer)
            assert len(got.indices) == b and len(got.batch) == b * n
            mask = got.batch.response_mask.bool()
            lag = (step - 1 - got.versions)[mask]
            assert lag.numel() == 0 or 0 <= int(lag.min()) and int(lag.max()) <= max_rounds - 1, (case, step)
            assert bool((got.batch.finished | (got.batch.response_lengths == width)).all())  # EOS, or cut at R
            for i, row in enumerate(got.indices):
                for j in range(n):
                    k = i * n + j
                    tokens = got.batch.response_ids[k, : int(mask[k].sum())].tolist()
                    assert tokens and len(tokens) <= width
                    whole = engine.one(tuple(prompt_of(row)) + (tokens[0],), width - 1, 0, fresh=False)
                    assert tokens == [tokens[0], *whole][: len(tokens)], (case, step, row)
                    assert tokens[-1] == EOS or len(tokens) == width
            trained += got.indices
            for key in seen:
                seen[key] += got.metrics[key]
        assert len(trained) == len(set(trained)), case  # no prompt group trained twice
        in_flight = {g.index for g in s.groups} | set(s.queue)
        missing = set(range(sampler.drawn)) - set(trained) - in_flight
        if not dynamic:
            assert not missing, case  # nothing is lost without dynamic sampling
        assert set(trained) | in_flight | missing == set(range(sampler.drawn))
    assert all(v > 0 for v in seen.values()), seen  # the cases reached continuations, drops and the draw bound


def test_one_full_round_is_the_synchronous_rollout():
    """round_tokens >= R, no extra groups, no dynamic sampling: one generate call per step with exactly the
    requests of ``generate(prompts, params)`` (same seeds), and the batch is that call's batch."""
    engine, sampler = FakeEngine(stop=0.1), Sampler(3)
    s = scheduler(sampler, n=4, width=16, round_tokens=16, max_rounds=3)
    assert s.capacity == 3  # one effective round: no extra groups
    for step in (1, 2):
        params = SamplingParams(n=4, max_new_tokens=16, seed=7 + step)
        got = s.collect(step, params, engine, reward_fn(0, 0.0), null_timer)
        prompts = [prompt_of(r) for r in range(3 * (step - 1), 3 * step)]
        assert engine.calls[-1] == requests_for(prompts, params)
        want = engine(requests_for(prompts, params), params)
        for name in ("response_ids", "response_mask", "rollout_log_probs", "group_index", "finished"):
            assert torch.equal(getattr(got.batch, name), getattr(want, name)), name
        assert got.batch.prompt_ids == want.prompt_ids and got.indices == list(range(3 * (step - 1), 3 * step))
        assert got.metrics["partial/rounds"] == 1 and got.metrics["partial/lag_max"] == 0
    assert len(engine.calls) == 4  # two steps, each one call (plus the two reference calls)


def test_steady_state_pipelines_one_round_per_step():
    """max_rounds 2, round R/2, extra = B: after the first step one round per step, continuations forced to finish,
    every trained group one step old."""
    engine, sampler = FakeEngine(stop=0.02), Sampler(2)  # long responses: most are cut at the budget
    s = scheduler(sampler, n=2, width=32, round_tokens=16, max_rounds=2)
    metrics = []
    for step in range(1, 6):
        got = s.collect(step, SamplingParams(n=2, max_new_tokens=32, seed=step), engine, reward_fn(1, 0), null_timer)
        metrics.append(got.metrics)
    assert metrics[0]["partial/rounds"] == 2 and metrics[0]["partial/admitted_groups"] == 4
    for m in metrics[1:]:
        assert m["partial/rounds"] == 1 and m["partial/admitted_groups"] == 2 and m["partial/lag_max"] == 1
    # step 2 trains step 1's groups (both rounds ran in step 1); from step 3 on the trained groups were cut in
    # the previous step and continued in this one
    assert metrics[1]["partial/continued_samples"] == 0
    assert all(m["partial/continued_samples"] > 0 for m in metrics[2:])
    assert max(q.max_new_tokens for call in engine.calls for q in call) == 16  # no round is longer than R/2


def test_dynamic_sampling_replaces_flat_groups_and_says_the_bound_once(capsys):
    engine, sampler = FakeEngine(stop=0.3), Sampler(2)
    s = scheduler(sampler, n=2, width=8, round_tokens=8, max_rounds=1, dynamic=True, max_draws=3)
    got = s.collect(1, SamplingParams(n=2, max_new_tokens=8, seed=1), engine, reward_fn(3, 0.5), null_timer)
    flat = {r for r in range(sampler.drawn) if _h("flat", 3, r) % 100 < 50}
    assert not set(got.indices) & flat and got.metrics["dynamic/dropped_groups"] >= 1
    assert got.metrics["dynamic/bound_hit"] == 0
    # every group flat: two replacement batches, then the batch is filled with dropped groups, said once
    for step in (2, 3):
        got = s.collect(step, SamplingParams(n=2, max_new_tokens=8, seed=step), engine, reward_fn(4, 1.0), null_timer)
        assert got.metrics["dynamic/bound_hit"] == 1 and len(got.indices) == 2
    err = capsys.readouterr().err
    assert err.count("warning: dynamic sampling:") == 1 and "dynamic_sampling.max_draws" in err


def test_state_round_trip_continues_identically():
    engine = FakeEngine(stop=0.05)
    a_sampler, b_sampler = Sampler(2), Sampler(2)
    a, b = scheduler(a_sampler), scheduler(b_sampler)

    def run(s, step):
        params = SamplingParams(n=4, max_new_tokens=32, seed=step)
        return s.collect(step, params, engine, reward_fn(5, 0.3), null_timer)

    for step in (1, 2):
        run(a, step), run(b, step)
    assert any(not x.finished for g in a.groups for x in g.samples)  # the buffer is not empty
    c_sampler = Sampler(2)
    c_sampler.drawn = b_sampler.drawn
    c = scheduler(c_sampler)
    c.load_state_dict(torch.load(_saved(b.state_dict()), weights_only=True))
    for step in (3, 4):
        x, y = run(a, step), run(c, step)
        assert x.indices == y.indices and torch.equal(x.batch.response_ids, y.batch.response_ids)
        assert torch.equal(x.versions, y.versions) and x.metrics == y.metrics


def test_each_token_keeps_the_route_of_the_round_that_first_fed_it_through_a_checkpoint():
    """Partial rollout's continuation re-feeds the earlier tokens: they keep the earlier round's routes, the new ones
    come from the continuation, and the buffer saved and loaded keeps them (a dropped segment fails here)."""
    engine, sampler = FakeEngine(stop=0.05, routes=True), Sampler(2)
    s = scheduler(sampler)
    params = SamplingParams(n=4, max_new_tokens=32, seed=1)
    s.collect(1, params, engine, reward_fn(5, 0.3), null_timer)
    restored = scheduler(Sampler(2))
    restored.load_state_dict(torch.load(_saved(s.state_dict()), weights_only=True))
    continued = 0
    for sched in (s, restored):
        got = sched.collect(2, dataclasses.replace(params, seed=2), engine, reward_fn(5, 0.3), null_timer)
        for i, routes in enumerate(got.batch.routed_experts):
            p, n = len(got.batch.prompt_ids[i]), int(got.batch.response_lengths[i])
            assert routes.shape[0] == p + n - 1 and torch.equal(routes[:, 0, 1].long(), torch.arange(p + n - 1) % 256)
            first = int(routes[0, 0, 0])  # the round that admitted the sample fed its prompt
            rounds = routes[:, 0, 0].long()
            switch = int((rounds != first).nonzero()[0]) if bool((rounds != first).any()) else None
            if switch is not None:  # a continuation: its routes start where the earlier round's end
                continued += 1
                assert switch >= p and bool((rounds[switch:] == rounds[switch]).all())
    assert continued > 0


def _saved(state):
    import io

    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return buf


def test_behavior_weights_by_hand():
    from gspo_ascend.algorithms.behavior import behavior_weights

    prox = torch.tensor([[-1.0, -2.0, -3.0, 0.0], [-1.0, -1.0, 0.0, 0.0], [-0.5, -0.5, -0.5, -0.5]])
    mu = torch.tensor([[-1.5, -2.0, -2.0, 9.0], [-1.0, -0.2, 0.0, 0.0], [-4.5, -4.5, -4.5, -4.5]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.float32)
    stale = torch.tensor([[1, 1, 0, 1], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    w, m = behavior_weights(prox, mu, stale, mask, cap=2.0)
    # row 0: stale tokens 0, 1 (token 3 is padding): (0.5 + 0) / 3 tokens; row 1: no stale token; row 2: 4.0 > cap
    assert torch.allclose(w, torch.tensor([torch.exp(torch.tensor(0.5 / 3)).item(), 1.0, 2.0]))
    assert m["behavior/capped_frac"] == 0.5 and m["behavior/weight_max"] == 2.0
    assert m["behavior/weight_mean"] == pytest.approx((torch.exp(torch.tensor(0.5 / 3)).item() + 2.0) / 2)
    w0 = math.exp(0.5 / 3)  # the ESS share of the two weighted rows: (w0 + 2)^2 / (2 (w0^2 + 4))
    assert m["behavior/ess"] == pytest.approx((w0 + 2) ** 2 / (2 * (w0**2 + 4)))
    # k3 = e^d - 1 - d over the 6 stale, unpadded tokens: d = 0.5, 0 (row 0) and 4 x 4.0 (row 2)
    k3 = [math.expm1(d) - d for d in (0.5, 0.0, 4.0, 4.0, 4.0, 4.0)]
    assert m["behavior/kl_k3"] == pytest.approx(sum(k3) / 6)


def test_behavior_metrics_without_a_stale_sample():
    from gspo_ascend.algorithms.behavior import behavior_weights

    lp = torch.tensor([[-1.0, -2.0]])
    w, m = behavior_weights(lp, lp - 1, torch.zeros(1, 2, dtype=torch.bool), torch.ones(1, 2), cap=2.0)
    assert w.tolist() == [1.0]
    assert m == {
        "behavior/weight_mean": 1.0,
        "behavior/weight_max": 1.0,
        "behavior/capped_frac": 0.0,
        "behavior/ess": 1.0,
        "behavior/kl_k3": 0.0,
    }


def test_weight_on_the_advantage_is_the_weight_on_the_loss():
    """w_i > 0 per sequence: the loss with A_i * w_i equals w_i times the per-sequence loss, for every loss."""
    from gspo_ascend.algorithms import get_policy_loss

    g = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 6, generator=g) - 0.1
    new = (old + 0.01 * torch.randn(4, 6, generator=g)).requires_grad_()
    mask = torch.ones(4, 6)
    adv, w = torch.tensor([1.0, -1.0, 0.5, -2.0]), torch.tensor([0.5, 1.7, 2.0, 1.0])
    for name in ("gspo", "gspo_token", "grpo"):
        loss_fn = get_policy_loss(name)
        kw = dict(clip_low=3e-4, clip_high=4e-4, clip_ratio_c=3.0, agg_mode="seq-mean-token-mean")
        weighted, _ = loss_fn(new, old, adv * w, mask, **kw)
        per_seq = torch.stack(
            [loss_fn(new[i : i + 1], old[i : i + 1], adv[i : i + 1], mask[i : i + 1], **kw)[0] for i in range(4)]
        )
        assert torch.allclose(weighted, (per_seq * w).mean(), atol=1e-7), name


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["partial_rollout.max_rounds=3"], "partial_rollout.max_rounds"),
        (["dynamic_sampling.max_draws=3"], "dynamic_sampling.max_draws"),
        (["partial_rollout.round_tokens=32", "partial_rollout.extra_groups=17"], "partial_rollout.extra_groups"),
        (["partial_rollout.round_tokens=0"], "partial_rollout.round_tokens"),
        (
            [
                "partial_rollout.round_tokens=32",
                "algorithm.behavior_correction=seq_tis",
                "algorithm.old_logprobs=engine",
            ],
            "algorithm.behavior_correction",
        ),
        (["algorithm.behavior_cap=3"], "algorithm.behavior_cap"),  # nothing is stale without partial rollout
        (["rollout_pool.max_staleness=0"], "rollout_pool.max_staleness"),  # no pool
        (["rollout_pool.devices_per_node=1", "rollout_pool.max_staleness=-1"], "rollout_pool.max_staleness"),
        (  # rounds run one step ahead at most (schedules/rounds_ahead.py)
            ["rollout_pool.devices_per_node=1", "rollout_pool.max_staleness=2", "partial_rollout.round_tokens=32"],
            "partial_rollout.round_tokens",
        ),
        (
            ["rollout_pool.devices_per_node=1", "rollout_pool.max_staleness=2", "dynamic_sampling.enabled=true"],
            "dynamic_sampling.enabled",
        ),
    ],
)
def test_config_refuses_inert_or_unsafe_keys(overrides, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert key in str(err.value) and "\n" not in str(err.value)


def test_config_extra_groups_default_is_the_bound():
    from gspo_ascend.config import behavior_correction, max_extra_groups

    cfg = load_config(None, ["partial_rollout.round_tokens=32", "data.max_response_length=64"])
    assert max_extra_groups(cfg) == cfg.data.train_batch_size  # 2 rounds: one batch of extra groups
    assert behavior_correction(cfg) == "seq_tis"
    cfg = load_config(None, ["partial_rollout.round_tokens=64", "algorithm.old_logprobs=engine"])
    assert max_extra_groups(cfg) == 0 and behavior_correction(cfg) == "none"


def test_worker_group_cuts_requests_into_one_run_per_rollout_group():
    """Four ranks at rollout TP 2: two groups, each rank of a group gets its group's run of requests, about
    equal samples each; the joined batch is the one-engine batch (request order, group_index = request)."""
    from types import SimpleNamespace

    from gspo_ascend.workers import WorkerGroup, balanced_runs

    assert balanced_runs([8, 1, 1, 1, 1, 8], 2) == [(0, 3), (3, 6)]  # 10 + 10 samples
    assert balanced_runs([1], 3) == [(0, 0), (0, 1), (1, 1)]  # a group may get nothing
    engine, seen = FakeEngine(stop=0.1), {}
    group = object.__new__(WorkerGroup)
    group.cfg = load_config(
        None, ["rollout.engine=vllm", "rollout.tensor_parallel_size=2", "trainer.devices_per_node=4"]
    )
    group.world_size, group._get = 4, list

    def worker(rank):
        def remote(requests, params):
            seen[rank] = list(requests)
            return engine(list(requests), params)

        return SimpleNamespace(generate_requests=SimpleNamespace(remote=remote))

    group.workers = [worker(r) for r in range(4)]
    requests = [Request(tuple(prompt_of(i)), n, 8, 100 + i) for i, n in enumerate([4, 1, 1, 4, 2, 1])]
    params = SamplingParams(n=4, max_new_tokens=8)
    got, want = group.generate_requests(requests, params), engine(requests, params)
    assert seen[0] == seen[1] and seen[2] == seen[3] and seen[0] + seen[2] == requests
    assert len(seen[0]) == 3  # 6 of 13 samples in the first run, 7 in the second
    for name in ("response_ids", "group_index", "finished"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name


def test_rounds_one_step_ahead_stamp_the_pool_version_and_count_lags_from_the_trainer():
    """schedules/rounds_ahead.py runs step k's rounds with the rollout pool one version behind the trainer: the tokens
    carry the pool's version (``version=``), the lags are counted from step - 1 (the version that trains them), so
    every token is at least one version old and none more than 1 + max_rounds - 1."""
    sampler, engine = Sampler(2), FakeEngine(stop=0.05)
    s = scheduler(sampler, round_tokens=4, max_rounds=3)
    stamped: set[int] = set()
    for step in range(1, 7):
        pool = max(step - 2, 0)  # one step off: the weights of the update before last (step 1: the initial ones)
        params = SamplingParams(n=4, max_new_tokens=32, seed=step)
        got = s.collect(step, params, engine, reward_fn(7, 0.0), null_timer, version=pool)
        mask = got.batch.response_mask.bool()
        lags = (step - 1) - got.versions[mask]
        assert int(got.versions[mask].max()) <= pool  # nothing newer than the pool's weights
        assert int(lags.min()) >= (1 if step > 1 else 0) and int(lags.max()) <= 1 + 3 - 1
        stamped.update(got.versions[mask].tolist())
        assert got.metrics["partial/lag_max"] == float(lags.max())
        assert got.metrics["partial/lag_mean"] == pytest.approx(float(lags.float().mean()))
    assert stamped == {0, 1, 2, 3, 4}  # steps 1-6 ran on pool versions 0, 0, 1, 2, 3, 4


@pytest.mark.parametrize(
    "overrides, said",
    [
        (["partial_rollout.round_tokens=16", "algorithm.old_logprobs=engine"], True),
        (["rollout_pool.devices_per_node=1", "algorithm.old_logprobs=engine"], True),  # one step off by default
        (["partial_rollout.round_tokens=16", "algorithm.old_logprobs=engine", "algorithm.loss=gspo_token"], True),
        (["partial_rollout.round_tokens=16", "algorithm.old_logprobs=engine", "algorithm.loss=grpo"], False),
        (["partial_rollout.round_tokens=16"], False),  # recompute: corrected
        (["algorithm.old_logprobs=engine"], False),  # nothing stale
        (["rollout.weights_lag=2", "algorithm.old_logprobs=engine"], False),  # the study asks for it
    ],
)
def test_the_stale_pi_old_note_is_said_once_for_gspo_only(overrides, said, capsys):
    from gspo_ascend.trainer import stale_pi_old_note

    stale_pi_old_note(load_config(None, overrides))
    err = capsys.readouterr().err
    assert (err.count("\n") == 1 and "50-55% of sequences" in err) if said else err == ""
