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
    batch: SampleBatch, micro_batch_size: int | None = None, max_tokens: int | None = None, shared_prefix: bool = False
) -> MicroBatchPlan:
    """Split ``batch`` into micro-batches; ``max_tokens`` (a token budget) wins over ``micro_batch_size``.

    With a budget, samples are placed longest first into the first micro-batch that still has room
    (first-fit decreasing); a sample longer than the budget gets a micro-batch of its own and is counted
    in ``oversized``. Without one, contiguous chunks of ``micro_batch_size`` samples (the last may be short).
    ``shared_prefix`` (actor.shared_prefix, budget only): samples of one prompt are placed together, as pieces
    that cost the prompt once (:func:`prefix_pieces`), so a micro-batch's row is what the budget counts.
    """
    n = len(batch)
    if max_tokens is not None:
        if max_tokens <= 0:
            raise ValueError(f"max_tokens per micro-batch must be > 0, got {max_tokens}")
        if shared_prefix:
            return _first_fit_pieces(prefix_pieces(batch, max_tokens), max_tokens)
        return _first_fit_decreasing(sample_tokens(batch), max_tokens)
    if micro_batch_size is None or micro_batch_size <= 0:
        raise ValueError(f"micro_batch_size must be > 0 when no token budget is set, got {micro_batch_size}")
    return MicroBatchPlan([list(range(i, min(i + micro_batch_size, n))) for i in range(0, n, micro_batch_size)])


def _first_fit_decreasing(costs: list[int], budget: int) -> MicroBatchPlan:
    return _first_fit_pieces([([i], cost) for i, cost in enumerate(costs)], budget)


def samples_by_prompt(prompts) -> dict[tuple[int, ...], list[int]]:
    """Sample indices per distinct prompt (by content), prompts in the order of their first sample: the samples a
    shared-prefix row (logprobs.shared_prefix_row) and the budget planner's pieces put together."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, prompt in enumerate(prompts):
        groups.setdefault(tuple(prompt), []).append(i)
    return groups


def shared_row_tokens(batch: SampleBatch) -> int:
    """Tokens of ``batch``'s shared-prefix row (logprobs.shared_prefix_row): each distinct prompt once, every
    response. A prompt with one sample costs its tokens, as a plain row's."""
    prompts = samples_by_prompt(batch.prompt_ids)
    return sum(len(p) for p in prompts) + int(batch.response_lengths.sum())


def prefix_pieces(batch: SampleBatch, budget: int) -> list[tuple[list[int], int]]:
    """The samples of each prompt (by content, in the batch's order) cut into pieces of at most ``budget`` tokens,
    each costing its prompt once plus its responses (a shared-prefix row's tokens, logprobs.shared_prefix_row): a
    piece takes the prompt's next sample while it fits. A sample alone costs its prompt + response, as always."""
    lengths = batch.response_lengths.tolist()
    pieces: list[tuple[list[int], int]] = []
    for prompt, members in samples_by_prompt(batch.prompt_ids).items():
        piece: list[int] = []
        cost = len(prompt)
        for i in members:
            if piece and cost + int(lengths[i]) > budget:
                pieces.append((piece, cost))
                piece, cost = [], len(prompt)
            piece.append(i)
            cost += int(lengths[i])
        pieces.append((piece, cost))
    return pieces


def _first_fit_pieces(pieces: list[tuple[list[int], int]], budget: int) -> MicroBatchPlan:
    """First-fit decreasing of pieces (sample indices, token cost); a piece over the budget (one sample longer
    than it) runs alone and is counted in ``oversized``."""
    order = sorted(range(len(pieces)), key=lambda p: (-pieces[p][1], pieces[p][0][0]))
    groups: list[list[int]] = []
    loads: list[int] = []
    oversized = 0
    for p in order:
        members, cost = pieces[p]
        if cost > budget:
            oversized += len(members)
            groups.append(list(members))
            loads.append(budget)  # full: nothing joins an oversized sample
            continue
        slot = next((g for g, load in enumerate(loads) if load + cost <= budget), None)
        if slot is None:
            groups.append(list(members))
            loads.append(cost)
        else:
            groups[slot] += members
            loads[slot] += cost
    # micro-batches in the order of their first sample, samples ascending: the plan reads like the batch
    groups = sorted((sorted(g) for g in groups), key=lambda g: g[0])
    return MicroBatchPlan(groups, oversized)


def micro_batches(
    batch: SampleBatch, micro_batch_size: int | None = None, max_tokens: int | None = None, shared_prefix: bool = False
) -> tuple[list[SampleBatch], MicroBatchPlan]:
    """The micro-batches of ``plan_micro_batches`` as SampleBatches, with the plan (to scatter results back)."""
    plan = plan_micro_batches(batch, micro_batch_size, max_tokens, shared_prefix)
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
