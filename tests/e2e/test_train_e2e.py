"""End to end on CPU, through the CLI and Ray, the way a user runs it.

- GSPO improves the reward on the synthetic arithmetic task within a short, seeded run.
- 6 steps straight == 3 steps, kill -9, resume for 3: identical metrics (the rollout-gap diagnostic bounded,
  see GAP_PREFIX) and bitwise-identical final weights.
- The run directory holds what the docs promise: metrics.jsonl, TensorBoard events, checkpoints, an HF export
  that AutoModelForCausalLM loads, and `gspo-ascend plot` turns it into PNGs.
- Greedy validation accuracy on the held-out problems rises, and `gspo-ascend eval` on the export reproduces the
  run's last validation metrics and responses.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO

pytestmark = pytest.mark.slow

TIMING_PREFIXES = ("time/", "perf/", "sync/time_s")


# One torch thread per actor in every run through train_cmd (a test's own override comes later and wins). The default
# (the node's CPUs / the run's actors: 2 for a one-actor run here; tests/unit/test_placement.py holds it) spins a
# second OpenMP thread against the other pytest worker's process on CI's 2 cores: a 4-step tiny run took 26-28 s
# beside a one-core busy loop with 2 threads, 24-25 s with 1, and the loop beside it ran 10-13% faster (2026-12-03).
# It also makes a one-actor run and a two-pool run (one thread per actor) compare bitwise on any CPU (issue #40).
ONE_THREAD = "trainer.cpu_threads=1"


def train_cmd(out: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "gspo_ascend.cli", "train", f"trainer.output_dir={out}", ONE_THREAD, *overrides]


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


# |log pi_rollout - log pi_recompute| is a diagnostic, not part of the trajectory (old_logprobs=recompute). One CI
# run on the shared 2-core host saw the hf engine's step-1 rollout log-probs differ between two fresh processes
# by ~1e-5 (gap max 5.9e-5 vs 2.9e-6) with identical tokens, rewards, losses and clip fractions; 10 local
# reruns, idle and under load, were bitwise equal. The cause is not understood, so the test says exactly that:
# the trajectory is compared bitwise, the gap is bounded.
GAP_PREFIX = "rollout/logprob_gap_"


def trajectory(rows: list[dict]) -> list[dict]:
    """Every metric but wall times and the gap diagnostic."""
    return [{k: v for k, v in r.items() if not k.startswith((*TIMING_PREFIXES, GAP_PREFIX))} for r in rows]


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted((out / "hf").glob("*.safetensors")):
        tensors |= load_file(str(f))
    return tensors


def test_gspo_improves_reward_and_writes_a_complete_run(tmp_path):
    out = tmp_path / "run"
    steps = 24
    proc = subprocess.run(
        train_cmd(out, f"trainer.total_steps={steps}", "trainer.save_freq=0", "actor.lr=2e-4"),
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = read_metrics(out)
    assert [r["step"] for r in lines] == list(range(0, steps + 1))  # step 0: validation before training
    rows = lines[1:]
    rewards = [r["reward/mean"] for r in rows]
    first, last = sum(rewards[:6]) / 6, sum(rewards[-6:]) / 6
    assert last > first + 0.1, rewards  # measured: ~0.33 -> ~0.55 at this seed
    assert all(0 <= r["actor/clipfrac_seq"] <= 1 for r in rows)
    assert rows[0]["sync/bytes"] > 1e6  # the whole 427k-param fp32 model crossed over each step
    assert f"step {steps}/{steps} reward=" in proc.stdout  # the progress line (plain when not a TTY)
    # the closing summary: where the outputs are and how to look at them
    run_dir = out.resolve()
    assert f"  last checkpoint  {run_dir}/checkpoints/step_{steps:08d}\n" in proc.stdout
    assert f"  HF export        {run_dir}/hf\n" in proc.stdout
    assert (
        f"  gspo-ascend plot {run_dir}   #" in proc.stdout
        and f"tensorboard --logdir {run_dir}/tensorboard" in proc.stdout
    )

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "hf")
    assert sum(p.numel() for p in model.parameters()) > 100_000
    assert list((out / "tensorboard").rglob("events.out.tfevents.*"))
    assert (out / "checkpoints" / f"step_{steps:08d}" / "COMPLETE").exists()

    plot = subprocess.run(
        [sys.executable, "-m", "gspo_ascend.cli", "plot", str(out)], capture_output=True, text=True, cwd=REPO
    )
    assert plot.returncode == 0, plot.stderr
    assert (out / "plots" / "reward.png").stat().st_size > 1000
    assert (out / "plots" / "validation.png").stat().st_size > 1000
    check_validation(out, lines, proc.stdout, tmp_path)


ACC = "val/all/mean@1"  # configs/tiny_gspo.yaml: greedy, one response per held-out problem


def eval_export(run_dir: Path, data: Path, output: Path) -> subprocess.CompletedProcess:
    """`gspo-ascend eval` of a run's HF export with the run's own config.json, as the run's summary prints it."""
    return subprocess.run(
        [sys.executable, "-m", "gspo_ascend.cli", "eval", "--model", str(run_dir / "hf"), "--data", str(data)]
        + ["--config", str(run_dir / "config.json"), "--output", str(output)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )


def check_validation(out: Path, lines: list[dict], stdout: str, tmp_path: Path) -> None:
    """The default run validates greedy accuracy on the 39 held-out problems at steps 0, 5, 10, ... and the last;
    it rises; `gspo-ascend eval` on the run's export reproduces the last validation, response for response."""
    from gspo_ascend.metrics import format_figure
    from gspo_ascend.runtime import embedded_data_dir

    val = {r["step"]: r for r in lines if ACC in r}
    steps = max(val)
    assert sorted(val) == sorted({0, steps} | set(range(0, steps + 1, 5)))
    assert all(v["val/all/prompts"] == 39 for v in val.values())
    first, last = val[0][ACC], val[steps][ACC]
    assert last >= first + 0.2, {s: v[ACC] for s, v in val.items()}  # measured at this seed: 0.31 -> 0.67
    last_line = next(line for line in stdout.splitlines() if line.startswith(f"step {steps}/{steps} "))
    assert last_line.endswith(f" val={format_figure(last)}")  # the console shows the last validation accuracy
    # the responses of the first validation.log_prompts (16) prompts, readable
    answers = [json.loads(x) for x in (out / "validation" / f"step_{steps:08d}.jsonl").read_text().splitlines()]
    assert len(answers) == 16 and {"prompt", "response", "answer", "ground_truth", "reward"} <= set(answers[0])
    assert sum(a["acc"] for a in answers) == sum(a["answer"] == a["ground_truth"] for a in answers)

    # eval on the export: same prompts, same seed (from config.json), in this process instead of a Ray worker
    evaluated = tmp_path / "eval"
    proc = eval_export(out, embedded_data_dir() / "test.parquet", evaluated)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((evaluated / "eval.json").read_text())
    assert report["metrics"] == {k: v for k, v in val[steps].items() if k.startswith("val/")}
    generated = [json.loads(x) for x in (evaluated / "generations.jsonl").read_text().splitlines()]
    assert [g["response"] for g in generated[:16]] == [a["response"] for a in answers]
    assert "| data source |" in proc.stdout and "eval: 1/1 batches, 39/39 prompts" in proc.stderr


def wait_for(path: Path, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while not path.exists():
        assert proc.poll() is None, "the run ended before the checkpoint appeared"
        assert time.time() < deadline, f"{path} did not appear within {timeout_s}s"
        time.sleep(0.05)


def test_kill_9_and_resume_equals_an_uninterrupted_run(tmp_path):
    common = ("trainer.total_steps=6", "trainer.save_freq=3", "data.train_batch_size=8", "rollout.n=4")
    straight = tmp_path / "straight"
    subprocess.run(train_cmd(straight, *common), check=True, cwd=REPO, timeout=600, capture_output=True)

    resumed = tmp_path / "resumed"
    proc = subprocess.Popen(
        train_cmd(resumed, *common), cwd=REPO, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        wait_for(resumed / "checkpoints" / "step_00000003" / "COMPLETE", proc, timeout_s=400)
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and everything it started, mid-step 4
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert len(read_metrics(resumed)) < 7  # it really died before the end (steps 0..6 when complete)
    again = subprocess.run(train_cmd(resumed, *common), capture_output=True, text=True, cwd=REPO, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stdout

    ours, theirs = read_metrics(resumed), read_metrics(straight)
    assert trajectory(ours) == trajectory(theirs)
    # the validation schedule survived the kill: step 0 from the first process, 5 and the last from the second
    assert [r["step"] for r in ours if "val/all/mean@1" in r] == [0, 5, 6]
    for row in ours[1:] + theirs[1:]:  # the diagnostic only: see GAP_PREFIX
        assert row["rollout/logprob_gap_max"] < 1e-4, row
    a, b = final_weights(straight), final_weights(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_two_emulated_npus_with_engine_log_probs(tmp_path):
    """Two Ray workers on the NPU shim's emulated "NPU" resource (placement, rendezvous, DP sharding, the
    "hccl" collective as gloo) with algorithm.old_logprobs=engine (no recompute pass)."""
    out = tmp_path / "npu2"
    proc = subprocess.run(
        train_cmd(
            out,
            "trainer.device=npu",
            "trainer.devices_per_node=2",
            "trainer.total_steps=2",
            "algorithm.old_logprobs=engine",
            "data.train_batch_size=8",
            "rollout.n=4",
        ),
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
        env={**os.environ, "GSPO_DEVICE_SHIM": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the fsdp and hf engines ran on torch_npu's fused ops (the shim's), summary printed once by rank 0
    assert (proc.stdout + proc.stderr).count("NPU patches for qwen3") == 1, proc.stdout[-3000:]
    lines = read_metrics(out)
    assert [r["step"] for r in lines] == [0, 1, 2]  # the default config validates before training and at the end
    assert lines[0]["val/all/prompts"] == 39 and "val/all/mean@1" in lines[2]  # chunks spread over 2 workers
    rows = lines[1:]
    assert all("time/old_log_prob_s" in r and r["time/old_log_prob_s"] < 0.01 for r in rows)  # no recompute
    assert "rollout/logprob_gap_mean" not in rows[0]
    assert all(0 <= r["actor/clipfrac_seq"] <= 1 and r["sync/bytes"] > 1e6 for r in rows)


def test_megatron_and_vllm_train_save_and_resume(tmp_path):
    """The production pair, actor.engine=megatron (megatron-core over gloo through the shim, mbridge) with
    rollout.engine=vllm (vLLM's CPU build), inside the Ray worker: steps run, rewards are logged, a checkpoint is
    written, and a second invocation with more steps resumes from it with the vLLM weights re-synced."""
    out = tmp_path / "megatron-vllm"
    common = (
        "actor.engine=megatron",
        "rollout.engine=vllm",
        "data.train_batch_size=8",
        "rollout.n=4",
        "trainer.save_freq=2",
    )
    first = subprocess.run(train_cmd(out, *common, "trainer.total_steps=2"), capture_output=True, text=True, cwd=REPO)
    assert first.returncode == 0, first.stderr[-3000:]
    second = subprocess.run(train_cmd(out, *common, "trainer.total_steps=3"), capture_output=True, text=True, cwd=REPO)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout and "step_00000002" in second.stdout
    lines = read_metrics(out)
    assert [r["step"] for r in lines] == [0, 1, 2, 3]
    # validated (greedy, vLLM) before training, at the first invocation's last step and at the resumed one's
    assert [r["step"] for r in lines if "val/all/mean@1" in r] == [0, 2, 3]
    rows = lines[1:]
    assert all(0 <= r["reward/mean"] <= 1 and r["sync/bytes"] > 1e6 for r in rows)
    # vLLM runs in the worker's process at TP 1 on the host build: the weights reach it as tensors, no bytes through
    # host memory (in vLLM's own engine-core process every byte went as safetensors: host_bytes == bytes)
    assert all(r["sync/host_bytes"] == 0 for r in rows)
    # vLLM's log-probs of its own samples against the Megatron engine's recompute: fp32 CPU, same weights
    assert all(r["rollout/logprob_gap_max"] < 1e-3 for r in rows)


def test_vllm_rollout_tensor_parallel_2_inside_the_training_world(tmp_path):
    """rollout.tensor_parallel_size=2 on 2 workers: vLLM's external launcher makes the two training ranks one
    rollout TP group (the layout the cluster configs use: TP 4 for Qwen3-30B, TP 2 for Qwen2.5-3B)."""
    out = tmp_path / "tp2"
    overrides = ("rollout.engine=vllm", "rollout.tensor_parallel_size=2", "trainer.devices_per_node=2")
    small = ("trainer.total_steps=2", "data.train_batch_size=8", "rollout.n=4")
    proc = subprocess.run(train_cmd(out, *overrides, *small), capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = read_metrics(out)
    assert [r["step"] for r in lines] == [0, 1, 2]  # step 0: validation, both ranks of the TP group in lockstep
    rows = lines[1:]
    assert all(r["rollout/logprob_gap_max"] < 1e-3 and r["sync/bytes"] > 1e6 for r in rows)
