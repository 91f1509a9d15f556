"""What every rollout schedule shares: the batch a schedule hands the trainer (:class:`Produced`), the interface the
trainer calls (:class:`Schedule`), and the stages two or more schedules run (sampling parameters, scoring, the
rollout pool's sync).

A schedule owns three things the trainer never asks about: where the step's batch comes from
(:meth:`Schedule.next_batch`), when the rollout side gets the trainer's weights (:meth:`Schedule.hand_on`, and what
must settle before a validation or a checkpoint), and what of it is in flight when a checkpoint is taken
(:meth:`Schedule.save` / :meth:`Schedule.resume`). The checkpoint files are the ones every earlier release wrote:
``rollout_buffer.pt`` (partial rollout's groups in flight) and ``pending_rollout.pt`` (a rollout pool's batches,
or its rounds, in flight); a schedule reading a checkpoint that holds what it does not make says so in one line
and skips it (those prompts were drawn before the sampler state was saved: they are not drawn again).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..engines import SampleBatch, SamplingParams
from ..partial_rollout import STATE_FILE as ROUNDS_FILE

IN_FLIGHT_FILE = "pending_rollout.pt"  # a rollout pool's batches or rounds in flight, beside the engines' files


@dataclass
class Produced:
    """A step's batch and its provenance."""

    batch: SampleBatch
    rewards: torch.Tensor  # one per sequence
    metrics: dict[str, float]
    versions: torch.Tensor | None = None  # each token's weights version; None: all from the trainer's weights
    # the staleness study (lagged.py): measure the behaviour correction this run does not apply
    measure_drift: bool = False


class Schedule:
    """One way of producing a batch. Subclasses implement :meth:`next_batch`; the rest has a default: the
    rollout side gets the new weights after every update, nothing is in flight across steps."""

    IN_FLIGHT_KIND: str | None = None  # what this schedule keeps in pending_rollout.pt: "batches" | "rounds"
    scheduler: Any = None  # partial_rollout.RolloutScheduler where the schedule runs rounds (rollout_buffer.pt)

    def __init__(self, run: Any) -> None:
        self.run = run

    def next_batch(self, step: int, timer: Any) -> Produced:
        """Step ``step``'s batch, scored; stage seconds into ``timer`` (metrics.Timer)."""
        raise NotImplementedError

    def hand_on(self, step: int, timer: Any) -> dict[str, float]:
        """After step ``step``'s update: the new weights to the rollout side, when this schedule's rhythm says."""
        with timer("sync"):
            return self.run.workers.sync_weights()

    def validating(self, step: int) -> contextlib.AbstractContextManager:
        """Around step ``step``'s validation (which generates on the rollout side)."""
        return contextlib.nullcontext()

    def validation_generate(self) -> Any:
        """How validation generates (validation.py's Generate): the workers' single-turn chunks by default."""
        return self.run.workers.generate_each

    def validation_metrics(self) -> dict[str, float]:
        """What the schedule counted during the last validation (``val/...``)."""
        return {}

    @property
    def in_flight(self) -> bool:
        """Whether a batch for a later step is generated already (a resume then sends no weights: that step does)."""
        return False

    def settle(self) -> None:
        """Wait for work in flight that moves the sampler or the scheduler's groups (before their state is saved)."""

    def in_flight_state(self) -> dict[str, Any] | None:
        """What ``pending_rollout.pt`` holds: the batches in flight, waited for; None when nothing is."""
        return None

    def load_in_flight(self, state: dict[str, Any]) -> None:
        raise NotImplementedError  # only a schedule with an IN_FLIGHT_KIND is given one

    def close(self) -> None:
        """After the workers are shut down: anything still in flight fails and returns."""

    # ------------------------------------------------------------------------------------------- checkpoint

    def save(self, directory: Path) -> None:
        """What is in flight, into checkpoint ``directory``; called before the sampler state is saved."""
        self.settle()
        if self.scheduler is not None:  # the groups in flight, every token of them: a resume continues them
            torch.save(self.scheduler.state_dict(), directory / ROUNDS_FILE)
        state = self.in_flight_state()
        if state is not None:
            torch.save(state, directory / IN_FLIGHT_FILE)

    def resume(self, checkpoint: Path, sampler_state: dict[str, Any]) -> None:
        """Load what ``checkpoint`` holds in flight (the engines' weights are loaded already), the prompt sampler's
        state, then the rounds' groups (that order: a sampler that refuses its state is the error a user sees). The
        rollout side gets the loaded weights now unless a batch is in flight, whose step sends them as the
        uninterrupted run did at that step."""
        from ..partial_rollout import load_scheduler

        self._load_in_flight(Path(checkpoint) / IN_FLIGHT_FILE)
        if not self.in_flight:
            self.run.workers.sync_weights()
        self.run.sampler.load_state_dict(sampler_state)
        load_scheduler(self.scheduler, checkpoint)

    def _load_in_flight(self, path: Path) -> None:
        if not path.is_file():  # the last step's checkpoint, or one of a schedule that keeps nothing in flight
            return
        if self.IN_FLIGHT_KIND is None:
            print(
                f"{path}: this checkpoint holds a rollout batch in flight and this run keeps none in flight (no "
                "rollout pool one step off: rollout_pool.devices_per_node=0 or max_staleness=0): its prompts are "
                "skipped",
                flush=True,
            )
            return
        state = torch.load(path, weights_only=True)
        if ("rounds" if "rounds" in state else "batches") != self.IN_FLIGHT_KIND:
            saved = "partial rollout / dynamic sampling rounds" if "rounds" in state else "rollout batches"
            print(
                f"{path}: this checkpoint holds {saved} in flight, which this run's settings (partial_rollout, "
                "dynamic_sampling, rollout_pool) do not make: their prompts are skipped",
                flush=True,
            )
            return
        self.load_in_flight(state)


