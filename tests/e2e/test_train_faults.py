"""Faults during `gspo-ascend train` on one node, the way an operator meets them (issue 18, defects 5 and 6).

Each test fails on the code before the fix (c5151b3): the docstrings say how.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.e2e.procs import cmdline, descendants

pytestmark = pytest.mark.slow

SMALL = ("data.train_batch_size=8", "rollout.n=4", "trainer.save_freq=0")


def train_cmd(out: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "gspo_ascend.cli", "train", f"trainer.output_dir={out}", *SMALL, *overrides]


def start_long_run(out: Path, stderr=subprocess.DEVNULL) -> subprocess.Popen:
    """A 50-step run in a session of its own, for the tests that kill part of it."""
    cmd = train_cmd(out, "trainer.total_steps=50")
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=stderr, text=True, start_new_session=True)


def read_metrics(out: Path) -> list[dict]:
    """The complete rows of metrics.jsonl (it may be read while a line is being written)."""
    rows = []
    for line in (out / "metrics.jsonl").read_text().splitlines() if (out / "metrics.jsonl").exists() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


def test_a_reward_function_failing_on_every_sample_stops_the_run_with_one_line(tmp_path):
    """Old code: every sample raised, the console showed reward 0, the run exited 0, the exception was nowhere."""
    scorer = tmp_path / "broken_reward.py"
    scorer.write_text(
        "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': float(solution_str.split()[0]) / 0}\n"
    )
    out = tmp_path / "run"
    proc = subprocess.run(
        train_cmd(out, "trainer.total_steps=3", f"reward.reward_fn={scorer}:score"),
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=900,
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    [line] = error_lines(proc.stderr)
    log = (out / "reward_errors.log").resolve()
    # 32 samples, reward.max_failure_rate=0.5: scoring stops at the 17th failure
    assert line.startswith("error: at least 17 of 32 reward samples failed at step 1"), line
    assert "reward.max_failure_rate=0.5 allows; first: error: " in line and str(log) in line
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and "broken_reward.py" in text
    assert not [r for r in read_metrics(out) if r["step"] >= 1]  # no training step was logged


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_dead_training_worker_is_one_line(tmp_path):
    """kill -9 of the training worker after step 1: one line naming the rank, its node and what to do, exit 1.
    Old code: two chained ActorDiedError tracebacks (the step's, then the shutdown's), ~90 lines."""
    out = tmp_path / "run"
    driver = start_long_run(out, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 600
        while not any(r["step"] == 1 for r in read_metrics(out)):
            assert driver.poll() is None and time.monotonic() < deadline, "no step finished"
            time.sleep(0.2)
        [worker] = [p for p in descendants(driver.pid) if cmdline(p).startswith("ray::PolicyWorker")]
        os.kill(worker, signal.SIGKILL)
        _, err = driver.communicate(timeout=300)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
    assert driver.returncode == 1, err[-3000:]
    assert "Traceback" not in err and "ActorDiedError" not in err, err[-3000:]
    [line] = error_lines(err)
    assert line.startswith("error: training worker rank 0 on Ray node "), line
    assert "died mid-run: The actor is dead because its worker process has died; the run stopped" in line, line
    assert "run the same command again: it resumes from step 1 (no checkpoint was saved yet)" in line, line


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for PID 1 to reap it; it runs nothing)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# Ray's per-node agents watch their raylet and exit on their own, a minute or two after it (measured on Ray 2.60):
# Ray's processes, not ours; everything else must be gone within the bound below
RAY_AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent", "ray/dashboard/agent.py", "runtime_env/agent/main.py")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_kill_9_of_the_driver_leaves_no_worker_behind(tmp_path):
    """kill -9 of the driver alone (not its process group): the training workers, the local Ray cluster the driver
    started, the reward workers and multiprocessing's resource tracker all go. Old code: the reward workers and
    the resource tracker lived on with PPID 1, blocked on their queue, until someone killed them."""
    out = tmp_path / "run"
    driver = start_long_run(out)
    left: list[int] = []
    try:
        deadline = time.monotonic() + 600
        while not any(r["step"] == 1 for r in read_metrics(out)):
            assert driver.poll() is None and time.monotonic() < deadline, "no step finished"
            time.sleep(0.2)
        started = [p for p in descendants(driver.pid) if not cmdline(p).startswith(RAY_AGENTS)]
        names = [cmdline(p) for p in started]
        for what in ("ray::PolicyWorker", "raylet", "gcs_server", "spawn_main", "resource_tracker"):
            assert any(what in name for name in names), (what, names)
        driver.kill()  # SIGKILL to the driver only: no atexit, no finally
        driver.wait()
        deadline = time.monotonic() + 60  # a bound for a loaded CI host, not a speed claim
        while any(running(p) for p in started) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = [p for p in started if running(p)]
        assert [cmdline(p)[:120] for p in left] == []
    finally:
        for pid in left or ([] if driver.poll() is not None else [driver.pid]):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
