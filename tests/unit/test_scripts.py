"""The launch scripts (scripts/{npu,gpu,cpu}/*.sh, shared logic in scripts/lib/) and the pinned requirements.

Every script's --dry-run runs on this CPU machine, prints the resolved config and the commands it would run and
starts nothing; the printed config is then re-checked in-process: it passes the preflight and the memory planner
says "fits" on the script's target hardware. NPU and GPU scripts differ only in their hardware names. The
requirements files agree with the doctor's version matrix (checked with the doctor's own package checks). Slow
tests run the Ray lifecycle for real and check that the launcher stops exactly what it started, and (where Ray's
job server is installed, `ray[default]`) run the CPU script end to end through `ray job submit`.

Why one file over 600 lines: every test here runs the same launch scripts through the same helpers (the dry run,
the Ray lifecycle), and the slow ones share the port and process helpers at its end.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from gspo_ascend import config
from gspo_ascend.doctor import matrix, packages
from gspo_ascend.doctor.hardware import profile
from gspo_ascend.doctor.modelspec import load_spec
from gspo_ascend.doctor.planner import plan
from gspo_ascend.doctor.preflight import failures, preflight
from gspo_ascend.doctor.versions import matches, normalize_name
from tests.conftest import REPO

MODELS = REPO / "tests/fixtures/models"
MOE, DENSE = MODELS / "qwen3-30b-a3b", MODELS / "qwen2.5-3b"

# script -> (trainer.device, planner hardware, runtime env, fixture model; None = the embedded tiny model)
SCRIPTS = {
    "scripts/npu/qwen3_30b_gspo.sh": ("npu", "atlas-800t-a2", "env/npu/mc2_env.yaml", MOE),
    "scripts/gpu/qwen3_30b_gspo.sh": ("cuda", "h20", "env/gpu/h20_env.yaml", MOE),
    "scripts/npu/qwen25_3b_gspo.sh": ("npu", "atlas-800t-a2", "env/npu/mc2_env.yaml", DENSE),
    "scripts/gpu/qwen25_3b_gspo.sh": ("cuda", "h20", "env/gpu/h20_env.yaml", DENSE),
    "scripts/cpu/tiny_gspo.sh": ("cpu", "cpu", "env/cpu/cpu_env.yaml", None),
    "scripts/npu/qwen3_30b_gspo_disagg.sh": ("npu", "atlas-800t-a2", "env/npu/mc2_env.yaml", MOE),
    "scripts/gpu/qwen3_30b_gspo_disagg.sh": ("cuda", "h20", "env/gpu/h20_env.yaml", MOE),
}
DISAGG = ("scripts/npu/qwen3_30b_gspo_disagg.sh", "scripts/gpu/qwen3_30b_gspo_disagg.sh")
PAIRS = [
    ("scripts/npu/qwen3_30b_gspo.sh", "scripts/gpu/qwen3_30b_gspo.sh"),
    DISAGG,
    ("scripts/npu/qwen25_3b_gspo.sh", "scripts/gpu/qwen25_3b_gspo.sh"),
]
HARDWARE_NAMES = {"RUN_NAME", "DEVICE", "HARDWARE", "RUNTIME_ENV", "HOST_ENV"}


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    from gspo_ascend.tiny import ensure_tiny_model

    return ensure_tiny_model()


def launch(script: str, *args: str, cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    """Run a launch script the way a user does, with a clean set of launcher variables."""
    base = {k: v for k, v in os.environ.items() if k not in ("NNODES", "NODE_RANK", "HEAD_ADDR", "MODEL_PATH")}
    base.update(PYTHON=sys.executable, **env)
    return subprocess.run(
        ["bash", str(REPO / script), *args], capture_output=True, text=True, env=base, cwd=cwd or REPO, timeout=240
    )


def printed_config(stdout: str) -> dict:
    """The YAML between the '== resolved config' and the '== preflight' headers."""
    body = stdout.split("== resolved config", 1)[1].split("\n", 1)[1].split("\n== preflight", 1)[0]
    return yaml.safe_load(body)


def commands(stdout: str) -> list[str]:
    return [line[2:] for line in stdout.split("\n== commands", 1)[1].splitlines() if line.startswith("+ ")]


def model_for(script: str, tiny: Path) -> Path:
    return SCRIPTS[script][3] or tiny


def printed_config_path(script: str) -> str:
    """The CONFIG an entry script names (`: "${CONFIG:=$REPO/configs/x.yaml}"`)."""
    (match,) = re.findall(r'CONFIG:=\$REPO/(configs/[^"}]+)', (REPO / script).read_text())
    return match


# ----------------------------------------------------------------------------------------------- dry runs


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_dry_run_resolves_checks_and_starts_nothing(script, tiny_model, tmp_path):
    device, hardware, runtime_env, _ = SCRIPTS[script]
    out, model = tmp_path / "out", model_for(script, tiny_model)
    proc = launch(script, "--dry-run", MODEL_PATH=str(model), OUTPUT_DIR=str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "verdict: fits" in proc.stdout
    cmds = commands(proc.stdout)
    assert any(c.split()[1:4] == ["start", "--head", "--port=6379"] and "--block" in c.split() for c in cmds), cmds
    (submit,) = [c for c in cmds if " job submit " in c]
    assert f"--runtime-env={runtime_env}" in submit and "-m gspo_ascend.cli train --config" in submit
    assert f"trainer.device={device}" in submit
    assert "dry run complete: nothing was started" in proc.stdout
    assert not out.exists()  # nothing written, not even the Ray log directory

    # independent of the script's own plan call: rebuild the printed config in-process, preflight and plan it
    cfg = config.from_dict(printed_config(proc.stdout))
    assert (cfg.trainer.device, cfg.trainer.output_dir, cfg.model.path) == (device, str(out), str(model))
    assert [c.finding for c in failures(preflight(cfg))] == []
    per_node = cfg.trainer.devices_per_node
    result = plan(cfg, load_spec(cfg.model.path), profile(hardware, per_node))
    assert result.verdict == "fits", (result.train_verdict, result.rollout_verdict)
    world = {"scripts/npu/qwen3_30b_gspo.sh": 16, "scripts/gpu/qwen3_30b_gspo.sh": 16}.get(script, per_node)
    world = {DISAGG[0]: 12, DISAGG[1]: 12}.get(script, world)  # the trainer pool; 4 more devices generate
    assert cfg.trainer.nnodes * per_node == world


# script -> the built-in spec its config's model.path (/models/<name>) maps to when the weights are not here
BUILTIN = {
    "scripts/npu/qwen3_30b_gspo.sh": "Qwen/Qwen3-30B-A3B",
    "scripts/gpu/qwen3_30b_gspo.sh": "Qwen/Qwen3-30B-A3B",
    "scripts/npu/qwen25_3b_gspo.sh": "Qwen/Qwen2.5-3B",
    "scripts/gpu/qwen25_3b_gspo.sh": "Qwen/Qwen2.5-3B",
    DISAGG[0]: "Qwen/Qwen3-30B-A3B",
    DISAGG[1]: "Qwen/Qwen3-30B-A3B",
}


@pytest.mark.parametrize("script", sorted(BUILTIN))
def test_dry_run_without_weights_fits_with_the_builtin_spec(script, tmp_path):
    """The laptop check of issue #20: no MODEL_PATH, no weights, no device; the config's own model.path."""
    device, hardware, _, fixture = SCRIPTS[script]
    default = config.load_config(REPO / printed_config_path(script), validate=False).model.path
    if Path(default, "config.json").is_file():
        pytest.skip(f"{default} exists on this machine; the built-in spec is not used")
    proc = launch(script, "--dry-run", OUTPUT_DIR=str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    hub_id = BUILTIN[script]
    notes = [line for line in proc.stdout.splitlines() if "has no config.json" in line]
    assert notes == [
        f"note: model.path '{default}' has no config.json: using the built-in spec of {hub_id} (matched by its last "
        f"path component '{Path(default).name}'; fields of https://huggingface.co/{hub_id}/blob/main/config.json)"
    ]
    assert "verdict: fits" in proc.stdout and "dry run complete: nothing was started" in proc.stdout
    cfg = config.from_dict(printed_config(proc.stdout))
    assert (cfg.model.path, cfg.trainer.device) == (default, device)
    # the same plan as from the published config.json the fixture holds
    per_node = cfg.trainer.devices_per_node
    ours, published = load_spec(cfg.model.path), load_spec(str(fixture))
    assert plan(cfg, ours, profile(hardware, per_node)).as_dict() | {"model": "", "spec_note": ""} == plan(
        cfg, published, profile(hardware, per_node)
    ).as_dict() | {"model": "", "spec_note": ""}


def test_dry_run_with_a_missing_model_path_says_a_real_run_needs_the_weights(tmp_path):
    missing = tmp_path / "qwen3-30b-a3b"  # lower-case, as some download tools name it
    proc = launch("scripts/npu/qwen3_30b_gspo.sh", "--dry-run", MODEL_PATH=str(missing), OUTPUT_DIR=str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "using the built-in spec of Qwen/Qwen3-30B-A3B (matched by its last path component 'qwen3-30b-a3b'" in (
        proc.stdout
    )
    assert f"# note: a real run needs MODEL_PATH={missing} (no config.json)" in proc.stdout
    assert "verdict: fits" in proc.stdout


@pytest.mark.parametrize(
    "script, nnodes, overrides, verdict",
    [
        ("scripts/npu/qwen3_30b_gspo.sh", "4", ["actor.pipeline_parallel_size=4", "data.train_batch_size=512"], "fits"),
        ("scripts/gpu/qwen3_30b_gspo.sh", "4", ["actor.pipeline_parallel_size=4", "data.train_batch_size=512"], "fits"),
        # 18 B/param (bf16 weights, fp32 gradients, fp32 master + Adam) x 30.5B / 8 = 68.7 GB: not on 64 GB NPUs
        ("scripts/npu/qwen3_30b_gspo.sh", "1", ["actor.expert_parallel_size=4"], "OOM"),
        ("scripts/gpu/qwen3_30b_gspo.sh", "1", ["actor.expert_parallel_size=4"], "fits"),
    ],
)
def test_documented_node_variants(script, nnodes, overrides, verdict):
    proc = launch(script, "--dry-run", *overrides, MODEL_PATH=str(MOE), NNODES=nnodes)
    assert f"verdict: {verdict}" in proc.stdout
    if verdict == "OOM":  # refused in one line, nothing started
        assert proc.returncode != 0 and "error: the memory plan is OOM on atlas-800t-a2" in proc.stdout + proc.stderr
        return
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ("warning: the plan is tight" in proc.stdout) == (verdict == "tight")
    assert printed_config(proc.stdout)["trainer"]["nnodes"] == int(nnodes)
    assert f"wait until {nnodes} node(s) with {int(nnodes) * 8} " in proc.stdout


@pytest.mark.parametrize("script", DISAGG)
def test_disaggregated_dry_run_gives_ray_both_pools_devices(script, tmp_path):
    """The variant with a rollout pool: each node gives Ray its 6 trainer + 2 rollout devices, the head waits for
    2 x 8, the job gets both pools' layout and one-step-off, and each pool passes the preflight and the plan."""
    device, hardware, _, _ = SCRIPTS[script]
    proc = launch(script, "--dry-run", MODEL_PATH=str(MOE), OUTPUT_DIR=str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"2 node(s) x 8 {'GPU' if device == 'cuda' else 'NPU'} (6 trainer + 2 rollout)" in proc.stdout
    assert "wait until 2 node(s) with 16 " in proc.stdout
    (start,) = [c for c in commands(proc.stdout) if " start --head " in c]
    # and each pool's share of the node as a resource of its own, so Ray places 6 + 2 ranks per node (placement.py)
    shares = r"\"gspo_trainer_pool\":6\,\"gspo_rollout_pool\":2\}"
    if device == "cuda":
        assert "--num-gpus=8" in start and r"--resources=\{" + shares in start
    else:
        assert r"--resources=\{\"NPU\":8\," + shares in start
    (submit,) = [c for c in commands(proc.stdout) if " job submit " in c]
    assert "rollout_pool.nnodes=2 rollout_pool.devices_per_node=2" in submit
    cfg = config.from_dict(printed_config(proc.stdout))
    pool = cfg.rollout_pool
    assert (pool.nnodes, pool.devices_per_node, pool.max_staleness) == (2, 2, 1)
    assert config.rollout_world(cfg) % cfg.rollout.tensor_parallel_size == 0
    assert (cfg.trainer.devices_per_node + pool.devices_per_node) == profile(hardware, 8).devices_per_node
    # one node of the worker: it joins with the same 8 devices
    worker = launch(script, "--dry-run", NODE_RANK="1", HEAD_ADDR="10.1.2.3")
    assert worker.returncode == 0, worker.stderr
    (join,) = [c for c in commands(worker.stdout) if " start --address=10.1.2.3:6379 " in f" {c} "]
    assert shares in join
    # a colocated script's node gives Ray its devices alone
    (colocated,) = [c for c in commands(launch(script.replace("_disagg", ""), "--dry-run").stdout) if " start " in c]
    assert "gspo_trainer_pool" not in colocated


@pytest.mark.parametrize(
    "env, args, fragment",
    [
        ({"ROLLOUT_DEVICES_PER_NODE": "4"}, [], "preflight:pools: trainer.devices_per_node (6) + rollout_pool"),
        ({}, ["rollout.tensor_parallel_size=4"], "preflight:rollout-tp: rollout.tensor_parallel_size (4) does not"),
        ({}, ["rollout_pool.devices_per_node=3"], "sets rollout_pool.devices_per_node from ROLLOUT_DEVICES_PER_NODE"),
    ],
)
def test_disaggregated_bad_pool_layout_stops_before_ray(env, args, fragment):
    proc = launch(DISAGG[0], "--dry-run", *args, MODEL_PATH=str(MOE), **env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert fragment in proc.stderr and "Traceback" not in proc.stderr
    assert "== commands" not in proc.stdout


def test_layout_that_does_not_fit_the_node_count_stops_before_ray():
    # the field failure: a 4-node layout (EP 8 x PP 2 = 16 ranks per fold) launched on 1 node
    proc = launch("scripts/npu/qwen3_30b_gspo.sh", "--dry-run", MODEL_PATH=str(MOE), NNODES="1")
    assert proc.returncode == 2
    assert "preflight:moe-folding" in proc.stderr and "nothing was started" in proc.stderr
    assert "== commands" not in proc.stdout


def test_npu_moe_nodes_build_mindspeed_ops_once_before_ray(tmp_path):
    """scripts/npu/qwen3_30b_gspo.sh: every node (head and worker) runs `selftest --build-ops` after its host
    profile and before Ray starts its workers; a dry run prints it and runs nothing. The dense FSDP script does not."""
    script = "scripts/npu/qwen3_30b_gspo.sh"
    for env in ({"MODEL_PATH": str(MOE)}, {"NODE_RANK": "1", "HEAD_ADDR": "10.1.2.3"}):
        proc = launch(script, "--dry-run", OUTPUT_DIR=str(tmp_path / "out"), **env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        cmds = commands(proc.stdout)
        (prep,) = [i for i, c in enumerate(cmds) if c.endswith("-m gspo_ascend.cli selftest --device npu --build-ops")]
        assert cmds[prep - 1].startswith("source env/npu/") and all("ray" not in c.split()[0] for c in cmds[:prep])
        assert "setup/mindspeed_ops" not in proc.stdout  # printed, not run
    dense = launch("scripts/npu/qwen25_3b_gspo.sh", "--dry-run", OUTPUT_DIR=str(tmp_path / "out"))
    assert dense.returncode == 0 and "--build-ops" not in dense.stdout


def test_worker_dry_run_joins_the_head_and_submits_nothing():
    proc = launch("scripts/gpu/qwen3_30b_gspo.sh", "--dry-run", NODE_RANK="1", HEAD_ADDR="10.1.2.3", RAY_PORT="7000")
    assert proc.returncode == 0, proc.stderr
    cmds = commands(proc.stdout)
    assert cmds[0] == "source env/gpu/h20.sh"
    assert any(" start --address=10.1.2.3:7000 " in f" {c} " and "--num-gpus=8" in c for c in cmds), cmds
    assert not any("job submit" in c for c in cmds) and "== resolved config" not in proc.stdout


def test_relative_paths_become_absolute_from_the_launch_directory(tmp_path):
    (tmp_path / "m").symlink_to(DENSE)
    proc = launch(
        "scripts/npu/qwen25_3b_gspo.sh", "--dry-run", cwd=tmp_path, MODEL_PATH="m", TRAIN_FILES="d/a.parquet,b.parquet"
    )
    assert proc.returncode == 0, proc.stderr
    cfg = printed_config(proc.stdout)
    assert cfg["model"]["path"] == str(tmp_path / "m")
    assert cfg["data"]["train_files"] == [str(tmp_path / "d/a.parquet"), str(tmp_path / "b.parquet")]
    assert f"{tmp_path}/d/a.parquet (gspo-ascend prepare-data writes it)" in proc.stdout  # reported, not fatal


@pytest.mark.parametrize(
    "args, env, fragment",
    [
        (["model.path=/x"], {}, "sets model.path from MODEL_PATH"),
        (["trainer.nnodes=4"], {}, "sets trainer.nnodes from NNODES"),
        (["--frobnicate"], {}, "unknown argument '--frobnicate'"),
        ([], {"NODE_RANK": "2", "NNODES": "2"}, "NODE_RANK=2 must be in 0..1"),
        ([], {"NODE_RANK": "1", "NNODES": "2"}, "set HEAD_ADDR"),
        ([], {"NNODES": "two"}, "NNODES='two' must be a non-negative integer"),
        (["algorithm.filter_groups.enable=true"], {}, "unknown config key 'algorithm.filter_groups"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, env, fragment):
    proc = launch("scripts/npu/qwen3_30b_gspo.sh", "--dry-run", *args, MODEL_PATH=str(MOE), **env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert fragment in proc.stderr and "Traceback" not in proc.stderr


def test_help_lists_the_variables():
    proc = launch("scripts/cpu/tiny_gspo.sh", "--help")
    assert proc.returncode == 0
    for name in ("MODEL_PATH", "DATA_DIR", "NNODES", "NODE_RANK", "HEAD_ADDR", "NIC", "--dry-run"):
        assert name in proc.stdout


# ----------------------------------------------------------------------------------------------- shape


def code_lines(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.strip() and not line.lstrip().startswith("#")]


@pytest.mark.parametrize("npu, gpu", PAIRS)
def test_npu_and_gpu_scripts_differ_only_in_hardware_names(npu, gpu):
    """... and in the NPU-only node preparation (NODE_PREP: MindSpeed's JIT ops; no GPU counterpart)."""
    a = [line for line in code_lines(REPO / npu) if not line.startswith("NODE_PREP=")]
    b = code_lines(REPO / gpu)
    assert len(a) == len(b)
    differing = [(x, y) for x, y in zip(a, b, strict=True) if x != y]
    assert {x.split("=", 1)[0] for x, _ in differing} == HARDWARE_NAMES
    assert all(x.split("=", 1)[0] == y.split("=", 1)[0] for x, y in differing)


def test_no_script_kills_what_it_did_not_start():
    files = sorted((REPO / "scripts").rglob("*.sh")) + sorted((REPO / "env").rglob("*.sh"))
    assert len(files) >= 9
    banned = re.compile(r"\bpkill\b|\bkillall\b|\bray(_cli|\")?\s+stop\b|\$RAY_BIN\"?\s+stop\b|kill\s+-9\s+-1")
    for path in files:
        for line in code_lines(path):
            assert not banned.search(line), f"{path.relative_to(REPO)}: {line}"


@pytest.mark.skipif(
    shutil.which("shellcheck") is None, reason="shellcheck is not installed (apt-get install shellcheck)"
)
def test_shellcheck_clean():
    launch_files = [p for d in ("npu", "gpu", "cpu", "lib") for p in sorted((REPO / "scripts" / d).glob("*.sh"))]
    files = [str(p.relative_to(REPO)) for p in launch_files + sorted(REPO.glob("env/*/*.sh"))]
    proc = subprocess.run(["shellcheck", "-x", *files], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stdout


# ----------------------------------------------------------------------------------------------- requirements

_PIN = re.compile(r"^([A-Za-z0-9_.\-]+)(\[[^\]]*\])?\s*(==|>=)\s*([^\s;#]+)")
_NOTED = re.compile(r"^#\s+@(system|source)\s+([A-Za-z0-9_.\-]+)==(\S+)")


def requirement_pins(path: Path) -> dict[str, str]:
    """name -> version: `==` pins, `>=` floors (taken as the version), and the `# @system` / `# @source` lines."""
    pins = {}
    for line in path.read_text().splitlines():
        noted = _NOTED.match(line)
        if noted:
            pins[normalize_name(noted[2])] = noted[3]
            continue
        pin = _PIN.match(line.strip())
        if pin:
            pins[normalize_name(pin[1])] = pin[4]
    return pins


def test_requirements_npu_is_the_matrix_stack():
    pins = requirement_pins(REPO / "requirements-npu.txt")
    stack = next(s for s in matrix.STACKS if s.platform == "npu" and not s.previous)  # the current line
    for package, spec in stack.pins:
        assert package in pins and matches(pins[package], spec), (package, pins.get(package), spec)
    # the 0.23 line: vllm-ascend 0.23.0's wheel pins torch, torch-npu, triton-ascend and transformers; MindSpeed
    # core_r0.16.0's setup.py declares 0.16.0 and patches Megatron core_r0.16.0
    assert pins["mindspeed"] == "0.16.0" and pins["megatron-core"] == "0.16.0" and pins["transformers"] == "5.5.4"
    assert pins["vllm-ascend"] == "0.23.0" and pins["vllm"] == "0.23.0" and pins["cann"] == "9.1.0"
    assert pins["torch"] == "2.10.0" and pins["torch-npu"] == "2.10.0.post4" and pins["triton-ascend"] == "3.2.2"
    checks = (
        packages.check_torch_npu_pair(pins)
        + packages.check_vllm_ascend(pins)
        + packages.check_mindspeed(pins)
        + packages.check_known_bad(pins, "npu")
        + packages.check_requirements(pins, "npu")
        + packages.check_stack(pins, "npu")
    )
    assert [(c.name, c.finding) for c in checks if c.status != "ok"] == []
    assert {c.name for c in checks} == {"compat-cann", "compat-vllm-ascend", "compat-mindspeed", "stack"}
    assert [c.finding for c in checks if c.name == "stack"] == ["matches the gspo-ascend Ascend stack"]


def test_requirements_gpu_share_vllm_and_megatron_and_satisfy_the_matrix():
    npu, gpu = requirement_pins(REPO / "requirements-npu.txt"), requirement_pins(REPO / "requirements-gpu.txt")
    for shared in ("vllm", "megatron-core", "mbridge", "ray", "math-verify", "einops"):
        assert gpu[shared] == npu[shared], shared
    # one transformers: vllm-ascend 0.23.0 declares ==5.5.4, which vLLM 0.23.0 accepts on GPU too
    assert gpu["transformers"] == npu["transformers"] == "5.5.4"
    # one vLLM and one megatron-core line, two torches: vLLM 0.23.0's CUDA wheel declares torch==2.11.0 and
    # torchvision==0.26.0, vllm-ascend 0.23.0 torch==2.10.0
    assert (gpu["torch"], gpu["torchvision"], npu["torch"]) == ("2.11.0", "0.26.0", "2.10.0")
    # megatron-core 0.16.0's dev extra asks for transformer-engine>=2.9,<2.12
    assert gpu["transformer-engine"] == "2.11.0"
    assert not {"torch-npu", "vllm-ascend", "mindspeed", "cann", "triton-ascend"} & set(gpu)
    checks = packages.check_known_bad(gpu, "cuda") + packages.check_requirements(gpu, "cuda")
    checks += packages.check_stack(gpu, "cuda")  # empty until the matrix names a CUDA stack; then it must match
    assert [(c.name, c.finding) for c in checks if c.status != "ok"] == []
    # the rule that makes the pair consistent: vLLM 0.23 CUDA wheels need torch 2.11.0
    (wrong,) = packages.check_requirements({**gpu, "torch": npu["torch"]}, "cuda")
    assert wrong.name == "requires-torch" and "==2.11.0" in wrong.finding


def test_requirements_ray_has_the_job_server_extra():
    for name in ("requirements-npu.txt", "requirements-gpu.txt"):
        assert re.search(r"^ray\[default\]==", (REPO / name).read_text(), re.M), name


# ----------------------------------------------------------------------------------------------- real Ray


# Ray's worker processes take ports 10002-19999 (``ray start --min/max-worker-port``'s defaults) and every port a
# component asks the kernel for (raylet, object manager, metrics; an outgoing connection's local end) comes from
# the ephemeral range. A port drawn from either can be taken again between our check and ``ray start`` binding it:
# a head then dies at start (seen once in CI, its GCS port 58067 in the ephemeral range, while the MindSpeed venvs
# downloaded beside it). So the ports we hand Ray come from the gap between the two ranges.
RAY_WORKER_PORTS = range(10002, 20000)


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))  # Ray's GCS and agents listen on every address
        except OSError:
            return False
    return True


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free now, outside Ray's worker ports and the kernel's ephemeral range (see above)."""
    import random

    gap = range(RAY_WORKER_PORTS.stop, _ephemeral_low())
    if len(gap) < 100 * n:  # an unusual port range: fall back to the kernel's choice
        socks = [socket.socket() for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        ports = [s.getsockname()[1] for s in socks]
        for s in socks:
            s.close()
        return ports
    ports: list[int] = []
    for port in random.sample(gap, min(len(gap), 50 * n)):
        if _bindable(port):
            ports.append(port)
            if len(ports) == n:
                return ports
    raise AssertionError(f"fewer than {n} free ports in {gap.start}-{gap.stop - 1}")


HARNESS = """
set -euo pipefail
source scripts/lib/launch.sh
DRY_RUN=0 NNODES=1 DEVICES_PER_NODE=1 NODE_DEVICES=1 HEAD_ADDR=127.0.0.1 RAY_PORT=$1 DASHBOARD_PORT=$2 WAIT_TIMEOUT=180
RAY_BIN=$(dirname "$PYTHON")/ray RAY_RESOURCE=CPU RAY_LOG=$RAY_TMPDIR/launch.log JOB_ADDRESS=http://127.0.0.1:$2
RUN_NAME=test
trap on_exit EXIT
trap 'exit 143' TERM
ray_auth
ray_head_up
ray_wait_nodes
echo "READY pid=${RAY_STARTED_PID:-none}"
while :; do sleep 1; done  # short sleeps: the TERM trap runs within a second, and no child outlives the launcher
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def processes_mentioning(text: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if text in (proc / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(proc.name))
            except OSError:
                continue
    return found


def wait_for_line(proc: subprocess.Popen, prefix: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith(prefix):
            return line.strip()
        if not line and proc.poll() is not None:
            break
    raise AssertionError(f"no '{prefix}' line; exit {proc.poll()}")


@pytest.mark.slow
def test_launcher_stops_exactly_what_it_started():
    """Launcher A starts a Ray head; launcher B finds it, uses it and leaves it running; an unrelated Python
    process survives both; on SIGTERM, A stops its Ray node (every process under its temp dir) and its marker."""
    tmp = Path(tempfile.mkdtemp(prefix="gr", dir="/tmp"))  # short: Ray's unix sockets live under it
    gcs, dashboard, client, agent = free_ports(4)
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "RAY_TMPDIR": str(tmp),
        "RAY_AUTH_TOKEN": secrets.token_hex(32),  # no ~/.ray/auth_token is written
        "RAY_POLL_S": "1",
        "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",  # Ray's SIGTERM drain (for Serve) would add 30 s
        "RAY_START_ARGS": f"--include-dashboard=false --num-cpus=1 --ray-client-server-port={client} "
        f"--dashboard-agent-listen-port={agent}",
    }
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    head = subprocess.Popen(
        ["bash", "-c", HARNESS, "harness", str(gcs), str(dashboard)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        ready = wait_for_line(head, "READY", 200)
        ray_pid = int(ready.split("pid=")[1])
        assert alive(ray_pid) and processes_mentioning(str(tmp))
        assert (tmp / "ray_current_cluster").is_file()
        second = subprocess.run(
            ["bash", "-c", HARNESS.replace("while :; do sleep 1; done", ""), "harness", str(gcs), str(dashboard)],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode == 0, second.stdout + second.stderr
        assert "already answers" in second.stdout and "READY pid=none" in second.stdout
        assert "stopping the Ray node" not in second.stdout and alive(ray_pid)  # B left A's cluster running
        head.send_signal(signal.SIGTERM)
        rest = head.communicate(timeout=120)[0]
        assert head.returncode == 143, rest
        assert f"stopping the Ray node this launcher started (PID {ray_pid})" in rest
        assert not alive(ray_pid)
        deadline = time.monotonic() + 30
        while processes_mentioning(str(tmp)) and time.monotonic() < deadline:
            time.sleep(1)
        assert processes_mentioning(str(tmp)) == []
        assert not (tmp / "ray_current_cluster").exists()
        assert bystander.poll() is None  # an unrelated python process survives (no `pkill python`)
    finally:
        for proc in (head, bystander):
            if proc.poll() is None:
                proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.slow
def test_cpu_script_trains_through_ray_job_submit(tmp_path):
    """The whole launch for real on CPU: Ray head, runtime_env upload, the trainer joining through RAY_ADDRESS,
    one GSPO step, the job's status as the exit code, and only our Ray node stopped afterwards."""
    tmp = Path(tempfile.mkdtemp(prefix="gr", dir="/tmp"))
    gcs, dashboard, client, agent = free_ports(4)
    env = {
        "RAY_TMPDIR": str(tmp),
        "RAY_PORT": str(gcs),
        "DASHBOARD_PORT": str(dashboard),
        "RAY_AUTH_TOKEN": secrets.token_hex(32),
        "RAY_POLL_S": "1",
        "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
        "RAY_START_ARGS": f"--num-cpus=2 --ray-client-server-port={client} --dashboard-agent-listen-port={agent}",
        "OUTPUT_DIR": str(tmp_path / "run"),
    }
    try:
        proc = launch("scripts/cpu/tiny_gspo.sh", "trainer.total_steps=1", "trainer.save_freq=0", **env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "step 1/1" in proc.stdout and "succeeded" in proc.stdout + proc.stderr
        assert (tmp_path / "run/metrics.jsonl").is_file()
        assert "stopping the Ray node this launcher started" in proc.stdout
        assert processes_mentioning(str(tmp)) == [] and not (tmp / "ray_current_cluster").exists()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.parametrize("how", [["--branch", "2.3.0"], ["--branch=master"]])
def test_check_mindspeed_refuses_an_unknown_branch_in_one_line(how, tmp_path):
    """Only the three held branches (docs/mindspeed-branches.md); refused before any venv is built."""
    env = {"PATH": os.environ["PATH"], "MINDSPEED_VENV": str(tmp_path / "venv")}
    proc = subprocess.run(
        ["bash", str(REPO / "scripts/check_mindspeed.sh"), *how], capture_output=True, text=True, env=env, timeout=60
    )
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "--branch" in proc.stderr and all(b in proc.stderr for b in ("core_r0.16.0", "26.1.0", "2.2.0"))
    assert not (tmp_path / "venv").exists()
