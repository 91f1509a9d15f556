"""The environment our NPU runtime profile sets, held to the pinned wheels that read it (issue #14).

Every variable in ``env/npu/mc2_env.yaml`` (the Ray runtime_env of NPU jobs) and every ``export`` of
``env/npu/atlas_800t_a2.sh`` must be read by something of the pinned stack:
* ``VLLM_ASCEND_*``: a key of vllm-ascend 0.11.0's ``vllm_ascend/envs.py``;
* other ``VLLM_*``: a key of vLLM 0.11.0's ``vllm/envs.py``;
* the rest: read by torch-npu 2.7.1 (its name in ``libtorch_npu.so`` or its Python), or one of the variables of
  the CANN runtime / Ray / gloo listed below with where they are documented (CANN is not on a package
  registry, so those cannot be checked here; the list makes a new one a deliberate choice, not a typo).
The values that matter to RL are checked against the code that reads them.
"""

from __future__ import annotations

import ast
import re
from functools import cache

import yaml

from tests.conftest import REPO

from .upstream import upstream_file, wheel_root

# Read by the CANN runtime (HCCL / ACL, documented in CANN's environment-variable reference), Ray or gloo.
NOT_IN_THE_WHEELS = {
    "HCCL_SOCKET_IFNAME": "CANN envref (HCCL NIC selection)",
    "HCCL_HOST_SOCKET_PORT_RANGE": "CANN envref",
    "HCCL_NPU_SOCKET_PORT_RANGE": "CANN envref",
    "GLOO_SOCKET_IFNAME": "torch.distributed gloo",
    "RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES": "Ray (ray/_private/accelerators/npu.py)",
}


@cache
def profile_vars() -> dict[str, str]:
    env = yaml.safe_load((REPO / "env/npu/mc2_env.yaml").read_text())["env_vars"]
    exports = re.findall(r"^\s*export\s+([A-Z_][A-Z0-9_]*)=", (REPO / "env/npu/atlas_800t_a2.sh").read_text(), re.M)
    return {**{k: str(v) for k, v in env.items()}, **{name: "" for name in exports if name not in env}}


def _env_keys(relpath: str, dist: str, dict_name: str) -> set[str]:
    tree = ast.parse(upstream_file(dist, relpath).read_text())
    for node in ast.walk(tree):
        target = (
            node.target
            if isinstance(node, ast.AnnAssign)
            else (node.targets[0] if isinstance(node, ast.Assign) else None)
        )
        if getattr(target, "id", None) == dict_name and isinstance(node.value, ast.Dict):
            return {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
    raise AssertionError(f"{dist}: no {dict_name} dict in {relpath}")


@cache
def torch_npu_reads(name: str) -> bool:
    root = wheel_root("torch-npu") / "torch_npu"
    if name.encode() in (root / "lib" / "libtorch_npu.so").read_bytes():
        return True
    return any(name in p.read_text(errors="ignore") for p in root.rglob("*.py"))


def test_every_profile_variable_is_read_by_the_pinned_stack():
    ascend = _env_keys("vllm_ascend/envs.py", "vllm-ascend", "env_variables")
    vllm = _env_keys("vllm/envs.py", "vllm", "environment_variables")
    unread = []
    for name in profile_vars():
        if name.startswith("VLLM_ASCEND_"):
            ok = name in ascend
        elif name.startswith("VLLM_"):
            ok = name in vllm
        else:
            ok = name in NOT_IN_THE_WHEELS or torch_npu_reads(name)
        if not ok:
            unread.append(name)
    assert not unread, f"set by env/npu but read by nothing of the pinned stack: {unread}"


def test_nz_off_is_what_vllm_ascend_needs_for_rl():
    """vllm-ascend 0.11.0 defaults VLLM_ASCEND_ENABLE_NZ to 1 and its NPUWorker.wake_up refuses to run with it on."""
    envs = upstream_file("vllm-ascend", "vllm_ascend/envs.py").read_text()
    assert 'os.getenv("VLLM_ASCEND_ENABLE_NZ", 1)' in envs
    worker = upstream_file("vllm-ascend", "vllm_ascend/worker/worker_v1.py").read_text()
    assert "Please set VLLM_ASCEND_ENABLE_NZ=0" in worker
    assert profile_vars()["VLLM_ASCEND_ENABLE_NZ"] == "0"


def test_allocator_conf_is_what_sleep_mode_accepts():
    """vllm-ascend's sleep-mode allocator asserts no expandable_segments in PYTORCH_NPU_ALLOC_CONF (camem.py)."""
    camem = upstream_file("vllm-ascend", "vllm_ascend/device_allocator/camem.py").read_text()
    assert 'os.environ.get("PYTORCH_NPU_ALLOC_CONF", "")' in camem and '"expandable_segments:True" not in conf' in camem
    assert "expandable_segments:True" not in profile_vars()["PYTORCH_NPU_ALLOC_CONF"]
    # torch_npu 2.7.1 reads the NPU name; the generic PYTORCH_ALLOC_CONF appears nowhere in it
    assert torch_npu_reads("PYTORCH_NPU_ALLOC_CONF") and not torch_npu_reads("PYTORCH_ALLOC_CONF")
