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


def test_a_selftest_killed_at_its_limit_is_judged_on_the_checks_it_finished(tmp_path):
    """The H100 run of 2026-11-26 killed the selftest at its limit after 24 checks had printed their lines; the
    old judge said only "no JSON records". The lines below are report.render_line's, a fix line included."""
    from gspo_ascend.selftest.report import Result, render_line

    log = tmp_path / "selftest.log"
    done = [
        Result("setup/device", "pass", 0.0, "cuda: NVIDIA H100 80GB HBM3, 1 visible"),
        Result("collectives", "skip", 0.0, "needs at least 2 devices (--devices 1)"),
        Result("training/moe_megatron_tp1", "fail", 22.6, "rank 0 exited with 1: NameError: x", fix="see docs"),
        Result("training/moe_fsdp_vs_megatron", "pass", 0.0, "weights within 5.8e-07"),
    ]
    log.write_text("gspo-ascend selftest (gspo-ascend 0.1.0): cuda\n" + "\n".join(map(render_line, done)) + "\n")
    log.with_suffix(".out").write_text("")
    status, detail, figures = gpu_proof.judge_selftest(_ctx(tmp_path), -9, log)
    assert status == "fail" and figures["partial"]
    assert (figures["pass"], figures["fail"], figures["skip"]) == (2, 1, 1)
    assert [r["name"] for r in figures["records"]] == [r.name for r in done]
    assert figures["records"][2]["seconds"] == 22.6
    assert detail == (
        "before it stopped: 2 pass, 1 fail, 1 skip; last finished training/moe_fsdp_vs_megatron; "
        "training/moe_megatron_tp1: rank 0 exited with 1: NameError: x"
    )


