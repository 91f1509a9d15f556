"""The NPU performance profile (gspo_ascend/npu_profile.py SETTINGS, issue #26) held to the pinned wheels.

One test per setting of verl's NPU GSPO practice guide: the pinned torch-npu 2.10.0.post4 / vllm-ascend 0.23.0 /
vLLM 0.23.0 reads the name (and takes the value we set), or the setting is left out / opt-in and the test holds the
reason.
Expected values come from the wheels' own files (headers, envs.py, platform.py), parsed here.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from gspo_ascend import npu_profile

from .test_npu_env_conformance import CXX_READERS, NOT_IN_THE_WHEELS, _env_keys, profile_vars, torch_npu_reader
from .upstream import upstream_file, wheel_root

SETTINGS = {s.name: s for s in npu_profile.SETTINGS}
OPTIONS_H = "torch_npu/include/torch_npu/csrc/core/npu/register/OptionsManager.h"


def _ascend_envs() -> set[str]:
    return _env_keys("vllm_ascend/envs.py", "vllm-ascend", "env_variables")


def _ascend_sources() -> dict[str, str]:
    """Every Python file of the pinned vllm_ascend package, by its path in the wheel."""
    root = wheel_root("vllm-ascend")
    return {str(f.relative_to(root)): f.read_text() for f in sorted((root / "vllm_ascend").rglob("*.py"))}


def _library() -> bytes:
    return (wheel_root("torch-npu") / "torch_npu" / "lib" / "libtorch_npu.so").read_bytes()


def test_profile_table_is_what_env_npu_sets():
    """Every setting placed in env/npu is set there to the table's value; every other one is not set there."""
    env = profile_vars()
    for s in npu_profile.SETTINGS:
        if s.where == "env/npu/mc2_env.yaml":
            assert env.get(s.name) == s.value, s.name
        elif s.where in ("opt-in", "left out"):
            assert s.name not in env, f"{s.name} is {s.where} but env/npu sets it"


def test_multi_stream_memory_reuse_is_left_at_torch_npus_default():
    """verl's guide sets 1, torch_npu's default (ERASE_RECORD_STREAM, OptionsManager.cpp per audit 3 section 4; the
    .cpp is not in the wheel): left out, and 1 is the mode the header names ERASE_RECORD_STREAM."""
    assert SETTINGS["MULTI_STREAM_MEMORY_REUSE"].where == "left out"
    assert "MULTI_STREAM_MEMORY_REUSE" not in profile_vars()
    assert "GetMultiStreamMemoryReuse" in CXX_READERS["MULTI_STREAM_MEMORY_REUSE"][1]
    assert torch_npu_reader("MULTI_STREAM_MEMORY_REUSE")  # header declares the reader, the .so holds the name
    header = upstream_file("torch-npu", OPTIONS_H).read_text()
    enum = re.search(r"enum ReuseMode \{([^}]*)\}", header)[1]
    modes = {int(v): k for k, v in re.findall(r"(\w+)\s*=\s*(\d+)", enum)}
    assert modes[int(SETTINGS["MULTI_STREAM_MEMORY_REUSE"].value)] == "ERASE_RECORD_STREAM"


def test_cpu_affinity_conf_is_read_and_each_actor_gets_its_npus_range():
    assert torch_npu_reader("CPU_AFFINITY_CONF")
    header = upstream_file("torch-npu", OPTIONS_H).read_text()
    assert "static char* GetCpuAffinityConf();" in header
    assert b"parseCPUAffinityConf" in _library() and profile_vars()["CPU_AFFINITY_CONF"] == "1"
    # the npuN:a-b form actor_cpu_affinity writes is parsed by the pinned library (its messages for that form)
    assert b"core range is %s-%s, should be all digits" in _library()
    # 2.10.0.post4 reworded the success message (2.7.1: "... user-defined range %d-%d success.")
    assert b"Set thread affinity to user-defined range %s success." in _library()
    # a host whose driver lacks the DCMI affinity query loses the binding, not the run
    assert b"The npu_affine configuration of CPU_AFFINITY_CONF will be disabled." in _library()


