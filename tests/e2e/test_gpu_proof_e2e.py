"""The GPU proof (scripts/device/gpu_proof.sh, issue #29) on the CPU at tiny sizes, as CI runs it: every step runs
through the same commands a GPU run takes and passes, the tiny size skips only the small-model build, and the three
outputs a device call brings back are there and agree with each other."""

from __future__ import annotations

import json
import subprocess
import tarfile

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow

STEPS = [
    "attention",
    "selftest",
    "small_model",
    "train",
    "throughput_fsdp",
    "throughput_megatron",
    "trl",
    "throughput_fsdp_compiled",
]


def test_the_proof_runs_every_step_on_the_cpu(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(
        ["bash", "scripts/device/gpu_proof.sh", str(out), "--device", "cpu", "--budget-s", "900"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["proof-logs.tar.gz", "proof.json", "proof.md"]
    result = json.loads((out / "proof.json").read_text())
    status = {s["name"]: s["status"] for s in result["steps"]}
    assert list(status) == STEPS
    assert status == {**dict.fromkeys(STEPS, "pass"), "small_model": "skip"}, status
    steps = {s["name"]: s for s in result["steps"]}
    train = steps["train"]["figures"]
    assert len(train["reward_mean"]) == 3  # trainer.total_steps=3 at the tiny size
    assert [s for s, _ in train["validation"]] == [0, 3]  # val_before_train, then the last step
    assert {"rollout", "update", "step"} <= set(train["stage_median_s"])
    for engine in ("fsdp", "megatron"):
        figures = steps[f"throughput_{engine}"]["figures"]
        assert figures["engine"] == engine and figures["tokens_per_second"] > 0
    assert steps["trl"]["figures"]["step_time_ratio"] > 0
    compiled = steps["throughput_fsdp_compiled"]["figures"]
    assert compiled["compiled_layers"] > 0 and compiled["tokens_per_second_vs_plain"] > 0
    attention = steps["attention"]["figures"]
    assert attention["runs"]["per_sequence_cpu"]["available"] and not attention["runs"]["varlen"]["available"]
    assert steps["attention"]["seconds"] < 30  # tiny on the CPU: seconds, first in the budget
    md = (out / "proof.md").read_text()
    for name, record in steps.items():
        assert f"| {name} | {record['status']} |" in md
    with tarfile.open(out / "proof-logs.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"logs/selftest.log", "logs/train.log", "raw/metrics.jsonl", "raw/trl.json", "raw/attention.json"} <= names
