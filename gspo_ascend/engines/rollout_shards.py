"""How a rollout is spread over the workers' ranks: the rollout tensor-parallel groups (``tp`` consecutive ranks,
vLLM's external-launcher layout), the split of a batch of prompts over them with one seed per group, and the gather
of the ranks' batches back into one rollout batch. Pure functions the driver's dispatch (:mod:`gspo_ascend.workers`)
uses for every rollout engine; with ``tp = 1`` every rank is its own group. Why rollout TP runs this way:
:mod:`.vllm_rollout`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from ..errors import ConfigError
from .base import SampleBatch, SamplingParams

GROUP_SEED_STRIDE = 7919  # a prime: rollout group g samples with seed + 7919 * g (the TP = 1 dispatch's rule)


def rollout_tp_groups(world_size: int, tp: int) -> list[list[int]]:
    """The ranks of each rollout TP group: ``tp`` consecutive ranks, as vLLM's external-launcher layout cuts them
    (``initialize_model_parallel``: world -> [external DP, DP, PP, PCP, TP], TP innermost)."""
    if tp < 1 or world_size < 1 or world_size % tp:
        raise ConfigError(
            f"config key 'rollout.tensor_parallel_size' ({tp}) must divide the number of workers "
            f"({world_size} = trainer.nnodes x trainer.devices_per_node)"
        )
    from ..placement import consecutive_groups  # torch-free; placement checks the same groups against nodes

    return consecutive_groups(world_size, tp)


def split_rollout_prompts(
    prompts: Sequence[Sequence[int]], params: SamplingParams, world_size: int, tp: int = 1
) -> list[tuple[list[list[int]], SamplingParams]]:
    """What each of ``world_size`` ranks generates: rollout group g (ranks ``g*tp .. g*tp+tp-1``) gets the g-th
    of ``world_size // tp`` equal contiguous slices of ``prompts`` and seed ``params.seed + 7919 * g``; every rank
    of a group gets the same slice and seed (vLLM's TP ranks must run the same requests in lockstep). With
    ``tp = 1`` this is one slice per rank, as before rollout TP existed."""
    groups = rollout_tp_groups(world_size, tp)
    if len(prompts) % len(groups):
        raise ValueError(f"{len(prompts)} prompts do not split evenly over {len(groups)} rollout groups")
    per = len(prompts) // len(groups)
    out = []
    for g, ranks in enumerate(groups):
        part = [list(p) for p in prompts[g * per : (g + 1) * per]]
        seeded = dataclasses.replace(params, seed=params.seed + GROUP_SEED_STRIDE * g)
        out.extend((part, seeded) for _ in ranks)
    return out


def gather_rollout_shards(shards: Sequence[SampleBatch], tp: int = 1) -> SampleBatch:
    """The inverse of :func:`split_rollout_prompts`: one batch per rank in rank order -> the rollout batch.

    Takes the first rank's batch of every group (the other ``tp - 1`` hold the same samples) and shifts its
    ``group_index`` (local to the group's slice) by the prompts of the groups before it."""
    groups = rollout_tp_groups(len(shards), tp)
    leaders = [shards[ranks[0]] for ranks in groups]
    offset, parts = 0, []
    for batch in leaders:
        parts.append(batch.replace(group_index=batch.group_index.to(torch.long) + offset))
        offset += int(batch.group_index.max()) + 1 if len(batch) else 0
    return SampleBatch.concat(parts)
