"""Per-step metrics sinks: a live console line, ``metrics.jsonl``, TensorBoard and (optionally) Weights & Biases.

The driver calls ``MetricsLogger.log(step, {"reward/mean": ..., ...})`` once per training step (steps are
1-based: step N is logged when step N has finished, and checkpoint ``step_N`` holds the state after it).

Resume without duplicates: a run killed after its last checkpoint has usually logged a few steps past it. On
construction with ``start_step`` (the step of the checkpoint being resumed), ``metrics.jsonl`` keeps exactly
the lines with ``step <= start_step`` and TensorBoard purges events from ``start_step + 1`` on, so the resumed
run rewrites those steps once instead of appending a second copy.

How we differ from verl's ``Tracking``: its sinks only append (the TensorBoard adapter opens a plain
``SummaryWriter``), so after a resume the steps a killed run logged past its checkpoint show up twice, and its
console logger prints the whole metrics dict. Here the JSONL file is cut back to the checkpoint and TensorBoard
purges past it, every JSONL line is fsync'd (a SIGKILL loses at most the line being written, and a torn last
line is dropped on the next start), non-finite values are stored as ``null`` so the file is strict JSON, and
the console shows a progress bar with six key figures (plain text, no escape codes, when stdout is not a TTY).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from .checkpoint import fsync_path
from .errors import ConfigError, UserError

JSONL_NAME = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
WANDB_ID_FILE = ".wandb_run_id"  # the same W&B run continues after a resume
VALID_LOGGERS = ("console", "jsonl", "tensorboard", "wandb")
# (label on the console, metrics key): the figures a user watches while GSPO trains
CONSOLE_FIGURES = (
    ("reward", "reward/mean"),
    ("clip_seq", "actor/clipfrac_seq"),
    ("kl", "actor/kl_k3_token"),
    ("resp_len", "response/length_mean"),
    ("step_s", "time/step_s"),
    ("tok/s", "perf/tokens_per_s"),
)
VAL_ACCURACY_PREFIX = "val/all/mean@"  # shown as `val=` from the first validation on (gspo_ascend/validation.py)


def _clean(metrics: Mapping[str, Any]) -> dict[str, float | None]:
    """Plain floats (tensor / numpy scalars accepted); NaN and +-inf become None (JSON null)."""
    out: dict[str, float | None] = {}
    for key, value in metrics.items():
        if key == "step":
            raise ValueError("'step' is reserved in metrics (it is the log() argument)")
        try:
            number = float(value)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"metric {key!r} is not a number: {value!r}") from exc
        out[str(key)] = number if math.isfinite(number) else None
    return out


def format_figure(value: float | None) -> str:
    """Compact, fixed-ish width console number: 812, 41.25, 0.0123, 1.2e-05; '-' when missing."""
    if value is None:
        return "-"
    if not math.isfinite(value):
        return str(value)
    if abs(value) >= 1000:
        return f"{value:.0f}"
    return f"{value:.4g}"


def console_line(step: int, total_steps: int, metrics: Mapping[str, float | None], val: float | None = None) -> str:
    """The step's figures; ``val``, the last validation accuracy (``val/all/mean@n``), once there is one."""
    figures = " ".join(f"{label}={format_figure(metrics.get(key))}" for label, key in CONSOLE_FIGURES)
    return f"step {step}/{total_steps} {figures}" + ("" if val is None else f" val={format_figure(val)}")


def _validation_accuracy(metrics: Mapping[str, float | None]) -> float | None:
    return next((v for k, v in metrics.items() if k.startswith(VAL_ACCURACY_PREFIX)), None)


