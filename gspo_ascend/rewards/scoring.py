"""Scoring one sample under a time limit; shared by the in-process path and the worker processes.

This module imports neither torch nor the rest of the trainer, so reward worker processes start fast.

The time limit is a ``SIGALRM`` timer (``setitimer``, sub-second) raising an exception that derives from
``BaseException``: math-verify and sympy catch ``Exception`` broadly, and a timeout must not be swallowed as a
parse failure. Signals only reach the main thread, so this runs in the main thread of the trainer process or
of a reward worker process (:mod:`gspo_ascend.rewards.pool`), never in a helper thread.

How we differ from verl: the limit wraps the whole scorer, built-in or user-supplied, and every sample comes
back with a status (ok / no_answer / timeout / error) that is counted in the metrics, where verl folds
timeouts and scorer exceptions into a silent score.
"""

from __future__ import annotations

import math
import signal
import threading
import time
from typing import Any, NamedTuple

from .math_answer import extract_boxed, is_equivalent
from .user_fn import load_reward_fn

OK, NO_ANSWER, TIMEOUT, ERROR = "ok", "no_answer", "timeout", "error"


class SampleResult(NamedTuple):
    score: float
    acc: float  # 1.0 when counted as correct (the math scorer: score == 1; user dicts: their "acc")
    status: str  # ok | no_answer | timeout | error
    detail: str = ""  # why, for timeout / error (logged, never raised)


class SampleTimeout(BaseException):
    """Raised by the alarm; BaseException so that ``except Exception`` in parsers does not eat it."""


def can_use_alarm() -> bool:
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


def run_with_alarm(fn, timeout_s: float | None):
    """``fn()``, interrupted with :class:`SampleTimeout` after ``timeout_s`` seconds (None or 0: no limit).

    A caller's own SIGALRM handler and pending timer are put back afterwards (the timer minus the time spent).
    """
    if not timeout_s:
        return fn()

    def on_alarm(signum, frame):
        raise SampleTimeout

    previous_handler = signal.signal(signal.SIGALRM, on_alarm)
    previous_delay, previous_interval = signal.setitimer(signal.ITIMER_REAL, timeout_s)
    start = time.monotonic()
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        # None = a handler installed from C; SIG_DFL is the closest we can restore
        signal.signal(signal.SIGALRM, signal.SIG_DFL if previous_handler is None else previous_handler)
        if previous_delay > 0:
            remaining = max(previous_delay - (time.monotonic() - start), 1e-3)
            signal.setitimer(signal.ITIMER_REAL, remaining, previous_interval)


def _unpack(value: Any) -> tuple[float, float]:
    """(score, acc) from a reward function's return value: a number, a bool or a dict with 'score'."""
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"reward dict has no 'score' key (keys: {sorted(value)})")
        score = float(value["score"])
        acc = float(value["acc"]) if "acc" in value else float(score > 0)
    elif isinstance(value, (bool, int, float)):
        score = float(value)
        acc = float(score > 0)
    else:
        raise TypeError(f"reward function returned {type(value).__name__}; expected a number or a dict with 'score'")
    if not math.isfinite(score):
        raise ValueError(f"reward function returned a non-finite score {score}")
    return score, acc


def _score(fn_spec, data_source: str, response: str, ground_truth: str, extra_info: dict | None) -> SampleResult:
    if fn_spec is None:  # built-in: math-verify on the last boxed answer
        answer = extract_boxed(response)
        if not answer:
            return SampleResult(0.0, 0.0, NO_ANSWER)
        correct = float(is_equivalent(answer, str(ground_truth)))
        return SampleResult(correct, correct, OK)
    fn = load_reward_fn(fn_spec) if isinstance(fn_spec, str) else fn_spec
    value = fn(data_source=data_source, solution_str=response, ground_truth=ground_truth, extra_info=extra_info)
    return SampleResult(*_unpack(value), OK)


def score_sample(
    fn_spec,
    data_source: str,
    response: str,
    ground_truth: str,
    extra_info: dict | None,
    timeout_s: float | None,
) -> SampleResult:
    """Score one response; never raises: a timeout or an exception becomes score 0 with its status."""
    try:
        return run_with_alarm(lambda: _score(fn_spec, data_source, response, ground_truth, extra_info), timeout_s)
    except SampleTimeout:
        return SampleResult(0.0, 0.0, TIMEOUT, f"no result within {timeout_s:g} s")
    except Exception as exc:  # a scorer bug or odd model text must cost one sample, not the training step
        return SampleResult(0.0, 0.0, ERROR, f"{type(exc).__name__}: {exc}"[:300])
