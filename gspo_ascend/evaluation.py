"""``gspo-ascend eval``: the validation metrics of any Hugging Face checkpoint, ours or anyone's.

``gspo-ascend eval --model PATH --data test.parquet [--config X] [--ray] [--output DIR] [key=value ...]`` loads the
prompts like the trainer's validation does, generates with ``rollout.engine`` (hf or vllm) in this process on one
device, or with ``--ray`` on ``trainer.nnodes x trainer.devices_per_node`` Ray workers (rollout engines only),
scores and summarizes with :mod:`gspo_ascend.validation`, and writes ``eval.json`` (the metrics under the same
``val/...`` keys a run logs), ``eval.md`` (a table per data source) and ``generations.jsonl`` (every response);
scorer failures also go to ``reward_errors.log`` there, with one warning.

Reproducing a run: ``--config RUN/config.json`` brings that run's ``validation.*``, ``data.*``, ``reward.*``,
``rollout.*`` and ``trainer.seed``; validation chunks are seeded by (``trainer.seed``, chunk index) and do not
depend on the worker layout, so ``eval --model RUN/hf`` on the run's validation files gives the metrics of the
run's last validation (the export is written right after it). How we differ from verl: verl evaluates a checkpoint
by starting its trainer with ``trainer.val_only=True`` (Ray, the worker groups, a training config); here one command
needs a model directory and a data file, and runs without Ray unless asked.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .errors import UserError


def add_eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="local Hugging Face checkpoint directory (e.g. a run's hf/ export)")
    p.add_argument(
        "--data",
        action="append",
        metavar="FILE",
        help="parquet / JSON-lines prompts; repeat for more files (default: data.val_files of --config)",
    )
    p.add_argument(
        "--config",
        help="YAML config or a run's config.json: its data.*, validation.*, reward.*, rollout.*, trainer.seed apply",
    )
    p.add_argument(
        "--ray",
        action="store_true",
        help="generate on trainer.nnodes x trainer.devices_per_node Ray workers (default: this process, one device)",
    )
    p.add_argument("--output", metavar="DIR", help="eval.json, eval.md, generations.jsonl (default: runs/eval/NAME)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. validation.n=8")


def eval_config(args: argparse.Namespace) -> Any:
    from . import config

    # model and data are set as values, not parsed as override text: a path may hold YAML syntax (: [ ,)
    cfg = config.load_config(args.config, args.overrides, validate=False)
    cfg.model.path = str(Path(args.model).expanduser())
    if args.data:
        cfg.data.val_files = [str(Path(f).expanduser()) for f in args.data]
    if not cfg.data.val_files:
        raise UserError("eval needs prompts: pass --data FILE (parquet or jsonl), or a --config with data.val_files")
    config.check(cfg)
    return cfg


def main_eval(args: argparse.Namespace) -> int:
    from .device import get_backend
    from .rewards.report import RewardErrorLog
    from .runtime import load_tokenizer, resolve_model_path
    from .validation import evaluate, load_val_set, log_failures

    cfg = eval_config(args)
    backend = get_backend(cfg.trainer.device)
    model_path = resolve_model_path(cfg)
    tokenizer = load_tokenizer(cfg, model_path)
    val_set = load_val_set(cfg, tokenizer, model_path, files=list(cfg.data.val_files))
    out_dir = Path(args.output).expanduser() if args.output else default_output(model_path)
    size = cfg.validation.batch_size
    progress = Progress(-(-len(val_set.records) // size), len(val_set.records), size)  # chunks, as requests() cuts
    print(
        f"eval: {model_path} on {len(val_set.records)} prompts x n={cfg.validation.n} "
        f"({', '.join(val_set.files)}), rollout.engine={cfg.rollout.engine}" + (" through Ray" if args.ray else ""),
        file=sys.stderr,
        flush=True,
    )
    with generator(cfg, backend, model_path, args.ray, tokenizer, val_set.records) as generate_each:
        progress.start()
        result = evaluate(val_set, generate_each, cfg, tokenizer, progress)
    report = build_report(cfg, model_path, val_set, result.metrics, progress.elapsed(), args.ray)
    table = markdown_table(result.metrics)
    write_outputs(out_dir, report, table, result.rows)
    print(table)
    print(f"\nwrote {out_dir / 'eval.json'}, {out_dir / 'eval.md'}, {out_dir / 'generations.jsonl'}")
    log_failures(RewardErrorLog(out_dir), result, phase="eval")  # after the table: the last line they read
    return 0


@contextlib.contextmanager
def generator(
    cfg: Any, backend: Any, model_path: str, use_ray: bool, tokenizer: Any = None, records: Any = ()
) -> Iterator[Any]:
    """``generate_each`` over one in-process rollout engine, or over rollout-only Ray workers; with tools, over
    trajectories of model and tool turns (agent_loop.py), each of ``records`` (the prompts) with its row's tools."""
    from .validation import sequential

    if use_ray:
        from .workers import WorkerGroup

        group = WorkerGroup(cfg, backend, model_path, train=False)
        try:
            with _with_tools(cfg, tokenizer, group.generate_requests, records) as agent:
                yield agent or group.generate_each
        finally:
            group.shutdown()
        return
    from .engines import build_rollout_engine

    backend.set_device(0)
    engine = build_rollout_engine(cfg, backend, model_path)
    try:
        with _with_tools(cfg, tokenizer, engine.generate_requests, records) as agent:
            yield agent or sequential(engine)
    finally:
        close = getattr(engine, "close", None)
        if callable(close):
            close()