class _ConsoleSink:
    """A rich progress bar with the key figures on a TTY; one plain line per step otherwise (CI logs, files)."""

    def __init__(self, total_steps: int, start_step: int, stream: TextIO | None):
        self.stream = stream if stream is not None else sys.stdout
        self.total_steps = total_steps
        self.val: float | None = None  # the last validation accuracy, repeated on every line after it
        isatty = getattr(self.stream, "isatty", None)
        self.progress = None
        if callable(isatty) and isatty():
            self._start_progress(start_step)

    def _start_progress(self, start_step: int) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        # auto_refresh=False: no background thread; the bar is redrawn once per step, which is all that changes
        self.progress = Progress(
            TextColumn("step"),
            MofNCompleteColumn(),
            BarColumn(bar_width=20),  # leaves room for the figures on an 80-column terminal
            TimeRemainingColumn(),
            TextColumn("{task.fields[figures]}"),
            console=Console(file=self.stream, force_terminal=True),
            auto_refresh=False,
        )
        self.task = self.progress.add_task("train", total=self.total_steps, completed=start_step, figures="")
        self.progress.start()

    def log(self, step: int, metrics: Mapping[str, float | None]) -> None:
        val = _validation_accuracy(metrics)
        self.val = self.val if val is None else val
        line = console_line(step, self.total_steps, metrics, self.val)
        if self.progress is None:
            print(line, file=self.stream, flush=True)
            return
        figures = line.split(" ", 2)[2]
        # the line above the bar keeps a scroll-back history; the bar shows the latest figures
        self.progress.console.print(line, markup=False, highlight=False)
        self.progress.update(self.task, completed=step, figures=figures)
        self.progress.refresh()

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


def _parse_lines(text: str, path: Path) -> list[dict]:
    """Records of a metrics.jsonl text; a torn last line (a kill mid-write) is dropped, a bad middle line is not."""
    lines = text.split("\n")
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ValueError("not an object with an integer 'step'")
        except ValueError as exc:
            if number == len(lines) and not text.endswith("\n"):
                break  # torn tail: the writer died before finishing the line
            raise UserError(f"{path}:{number} is not a metrics line ({exc}); fix or remove that line") from exc
        records.append(record)
    return records


class _JsonlSink:
    def __init__(self, output_dir: Path, start_step: int):
        self.path = output_dir / JSONL_NAME
        if self.path.exists():
            self._truncate(start_step)
        self.file = open(self.path, "a", encoding="utf-8")  # open until close(): one fsync per step

    def _truncate(self, start_step: int) -> None:
        records = _parse_lines(self.path.read_text(encoding="utf-8"), self.path)
        # a fresh run (start_step 0) keeps nothing, not even an earlier run's step-0 validation line
        kept = [r for r in records if r["step"] <= start_step] if start_step > 0 else []
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, allow_nan=False) + "\n" for r in kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)  # atomic: a kill here leaves either the old or the truncated file
        fsync_path(self.path.parent)

    def log(self, step: int, metrics: Mapping[str, float | None]) -> None:
        self.file.write(json.dumps({"step": step, **metrics}, allow_nan=False) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())

    def close(self) -> None:
        self.file.close()


class _TensorBoardSink:
    def __init__(self, output_dir: Path, start_step: int, config_dict: Mapping[str, Any] | None):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise UserError(
                f"trainer.loggers includes 'tensorboard' but it cannot be imported ({exc}); "
                "pip install tensorboard, or remove 'tensorboard' from trainer.loggers"
            ) from exc
        # purge_step hides the events at or after it: those a killed run wrote past its last checkpoint (or,
        # for a fresh run, start_step=0, all of an earlier run in the same directory, step 0 included), like the
        # JSONL file
        self.writer = SummaryWriter(str(output_dir / TENSORBOARD_DIR), purge_step=start_step + 1 if start_step else 0)
        if config_dict is not None and not start_step:
            text = json.dumps(config_dict, indent=2, default=str)
            self.writer.add_text("config", "\n".join("    " + line for line in text.splitlines()), 0)

    def log(self, step: int, metrics: Mapping[str, float | None]) -> None:
        for key, value in metrics.items():
            if value is not None:
                self.writer.add_scalar(key, value, step)
        self.writer.flush()  # the default 2-minute flush would lose minutes of curves on a crash

    def close(self) -> None:
        self.writer.close()


