"""The synchronous schedule, the paper's Algorithm 1 as written: each step draws B prompts, generates n responses
for each with the weights the trainer holds, scores them, and trains on them; after the update the rollout engine
gets the new weights. Nothing is in flight between steps, so a checkpoint holds no rollout state.

Where it runs: colocated (``rollout_pool.devices_per_node=0``) with partial rollout and dynamic sampling off. On two
pools the same semantics are :class:`~.pool.PoolAhead` with ``max_staleness=0``.
"""

from __future__ import annotations

from typing import Any

from .base import Produced, Schedule, rollout_params, score, zero_variance_share


class Synchronous(Schedule):
    def next_batch(self, step: int, timer: Any) -> Produced:
        run = self.run
        prompts = [run.dataset[i] for i in run.sampler.next_batch()]
        with timer("rollout"):
            batch = run.workers.generate([p.prompt_ids for p in prompts], rollout_params(run, step))
        with timer("reward"):
            rewards, metrics = score(run, batch, prompts, step)
        metrics["reward/zero_var_group_frac"] = zero_variance_share(rewards, batch.group_index)
        return Produced(batch, rewards, metrics)
