"""The rollout schedules' rhythm (gspo_ascend/schedules/, issue #44), driven through trainer.train_step with
stand-in workers (test-only, below: they record calls and keep weight versions; no engine, no Ray) and a stand-in
scorer. Expected sequences are derived by hand from each schedule's docstring; the e2e tests hold the same schedules
bitwise against real runs (tests/e2e/test_disaggregated_e2e.py, test_partial_rollout_e2e.py, test_weights_lag_e2e.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from gspo_ascend import trainer, validation
from gspo_ascend.config import load_config
from gspo_ascend.data.sampler import PromptSampler
from gspo_ascend.engines.base import SampleBatch, requests_for
from gspo_ascend.schedules import base as schedules_base
from gspo_ascend.schedules import build_schedule


class Workers:
    """Stand-in workers: every response is 3 tokens of log-prob -1; ``version`` counts updates, the rollout side
    holds ``rollout_version`` (what the last sync sent)."""

    def __init__(self, events: list) -> None:
        self.events, self.version, self.rollout_version = events, 0, 0

    def _batch(self, requests, params) -> SampleBatch:
        rows = [j for j, q in enumerate(requests) for _ in range(q.n)]
        width = params.max_new_tokens
        mask = torch.zeros(len(rows), width)
        mask[:, :3] = 1.0
        ids, done = torch.ones(len(rows), width).long(), torch.ones(len(rows)).bool()
        prompts = [list(requests[j].prompt_ids) for j in rows]
        return SampleBatch(prompts, ids, mask, rollout_log_probs=-mask, group_index=torch.tensor(rows), finished=done)

    def generate(self, prompts, params):
        self.events.append(("generate", self.rollout_version))
        return self._batch(requests_for(prompts, params), params)

    def submit(self, prompts, params):
        self.events.append(("submit", self.rollout_version))
        done = self._batch(requests_for(prompts, params), params)
        return SimpleNamespace(result=lambda: done)

    def sync_weights(self):
        self.events.append(("sync", self.version))
        self.rollout_version = self.version
        return {"sync/time_s": 0.5}

    def show_weights(self, which):
        self.events.append(("show", which))

    def compute_log_probs(self, batch, temperature):
        return -batch.response_mask

    def update(self, batch, temperature, minibatches):
        self.events.append(("update", self.version))
        self.version += 1
        return {}


@pytest.fixture
def make_run(monkeypatch):
    def stub_score(run, batch, prompts, step):
        return torch.arange(len(batch), dtype=torch.float32) % 2, {}

    for module in ("synchronous", "pool"):
        monkeypatch.setattr(f"gspo_ascend.schedules.{module}.score", stub_score)
    monkeypatch.setattr(validation, "validate", lambda run, step: run.workers.events.append(("validate",)) or {})
    assert schedules_base.score is not stub_score  # the stand-in is where the schedules look, not in base

    def make(*overrides: str, validate_every: int = 0):
        base = ["data.train_batch_size=2", "rollout.n=2", "algorithm.minibatches_per_rollout=1"]
        cfg = load_config(None, [*base, f"trainer.test_freq={validate_every}", "trainer.total_steps=6", *overrides])
        events: list = []
        run = SimpleNamespace(
            cfg=cfg, workers=Workers(events), resume_from=None, val_set=object() if validate_every else None,
            dataset=[SimpleNamespace(prompt_ids=[5, i]) for i in range(8)], sampler=PromptSampler(8, 2, seed=0),
            logger=SimpleNamespace(log=lambda step, metrics: None),
        )  # fmt: skip
        run.schedule = build_schedule(run)
        return run, events

    return make


def test_synchronous_syncs_after_every_update(make_run):
    run, events = make_run()
    for step in (1, 2, 3):
        trainer.train_step(run, step)
    assert events == [("generate", 0), ("update", 0), ("sync", 1), ("generate", 1), ("update", 1), ("sync", 2),
                      ("generate", 2), ("update", 2), ("sync", 3)]  # fmt: skip


def test_a_pool_two_ahead_syncs_when_its_queue_empties_and_lags_zero_to_two(make_run):
    run, events = make_run("rollout_pool.devices_per_node=1", "rollout_pool.max_staleness=2")
    lags = [trainer.train_step(run, step)["async/staleness"] for step in range(1, 7)]
    assert lags == [0.0, 1.0, 2.0, 1.0, 2.0, 1.0]
    syncs = [e for e in events if e[0] in ("sync", "submit")]
    # step 1: batch 1 now, the pool already holds version 0 (no sync), batches 2-3 submitted; step 3: version 2 sent,
    # batches 4-5; step 5: version 4 sent, batch 6 (the last step)
    assert syncs == [("submit", 0), ("submit", 0), ("submit", 0), ("sync", 2), ("submit", 2), ("submit", 2),
                     ("sync", 4), ("submit", 4)]  # fmt: skip


def test_a_pool_in_step_is_the_synchronous_order(make_run):
    run, events = make_run("rollout_pool.devices_per_node=1", "rollout_pool.max_staleness=0")
    lags = [trainer.train_step(run, step)["async/staleness"] for step in (1, 2, 3)]
    assert lags == [0.0, 0.0, 0.0]
    assert events == [("submit", 0), ("update", 0), ("sync", 1), ("submit", 1), ("update", 1), ("sync", 2),
                      ("submit", 2), ("update", 2), ("sync", 3), ("submit", 3)]  # fmt: skip


def test_a_pool_ahead_syncs_before_a_validation(make_run):
    run, events = make_run("rollout_pool.devices_per_node=1", "rollout_pool.max_staleness=1", validate_every=2)
    metrics = [trainer.train_step(run, step) for step in (1, 2)]
    assert "sync/extra_s" not in metrics[0] and metrics[1]["sync/extra_s"] == 0.5
    assert events[-3:] == [("update", 1), ("sync", 2), ("validate",)]


def test_the_lag_wrapper_stamps_old_versions_and_validates_the_current_weights(make_run):
    run, events = make_run("rollout.weights_lag=2", "algorithm.old_logprobs=recompute", validate_every=3)
    lags = [trainer.train_step(run, step)["async/staleness"] for step in (1, 2, 3, 4)]
    assert lags == [0.0, 1.0, 2.0, 2.0]  # version max(0, step - 1 - 2)
    at_3 = events[events.index(("update", 2)) :]
    assert at_3[:5] == [("update", 2), ("sync", 3), ("show", "current"), ("validate",), ("show", "lagged")]
