"""Batch reward computation: task score (math-verify or a user function) + DAPO overlong penalty -> tensor [N].

How we differ from verl: verl's reward managers are classes chosen by name (naive / dapo / prime ...) that
decode tokens themselves and write a token-level reward tensor. Here the trainer hands decoded strings in and
gets one scalar per response (GSPO and GRPO only need sequence rewards), plus counters a run can be
watched by: a scorer that raised or ran out of time scores 0 and is counted. It is fatal only in bulk: more
than ``max_failure_rate`` of the samples failing raises :class:`~.report.RewardFailureError` (one line), and
with an ``error_log`` every failure and its first traceback go to the run's ``reward_errors.log``
(:mod:`gspo_ascend.rewards.report`).

Where scoring runs (``num_workers``):

* ``k >= 1`` (the default, and the only choice the trainer's config accepts): ``k`` spawned worker processes
  (:mod:`gspo_ascend.rewards.pool`), kept for later calls. A scorer stuck inside one C call is killed at the
  batch deadline, Ctrl-C reaches the driver, and ``sys.exit`` costs one sample.
* ``0``: in the calling thread, each sample bounded by a ``SIGALRM`` timer, for tests and benchmarks that must not
  spawn. Not safe for untrusted scorers: the timer and Ctrl-C cannot interrupt code stuck in one C call (a huge
  integer power), which then hangs the caller. Signals only reach the main thread, so when called from another
  thread with a time limit we fall back to one worker process.
"""

from __future__ import annotations

import atexit
from collections.abc import Callable, Sequence

from .math_answer import warm_up
from .penalty import overlong_penalty
from .pool import WorkerPool
from .report import RewardErrorLog, allowed_failures, check_failure_rate
from .scoring import ERROR, NO_ANSWER, TIMEOUT, SampleResult, can_use_alarm, score_sample
from .user_fn import load_reward_fn

DEFAULT_TIMEOUT_S = 5.0
DEFAULT_NUM_WORKERS = 1  # worker processes: the only way a stuck scorer can be stopped
_POOLS: dict[int, WorkerPool] = {}


def _pool(num_workers: int) -> WorkerPool:
    if num_workers not in _POOLS:
        _POOLS[num_workers] = WorkerPool(num_workers)
    return _POOLS[num_workers]


@atexit.register
def shutdown_reward_workers() -> None:
    """Stop the worker processes started by :func:`compute_rewards` (also runs at interpreter exit)."""
    while _POOLS:
        _POOLS.popitem()[1].close()


def _score_all(
    tasks: list[tuple], timeout_s: float | None, num_workers: int, max_failures: int | None = None
) -> list[SampleResult | None]:
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {num_workers}")
    if num_workers == 0 and (not timeout_s or can_use_alarm()):
        warm_up()  # the first parse builds math-verify's grammar (~1 s): not a sample's time
        results: list[SampleResult | None] = [None] * len(tasks)
        failures = 0
        for i, task in enumerate(tasks):
            results[i] = score_sample(*task, timeout_s)
            failures += results[i].status in (ERROR, TIMEOUT)
            if max_failures is not None and failures > max_failures:
                break  # the caller stops the run: the rest stay None (not scored)
        return results
    return _pool(max(num_workers, 1)).run(tasks, timeout_s, max_failures)


def _metrics(results: list[SampleResult], scores, penalties, rewards) -> dict[str, float]:
    n = max(len(results), 1)
    return {
        "reward/mean": float(rewards.mean()) if len(results) else 0.0,
        "reward/score_mean": float(scores.mean()) if len(results) else 0.0,
        "reward/accuracy": sum(r.acc for r in results) / n,
        "reward/no_answer": float(sum(r.status == NO_ANSWER for r in results)),
        "reward/timeouts": float(sum(r.status == TIMEOUT for r in results)),
        "reward/errors": float(sum(r.status == ERROR for r in results)),
        "reward/overlong_penalty_mean": float(penalties.mean()) if len(results) else 0.0,
        "reward/overlong_frac": float((penalties < 0).float().mean()) if len(results) else 0.0,
    }


