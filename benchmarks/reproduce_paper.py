"""Reproduce the GSPO paper's qualitative claims at tiny scale: GSPO vs GRPO on the embedded Qwen3-MoE and dense models.

    .venv/bin/python benchmarks/reproduce_paper.py --out docs/results      # the full default run
    .venv/bin/python benchmarks/reproduce_paper.py --out docs/results --replot   # figures + report from the JSON

Claims under test (Zheng et al., arXiv 2507.18071): GSPO clips about two orders of magnitude more tokens than
GRPO yet learns faster, and GRPO is unstable on MoE models without Routing Replay while GSPO is not.

What runs: for every seed, model (tiny Qwen3-MoE, then the dense tiny Qwen3 as a control) and algorithm (GRPO + R2
on the MoE only), one ``gspo_ascend.trainer.train`` call on the synthetic arithmetic task with the same rollout
batch (16 prompts x n=8), 4 minibatches per rollout batch, lr, response length and number of steps. GSPO = preset
``gspo_paper`` (clip 3e-4 / 4e-4, seq-mean-token-mean); GRPO = preset ``grpo_paper`` (clip 0.2 / 0.27) with
``--grpo-agg`` (default token-mean, the DAPO-style GRPO of configs/tiny_grpo.yaml). ``trainer.seed`` fixes the prompt
order and the sampling seeds, so with one seed all algorithms see the same prompts and, at step 1, the same responses.
Runs are interleaved (seed, model, algorithm) so load from other jobs on a shared machine hits both alike.

Output in ``--out``: ``raw/<model>-<algo>-seed<k>.jsonl`` (each run's own metrics.jsonl, unmodified),
``runs.json`` (settings, per-run wall time, machine load), the PNG figures and ``results.md`` (the table and the
"what we observed" section, whose every data statement is computed from the raw files). ``--replot`` rebuilds
the figures and results.md from those files without training.

How we differ from the paper: a 625k-parameter MoE (4 experts, top-2) and a 427k-parameter dense model instead
of Qwen3-30B-A3B, a toy task with ~14-token responses, lr 1e-4 (the tiny model's) and tens of steps instead of
thousands; the rollout and train engines are both Hugging Face forwards on CPU, so there is (almost) no
train/inference mismatch and routing never differs between engines. Routing still shifts between the old and the
updated policy within a step: every MoE run measures it (``routing/update_agreement``), and the MoE runs add the
paper's own baseline, GRPO with Routing Replay (``actor.routing_replay=r2``), beside GRPO without it.

Why one file over 600 lines: a benchmark script that runs, summarises and reports in one, so that it is run,
copied to another box and read as one; its statistics and report are pure functions over the raw JSON
(``--replot``), tested in tests/unit/test_reproduce_paper.py, and benchmarks/staleness_study.py imports them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # runnable as `python benchmarks/reproduce_paper.py` from anywhere
    sys.path.insert(0, str(REPO))

from gspo_ascend.errors import UserError  # noqa: E402

MODELS = ("moe", "dense")
MODEL_LABELS = {"moe": "tiny Qwen3-MoE (625k, 4 experts top-2)", "dense": "tiny Qwen3 dense (427k), control"}
ALGOS = {"gspo": "gspo_paper", "grpo": "grpo_paper", "grpo_r2": "grpo_paper"}  # algorithm -> preset (presets.py)
# GRPO + Routing Replay, the paper's own MoE baseline: the old policy's experts replayed in the update (r2); MoE only
ALGO_OVERRIDES = {"grpo_r2": {"actor.routing_replay": "r2"}}
MOE_ONLY = ("grpo_r2",)
PAIR = ("gspo", "grpo")  # the paper's comparison; GRPO + R2 is observed apart
LABELS = {"gspo": "GSPO", "grpo": "GRPO", "grpo_r2": "GRPO + R2"}
COLORS = {"gspo": "tab:blue", "grpo": "tab:orange", "grpo_r2": "tab:green"}
DEFAULT_STEPS = 60
DEFAULT_SEEDS = 3
QUICK_STEPS, QUICK_SEEDS = 2, 1
# A "collapse": the 3-step mean reward falls this far below its best so far. One step's reward (128 samples)
# has a standard error of about 0.04, a 3-step mean about 0.025: 0.25 is ten of those, not sampling noise.
FALL_WINDOW, COLLAPSE = 3, 0.25
MANIFEST = "runs.json"
REPORT = "results.md"
RAW_DIR = "raw"
# Identical for every run: the paper's rollout batch shape at tiny scale, and the tiny models' lr.
SHARED = {
    "data.train_batch_size": 16,
    "data.max_prompt_length": 64,
    "data.max_response_length": 32,
    "rollout.engine": "hf",
    "rollout.n": 8,
    "rollout.temperature": 1.0,
    "actor.engine": "fsdp",
    "actor.micro_batch_size": 32,  # 16 x 8 / 4 minibatches: one forward/backward per optimizer step
    "algorithm.minibatches_per_rollout": 4,
    "algorithm.old_logprobs": "recompute",
    "trainer.device": "cpu",
    "trainer.save_freq": 0,
    "trainer.resume": "never",
    "trainer.loggers": ["jsonl"],
}
SEEDS_FIGURE = "reward_seeds.png"
# (file, y label, metric key, log scale): each figure has one panel per model, GSPO vs GRPO, mean +- sd over seeds
FIGURES = (
    ("reward.png", "mean reward", "reward/mean", False),
    ("clipfrac_token.png", "clipped token fraction (log)", "actor/clipfrac_token", True),
    ("clipfrac_seq.png", "clipped sequence fraction (log)", "actor/clipfrac_seq", True),
    ("kl_k3_token.png", "KL(pi_old || pi) per token, k3 (log)", "actor/kl_k3_token", True),
    ("grad_norm.png", "gradient norm (mean of 4 minibatches)", "actor/grad_norm", False),
    ("response_length.png", "mean response length (tokens)", "response/length_mean", False),
)


# ----------------------------------------------------------------------------------------------- arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=REPO / "docs" / "results", help="report directory")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="rollout batches (steps) per run")
    p.add_argument("--seeds", type=int, default=DEFAULT_SEEDS, help="seeds per (model, algorithm): 0..N-1")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of: moe,dense")
    p.add_argument("--quick", action="store_true", help=f"smoke size: {QUICK_STEPS} steps, {QUICK_SEEDS} seed")
    p.add_argument("--replot", action="store_true", help="no training: redraw figures and results.md from --out")
    p.add_argument("--lr", type=float, default=1e-4, help="learning rate of every run (the tiny models')")
    p.add_argument("--grpo-agg", default="token-mean", choices=("token-mean", "seq-mean-token-mean"))
    p.add_argument("--work-dir", type=Path, default=None, help="where throwaway run directories go (default: tmp)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the trainer's worker (see start_ray)")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.seeds = QUICK_STEPS, QUICK_SEEDS
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in args.models if m not in MODELS]
    if bad or not args.models:
        raise UserError(f"--models must be a comma-separated subset of {','.join(MODELS)}, got {bad or 'nothing'}")
    if args.steps < 1:
        raise UserError(f"--steps must be >= 1, got {args.steps}")
    if args.seeds < 1:
        raise UserError(f"--seeds must be >= 1, got {args.seeds}")
    if args.threads < 1:
        raise UserError(f"--threads must be >= 1, got {args.threads}")
    if not args.lr > 0:
        raise UserError(f"--lr must be > 0, got {args.lr}")
    return args


def run_name(model: str, algo: str, seed: int) -> str:
    return f"{model}-{algo}-seed{seed}"


def run_config(
    model: str, algo: str, seed: int, *, steps: int, lr: float, grpo_agg: str, out_dir: str, extra: dict | None = None
):
    """The trainer config of one run: SHARED, then the algorithm's paper preset, then model, seed and size, then
    ``extra`` (another study's settings: benchmarks/routing_study.py)."""
    from gspo_ascend.algorithms.presets import get_preset
    from gspo_ascend.config import load_config
    from gspo_ascend.runtime import resolve_train_files
    from gspo_ascend.tiny import ensure_tiny_model

    overrides = dict(SHARED) | get_preset(ALGOS[algo]) | ALGO_OVERRIDES.get(algo, {})
    if algo.startswith("grpo"):
        overrides["algorithm.loss_agg_mode"] = grpo_agg
    overrides |= {
        "model.path": str(ensure_tiny_model(moe=model == "moe")),
        # the embedded synthetic task; resolved explicitly because model.path is no longer "" (the embedded one)
        "data.train_files": resolve_train_files(load_config(None, [])),
        "actor.lr": lr,
        "trainer.seed": seed,
        "trainer.total_steps": steps,
        "trainer.output_dir": out_dir,
        "trainer.experiment_name": run_name(model, algo, seed),
    }
    overrides |= extra or {}
    return load_config(None, [f"{k}={json.dumps(v)}" for k, v in overrides.items()])


# ----------------------------------------------------------------------------------------------- training


def algos_of(model: str) -> list[str]:
    """The algorithms run on ``model``: routing replay only where there is routing."""
    return [a for a in ALGOS if model == "moe" or a not in MOE_ONLY]


def machine() -> dict:
    import torch

    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "loadavg_1m_at_start": os.getloadavg()[0],
    }


