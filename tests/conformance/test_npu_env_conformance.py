"""The environment our NPU runtime profile sets, held to the pinned wheels that read it (issue #14).

Every variable in ``env/npu/mc2_env.yaml`` (the Ray runtime_env of NPU jobs) and every ``export`` of
``env/npu/atlas_800t_a2.sh`` must be read by something of the pinned stack:
* ``VLLM_ASCEND_*``: a key of vllm-ascend 0.23.0's ``vllm_ascend/envs.py``;
* other ``VLLM_*``: a key of vLLM 0.23.0's ``vllm/envs.py``;
* the rest: read by torch-npu 2.10.0.post4 (:func:`torch_npu_reader`: a read site in its Python, or a C++ reader of
  :data:`CXX_READERS`), or one of the variables of the CANN runtime / Ray / gloo listed below with where they
  are documented (CANN is not on a package registry, so those cannot be checked here; the list makes a new one
  a deliberate choice, not a typo).
The values that matter to RL are checked against the code that reads them.
"""

from __future__ import annotations

import ast
import re
import types
import warnings
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
    "LD_PRELOAD": "glibc's dynamic loader, ld.so(8) (jemalloc, env/npu/atlas_800t_a2.sh)",
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


# Variables torch_npu reads only in its C++ (libtorch_npu.so; the .cpp is not in the wheel): the reader its shipped
# headers declare, and where the variable is documented. Checked: the header declares the reader and the library
# holds the name as a C string of its own (what getenv is called with), not only inside a longer message.
CXX_READERS = {
    "TASK_QUEUE_ENABLE": (
        "torch_npu/csrc/core/npu/register/OptionsManager.h",
        "GetTaskQueueEnable",
        "../shared/reference/npu_api.md section 5 (TASK_QUEUE_ENABLE 0 / 1 / 2; Ascend torch_npu env reference)",
    ),
    "HCCL_CONNECT_TIMEOUT": (
        "torch_npu/csrc/core/npu/register/OptionsManager.h",
        "GetHCCLConnectTimeout",
        "../shared/reference/npu_api.md HCCL table (CANN environment-variable reference)",
    ),
    "HCCL_EXEC_TIMEOUT": (
        "torch_npu/csrc/core/npu/register/OptionsManager.h",
        "GetHCCLExecTimeout",
        "../shared/reference/npu_api.md HCCL table (CANN environment-variable reference)",
    ),
    "CPU_AFFINITY_CONF": (
        "torch_npu/csrc/core/npu/register/OptionsManager.h",
        "GetCpuAffinityConf",
        "../shared/reference/npu_api.md section 5 (CPU_AFFINITY_CONF 0 / 1 / 2; Ascend torch_npu env reference)",
    ),
    "MULTI_STREAM_MEMORY_REUSE": (
        "torch_npu/csrc/core/npu/register/OptionsManager.h",
        "GetMultiStreamMemoryReuse",
        "../shared/reference/npu_api.md section 5 (verl's NPU GSPO practice guide sets 1)",
    ),
    "HCCL_ASYNC_ERROR_HANDLING": (
        "torch_npu/csrc/distributed/ProcessGroupHCCL.hpp",
        'HCCL_ASYNC_ERROR_HANDLING = "HCCL_ASYNC_ERROR_HANDLING"',
        "../shared/reference/npu_api.md HCCL table (TORCH_HCCL_ASYNC_ERROR_HANDLING, old name)",
    ),
}

_READ_CALLS = ("getenv", "environ.get")  # os.environ.setdefault / assignment write the variable, they do not read it


def _python_reads(tree: ast.Module) -> set[str]:
    """Names read in one module: ``os.getenv(N)``, ``os.environ.get(N)``, ``os.environ[N]`` (load), ``N in
    os.environ``, with N a literal or a module-level ``CONST = "N"``; and the keys of an envs.py-style dict whose
    value reads the environment (``{"N": lambda: os.getenv("N", ...)}``). A name in a docstring is none of these."""
    consts = {
        t.id: n.value.value
        for n in tree.body
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
        for t in n.targets
        if isinstance(t, ast.Name)
    }

    def name_of(expr: ast.AST) -> str | None:
        value = expr.value if isinstance(expr, ast.Constant) else consts.get(getattr(expr, "id", ""))
        return value if isinstance(value, str) else None

    found: set[str | None] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and ast.unparse(node.func).endswith(_READ_CALLS):
            found.add(name_of(node.args[0]))
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            if ast.unparse(node.value).endswith("environ"):
                found.add(name_of(node.slice))
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            if ast.unparse(node.comparators[-1]).endswith("environ"):
                found.add(name_of(node.left))
        elif isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if isinstance(value, ast.Lambda) and _python_reads(ast.Module([ast.Expr(value.body)], [])):
                    found.add(name_of(key) if key is not None else None)
    return {n for n in found if n}


