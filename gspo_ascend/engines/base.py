"""The contract between the driver and the engines: one batch type and two small interfaces.

A :class:`SampleBatch` is a rollout batch on the host: prompts stay as unpadded token lists (engines pack or
pad them as they like), responses are right-padded to a fixed width ``R`` = ``data.max_response_length`` so
every per-token tensor the loss sees is ``[B, R]`` with one ``response_mask``. Log-probs everywhere are those of
the temperature-scaled distribution ``log_softmax(logits / T)`` at the sampled token, before top-p / top-k
truncation (verl's convention), so rollout-engine, recomputed and trainer log-probs are directly comparable.

How we differ from verl's ``DataProto``: a plain dataclass with a fixed, typed set of fields instead of a dict
of tensors plus a dict of numpy objects; ``select`` and ``concat`` are the only batch operations engines need.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

TENSOR_FIELDS = (
    "response_ids",
    "response_mask",
    "rollout_log_probs",
    "old_log_probs",
    "advantages",
    "group_index",
    "finished",
    "loss_mask",
)


@dataclass
class SampleBatch:
    prompt_ids: list[list[int]]  # B prompts (each repeated for its n samples), chat template applied
    response_ids: torch.Tensor  # [B, R] int64, right-padded with the pad id
    response_mask: torch.Tensor  # [B, R] float32: 1 for generated tokens (EOS included), 0 for padding
    rollout_log_probs: torch.Tensor | None = None  # [B, R] float32, from the rollout engine
    old_log_probs: torch.Tensor | None = None  # [B, R] float32, pi_old (recomputed or = rollout_log_probs)
    advantages: torch.Tensor | None = None  # [B] float32, one per sequence (group-normalised reward)
    group_index: torch.Tensor | None = None  # [B] int64, which prompt a sample answers
    # [B] bool: the engine ended the sample (EOS); False = it stopped at its token budget (max_new_tokens)
    finished: torch.Tensor | None = None
    # [B, R] float32: 1 at the tokens the loss trains, a part of response_mask; None = all of response_mask. A
    # multi-turn trajectory (agent_loop.py) has its tool turns in response_mask (context the model attends to) and
    # only the model's own tokens here: the loss, GSPO's length normalisation and the behaviour weight read it
    loss_mask: torch.Tensor | None = None
    # per sample, the MoE experts the rollout engine routed each fed token to: [tokens, layers, k] uint8 / int16
    # (engines/routing.py), tokens = prompt + response - 1 (the last sampled token is never fed); None = not recorded
    routed_experts: list[torch.Tensor] | None = None

    def __post_init__(self) -> None:
        b, r = self.response_ids.shape
        if len(self.prompt_ids) != b or tuple(self.response_mask.shape) != (b, r):
            raise ValueError(
                f"SampleBatch: {len(self.prompt_ids)} prompts, response_ids {tuple(self.response_ids.shape)}, "
                f"response_mask {tuple(self.response_mask.shape)} do not agree"
            )
        if self.loss_mask is not None and (
            self.loss_mask.shape != self.response_mask.shape or bool((self.loss_mask > self.response_mask).any())
        ):
            raise ValueError("SampleBatch: loss_mask must have response_mask's shape and lie within it")
        if self.routed_experts is not None and len(self.routed_experts) != b:
            raise ValueError(f"SampleBatch: {len(self.routed_experts)} routed_experts for {b} samples")

    def __len__(self) -> int:
        return len(self.prompt_ids)

    @property
    def trained_mask(self) -> torch.Tensor:
        """[B, R]: the tokens the loss trains (``loss_mask``, else every response token)."""
        return self.response_mask if self.loss_mask is None else self.loss_mask

    @property
    def response_lengths(self) -> torch.Tensor:
        return self.response_mask.sum(-1).long()

    def num_tokens(self) -> int:
        """Prompt plus response tokens: what a forward pass over this batch costs."""
        return sum(len(p) for p in self.prompt_ids) + int(self.response_mask.sum())

    def select(self, index: Sequence[int] | slice) -> SampleBatch:
        rows = list(range(len(self)))[index] if isinstance(index, slice) else list(index)
        idx = torch.as_tensor(rows, dtype=torch.long)
        kwargs: dict[str, Any] = {"prompt_ids": [self.prompt_ids[i] for i in rows]}
        if self.routed_experts is not None:
            kwargs["routed_experts"] = [self.routed_experts[i] for i in rows]
        for name in TENSOR_FIELDS:
            value = getattr(self, name)
            kwargs[name] = None if value is None else value.index_select(0, idx)
        return SampleBatch(**kwargs)

    def split(self, parts: int) -> list[SampleBatch]:
        """``parts`` contiguous, equal chunks (data-parallel shards, minibatches); ``len`` must divide."""
        if parts <= 0 or len(self) % parts:
            raise ValueError(f"cannot split a batch of {len(self)} samples into {parts} equal parts")
        size = len(self) // parts
        return [self.select(slice(i * size, (i + 1) * size)) for i in range(parts)]

    def replace(self, **changes: Any) -> SampleBatch:
        return dataclasses.replace(self, **changes)

    @staticmethod
    def concat(batches: Sequence[SampleBatch]) -> SampleBatch:
        if not batches:
            raise ValueError("SampleBatch.concat needs at least one batch")
        kwargs: dict[str, Any] = {"prompt_ids": [p for b in batches for p in b.prompt_ids]}
        routed = [b.routed_experts is not None for b in batches if len(b)]  # an empty batch carries no routes
        if routed and all(routed):
            kwargs["routed_experts"] = [r for b in batches for r in b.routed_experts or []]
        elif any(routed):
            raise ValueError("SampleBatch.concat: some batches carry routed_experts and some do not")
        for name in TENSOR_FIELDS:
            values = [getattr(b, name) for b in batches]
            kwargs[name] = None if any(v is None for v in values) else torch.cat(values, 0)
        return SampleBatch(**kwargs)


def empty_batch(width: int, pad_id: int) -> SampleBatch:
    """A batch of no samples and width ``width`` (a rollout group given no requests this round)."""
    return SampleBatch(
        prompt_ids=[],
        response_ids=torch.full((0, width), pad_id, dtype=torch.long),
        response_mask=torch.zeros(0, width),
        rollout_log_probs=torch.zeros(0, width),
        group_index=torch.zeros(0, dtype=torch.long),
        finished=torch.zeros(0, dtype=torch.bool),
    )


def check_prompt_tokens(prompts: Sequence[Sequence[int]], vocab_size: int) -> None:
    """Every rollout engine refuses empty prompts and ids outside the vocabulary with one line (a prompt
    tokenized with another tokenizer otherwise fails deep inside an embedding lookup or a vLLM worker)."""
    from ..errors import UserError

    for i, p in enumerate(prompts):
        if not p:
            raise UserError(f"prompt {i} is empty: every prompt needs at least one token (the chat template)")
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise UserError(
                f"prompt {i} holds token id {bad[0]} outside the model's vocabulary [0, {vocab_size}); "
                "was the data tokenized with another tokenizer? (model.tokenizer_path)"
            )


def existing_rank_file(path: str | Path, name: str) -> Path:
    """This rank's file of an engine checkpoint, or a one-line error when a resume points at an incomplete one."""
    from ..errors import UserError

    rank_file = Path(path) / name
    if not rank_file.is_file():
        raise UserError(
            f"checkpoint '{path}' has no {name}: it is incomplete or was written by fewer ranks; "
            "resume with the same number of ranks or from another checkpoint"
        )
    return rank_file


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1  # samples per prompt
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = disabled
    max_new_tokens: int = 64
    seed: int = 0  # generation is a pure function of (weights, prompts, params, seed); vLLM: rollout.seed_requests