def start_ray(threads: int) -> None:
    """Start the local Ray instance the trainer then joins, with ``threads`` CPUs.

    The trainer gives its single worker every CPU Ray knows of as torch intra-op threads. On the shared 2-core
    box two threads spin against the other jobs: measured 6-14 s per MoE step with 2 threads against 1.3-1.5 s
    with 1, under the same load. Starting Ray first with ``num_cpus=threads`` is the trainer's documented way
    in (it joins an initialised Ray) and changes no setting of the runs. Ray also starts workers at niceness
    15, where they would lose the CPU to every other job; the wall time should measure this benchmark.
    """
    import ray

    from gspo_ascend.workers import FORWARDED_ENV

    os.environ.setdefault("RAY_worker_niceness", "0")
    if ray.is_initialized() or os.environ.get("RAY_ADDRESS"):
        return  # a cluster the user chose: leave its sizing alone
    env = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
    ray.init(num_cpus=threads, include_dashboard=False, runtime_env={"env_vars": env}, log_to_driver=True)


def train_all(args: argparse.Namespace) -> dict:
    """Every (seed, model, algorithm) run; each run's metrics.jsonl is copied to out/raw, its directory deleted."""
    from gspo_ascend.rewards import shutdown_reward_workers
    from gspo_ascend.trainer import train

    start_ray(args.threads)
    out = args.out
    (out / RAW_DIR).mkdir(parents=True, exist_ok=True)
    manifest = {
        "command": "python benchmarks/reproduce_paper.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "settings": {"steps": args.steps, "seeds": args.seeds, "models": args.models, "lr": args.lr}
        | {"grpo_agg": args.grpo_agg, "threads": args.threads, "shared": SHARED, "presets": ALGOS},
        "machine": machine(),
        "runs": [],
    }
    plan = [(s, m, a) for s in range(args.seeds) for m in args.models for a in algos_of(m)]
    start = time.perf_counter()
    for i, (seed, model, algo) in enumerate(plan, 1):
        name = run_name(model, algo, seed)
        run_dir = Path(tempfile.mkdtemp(prefix=f"gspo-repro-{name}-", dir=args.work_dir))
        try:
            sizes = {"steps": args.steps, "lr": args.lr, "grpo_agg": args.grpo_agg}
            cfg = run_config(model, algo, seed, **sizes, out_dir=str(run_dir))
            t0 = time.perf_counter()
            history = train(cfg)
            wall = time.perf_counter() - t0
            shutil.copyfile(run_dir / "metrics.jsonl", out / RAW_DIR / f"{name}.jsonl")
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)
            # Fresh reward workers per run: scoring cost grows with the samples a worker has scored (a logging
            # filter added per sample in rewards/math_answer.py), which would make later runs ever slower.
            shutdown_reward_workers()
        manifest["runs"].append(
            {"model": model, "algo": algo, "seed": seed, "steps": len(history), "wall_s": round(wall, 1)}
            | {"file": f"{RAW_DIR}/{name}.jsonl"}
        )
        final = history[-1].get("reward/mean", math.nan) if history else math.nan
        print(f"[{i}/{len(plan)}] {name}: {len(history)} steps in {wall:.0f} s, last reward {final:.3f}", flush=True)
        _write_manifest(out, manifest)  # after every run: an interrupted sweep keeps what it measured
    manifest["wall_s"] = round(time.perf_counter() - start, 1)
    manifest["machine"]["loadavg_1m_at_end"] = os.getloadavg()[0]
    _write_manifest(out, manifest)
    return manifest


