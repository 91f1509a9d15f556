"""A seeded, resumable sampler of prompt-index batches.

Epoch ``e`` visits the prompts in the order of ``random.Random(seed + e).shuffle`` (Python's ``random`` is
stable across versions for a given seed, unlike numpy's ``Generator`` stream), in batches of
``batch_size``; the last partial batch of an epoch is dropped so every rollout batch has the configured number
of prompts (GSPO groups and the minibatch split depend on it). The state is two integers, epoch and position,
so a resumed run draws exactly the batches an uninterrupted run would have drawn.

How we differ from verl: verl checkpoints torchdata's ``StatefulDataLoader`` state (opaque, tied to the
worker count and the torchdata version); ours is ``{"epoch", "position"}`` plus the sizes it was made for,
and a resume with different data is refused with a message instead of silently re-ordering.
"""

from __future__ import annotations

import random

from ..errors import UserError


class PromptSampler:
    def __init__(self, num_prompts: int, batch_size: int, seed: int = 0, shuffle: bool = True):
        if batch_size <= 0:
            raise UserError(f"data.train_batch_size must be > 0, got {batch_size}")
        if num_prompts < batch_size:
            raise UserError(
                f"the dataset has {num_prompts} prompts (after filtering), fewer than data.train_batch_size="
                f"{batch_size}; lower data.train_batch_size or add data"
            )
        self.num_prompts, self.batch_size, self.seed, self.shuffle = num_prompts, batch_size, seed, shuffle
        self.epoch = 0
        self.position = 0  # batches already drawn in this epoch
        self._order_epoch, self._order = -1, []

    @property
    def batches_per_epoch(self) -> int:
        return self.num_prompts // self.batch_size

    def _epoch_order(self) -> list[int]:
        if self._order_epoch != self.epoch:
            order = list(range(self.num_prompts))
            if self.shuffle:
                random.Random(self.seed + self.epoch).shuffle(order)
            self._order_epoch, self._order = self.epoch, order
        return self._order

    def next_batch(self) -> list[int]:
        """Indices of the next ``batch_size`` prompts."""
        if self.position >= self.batches_per_epoch:
            self.epoch, self.position = self.epoch + 1, 0
        start = self.position * self.batch_size
        batch = self._epoch_order()[start : start + self.batch_size]
        self.position += 1
        return batch

    def __iter__(self):
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_prompts": self.num_prompts,
            "batch_size": self.batch_size,
        }

    def load_state_dict(self, state: dict) -> None:
        for key in ("num_prompts", "batch_size", "seed", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise UserError(
                    f"cannot resume the prompt sampler: the checkpoint has {key}={state[key]!r}, this run "
                    f"{getattr(self, key)!r}; resume with the same data files, data.train_batch_size and "
                    "trainer.seed, or start a new run (trainer.resume=never)"
                )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
