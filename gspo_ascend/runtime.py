"""Everything a run needs before its first step, checked before any worker starts.

Cheap checks run first and fail with one line (exit 2): the model directory, the dataset files and their
columns, the reward function path, the config's cross-field rules. Only then are Ray and the engines started,
so a typo never costs a cluster start-up. The embedded default (``model.path: ""``, no ``data.train_files``)
builds the tiny model and the synthetic arithmetic data on first use.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import Config, to_dict
from .errors import UserError


@dataclass
class Run:
    cfg: Config
    backend: Any
    model_path: str
    tokenizer: Any
    dataset: Any  # data.PromptDataset
    sampler: Any  # data.PromptSampler
    output_dir: Path
    resume_from: Path | None
    workers: Any = None  # workers.WorkerGroup, started last
    logger: Any = None  # metrics.MetricsLogger
    start_step: int = 0


def resolve_model_path(cfg: Config) -> str:
    if not cfg.model.path:
        from .tiny import ensure_tiny_model

        return str(ensure_tiny_model())
    path = Path(cfg.model.path).expanduser()
    if not (path / "config.json").is_file():
        from .doctor.modelspec import builtin_match

        what = "does not exist" if not path.exists() else "has no config.json (not a Hugging Face model directory)"
        match = builtin_match(cfg.model.path)
        if match:  # --dry-run, plan and doctor accepted this path; say why training does not
            raise UserError(
                f"model.path '{path}' {what}: training needs the weights of {match[0]} there (its built-in spec "
                "serves only --dry-run, plan and doctor); download the model to that directory or point model.path "
                "at a local HF checkpoint directory"
            )
        raise UserError(f"model.path '{path}' {what}; point model.path at a local HF checkpoint directory")
    return str(path)


def resolve_train_files(cfg: Config) -> list[str]:
    if cfg.data.train_files:
        return list(cfg.data.train_files)
    if cfg.model.path:
        raise UserError("data.train_files is empty; set it to parquet/jsonl files (see `gspo-ascend prepare-data`)")
    from .data import prepare_data
    from .tiny import gspo_home

    out = gspo_home() / "data" / "synthetic"
    if not (out / "train.parquet").is_file():
        prepare_data("synthetic", None, out, seed=0)
    return [str(out / "train.parquet")]


def load_tokenizer(cfg: Config, model_path: str):
    from transformers import AutoTokenizer

    path = cfg.model.tokenizer_path or model_path
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot load a tokenizer from '{path}' (model.tokenizer_path): {exc}") from None


def prepare(cfg: Config) -> Run:
    """Validate and load everything host-side; no Ray, no engines yet."""
    from .checkpoint import cleanup_stale, resolve_resume
    from .data import PromptSampler, load_prompts
    from .device import get_backend
    from .rewards import load_reward_fn

    backend = get_backend(cfg.trainer.device)
    if cfg.reward.reward_fn:
        load_reward_fn(cfg.reward.reward_fn)  # a bad module:function path fails now, with its one line
    model_path = resolve_model_path(cfg)
    tokenizer = load_tokenizer(cfg, model_path)
    d = cfg.data
    dataset = load_prompts(
        resolve_train_files(cfg),
        d.prompt_key,
        tokenizer,
        d.max_prompt_length,
        d.overlong_prompts,
        answer_key=d.answer_key,
    )
    sampler = PromptSampler(len(dataset), d.train_batch_size, seed=cfg.trainer.seed, shuffle=d.shuffle)
    output_dir = Path(cfg.trainer.output_dir).expanduser()
    output_dir.mkdir(parents=True, exist_ok=True)
    cleanup_stale(output_dir)
    resume_from = resolve_resume(cfg.trainer.resume, output_dir)
    (output_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
    return Run(cfg, backend, model_path, tokenizer, dataset, sampler, output_dir, resume_from)