@contextlib.contextmanager
def _with_tools(cfg: Any, tokenizer: Any, generate_requests: Any, records: Any) -> Iterator[Any]:
    """Trajectories' ``generate_each`` when the config names tools (None otherwise); its tool workers stop after."""
    if not cfg.tools.enabled:
        yield None
        return
    from .agent_loop import AgentLoop, rows_by_prompt
    from .tools.toolbox import ToolBox

    box = ToolBox.from_config(cfg.tools)
    rows = rows_by_prompt(records)
    try:
        yield AgentLoop.of(box, tokenizer, cfg.tools).each(generate_requests, rows)
    finally:
        box.close()


class Progress:
    """One line on stderr per finished generate call (chunk): how far, how long."""

    def __init__(self, chunks: int, prompts: int, batch_size: int):
        self.chunks, self.prompts, self.batch_size = chunks, prompts, batch_size
        self.t0 = time.perf_counter()

    def start(self) -> None:
        self.t0 = time.perf_counter()  # after the engine started: that time is not generation

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def __call__(self, done: int) -> None:
        prompts = min(done * self.batch_size, self.prompts)
        print(
            f"eval: {done}/{self.chunks} batches, {prompts}/{self.prompts} prompts, {self.elapsed():.1f} s",
            file=sys.stderr,
            flush=True,
        )


def default_output(model_path: str) -> Path:
    path = Path(model_path).resolve()
    name = path.parent.name if path.name == "hf" else path.name  # a run's export: name it after the run
    return Path("runs") / "eval" / (name or "model")


def build_report(cfg: Any, model_path: str, val_set: Any, metrics: dict, seconds: float, use_ray: bool) -> dict:
    from .validation import report_ks, sampling_params

    v, params = cfg.validation, sampling_params(cfg)
    return {
        "model": str(Path(model_path).resolve()),
        "data": val_set.files,
        "prompts": len(val_set.records),
        "prompts_in_files": val_set.num_before_cap,
        "prompts_too_long": val_set.num_filtered,
        "engine": cfg.rollout.engine,
        "ray_workers": cfg.trainer.nnodes * cfg.trainer.devices_per_node if use_ray else 0,
        "sampling": {
            "n": v.n,
            "greedy": v.greedy,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
            "max_new_tokens": params.max_new_tokens,
            "seed": cfg.trainer.seed,
            "batch_size": v.batch_size,
            "k": report_ks(v.n, v.k),
        },
        "metrics": metrics,
        "seconds": round(seconds, 3),
    }


def markdown_table(metrics: dict[str, float]) -> str:
    """One row per data source ("all" first), one column per metric, in the order they were computed."""
    rows: dict[str, dict[str, float]] = {}
    for key, value in metrics.items():
        source, _, name = key.removeprefix("val/").rpartition("/")
        rows.setdefault(source, {})[name] = value
    columns = list(next(iter(rows.values())))
    lines = ["| data source | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for source, values in rows.items():
        cells = [_cell(name, values.get(name)) for name in columns]
        lines.append(f"| {source} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(name: str, value: float | None) -> str:
    if value is None:
        return "-"
    if name in ("prompts", "truncated", "no_answer", "score_errors"):
        return f"{value:.0f}"
    return f"{value:.1f}" if name == "response_length_mean" else f"{value:.4f}"


def write_outputs(out_dir: Path, report: dict, table: str, rows: list[dict]) -> None:
    from .validation import write_generations

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "eval.json").write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / "eval.md").write_text(table + "\n")
    write_generations(out_dir / "generations.jsonl", rows, prompts=len(rows), n=1)
