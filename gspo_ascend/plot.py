"""``gspo-ascend plot <run_dir>``: PNG training curves from a run's ``metrics.jsonl``, no TensorBoard needed.

Writes ``reward.png`` (reward/mean, reward/accuracy), ``clipfrac.png`` (actor/clipfrac_seq,
actor/clipfrac_token), ``response_length.png`` (response/length_mean) and, when the run validated,
``validation.png`` (val/all/mean@n, pass@k, maj@k; ``validation_by_source.png`` with several data sources) into
``run_dir/plots`` (or ``--output``); a training figure none of whose keys were logged is skipped with a note (the
validation ones need no note: validation is off unless asked for). The three training curves are the ones the GSPO
paper reports (training reward, clipping fraction, response length), so a CPU/NPU run can be checked against the
paper's shapes at a glance.

How we differ from verl: verl leaves plotting to W&B / TensorBoard; here a headless cluster node or CI job gets
the curves from the JSONL file alone. matplotlib is imported lazily and only through its Agg canvas (no pyplot
global state, no display needed).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from .errors import UserError
from .metrics import JSONL_NAME, read_metrics

# (file name, y-axis label, metric keys drawn as one line each)
FIGURES = (
    ("reward.png", "reward", ("reward/mean", "reward/accuracy")),
    ("clipfrac.png", "clipped fraction", ("actor/clipfrac_seq", "actor/clipfrac_token")),
    ("response_length.png", "response length (tokens)", ("response/length_mean",)),
)
FIGSIZE_IN, DPI = (6.4, 4.0), 100  # -> 640 x 400 px
# validation (gspo_ascend/validation.py): keys carry n and k, so they are found by pattern. validation.png: the
# overall mean@n, pass@k, maj@k; validation_by_source.png: mean@n of each data source, when there are several.
VALIDATION_FIGURES = (
    ("validation.png", "validation accuracy (held-out prompts)", re.compile(r"^val/all/(mean|pass|maj)@\d+$")),
    ("validation_by_source.png", "validation mean@n per data source", re.compile(r"^val/(?!all/).+/mean@\d+$")),
)


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) where ``key`` was logged; a null (non-finite) value is a gap (NaN), not a zero."""
    steps, values = [], []
    for record in records:
        if key in record:
            value = record[key]
            steps.append(record["step"])
            values.append(math.nan if value is None else float(value))
    return steps, values


def _import_matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise UserError(
            f"gspo-ascend plot needs matplotlib ({exc}); pip install matplotlib==3.11.2 (see requirements-cpu.txt)"
        ) from exc
    return Figure, FigureCanvasAgg


def _draw(path: Path, ylabel: str, lines: dict[str, tuple[list[int], list[float]]], title: str) -> None:
    figure_cls, canvas_cls = _import_matplotlib()
    fig = figure_cls(figsize=FIGSIZE_IN, dpi=DPI)
    canvas_cls(fig)
    ax = fig.add_subplot()
    for key, (steps, values) in lines.items():
        # markers keep a one-step run (a single point) visible
        ax.plot(steps, values, marker="o" if len(steps) < 50 else None, markersize=3, label=key)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)


def plot_run(run_dir: str | Path, output: str | Path | None = None) -> tuple[list[Path], list[str]]:
    """Write the figures of ``run_dir``; returns (files written, notes about figures skipped)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"run directory {run_dir} does not exist; pass a run's trainer.output_dir")
    if not (run_dir / JSONL_NAME).is_file():
        raise UserError(
            f"{run_dir / JSONL_NAME} does not exist; the run needs 'jsonl' in trainer.loggers to be plotted"
        )
    records = read_metrics(run_dir / JSONL_NAME)
    if not records:
        raise UserError(f"{run_dir / JSONL_NAME} has no steps yet; plot again after the first step is logged")
    out_dir = Path(output) if output is not None else run_dir / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    written, notes = [], []
    for name, ylabel, keys in FIGURES:
        lines = {key: _series(records, key) for key in keys}
        lines = {key: series for key, series in lines.items() if series[0]}
        if not lines:
            notes.append(f"{name} skipped: none of {', '.join(keys)} in {JSONL_NAME}")
            continue
        _draw(out_dir / name, ylabel, lines, title=run_dir.resolve().name)
        written.append(out_dir / name)
    for name, ylabel, pattern in VALIDATION_FIGURES:
        keys = sorted({k for record in records for k in record if pattern.match(k)})
        if len(keys) < (2 if name == "validation_by_source.png" else 1):
            continue  # no validation; or one data source, which validation.png shows already
        _draw(out_dir / name, ylabel, {key: _series(records, key) for key in keys}, title=run_dir.resolve().name)
        written.append(out_dir / name)
    return written, notes


def add_plot_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="a run directory (trainer.output_dir) containing metrics.jsonl")
    p.add_argument("--output", metavar="DIR", help="where the PNGs go (default: RUN_DIR/plots)")


def main_plot(args: argparse.Namespace) -> int:
    written, notes = plot_run(args.run_dir, args.output)
    for path in written:
        print(f"wrote {path}")
    for note in notes:
        print(f"note: {note}")
    return 0 if written else 1


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m gspo_ascend.plot``: the same command outside the ``gspo-ascend`` entry point."""
    parser = argparse.ArgumentParser(prog="gspo-ascend plot", description="PNG training curves of a run")
    add_plot_args(parser)
    args = parser.parse_args(argv)
    try:
        return main_plot(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