def _write_manifest(out: Path, manifest: dict) -> None:
    tmp = out / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    tmp.replace(out / MANIFEST)


def load_results(out: Path) -> tuple[dict, dict[tuple[str, str], list[list[dict]]]]:
    """(manifest, {(model, algo): [per-seed records, in seed order]}) from a report directory."""
    from gspo_ascend.metrics import read_metrics

    path = out / MANIFEST
    if not path.is_file():
        raise UserError(f"{path} does not exist; run without --replot first (or pass --out <report dir>)")
    manifest = json.loads(path.read_text())
    results: dict[tuple[str, str], list[list[dict]]] = {}
    for run in sorted(manifest["runs"], key=lambda r: r["seed"]):
        results.setdefault((run["model"], run["algo"]), []).append(read_metrics(out / run["file"]))
    if not results:
        raise UserError(f"{path} lists no runs; run the benchmark again")
    return manifest, results


# ----------------------------------------------------------------------------------------------- statistics


def window(steps: int) -> int:
    """Steps in the "first" and "last" reward windows: a fifth of the run (reward per step is noisy)."""
    return max(1, round(steps / 5))


def _values(records: list[dict], key: str) -> list[float]:
    """The finite values of ``key`` in step order (non-finite ones are logged as null)."""
    return [float(r[key]) for r in records if r.get(key) is not None]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def reward_fall(rewards: list[float], k: int = FALL_WINDOW) -> dict[str, float | int | None]:
    """The largest fall of the trailing k-step mean reward below its best so far, and when it happened.

    ``drop``: that fall; ``peak`` / ``bottom``: the 1-based steps (window ends) of the best value before it and
    of the low point; ``recovered``: the first later step whose k-step mean is back at the peak (None: never).
    """
    means = [_mean(rewards[i - k + 1 : i + 1]) for i in range(k - 1, len(rewards))]
    best, peak, fall = -math.inf, 0, {"drop": 0.0, "peak": None, "bottom": None, "recovered": None}
    for i, m in enumerate(means):
        if m > best:
            best, peak = m, i
        if best - m > fall["drop"]:
            fall = {"drop": best - m, "peak": peak + k, "bottom": i + k, "recovered": None}
    if fall["bottom"] is not None:
        top = means[fall["peak"] - k]
        later = [i + k for i in range(fall["bottom"] - k + 1, len(means)) if means[i] >= top]
        fall["recovered"] = later[0] if later else None
    return fall


