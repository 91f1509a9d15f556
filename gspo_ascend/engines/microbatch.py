"""How a train engine cuts its data: data-parallel shards, minibatches and micro-batches.

Three levels, outermost first:

- ``dp_shard``: the driver gives rank r of W the r-th slice *of every minibatch*, so that minibatch j of all
  ranks together is minibatch j of the global batch (what one optimizer step of a single-process run sees).
  Plain contiguous sharding would mix samples of different minibatches into one step.
- ``SampleBatch.split(k)``: the rank's shard into k contiguous minibatches (one optimizer step each).
- ``micro_batches``: a minibatch into forward/backward passes, either a fixed number of samples
  (``actor.micro_batch_size``) or a token budget (``actor.max_tokens_per_micro_batch``, prompt + response
  tokens). Gradients accumulate over micro-batches; the loss uses global counts, so the split never changes
  the result beyond float summation order.

How we differ from verl: verl's dynamic batch size balances token counts with Karmarkar-Karp over a fixed
number of partitions and then re-sorts outputs; we use first-fit-decreasing into as few micro-batches as the
budget allows (deterministic: ties broken by sample index), keep each micro-batch's samples in their
original order, and let a sample longer than the whole budget run alone instead of raising, counting it
(``oversized``) so the engine can report it as a metric.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gspo_ascend.engines.base import SampleBatch


@dataclass
class MicroBatchPlan:
    """Sample indices of each micro-batch (ascending within one), and how many samples exceeded the budget."""

    groups: list[list[int]] = field(default_factory=list)
    oversized: int = 0

    def __len__(self) -> int:
        return len(self.groups)


def sample_tokens(batch: SampleBatch) -> list[int]:
    """Prompt plus response tokens of every sample: the cost the token budget counts."""
    lengths = batch.response_lengths.tolist()
    return [len(p) + int(n) for p, n in zip(batch.prompt_ids, lengths, strict=True)]


def plan_micro_batches(
    batch: SampleBatch, micro_batch_size: int | None = None, max_tokens: int | None = None
) -> MicroBatchPlan:
    """Split ``batch`` into micro-batches; ``max_tokens`` (a token budget) wins over ``micro_batch_size``.

    With a budget, samples are placed longest first into the first micro-batch that still has room
    (first-fit decreasing); a sample longer than the budget gets a micro-batch of its own and is counted
    in ``oversized``. Without one, contiguous chunks of ``micro_batch_size`` samples (the last may be short).
    """
    n = len(batch)
    if max_tokens is not None:
        if max_tokens <= 0:
            raise ValueError(f"max_tokens per micro-batch must be > 0, got {max_tokens}")
        return _first_fit_decreasing(sample_tokens(batch), max_tokens)
    if micro_batch_size is None or micro_batch_size <= 0:
        raise ValueError(f"micro_batch_size must be > 0 when no token budget is set, got {micro_batch_size}")
    return MicroBatchPlan([list(range(i, min(i + micro_batch_size, n))) for i in range(0, n, micro_batch_size)])


def _first_fit_decreasing(costs: list[int], budget: int) -> MicroBatchPlan:
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    groups: list[list[int]] = []
    loads: list[int] = []
    oversized = 0
    for i in order:
        if costs[i] > budget:
            oversized += 1
            groups.append([i])
            loads.append(budget)  # full: nothing joins an oversized sample
            continue
        slot = next((g for g, load in enumerate(loads) if load + costs[i] <= budget), None)
        if slot is None:
            groups.append([i])
            loads.append(costs[i])
        else:
            groups[slot].append(i)
            loads[slot] += costs[i]
    # micro-batches in the order of their first sample, samples ascending: the plan reads like the batch
    groups = sorted((sorted(g) for g in groups), key=lambda g: g[0])
    return MicroBatchPlan(groups, oversized)


def micro_batches(
    batch: SampleBatch, micro_batch_size: int | None = None, max_tokens: int | None = None
) -> tuple[list[SampleBatch], MicroBatchPlan]:
    """The micro-batches of ``plan_micro_batches`` as SampleBatches, with the plan (to scatter results back)."""
    plan = plan_micro_batches(batch, micro_batch_size, max_tokens)
    return [batch.select(g) for g in plan.groups], plan


def dp_rows(n: int, world_size: int, minibatches: int) -> list[list[int]]:
    """Per rank, the rows of a global batch of ``n`` that :func:`dp_shard` gives it, in the shard's order."""
    if minibatches <= 0 or n % (minibatches * world_size):
        raise ValueError(f"a batch of {n} samples cannot be cut into {minibatches} minibatches x {world_size} ranks")
    size, part = n // minibatches, n // (minibatches * world_size)
    return [[j * size + rank * part + t for j in range(minibatches) for t in range(part)] for rank in range(world_size)]


def dp_shard(batch: SampleBatch, rank: int, world_size: int, minibatches: int) -> SampleBatch:
    """Rank ``rank``'s shard of a global rollout batch: the rank-th equal slice of each of the ``minibatches``
    contiguous minibatches, concatenated, so ``shard.split(minibatches)[j]`` on every rank together is
    exactly ``batch.split(minibatches)[j]``. ``len(batch)`` must divide by ``minibatches * world_size``."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size}")
    return batch.select(dp_rows(len(batch), world_size, minibatches)[rank])
