"""Rollout engines (``hf``, ``vllm``) and train engines (``fsdp``, ``megatron``) behind one contract
(:mod:`.base`), chosen by ``rollout.engine`` and ``actor.engine``; any combination works. Engine modules import
torch, transformers, vLLM or Megatron lazily so the package imports on a bare CPU box.
"""

from __future__ import annotations

from typing import Any

from ..errors import UserError
from .base import Request, RolloutEngine, SampleBatch, SamplingParams, TrainEngine, requests_for

__all__ = [
    "Request",
    "RolloutEngine",
    "SampleBatch",
    "SamplingParams",
    "TrainEngine",
    "build_rollout_engine",
    "build_train_engine",
    "requests_for",
]


def _missing(key: str, value: str, exc: ImportError) -> UserError:
    return UserError(f"{key}={value} is not available in this installation ({exc}); see docs/engines.md")


def build_train_engine(cfg: Any, backend: Any, model_path: str) -> TrainEngine:
    if cfg.actor.engine == "fsdp":
        from .fsdp import FSDPEngine

        return FSDPEngine(cfg, backend, model_path)
    try:
        from .megatron import MegatronEngine
    except ImportError as exc:
        raise _missing("actor.engine", cfg.actor.engine, exc) from None
    return MegatronEngine(cfg, backend, model_path)


def build_rollout_engine(cfg: Any, backend: Any, model_path: str) -> RolloutEngine:
    if cfg.rollout.engine == "hf":
        from .hf_rollout import build_hf_rollout

        return build_hf_rollout(cfg, backend, model_path)
    try:
        from .vllm_rollout import build_vllm_rollout
    except ImportError as exc:
        raise _missing("rollout.engine", cfg.rollout.engine, exc) from None
    return build_vllm_rollout(cfg, backend, model_path)