@dataclass(frozen=True)
class Request:
    """One request of :meth:`RolloutEngine.generate_requests`: ``n`` samples of ``prompt_ids``, each at most
    ``max_new_tokens`` long, drawn with ``seed``. A continuation of a partial sample (partial_rollout.py) is a
    request with ``n = 1`` whose prompt is the original prompt followed by the tokens generated so far."""

    prompt_ids: tuple[int, ...]
    n: int
    max_new_tokens: int
    seed: int


def requests_for(prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Request]:
    """The requests of ``generate(prompts, params)``: prompt i draws with ``params.seed + i * n`` (child j of it with
    ``+ j`` on vLLM), the seeding ``generate`` has always had."""
    n = params.n
    return [
        Request(tuple(int(t) for t in p), n, params.max_new_tokens, params.seed + i * n) for i, p in enumerate(prompts)
    ]


class RolloutEngine(Protocol):
    """Generates samples; holds its own copy of the weights, refreshed from the train engine."""

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> SampleBatch:
        """``len(prompts) * params.n`` samples, the n samples of a prompt adjacent, with ``rollout_log_probs``,
        ``group_index`` (= position of the prompt in ``prompts``) and ``finished`` filled; ``R`` =
        ``params.max_new_tokens``. The same as ``generate_requests(requests_for(prompts, params), params)``."""
        ...

    def generate_requests(self, requests: Sequence[Request], params: SamplingParams) -> SampleBatch:
        """Each request's ``n`` samples, adjacent and in request order, ``group_index`` = the request's position;
        temperature / top-p / top-k from ``params``, the width ``R`` from ``params.max_new_tokens`` (every request's
        own ``max_new_tokens`` is at most that). ``finished`` says which samples ended with EOS."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load HF-named full tensors; returns the bytes received."""
        ...

    def sleep(self) -> None:  # free device memory between rollouts when colocated (no-op where unsupported)
        ...

    def wake_up(self) -> None: ...


class TrainEngine(Protocol):
    """Owns the policy being trained on this rank: log-probs, GSPO updates, weight export, checkpoints."""

    def compute_log_probs(self, batch: SampleBatch, temperature: float) -> torch.Tensor:
        """[B, R] float32 log-probs of ``batch.response_ids`` under the current weights (no grad)."""
        ...

    def update(self, batch: SampleBatch, temperature: float) -> dict[str, float]:
        """One rollout batch (this rank's shard) -> minibatch optimizer steps; returns averaged metrics."""
        ...

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full (unsharded) tensors under Hugging Face names, one at a time (collective on every rank)."""
        ...

    def save_checkpoint(self, path: str) -> None:
        """Model, optimizer, scheduler and this rank's RNG state into directory ``path`` (collective; every rank
        writes its own shards). The caller makes the directory and makes the checkpoint atomic."""
        ...

    def load_checkpoint(self, path: str) -> None: ...

    def save_hf(self, path: str, tokenizer: Any) -> None:
        """A Hugging Face checkpoint (safetensors + config + tokenizer) that AutoModelForCausalLM loads."""
        ...
