"""Reward failures made visible: ``reward_errors.log`` in the run directory, one console warning, a limit.

A sample whose scorer raised or ran out of time scores 0 and is counted (``reward/errors``,
``reward/timeouts``). Counting alone hid real breakage: with every sample raising, the console showed reward 0
and the run exited 0, and the exception text was logged nowhere. So the trainer hands each step's results here:

* every failed sample gets one line in ``<output_dir>/reward_errors.log`` (step, sample, data source, status,
  the exception's line, the start of the response and the ground truth), and the first occurrence of each
  distinct traceback (same frames; the message may differ) is written in full below its line;
* the first step with a failure prints one warning on stderr naming the log (once per run; validation's scoring of
  held-out prompts and ``gspo-ascend eval`` log here too, marked with their phase, with a warning of their own);
* more than ``reward.max_failure_rate`` of a step's samples failing stops the run with one line
  (:class:`RewardFailureError`), because a reward that is mostly zeros by accident trains the policy on noise.

How we differ from verl: verl's reward managers print a scorer's exception per sample (or swallow it, with
``timeout_score``) and never stop; there is no file and no rate limit.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import TextIO

from ..errors import UserError
from .scoring import ERROR, TIMEOUT, SampleResult

REWARD_ERRORS_NAME = "reward_errors.log"
_SNIPPET_CHARS = 120  # of a response or a ground truth, in the log line


class RewardFailureError(UserError):
    """More of a step's samples failed to score than ``reward.max_failure_rate`` allows."""


def failure_counts(results: Sequence[SampleResult | None]) -> tuple[int, int]:
    """(errors, timeouts) among ``results`` (``None``: not scored, counted as neither)."""
    errors = sum(r is not None and r.status == ERROR for r in results)
    timeouts = sum(r is not None and r.status == TIMEOUT for r in results)
    return errors, timeouts


def allowed_failures(n: int, max_failure_rate: float | None) -> int | None:
    """The most failed samples of ``n`` that ``max_failure_rate`` tolerates (None: no limit)."""
    if max_failure_rate is None or max_failure_rate >= 1:
        return None
    return int(max_failure_rate * n + 1e-9)  # 0.5 of 16 allows 8; the epsilon keeps 0.3 * 10 at 3, not 2


def _snippet(text: str) -> str:
    text = str(text)
    return repr(text if len(text) <= _SNIPPET_CHARS else text[:_SNIPPET_CHARS] + "...")


def _at(step: int | None, phase: str) -> str:
    if step is None:  # gspo-ascend eval: no training step
        return phase
    return f"{phase} at step {step}" if phase else f"step {step}"


def _first_failure(results: Sequence[SampleResult | None]) -> str:
    first = next(r for r in results if r is not None and r.status in (ERROR, TIMEOUT))
    return f"{first.status}: {first.detail}"


class RewardErrorLog:
    """Writes the failures of each scored step to ``reward_errors.log`` and warns once on the console."""

    def __init__(self, output_dir: str | Path, stream: TextIO | None = None):
        self.path = Path(output_dir).resolve() / REWARD_ERRORS_NAME
        self.stream = stream
        self.warned: set[str] = set()  # the phases ("": training) already warned about: one warning each
        self._seen_traces: set[str] = set()
        self._opened = False

    def record(
        self,
        step: int | None,
        results: Sequence[SampleResult | None],
        responses: Sequence[str],
        ground_truths: Sequence[str],
        data_sources: Sequence[str],
        phase: str = "",
    ) -> None:
        """Log the failed samples of ``step`` (nothing when none failed); ``phase="validation"`` marks the held-out
        prompts' scoring, whose failures count in ``val/*/score_errors`` and never stop a run."""
        errors, timeouts = failure_counts(results)
        if not errors + timeouts:
            return
        scored = sum(r is not None for r in results)
        at = _at(step, phase)
        lines = [f"{at}: {errors + timeouts} of {scored} scored samples failed ({errors} errors, {timeouts} timeouts)"]
        for i, r in enumerate(results):
            if r is None or r.status not in (ERROR, TIMEOUT):
                continue
            lines.append(
                f"{at} sample {i} [{data_sources[i]}] {r.status}: {r.detail} | response {_snippet(responses[i])}"
                f" | ground truth {_snippet(ground_truths[i])}"
            )
            frames = r.trace.rsplit("\n", 2)[0]  # the traceback without its last line (the varying message)
            if r.trace and frames not in self._seen_traces:
                self._seen_traces.add(frames)
                lines.append("  first traceback of this error:")
                lines.extend("    " + line for line in r.trace.rstrip().splitlines())
        self._append(lines)

    def _append(self, lines: list[str]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as fh:
            if not self._opened:  # a header per process: a resumed run appends below the first run's lines
                fh.write(f"# {datetime.now().isoformat(timespec='seconds')}: reward failures of this run\n")
                self._opened = True
            fh.write("\n".join(lines) + "\n")

    def warn_once(self, step: int | None, results: Sequence[SampleResult | None], phase: str = "") -> None:
        errors, timeouts = failure_counts(results)
        if phase in self.warned or not errors + timeouts:
            return
        self.warned.add(phase)
        counted = "val/*/score_errors" if phase else "reward/errors and reward/timeouts every step"
        where = f"{'in' if phase else 'at'} {_at(step, phase)}"
        print(
            f"warning: the reward function failed on {errors + timeouts} of {len(results)} samples {where} "
            f"({errors} errors, {timeouts} timeouts; first: {_first_failure(results)}); failed samples score 0 and "
            f"are counted in {counted}; each failure and its first traceback: "
            f"{self.path} (this warning is shown once)",
            file=self.stream or sys.stderr,
            flush=True,
        )


def check_failure_rate(
    step: int | None,
    results: Sequence[SampleResult | None],
    max_failure_rate: float | None,
    log_path: Path | None = None,
) -> None:
    """Raise :class:`RewardFailureError` (one line) when more samples failed than ``max_failure_rate`` allows."""
    limit = allowed_failures(len(results), max_failure_rate)
    errors, timeouts = failure_counts(results)
    if limit is None or errors + timeouts <= limit:
        return
    at = f" at step {step}" if step is not None else ""
    unscored = sum(r is None for r in results)
    counted = f"{errors + timeouts} of {len(results)} reward samples failed{at}"
    if unscored:
        counted = f"at least {counted} (scoring stopped there; {unscored} not scored)"
    where = f"; each failure and its traceback: {log_path}" if log_path is not None else ""
    raise RewardFailureError(
        f"{counted} ({errors} errors, {timeouts} timeouts), more than reward.max_failure_rate={max_failure_rate:g} "
        f"allows; first: {_first_failure(results)}{where}; fix the reward function (or raise reward.timeout_s, or "
        "reward.max_failure_rate: 1 never stops)"
    )