def test_task_queue_enable_is_read_and_graph_mode_is_refused_without_1():
    assert torch_npu_reader("TASK_QUEUE_ENABLE")
    assert profile_vars()["TASK_QUEUE_ENABLE"] == "2"  # eager, the NPU default; graph mode needs the job to say 1
    from gspo_ascend.config import load_config

    cfg = load_config(overrides=["rollout.engine=vllm", "rollout.enforce_eager=false"], validate=False)
    (problem,) = npu_profile.environment_problems(
        cfg, "npu", {"TASK_QUEUE_ENABLE": profile_vars()["TASK_QUEUE_ENABLE"]}
    )
    assert "needs TASK_QUEUE_ENABLE=1" in problem


def test_ld_preload_is_the_loaders_not_a_wheels():
    """jemalloc is preloaded by glibc's loader: nothing of the stack reads LD_PRELOAD, the allowlist says who does."""
    assert "LD_PRELOAD" in NOT_IN_THE_WHEELS and torch_npu_reader("LD_PRELOAD") is None
    assert all(p.endswith("/libjemalloc.so.2") for p in npu_profile.JEMALLOC_PATHS)


def test_aiv_is_left_out_and_vllm_ascend_reads_it_only_on_the_a5():
    """HCCL_OP_EXPANSION_MODE is CANN's (torch_npu never reads it). vllm-ascend 0.11.0 read it to size its ACL graph
    capture list (utils.py update_aclgraph_sizes); 0.23.0 reads it only in A5DeviceAdaptor.npu_mm_reduce_scatter_base
    (device/device_op.py:1283, CCU_SCHED -> comm_mode "ccu"; the Ascend 950, not our A2), and sets it to AIV for
    MiniMax-M2 only (patch/platform/patch_minimax_m2_config.py:118-121). Left out of env/npu (reason in SETTINGS)."""
    assert SETTINGS["HCCL_OP_EXPANSION_MODE"].where == "left out" and "1091" in SETTINGS["HCCL_OP_EXPANSION_MODE"].why
    assert torch_npu_reader("HCCL_OP_EXPANSION_MODE") is None
    sources = _ascend_sources()
    reads = {path for path, text in sources.items() if re.search(r"environ\.get\(\"HCCL_OP_EXPANSION_MODE\"\)", text)}
    assert reads == {"vllm_ascend/device/device_op.py", "vllm_ascend/patch/platform/patch_minimax_m2_config.py"}
    device_op = sources["vllm_ascend/device/device_op.py"]
    tree = ast.parse(device_op)
    (reader,) = [
        (cls.name, fn.name)
        for cls in tree.body
        if isinstance(cls, ast.ClassDef)
        for fn in cls.body
        if isinstance(fn, ast.FunctionDef) and "HCCL_OP_EXPANSION_MODE" in ast.get_source_segment(device_op, fn)
    ]
    assert reader == ("A5DeviceAdaptor", "npu_mm_reduce_scatter_base")
    assert 'if expansion_mode == "CCU_SCHED":' in device_op
    assert "update_aclgraph_sizes" not in sources["vllm_ascend/utils.py"]
    assert "A5DeviceAdaptor" in SETTINGS["HCCL_OP_EXPANSION_MODE"].reader
    assert "HCCL_OP_EXPANSION_MODE" not in profile_vars()


def test_flashcomm1_is_in_0_23_0_and_verls_flashcomm_spelling_is_read_by_nothing():
    keys = _ascend_envs()
    assert "VLLM_ASCEND_ENABLE_FLASHCOMM1" in keys and SETTINGS["VLLM_ASCEND_ENABLE_FLASHCOMM1"].where == "opt-in"
    assert "VLLM_ASCEND_ENABLE_FLASHCOMM1" not in profile_vars()
    # the guide's VLLM_ASCEND_ENABLE_FLASHCOMM: not a key of 0.23.0's envs.py, and (unlike 0.11.0's utils.py, which
    # kept it for backward compatibility) read by no file of the package
    assert "VLLM_ASCEND_ENABLE_FLASHCOMM" not in keys
    legacy = re.compile(r"VLLM_ASCEND_ENABLE_FLASHCOMM(?![0-9A-Z_])")
    assert [path for path, text in _ascend_sources().items() if legacy.search(text)] == []
    assert "read by nothing of 0.23.0" in SETTINGS["VLLM_ASCEND_ENABLE_FLASHCOMM1"].why


