"""The selftest's record (one per check), how a check is timed and guarded, and the text / JSON renderings.

A :class:`Result` is what ``--json`` prints for each check: ``name``, ``status`` (pass / fail / skip), ``seconds``,
``detail`` (one line: what was measured, or why it failed or was skipped) and ``fix`` (one line, for failures). It
follows the doctor's :class:`~gspo_ascend.doctor.check.Check` (one line found, one line fix) but is a type of its
own: a selftest check has a duration and a third outcome, skip, that the doctor's ok / warn / fail does not have.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

STATUSES = ("pass", "fail", "skip")


@dataclass
class Result:
    name: str  # layer/check, e.g. ops/npu_rms_norm, rollout/hf, training/checkpoint
    status: str  # pass | fail | skip
    seconds: float
    detail: str  # one line: the measurement, or why it failed / was skipped
    fix: str = ""  # one line: what to do (failures only)

    def as_dict(self) -> dict:
        return asdict(self)


class CheckFailed(Exception):
    """Raised inside a check body: the check fails with this one-line detail (and ``fix``, if given)."""

    def __init__(self, detail: str, fix: str = ""):
        super().__init__(detail)
        self.detail, self.fix = detail, fix


class CheckSkipped(Exception):
    """Raised inside a check body: the check is skipped for this reason."""


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else '(no message)'}"


def run_check(name: str, body: Callable[[], str], fix: str, log: Path | None = None) -> Result:
    """Run ``body`` (returns the pass detail) as check ``name``: a CheckFailed / CheckSkipped / any exception becomes
    a fail or skip record instead of ending the selftest. ``fix`` is the check's hint for a failure; an unexpected
    exception's traceback goes to ``log`` (named in the detail) when one is given."""
    start = time.perf_counter()
    try:
        status, detail, hint = "pass", body(), ""
    except CheckSkipped as exc:
        status, detail, hint = "skip", str(exc), ""
    except CheckFailed as exc:
        status, detail, hint = "fail", exc.detail, exc.fix or fix
    except Exception as exc:  # a check must never end the run: every other layer still gets checked
        status, detail, hint = "fail", f"raised {first_line(exc)}", fix
        if log is not None:
            with log.open("a") as sink:
                traceback.print_exc(file=sink)
            detail += f" (traceback in {log})"
    return Result(name, status, round(time.perf_counter() - start, 2), detail, hint)


@contextlib.contextmanager
def output_to(path: Path) -> Iterator[None]:
    """Send this process's stdout and stderr (file descriptors 1 and 2, so also what vLLM, Ray and child processes
    print) to ``path`` for the duration of the block; the report itself is printed outside such blocks."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with path.open("ab") as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def render_line(r: Result) -> str:
    line = f"[{r.status}] {r.seconds:6.1f}s {r.name}: {r.detail}"
    if r.fix and r.status == "fail":
        line += f"\n              fix: {r.fix}"
    return line


def summary(results: list[Result], seconds: float) -> str:
    counts = ", ".join(f"{sum(r.status == s for r in results)} {s}" for s in STATUSES)
    return f"summary: {counts} in {seconds:.1f} s"


def render_json(results: list[Result]) -> str:
    return json.dumps([r.as_dict() for r in results], indent=2)


def exit_code(results: list[Result]) -> int:
    return 1 if any(r.status == "fail" for r in results) else 0