@cache
def _torch_npu_python_reads() -> dict[str, str]:
    """Every name the pinned torch_npu Python reads -> the first file that reads it."""
    root = wheel_root("torch-npu")
    reads: dict[str, str] = {}
    for path in sorted((root / "torch_npu").rglob("*.py")):
        try:
            with warnings.catch_warnings():  # their invalid escape sequences in docstrings are theirs, not ours
                warnings.simplefilter("ignore")
                tree = ast.parse(path.read_text(errors="ignore"))
        except SyntaxError:  # test data / templates in the wheel that are not Python 3.11
            continue
        for name in _python_reads(tree):
            reads.setdefault(name, str(path.relative_to(root)))
    return reads


@cache
def torch_npu_reader(name: str) -> str | None:
    """Where the pinned torch_npu reads ``name`` (a Python file, or a C++ reader of CXX_READERS), or None."""
    if name in _torch_npu_python_reads():
        return _torch_npu_python_reads()[name]
    if name not in CXX_READERS:
        return None
    header, reader, documented = CXX_READERS[name]
    root = wheel_root("torch-npu") / "torch_npu"
    assert reader in (root / "include" / header).read_text(), f"the pinned torch-npu's {header} declares no {reader}"
    library = (root / "lib" / "libtorch_npu.so").read_bytes()
    assert b"\0" + name.encode() + b"\0" in library, f"libtorch_npu.so holds no C string {name}"
    return f"{header} {reader} (C++; documented in {documented})"


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
            ok = name in NOT_IN_THE_WHEELS or torch_npu_reader(name) is not None
        if not ok:
            unread.append(name)
    assert not unread, f"set by env/npu but read by nothing of the pinned stack: {unread}"


def _method(relpath: str, cls: str, name: str) -> ast.FunctionDef:
    tree = ast.parse(upstream_file("vllm-ascend", relpath).read_text())
    owner = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    return next(n for n in owner.body if isinstance(n, ast.FunctionDef) and n.name == name)


def _nz_mode(additional_config: dict, environ: dict[str, str]) -> object:
    """AscendConfig.weight_nz_mode as vllm-ascend 0.23.0 computes it (ascend_config.py:249-254), by running its
    own ``_get_config_value`` (:354-365) with the env default its envs.py gives (:92)."""
    fn = _method("vllm_ascend/ascend_config.py", "AscendConfig", "_get_config_value")
    fn.decorator_list = []
    namespace: dict = {"os": types.SimpleNamespace(environ=environ), "Any": object}
    namespace["logger"] = types.SimpleNamespace(info_once=lambda *a, **k: None)
    exec(compile(ast.Module([fn], []), "ascend_config.py", "exec"), namespace)
    env_value = int(environ.get("VLLM_ASCEND_ENABLE_NZ", 1))  # envs.py: int(os.getenv("VLLM_ASCEND_ENABLE_NZ", 1))
    return namespace["_get_config_value"](additional_config, "weight_nz_mode", "VLLM_ASCEND_ENABLE_NZ", env_value)


