"""The GPU proof's driver (benchmarks/gpu_proof.py) without running its steps: the judges read hand-made results, a
step past its limit is killed and said so, a spent budget skips, the summary names every step."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_proof  # noqa: E402
import proof_report  # noqa: E402


def _ctx(tmp_path: Path, budget_s: float = 600.0, size: str = "tiny") -> gpu_proof.Ctx:
    return gpu_proof.Ctx("cpu", size, tmp_path, sys.executable, {}, time.monotonic() + budget_s)


def _write_metrics(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_judge_train_reads_reward_validation_and_stage_times(tmp_path):
    rows = [{"step": 0, "val/all/mean@1": 0.25, "time/validation_s": 9.0}]
    rewards = [0.1, 0.2, 0.2, 0.3, 0.4, 0.5, 0.6]
    for step, r in enumerate(rewards, start=1):
        rows.append({"step": step, "reward/mean": r, "time/rollout_s": float(step), "time/step_s": 10.0 * step,
                     "response/length_mean": 20.0})  # fmt: skip
    rows[-1]["val/all/mean@1"] = 0.75
    _write_metrics(tmp_path / "train" / "metrics.jsonl", rows)
    status, detail, figures = gpu_proof.judge_train(_ctx(tmp_path), 0, tmp_path / "train.log")
    assert status == "pass"
    assert figures["reward_mean"] == rewards
    # 7 steps: windows of 3 (never overlapping), not 5
    assert figures["reward_window"] == 3
    assert figures["reward_first5"] == pytest.approx((0.1 + 0.2 + 0.2) / 3)
    assert figures["reward_last5"] == pytest.approx((0.4 + 0.5 + 0.6) / 3)
    assert figures["reward_rising"] and figures["validation_rising"]
    assert figures["validation"] == [(0, 0.25), (7, 0.75)]
    # medians over steps 2..7 (the first step is warm-up): rollout 2..7 -> 4.5, step 20..70 -> 45
    assert figures["stage_median_s"] == {"rollout": 4.5, "step": 45.0}
    assert "0.100 -> 0.600" in detail and "0.250 -> 0.750" in detail


def test_judge_train_fails_on_no_steps_or_nonzero_exit(tmp_path):
    log = tmp_path / "train.log"
    log.write_text("Traceback ...\nRuntimeError: CUDA error: out of memory\n")
    status, detail, _ = gpu_proof.judge_train(_ctx(tmp_path), 1, log)
    assert status == "fail" and "out of memory" in detail


def test_judge_selftest_parses_the_json_after_progress_lines(tmp_path):
    log = tmp_path / "selftest.log"
    records = [{"name": "ops/a", "status": "pass", "seconds": 1.0, "detail": "ok", "fix": ""},
               {"name": "training/x", "status": "fail", "seconds": 2.0, "detail": "off by 1e-1", "fix": "f"},
               {"name": "rollout/vllm", "status": "skip", "seconds": 0.0, "detail": "no vLLM", "fix": ""}]  # fmt: skip
    log.with_suffix(".out").write_text("[not json progress\n" + json.dumps(records) + "\n")
    status, detail, figures = gpu_proof.judge_selftest(_ctx(tmp_path), 1, log)
    assert status == "fail"
    assert (figures["pass"], figures["fail"], figures["skip"]) == (1, 1, 1)
    assert detail == "1 pass, 1 fail, 1 skip; training/x: off by 1e-1"


def test_a_step_past_its_limit_is_killed_and_reported(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    step = gpu_proof.Step("sleeper", {"tiny": 1}, lambda ctx: [sys.executable, "-c", "import time; time.sleep(60)"],
                          lambda ctx, rc, log: ("pass", "", {}))  # fmt: skip
    ctx = _ctx(tmp_path)
    ctx.python = sys.executable
    start = time.monotonic()
    record = gpu_proof.run_step(step, ctx, logs)
    assert record.status == "timeout" and time.monotonic() - start < 30
    assert "limit of 1 s" in record.detail and record.detail.endswith("; ")


def test_a_spent_budget_skips_and_a_failing_judge_is_a_failure(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    ok = [sys.executable, "-c", "print('done')"]
    step = gpu_proof.Step("s", {"tiny": 60}, lambda ctx: ok, lambda ctx, rc, log: ("pass", "", {}))
    assert gpu_proof.run_step(step, _ctx(tmp_path, budget_s=10), logs).status == "skip"

    def broken(ctx, rc, log):
        raise KeyError("reward/mean")

    record = gpu_proof.run_step(gpu_proof.Step("s", {"tiny": 60}, lambda ctx: ok, broken), _ctx(tmp_path), logs)
    assert record.status == "fail" and "could not be read" in record.detail


def test_small_model_is_skipped_at_tiny_size_and_train_then_uses_the_embedded_model(tmp_path):
    with pytest.raises(gpu_proof.Skip):
        gpu_proof.small_model_command(_ctx(tmp_path))
    full = _ctx(tmp_path, size="full")
    with pytest.raises(gpu_proof.Skip, match="small model was not built"):
        gpu_proof.train_command(full)
    full.found["model"] = "/models/small"
    command = gpu_proof.train_command(full)
    assert "model.path=/models/small" in command and "model.dtype=bfloat16" in command


def test_markdown_names_every_step_and_the_figures():
    steps = [
        {"name": "selftest", "status": "pass", "seconds": 3.0, "detail": "1 pass | 0 fail",
         "figures": {"records": [{"name": "ops/a", "status": "pass", "seconds": 1.0, "detail": "ok"}]}},
        {"name": "throughput_fsdp", "status": "pass", "seconds": 9.0, "detail": "x",
         "figures": {"tokens_per_second": 12345.6, "mfu": 0.4123, "peak_memory_bytes": 3 * 2**30}},
        {"name": "trl", "status": "timeout", "seconds": 180.0, "detail": "killed", "figures": {}},
    ]  # fmt: skip
    header = {"device_name": "NVIDIA H100 80GB HBM3", "commit": "abc", "date": "2026-11-26", "python": "3.12.3",
              "versions": {"torch": "2.11.0"}}  # fmt: skip
    text = proof_report.render_markdown({"header": header, "size": "full", "seconds": 192.0, "steps": steps})
    assert text.startswith("# GPU proof: NVIDIA H100 80GB HBM3, commit abc, 2026-11-26")
    assert "| selftest | pass | 3.0 | 1 pass \\| 0 fail |" in text
    assert "| trl | timeout | 180.0 | killed |" in text
    assert "| tokens/s (real tokens) | 12,346 |" in text and "| MFU (bf16 dense peak) | 41.2% |" in text
    assert "| peak device memory (GiB) | 3.00 |" in text