def run_summary(records: list[dict], w: int) -> dict[str, float]:
    """One run's figures: reward over the first / last ``w`` steps and over all steps, per-step means of the rest."""
    rewards = _values(records, "reward/mean")
    norms = _values(records, "actor/grad_norm")
    return {
        "reward_first": _mean(rewards[:w]),
        "reward_last": _mean(rewards[-w:]),
        "reward_all": _mean(rewards),  # the area under the learning curve / steps: a learning-speed measure
        "clipfrac_token": _mean(_values(records, "actor/clipfrac_token")),
        "clipfrac_seq": _mean(_values(records, "actor/clipfrac_seq")),
        "kl_k3_token": _mean(_values(records, "actor/kl_k3_token")),
        "grad_norm": _mean(norms),
        "grad_norm_max": max(norms) if norms else math.nan,
        "reward_fall": reward_fall(rewards)["drop"] if rewards else math.nan,
        "kl_max": max(_values(records, "actor/kl_k3_token"), default=math.nan),
        "truncated_max": max(_values(records, "response/clip_ratio"), default=math.nan),
        "length": _mean(_values(records, "response/length_mean")),
        "nan_steps": sum(_values(records, "actor/nan_steps_skipped")),
        "seq_ratio_max": _mean(_values(records, "actor/seq_ratio_max")),
        "seq_ratio_min": _mean(_values(records, "actor/seq_ratio_min")),
        "logprob_gap": _mean(_values(records, "rollout/logprob_gap_mean")),
        # share of tokens whose experts in the update's forwards (the router's own choice, before any replay) are
        # those of the old-log-prob forward: the paper's expert volatility within a step, on MoE runs only
        "routes_kept": _mean(_values(records, "routing/update_agreement_mean")),
        "routes_kept_min": min(_values(records, "routing/update_agreement_min_layer"), default=math.nan),
    }


def summarize(results: dict[tuple[str, str], list[list[dict]]], w: int) -> dict[tuple[str, str], dict]:
    """{(model, algo): {stat: {"mean", "sd", "n", "per_seed"}}}; sd is the sample sd over seeds (nan for one)."""
    return {key: over_seeds([run_summary(records, w) for records in runs]) for key, runs in results.items()}


def over_seeds(per_run: list[dict[str, float]]) -> dict[str, dict]:
    """{stat: {"mean", "sd", "n", "per_seed"}} of one cell's runs (one per seed); a nan value is left out of the
    mean, sd and n, kept in per_seed."""
    stats = {}
    for stat in per_run[0]:
        xs = [s[stat] for s in per_run if not math.isnan(s[stat])]
        sd = statistics.stdev(xs) if len(xs) >= 2 else math.nan
        stats[stat] = {"mean": _mean(xs), "sd": sd, "n": len(xs), "per_seed": [s[stat] for s in per_run]}
    return stats


# ----------------------------------------------------------------------------------------------- report


def _num(x: float, kind: str) -> str:
    if math.isnan(x):
        return "n/a"
    if kind == "pct":
        return f"{100 * x:.3g}%"
    if kind == "sci":
        return f"{x:.2e}"
    return f"{x:.3f}"


def cell(stat: dict, kind: str = "f3") -> str:
    """The cell text "mean ± sd" (just the mean for a single seed)."""
    if math.isnan(stat["sd"]):
        return _num(stat["mean"], kind)
    sd = f"{100 * stat['sd']:.2g}%" if kind == "pct" else f"{stat['sd']:.1e}" if kind == "sci" else f"{stat['sd']:.3f}"
    return f"{_num(stat['mean'], kind)} ± {sd}"


TABLE_COLUMNS = (  # (header, stat, format)
    ("reward, first {w} steps", "reward_first", "f3"),
    ("reward, last {w} steps", "reward_last", "f3"),
    ("reward, all steps", "reward_all", "f3"),
    ("clipped tokens", "clipfrac_token", "pct"),
    ("clipped sequences", "clipfrac_seq", "pct"),
    ("KL k3 / token", "kl_k3_token", "sci"),
    ("grad norm", "grad_norm", "f3"),
    ("max grad norm", "grad_norm_max", "f3"),
    ("response length", "length", "f3"),
    ("routes kept in the update", "routes_kept", "pct"),
)