def score_responses(
    responses: Sequence[str],
    ground_truths: Sequence[str],
    data_sources: Sequence[str] | None = None,
    *,
    reward_fn: str | Callable | None = None,
    extra_infos: Sequence[dict | None] | None = None,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    num_workers: int = DEFAULT_NUM_WORKERS,
    max_failures: int | None = None,
) -> list[SampleResult | None]:
    """The task score of each response, one :class:`SampleResult` (score, acc, status) per response and no
    penalty: what :func:`compute_rewards` builds its rewards from, and what validation reports per sample.
    With ``max_failures``, scoring stops once more samples than that failed; the rest are ``None``."""
    n = len(responses)
    if len(ground_truths) != n:
        raise ValueError(f"{n} responses but {len(ground_truths)} ground truths")
    data_sources = list(data_sources) if data_sources is not None else ["unknown"] * n
    extra_infos = list(extra_infos) if extra_infos is not None else [None] * n
    if len(data_sources) != n or len(extra_infos) != n:
        raise ValueError("data_sources and extra_infos must have one entry per response")
    if isinstance(reward_fn, str):
        load_reward_fn(reward_fn)  # a bad path is a UserError now, not N counted errors
    tasks = [(reward_fn, data_sources[i], responses[i], str(ground_truths[i]), extra_infos[i]) for i in range(n)]
    return _score_all(tasks, timeout_s, num_workers, max_failures)


def compute_rewards(
    responses: Sequence[str],
    ground_truths: Sequence[str],
    data_sources: Sequence[str] | None = None,
    *,
    reward_fn: str | Callable | None = None,
    extra_infos: Sequence[dict | None] | None = None,
    response_lengths=None,
    max_response_length: int | None = None,
    overlong_buffer_length: int = 0,
    overlong_penalty_factor: float = 1.0,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
    num_workers: int = DEFAULT_NUM_WORKERS,
    max_failure_rate: float | None = None,
    error_log: RewardErrorLog | None = None,
    step: int | None = None,
):
    """Rewards for N decoded responses -> ``(rewards [N] float32, metrics)``.

    ``reward_fn``: None = math-verify on the last ``\\boxed{}`` (1 correct / 0 otherwise); a ``module:function``
    path or a callable with verl's ``compute_score`` keywords (see :mod:`gspo_ascend.rewards.user_fn`; with
    worker processes a callable must be importable by name). The overlong penalty is added when
    ``response_lengths`` [N] (tokens) and ``max_response_length`` are given and ``overlong_buffer_length`` > 0.
    Metrics: ``reward/mean``, ``reward/score_mean``, ``reward/accuracy`` and counts of ``reward/no_answer``,
    ``reward/timeouts``, ``reward/errors``, plus the penalty's mean and the fraction penalised.

    Failures: ``error_log`` (a :class:`~.report.RewardErrorLog`) records each failed sample of ``step`` and warns
    once; more than ``max_failure_rate`` (0..1; None or 1: no limit) of the samples failing raises
    :class:`~.report.RewardFailureError`, as soon as the limit is passed (the rest is not scored).
    """
    import torch

    n = len(responses)
    results = score_responses(
        responses,
        ground_truths,
        data_sources,
        reward_fn=reward_fn,
        extra_infos=extra_infos,
        timeout_s=timeout_s,
        num_workers=num_workers,
        max_failures=allowed_failures(n, max_failure_rate),
    )
    if error_log is not None:
        sources = list(data_sources) if data_sources is not None else ["unknown"] * n
        error_log.record(step or 0, results, responses, [str(g) for g in ground_truths], sources)
    check_failure_rate(step, results, max_failure_rate, error_log.path if error_log is not None else None)
    if error_log is not None:
        error_log.warn_once(step or 0, results)
    scores = torch.tensor([r.score for r in results], dtype=torch.float32)
    penalties = torch.zeros(n, dtype=torch.float32)
    if response_lengths is not None and max_response_length is not None and overlong_buffer_length > 0:
        lengths = torch.as_tensor(response_lengths)
        penalties = overlong_penalty(lengths, max_response_length, overlong_buffer_length, overlong_penalty_factor)
    rewards = scores + penalties
    return rewards, _metrics(results, scores, penalties, rewards)
