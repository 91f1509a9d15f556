"""SIGTERM, the way Slurm, Kubernetes and most schedulers preempt a job: finish the step, save, exit 143.

The handler only records the signal (and says so in one line). The trainer looks at it at its safe point, after
each step: it saves a checkpoint of that step unless one was just saved, stops the workers and ends with
:class:`~gspo_ascend.errors.Stopped`, which the CLI turns into exit code 128 + 15 = 143. A second SIGTERM stops at
once, without saving (``SystemExit(143)``): the last checkpoint is then the newest one on disk.

Ray's driver start-up installs its own SIGTERM handlers (``ray.init`` a ``sys.exit``; its C++ core worker the
failure-signal handler, which dumps a stack and aborts: exit code 134, no checkpoint). :meth:`GracefulStop.install`
is therefore called again once the workers are up. A SIGTERM that lands while ``ray.init`` itself runs (seconds,
before any step) still ends the way Ray ends it; nothing has been trained then, so nothing is lost.

How we differ from verl: verl saves every ``save_freq`` steps, at the last step, and before a cloud capacity block
expires (``should_save_ckpt_esi``, from an expiration timestamp in the environment: Volcano MLP, SageMaker). A
scheduler's SIGTERM is the signal every other cluster gives, with a grace period; we save on it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any


def _say(line: str) -> None:
    # os.write, not print: the handler may interrupt a print to the same stream ("reentrant call" RuntimeError)
    try:
        os.write(sys.stderr.fileno(), (line + "\n").encode())
    except (OSError, ValueError, AttributeError):
        pass


class GracefulStop:
    """Records SIGTERM for the trainer's safe points; ``restore`` puts the handler found at the first install back."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: list[Any] = []

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # Python delivers signals to the main thread only; a trainer run elsewhere keeps the default
        previous = signal.signal(signal.SIGTERM, self._handle)
        if not self._previous:
            self._previous.append(previous)

    def restore(self) -> None:
        if self._previous and threading.current_thread() is threading.main_thread():
            previous = self._previous.pop()
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            _say("second SIGTERM: stopping now, without saving")
            raise SystemExit(128 + signum)
        self.signum = signum
        _say(
            "SIGTERM received: the current step finishes, a checkpoint is saved, then the run exits with code 143 "
            "(a second SIGTERM stops at once, without saving)"
        )
