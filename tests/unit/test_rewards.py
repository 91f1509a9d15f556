"""Rewards: hand-checked math answers, no evaluation of model text, timeouts, overlong penalty, user functions."""

from __future__ import annotations

import signal
import threading
import time

import pytest
import torch

from gspo_ascend.errors import UserError
from gspo_ascend.rewards import compute_rewards, extract_boxed, load_reward_fn, math_score, overlong_penalty
from gspo_ascend.rewards import pool as pool_mod
from gspo_ascend.rewards.compute import shutdown_reward_workers

# ----------------------------------------------------------------------------------------------- extraction


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so the answer is \\boxed{12}.", "12"),
        ("first \\boxed{3} then \\boxed{4}", "4"),  # the last box counts
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # nested braces
        ("\\fbox{7}", "7"),
        ("\\boxed 5.", "5"),
        ("no box here: 12", None),
        ("\\boxed{12", None),  # unclosed
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


# ----------------------------------------------------------------------------------------------- math score


@pytest.mark.parametrize(
    "response, truth, score",
    [
        ("7 + 5 = 12. \\boxed{12}", "12", 1.0),  # correct
        ("7 + 5 = 13. \\boxed{13}", "12", 0.0),  # wrong
        ("7 + 5 = 12.", "12", 0.0),  # no box: the bare number is not taken as the answer
        ("\\boxed{0.5}", "1/2", 1.0),  # equivalent forms
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("\\boxed{1/2}", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\dfrac12}", "0.5", 1.0),
        ("\\boxed{1,000}", "1000", 1.0),
        ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),  # symbolic equivalence
        ("\\boxed{0.6}", "1/2", 0.0),
        ("the answer is \\boxed{3} not 4", "3", 1.0),
        ("\\boxed{}", "3", 0.0),
    ],
)
def test_math_score_hand_checked(response, truth, score):
    assert math_score(response, truth) == score


@pytest.mark.parametrize(
    "payload",
    [
        "__import__('os').system('touch {marker}')",
        "__import__('pathlib').Path('{marker}').touch()",
        "exec(\"open('{marker}', 'w').write('x')\")",
        'eval(\'__import__("os").system("touch {marker}")\')',
    ],
)
def test_malicious_box_is_not_executed(tmp_path, payload):
    marker = tmp_path / "pwned"
    response = "\\boxed{" + payload.format(marker=marker) + "}"
    rewards, metrics = compute_rewards([response], ["0"])
    assert rewards.tolist() == [0.0]
    assert not marker.exists()
    assert metrics["reward/errors"] == 0.0  # an unparseable answer is just wrong, not a scorer failure


def test_compute_rewards_metrics():
    responses = ["\\boxed{12}", "\\boxed{13}", "twelve", "\\boxed{\\frac{1}{2}}"]
    rewards, metrics = compute_rewards(responses, ["12", "12", "12", "0.5"])
    assert rewards.dtype == torch.float32 and rewards.tolist() == [1.0, 0.0, 0.0, 1.0]
    assert metrics["reward/accuracy"] == 0.5
    assert metrics["reward/no_answer"] == 1.0
    assert metrics["reward/timeouts"] == metrics["reward/errors"] == 0.0


# ----------------------------------------------------------------------------------------------- overlong


@pytest.mark.parametrize(
    "length, expected",
    [(10, 0.0), (15, 0.0), (16, -0.2), (18, -0.6), (20, -1.0), (25, -1.0)],  # L_max 20, L_cache 5
)
def test_overlong_penalty_hand_computed(length, expected):
    assert overlong_penalty(length, 20, 5, 1.0) == pytest.approx(expected)
    assert overlong_penalty(length, 20, 5, 0.5) == pytest.approx(expected / 2)


def test_overlong_penalty_tensor_and_zero_buffer():
    out = overlong_penalty(torch.tensor([4, 12, 16]), 16, 8, 2.0)
    assert torch.allclose(out, torch.tensor([0.0, -1.0, -2.0]))
    assert overlong_penalty(20, 20, 0) == 0.0 and overlong_penalty(21, 20, 0) == -1.0
    with pytest.raises(ValueError):
        overlong_penalty(5, 20, 21)


def test_compute_rewards_adds_overlong_penalty():
    rewards, metrics = compute_rewards(
        ["\\boxed{1}", "\\boxed{1}", "\\boxed{2}"],
        ["1", "1", "1"],
        response_lengths=[10, 19, 20],
        max_response_length=20,
        overlong_buffer_length=4,
    )
    assert rewards.tolist() == pytest.approx([1.0, 0.25, -1.0])
    assert metrics["reward/overlong_frac"] == pytest.approx(2 / 3)


# ----------------------------------------------------------------------------------------------- user fns

USER_FNS = """
import math, time

def exact(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str.strip() == ground_truth)

def as_dict(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": -1.0 if solution_str != ground_truth else 1.0, "acc": float(solution_str == ground_truth)}

def slow(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(30)
    return 1.0

def boom(data_source, solution_str, ground_truth, extra_info=None):
    raise RuntimeError("scorer bug")

def bad_type(data_source, solution_str, ground_truth, extra_info=None):
    return "yes"

def nan(data_source, solution_str, ground_truth, extra_info=None):
    return math.nan

def deaf(data_source, solution_str, ground_truth, extra_info=None):
    import signal
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})  # the alarm cannot interrupt this one
    time.sleep(30)

NOT_A_FUNCTION = 3
"""


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_FNS)
    return path


