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