def test_nz_off_is_what_vllm_ascend_needs_for_rl():
    """vllm-ascend 0.23.0 defaults NZ to 1 (envs.py:92) and refuses weight updates with it on, twice:
    ``NPUWorker.wake_up`` raises when ``AscendConfig.weight_nz_mode`` is non-zero (worker.py:241-247; the mode is
    ``additional_config["weight_nz_mode"]``, else the variable: ascend_config.py:249-254), and its weight-update
    path's ``_check_nz_disabled`` reads the *variable* (worker.py:295-301). Our VLLM_ASCEND_ENABLE_NZ=0 (env/npu
    and the engine's default, vllm_env.platform_env_defaults) with no additional_config satisfies both."""
    envs = upstream_file("vllm-ascend", "vllm_ascend/envs.py").read_text()
    assert 'int(os.getenv("VLLM_ASCEND_ENABLE_NZ", 1))' in envs
    config = ast.unparse(_method("vllm_ascend/ascend_config.py", "AscendConfig", "__init__"))
    assert re.search(r"self\.weight_nz_mode = self\._get_config_value\(additional_config, 'weight_nz_mode', "
                     r"'VLLM_ASCEND_ENABLE_NZ', ascend_envs\.VLLM_ASCEND_ENABLE_NZ\)", config)  # fmt: skip
    wake_up = ast.unparse(_method("vllm_ascend/worker/worker.py", "NPUWorker", "wake_up"))
    assert re.search(
        r"^    nz_mode = get_ascend_config\(\)\.weight_nz_mode\n    if nz_mode:\n        raise ValueError\(",
        wake_up,
        re.M,
    )
    check = ast.unparse(_method("vllm_ascend/worker/worker.py", "NPUWorker", "_check_nz_disabled"))
    assert re.search(r"^    if envs_ascend\.VLLM_ASCEND_ENABLE_NZ:\n        raise ValueError\(", check, re.M)
    # the upstream rule, run: unset -> 1 (refused); the variable at 0 -> 0; additional_config wins over it
    assert _nz_mode({}, {}) == 1 and _nz_mode({}, {"VLLM_ASCEND_ENABLE_NZ": "0"}) == 0
    assert _nz_mode({"weight_nz_mode": 2}, {"VLLM_ASCEND_ENABLE_NZ": "0"}) == 2
    # ours: the profile and the engine set the variable to 0 ...
    assert profile_vars()["VLLM_ASCEND_ENABLE_NZ"] == "0"
    assert _engine_env()["VLLM_ASCEND_ENABLE_NZ"] == "0"
    assert _nz_mode({}, {"VLLM_ASCEND_ENABLE_NZ": _engine_env()["VLLM_ASCEND_ENABLE_NZ"]}) == 0
    # ... and the engine passes no additional_config that could turn weight_nz_mode back on
    llm_kwargs = (REPO / "gspo_ascend/engines/vllm_rollout.py").read_text()
    assert "additional_config" not in llm_kwargs and "weight_nz_mode" not in llm_kwargs


def _engine_env() -> dict[str, str]:
    from gspo_ascend.config import load_config
    from gspo_ascend.device import NPU
    from gspo_ascend.engines import vllm_env

    cfg = load_config(overrides=["rollout.engine=vllm"], validate=False)
    return vllm_env.platform_env_defaults(NPU, cfg, {})  # the real NPU backend (no host KV-cache sizing)


def test_allocator_conf_is_what_sleep_mode_accepts():
    """vllm-ascend's sleep-mode allocator asserts no expandable_segments in PYTORCH_NPU_ALLOC_CONF (camem.py)."""
    camem = upstream_file("vllm-ascend", "vllm_ascend/device_allocator/camem.py").read_text()
    assert 'os.environ.get("PYTORCH_NPU_ALLOC_CONF", "")' in camem and '"expandable_segments:True" not in conf' in camem
    assert "expandable_segments:True" not in profile_vars()["PYTORCH_NPU_ALLOC_CONF"]
    # the pinned torch_npu reads the NPU name (its Python too: the profiler records it); the generic one it never reads
    assert torch_npu_reader("PYTORCH_NPU_ALLOC_CONF") and torch_npu_reader("PYTORCH_ALLOC_CONF") is None


def test_a_docstring_mention_is_not_a_read():
    """``TORCH_NPU_WARN_ONCE`` appears in the pinned torch_npu only in a docstring (testing/testcase.py): a substring
    search of the wheel finds it, the reader rule must not (issue #25 item 6)."""
    root = wheel_root("torch-npu") / "torch_npu"
    assert "TORCH_NPU_WARN_ONCE" in (root / "testing" / "testcase.py").read_text()
    assert torch_npu_reader("TORCH_NPU_WARN_ONCE") is None
    docstring = ast.parse('def f():\n    """Set TORCH_NPU_WARN_ONCE=1."""\n    return os.getenv("TORCH_NPU_LOGS")\n')
    assert _python_reads(docstring) == {"TORCH_NPU_LOGS"}
