"""Partial rollout and dynamic sampling end to end, through the CLI and Ray on CPU (tiny model, hf rollout).

- One round (``partial_rollout.round_tokens`` >= ``data.max_response_length``), no dynamic sampling: the run is
  today's synchronous run, bitwise (every metric the synchronous run logs, and the final weights).
- Two steps, then a resume for two more, with unfinished samples in flight and dynamic sampling on: equal to the
  four-step run (trajectory and final weights), and the checkpoint holds the buffer.
"""

from __future__ import annotations

import subprocess

import pytest
import torch

from tests.conftest import REPO
from tests.e2e.test_train_e2e import final_weights, read_metrics, train_cmd, trajectory

pytestmark = pytest.mark.slow

SMALL = ("data.train_batch_size=4", "rollout.n=4", "trainer.loggers=[jsonl]", "actor.lr=2e-4", "trainer.test_freq=0")


def _train(out, *overrides: str) -> list[dict]:
    proc = subprocess.run(train_cmd(out, *SMALL, *overrides), capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_metrics(out)


def test_one_full_round_is_the_synchronous_run(tmp_path):
    plain = trajectory(_train(tmp_path / "plain", "trainer.total_steps=3"))
    rounds = trajectory(_train(tmp_path / "partial", "trainer.total_steps=3", "partial_rollout.round_tokens=64"))
    assert len(plain) == len(rounds)
    for a, b in zip(plain, rounds, strict=True):
        assert {k: b[k] for k in a} == a  # every synchronous metric, bitwise
    assert rounds[-1]["partial/rounds"] == 1 and rounds[-1]["partial/lag_max"] == 0
    want, got = final_weights(tmp_path / "plain"), final_weights(tmp_path / "partial")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_resume_with_samples_in_flight_equals_the_uninterrupted_run(tmp_path):
    # 4-token rounds, up to 8 of them: the tiny model's ~14-token answers span rounds and steps and end by EOS in
    # different rounds (with 4 rounds, a box whose tiny model answers at 16+ tokens cut every sample at the budget
    # in the same round, so no group was in flight at the checkpoint)
    common = (
        "partial_rollout.round_tokens=4",
        "partial_rollout.max_rounds=8",
        "dynamic_sampling.enabled=true",
        "trainer.save_freq=2",
    )
    whole = trajectory(_train(tmp_path / "whole", *common, "trainer.total_steps=4"))
    _train(tmp_path / "cut", *common, "trainer.total_steps=2")
    buffer = torch.load(tmp_path / "cut" / "checkpoints" / "step_00000002" / "rollout_buffer.pt", weights_only=True)
    unfinished = [s for g in buffer["groups"] for s in g["samples"] if s["rounds"] and not s["finished"]]
    assert unfinished, "the checkpoint must hold samples cut at their round budget"
    resumed = trajectory(_train(tmp_path / "cut", *common, "trainer.total_steps=4"))
    assert resumed == whole
    assert any(r.get("partial/continued_samples", 0) > 0 for r in whole)
    assert all(r.get("partial/lag_max", 0) <= 3 for r in whole) and any(r.get("partial/lag_max", 0) > 0 for r in whole)
    want, got = final_weights(tmp_path / "whole"), final_weights(tmp_path / "cut")
    assert all(torch.equal(want[k], got[k]) for k in want)
