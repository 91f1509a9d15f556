"""The command line as a user meets it: help, --print-config, bad input -> one line + exit 2."""

from __future__ import annotations

import yaml

from tests.conftest import REPO


def assert_user_error(proc, *fragments):
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def test_help(cli):
    proc = cli("--help")
    assert proc.returncode == 0 and "train" in proc.stdout and "doctor" in proc.stdout


def test_print_config_resolves_yaml_and_overrides(cli):
    proc = cli(
        "train",
        "--config",
        str(REPO / "configs/tiny_gspo.yaml"),
        "algorithm.clip_ratio_low=2e-4",
        "--print-config",
    )
    assert proc.returncode == 0, proc.stderr
    resolved = yaml.safe_load(proc.stdout)
    assert resolved["algorithm"]["clip_ratio_low"] == 2e-4
    assert resolved["algorithm"]["clip_ratio_high"] == 4e-4
    assert resolved["rollout"]["n"] == 8


def test_unknown_key_exit_2(cli):
    assert_user_error(
        cli("train", "algorithm.clip_ratio_lo=1", "--print-config"), "did you mean 'algorithm.clip_ratio_low'"
    )


def test_missing_config_file(cli):
    assert_user_error(cli("train", "--config", "nope.yaml", "--print-config"), "nope.yaml", "does not exist")


def test_unknown_device_exit_2(cli):
    proc = cli("train", "trainer.device=xpu", "--dry-run")
    assert_user_error(proc, "trainer.device", "'auto', 'cpu', 'cuda', 'npu'")


def test_unknown_device_env_exit_2(cli):
    assert_user_error(cli("train", "--dry-run", env={"GSPO_DEVICE": "xpu"}), "GSPO_DEVICE='xpu'", "cpu, cuda, npu")


def test_npu_without_shim_or_cann_exit_2(cli):
    proc = cli("train", "trainer.device=npu", "--dry-run", env={"GSPO_DEVICE_SHIM": "0"})
    assert_user_error(proc, "GSPO_DEVICE_SHIM=1", "CANN")


def test_npu_with_shim_dry_run(cli):
    proc = cli("train", "trainer.device=npu", "--dry-run", env={"GSPO_DEVICE_SHIM": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "npu (CPU shim)" in proc.stdout


def test_doctor_cpu_mode(cli):
    import json

    proc = cli("doctor", "--json")
    assert proc.returncode == 0, proc.stderr
    checks = {c["name"]: c for c in json.loads(proc.stdout)}
    assert checks["device"]["status"] == "ok" and "CPU mode" in checks["device"]["finding"]
    assert "shim" in checks["cpu-shim"]["finding"]


def test_end_of_run_summary_names_the_outputs_and_the_commands(tmp_path):
    from gspo_ascend import checkpoint
    from gspo_ascend.trainer import run_summary

    run = tmp_path.resolve() / "my run"  # a space: the printed commands must still paste into a shell
    for step in (2, 4):
        checkpoint.commit(checkpoint.begin(run, step), step, {"step": step})
    (run / "hf").mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "tensorboard").mkdir()
    lines = run_summary(run, ["console", "jsonl", "tensorboard"])
    assert lines == [
        f"run finished; outputs in {run}",
        f"  run directory    {run} (config.json: the resolved config)",
        f"  last checkpoint  {run}/checkpoints/step_00000004",
        f"  HF export        {run}/hf",
        f"  metrics          {run}/metrics.jsonl",
        f"  TensorBoard      {run}/tensorboard",
        "look at it:",
        f"  gspo-ascend plot '{run}'   # PNG curves into {run}/plots",
        f"  tensorboard --logdir '{run}/tensorboard'",
    ]
    assert not any("eval" in line for line in lines)  # no validation files: no `gspo-ascend eval` to reproduce


def test_end_of_run_summary_explains_what_was_not_written(tmp_path):
    from gspo_ascend.trainer import run_summary

    tmp_path = tmp_path.resolve()  # the summary prints absolute, resolved paths
    lines = run_summary(tmp_path, ["console", "wandb"], "my-project")
    assert lines == [
        f"run finished; outputs in {tmp_path}",
        f"  run directory    {tmp_path} (config.json: the resolved config)",
        "  last checkpoint  none saved (trainer.save_freq, or no step ran)",
        "  HF export        none written",
        "  metrics          not written (trainer.loggers has no 'jsonl')",
        "  TensorBoard      not written (trainer.loggers has no 'tensorboard')",
        "  W&B              project 'my-project' (trainer.project_name)",
    ]