class _WandbSink:
    def __init__(self, output_dir: Path, project: str, name: str, config_dict: Mapping[str, Any] | None):
        try:
            import wandb
        except ImportError as exc:
            raise UserError(
                "trainer.loggers includes 'wandb' but wandb is not installed; pip install wandb "
                "(WANDB_MODE=offline needs no account), or remove 'wandb' from trainer.loggers"
            ) from exc
        id_file = output_dir / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if id_file.exists() else None
        if not run_id:
            run_id = wandb.util.generate_id()
            id_file.write_text(run_id + "\n")
        # mode is left to wandb, which reads WANDB_MODE (offline / disabled) from the environment
        self.run = wandb.init(
            project=project,
            name=name,
            id=run_id,
            resume="allow",
            dir=str(output_dir),
            config=dict(config_dict) if config_dict is not None else None,
        )

    def log(self, step: int, metrics: Mapping[str, float | None]) -> None:
        self.run.log({k: v for k, v in metrics.items() if v is not None}, step=step)

    def close(self) -> None:
        self.run.finish()


class MetricsLogger:
    """Fan one ``log(step, metrics)`` out to the sinks named in ``trainer.loggers``; a context manager."""

    def __init__(
        self,
        output_dir: str | os.PathLike,
        loggers: list[str],
        *,
        total_steps: int,
        start_step: int = 0,
        config_dict: Mapping[str, Any] | None = None,
        project_name: str = "gspo-ascend",
        experiment_name: str = "",
        console_stream: TextIO | None = None,
    ):
        if isinstance(loggers, str):
            raise ConfigError(f"config key 'trainer.loggers' must be a list, e.g. [{loggers}], got {loggers!r}")
        unknown = [name for name in loggers if name not in VALID_LOGGERS]
        if unknown:
            raise ConfigError(
                f"config key 'trainer.loggers' has unknown logger(s) {unknown}; valid: {', '.join(VALID_LOGGERS)}"
            )
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        # a fresh run may log step 0 (validation before training: trainer.val_before_train); a resumed one
        # continues after its checkpoint's step
        self.total_steps, self.last_step = total_steps, start_step if start_step > 0 else -1
        self.sinks: list[Any] = []
        try:
            for name in dict.fromkeys(loggers):  # a repeated name would log every step twice
                self.sinks.append(
                    self._make_sink(name, start_step, config_dict, project_name, experiment_name, console_stream)
                )
        except BaseException:
            self.close()
            raise

    def _make_sink(self, name, start_step, config_dict, project_name, experiment_name, console_stream):
        if name == "console":
            return _ConsoleSink(self.total_steps, start_step, console_stream)
        if name == "jsonl":
            return _JsonlSink(self.output_dir, start_step)
        if name == "tensorboard":
            return _TensorBoardSink(self.output_dir, start_step, config_dict)
        run_name = experiment_name or self.output_dir.resolve().name
        return _WandbSink(self.output_dir, project_name, run_name, config_dict)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        if step <= self.last_step:
            # steps only move forward: a repeated step would be a duplicate line in every sink
            raise ValueError(
                f"MetricsLogger.log: step {step} is not after the last logged / resumed step {self.last_step}"
            )
        clean = _clean(metrics)
        for sink in self.sinks:
            sink.log(step, clean)
        self.last_step = step

    def close(self) -> None:
        sinks, self.sinks = self.sinks, []
        error = None
        for sink in reversed(sinks):
            try:
                sink.close()
            except Exception as exc:  # close the others (the JSONL file above all) before reporting it
                error = error or exc
        if error is not None:
            raise error

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """Records of a run's ``metrics.jsonl`` (``path`` = the file or the run directory); ``null`` stays None."""
    path = Path(path)
    if path.is_dir():
        path = path / JSONL_NAME
    if not path.is_file():
        raise UserError(f"no metrics file at {path}; pass a run directory (trainer.output_dir) or its {JSONL_NAME}")
    return _parse_lines(path.read_text(encoding="utf-8"), path)


class Timer:
    """Wall time per stage -> ``time/<stage>_s``, ``time/step_s`` and ``perf/tokens_per_s``."""

    def __init__(self) -> None:
        self.start, self.spans = time.perf_counter(), {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        """Adds the time spent inside to stage ``name`` (a stage may run several times in a step: rounds)."""
        t0 = time.perf_counter()
        yield
        self.spans[name] = self.spans.get(name, 0.0) + time.perf_counter() - t0

    def metrics(self, tokens: int) -> dict[str, float]:
        total = time.perf_counter() - self.start
        return {f"time/{k}_s": v for k, v in self.spans.items()} | {
            "time/step_s": total,
            "perf/tokens_per_s": tokens / total if total > 0 else 0.0,
        }