# ----------------------------------------------------------------------------------------------- shared stages


def rollout_params(run: Any, step: int) -> SamplingParams:
    r = run.cfg.rollout
    return SamplingParams(
        n=r.n,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        max_new_tokens=run.cfg.data.max_response_length,
        seed=run.cfg.trainer.seed * 1_000_003 + step,  # a function of the step: resumed runs sample alike
    )


def score(run: Any, batch: SampleBatch, prompts: list[Any], step: int) -> tuple[torch.Tensor, dict[str, float]]:
    """Rewards of ``batch`` (group g's samples answer ``prompts[g]``) and the scorer's metrics."""
    from ..rewards import compute_rewards

    rc = run.cfg.reward
    rows = [prompts[int(g)] for g in batch.group_index]
    lengths = batch.response_lengths
    texts = run.tokenizer.batch_decode(
        [ids[:n].tolist() for ids, n in zip(batch.response_ids, lengths, strict=True)], skip_special_tokens=True
    )
    return compute_rewards(
        texts,
        [p.ground_truth for p in rows],
        [p.data_source for p in rows],
        reward_fn=rc.reward_fn,
        extra_infos=[p.extra_info for p in rows],
        response_lengths=lengths,
        max_response_length=run.cfg.data.max_response_length,
        overlong_buffer_length=rc.overlong_buffer_length,
        overlong_penalty_factor=rc.overlong_penalty_factor,
        timeout_s=rc.timeout_s,
        num_workers=rc.num_workers,
        max_failure_rate=rc.max_failure_rate,
        error_log=run.reward_log,
        step=step,
    )


def scorer(run: Any) -> Any:
    """The rounds' scoring call (partial_rollout.ScoreFn): a batch of finished groups, their dataset rows."""

    def score_rows(batch: SampleBatch, rows: list[int], at_step: int) -> tuple[torch.Tensor, dict[str, float]]:
        return score(run, batch, [run.dataset[i] for i in rows], at_step)

    return score_rows


def zero_variance_share(rewards: torch.Tensor, group_index: torch.Tensor) -> float:
    """The share of groups whose rewards are all equal (zero advantage: the update learns nothing from them)."""
    groups = group_index.unique()
    flat = sum(1 for g in groups if rewards[group_index == g].unique().numel() == 1)
    return flat / max(len(groups), 1)


def sync_pool(workers: Any, *, extra: bool) -> dict[str, float]:
    """The trainer's weights to the rollout pool, unless it holds them already (a validation step's sync after its
    update leaves the next step's sync nothing new to send). ``extra``: a sync outside the schedule's rhythm (for
    a validation), logged as ``sync/extra_s`` alone."""
    if workers.rollout_version == workers.version:
        return {}
    metrics = workers.sync_weights()
    return {"sync/extra_s": metrics["sync/time_s"]} if extra else metrics
