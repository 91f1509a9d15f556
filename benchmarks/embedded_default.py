"""The embedded CPU default (`gspo-ascend train`, configs/tiny_gspo.yaml) over three seeds, as is and with partial
rollout or dynamic sampling: what its held-out greedy accuracy does, and what each option saves or costs.

    .venv/bin/python benchmarks/embedded_default.py                # 5 variants x 3 seeds, 40-90 s a run (quiet 2 cores)
    .venv/bin/python benchmarks/embedded_default.py --report-only  # the report again from the raw files

Every run is the README's command with ``trainer.seed=K`` (the prompt order and every sampling seed) and the
variant's keys; nothing else changes, so every variant trains on the same samples per step (16 prompts x 8). The
default runs its 60 steps; the options run 30 and are compared with the default's first 30 (equal trained
samples). Variants:

    default   the embedded default as shipped
    dynamic   dynamic_sampling.enabled=true: zero-variance groups dropped and replaced (docs/partial-rollout.md)
    partial   partial_rollout.round_tokens=16 (half of data.max_response_length), 2 rounds, one batch of extra
              groups, pi_old recomputed with the behaviour correction (decoupled)
    partial-engine  the same rounds, pi_old = the rollout engine's log-probs (mixed versions, no correction)
    engine    synchronous, pi_old = the rollout engine's log-probs: partial-engine without the rounds, which
              separates what mixed versions cost from what the engine's log-probs cost

Output: ``docs/results/raw/embedded-<variant>-seed<K>.jsonl`` (each run's metrics.jsonl, unmodified) and
``docs/results/embedded-default.md`` (computed from them). A run whose raw file already holds its last step is
not run again, so an interrupted study resumes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# variant -> (its keys, steps): the default runs as shipped (60 steps); the options are compared with it at equal
# trained samples over the first 30 steps (16 x 8 samples a step on every variant), which halves the study's time
VARIANTS = {
    "default": ([], 60),
    "partial": (["partial_rollout.round_tokens=16"], 30),
    "dynamic": (["dynamic_sampling.enabled=true"], 30),
    "partial-engine": (["partial_rollout.round_tokens=16", "algorithm.old_logprobs=engine"], 30),
    "engine": (["algorithm.old_logprobs=engine"], 30),
}
REPORT = REPO / "docs" / "results" / "embedded-default.md"
RAW = REPO / "docs" / "results" / "raw"


def raw_file(variant: str, seed: int) -> Path:
    return RAW / f"embedded-{variant}-seed{seed}.jsonl"


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def run(variant: str, seed: int, work: Path) -> float:
    """One training run through the CLI; its metrics.jsonl copied to the raw file. Returns wall seconds."""
    out = work / f"{variant}-{seed}"
    cmd = [sys.executable, "-m", "gspo_ascend.cli", "train", f"trainer.output_dir={out}", f"trainer.seed={seed}"]
    keys, steps = VARIANTS[variant]
    cmd += ["trainer.loggers=[jsonl]", "trainer.save_freq=0", "trainer.resume=never", *keys]
    cmd += [f"trainer.total_steps={steps}"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"{variant} seed {seed} failed:\n{proc.stderr[-2000:]}")
    RAW.mkdir(parents=True, exist_ok=True)
    raw_file(variant, seed).write_text((out / "metrics.jsonl").read_text())
    return seconds


def _stat(values: list[float]) -> str:
    if not values:
        return "-"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    digits = 3 if max(abs(v) for v in values) < 10 else 0  # accuracies and rewards; counts and seconds whole
    return f"{statistics.mean(values):.{digits}f} ± {sd:.{digits}f}"


def done(variant: str, seed: int) -> list[dict]:
    """The run's metrics when it ran to its last step, else []."""
    rows = read(raw_file(variant, seed))
    return rows if rows and rows[-1]["step"] == VARIANTS[variant][1] else []


