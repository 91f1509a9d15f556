"""env/: the Ray runtime_envs (env/*/*.yaml) and the host profiles (env/npu/atlas_800t_a2.sh, env/gpu/h20.sh).

Every variable is documented where it is set (a `what:` / `why:` / `source:` comment block) and in
docs/launch-scripts.md, and is allowed on its hardware: the NPU set (runtime_env plus what sourcing the profile
exports, with recorded CANN set_env.sh scripts) passes every gspo-ascend doctor env rule for the shipped NPU runs,
and no Ascend variable leaks into the GPU / CPU sets (nor CUDA ones into the NPU set). The profiles are sourced for
real in bash, under `set -euo pipefail` as the launcher does.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from gspo_ascend import config
from gspo_ascend.doctor.envrules import ENV_RULES, Situation, situation
from tests.conftest import REPO

YAMLS = {
    "npu": REPO / "env/npu/mc2_env.yaml",
    "gpu": REPO / "env/gpu/h20_env.yaml",
    "cpu": REPO / "env/cpu/cpu_env.yaml",
}
PROFILES = {"npu": REPO / "env/npu/atlas_800t_a2.sh", "gpu": REPO / "env/gpu/h20.sh"}
ASCEND_ONLY = re.compile(
    r"^(HCCL_|ASCEND_|VLLM_ASCEND_|ATB_|LCCL_|PYTORCH_NPU_|TASK_QUEUE_ENABLE$|.*ASCEND_RT_VISIBLE)"
)
CUDA_ONLY = re.compile(r"^(NCCL_|TORCH_NCCL_|CUDA_|PYTORCH_CUDA_|.*CUDA_VISIBLE)")
FIXTURES = REPO / "tests/fixtures/doctor/ascend"
DOC = (REPO / "docs/launch-scripts.md").read_text()


def env_vars(kind: str) -> dict:
    return yaml.safe_load(YAMLS[kind].read_text())["env_vars"]


def comment_block(lines: list[str], index: int) -> list[str]:
    """The contiguous comment lines right above line ``index``, without the '#' and indentation."""
    block = []
    i = index - 1
    while i >= 0 and lines[i].lstrip().startswith("#"):
        block.insert(0, lines[i].lstrip()[1:].strip())
        i -= 1
    return block


def assert_documented(block: list[str], where: str) -> None:
    starts = [line.split(":", 1)[0] for line in block]
    for field in ("what", "why", "source"):
        assert any(s == field or s.startswith(field + " ") for s in starts), f"{where}: no '{field}:' line in {block}"


# ----------------------------------------------------------------------------------------------- documentation


@pytest.mark.parametrize("kind", sorted(YAMLS))
def test_every_runtime_env_variable_is_documented(kind):
    lines = YAMLS[kind].read_text().splitlines()
    names = env_vars(kind)
    assert names, kind
    for name in names:
        (index,) = [i for i, line in enumerate(lines) if re.match(rf"^\s+{name}:", line)]
        assert_documented(comment_block(lines, index), f"{YAMLS[kind].name}:{name}")
        assert f"`{name}`" in DOC, f"{name} is not in docs/launch-scripts.md"


@pytest.mark.parametrize("kind", sorted(YAMLS))
def test_runtime_env_values_are_strings_and_shapes_match(kind):
    data = yaml.safe_load(YAMLS[kind].read_text())
    # Ray rejects non-string env_vars values; an unquoted 1800 in YAML is an int
    assert all(isinstance(v, str) for v in data["env_vars"].values()), data["env_vars"]
    npu = yaml.safe_load(YAMLS["npu"].read_text())
    assert sorted(data) == sorted(npu) == ["env_vars", "excludes", "working_dir"]
    assert data["working_dir"] == "." and data["excludes"] == npu["excludes"]
    assert {"/.git/", "/.venv/", "/runs/"} <= set(data["excludes"])


@pytest.mark.parametrize("kind", sorted(PROFILES))
def test_every_profile_export_and_source_is_documented(kind):
    lines = PROFILES[kind].read_text().splitlines()
    exports = [(i, m[1]) for i, line in enumerate(lines) if (m := re.match(r"^\s*export\s+([A-Z_][A-Z0-9_]*)=", line))]
    assert exports, kind
    for index, name in exports:
        assert_documented(comment_block(lines, index), f"{PROFILES[kind].name}:{name}")
        assert f"`{name}`" in DOC, f"{name} is not in docs/launch-scripts.md"


# ----------------------------------------------------------------------------------------------- sourcing


def fake_ascend_root(tmp_path: Path) -> Path:
    """/usr/local/Ascend with the recorded set_env.sh scripts (exports only), as the doctor tests use."""
    root = tmp_path / "Ascend"
    (root / "ascend-toolkit").mkdir(parents=True, exist_ok=True)
    (root / "nnal/atb").mkdir(parents=True, exist_ok=True)
    shutil.copy(FIXTURES / "set_env.sh", root / "ascend-toolkit/set_env.sh")
    shutil.copy(FIXTURES / "atb_set_env.sh", root / "nnal/atb/set_env.sh")
    return root


def source(profile: Path, env: dict, tail: str = "") -> subprocess.CompletedProcess:
    """Source a profile the way the launcher does (set -euo pipefail), then print the environment."""
    script = f'set -euo pipefail\nsource "{profile}"\n{tail}\nenv -0'
    return subprocess.run(["bash", "-c", script], capture_output=True, env=env, timeout=60)


def parse_env(raw: bytes) -> dict[str, str]:
    pairs = (item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)
    return dict(pairs)


BASE = {"PATH": "/usr/bin:/bin", "HOME": "/tmp"}  # no LD_LIBRARY_PATH: ATB's set_env.sh reads it unset


def sourced_npu(tmp_path: Path, **extra: str) -> dict[str, str]:
    proc = source(PROFILES["npu"], {**BASE, "ASCEND_ROOT": str(fake_ascend_root(tmp_path)), "NIC": "lo", **extra})
    assert proc.returncode == 0, proc.stderr.decode()
    return parse_env(proc.stdout)


def test_npu_profile_sources_cann_and_atb_and_sets_the_nic(tmp_path):
    inputs = {**BASE, "ASCEND_ROOT": str(fake_ascend_root(tmp_path)), "NIC": "lo"}
    after = sourced_npu(tmp_path)
    added = {k: v for k, v in after.items() if inputs.get(k) != v and k not in ("_", "SHLVL", "PWD", "OLDPWD")}
    assert added["ASCEND_HOME_PATH"] == "/usr/local/Ascend/ascend-toolkit/latest"  # from the recorded set_env.sh
    assert added["ATB_HOME_PATH"].endswith("atb/cxx_abi_1") and "LD_LIBRARY_PATH" in added
    assert added["HCCL_SOCKET_IFNAME"] == "=lo" and added["GLOO_SOCKET_IFNAME"] == "lo"
    assert "HCCL_OP_EXPANSION_MODE" not in after and "HCCL_INTRA_ROCE_ENABLE" not in after
    # a variable set by a sourced vendor script is named in the profile's comments and in the docs; every
    # `source` statement follows a what / why / source block
    lines = PROFILES["npu"].read_text().splitlines()
    comments = " ".join(line for line in lines if line.lstrip().startswith("#"))
    exported = {m[1] for line in lines if (m := re.match(r"^\s*export\s+([A-Z_][A-Z0-9_]*)=", line))}
    for name in set(added) - exported:
        assert name in comments, f"{name} is set by a sourced script but not named in the profile's comments"
        assert name == "LD_LIBRARY_PATH" or f"`{name}`" in DOC, f"{name} is not in docs/launch-scripts.md"
    sourcing = [i for i, line in enumerate(lines) if re.match(r"^\s*source\s", line)]
    assert len(sourcing) == 2
    for index in sourcing:
        recent = [line.strip() for line in lines[max(index - 12, 0) : index]]
        block_start = max(i for i, line in enumerate(recent) if line.startswith("# what:"))
        assert_documented([line[1:].strip() for line in recent[block_start:] if line.startswith("#")], lines[index])


def test_gpu_profile_sets_the_counterparts(tmp_path):
    proc = source(PROFILES["gpu"], {**BASE, "NIC": "lo"})
    assert proc.returncode == 0, proc.stderr.decode()
    after = parse_env(proc.stdout)
    assert after["NCCL_SOCKET_IFNAME"] == "=lo" and after["GLOO_SOCKET_IFNAME"] == "lo"
    assert not [k for k in after if ASCEND_ONLY.match(k)]


@pytest.mark.parametrize("kind", sorted(PROFILES))
def test_profiles_keep_the_callers_shell_options(kind, tmp_path):
    env = {**BASE, "ASCEND_ROOT": str(fake_ascend_root(tmp_path)), "NIC": "lo"}
    proc = source(PROFILES[kind], env, tail='[[ $- == *u* ]] && echo NOUNSET-KEPT >&2; echo "$NO_SUCH_VAR"')
    assert proc.returncode != 0  # set -u is still on after sourcing: the unset variable is an error
    assert b"NOUNSET-KEPT" in proc.stderr and b"NO_SUCH_VAR: unbound variable" in proc.stderr
    leftovers = subprocess.run(
        ["bash", "-c", f'source "{PROFILES[kind]}"; declare -F | grep -c _gspo_; compgen -v | grep -c _gspo_'],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert leftovers.stdout.split() == ["0", "0"]  # no helper function or variable left in the caller's shell


@pytest.mark.parametrize(
    "kind, extra, fragment",
    [
        ("npu", {"NIC": "nosuchnic0"}, "NIC=nosuchnic0 is not a network interface"),
        ("gpu", {"NIC": "nosuchnic0"}, "NIC=nosuchnic0 is not a network interface"),
        ("npu", {"ASCEND_ROOT": "/nonexistent"}, "no CANN set_env.sh under /nonexistent (set ASCEND_ROOT)"),
    ],
)
def test_profiles_refuse_a_broken_host(kind, extra, fragment, tmp_path):
    env = {**BASE, "ASCEND_ROOT": str(fake_ascend_root(tmp_path)), **extra}
    proc = source(PROFILES[kind], env)
    assert proc.returncode != 0 and fragment in proc.stderr.decode()


# ----------------------------------------------------------------------------------------------- allowed values


def npu_runs() -> list[tuple[str, config.Config]]:
    """The situations the NPU scripts create: trainer.device=npu, their node counts, vLLM rollout."""
    runs = []
    for name, model, nnodes in (("qwen3_30b_a3b_gspo", "qwen3-30b-a3b", 2), ("qwen25_3b_gspo", "qwen2.5-3b", 1)):
        overrides = ["trainer.device=npu", f"trainer.nnodes={nnodes}", f"model.path=tests/fixtures/models/{model}"]
        runs.append((name, config.load_config(REPO / f"configs/{name}.yaml", overrides)))
    return runs


def npu_environment(tmp_path: Path) -> dict[str, str]:
    return {**sourced_npu(tmp_path), **env_vars("npu")}


def test_npu_set_passes_every_doctor_env_rule(tmp_path):
    env = npu_environment(tmp_path)
    runs = npu_runs()
    assert {situation(SimpleNamespace(config=cfg)).multi_node for _, cfg in runs} == {True, False}
    for name, cfg in runs:
        s = situation(SimpleNamespace(config=cfg))
        assert s.vllm and not s.graph_mode, name  # vLLM rollout, eager on NPU
        problems = {rule.name: rule.problem(env, s) for rule in ENV_RULES}
        assert {k: v for k, v in problems.items() if v} == {}, name
    # the rules are not vacuous here: the doctor flags what this set avoids
    multi = situation(SimpleNamespace(config=runs[0][1]))
    bad = {
        "TASK_QUEUE_ENABLE": {**env, "TASK_QUEUE_ENABLE": "1"},
        "VLLM_ASCEND_ENABLE_NZ": {k: v for k, v in env.items() if k != "VLLM_ASCEND_ENABLE_NZ"},
        "HCCL_CONNECT_TIMEOUT": {**env, "HCCL_CONNECT_TIMEOUT": "120"},
        "HCCL_OP_EXPANSION_MODE": {**env, "HCCL_OP_EXPANSION_MODE": "AIV"},
        "HCCL_INTRA_ROCE_ENABLE": {**env, "HCCL_INTRA_ROCE_ENABLE": "1"},
        "PYTORCH_ALLOC_CONF": {**env, "PYTORCH_ALLOC_CONF": "max_split_size_mb:64"},
        "HCCL_SOCKET_IFNAME": {k: v for k, v in env.items() if k != "HCCL_SOCKET_IFNAME"},
        "HCCL_ASYNC_ERROR_HANDLING": {**env, "TORCH_HCCL_ASYNC_ERROR_HANDLING": "1"},
    }
    for rule in ENV_RULES:
        assert rule.problem(bad[rule.name], multi), rule.name


def test_npu_set_avoids_what_the_a2_does_not_support(tmp_path):
    env = npu_environment(tmp_path)
    assert "HCCL_INTRA_ROCE_ENABLE" not in env  # 200T A2 Box16 / 300T Pro only
    assert env.get("HCCL_OP_EXPANSION_MODE", "HOST") != "AIV"  # AIV is inference-only on A2
    assert int(env["HCCL_EXEC_TIMEOUT"]) >= int(env["HCCL_CONNECT_TIMEOUT"]) >= 1800
    # CANN: on A2 the socket port ranges and MC2 fused operators exclude each other
    assert env["HCCL_HOST_SOCKET_PORT_RANGE"] == "auto" and env["VLLM_ASCEND_ENABLE_MATMUL_ALLREDUCE"] == "0"
    assert "expandable_segments:True" not in env["PYTORCH_NPU_ALLOC_CONF"]  # vllm-ascend sleep mode asserts on it


def test_no_variable_of_the_other_vendor(tmp_path):
    npu = npu_environment(tmp_path)
    assert not [k for k in npu if CUDA_ONLY.match(k)]
    for kind in ("gpu", "cpu"):
        assert not [k for k in env_vars(kind) if ASCEND_ONLY.match(k)], kind
    gpu = env_vars("gpu")
    assert gpu["PYTORCH_CUDA_ALLOC_CONF"] == env_vars("npu")["PYTORCH_NPU_ALLOC_CONF"]  # one policy, two names


def test_noset_variables_follow_how_workers_pick_their_device():
    """Ray's per-actor device visibility and the workers' device choice must change together: with one device
    made visible per actor the workers use device 0 and NOSET must be 0; with NOSET=1 every actor sees the whole
    node and must pick its device by local rank. A mismatch puts every rank of a node on one device, which no
    CPU test would otherwise notice."""
    from gspo_ascend.device import CUDA, NPU

    uses_device_0 = "set_device(0)" in (REPO / "gspo_ascend/workers.py").read_text()
    for kind, backend in (("npu", NPU), ("gpu", CUDA)):
        value = env_vars(kind)[backend.ray_noset_visible_env]
        assert value == ("0" if uses_device_0 else "1"), (kind, value)


def test_situation_rules_see_graph_mode_only_when_asked():
    # the runtime env assumes eager vLLM on NPU (enforce_eager null); graph mode would need TASK_QUEUE_ENABLE=1
    cfg = npu_runs()[0][1]
    cfg.rollout.enforce_eager = False
    s = situation(SimpleNamespace(config=cfg))
    assert s == Situation(True, True, True)
    (rule,) = [r for r in ENV_RULES if r.name == "TASK_QUEUE_ENABLE"]
    assert rule.problem(env_vars("npu"), s)  # so the shipped env is eager-only, as documented
