"""``rollout.weights_lag`` end to end (staleness studies, issue #31): the tiny model through Ray, every batch from
the weights of exactly ``lag`` updates ago (the first ones from the initial weights), the behaviour correction on
the stale samples, validation on the trained weights; a resume is refused in one line (a checkpoint holds no older
weights)."""

from __future__ import annotations

import subprocess

import pytest

from tests.conftest import REPO
from tests.e2e.test_train_e2e import read_metrics, train_cmd

pytestmark = pytest.mark.slow

SMALL = ("data.train_batch_size=4", "rollout.n=4", "trainer.loggers=[jsonl]", "actor.lr=2e-4")


def test_every_batch_is_exactly_lag_versions_old_and_a_resume_is_refused(tmp_path):
    out = tmp_path / "run"
    run = (*SMALL, "rollout.weights_lag=2", "trainer.total_steps=4", "trainer.test_freq=2", "trainer.save_freq=2")
    proc = subprocess.run(train_cmd(out, *run), capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [r for r in read_metrics(out) if r["step"] >= 1]
    assert [r["async/staleness"] for r in steps] == [0, 1, 2, 2]
    assert steps[0]["behavior/weight_max"] == 1.0  # batch 1: the current (initial) weights, nothing to correct
    assert all(r["behavior/weight_mean"] != 1.0 for r in steps[1:])
    assert all("val/all/mean@1" in r for r in steps if r["step"] in (2, 4))
    again = subprocess.run(
        train_cmd(out, *run[:-3], "trainer.total_steps=6", "trainer.test_freq=2", "trainer.save_freq=2"),
        capture_output=True, text=True, cwd=REPO, timeout=600,
    )  # fmt: skip
    assert again.returncode == 2
    last = again.stderr.strip().splitlines()[-1]
    assert last.startswith("error: rollout.weights_lag=2: a checkpoint holds no older weights"), again.stderr[-2000:]
