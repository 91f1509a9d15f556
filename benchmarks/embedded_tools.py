"""The embedded tool-use demo (configs/tiny_gspo_tools.yaml, docs/agent.md, issue #45) over three seeds, with the
calculator and without it: the tool-call rate and the held-out greedy accuracy over training.

    .venv/bin/python benchmarks/embedded_tools.py                # 2 arms x 3 seeds, ~1-3 min a run on 2 cores
    .venv/bin/python benchmarks/embedded_tools.py --report-only  # the report again from the raw files

Both arms start from the same model (the ``tools`` preset of make-tiny-model: warm-started with 30% of its examples
calling the calculator) and train on the same prompts (``trainer.seed=K``), 20 steps of 16 prompts x 8:

    tools   the shipped config: ``tools.names=[calculator]``, a call then the answer (``tools.max_turns=2``)
    none    ``tools.names=[]``, the model and data given explicitly: a call the model makes is never answered, so
            the trajectory ends there and scores 0; the model can only learn to answer directly

Output: ``docs/results/raw/tools-<arm>-seed<K>.jsonl`` (each run's metrics.jsonl, unmodified) and
``docs/results/agent-tools.md`` (computed from them). A run whose raw file already holds its last step is not run
again, so an interrupted study resumes.
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
STEPS, SEEDS = 20, (0, 1, 2)
CONFIG = REPO / "configs" / "tiny_gspo_tools.yaml"
REPORT = REPO / "docs" / "results" / "agent-tools.md"
RAW = REPO / "docs" / "results" / "raw"
ACC = "val/all/mean@1"


def raw_file(arm: str, seed: int) -> Path:
    return RAW / f"tools-{arm}-seed{seed}.jsonl"


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def arm_keys(arm: str) -> list[str]:
    if arm == "tools":
        return []
    from gspo_ascend.data.prepare import embedded_data_dir
    from gspo_ascend.tiny import ensure_tiny_model

    data = embedded_data_dir(tools=True)
    return [
        "tools.names=[]",
        "tools.max_turns=4",  # the shipped 2 back to the default: with tools off an inert key is refused
        f"model.path={ensure_tiny_model(size='tools')}",
        f"data.train_files=[{data / 'train.parquet'}]",
        f"data.val_files=[{data / 'test.parquet'}]",
    ]


def run(arm: str, seed: int, work: Path) -> float:
    out = work / f"{arm}-{seed}"
    command = [sys.executable, "-m", "gspo_ascend.cli", "train", "--config", str(CONFIG), *arm_keys(arm)]
    command += [f"trainer.seed={seed}", f"trainer.total_steps={STEPS}", f"trainer.output_dir={out}"]
    start = time.perf_counter()
    subprocess.run(command, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    RAW.mkdir(parents=True, exist_ok=True)
    raw_file(arm, seed).write_text((out / "metrics.jsonl").read_text())
    return time.perf_counter() - start


def summary(rows: list[dict]) -> dict:
    steps = [r for r in rows if r["step"] > 0]
    rate = [r["agent/tool_call_rate"] for r in steps if "agent/tool_call_rate" in r]  # none: tools off, not counted
    return {
        "val": {r["step"]: r[ACC] for r in rows if ACC in r},
        "calls": f"{statistics.mean(rate[:3]):.2f} -> {statistics.mean(rate[-3:]):.2f}" if rate else "n/a (tools off)",
        "reward_first": statistics.mean(r["reward/mean"] for r in steps[:3]),
        "reward_last": statistics.mean(r["reward/mean"] for r in steps[-3:]),
    }


def curves() -> list[str]:
    """Per step, the mean over seeds: the tools arm's call rate and reward, the none arm's reward."""
    runs = {arm: [read(raw_file(arm, seed)) for seed in SEEDS] for arm in ("tools", "none")}
    if any(not rows or rows[-1]["step"] < STEPS for arm in runs.values() for rows in arm):
        return []
    lines = ["", "Per step, mean of the 3 seeds:", "", "| step | tools: call rate | tools: reward | none: reward |"]
    lines.append("|---|---|---|---|")
    for step in range(1, STEPS + 1):
        at = {arm: [next(r for r in rows if r["step"] == step) for rows in runs[arm]] for arm in runs}
        rate = statistics.mean(r["agent/tool_call_rate"] for r in at["tools"])
        reward = {arm: statistics.mean(r["reward/mean"] for r in at[arm]) for arm in at}
        lines.append(f"| {step} | {rate:.2f} | {reward['tools']:.2f} | {reward['none']:.2f} |")
    return lines


def report() -> str:
    lines = [
        "# The embedded tool-use demo: GSPO with and without the calculator",
        "",
        "`.venv/bin/python benchmarks/embedded_tools.py` (its docstring says what each arm is). The tiny model is",
        "warm-started with 30% of its examples calling the calculator on two-digit products (`make-tiny-model",
        "--size tools`); held-out accuracy is greedy, one answer per problem, on the 64 held-out problems.",
        "Tool-call rate and reward: the mean of the first three and of the last three steps. 3 seeds each.",
        "",
        "| arm | seed | held-out accuracy by step | tool-call rate first -> last | reward first -> last |",
        "|---|---|---|---|---|",
    ]
    finals = {}
    for arm in ("tools", "none"):
        for seed in SEEDS:
            rows = read(raw_file(arm, seed))
            if not rows or rows[-1]["step"] < STEPS:
                lines.append(f"| {arm} | {seed} | (not run) | | |")
                continue
            s = summary(rows)
            finals.setdefault(arm, []).append(s["val"][STEPS])
            curve = ", ".join(f"{k}: {v:.2f}" for k, v in sorted(s["val"].items()))
            lines.append(
                f"| {arm} | {seed} | {curve} | {s['calls']} | {s['reward_first']:.2f} -> {s['reward_last']:.2f} |"
            )
    lines += curves()
    lines += ["", "Final held-out accuracy (step 20), mean over seeds:"]
    for arm, values in finals.items():
        lines.append(f"- {arm}: {statistics.mean(values):.3f} ({', '.join(f'{v:.3f}' for v in values)})")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--report-only", action="store_true")
    args = p.parse_args()
    if not args.report_only:
        with tempfile.TemporaryDirectory(prefix="gspo-tools-") as work:
            for seed in SEEDS:
                for arm in ("tools", "none"):
                    done = read(raw_file(arm, seed))
                    if done and done[-1]["step"] >= STEPS:
                        continue
                    seconds = run(arm, seed, Path(work))
                    print(f"{arm} seed {seed}: {seconds:.0f} s", flush=True)
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    REPORT.write_text(report())
    print(REPORT.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
