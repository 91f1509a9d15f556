"""How much staleness GSPO tolerates, against GRPO and GSPO-token, with and without the behaviour correction
(issue #31), at tiny scale on CPU with the real engines.

    .venv/bin/python benchmarks/staleness_study.py                  # the grid, resumable: a finished run is kept
    .venv/bin/python benchmarks/staleness_study.py --shard 1/2 &    # ... or split over processes (1 CPU each)
    .venv/bin/python benchmarks/staleness_study.py --report-only    # results.md and the figures from raw/

The grid: model (tiny MoE, tiny dense) x loss (GSPO, GSPO-token, GRPO) x staleness eta in {0, 1, 2, 4} x pi_old
(``engine``: the rollout engine's log-probs, i.e. the stale behaviour policy mu itself, no correction; ``recompute``:
pi_prox recomputed by the trainer with the decoupled capped sequence correction of algorithms/behavior.py) x
seeds. At eta = 0 the two pi_old differ only by the engines' precision gap (both are Hugging Face forwards here),
so eta 0 runs once, with ``recompute``. GSPO-token runs for seed 0 only (``--token-seeds``): with one advantage
per sequence it is GSPO's objective (paper, section 4.3), which the report measures. Default: 2 models x 7
(eta, pi_old) x (2 losses x 3 seeds + GSPO-token x 1) = 98 runs of 40 steps, ~50 s each on 2 shared cores with
two shards: ~45 min.

Staleness is forced with ``rollout.weights_lag = eta``: step k's samples come from the weights after update
k - 1 - eta, exactly eta versions old once k > eta; the first eta steps can only use the initial weights (no older
version exists), so their lag is k - 1. Every run's raw file is checked for exactly that (``async/staleness`` per
step) before the report uses it, and a run that breaks it is reported as such, not averaged.

Settings are the paper reproduction's (benchmarks/reproduce_paper.py: its SHARED settings and presets, GRPO with
token-mean aggregation), plus greedy validation on the 39 held-out problems every ``--val-every`` steps and before
training; GSPO-token is the ``gspo_paper`` preset with ``algorithm.loss=gspo_token``. With ``engine`` and eta > 0
each step also recomputes pi_prox for the ``behavior/*`` drift metrics alone (rollout.weights_lag's one extra
forward), so both pi_old choices report drift on one scale.

How this differs from AReaL's staleness study: staleness is fixed, not bounded (every sample exactly eta old,
not "at most"), the correction is per sequence and length-normalised (GSPO's ratio), and the models and task are
tiny: the findings are about the objectives' mechanics at this scale, not a forecast for Qwen3-30B-A3B.

Output: ``raw/<run>.jsonl`` (each run's metrics.jsonl, unmodified), ``raw/<run>.meta.json`` (settings, wall time,
load), figures and ``results.md`` in ``--out`` (default docs/results/staleness).

Why one file over 600 lines: as benchmarks/reproduce_paper.py, whose settings and statistics it imports rather
than copies: one script runs the grid, summarises and writes the report (``--report-only`` from the raw files).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # runnable as `python benchmarks/staleness_study.py` from anywhere
    sys.path.insert(0, str(REPO))

from gspo_ascend.errors import UserError  # noqa: E402


def _reproduce_paper():
    """benchmarks/reproduce_paper.py as a module: its shared settings, Ray start-up and statistics, not a copy."""
    name = "reproduce_paper"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("reproduce_paper.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


rp = _reproduce_paper()

MODELS = rp.MODELS
LOSSES = {  # loss -> (preset, extra keys)
    "gspo": ("gspo_paper", {}),
    "gspo_token": ("gspo_paper", {"algorithm.loss": "gspo_token"}),
    "grpo": ("grpo_paper", {"algorithm.loss_agg_mode": "token-mean"}),  # the reproduction's DAPO-style GRPO
}
LOSS_LABELS = {"gspo": "GSPO", "gspo_token": "GSPO-token", "grpo": "GRPO"}
ETAS = (0, 1, 2, 4)
PI_OLD = ("engine", "recompute")
DEFAULT_STEPS, DEFAULT_SEEDS, DEFAULT_VAL_EVERY = 40, 3, 10
VAL_KEY = "val/all/mean@1"  # greedy validation samples once
COLLAPSE = rp.COLLAPSE  # a fall of the 3-step mean reward this far below its best so far


def run_name(model: str, loss: str, eta: int, pi_old: str, seed: int) -> str:
    return f"{model}-{loss}-eta{eta}-{pi_old}-seed{seed}"


def grid(
    models: list[str], losses: list[str], etas: list[int], seeds: int, token_seeds: int = 1
) -> list[tuple[str, str, int, str, int]]:
    """(model, loss, eta, pi_old, seed), seed-major: an interrupted study has whole seeds of every cell first.
    GSPO-token runs for the first ``token_seeds`` seeds only: with one advantage per sequence it is GSPO's
    objective (paper, section 4.3; the report measures how exactly), so more seeds of it would repeat GSPO's."""
    cells = []
    for seed in range(seeds):
        for model in models:
            for eta in etas:
                for loss in (x for x in losses if x != "gspo_token" or seed < token_seeds):
                    cells += [(model, loss, eta, p, seed) for p in (("recompute",) if eta == 0 else PI_OLD)]
    return cells