def test_dense_optimize_and_prefetch_mlp_are_gone_and_left_out():
    """vllm-ascend 0.23.0 dropped both switches: no key of envs.py, no file of the package names them. Its MLP weight
    prefetch is additional_config["weight_prefetch_config"] (ascend_config.py:52-53, WeightPrefetchConfig 704-720),
    which our engine does not pass; so they are left out, and setting them is no coupling of ours any more."""
    keys = _ascend_envs()
    sources = _ascend_sources()
    for name in ("VLLM_ASCEND_ENABLE_DENSE_OPTIMIZE", "VLLM_ASCEND_ENABLE_PREFETCH_MLP"):
        assert name not in keys and SETTINGS[name].where == "left out", name
        assert [path for path, text in sources.items() if name in text] == [], name
        assert name not in profile_vars()
    config = sources["vllm_ascend/ascend_config.py"]
    assert 'weight_prefetch_config = additional_config.get("weight_prefetch_config", {})' in config
    from gspo_ascend.engines import vllm_rollout

    assert "additional_config" not in Path(vllm_rollout.__file__).read_text()
    from gspo_ascend.config import load_config

    cfg = load_config(overrides=["rollout.engine=vllm"], validate=False)
    env = {"VLLM_ASCEND_ENABLE_PREFETCH_MLP": "1", "VLLM_ASCEND_ENABLE_DENSE_OPTIMIZE": "0"}
    assert npu_profile.environment_problems(cfg, "npu", env) == []


def test_flashcomm1_with_graphs_keeps_only_multiples_of_tp():
    platform = upstream_file("vllm-ascend", "vllm_ascend/platform.py").read_text()
    assert "update_sizes_for_sequence_parallelism(original_sizes)" in platform and "enable_sp(vllm_config)" in platform
    # FLASHCOMM1 turns enable_sp on: AscendConfig.enable_flashcomm1 is additional_config["enable_flashcomm1"] (which
    # our engine does not pass), else the variable (ascend_config.py:84-89, _get_config_value 354-365); enable_sp
    # returns it (utils.py:909-929)
    utils = upstream_file("vllm-ascend", "vllm_ascend/utils.py").read_text()
    assert "_ENABLE_SP = get_ascend_config().enable_flashcomm1" in utils
    assert "_ENABLE_SP = envs_ascend.VLLM_ASCEND_ENABLE_FLASHCOMM1" in utils
    config = upstream_file("vllm-ascend", "vllm_ascend/ascend_config.py").read_text()
    assert re.search(r'self\.enable_flashcomm1 = self\._get_config_value\(\s*additional_config,\s*"enable_flashcomm1",'
                     r'\s*"VLLM_ASCEND_ENABLE_FLASHCOMM1",\s*ascend_envs\.VLLM_ASCEND_ENABLE_FLASHCOMM1,',
                     config)  # fmt: skip
    assert "if env_key in os.environ:" in config and "return env_value" in config
    from gspo_ascend.config import load_config

    over = ["rollout.engine=vllm", "rollout.enforce_eager=false", "rollout.tensor_parallel_size=2"]
    over += ["trainer.devices_per_node=2", "rollout.cudagraph_capture_sizes=[4,6,7]"]
    cfg = load_config(overrides=over, validate=False)
    env = {"VLLM_ASCEND_ENABLE_FLASHCOMM1": "1", "TASK_QUEUE_ENABLE": "1"}
    (problem,) = npu_profile.environment_problems(cfg, "npu", env)
    assert "[7]" in problem and "multiples of rollout TP 2" in problem


def _graph_mode_values() -> dict[str, tuple[int, ...]]:
    """vLLM 0.23.0's CUDAGraphMode members (config/compilation.py:53-63) as the tuple of their routine modes."""
    compilation = upstream_file("vllm", "vllm/config/compilation.py").read_text()
    cls = next(n for n in ast.walk(ast.parse(compilation)) if getattr(n, "name", "") == "CUDAGraphMode")
    values: dict[str, tuple[int, ...]] = {}
    for node in cls.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            v = node.value
            parts = v.elts if isinstance(v, ast.Tuple) else [v]
            values[node.targets[0].id] = tuple(
                p.value if isinstance(p, ast.Constant) else values[p.id][0] for p in parts
            )
    return values


