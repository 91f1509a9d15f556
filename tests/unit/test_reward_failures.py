"""Reward failures are visible and bounded (issue 18, defect 5; the orphan part of defect 6).

Each test fails on the code before the fix (c5151b3), for the reason in its docstring.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gspo_ascend.config import load_config
from gspo_ascend.errors import ConfigError
from gspo_ascend.rewards import compute_rewards
from gspo_ascend.rewards.compute import shutdown_reward_workers

SCORERS = """
import math, sys, time
import numpy as np
import torch

def np_float32(data_source, solution_str, ground_truth, extra_info=None):
    return np.float32(0.5)

def np_int64(data_source, solution_str, ground_truth, extra_info=None):
    return np.int64(1)

def np_bool(data_source, solution_str, ground_truth, extra_info=None):
    return np.bool_(True)

def np_dict(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": np.float64(0.25), "acc": np.bool_(False)}

def tensor_0d(data_source, solution_str, ground_truth, extra_info=None):
    return torch.tensor(2.0)

def huge(data_source, solution_str, ground_truth, extra_info=None):
    return 1e300  # finite in float64, inf in float32

def float32_max(data_source, solution_str, ground_truth, extra_info=None):
    return 3.0e38  # finite in float32

def vector(data_source, solution_str, ground_truth, extra_info=None):
    return np.array([1.0, 2.0])

def exits(data_source, solution_str, ground_truth, extra_info=None):
    sys.exit(3)

def boom(data_source, solution_str, ground_truth, extra_info=None):
    raise RuntimeError(f"scorer bug on {solution_str}")

def slow(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(30)
    return 1.0
"""


@pytest.fixture
def scorers(tmp_path):
    path = tmp_path / "scorers.py"
    path.write_text(SCORERS)
    yield path
    shutdown_reward_workers()


@pytest.mark.parametrize(
    ("name", "reward", "acc"),
    [("np_float32", 0.5, 1.0), ("np_int64", 1.0, 1.0), ("np_bool", 1.0, 1.0), ("np_dict", 0.25, 0.0)]
    + [("tensor_0d", 2.0, 1.0)],
)
@pytest.mark.parametrize("num_workers", [0, 1])
def test_numpy_scalars_are_rewards(scorers, name, reward, acc, num_workers):
    """Old code: np.float32 / np.bool_ / 0-d tensors are not (bool, int, float): scored 0 and counted as errors."""
    rewards, metrics = compute_rewards(["a", "b"], ["a", "a"], reward_fn=f"{scorers}:{name}", num_workers=num_workers)
    assert rewards.tolist() == [reward, reward]
    assert metrics["reward/errors"] == 0.0 and metrics["reward/accuracy"] == acc


def test_rewards_must_be_finite_in_float32(scorers, tmp_path):
    """Old code: 1e300 passed the float64 finiteness check and became inf in the float32 reward tensor."""
    from gspo_ascend.rewards.report import RewardErrorLog

    log = RewardErrorLog(tmp_path / "run", stream=open(os.devnull, "w"))  # noqa: SIM115
    rewards, metrics = compute_rewards(["a"], ["a"], reward_fn=f"{scorers}:huge", error_log=log, step=1)
    assert rewards.tolist() == [0.0] and metrics["reward/errors"] == 1.0
    assert "1e+300, which is inf in float32" in log.path.read_text()
    rewards, metrics = compute_rewards(["a"], ["a"], reward_fn=f"{scorers}:float32_max")
    assert metrics["reward/errors"] == 0.0 and rewards.tolist() == [pytest.approx(3.0e38)]
    rewards, metrics = compute_rewards(["a"], ["a"], reward_fn=f"{scorers}:vector")
    assert metrics["reward/errors"] == 1.0  # an array is not a score


@pytest.mark.parametrize("num_workers", [0, 1])
def test_sys_exit_in_a_scorer_costs_one_sample(scorers, tmp_path, num_workers):
    """Old code: in-process, SystemExit ended the caller; in a worker, it killed the worker ("a reward worker
    process died") and the batch's other samples with it."""
    from gspo_ascend.rewards.report import RewardErrorLog

    log = RewardErrorLog(tmp_path / "run", stream=open(os.devnull, "w"))  # noqa: SIM115
    rewards, metrics = compute_rewards(
        ["a", "b"], ["a", "a"], reward_fn=f"{scorers}:exits", num_workers=num_workers, error_log=log, step=4
    )
    assert rewards.tolist() == [0.0, 0.0] and metrics["reward/errors"] == 2.0
    assert log.path.read_text().count("error: the reward function called sys.exit(3)") == 2
    rewards, _ = compute_rewards(["\\boxed{2}"], ["2"], num_workers=num_workers)  # still scoring
    assert rewards.tolist() == [1.0]


def test_failures_go_to_the_run_log_with_their_first_traceback_and_one_warning(scorers, tmp_path, capsys):
    """Old code: the exception text was logged nowhere and nothing was printed; the run showed reward 0."""
    from gspo_ascend.rewards.report import REWARD_ERRORS_NAME, RewardErrorLog

    log = RewardErrorLog(tmp_path / "run")
    for step in (1, 2):
        rewards, metrics = compute_rewards(
            ["x", "\\boxed{1}", "y"], ["1", "1", "1"], reward_fn=f"{scorers}:boom", error_log=log, step=step
        )
        assert metrics["reward/errors"] == 3.0
    text = (tmp_path / "run" / REWARD_ERRORS_NAME).read_text()
    assert text.count("step 1: 3 of 3 scored samples failed (3 errors, 0 timeouts)") == 1
    for step in (1, 2):
        for i, response in enumerate(["x", "\\boxed{1}", "y"]):
            line = f"step {step} sample {i} [unknown] error: RuntimeError: scorer bug on {response} | response"
            assert line in text, text
    # the same frames with a different message: one traceback in the file, naming the scorer's line
    assert text.count("Traceback (most recent call last)") == 1
    assert 'in boom\n        raise RuntimeError(f"scorer bug on {solution_str}")' in text
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: the reward function failed on 3 of 3 samples at step 1")
    assert str(tmp_path / "run" / REWARD_ERRORS_NAME) in err[0]


def test_failure_rate_above_the_limit_stops_with_one_line(scorers, tmp_path):
    """Old code: no limit; every sample failing gave reward 0 and training went on."""
    from gspo_ascend.rewards.report import RewardErrorLog, RewardFailureError

    log = RewardErrorLog(tmp_path / "run", stream=open(os.devnull, "w"))  # noqa: SIM115
    # 2 of 4 failing is at the limit of 0.5: allowed
    ok = f"{tmp_path}/mixed.py"
    Path(ok).write_text(
        "def f(data_source, solution_str, ground_truth, extra_info=None):\n    return 1 / int(solution_str)\n"
    )
    rewards, metrics = compute_rewards(
        ["1", "0", "2", "0"], ["", "", "", ""], reward_fn=f"{ok}:f", max_failure_rate=0.5
    )
    assert rewards.tolist() == [1.0, 0.0, 0.5, 0.0] and metrics["reward/errors"] == 2.0
    with pytest.raises(RewardFailureError) as err:
        compute_rewards(["a"] * 4, ["a"] * 4, reward_fn=f"{scorers}:boom", max_failure_rate=0.5, error_log=log, step=7)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("at least 3 of 4 reward samples failed at step 7 (scoring stopped there; 1 not scored)")
    assert "reward.max_failure_rate=0.5" in message and "RuntimeError: scorer bug on a" in message
    assert str(log.path) in message


def test_a_scorer_that_always_times_out_stops_at_the_limit_not_after_every_sample(scorers, monkeypatch):
    """Old code: n x timeout_s per step, every step, with no limit. Here one worker, 8 samples, a limit of 0.25
    (2 allowed): scoring stops after the third timeout, the 5 others are never started."""
    from gspo_ascend.rewards import pool
    from gspo_ascend.rewards.report import RewardFailureError

    monkeypatch.setattr(pool, "_DEADLINE_GRACE_S", 300.0)  # a starved CI host must not hit the batch deadline first

    with pytest.raises(RewardFailureError, match=r"^at least 3 of 8 reward samples failed \(scoring stopped there; "):
        compute_rewards(["a"] * 8, ["a"] * 8, reward_fn=f"{scorers}:slow", timeout_s=0.2, max_failure_rate=0.25)


def test_a_reward_module_with_a_slow_import_is_not_cut_by_the_sample_timer(tmp_path):
    """Old code: the user's module was imported inside the first sample's time limit; importing torch takes far
    longer than 50 ms, so the alarm cut the import short: that sample timed out, and the half-imported torch later
    segfaulted the worker (seen as a flaky "a reward worker process died")."""
    path = tmp_path / "heavy_import.py"
    path.write_text(
        "import torch\n\ndef f(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n"
    )
    try:
        # 3 workers: a pool of its own, so its processes have not imported torch for another test
        rewards, metrics = compute_rewards(["a"] * 6, ["a"] * 6, reward_fn=f"{path}:f", timeout_s=0.05, num_workers=3)
    finally:
        shutdown_reward_workers()
    assert rewards.tolist() == [1.0] * 6
    assert metrics["reward/timeouts"] == 0.0 and metrics["reward/errors"] == 0.0


def test_config_refuses_scoring_inside_the_driver():
    """Old code: reward.num_workers=0 scored in the driver, where a scorer stuck in C hangs it, deaf to Ctrl-C."""
    with pytest.raises(ConfigError, match=r"'reward.num_workers' must be >= 1, got 0: scoring inside the driver"):
        load_config(None, ["reward.num_workers=0"])
    with pytest.raises(ConfigError, match=r"'reward.max_failure_rate' must be in \[0, 1\]"):
        load_config(None, ["reward.max_failure_rate=1.5"])
    assert load_config(None, []).reward.max_failure_rate == 0.5


# ----------------------------------------------------------------------------------------------- orphans

DRIVER = """
import sys, threading, time
from gspo_ascend.rewards import compute_rewards
from gspo_ascend.rewards.compute import _POOLS

def score():
    compute_rewards(["\\\\boxed{1}"], ["1"], num_workers=2)

if __name__ == "__main__":
    if sys.argv[1] == "thread":  # a pool made off the main thread: no kernel death signal, the watcher alone
        t = threading.Thread(target=score)
        t.start()
        t.join()
    else:
        score()
    from multiprocessing import resource_tracker
    pids = [p.pid for p in next(iter(_POOLS.values()))._procs] + [resource_tracker._resource_tracker._pid]
    print("PIDS", *pids, flush=True)
    time.sleep(600)
"""


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for PID 1 to reap it; it runs nothing)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("made_on", ["main", "thread"])
def test_reward_workers_and_resource_tracker_die_with_the_driver(tmp_path, made_on):
    """Old code: after `kill -9` of the driver the reward workers (and multiprocessing's resource tracker,
    which waits for them) lived on with PPID 1, blocked on their queue, until someone killed them."""
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    driver = subprocess.Popen(
        [sys.executable, str(script), made_on],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    pids: list[int] = []
    try:
        line = driver.stdout.readline()
        assert line.startswith("PIDS"), line
        pids = [int(p) for p in line.split()[1:]]
        assert all(running(p) for p in pids)
        driver.kill()  # SIGKILL: no atexit, no finally
        driver.wait()
        deadline = time.monotonic() + 60  # a bound for a loaded CI host, not a speed claim
        while any(running(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [p for p in pids if running(p)] == []
    finally:
        for pid in pids:  # what the old code leaves behind
            if running(pid):
                os.kill(pid, signal.SIGKILL)


INTERRUPTED = """
import faulthandler, signal, time
from gspo_ascend.rewards import compute_rewards

if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR1)  # where it hangs, if it does: the test asks for every thread's stack
    # Ctrl-C as a terminal's foreground job gets it. A process started with SIGINT ignored (pytest run under nohup
    # or as a shell's background job: the shell ignores SIGINT for those, and children inherit it) has no
    # KeyboardInterrupt at all, and this driver then waited out the stuck scorer.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    compute_rewards(["\\\\boxed{1}"], ["1"], num_workers=1)  # workers up
    print("READY", flush=True)
    compute_rewards(["a"], ["a"], reward_fn=__import__("sys").argv[1], num_workers=1, timeout_s=600)
"""


def test_ctrl_c_stops_a_driver_waiting_on_a_stuck_scorer_without_worker_tracebacks(tmp_path):
    """Ctrl-C (SIGINT to the process group) while a scorer is stuck: the driver ends with KeyboardInterrupt and
    the workers stay quiet. Old code: every worker printed its own KeyboardInterrupt traceback as well."""
    inside = tmp_path / "in-scorer"  # the scorer says it has the sample: the test waits on that, not on a sleep
    (tmp_path / "stuck.py").write_text(
        "import pathlib, signal, time\n"
        "def f(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})\n"
        f"    pathlib.Path({str(inside)!r}).touch()\n"
        "    time.sleep(600)\n"
    )
    script = tmp_path / "driver.py"
    script.write_text(INTERRUPTED)
    driver = subprocess.Popen(
        [sys.executable, str(script), f"{tmp_path / 'stuck.py'}:f"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    try:
        assert driver.stdout.readline().startswith("READY")
        deadline = time.monotonic() + 60  # a bound for a loaded CI host, not a speed claim
        while not inside.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert inside.exists(), "the sample never reached the scorer"
        os.killpg(driver.pid, signal.SIGINT)
        _, err = driver.communicate(timeout=120)
    except subprocess.TimeoutExpired as timeout:  # a hung driver's threads, for the failure message
        alive = driver.poll() is None
        if alive:
            driver.send_signal(signal.SIGUSR1)
            time.sleep(2.0)
        os.killpg(driver.pid, signal.SIGKILL)
        stacks = driver.communicate()[1]
        raise AssertionError(f"no exit within 120 s of Ctrl-C (driver alive: {alive})\n{stacks}") from timeout
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
    assert driver.returncode != 0
    assert err.count("KeyboardInterrupt") == 1, err  # the driver's own, and only that
    assert "Process gspo-reward" not in err, err
