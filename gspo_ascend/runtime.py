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
from .data.prepare import embedded_data_dir  # here too: the benchmarks and tests import it from runtime
from .errors import ConfigError, UserError


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
    reward_log: Any = None  # rewards.report.RewardErrorLog: <output_dir>/reward_errors.log, written at a failure
    start_step: int = 0
    lock: Any = None  # rundir.RunLock on output_dir, released by trainer.stop
    val_set: Any = None  # validation.ValSet; None = validation off
    schedule: Any = None  # schedules.Schedule: how each step's batch is produced, started with the workers

    def __post_init__(self) -> None:
        if self.reward_log is None:  # training's and validation's scorer failures (opens no file until one)
            from .rewards.report import RewardErrorLog

            self.reward_log = RewardErrorLog(self.output_dir)


def resolve_model_path(cfg: Config) -> str:
    if not cfg.model.path:  # the embedded tiny model; with tools, the one warm-started on calculator calls
        from .tiny import ensure_tiny_model

        return str(ensure_tiny_model(size="tools" if cfg.tools.enabled else "tiny"))
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
    return [str(embedded_data_dir(tools=cfg.tools.enabled) / "train.parquet")]


def check_model_layout(cfg: Config, model_path: str) -> None:
    """Parallel sizes the model's config.json must allow, checked before Ray starts (a worker's error would arrive
    wrapped in Ray's traceback): Ulysses SP against the head counts."""
    sp = cfg.actor.ulysses_sequence_parallel_size
    if sp <= 1:
        return
    from .doctor.modelspec import load_spec
    from .engines.ulysses import layout_problem

    spec = load_spec(model_path)
    if problem := layout_problem(sp, spec.heads, spec.kv_heads):
        raise ConfigError(problem)


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
    from .data import PromptSampler, load_prompts, report_filtered
    from .device import get_backend
    from .npu_profile import check_environment
    from .resume import check_resume
    from .rewards import load_reward_fn
    from .rundir import check_writable, open_run_dir
    from .tools.plan import ToolPlan
    from .validation import prepare_val_set

    backend = get_backend(cfg.trainer.device)
    check_environment(cfg, backend.name)  # the NPU profile's couplings with the job's runtime_env (issue #26)
    check_writable(cfg.trainer.output_dir)  # before minutes of data loading; creates nothing
    if cfg.reward.reward_fn:
        load_reward_fn(cfg.reward.reward_fn)  # a bad module:function path fails now, with its one line
    model_path = resolve_model_path(cfg)
    check_model_layout(cfg, model_path)
    tokenizer = load_tokenizer(cfg, model_path)
    d = cfg.data
    dataset = load_prompts(
        resolve_train_files(cfg),
        d.prompt_key,
        tokenizer,
        d.max_prompt_length,
        d.overlong_prompts,
        answer_key=d.answer_key,
        # a tool that cannot be used, or a row whose tools_kwargs do not fit, fails here, before anything starts
        tools=ToolPlan(cfg.tools) if cfg.tools.enabled else None,
    )
    report_filtered(dataset, d.max_prompt_length)  # over-long prompts left out: said once
    sampler = PromptSampler(len(dataset), d.train_batch_size, seed=cfg.trainer.seed, shuffle=d.shuffle)
    val_set = prepare_val_set(cfg, tokenizer, model_path)
    output_dir = Path(cfg.trainer.output_dir).expanduser()
    lock = open_run_dir(output_dir)  # this run's alone from here on (a second run stops here, in one line)
    try:
        cleanup_stale(output_dir)
        resume_from = resolve_resume(cfg.trainer.resume, output_dir)
        start_step = check_resume(cfg, resume_from, model_path)  # refuses before config.json is rewritten
        (output_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
    except BaseException:
        lock.release()
        raise
    run = Run(cfg, backend, model_path, tokenizer, dataset, sampler, output_dir, resume_from, val_set=val_set)
    run.start_step, run.lock = start_step, lock
    return run