def test_graph_modes_are_those_vllm_ascend_runs():
    """NPU_GRAPH_MODES = the CUDAGraphMode members vllm-ascend 0.23.0's check_and_update_config runs as themselves
    (platform.py:593-640): NONE is eager; a mode that requires_piecewise_compilation() or has_full_cudagraphs() keeps
    its branch; any other would fall back to NONE. The two predicates are vLLM 0.23.0's (compilation.py:71-90),
    evaluated here on the members' values: PIECEWISE = 1 among the routines, or FULL = 2 the largest."""
    platform = upstream_file("vllm-ascend", "vllm_ascend/platform.py").read_text()
    chain = re.findall(r"(if|elif) compilation_config\.cudagraph_mode(.*?):\n", platform)
    assert ("if", " == CUDAGraphMode.NONE") in chain
    start = chain.index(("if", " == CUDAGraphMode.NONE"))
    assert chain[start + 1 : start + 3] == [
        ("elif", ".requires_piecewise_compilation()"),
        ("elif", ".has_full_cudagraphs()"),
    ]
    assert "cudagraph_mode is not support on NPU. falling back to NONE" in platform
    compilation = upstream_file("vllm", "vllm/config/compilation.py").read_text()
    assert "return self.has_mode(CUDAGraphMode.PIECEWISE)" in compilation  # requires_piecewise_compilation
    assert "return self.max_cudagraph_mode() == CUDAGraphMode.FULL" in compilation  # has_full_cudagraphs
    values = _graph_mode_values()
    assert set(npu_profile.GRAPH_MODES) == set(values)
    piecewise, full = values["PIECEWISE"][0], values["FULL"][0]
    runs = {name for name, v in values.items() if name != "NONE" and (piecewise in v or max(v) == full)}
    assert set(npu_profile.NPU_GRAPH_MODES) == runs
    # reassignments before the chain: only xlite (opt-in additional_config), encoder-decoder models and a compilation
    # mode other than NONE / VLLM_COMPILE change the mode; none applies to our decoder-only rollout
    assert "and model_config.is_encoder_decoder" in platform and "ascend_config.xlite_graph_config.enabled" in platform


def test_sleep_keeps_addresses_and_nz_off_keeps_layout():
    """Why captured ACL graphs see weights updated after capture (read, not run): wake-up maps each allocation
    back from its recorded handle, whose third field is the device pointer; the only post-load re-layout of an
    unquantized linear weight is NZ, which our profile turns off."""
    camem = upstream_file("vllm-ascend", "vllm_ascend/device_allocator/camem.py").read_text()
    assert "# py_device, py_alignedSize, py_d_mem, py_p_memHandle" in camem
    assert "py_d_mem = allocation_handle[2]" in camem and "self.pointer_to_data[py_d_mem]" in camem
    wake = ast.get_source_segment(
        camem, next(n for n in ast.walk(ast.parse(camem)) if getattr(n, "name", "") == "wake_up")
    )
    assert "create_and_map(handle)" in wake and "memcpy(ptr," in wake  # same pointer, weights copied back
    # 0.23.0: the unquantized linear's NZ step is maybe_trans_nz (ops/linear.py:92-98), which returns the weight
    # itself unless _should_trans_nz (utils.py:261-298): weight_nz_mode 0 (AscendConfig, from VLLM_ASCEND_ENABLE_NZ
    # when additional_config has no weight_nz_mode, ascend_config.py:249-254) converts nothing
    linear = upstream_file("vllm-ascend", "vllm_ascend/ops/linear.py").read_text()
    after_load = linear[linear.index("def process_weights_after_loading") :][:1200]
    assert "layer.weight.data = maybe_trans_nz(layer.weight.data)" in after_load
    utils = upstream_file("vllm-ascend", "vllm_ascend/utils.py").read_text()
    trans = utils[utils.index("def maybe_trans_nz") :][:200]
    assert "if not _should_trans_nz(weight):\n        return weight" in trans
    should = utils[utils.index("def _should_trans_nz") : utils.index("def maybe_trans_nz")]
    assert "nz_mode = config.weight_nz_mode" in should and "if not nz_mode:\n        return False" in should
    config = upstream_file("vllm-ascend", "vllm_ascend/ascend_config.py").read_text()
    assert re.search(r'self\.weight_nz_mode = self\._get_config_value\(\s*additional_config,\s*"weight_nz_mode",'
                     r'\s*"VLLM_ASCEND_ENABLE_NZ",', config)  # fmt: skip
    assert profile_vars()["VLLM_ASCEND_ENABLE_NZ"] == "0"