def test_user_reward_fn_by_path(user_file):
    rewards, metrics = compute_rewards(["a", "b"], ["a", "a"], reward_fn=f"{user_file}:exact")
    assert rewards.tolist() == [1.0, 0.0]
    rewards, metrics = compute_rewards(["a", "b"], ["a", "a"], reward_fn=f"{user_file}:as_dict")
    assert rewards.tolist() == [1.0, -1.0] and metrics["reward/accuracy"] == 0.5
    assert load_reward_fn("os.path:join") is __import__("os").path.join  # module:function form


@pytest.mark.parametrize("name", ["boom", "bad_type", "nan"])
def test_user_fn_failures_score_zero_and_are_counted(user_file, name):
    rewards, metrics = compute_rewards(["a", "a"], ["a", "a"], reward_fn=f"{user_file}:{name}")
    assert rewards.tolist() == [0.0, 0.0]
    assert metrics["reward/errors"] == 2.0


def test_timeout_scores_zero_and_is_counted(user_file):
    start = time.perf_counter()
    rewards, metrics = compute_rewards(
        ["a", "a"], ["a", "a"], reward_fn=f"{user_file}:slow", timeout_s=0.2, num_workers=0
    )
    assert time.perf_counter() - start < 5
    assert rewards.tolist() == [0.0, 0.0]
    assert metrics["reward/timeouts"] == 2.0 and metrics["reward/errors"] == 0.0


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("no_colon", "must be of the form"),
        ("surely_not_a_module_xyz:fn", "module 'surely_not_a_module_xyz' not found"),
        ("os.path:no_such_function", "has no function 'no_such_function'"),
        ("{file}:NOT_A_FUNCTION", "is a int, not a function"),
        ("/nonexistent/dir/r.py:fn", "does not exist"),
    ],
)
def test_user_fn_errors_are_one_line(user_file, spec, fragment):
    spec = spec.format(file=user_file)
    with pytest.raises(UserError) as err:
        compute_rewards(["a"], ["a"], reward_fn=spec)
    message = str(err.value)
    assert fragment in message and spec in message and "\n" not in message


def test_user_file_that_fails_to_import(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("import surely_not_a_module_xyz\n")
    with pytest.raises(UserError, match="importing .* failed: ModuleNotFoundError"):
        load_reward_fn(f"{path}:fn")


# ----------------------------------------------------------------------------------------------- workers


def test_worker_processes_off_main_thread(user_file, monkeypatch):
    """Off the main thread no alarm is possible: scoring moves to worker processes, which keep the limits,
    and a worker deaf to the alarm is killed at the batch deadline and replaced."""
    monkeypatch.setattr(pool_mod, "_DEADLINE_GRACE_S", 0.5)
    out = {}

    def run():
        out["math"] = compute_rewards(["\\boxed{2}", "\\boxed{3}"], ["2", "2"], timeout_s=2.0)
        out["slow"] = compute_rewards(["a"], ["a"], reward_fn=f"{user_file}:slow", timeout_s=0.3)
        out["deaf"] = compute_rewards(["a"], ["a"], reward_fn=f"{user_file}:deaf", timeout_s=0.3)
        out["after"] = compute_rewards(["\\boxed{2}"], ["2"], timeout_s=2.0)

    try:
        thread = threading.Thread(target=run)
        thread.start()
        thread.join(timeout=120)
        assert not thread.is_alive()
        assert out["math"][0].tolist() == [1.0, 0.0]
        assert out["slow"][0].tolist() == [0.0] and out["slow"][1]["reward/timeouts"] == 1.0
        assert out["deaf"][0].tolist() == [0.0] and out["deaf"][1]["reward/timeouts"] == 1.0
        assert out["after"][0].tolist() == [1.0]  # the restarted workers still score
    finally:
        shutdown_reward_workers()


def test_alarm_leaves_the_callers_timer_alone():
    def callers_handler(signum, frame):
        raise AssertionError("the caller's timer fired during the test")

    previous = signal.signal(signal.SIGALRM, callers_handler)
    signal.setitimer(signal.ITIMER_REAL, 30)
    try:
        compute_rewards(["\\boxed{1}"], ["1"], timeout_s=1.0, num_workers=0)  # the alarm runs in this process
        delay, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 25 < delay <= 30  # still pending, minus the time spent
        assert signal.getsignal(signal.SIGALRM) is callers_handler
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_scoring_does_not_pile_up_logger_filters():
    """Regression: each scored sample used to add two logging filters (linear slow-down over a run)."""
    import logging

    from gspo_ascend.rewards.math_answer import math_score

    for _ in range(5):
        math_score("so \\boxed{4}", "4")
    for name in ("math_verify.parser", "math_verify.grader"):
        assert len(logging.getLogger(name).filters) == 1