def run_config(model: str, loss: str, eta: int, pi_old: str, seed: int, *, steps: int, val_every: int, out: str):
    """The trainer config of one run: the reproduction's SHARED settings, the loss's preset, then this cell."""
    from gspo_ascend.algorithms.presets import get_preset
    from gspo_ascend.config import load_config
    from gspo_ascend.runtime import embedded_data_dir
    from gspo_ascend.tiny import ensure_tiny_model

    preset, extra = LOSSES[loss]
    data = embedded_data_dir()
    overrides = dict(rp.SHARED) | get_preset(preset) | extra
    overrides |= {
        "model.path": str(ensure_tiny_model(moe=model == "moe")),
        "data.train_files": [str(data / "train.parquet")],
        "data.val_files": [str(data / "test.parquet")],
        "actor.lr": 1e-4,
        "rollout.weights_lag": eta,
        "algorithm.old_logprobs": pi_old,
        "algorithm.behavior_correction": "seq_tis" if pi_old == "recompute" else "none",
        "trainer.seed": seed,
        "trainer.total_steps": steps,
        "trainer.test_freq": val_every,
        "trainer.val_before_train": True,
        "trainer.output_dir": out,
        "trainer.experiment_name": run_name(model, loss, eta, pi_old, seed),
    }
    if eta == 0:  # nothing is stale: the behaviour keys would be refused as inert (config.py)
        del overrides["algorithm.behavior_correction"]
    return load_config(None, [f"{k}={json.dumps(v)}" for k, v in overrides.items()])


# ----------------------------------------------------------------------------------------------- running


def lag_violations(records: list[dict], eta: int) -> list[int]:
    """Steps whose logged staleness is not the forced one: min(step - 1, eta) (module docstring)."""
    bad = []
    for r in records:
        if r.get("step", 0) >= 1 and "reward/mean" in r:
            want = min(r["step"] - 1, eta)
            if float(r.get("async/staleness", 0.0)) != want:
                bad.append(r["step"])
    return bad


def finished_records(raw: Path, steps: int) -> list[dict] | None:
    """A run's records when its raw file holds its last step's validation, else None (not run, or cut short)."""
    from gspo_ascend.metrics import read_metrics

    records = read_metrics(raw) if raw.is_file() else []
    return records if any(r.get("step") == steps and VAL_KEY in r for r in records) else None


