"""Simulated-latency engines: TEST AND BENCHMARK ONLY. Never a training mode.

On a 2-core box two CPU pools cannot show that a rollout pool and a trainer pool overlap: they share the cores. With
``GSPO_SIMULATED_ENGINES`` set (a JSON :class:`SimSpec`), each worker wraps its real engines so that the *time* of
generation and training is a model and the processes sleep through it, while everything else stays real: Ray
placement, the driver's pipeline, the gloo weight sync (the tiny model's real weights), checkpoints.

* Generation: response lengths drawn from a lognormal (the realistic benchmark's long right tail: median and
  sigma in the spec), capped at ``max_new_tokens``; the rank sleeps
  ``sum over decode steps t of (decode_base_s + decode_per_seq_s x sequences still running at t)``, the per-step
  cost at the step's concurrency (benchmarks/step_model.py's decode model). Tokens are random ids of the model's
  vocabulary (rewards are then mostly 0: the run measures time, not learning), log-probs random.
* Training: the real engine updates the tiny model (so the weights the sync carries change), then the rank sleeps
  until ``tokens / train_tokens_per_s`` has passed; ``compute_log_probs`` likewise at ``logprob_tokens_per_s``.

The driver prints one line saying the engines are simulated; every metric of such a run is a simulation's.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from .engines.base import SampleBatch, SamplingParams

ENV = "GSPO_SIMULATED_ENGINES"


@dataclass(frozen=True)
class SimSpec:
    decode_base_s: float = 0.02  # one decode step of a replica, whatever its batch
    decode_per_seq_s: float = 0.0005  # and per sequence running in it
    length_median: float = 64.0  # response tokens (lognormal)
    length_sigma: float = 0.8
    train_tokens_per_s: float = 2000.0  # prompt + response tokens per second per trainer rank (fwd + bwd + opt)
    logprob_tokens_per_s: float = 20000.0

    def generation_s(self, lengths: list[int]) -> float:
        steps = max(lengths, default=0)
        running = [sum(1 for n in lengths if n >= t) for t in range(1, steps + 1)]
        return sum(self.decode_base_s + self.decode_per_seq_s * b for b in running)

    def lengths(self, count: int, cap: int, seed: int) -> list[int]:
        g = torch.Generator().manual_seed(seed)
        normal = torch.randn(count, generator=g, dtype=torch.float64)
        raw = torch.exp(math.log(self.length_median) + self.length_sigma * normal)
        return [int(min(max(1, round(float(x))), cap)) for x in raw]


def spec_from_env() -> SimSpec | None:
    raw = os.environ.get(ENV)
    return SimSpec(**json.loads(raw)) if raw else None


def env_value(spec: SimSpec) -> str:
    return json.dumps(asdict(spec))


def announce() -> None:
    """One line on the driver's stderr when the engines are simulated."""
    spec = spec_from_env()
    if spec is not None:
        print(f"SIMULATED ENGINES (test / benchmark only: {ENV}): {asdict(spec)}", file=sys.stderr, flush=True)


def wrap(train_engine: Any, rollout_engine: Any) -> tuple[Any, Any]:
    """The worker's engines, wrapped when ``GSPO_SIMULATED_ENGINES`` is set, else as they are."""
    spec = spec_from_env()
    if spec is None:
        return train_engine, rollout_engine
    train = _SimTrain(train_engine, spec) if train_engine is not None else None
    return train, (_SimRollout(rollout_engine, spec) if rollout_engine is not None else None)


class _Delegate:
    def __init__(self, inner: Any, spec: SimSpec) -> None:
        self.inner, self.spec = inner, spec

    def __getattr__(self, name: str) -> Any:  # sleep / wake_up / update_weights / save / export ... are real
        return getattr(self.inner, name)


class _SimRollout(_Delegate):
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> SampleBatch:
        rows = [p for p in range(len(prompts)) for _ in range(params.n)]
        width = params.max_new_tokens
        lengths = self.spec.lengths(len(rows), width, params.seed * 7919 + len(prompts))
        time.sleep(self.spec.generation_s(lengths))
        g = torch.Generator().manual_seed(params.seed)
        vocab = int(self.inner.model.config.vocab_size)
        ids = torch.randint(0, vocab, (len(rows), width), generator=g)
        mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).float()
        ids = ids.masked_fill(mask == 0, int(self.inner.pad_token_id))
        return SampleBatch(
            prompt_ids=[list(prompts[p]) for p in rows],
            response_ids=ids,
            response_mask=mask,
            rollout_log_probs=-torch.rand(ids.shape, generator=g) * mask,
            group_index=torch.tensor(rows, dtype=torch.long),
            finished=torch.tensor([n < width for n in lengths]),
        )


class _SimTrain(_Delegate):
    def _padded(self, start: float, tokens: int, rate: float) -> None:
        time.sleep(max(0.0, tokens / rate - (time.perf_counter() - start)))

    def update(self, batch: SampleBatch, temperature: float) -> dict[str, float]:
        start = time.perf_counter()
        metrics = self.inner.update(batch, temperature)
        self._padded(start, batch.num_tokens(), self.spec.train_tokens_per_s)
        return metrics

    def compute_log_probs(self, batch: SampleBatch, temperature: float) -> torch.Tensor:
        start = time.perf_counter()
        out = self.inner.compute_log_probs(batch, temperature)
        self._padded(start, batch.num_tokens(), self.spec.logprob_tokens_per_s)
        return out
