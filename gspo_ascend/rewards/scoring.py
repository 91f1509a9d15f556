"""Scoring one sample under a time limit; shared by the in-process path and the worker processes.

This module imports neither torch nor the rest of the trainer, so reward worker processes start fast.

The time limit is a ``SIGALRM`` timer (``setitimer``, sub-second) raising an exception that derives from
``BaseException``: math-verify and sympy catch ``Exception`` broadly, and a timeout must not be swallowed as a
parse failure. Signals only reach the main thread, so this runs in the main thread of the trainer process or
of a reward worker process (:mod:`gspo_ascend.rewards.pool`), never in a helper thread.

How we differ from verl: the limit wraps the whole scorer, built-in or user-supplied, and every sample comes
back with a status (ok / no_answer / timeout / error) that is counted in the metrics, where verl folds
timeouts and scorer exceptions into a silent score. An error carries its traceback (written to the run's
``reward_errors.log`` by :mod:`.report`); ``sys.exit`` inside a scorer is an error of that sample, not the end of
the process; a score must be a finite number *in float32*, the dtype rewards are used in (``1e300`` is finite
in Python but ``inf`` in the reward tensor, which would make every optimizer step non-finite and skipped).
"""

from __future__ import annotations

import math
import numbers
import signal
import struct
import threading
import time
import traceback
from typing import Any, NamedTuple

from .math_answer import extract_boxed, is_equivalent
from .user_fn import load_reward_fn

OK, NO_ANSWER, TIMEOUT, ERROR = "ok", "no_answer", "timeout", "error"


class SampleResult(NamedTuple):
    score: float
    acc: float  # 1.0 when counted as correct (the math scorer: score == 1; user dicts: their "acc")
    status: str  # ok | no_answer | timeout | error
    detail: str = ""  # why, for timeout / error (logged, never raised)
    trace: str = ""  # the traceback of an error ("" otherwise), for the run's reward_errors.log


MAX_TRACE_CHARS = 20_000  # a recursion error's traceback is megabytes; its head and tail say what happened


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


def _number(value: Any, what: str) -> float:
    """A Python float from a number a scorer returned: int, float, bool, numpy scalars (``np.float32(1)``,
    ``np.bool_``) and 0-d tensors; finite in float32, the dtype of the reward tensor."""
    if not isinstance(value, numbers.Real) and getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        value = value.item()  # np.bool_ and 0-d arrays / tensors are not numbers.Real; their item() is
    if not isinstance(value, numbers.Real):
        kind = type(value).__name__
        raise TypeError(f"reward function returned {kind}{what}; expected a number or a dict with 'score'")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"reward function returned a non-finite score {number}{what}")
    if math.isinf(struct.unpack("f", struct.pack("f", number))[0]):  # rounded to float32, as the reward tensor does
        raise ValueError(
            f"reward function returned {number:g}{what}, which is inf in float32 (the rewards' dtype; max 3.4e38)"
        )
    return number


def _unpack(value: Any) -> tuple[float, float]:
    """(score, acc) from a reward function's return value: a number or a dict with 'score' (and 'acc')."""
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"reward dict has no 'score' key (keys: {sorted(value)})")
        score = _number(value["score"], " in 'score'")
        acc = _number(value["acc"], " in 'acc'") if "acc" in value else float(score > 0)
        return score, acc
    score = _number(value, "")
    return score, float(score > 0)


def _score(fn, data_source: str, response: str, ground_truth: str, extra_info: dict | None) -> SampleResult:
    if fn is None:  # built-in: math-verify on the last boxed answer
        answer = extract_boxed(response)
        if not answer:
            return SampleResult(0.0, 0.0, NO_ANSWER)
        correct = float(is_equivalent(answer, str(ground_truth)))
        return SampleResult(correct, correct, OK)
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
        # the user's module is imported outside the timer: not a sample's time, and an import cut short by the alarm
        # leaves half-initialised modules behind (a reward file importing torch then segfaulted its worker)
        fn = load_reward_fn(fn_spec) if isinstance(fn_spec, str) else fn_spec
        return run_with_alarm(lambda: _score(fn, data_source, response, ground_truth, extra_info), timeout_s)
    except SampleTimeout:
        return SampleResult(0.0, 0.0, TIMEOUT, f"no result within {timeout_s:g} s")
    except SystemExit as exc:  # sys.exit() in a scorer would end the trainer (or a worker) without a word
        return _error(f"the reward function called sys.exit({exc.code!r})")
    except Exception as exc:  # a scorer bug or odd model text must cost one sample, not the training step
        return _error(f"{type(exc).__name__}: {exc}")


def _error(detail: str) -> SampleResult:
    trace = traceback.format_exc()
    if len(trace) > MAX_TRACE_CHARS:
        half = MAX_TRACE_CHARS // 2
        trace = f"{trace[:half]}\n[... {len(trace) - MAX_TRACE_CHARS} characters cut ...]\n{trace[-half:]}"
    return SampleResult(0.0, 0.0, ERROR, " ".join(detail.split())[:300], trace)