def render_table(summary: dict, models: list[str], w: int) -> str:
    head = ["model", "algorithm"] + [h.format(w=w) for h, _, _ in TABLE_COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for model in models:
        for algo in ALGOS:
            if (model, algo) not in summary:
                continue
            s = summary[(model, algo)]
            cells = [model, LABELS[algo]] + [cell(s[stat], kind) for _, stat, kind in TABLE_COLUMNS]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.inf if a > 0 else math.nan


def distinguishable(a: dict, b: dict) -> bool | None:
    """Whether two mean ± sd figures differ by more than twice the standard error of their difference.

    None when either has a single seed (no spread, so no basis for a claim).
    """
    if a["n"] < 2 or b["n"] < 2:
        return None
    se = math.sqrt(a["sd"] ** 2 / a["n"] + b["sd"] ** 2 / b["n"])
    return abs(a["mean"] - b["mean"]) > 2 * se


def observe_clipping(summary: dict, model: str) -> str:
    g, r = summary[(model, "gspo")], summary[(model, "grpo")]
    gt, rt = g["clipfrac_token"]["mean"], r["clipfrac_token"]["mean"]
    x = ratio(gt, rt)
    orders = math.log10(x) if 0 < x < math.inf else x
    every = min(g["clipfrac_token"]["per_seed"]) > max(r["clipfrac_token"]["per_seed"])
    if orders >= 1.5:
        verdict = "the paper's direction and roughly its size (it reports about two orders of magnitude)"
    elif x > 1:
        verdict = "the paper's direction, but less than its two orders of magnitude"
    else:
        verdict = "the opposite of the paper"
    return (
        f"**Clipping, {model}.** GSPO clipped {_num(gt, 'pct')} of response tokens per step, GRPO "
        f"{_num(rt, 'pct')}: {x:.0f}x ({orders:.1f} orders of magnitude), {verdict}; "
        f"{'in every seed' if every else 'not in every seed'} GSPO clipped more. By sequences: GSPO "
        f"{_num(g['clipfrac_seq']['mean'], 'pct')}, GRPO {_num(r['clipfrac_seq']['mean'], 'pct')}."
    )


def observe_learning(summary: dict, model: str) -> str:
    g, r = summary[(model, "gspo")], summary[(model, "grpo")]
    parts = []
    for stat, what in (("reward_last", "final-window reward"), ("reward_all", "reward averaged over all steps")):
        d = g[stat]["mean"] - r[stat]["mean"]
        sep = distinguishable(g[stat], r[stat])
        judged = (
            "one seed: no spread to judge it against"
            if sep is None
            else f"{'larger' if sep else 'smaller'} than twice the standard error over seeds"
        )
        parts.append(f"{what} GSPO {cell(g[stat])} vs GRPO {cell(r[stat])} (difference {d:+.3f}, {judged})")
    gains = [summary[(model, a)]["reward_last"]["mean"] - summary[(model, a)]["reward_first"]["mean"] for a in PAIR]
    return (
        f"**Learning, {model}.** " + "; ".join(parts) + f". Reward gain, last minus first window: GSPO "
        f"{gains[0]:+.3f}, GRPO {gains[1]:+.3f}."
    )


def observe_stability(summary: dict, results: dict, model: str) -> str:
    parts = []
    for algo in algos_of(model):
        st = summary[(model, algo)]
        falls = [reward_fall(_values(records, "reward/mean")) for records in results[(model, algo)]]
        collapsed = [(seed, f) for seed, f in enumerate(falls) if f["drop"] > COLLAPSE]
        text = (
            f"{LABELS[algo]}: {len(collapsed)}/{len(falls)} seeds collapsed (largest fall "
            f"{max(f['drop'] for f in falls):.2f}), largest per-step KL {max(st['kl_max']['per_seed']):.1e}, at most "
            f"{_num(max(st['truncated_max']['per_seed']), 'pct')} of a step's responses cut at the length limit, "
            f"largest gradient norm {max(st['grad_norm_max']['per_seed']):.2f}, "
            f"{int(sum(st['nan_steps']['per_seed']))} non-finite steps skipped"
        )
        for seed, f in collapsed:
            back = f"back at that level by step {f['recovered']}" if f["recovered"] else "never back at that level"
            text += (
                f" (seed {seed}: the {FALL_WINDOW}-step mean reward fell from its step-{f['peak']} best by "
                f"{f['drop']:.2f}, lowest at step {f['bottom']}, {back})"
            )
        parts.append(text)
    return (
        f"**Stability, {model}.** A collapse = the {FALL_WINDOW}-step mean reward falling more than {COLLAPSE} "
        "below its best so far. " + "; ".join(parts) + "."
    )


def paired_gap(summary: dict, model: str, stat: str = "reward_all") -> tuple[float, float]:
    """Mean and standard error over seeds of GSPO minus GRPO; seed k of both saw the same prompts and samplings."""
    d = [a - b for a, b in zip(*(summary[(model, x)][stat]["per_seed"] for x in PAIR), strict=True)]
    return _mean(d), statistics.stdev(d) / math.sqrt(len(d)) if len(d) >= 2 else math.nan


def observe_moe_vs_dense(summary: dict) -> str | None:
    if not all((m, a) in summary for m in MODELS for a in PAIR):
        return None
    (gm, sm), (gd, sd) = paired_gap(summary, "moe"), paired_gap(summary, "dense")
    diff, se = gm - gd, math.sqrt(sm**2 + sd**2)
    judged = "n/a with one seed" if math.isnan(se) else f"{'more' if abs(diff) > 2 * se else 'less'} than 2 se"
    return (
        f"**MoE vs the dense control.** GSPO minus GRPO in reward averaged over all steps, paired by seed: "
        f"{gm:+.3f} (se {sm:.3f}) on MoE, {gd:+.3f} (se {sd:.3f}) on dense. Relative to GRPO, GSPO does "
        f"{'better' if diff > 0 else 'worse'} on MoE than on dense by {diff:+.3f} (se {se:.3f}: {judged}). The "
        "paper's claim (GRPO handicapped on MoE specifically) predicts a positive difference."
    )


def observe_replay(summary: dict, results: dict) -> str | None:
    """The paper's MoE baseline: does replaying the old policy's experts (R2) rescue GRPO, and does GSPO need it?"""
    if not all(("moe", a) in summary for a in ALGOS):
        return None
    s = {a: summary[("moe", a)] for a in ALGOS}
    kept = ", ".join(f"{LABELS[a]} {_num(s[a]['routes_kept']['mean'], 'pct')}" for a in ALGOS)
    least = min(min(s[a]["routes_kept_min"]["per_seed"]) for a in ALGOS)
    collapsed = {a: sum(x > COLLAPSE for x in s[a]["reward_fall"]["per_seed"]) for a in ALGOS}
    n = len(s["grpo"]["reward_fall"]["per_seed"])
    d = s["grpo_r2"]["reward_all"]["mean"] - s["grpo"]["reward_all"]["mean"]
    sep = distinguishable(s["grpo_r2"]["reward_all"], s["grpo"]["reward_all"])
    judged = "one seed" if sep is None else f"{'larger' if sep else 'smaller'} than twice the standard error"
    g = s["gspo"]["reward_all"]["mean"] - s["grpo_r2"]["reward_all"]["mean"]
    return (
        f"**Routing Replay, moe.** Share of tokens whose experts in the update's forwards (the router's own choice) "
        f"are those of the old-log-prob forward, per step: {kept} (lowest per step and layer over all runs "
        f"{_num(least, 'pct')}): the experts that moved within a step, what R2 pins. GRPO + R2 minus GRPO in reward "
        f"averaged over all steps: {d:+.3f} ({judged}); collapsed seeds GRPO {collapsed['grpo']}/{n}, GRPO + R2 "
        f"{collapsed['grpo_r2']}/{n}, GSPO {collapsed['gspo']}/{n}. GSPO without replay minus GRPO + R2: {g:+.3f}."
    )


def observe_scale(summary: dict, lr: float) -> str:
    keys = [k for k in summary if k[1] == "gspo"]
    hi = _mean([summary[k]["seq_ratio_max"]["mean"] - 1 for k in keys])
    lo = _mean([1 - summary[k]["seq_ratio_min"]["mean"] for k in keys])
    beyond = hi > 4e-4 or lo > 3e-4
    gaps = [summary[k]["logprob_gap"]["mean"] for k in summary if not math.isnan(summary[k]["logprob_gap"]["mean"])]
    gap = f"at most {max(gaps):.1e} (largest over runs)" if gaps else "n/a (not logged)"
    return (
        f"**GSPO's sequence ratios.** In GSPO runs s_i reached on average 1 + {hi:.1e} (per-step maximum) and "
        f"1 - {lo:.1e} (per-step minimum), against the clip range 1 + 4e-4 / 1 - 3e-4: an optimizer step at lr "
        f"{lr:g} moves these models' per-token likelihoods {'beyond' if beyond else 'within'} the paper's range. "
        f"The first of the 4 minibatches of every step is exactly on-policy (s_i = 1, never clipped), so at most "
        f"75% of sequences can be clipped. The rollout and train engines' mean per-token log-prob gap is {gap}."
    )


# ----------------------------------------------------------------------------------------------- figures


def band(runs: list[list[dict]], key: str) -> tuple[list[int], list[float], list[float]]:
    """(steps, mean over seeds, sd over seeds; 0 for one seed) of ``key``; a step no seed logged is left out."""
    by_step: dict[int, list[float]] = {}
    for records in runs:
        for r in records:
            if r.get(key) is not None:
                by_step.setdefault(r["step"], []).append(float(r[key]))
    steps = sorted(by_step)
    means = [_mean(by_step[s]) for s in steps]
    sds = [statistics.stdev(by_step[s]) if len(by_step[s]) >= 2 else 0.0 for s in steps]
    return steps, means, sds


def _matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise UserError(
            f"the report needs matplotlib ({exc}); pip install matplotlib (see requirements-cpu.txt)"
        ) from None
    return Figure, FigureCanvasAgg


def _panels(n: int):
    """A figure (Agg canvas, no pyplot state) with ``n`` side-by-side axes."""
    figure_cls, canvas_cls = _matplotlib()
    fig = figure_cls(figsize=(5.2 * n, 3.9), dpi=100)
    canvas_cls(fig)
    return fig, fig.subplots(1, n, squeeze=False)[0]


def plot_figure(path: Path, results: dict, models: list[str], ylabel: str, key: str, log: bool) -> None:
    """One panel per model, GSPO vs GRPO: mean over seeds, shaded +- sd (Agg canvas, no pyplot state)."""
    fig, axes = _panels(len(models))
    for ax, model in zip(axes, models, strict=True):
        for algo in ALGOS:
            runs = results.get((model, algo))
            if not runs:
                continue
            steps, mean, sd = band(runs, key)
            lo = [m - s for m, s in zip(mean, sd, strict=True)]
            if log:  # a band reaching 0 would vanish on a log axis; cut it at a tenth of the mean instead
                lo = [max(v, m / 10) for v, m in zip(lo, mean, strict=True)]
            label = f"{LABELS[algo]} ({len(runs)} seed{'s' if len(runs) > 1 else ''})"
            marker = "o" if len(steps) < 40 else None  # a short run's points stay visible
            ax.plot(steps, mean, color=COLORS[algo], marker=marker, markersize=3, label=label)
            ax.fill_between(steps, lo, [m + s for m, s in zip(mean, sd, strict=True)], color=COLORS[algo], alpha=0.2)
        if log:
            ax.set_yscale("log", nonpositive="mask")  # a step where nothing was clipped is a gap, not a cliff
        ax.set_title(MODEL_LABELS[model], fontsize=10)
        ax.set_xlabel("step (rollout batch)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, which="both" if log else "major")
        ax.legend(loc="best", fontsize=9)
    fig.suptitle(f"{key}: mean ± sd over seeds", fontsize=11)
    fig.tight_layout()
    fig.savefig(path)


def plot_seeds(path: Path, results: dict, models: list[str], key: str = "reward/mean") -> None:
    """Every seed's own curve: a mean over seeds hides a single seed's collapse."""
    fig, axes = _panels(len(models))
    for ax, model in zip(axes, models, strict=True):
        for algo in ALGOS:
            for seed, records in enumerate(results.get((model, algo), [])):
                steps, values = zip(*((r["step"], r[key]) for r in records if r.get(key) is not None), strict=True)
                style = ("-", "--", ":", "-.")[seed % 4]
                ax.plot(steps, values, style, color=COLORS[algo], linewidth=1, label=f"{LABELS[algo]} seed {seed}")
        ax.set_title(MODEL_LABELS[model], fontsize=10)
        ax.set_xlabel("step (rollout batch)")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=7, ncol=2)
    fig.suptitle(f"{key}: every seed", fontsize=11)
    fig.tight_layout()
    fig.savefig(path)


def plot_all(out: Path, results: dict, models: list[str]) -> list[Path]:
    written = []
    for name, ylabel, key, log in FIGURES:
        plot_figure(out / name, results, models, ylabel, key, log)
        written.append(out / name)
    plot_seeds(out / SEEDS_FIGURE, results, models)
    return [*written, out / SEEDS_FIGURE]


# ----------------------------------------------------------------------------------------------- results.md


def verdicts(summary: dict, model: str) -> list[str]:
    """The three claims, as table cells for one model: what the data says, one short phrase each."""
    g, r = summary[(model, "gspo")], summary[(model, "grpo")]
    x = ratio(g["clipfrac_token"]["mean"], r["clipfrac_token"]["mean"])
    clip = f"{x:.0f}x ({math.log10(x):.1f} orders)" if 0 < x < math.inf else f"{x}"
    sep = distinguishable(g["reward_all"], r["reward_all"])
    d = g["reward_all"]["mean"] - r["reward_all"]["mean"]
    faster = (
        "no seed spread (1 seed)"
        if sep is None
        else ("yes" if sep and d > 0 else "no, GRPO faster" if sep else "no difference")
    )
    bad = [sum(x > COLLAPSE for x in s["reward_fall"]["per_seed"]) for s in (g, r)]
    unstable = "seen" if bad[1] > 0 and bad[0] == 0 else "not seen" if bad[1] == 0 else "both unstable"
    n = [len(s["reward_fall"]["per_seed"]) for s in (g, r)]
    seeds = f"collapsed seeds: GSPO {bad[0]}/{n[0]}, GRPO {bad[1]}/{n[1]}"
    return [clip, f"{faster} (all-steps reward {d:+.3f})", f"{unstable} ({seeds})"]


def _setup_lines(manifest: dict, w: int) -> list[str]:
    from gspo_ascend.algorithms.presets import get_preset

    st, m = manifest["settings"], manifest["machine"]
    preset_agg = get_preset(ALGOS["grpo"])["algorithm.loss_agg_mode"]
    sh = st["shared"]
    walls: dict[tuple[str, str], list[float]] = {}
    for run in manifest["runs"]:
        walls.setdefault((run["model"], run["algo"]), []).append(run["wall_s"])
    per = ", ".join(f"{mo} {LABELS[a]} {_mean(v):.0f} s" for (mo, a), v in walls.items())
    total = manifest.get("wall_s")
    return [
        f"- Models: {', '.join(MODEL_LABELS[x] for x in st['models'])}; the synthetic arithmetic task.",
        f"- {st['steps']} steps x {st['seeds']} seeds (0..{st['seeds'] - 1}) per model and algorithm; rollout batch "
        f"{sh['data.train_batch_size']} prompts x n={sh['rollout.n']}, {sh['algorithm.minibatches_per_rollout']} "
        f"minibatches (optimizer steps) per rollout batch, lr {st['lr']:g}, responses <= "
        f"{sh['data.max_response_length']} tokens, temperature {sh['rollout.temperature']}, old log-probs "
        f"{sh['algorithm.old_logprobs']}d, no KL term.",
        "- GSPO: preset `gspo_paper` (clip 3e-4 / 4e-4, seq-mean-token-mean). GRPO: preset `grpo_paper` (clip "
        f"0.2 / 0.27) with aggregation {st['grpo_agg']}"
        + (
            f" (the preset's is {preset_agg}; token-mean is the DAPO-style GRPO of configs/tiny_grpo.yaml)."
            if st["grpo_agg"] != preset_agg
            else "."
        )
        + " GRPO + R2 (MoE only): the same GRPO with `actor.routing_replay=r2`, the paper's Routing Replay (the "
        "experts of the old-log-prob forward replayed in the update's forwards).",
        f'- Windows: "first" / "last" = the first / last {w} steps (a fifth of the run); "all steps" = mean '
        "over the whole run (area under the learning curve: a learning-speed measure). Other columns: per-step "
        "values averaged over the run. Cells: mean ± sample sd over seeds.",
        f"- Measured {manifest['date']} on {m['cpus']} CPU cores ({m['platform']}, torch {m['torch']}, "
        f"{st['threads']} torch thread{'s' if st['threads'] > 1 else ''} in the trainer's worker), shared "
        f"with other jobs (1-min load average {m['loadavg_1m_at_start']:.1f} at start"
        + (f", {m['loadavg_1m_at_end']:.1f} at end" if "loadavg_1m_at_end" in m else "")
        + "). Wall time "
        + (f"{total / 60:.1f} min in all" if total else "(run interrupted)")
        + f"; per run: {per}.",
    ]


def scale_notes(summary: dict) -> str:
    """Why the tiny setting cannot test everything the paper claims; the one number in it is measured."""
    length = _mean([v["length"]["mean"] for v in summary.values()])
    return f"""\
- **Routing volatility, only part of it.** The paper traces GRPO's MoE failure to expert-activation
  volatility: after a gradient update a noticeable share of the experts chosen for the same response change,
  so token-level ratios swing and clipping stops controlling them; Routing Replay replays the old policy's
  routing when the new policy's ratios are computed. Our MoE has 2 layers of 4 experts (top-2), and the rollout
  and train engines run the same Hugging Face model code on CPU (log-prob gap above), so routing changes only
  through the 4 weight updates within a step, never between engines: the "routes kept" column measures that
  change, and GRPO + R2 pins it. Train-inference routing gaps (the rollout engine's own routes, replayed as r3)
  do not arise here; vLLM's CPU build cannot return its routes (docs/engines.md).
- **Short responses.** {length:.0f} tokens per response on average: GSPO's length normalisation, and the paper's
  argument that GRPO's per-token importance weights accumulate noise over long responses, barely apply.
- **Clip ranges made for a 30B model.** The paper's 3e-4 / 4e-4 range was set for a large model at a small lr;
  here one optimizer step moves many sequence ratios past it (see the sequence ratios above), so GSPO's
  updates in minibatches 2-4 of a step use only the sequences that stayed inside the range.
- **Few steps and seeds.** Tens of steps and a handful of seeds, with 128 samples per step: a per-step reward
  has a standard error of about 0.04, and differences smaller than the seed spread are not findings.
"""


FIGURE_NOTE = (
    "Figures: one panel per model; line = mean over seeds, band = ± sd (on log axes its lower edge is cut at a "
    "tenth of the mean, and a step where no seed clipped anything is a gap); the last figure shows every seed's "
    "reward."
)
FILES_NOTE = f"""\
- `{RAW_DIR}/<model>-<algo>-seed<k>.jsonl`: each run's metrics.jsonl, unmodified (every key is described in
  docs/metrics-and-checkpoints.md).
- `{MANIFEST}`: settings, machine, wall times.
- `*.png`: the figures above.
"""


def render_report(manifest: dict, results: dict, summary: dict, models: list[str]) -> str:
    w = window(manifest["settings"]["steps"])
    lines = [
        "# GSPO vs GRPO at tiny scale: the paper's qualitative claims on a laptop-sized MoE",
        "",
        "Generated by `benchmarks/reproduce_paper.py`; do not edit by hand. Regenerate everything (training, then "
        "figures and this file) with `.venv/bin/python benchmarks/reproduce_paper.py --out docs/results`, or only "
        "the figures and this file from the stored raw metrics with `... --out docs/results --replot`.",
        "",
        "## Setup",
        "",
        *_setup_lines(manifest, w),
        "",
        "## Results",
        "",
        render_table(summary, models, w),
        "",
        "| claim (paper) | " + " | ".join(models) + " |",
        "|---|" + "---|" * len(models),
    ]
    claims = ("GSPO clips far more tokens (GSPO / GRPO)", "GSPO learns faster", "GRPO unstable, GSPO not")
    cells = {m: verdicts(summary, m) for m in models}
    lines += [f"| {c} | " + " | ".join(cells[m][i] for m in models) + " |" for i, c in enumerate(claims)]
    lines += ["", FIGURE_NOTE, ""]
    lines += [f"![{key}]({name})" for name, _, key, _ in FIGURES] + [f"![reward/mean, every seed]({SEEDS_FIGURE})"]
    lines += ["", "## What we observed", "", "Every number below is computed from `raw/` by the script.", ""]
    for model in models:
        lines += [f"- {observe_clipping(summary, model)}", f"- {observe_learning(summary, model)}"]
        lines += [f"- {observe_stability(summary, results, model)}"]
    for extra in (observe_moe_vs_dense(summary), observe_replay(summary, results)):
        lines += [f"- {extra}"] if extra else []
    lines += [f"- {observe_scale(summary, manifest['settings']['lr'])}", ""]
    lines += ["## Where the tiny scale cannot reproduce the paper", "", scale_notes(summary)]
    lines += ["## Files", "", FILES_NOTE]
    return "\n".join(lines)


def write_report(out: Path, manifest: dict, results: dict) -> list[Path]:
    models = [m for m in MODELS if any((m, a) in results for a in ALGOS)]
    missing = [f"{m}/{a}" for m in models for a in algos_of(m) if (m, a) not in results]
    if missing:
        raise UserError(f"{out / MANIFEST} has no runs for {', '.join(missing)}; rerun the benchmark for them")
    summary = summarize(results, window(manifest["settings"]["steps"]))
    written = plot_all(out, results, models)
    (out / REPORT).write_text(render_report(manifest, results, summary, models))
    return [*written, out / REPORT]


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        if not args.replot:
            train_all(args)
        manifest, results = load_results(args.out)
        for path in write_report(args.out, manifest, results):
            print(f"wrote {path}")
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
