"""Partial rollout and dynamic sampling in step: rounds of bounded generation until the B oldest groups in flight
are finished and kept (the rounds themselves, their FIFO order and staleness bound: partial_rollout.py). The rounds
of step k run on the weights the trainer holds (version k - 1); a sample continued from earlier rounds carries the
versions of the tokens it has, so :attr:`Produced.versions` is per token and the trainer applies the behaviour
correction to samples with older tokens.

Syncs: after every update, as the synchronous schedule (colocated, or on a rollout pool with ``max_staleness=0``).
Checkpoint: the groups in flight, every token, log-prob and version of them (``rollout_buffer.pt``), so a resume
continues them. With one full-length round, no extra groups and no dynamic sampling it is the synchronous schedule,
bitwise.
"""

from __future__ import annotations

from typing import Any

from ..partial_rollout import build_scheduler
from .base import Produced, Schedule, rollout_params, scorer


class Rounds(Schedule):
    def __init__(self, run: Any) -> None:
        super().__init__(run)
        self.scheduler = build_scheduler(run.cfg, run.sampler, run.dataset)

    def next_batch(self, step: int, timer: Any) -> Produced:
        run = self.run
        got = self.scheduler.collect(step, rollout_params(run, step), run.workers.generate_requests, scorer(run), timer)
        return Produced(got.batch, got.rewards, got.metrics, got.versions)