def train_one(cell: tuple[str, str, int, str, int], args: argparse.Namespace) -> float:
    """One run; its metrics.jsonl copied to raw/ with a meta file beside it. Returns wall seconds."""
    from gspo_ascend.rewards import shutdown_reward_workers
    from gspo_ascend.trainer import train

    name = run_name(*cell)
    run_dir = Path(tempfile.mkdtemp(prefix=f"gspo-stale-{name}-", dir=args.work_dir))
    load = os.getloadavg()[0]
    try:
        cfg = run_config(*cell, steps=args.steps, val_every=args.val_every, out=str(run_dir))
        t0 = time.perf_counter()
        train(cfg)
        wall = time.perf_counter() - t0
        shutil.copyfile(run_dir / "metrics.jsonl", args.out / "raw" / f"{name}.jsonl")
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        shutdown_reward_workers()  # fresh scoring workers per run (reproduce_paper.train_all says why)
    model, loss, eta, pi_old, seed = cell
    meta = {"model": model, "loss": loss, "eta": eta, "pi_old": pi_old, "seed": seed, "steps": args.steps}
    meta |= {"val_every": args.val_every, "wall_s": round(wall, 1), "loadavg_1m": [load, os.getloadavg()[0]]}
    meta |= {"date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "machine": rp.machine()}
    (args.out / "raw" / f"{name}.meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return wall


def train_all(args: argparse.Namespace) -> None:
    cells = grid(args.models, args.losses, args.etas, args.seeds, args.token_seeds)
    mine = [c for i, c in enumerate(cells) if i % args.shard[1] == args.shard[0] - 1]
    todo = [c for c in mine if finished_records(args.out / "raw" / f"{run_name(*c)}.jsonl", args.steps) is None]
    print(f"staleness study: {len(cells)} runs in the grid, {len(mine)} in this shard, {len(todo)} to run", flush=True)
    if not todo:
        return
    (args.out / "raw").mkdir(parents=True, exist_ok=True)
    rp.start_ray(1)  # one torch thread (reproduce_paper.start_ray: 2 threads on 2 shared cores run 5-10x slower)
    for i, cell in enumerate(todo, 1):
        wall = train_one(cell, args)
        print(f"[{i}/{len(todo)}] {run_name(*cell)}: {wall:.0f} s", flush=True)


# ----------------------------------------------------------------------------------------------- statistics


def load_runs(out: Path) -> dict[tuple[str, str, int, str], list[tuple[dict, list[dict]]]]:
    """{(model, loss, eta, pi_old): [(meta, records) per seed, in seed order]} from ``out/raw``."""
    runs: dict[tuple[str, str, int, str], list[tuple[dict, list[dict]]]] = {}
    for meta_file in sorted((out / "raw").glob("*.meta.json")):
        meta = json.loads(meta_file.read_text())
        records = finished_records(meta_file.with_name(meta_file.name.removesuffix(".meta.json") + ".jsonl"),
                                   meta["steps"])  # fmt: skip
        if records is None:
            continue  # a run cut short (its raw file is rewritten when it runs again)
        key = (meta["model"], meta["loss"], meta["eta"], meta["pi_old"])
        runs.setdefault(key, []).append((meta, records))
    if not runs:
        raise UserError(f"{out / 'raw'} holds no finished run; run benchmarks/staleness_study.py first")
    return {k: sorted(v, key=lambda mr: mr[0]["seed"]) for k, v in sorted(runs.items())}


def _steady(records: list[dict], eta: int) -> list[dict]:
    """The trained steps at the forced lag (step > eta); all trained steps when eta = 0."""
    return [r for r in records if r.get("step", 0) > eta and "reward/mean" in r]


def run_summary(records: list[dict], eta: int, steps: int) -> dict[str, float]:
    """One run's figures (the report's columns): final greedy validation accuracy, reward over the last fifth,
    per-step means over the steps at the forced lag, the behaviour weights' worst step, the response-length drift
    (last fifth - first fifth), and the reward's largest fall (rp.reward_fall)."""
    w = rp.window(steps)
    trained = [r for r in records if r.get("step", 0) >= 1 and "reward/mean" in r]
    steady = _steady(records, eta)
    rewards = [float(r["reward/mean"]) for r in trained]
    lengths = [float(r["response/length_mean"]) for r in trained]
    val = [float(r[VAL_KEY]) for r in records if r.get(VAL_KEY) is not None]
    fall = rp.reward_fall(rewards) if rewards else {"drop": math.nan, "bottom": None}

    def mean_of(key: str, rows: list[dict] = steady) -> float:
        return rp._mean(rp._values(rows, key))

    return {
        "val_final": val[-1] if val else math.nan,
        "val_late": rp._mean(val[-2:]),  # the last two validations: 78 greedy answers, half the noise of one
        "val_gain": val[-1] - val[0] if len(val) >= 2 else math.nan,
        "reward_last": rp._mean(rewards[-w:]),
        "clipfrac_seq": mean_of("actor/clipfrac_seq"),
        "clipfrac_token": mean_of("actor/clipfrac_token"),
        "weight_mean": mean_of("behavior/weight_mean"),
        "weight_max": max(rp._values(steady, "behavior/weight_max"), default=math.nan),
        "capped_frac": mean_of("behavior/capped_frac"),
        "ess": mean_of("behavior/ess"),
        "kl_behavior": mean_of("behavior/kl_k3"),
        "length_drift": rp._mean(lengths[-w:]) - rp._mean(lengths[:w]),
        "reward_fall": fall["drop"] if rewards else math.nan,
        "collapse_step": float(fall["bottom"] or 0),  # where the largest fall bottomed out (0: none)
        "lag_violations": float(len(lag_violations(records, eta))),
    }


def summarize(runs: dict) -> dict[tuple[str, str, int, str], dict]:
    """{cell: {stat: {"mean", "sd", "n", "per_seed"}}} as rp.summarize, plus "collapsed": seeds with a fall of
    at least COLLAPSE."""
    out = {}
    for key, seeds in runs.items():
        per_run = [run_summary(records, key[2], meta["steps"]) for meta, records in seeds]
        stats = rp.over_seeds(per_run)
        stats["collapsed"] = sum(s["reward_fall"] >= COLLAPSE for s in per_run)
        stats["collapse_steps"] = [s["collapse_step"] for s in per_run if s["reward_fall"] >= COLLAPSE]
        out[key] = stats
    return out


# ----------------------------------------------------------------------------------------------- report

COLUMNS = (  # (header, stat, format): the table's columns after model / loss / pi_old / eta
    ("greedy val. accuracy, final", "val_final", "f3"),
    ("greedy val. accuracy, last two", "val_late", "f3"),
    ("val. gain over the run", "val_gain", "f3"),
    ("reward, last fifth", "reward_last", "f3"),
    ("clipped sequences", "clipfrac_seq", "pct"),
    ("clipped tokens", "clipfrac_token", "pct"),
    ("behaviour weight, mean", "weight_mean", "f3"),
    ("behaviour weight, max", "weight_max", "f3"),
    ("share capped", "capped_frac", "pct"),
    ("ESS share", "ess", "f3"),
    ("KL(mu, pi_prox) / token", "kl_behavior", "sci"),
    ("length drift", "length_drift", "f3"),
)
COLORS = {"gspo": "tab:blue", "gspo_token": "tab:green", "grpo": "tab:orange"}
STYLES = {"recompute": "-", "engine": "--"}
SAMPLES_PER_STEP = rp.SHARED["data.train_batch_size"] * rp.SHARED["rollout.n"]


def render_table(summary: dict) -> str:
    head = ["model", "loss", "pi_old", "eta", *(h for h, _, _ in COLUMNS), "collapsed seeds"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (model, loss, eta, pi_old), st in summary.items():
        cells = [model, LOSS_LABELS[loss], pi_old if eta else "either", str(eta)]
        cells += [rp.cell(st[stat], kind) for _, stat, kind in COLUMNS]
        at = ", ".join(f"{x:.0f}" for x in st["collapse_steps"])
        cells.append(f"{st['collapsed']}/{st['val_final']['n']}" + (f" (step {at})" if at else ""))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell_at(summary: dict, model: str, loss: str, eta: int, pi_old: str) -> dict | None:
    return summary.get((model, loss, eta, "recompute" if eta == 0 else pi_old))


TOLERANCE_STAT = "val_late"  # what "holds its accuracy" is judged on


def tolerance(summary: dict, model: str, loss: str, pi_old: str) -> tuple[int | None, int | None]:
    """(the largest eta whose late validation accuracy is not distinguishably below eta 0's, the smallest eta whose
    is): "distinguishably" = more than twice the standard error of the difference (rp.distinguishable). (None,
    None) without an eta-0 cell, a staler cell, or a second seed in each (no basis for a claim)."""
    base = _cell_at(summary, model, loss, 0, pi_old)
    if base is None:
        return None, None
    held, broke, compared = 0, None, False
    for eta in sorted({k[2] for k in summary if k[0] == model and k[1] == loss and k[2] > 0}):
        st = _cell_at(summary, model, loss, eta, pi_old)
        if st is None:
            continue
        sep = rp.distinguishable(st[TOLERANCE_STAT], base[TOLERANCE_STAT])
        if sep is None:
            return None, None
        compared = True
        if sep and st[TOLERANCE_STAT]["mean"] < base[TOLERANCE_STAT]["mean"]:
            broke = eta if broke is None else broke
        elif broke is None:
            held = eta
    return (held, broke) if compared else (None, None)


def pi_old_effect(summary: dict) -> list[str]:
    """Per (model, loss): recompute - engine in the reward over the last fifth (1,024 samples a step-window, the
    least noisy learning measure here) and in the clipped-sequence fraction, at every eta > 0."""
    lines = []
    for model in sorted({k[0] for k in summary}, key=MODELS.index):
        for loss in LOSSES:
            parts = []
            for eta in sorted({k[2] for k in summary if k[0] == model and k[1] == loss and k[2] > 0}):
                rec, eng = summary.get((model, loss, eta, "recompute")), summary.get((model, loss, eta, "engine"))
                if rec is None or eng is None:
                    continue
                d = rec["reward_last"]["mean"] - eng["reward_last"]["mean"]
                sep = rp.distinguishable(rec["reward_last"], eng["reward_last"])
                tag = "" if sep is None else " (distinguishable)" if sep else " (within noise)"
                clip = (rec["clipfrac_seq"]["mean"], eng["clipfrac_seq"]["mean"])
                parts.append(f"eta {eta}: {d:+.3f}{tag}, clipped {100 * clip[0]:.3g}% vs {100 * clip[1]:.3g}%")
            if parts:
                lines.append(f"- {model}, {LOSS_LABELS[loss]}, recompute - engine, reward over the last fifth: "
                             + "; ".join(parts) + ".")  # fmt: skip
    return lines


def token_identity(runs: dict) -> str | None:
    """GSPO-token against GSPO on the same cell and seed. With one advantage per sequence (ours: group-normalised
    rewards) the paper (section 4.3) says the two are identical in objective, clipping and gradient; this measures
    how identical: the same rewards at every step, and the largest relative gap in the loss and gradient norm."""
    pairs = 0
    same_rewards = 0
    gap = 0.0
    for (model, loss, eta, pi_old), seeds in runs.items():
        if loss != "gspo_token":
            continue
        twins = {meta["seed"]: records for meta, records in runs.get((model, "gspo", eta, pi_old), [])}
        for meta, records in seeds:
            other = twins.get(meta["seed"])
            if other is None:
                continue
            pairs += 1
            a = [r for r in records if "reward/mean" in r]
            b = [r for r in other if "reward/mean" in r]
            same_rewards += [r["reward/mean"] for r in a] == [r["reward/mean"] for r in b]
            for x, y in zip(a, b, strict=True):
                for key in ("actor/pg_loss", "actor/grad_norm"):
                    if x.get(key) is not None and y.get(key) is not None:
                        gap = max(gap, abs(x[key] - y[key]) / max(abs(y[key]), 1e-12))
    if not pairs:
        return None
    return (
        f"- GSPO-token against GSPO, {pairs} paired runs (same cell and seed): the same reward at every step in "
        f"{same_rewards} of them; the largest relative gap in the loss or gradient norm at any step {gap:.1e}. With "
        "one advantage per sequence the two objectives are the same function (paper, section 4.3), so GSPO-token "
        "runs for seed 0 only (`--token-seeds`); its rows stand for GSPO's."
    )


def observations(summary: dict) -> list[str]:
    """What the table says, one line per (model, pi_old) and per loss pair, every number computed from raw/."""
    lines = []
    models = sorted({k[0] for k in summary}, key=MODELS.index)
    for model in models:
        for pi_old in PI_OLD:
            parts = []
            for loss in LOSSES:
                held, broke = tolerance(summary, model, loss, pi_old)
                if held is None:
                    continue
                parts.append(
                    f"{LOSS_LABELS[loss]} holds its eta-0 late accuracy to eta {held}"
                    + (f", falls at eta {broke}" if broke is not None else "")
                )
            if parts:
                lines.append(f"- {model}, pi_old = {pi_old}: " + "; ".join(parts) + ".")
        for eta in sorted({k[2] for k in summary if k[0] == model and k[2] > 0}):
            for pi_old in PI_OLD:
                g, r = _cell_at(summary, model, "gspo", eta, pi_old), _cell_at(summary, model, "grpo", eta, pi_old)
                if g is None or r is None:
                    continue
                d = g[TOLERANCE_STAT]["mean"] - r[TOLERANCE_STAT]["mean"]
                sep = rp.distinguishable(g[TOLERANCE_STAT], r[TOLERANCE_STAT])
                verdict = "one seed, no claim" if sep is None else "distinguishable" if sep else "within noise"
                lines.append(
                    f"- {model}, eta {eta}, pi_old = {pi_old}: GSPO - GRPO late accuracy {d:+.3f} ({verdict}); "
                    f"clipped sequences {100 * g['clipfrac_seq']['mean']:.3g}% vs "
                    f"{100 * r['clipfrac_seq']['mean']:.3g}%."
                )
    return lines


def _axes(rows: int, cols: int):
    figure_cls, canvas_cls = rp._matplotlib()
    fig = figure_cls(figsize=(4.6 * cols, 3.5 * rows), dpi=100)
    canvas_cls(fig)
    return fig, fig.subplots(rows, cols, squeeze=False)


def plot_curves(path: Path, runs: dict, key: str, ylabel: str) -> None:
    """Rows: models; columns: losses; one line per (eta, pi_old), mean over seeds, x = trained samples."""
    models = sorted({k[0] for k in runs}, key=MODELS.index)
    losses = [loss for loss in LOSSES if any(k[1] == loss for k in runs)]
    fig, axes = _axes(len(models), len(losses))
    etas = sorted({k[2] for k in runs})
    shades = {eta: 0.25 + 0.75 * i / max(len(etas) - 1, 1) for i, eta in enumerate(etas)}
    for row, model in enumerate(models):
        for col, loss in enumerate(losses):
            ax = axes[row][col]
            for (m, lo, eta, pi_old), seeds in runs.items():
                if (m, lo) != (model, loss):
                    continue
                steps, mean, _ = rp.band([records for _, records in seeds], key)
                x = [s * SAMPLES_PER_STEP for s in steps]
                label = f"eta {eta}" + (f", {pi_old}" if eta else "")
                ax.plot(x, mean, STYLES[pi_old], color=COLORS[loss], alpha=shades[eta], marker="o", markersize=2,
                        label=label)  # fmt: skip
            _label(ax, f"{model}, {LOSS_LABELS[loss]}", "trained samples", ylabel)
    title = f"{key}: mean over seeds (solid: recompute + correction, dashed: engine, darker: staler)"
    _save(fig, path, title)


def _label(ax: Any, title: str, xlabel: str, ylabel: str) -> None:
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def _save(fig: Any, path: Path, title: str) -> None:
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path)


def plot_vs_eta(path: Path, summary: dict, stat: str, ylabel: str, log: bool = False) -> None:
    """One panel per model: ``stat`` against eta, one line per (loss, pi_old), error bars = sd over seeds."""
    models = sorted({k[0] for k in summary}, key=MODELS.index)
    fig, axes = _axes(1, len(models))
    for ax, model in zip(axes[0], models, strict=True):
        for loss in LOSSES:
            for pi_old in PI_OLD:
                pts = [(eta, _cell_at(summary, model, loss, eta, pi_old)) for eta in ETAS]
                pts = [(eta, st[stat]) for eta, st in pts if st is not None and not math.isnan(st[stat]["mean"])]
                if len(pts) < 2:
                    continue
                sd = [0.0 if math.isnan(v["sd"]) else v["sd"] for _, v in pts]
                ax.errorbar([e for e, _ in pts], [v["mean"] for _, v in pts], yerr=sd, fmt="o" + STYLES[pi_old],
                            color=COLORS[loss], capsize=3, label=f"{LOSS_LABELS[loss]}, {pi_old}")  # fmt: skip
        if log:
            ax.set_yscale("log", nonpositive="mask")
        ax.set_xticks(list(ETAS))
        _label(ax, rp.MODEL_LABELS[model], "staleness eta (versions)", ylabel)
    _save(fig, path, f"{ylabel} against staleness (eta 0: recompute, shared by both pi_old lines)")


FIGURES_VS_ETA = (  # (file, stat, y label, log)
    ("final_accuracy_vs_eta.png", "val_final", "final greedy validation accuracy", False),
    ("clipfrac_seq_vs_eta.png", "clipfrac_seq", "clipped sequence fraction", False),
    ("kl_behavior_vs_eta.png", "kl_behavior", "KL(mu || pi_prox) per stale token", True),
    ("ess_vs_eta.png", "ess", "behaviour-weight ESS share", False),
)


def render_report(out: Path, runs: dict, summary: dict) -> str:
    metas = [meta for seeds in runs.values() for meta, _ in seeds]
    first = metas[0]
    wall = sum(m["wall_s"] for m in metas)
    loads = [m["loadavg_1m"][0] for m in metas]
    eta0 = [r for key, seeds in runs.items() if key[2] == 0 for _, records in seeds for r in records]
    gap = max(rp._values(eta0, "rollout/logprob_gap_mean"), default=math.nan)
    bad = {k: st["lag_violations"]["per_seed"] for k, st in summary.items() if any(st["lag_violations"]["per_seed"])}
    lines = [
        "# Staleness: GSPO against GRPO and GSPO-token, with and without the behaviour correction",
        "",
        "Generated by `benchmarks/staleness_study.py` from `raw/`; do not edit by hand. Continue or regenerate with "
        "`.venv/bin/python benchmarks/staleness_study.py` (finished runs are kept), or only this file and the "
        "figures with `--report-only`.",
        "",
        "## Setup",
        "",
        f"- {len(metas)} runs in {len(runs)} cells; {first['steps']} steps each (rollout batch 16 prompts x 8 = "
        f"{SAMPLES_PER_STEP} samples), greedy validation on 39 held-out problems every {first['val_every']} steps "
        "and before training; the paper reproduction's settings (reproduce_paper.py SHARED, lr 1e-4, fp32, "
        "hf rollout + fsdp on CPU, 1 torch thread).",
        "- eta = `rollout.weights_lag`: step k trains on samples of the weights after update k - 1 - eta, exactly "
        "eta versions old once k > eta (the first eta steps: the initial weights). Per-step metrics below are "
        "means over the steps at the forced lag (k > eta). Every run's lag was checked from its raw metrics: "
        + ("all exact." if not bad else f"**violations** in {sorted(bad)}."),
        "- pi_old = `engine`: the stale behaviour policy's log-probs, no correction (the naive objective); "
        "`recompute`: pi_prox recomputed with the trained weights and the capped (2.0) length-normalised sequence "
        "weight w_i = min(exp(mean_t(log pi_prox - log mu)), 2) on the advantage. At eta 0 they coincide up to the "
        f"engines' precision gap (here at most {gap:.1e} per token: `rollout/logprob_gap_mean` over the eta-0 "
        "runs), so eta 0 ran once. Behaviour-weight columns under `engine` are measured, not applied.",
        "- Collapsed: the 3-step mean reward fell at least 0.25 below its best so far (reproduce_paper.py).",
        f"- Machine: {first['machine']['cpus']} CPU cores ({first['machine']['platform']}, torch "
        f"{first['machine']['torch']}), 1-min load average {rp._mean(loads):.1f} at the runs' starts (2 = both "
        f"cores busy); {wall / 3600:.2f} h of run time in all, first run "
        f"{min(m['date'] for m in metas)}, last {max(m['date'] for m in metas)}.",
        "",
        "## Results",
        "",
        render_table(summary),
        "",
        "Cells: mean ± sample sd over seeds (n in the last column).",
        "",
        *(f"![{stat}]({name})" for name, stat, _, _ in FIGURES_VS_ETA),
        "![validation accuracy](val_accuracy.png)",
        "![clipped sequences](clipfrac_seq.png)",
        "![reward](reward.png)",
        "",
        "## What the numbers say",
        "",
        "Computed from the table. 'Late accuracy': the mean of the last two greedy validations; 'distinguishable': "
        "more than twice the standard error of the difference (no claim is made from one seed).",
        "",
        *observations(summary),
        *pi_old_effect(summary),
        *filter(None, [token_identity(runs)]),
        "",
    ]
    return "\n".join(lines)


def write_report(out: Path) -> Path:
    runs = load_runs(out)
    summary = summarize(runs)
    for name, stat, ylabel, log in FIGURES_VS_ETA:
        plot_vs_eta(out / name, summary, stat, ylabel, log)
    plot_curves(out / "val_accuracy.png", runs, VAL_KEY, "greedy validation accuracy")
    plot_curves(out / "clipfrac_seq.png", runs, "actor/clipfrac_seq", "clipped sequence fraction")
    plot_curves(out / "reward.png", runs, "reward/mean", "mean reward (sampled)")
    path = out / "results.md"
    path.write_text(render_report(out, runs, summary))
    return path


# ----------------------------------------------------------------------------------------------- arguments


def _ints(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{flag} must be comma-separated integers, got {text!r}") from None


def _subset(text: str, allowed, flag: str) -> list:
    picked = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in picked if x not in allowed]
    if bad or not picked:
        raise UserError(f"{flag} must be a comma-separated subset of {','.join(map(str, allowed))}, got {text!r}")
    return picked


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "staleness", help="report directory")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="rollout batches (steps) per run")
    p.add_argument("--seeds", type=int, default=DEFAULT_SEEDS, help="seeds per cell: 0..N-1")
    p.add_argument("--token-seeds", type=int, default=1, help="seeds of GSPO-token (GSPO's objective: see grid)")
    p.add_argument("--val-every", type=int, default=DEFAULT_VAL_EVERY, help="steps between greedy validations")
    p.add_argument("--models", default=",".join(MODELS), help="subset of: " + ",".join(MODELS))
    p.add_argument("--losses", default=",".join(LOSSES), help="subset of: " + ",".join(LOSSES))
    p.add_argument("--etas", default=",".join(map(str, ETAS)), help="staleness values, each >= 0")
    p.add_argument("--shard", default="1/1", help="K/N: run every N-th run of the grid from the K-th (1-based)")
    p.add_argument("--report-only", action="store_true", help="no training: results.md and figures from raw/")
    p.add_argument("--work-dir", type=Path, default=None, help="where throwaway run directories go (default: tmp)")
    args = p.parse_args(argv)
    args.models = _subset(args.models, MODELS, "--models")
    args.losses = _subset(args.losses, LOSSES, "--losses")
    args.etas = sorted(set(_ints(args.etas, "--etas")))
    if not args.etas or args.etas[0] < 0:
        raise UserError(f"--etas must be integers >= 0, got {args.etas}")
    for flag, value in (("--steps", args.steps), ("--seeds", args.seeds), ("--val-every", args.val_every),
                        ("--token-seeds", args.token_seeds)):  # fmt: skip
        if value < 1:
            raise UserError(f"{flag} must be >= 1, got {value}")
    k, _, n = args.shard.partition("/")
    if not (k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n)):
        raise UserError(f"--shard must be K/N with 1 <= K <= N, got {args.shard!r}")
    args.shard = (int(k), int(n))
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        if not args.report_only:
            train_all(args)
        path = write_report(args.out)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
