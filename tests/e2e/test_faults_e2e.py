"""Faults a cluster meets, through the CLI and Ray (issue 18): a preempting SIGTERM saves at the next safe point and
exits 143; a checkpoint damaged after its commit (same-size corruption of the engine's zip file) is announced, moved
aside, and the next run falls back to the previous one and finishes. The layers underneath have fast unit tests:
tests/unit/test_checkpoint.py, test_run_dir.py, test_resume_config.py."""

from __future__ import annotations

import re
import signal
import subprocess

import pytest

from gspo_ascend import checkpoint as ck
from tests.conftest import REPO
from tests.e2e.test_train_e2e import read_metrics, train_cmd
from tests.unit.test_checkpoint import flip_byte

pytestmark = pytest.mark.slow


def training_steps(out) -> list[int]:
    return [r["step"] for r in read_metrics(out) if r["step"] > 0]  # step 0: validation before training, if on


def test_sigterm_saves_and_exits_143_then_a_damaged_checkpoint_is_fallen_back_from(tmp_path):
    out = tmp_path / "run"
    common = ("trainer.total_steps=5", "trainer.save_freq=1", "data.train_batch_size=8", "rollout.n=4")
    err_file = tmp_path / "stderr.txt"
    with open(err_file, "w") as err:
        proc = subprocess.Popen(train_cmd(out, *common), cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True)
        try:
            for line in proc.stdout:
                if line.startswith("step 2/5"):
                    proc.send_signal(signal.SIGTERM)  # what Slurm / Kubernetes send to preempt, to the driver
                    break
            proc.communicate(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    stderr = err_file.read_text()
    assert proc.returncode == 143, stderr[-3000:]
    assert "SIGTERM received at time" not in stderr  # Ray's failure-signal handler: a stack dump and exit code 134
    (stopped,) = [line for line in stderr.splitlines() if line.startswith("stopped: ")]
    last = int(re.search(r"after step (\d+) with checkpoint", stopped).group(1))
    assert last in (2, 3)  # step 2's line was out: its save, or step 3 and its save, is the next safe point
    assert stopped.endswith(f"checkpoint {out}/checkpoints/step_{last:08d}; run the same command to resume")
    assert training_steps(out) == list(range(1, last + 1))
    assert (
        ck.find_latest(out).name == ck.checkpoint_name(last)
        and ck.checkpoint_problem(ck.find_latest(out), True) is None
    )
    assert not (out / "run.lock").exists() and not (out / "hf").exists()

    damaged = out / "checkpoints" / ck.checkpoint_name(last)
    flip_byte(damaged / "engine" / "engine_rank0.pt")  # same size: the marker's sizes still agree
    again = subprocess.run(train_cmd(out, *common), capture_output=True, text=True, cwd=REPO, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    (warning,) = [line for line in again.stderr.splitlines() if "damaged" in line]
    assert warning == (
        f"warning: checkpoint {damaged} is damaged (file engine/engine_rank0.pt does not match its blake3 checksum "
        f"in COMPLETE (its content changed)); moved to damaged-{damaged.name}, resuming from "
        f"{ck.checkpoint_name(last - 1)}"
    )
    assert f"resumed from {out}/checkpoints/{ck.checkpoint_name(last - 1)} at step {last - 1}" in again.stdout
    assert training_steps(out) == [1, 2, 3, 4, 5]
    assert (out / "checkpoints" / f"damaged-{damaged.name}" / "engine" / "engine_rank0.pt").is_file()  # evidence kept
    assert ck.find_latest(out).name == ck.checkpoint_name(5) and (out / "hf").is_dir()
