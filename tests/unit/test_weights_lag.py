"""``rollout.weights_lag`` (staleness studies, issue #31): the rollout engine generates with the weights of exactly
``lag`` updates ago. The worker's history with stand-in engines whose weights are their version number: after
update k the rollout engine holds version max(0, k - lag); validation shows the current version, then the lagged
one again. The config refuses it where it is not exact (pools, partial rollout, dynamic sampling) in one line."""

from __future__ import annotations

import pytest
import torch

from gspo_ascend.config import ConfigError, load_config, to_dict
from gspo_ascend.workers import PolicyWorker


class _Train:
    """A stand-in train engine: one weight whose value is the number of updates so far."""

    def __init__(self) -> None:
        self.version = 0

    def export_weights(self):
        yield "w", torch.tensor([float(self.version)])


class _Rollout:
    def __init__(self) -> None:
        self.holds = 0.0

    def update_weights(self, named):
        for _, tensor in named:
            self.holds = float(tensor)
        return 4

    def sleep(self) -> None:
        pass


@pytest.mark.parametrize("lag", [1, 2, 4])
def test_the_rollout_engine_holds_exactly_the_weights_of_lag_updates_ago(lag):
    worker = PolicyWorker(to_dict(load_config(None, [f"rollout.weights_lag={lag}"])), "", 0, 1, 1)
    worker.train_engine, worker.rollout_engine = _Train(), _Rollout()
    worker.start_history()
    for k in range(1, 9):
        worker.train_engine.version = k  # update k
        worker.sync_weights()
        assert worker.rollout_engine.holds == max(0, k - lag), (k, lag)
        worker.show_weights("current")  # a validation step: the trained weights
        assert worker.rollout_engine.holds == k
        worker.show_weights("lagged")
        assert worker.rollout_engine.holds == max(0, k - lag)
    assert len(worker._history) == lag + 1  # the host copies kept: lag + 1 versions, no more


@pytest.mark.parametrize(
    "overrides",
    [
        ["rollout.weights_lag=-1"],
        ["rollout.weights_lag=2", "rollout_pool.devices_per_node=1", "rollout_pool.max_staleness=0"],
        ["rollout.weights_lag=2", "partial_rollout.round_tokens=16"],
        ["rollout.weights_lag=2", "dynamic_sampling.enabled=true"],
    ],
)
def test_weights_lag_is_refused_where_it_would_not_be_exact(overrides):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert "rollout.weights_lag" in str(err.value) and "\n" not in str(err.value)