def summary(rows: list[dict]) -> dict[str, float]:
    """One run's figures over its first 30 steps (all variants) and to its end: validation accuracy, reward,
    zero-variance share, what generation cost."""
    val = {r["step"]: r["val/all/mean@1"] for r in rows if "val/all/mean@1" in r}
    steps = [r for r in rows if 0 < r["step"] <= 30]
    last = max(val)
    late = [val[s] for s in sorted(val)[-3:]]
    admitted = [r.get("partial/admitted_groups", 16.0) for r in steps]  # groups generated (the default: 16)
    return {
        "val0": val[0],
        "val30": val.get(30, float("nan")),
        "val_20_30": statistics.mean(val[s] for s in (20, 25, 30)),
        "val_last": val[last],
        "val_late3": statistics.mean(late),
        "val_peak": max(val.values()),
        "reward_21_30": statistics.mean(r["reward/mean"] for r in steps[-10:]),
        "zero_var": statistics.mean(r["reward/zero_var_group_frac"] for r in steps),
        "clipfrac_seq": statistics.mean(r["actor/clipfrac_seq"] for r in steps),
        "groups_generated": sum(admitted),
        "rollout_s": sum(r["time/rollout_s"] for r in steps),
    }


COLUMNS = (  # the first eight over steps 1-30 (every variant), the last three to the run's end
    ("val0", "val. acc. step 0"),
    ("val30", "step 30"),
    ("val_20_30", "mean of steps 20-30"),
    ("reward_21_30", "reward, steps 21-30"),
    ("zero_var", "zero-variance groups, steps 1-30"),
    ("clipfrac_seq", "sequences clipped, steps 1-30"),
    ("groups_generated", "groups generated, steps 1-30"),
    ("rollout_s", "rollout s, steps 1-30"),
    ("val_last", "val. acc. at the last step"),
    ("val_late3", "mean of the last 3 validations"),
    ("val_peak", "peak"),
)


def report(seeds: int) -> str:
    lines = [
        "# The embedded default over three seeds (`benchmarks/embedded_default.py`)",
        "",
        f"Each cell: mean ± sd over seeds 0..{seeds - 1} of `gspo-ascend train trainer.seed=K` "
        "(configs/tiny_gspo.yaml), greedy accuracy on the 39 held-out problems (one problem = 0.026). Raw metrics: "
        "`docs/results/raw/embedded-<variant>-seed<K>.jsonl`. Times are from a shared 2-core box.",
        "",
        "| variant | " + " | ".join(label for _, label in COLUMNS) + " |",
        "|---|" + "---|" * len(COLUMNS),
    ]
    per_variant = {}
    for variant in VARIANTS:
        runs = [summary(rows) for s in range(seeds) if (rows := done(variant, s))]
        per_variant[variant] = runs
        if runs:
            cells = [_stat([r[k] for r in runs]) for k, _ in COLUMNS]
            seeds_run = f"{len(runs)} seed{'s' if len(runs) > 1 else ''}"
            lines.append(f"| {variant} ({seeds_run}) | " + " | ".join(cells) + " |")
    lines += ["", "Validation accuracy by step (mean over seeds):", ""]
    for variant, runs in per_variant.items():
        if not runs:
            continue
        curves = [
            {r["step"]: r["val/all/mean@1"] for r in read(raw_file(variant, s)) if "val/all/mean@1" in r}
            for s in range(seeds)
        ]
        steps = sorted(curves[0])
        points = ", ".join(f"{s}: {statistics.mean(c[s] for c in curves if s in c):.2f}" for s in steps)
        lines.append(f"- {variant} ({VARIANTS[variant][1]} steps): {points}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--report-only", action="store_true")
    args = p.parse_args(argv)
    if not args.report_only:
        with tempfile.TemporaryDirectory(prefix="embedded-default-") as work:
            for seed in range(args.seeds):  # seed-major: load from other jobs hits every variant alike
                for variant in args.variants.split(","):
                    if done(variant, seed):
                        continue
                    seconds = run(variant, seed, Path(work))
                    print(f"{variant} seed {seed}: {seconds:.0f} s", flush=True)
    REPORT.write_text(report(args.seeds))
    print(REPORT.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