# a step that starts a daemon in a session of its own (as Ray's GCS and raylet are), prints its pid, then hangs
DAEMON_THEN_HANG = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
print(child.pid, flush=True)
time.sleep(120)
"""


def test_a_step_past_its_limit_is_killed_with_what_it_started_and_reported(tmp_path):
    import psutil

    logs = tmp_path / "logs"
    logs.mkdir()
    step = gpu_proof.Step("sleeper", {"tiny": 3}, lambda ctx: [sys.executable, "-c", DAEMON_THEN_HANG],
                          lambda ctx, rc, log: ("fail", f"exit {rc}", {}))  # fmt: skip
    start = time.monotonic()
    record = gpu_proof.run_step(step, _ctx(tmp_path), logs)
    assert record.status == "timeout" and time.monotonic() - start < 30
    assert record.detail == "killed at its limit of 3 s; exit -9"  # the judge still read what the step left
    daemon = int((logs / "sleeper.out").read_text().split()[0])

    def gone() -> bool:
        try:
            return psutil.Process(daemon).status() == psutil.STATUS_ZOMBIE  # killed, not reaped by its new parent
        except psutil.NoSuchProcess:
            return True

    deadline = time.monotonic() + 10  # a SIGKILL is delivered asynchronously
    while not gone() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(), "the step's daemon (its own session) outlived the step"


def test_judges_of_the_model_throughput_and_trl_steps(tmp_path):
    from gspo_ascend.tiny import MANIFEST

    ctx, log = _ctx(tmp_path, size="full"), tmp_path / "x.log"
    log.write_text("ValueError: boom\n")
    model = tmp_path / "small-model"
    ctx.found["model"] = str(model)
    assert gpu_proof.judge_small_model(ctx, 0, log)[0] == "fail" and "model" not in ctx.found  # no manifest
    model.mkdir()
    manifest = {"num_parameters": 1234, "device": "cuda", "build_seconds": 5.0,
                "initial_accuracy": {"sampled_t1": 0.25, "greedy": 0.5, "sampled_length": {"max": 9}}}  # fmt: skip
    (model / MANIFEST).write_text(json.dumps(manifest))
    ctx.found["model"] = str(model)
    status, detail, figures = gpu_proof.judge_small_model(ctx, 0, log)
    assert status == "pass" and figures["device"] == "cuda"
    assert detail.startswith("1,234 parameters built on cuda in 5.0 s; initial accuracy 0.25 sampled, 0.50 greedy")

    judge = gpu_proof.throughput_judge("fsdp")
    assert judge(ctx, 1, log) == ("fail", "exit 1: ValueError: boom", {})
    (tmp_path / "throughput_fsdp.json").write_text(json.dumps({"tokens_per_second": 10.0}))
    assert judge(ctx, 0, log)[0] == "pass" and judge(ctx, 0, log)[2] == {"tokens_per_second": 10.0}

    sides = {"ours-hf": {"median_step_s": None, "tokens_per_s": None, "error": "ValueError: no GPU"},
             "trl-hf": {"median_step_s": 5.4, "tokens_per_s": 3236.0, "error": None}}  # fmt: skip
    (tmp_path / "trl.json").write_text(json.dumps({"step_time_ratio": float("nan"), "sides": sides}))
    status, detail, figures = gpu_proof.judge_trl(ctx, 1, log)
    assert (
        status == "fail"
        and detail == "ours-hf / trl-hf median step time nanx; ours-hf ValueError: no GPU, trl-hf 5.40 s"
    )
    sides["ours-hf"] = {"median_step_s": 2.7, "tokens_per_s": 6000.0, "error": None}
    (tmp_path / "trl.json").write_text(json.dumps({"step_time_ratio": 0.5, "sides": sides}))
    assert gpu_proof.judge_trl(ctx, 0, log)[:2] == (
        "pass",
        "ours-hf / trl-hf median step time 0.500x; ours-hf 2.70 s, trl-hf 5.40 s",
    )


def test_a_reused_work_folder_never_passes_off_old_results(tmp_path):
    ctx = _ctx(tmp_path, size="full")
    ctx.found["model"] = str(tmp_path / "m")
    for name in ("trl.json", "throughput_fsdp.json", "attention.json"):
        (tmp_path / name).write_text("{}")
    _write_metrics(tmp_path / "train" / "metrics.jsonl", [{"step": 1, "reward/mean": 0.5}])
    gpu_proof.trl_command(ctx)
    gpu_proof.throughput_command("fsdp")(ctx)
    gpu_proof.train_command(ctx)
    gpu_proof.attention_command(ctx)
    assert not any((tmp_path / n).exists() for n in ("trl.json", "throughput_fsdp.json", "train", "attention.json"))


def test_the_attention_check_runs_first_tiny_on_a_cpu_and_is_judged_on_its_json(tmp_path):
    assert gpu_proof.STEPS[0].name == "attention"  # the cheapest step and the one that explains the others
    tiny = gpu_proof.attention_command(_ctx(tmp_path))
    assert tiny[1].endswith("benchmarks/attention_check.py") and tiny[tiny.index("--device") + 1] == "cpu"
    assert tiny[tiny.index("--layers") + 1] == "2" and tiny[-2:] == ["--json", str(tmp_path / "attention.json")]
    full = _ctx(tmp_path, size="full")
    full.device = "cuda"
    assert gpu_proof.attention_command(full)[2:] == ["--device", "cuda", "--json", str(tmp_path / "attention.json")]
    full.device = "npu"
    with pytest.raises(gpu_proof.Skip, match="CUDA's"):
        gpu_proof.attention_command(full)

    log = tmp_path / "attention.log"
    log.write_text("RuntimeError: CUDA error: out of memory\n")
    assert gpu_proof.judge_attention(_ctx(tmp_path), 1, log) == (
        "fail",
        "exit 1: RuntimeError: CUDA error: out of memory",
        {},
    )
    # killed after the cheap runs: the JSON it rewrote after each is what it found
    runs = {
        "per_sequence_cudnn_off": {"available": True, "median_s": 0.05},
        "varlen": {"available": False, "reason": "r"},
    }
    (tmp_path / "attention.json").write_text(json.dumps({"runs": runs}))
    status, detail, figures = gpu_proof.judge_attention(_ctx(tmp_path), -9, log)
    assert status == "fail" and "['per_sequence_cudnn_off']" in detail and figures["runs"] == runs
    log.with_suffix(".out").write_text("attention_check: summary\n")
    assert gpu_proof.judge_attention(_ctx(tmp_path), 0, log) == ("pass", "attention_check: summary", {"runs": runs})


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
    attention = {
        "dtype": "bfloat16",
        "sequences": 32,
        "layers": 28,
        "iteration_lengths": [[256, 1280]],
        "iteration_tokens": [1536],
        "cudnn_version": 91900,
        "torch": "2.11.0",
        "calls_per_iteration": {"per_sequence": 896, "varlen": 28},
        "runs": {
            "per_sequence_cudnn_off": {
                "available": True,
                "first_s": 0.5,
                "median_s": 0.04,
                "forward_seconds": [0.01, 0.02],
            },
            "varlen": {"available": False, "reason": "varlen_attn failed: RuntimeError: sm"},
        },
        "ratios": {"cudnn_on_over_off": 52.5},
        "varlen_vs_per_sequence": {"max_abs_diff": {"out": 0.004}, "reference_max_abs": {"out": 2.0}},
    }
    steps = [
        {"name": "attention", "status": "pass", "seconds": 40.0, "detail": "a", "figures": attention},
        {"name": "selftest", "status": "pass", "seconds": 3.0, "detail": "1 pass | 0 fail",
         "figures": {"records": [{"name": "ops/a", "status": "pass", "seconds": 1.0, "detail": "ok"}]}},
        {"name": "throughput_fsdp", "status": "pass", "seconds": 9.0, "detail": "x",
         "figures": {"tokens_per_second": 12345.6, "mfu": 0.4123, "peak_memory_bytes": 3 * 2**30,
                     "first_update_s": 9.5, "tokens_per_step": 18381.5, "micro_batches_per_step": 4.5}},
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
    assert "| first update, a fresh engine (s) | 9.500 |" in text and "| real tokens per step (mean) | 18,382 |" in text
    assert "| micro-batches per step (mean) | 4.5 |" in text
    assert "| per_sequence_cudnn_off | 896 | 0.5000 | 0.0400 | 0.0150 |" in text
    assert "| varlen | - | - | varlen_attn failed: RuntimeError: sm | - |" in text
    assert "cudnn on over off: 52.5x" in text and "out 0.004 (2)" in text and "(256-1280 tokens" in text
