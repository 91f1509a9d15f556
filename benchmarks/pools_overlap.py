"""Colocated vs one-step-off on two pools, with simulated-latency engines (issue #28 item 4a), against the step-time
model (benchmarks/step_model.py, item 4b).

    PYTHONPATH=. .venv/bin/python benchmarks/pools_overlap.py                 # ~4 min on 2 cores
    PYTHONPATH=. .venv/bin/python benchmarks/pools_overlap.py --steps 12 --json out.json

Two CPU pools on two shared cores cannot show overlap, so the engines' *time* is simulated
(gspo_ascend/simulated.py: TEST AND BENCHMARK ONLY): generation and training sleep for what a decode-step model and
a training rate say, while the pipeline, Ray placement, the gloo weight sync of the tiny model's real weights and
the driver's scoring are real. Each side is `gspo-ascend train` on two devices (two CPU "devices"): colocated (both
generate, then both train) and one-step-off (1 rollout + 1 trainer, ``rollout_pool.max_staleness=1``). Reported per
side: the steady-state step (mean of the steps after the first two, the last left out: it starts no batch), the
trainer's idle share (``time/wait_rollout_s``), and the model's prediction from the same inputs (decode step, rates,
the sync's measured seconds, the same length distribution). Checked: one-step-off step <= 1.1 x max(generation,
training + sync); trainer idle < 20% at this (the only) split; the model within 10% of each side.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from gspo_ascend.simulated import ENV, SimSpec, env_value

sys.path.insert(0, str(Path(__file__).parent))
import step_model  # noqa: E402

SPEC = SimSpec(decode_base_s=0.02, decode_per_seq_s=0.0005, length_median=48, length_sigma=0.8,
               train_tokens_per_s=700, logprob_tokens_per_s=20000)  # fmt: skip
B, N, R = 8, 4, 128  # prompts per step, samples per prompt, max response tokens
SIDES = {
    "colocated": ["trainer.devices_per_node=2"],
    "one-step-off": ["trainer.devices_per_node=1", "rollout_pool.devices_per_node=1", "rollout_pool.max_staleness=1"],
}


def run_side(side: str, steps: int, work: Path) -> list[dict]:
    out = work / side
    cmd = [sys.executable, "-m", "gspo_ascend.cli", "train", f"trainer.output_dir={out}", "trainer.resume=never",
           f"trainer.total_steps={steps}", f"data.train_batch_size={B}", f"rollout.n={N}",
           f"data.max_response_length={R}", "trainer.test_freq=0", "trainer.val_before_train=false",
           "trainer.loggers=[jsonl]", "trainer.save_freq=0", *SIDES[side]]  # fmt: skip
    env = {**os.environ, ENV: env_value(SPEC)}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise SystemExit(f"{side}: exit {done.returncode}\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("step", 0) >= 1]


def generation_s(step: int, ranks: int) -> float:
    """The rollout pool's sleep for batch ``step`` (simulated.py draws it from the step's seed): the slowest rank."""
    seed = 0 * 1_000_003 + step  # trainer.seed 0: schedules.base.rollout_params
    per_rank = B // ranks
    seeds = [seed + 7919 * g for g in range(ranks)]  # split_rollout_prompts: rank g's seed
    return max(SPEC.generation_s(SPEC.lengths(per_rank * N, R, s * 7919 + per_rank)) for s in seeds)


def steady(rows: list[dict]) -> list[dict]:
    return rows[2:-1] if len(rows) > 4 else rows[1:]


def model(rows: list[dict], side: str) -> step_model.Summary:
    sync = statistics.median(r.get("sync/time_s", 0.0) for r in rows if "sync/time_s" in r) or 1e-3
    prompt = statistics.fmean(r["prompt/length_mean"] for r in rows)
    lengths = [SPEC.lengths(B * N, R, (0 * 1_000_003 + s) * 7919 + B) for s in range(1, 200)]
    inp = step_model.inputs_from_measurements(
        name="simulated", prompts_per_step=B, group_size=N, prompt_tokens=prompt, max_response=R,
        decode_fixed_s=SPEC.decode_base_s, decode_per_seq_s=SPEC.decode_per_seq_s, prefill_tps=float("inf"),
        update_s=1.0, update_tokens=SPEC.train_tokens_per_s, old_logprob_s=1.0 / SPEC.logprob_tokens_per_s,
        sync_s=sync, weight_bytes=float(rows[-2].get("sync/bytes", 1e6)), total_devices=2, max_concurrency=4096,
        lengths=tuple(n for draw in lengths for n in draw),
    )  # fmt: skip
    inp = step_model.dataclasses.replace(inp, old_logprob_tps=SPEC.logprob_tokens_per_s)
    if side == "colocated":
        return step_model.simulate(inp, "colocated", 2, 2, steps=200)
    return step_model.simulate(inp, "one-step-off", 1, 1, steps=200)


def report(results: dict[str, list[dict]]) -> dict:
    out = {}
    for side, rows in results.items():
        keep = steady(rows)
        step = statistics.fmean(r["time/step_s"] for r in keep)
        idle = statistics.fmean(r.get("time/wait_rollout_s", 0.0) / r["time/step_s"] for r in keep)
        train = statistics.fmean(sum(r.get(f"time/{k}_s", 0.0) for k in ("update", "old_log_prob", "reward", "sync"))
                                 for r in keep)  # fmt: skip
        ranks = 2 if side == "colocated" else 1
        gen = statistics.fmean(generation_s(int(r["step"]) + (side != "colocated"), ranks) for r in keep)
        predicted = model(rows, side)
        out[side] = {"step_s": step, "trainer_idle": idle, "train_plus_sync_s": train, "generation_s": gen,
                     "model_step_s": predicted.step_s, "model_error": predicted.step_s / step - 1,
                     "steps": [r["time/step_s"] for r in rows]}  # fmt: skip
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="gspo-pools-") as work:
        results = {side: run_side(side, args.steps, Path(work)) for side in SIDES}
    figures = report(results)
    print("| side | step (s) | generation (s) | train+sync+reward (s) | trainer idle | model step (s) | model err |")
    print("|---|---|---|---|---|---|---|")
    for side, f in figures.items():
        print(f"| {side} | {f['step_s']:.2f} | {f['generation_s']:.2f} | {f['train_plus_sync_s']:.2f} | "
              f"{f['trainer_idle']:.1%} | {f['model_step_s']:.2f} | {f['model_error']:+.1%} |")  # fmt: skip
    off, colo = figures["one-step-off"], figures["colocated"]
    bound = 1.1 * max(off["generation_s"], off["train_plus_sync_s"])
    print(f"one-step-off / colocated step: {off['step_s'] / colo['step_s']:.3f}x; one-step-off step {off['step_s']:.2f}"
          f" s vs 1.1 x max(gen, train + sync) = {bound:.2f} s")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"spec": SPEC.__dict__, "sides": figures}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
