"""Partial rollout and dynamic sampling: rollout batches that never wait for their longest response, and no update
on groups whose rewards are all equal.

A synchronous step generates until the longest of its n x B responses ends. Here generation runs in *rounds*,
each bounded by a token budget (``partial_rollout.round_tokens``): a sample that has not ended when its round's
budget runs out is kept, unfinished, and continued in the next round (a request with n = 1 whose prompt is the
original prompt plus the tokens so far; the rollout engine re-prefills it under its current weights). A sample
is forced to finish in its ``max_rounds``-th round (its budget is then whatever is left of
``data.max_response_length``). While long samples continue, extra prompt groups are in flight
(``partial_rollout.extra_groups``), so each step has finished groups to train on.

The schedule, per step (weights version v = step - 1, the number of updates so far):

1. admit: draw prompt groups from the sampler until ``B + extra_groups`` groups are in flight (B =
   ``data.train_batch_size``); dynamic sampling may draw replacements beyond that, up to its bound;
2. run a round over every unfinished sample (at least one round per step, more while the B oldest groups are not
   all finished); a group whose n samples have all finished is scored at once;
3. train on the B *oldest* groups in flight (first in, first out).

Invariants (tests/unit/test_partial_rollout.py checks them under random lengths and budgets):
- a group goes to training only when all its n samples are finished, so the group normalisation of advantages
  is unchanged, and every drawn prompt's n samples are trained exactly once (nothing is discarded, except the
  zero-variance groups dynamic sampling drops by design);
- every token carries the weights version that generated it, and no trained token is more than
  ``max_rounds - 1`` versions old: ``extra_groups <= (max_rounds - 1) x B`` bounds the groups in flight, and
  FIFO training then trains every group within ``max_rounds - 1`` steps of its admission (the proof is in
  docs/partial-rollout.md);
- with one round (``round_tokens >= data.max_response_length``), no extra groups and no dynamic sampling a step
  draws, generates, scores and trains exactly what the synchronous schedule (schedules/synchronous.py) does
  (bitwise, one rollout group: the request seeds are ``generate``'s).

Dynamic sampling (``dynamic_sampling.enabled``; verl's DAPO ``filter_groups``): a scored group whose n rewards are
all equal has zero advantage everywhere and teaches nothing, so it is dropped and a replacement prompt group is
drawn (with partial rollout the groups already in flight move up first). At most ``max_draws - 1`` rollout
batches of replacements per step (verl's ``max_num_gen_batches``); when that bound is hit the step trains on the
oldest dropped groups of the step to fill its batch and says so, once per run (``dynamic/bound_hit`` every step).

How we differ from the peers: ChatLearn (partial_rollout_manager.py) releases a prompt's finished samples as soon as
enough of them are done and recomputes pi_old with no behaviour correction; APRIL (slime) trains whichever groups
finish first, which favours short responses; verl's DAPO raises an error when its draw bound is hit. Here
training is FIFO (no length bias, an exact staleness bound), the behaviour correction for mixed-version samples
is :mod:`gspo_ascend.algorithms.behavior`, and a hit bound trains on and is reported. The scheduler's state (the
groups in flight, with every token, log-prob and version) is part of the checkpoint, so a resume equals the
uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .config import effective_rounds
from .engines.base import Request, SampleBatch, SamplingParams
from .engines.routing import merge_segments

STATE_FILE = "rollout_buffer.pt"  # in a checkpoint directory, beside the engines' files
COUNT_METRICS = ("reward/no_answer", "reward/timeouts", "reward/errors")  # summed over scoring calls, not averaged


@dataclass
class Sample:
    tokens: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)  # the rollout engine's log-probs, one per token
    versions: list[int] = field(default_factory=list)  # the weights version that generated each token
    rounds: int = 0
    finished: bool = False  # no more rounds: EOS, the response length reached, or its last round done
    eos: bool = False  # the engine ended it (SampleBatch.finished of its last round)
    # the MoE experts of every token fed so far, each from the round that first fed it (engines/routing.py)
    routes: torch.Tensor | None = None


@dataclass
class Group:
    gid: int  # admission order: training is first in, first out
    index: int  # the prompt's row in the training set
    prompt: list[int]
    samples: list[Sample]
    rewards: list[float] | None = None  # set when every sample has finished (scored once)

    @property
    def ready(self) -> bool:
        return self.rewards is not None


@dataclass
class Collected:
    """What a step trains on: B groups of n samples, their rewards, each token's version, and the step's metrics."""

    batch: SampleBatch
    indices: list[int]  # each group's row in the training set
    rewards: torch.Tensor  # [B * n]
    versions: torch.Tensor  # [B * n, R] int64, -1 at padding
    metrics: dict[str, float]


GenerateFn = Callable[[list[Request], SamplingParams], SampleBatch]
ScoreFn = Callable[[SampleBatch, list[int], int], tuple[torch.Tensor, dict[str, float]]]  # batch, rows, step


class RolloutScheduler:
    """The groups in flight across steps and the schedule of the module docstring. ``draw()`` returns the next
    batch of prompt rows from the sampler, ``prompt_of(row)`` a row's prompt token ids."""

    def __init__(
        self,
        *,
        batch_groups: int,
        n: int,
        width: int,
        round_tokens: int,
        max_rounds: int,
        extra_groups: int,
        dynamic: bool,
        max_draws: int,
        draw: Callable[[], list[int]],
        prompt_of: Callable[[int], Sequence[int]],
    ):
        self.b, self.n, self.width = batch_groups, n, width
        self.round_tokens, self.max_rounds = min(round_tokens, width), effective_rounds(round_tokens, max_rounds, width)
        if not 0 <= extra_groups <= (self.max_rounds - 1) * batch_groups:
            raise ValueError(f"extra_groups={extra_groups} outside [0, (max_rounds - 1) x batch_groups]")
        self.capacity = batch_groups + extra_groups
        self.dynamic, self.replace_bound = dynamic, (max_draws - 1) * batch_groups if dynamic else 0
        self.draw, self.prompt_of = draw, prompt_of
        self.groups: list[Group] = []  # in flight (admitted, not trained, not dropped), in gid order
        self.queue: list[int] = []  # rows drawn from the sampler and not admitted yet
        self.next_gid = 0
        self.warned_bound = False

    # ------------------------------------------------------------------------------------------- a step

    def collect(
        self,
        step: int,
        params: SamplingParams,
        generate: GenerateFn,
        score: ScoreFn,
        timer: Any,
        version: int | None = None,
    ) -> Collected:
        """Run rounds until the B oldest groups in flight are finished and kept; take them (module docstring).
        ``params``: the step's sampling parameters (``max_new_tokens`` = R, ``seed`` = the step's seed);
        ``version``: the weights version generating these rounds (default step - 1, the trainer's: colocated; one
        step off, the rollout pool's older one). Lags are logged against step - 1, the version that trains them."""
        version, stats = (step - 1 if version is None else version), _Stats()
        free, dropped = self.capacity - len(self.groups), []
        bound_hit = False
        while True:
            self._admit(free + min(len(dropped), self.replace_bound), stats)
            unready = [g for g in self.groups if not g.ready]
            head = self.groups[: self.b]
            if len(head) == self.b and all(g.ready for g in head) and (stats.rounds or not unready):
                break
            if not unready:  # every group in flight is scored, too few kept, no replacement allowed: the bound
                if not dropped:
                    raise RuntimeError("partial rollout: fewer groups in flight than a batch and none to admit")
                bound_hit = True
                self._restore(dropped, self.b - len(self.groups))
                continue
            self._round(version, params, generate, stats, timer)
            dropped += self._score_ready(step, score, stats, timer)
        if bound_hit:
            self._say_bound(step)
        taken, self.groups = self.groups[: self.b], self.groups[self.b :]
        collected = self._batch(taken)
        collected.metrics = stats.metrics(collected, step - 1, len(dropped), bound_hit) | self._flight_metrics()
        return collected

    def _admit(self, allowed: int, stats: _Stats) -> None:
        while len(self.groups) < self.capacity and stats.admitted < allowed:
            if not self.queue:
                self.queue = list(self.draw())
            row = self.queue.pop(0)
            samples = [Sample() for _ in range(self.n)]
            self.groups.append(Group(self.next_gid, row, [int(t) for t in self.prompt_of(row)], samples))
            self.next_gid += 1
            stats.admitted += 1

    def _round(self, version: int, params: SamplingParams, generate: GenerateFn, stats: _Stats, timer: Any) -> None:
        """One generate call over every unfinished sample: a fresh group is one request of n, a started one a
        continuation (n = 1) per unfinished sample."""
        requests, targets = [], []
        base, offset = round_seed(params.seed, stats.rounds), 0
        for g in self.groups:
            if g.ready:
                continue
            if all(s.rounds == 0 for s in g.samples):
                requests.append(Request(tuple(g.prompt), self.n, self._budget(g.samples[0]), base + offset))
                targets.append(g.samples)
                offset += self.n
                continue
            for s in g.samples:
                if not s.finished:
                    requests.append(Request(tuple(g.prompt + s.tokens), 1, self._budget(s), base + offset))
                    targets.append([s])
                    offset += 1
                    stats.continued += 1
                    stats.prefill += len(g.prompt) + len(s.tokens)
        with timer("rollout"):
            out = generate(requests, dataclasses.replace(params, max_new_tokens=self.width))
        lengths, row = out.response_lengths.tolist(), 0
        for samples in targets:
            for s in samples:
                k = lengths[row]
                s.tokens += out.response_ids[row, :k].tolist()
                s.logps += out.rollout_log_probs[row, :k].tolist()
                s.versions += [version] * k
                if out.routed_experts is not None:
                    s.routes = merge_segments(s.routes, out.routed_experts[row])
                s.rounds += 1
                s.eos = bool(out.finished[row])
                s.finished = s.eos or len(s.tokens) >= self.width or s.rounds >= self.max_rounds
                stats.generated += k
                row += 1
        stats.rounds += 1

    def _budget(self, s: Sample) -> int:
        left = self.width - len(s.tokens)
        return left if s.rounds + 1 >= self.max_rounds else min(self.round_tokens, left)

    def _score_ready(self, step: int, score: ScoreFn, stats: _Stats, timer: Any) -> list[Group]:
        """Score the groups that finished this round, in one call; with dynamic sampling, drop (and return) those
        whose n rewards are all equal."""
        done = [g for g in self.groups if not g.ready and all(s.finished for s in g.samples)]
        if not done:
            return []
        with timer("reward"):
            rewards, metrics = score(self._batch(done).batch, [g.index for g in done], step)
        stats.add_scores(metrics, len(rewards))
        for g, r in zip(done, rewards.view(len(done), self.n).tolist(), strict=True):
            g.rewards = r
        flat = [g for g in done if max(g.rewards) == min(g.rewards)]
        stats.scored_groups += len(done)
        stats.zero_var_groups += len(flat)
        if not self.dynamic:
            return []
        self.groups = [g for g in self.groups if g not in flat]
        return flat

    def _restore(self, dropped: list[Group], count: int) -> None:
        """The draw bound is hit: the oldest ``count`` groups dropped this step go back in flight."""
        back = sorted(dropped, key=lambda g: g.gid)[:count]
        for g in back:
            dropped.remove(g)
        self.groups = sorted(self.groups + back, key=lambda g: g.gid)

    def _say_bound(self, step: int) -> None:
        if not self.warned_bound:
            self.warned_bound = True
            print(
                f"warning: dynamic sampling: step {step} drew {self.replace_bound // self.b} rollout batches of "
                "replacements and still lacked groups with reward variance; it trained on zero-variance groups to "
                "fill the batch (dynamic/bound_hit counts such steps; raise dynamic_sampling.max_draws)",
                file=sys.stderr,
                flush=True,
            )

    # ------------------------------------------------------------------------------------------- output

    def _batch(self, groups: list[Group]) -> Collected:
        """The groups' samples as a training batch of width R: original prompts, the concatenated segments."""
        rows = [(g, s) for g in groups for s in g.samples]
        r = self.width
        ids = torch.zeros(len(rows), r, dtype=torch.long)
        mask = torch.zeros(len(rows), r)
        logps = torch.zeros(len(rows), r)
        versions = torch.full((len(rows), r), -1, dtype=torch.long)
        for i, (_, s) in enumerate(rows):
            k = len(s.tokens)
            ids[i, :k] = torch.tensor(s.tokens, dtype=torch.long)
            mask[i, :k] = 1.0
            logps[i, :k] = torch.tensor(s.logps, dtype=torch.float32)
            versions[i, :k] = torch.tensor(s.versions, dtype=torch.long)
        routes = [s.routes for _, s in rows]
        batch = SampleBatch(
            routed_experts=routes if rows and all(r is not None for r in routes) else None,
            prompt_ids=[list(g.prompt) for g, _ in rows],
            response_ids=ids,
            response_mask=mask,
            rollout_log_probs=logps,
            group_index=torch.arange(len(groups), dtype=torch.long).repeat_interleave(self.n),
            finished=torch.tensor([s.eos for _, s in rows], dtype=torch.bool),
        )
        rewards = torch.tensor([x for g in groups for x in (g.rewards or [0.0] * self.n)], dtype=torch.float32)
        return Collected(batch, [g.index for g in groups], rewards, versions, {})

    def _flight_metrics(self) -> dict[str, float]:
        started = sum(1 for g in self.groups for s in g.samples if s.rounds and not s.finished)
        return {"partial/inflight_groups": float(len(self.groups)), "partial/unfinished_samples": float(started)}

    # ------------------------------------------------------------------------------------------- checkpoint

    def state_dict(self) -> dict[str, Any]:
        return {
            "groups": [dataclasses.asdict(g) for g in self.groups],
            "queue": list(self.queue),
            "next_gid": self.next_gid,
            "shape": {"batch_groups": self.b, "n": self.n, "width": self.width},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from .errors import UserError

        shape = {"batch_groups": self.b, "n": self.n, "width": self.width}
        if state["shape"] != shape:
            raise UserError(
                f"the checkpoint's partial rollout buffer was made for {state['shape']}, this run has {shape} "
                "(data.train_batch_size, rollout.n, data.max_response_length); resume with the same values"
            )
        self.groups = [Group(**{**g, "samples": [Sample(**s) for s in g["samples"]]}) for g in state["groups"]]
        self.queue, self.next_gid = list(state["queue"]), int(state["next_gid"])


class _Stats:
    """What one step's rounds did, turned into ``partial/*``, ``dynamic/*`` and ``reward/*`` metrics."""

    def __init__(self) -> None:
        self.rounds = self.admitted = self.continued = self.prefill = self.generated = 0
        self.scored_groups = self.zero_var_groups = 0
        self.scores: dict[str, float] = {}
        self.scored = 0

    def add_scores(self, metrics: dict[str, float], count: int) -> None:
        """Reward metrics of several scoring calls: counts summed, means weighted by samples."""
        for k, v in metrics.items():
            if not self.scored:  # one call (a synchronous step): its metrics exactly
                self.scores[k] = v
            elif k in COUNT_METRICS:
                self.scores[k] += v
            else:
                self.scores[k] = (self.scores[k] * self.scored + v * count) / (self.scored + count)
        self.scored += count

    def metrics(self, c: Collected, trained_by: int, dropped: int, bound_hit: bool) -> dict[str, float]:
        """``trained_by``: the weights version that trains the batch; every lag is counted from it."""
        mask = c.batch.response_mask.bool()
        lag = (trained_by - c.versions)[mask].float()
        stale_rows = ((trained_by - c.versions) * mask.long() > 0).any(-1)
        return dict(self.scores) | {
            "reward/zero_var_group_frac": self.zero_var_groups / max(self.scored_groups, 1),
            "partial/rounds": float(self.rounds),
            "partial/admitted_groups": float(self.admitted),
            "partial/continued_samples": float(self.continued),
            "partial/prefill_tokens": float(self.prefill),
            "partial/generated_tokens": float(self.generated),
            "partial/lag_mean": float(lag.mean()) if lag.numel() else 0.0,
            "partial/lag_max": float(lag.max()) if lag.numel() else 0.0,
            "partial/stale_sample_frac": float(stale_rows.float().mean()) if len(stale_rows) else 0.0,
            "dynamic/dropped_groups": float(dropped),
            "dynamic/bound_hit": float(bound_hit),
        }


def round_seed(step_seed: int, round_index: int) -> int:
    """The seed base of a step's round; request j draws from ``base + (samples of the requests before it)``. The
    first round uses the step's seed itself (``generate``'s seeding), so one full-length round is the synchronous
    rollout; later rounds a hash of (step seed, round)."""
    if round_index == 0:
        return step_seed
    digest = hashlib.sha256(f"{step_seed}:{round_index}".encode()).digest()
    return int.from_bytes(digest[:6], "little")  # vLLM seeds are 64-bit; room for base + offset


def build_scheduler(cfg: Any, sampler: Any, dataset: Any) -> RolloutScheduler | None:
    """The scheduler for ``cfg`` (None when neither partial rollout nor dynamic sampling is on)."""
    from .config import max_extra_groups

    p, d = cfg.partial_rollout, cfg.dynamic_sampling
    if p.round_tokens is None and not d.enabled:
        return None
    width = cfg.data.max_response_length
    return RolloutScheduler(
        batch_groups=cfg.data.train_batch_size,
        n=cfg.rollout.n,
        width=width,
        round_tokens=p.round_tokens or width,
        max_rounds=p.max_rounds if p.round_tokens else 1,
        extra_groups=max_extra_groups(cfg) if p.extra_groups is None else p.extra_groups,
        dynamic=d.enabled,
        max_draws=d.max_draws,
        draw=sampler.next_batch,
        prompt_of=lambda row: dataset[row].prompt_ids,
    )


def load_scheduler(scheduler: RolloutScheduler | None, checkpoint: Any) -> None:
    """Restore the groups in flight from ``checkpoint`` (a directory); a buffer this run has no use for is said."""
    from pathlib import Path

    path = Path(checkpoint) / STATE_FILE
    if not path.is_file():
        return  # a checkpoint of a run without partial rollout / dynamic sampling: nothing in flight
    state = torch.load(path, weights_only=True)
    if scheduler is None:
        if state["groups"] or state["queue"]:
            print(
                f"warning: {path}: {len(state['groups'])} prompt groups in flight and {len(state['queue'])} drawn "
                "prompts are dropped: this run has partial rollout and dynamic sampling off",
                file=sys.stderr,
                flush=True,
            )
        return
    scheduler.load_state_dict(state)
