"""The NPU performance profile (gspo_ascend/npu_profile.py SETTINGS, issue #26) held to the pinned wheels.

One test per setting of verl's NPU GSPO practice guide: the pinned torch-npu 2.7.1 / vllm-ascend 0.11.0 / vLLM 0.11.0
reads the name (and takes the value we set), or the setting is left out / opt-in and the test holds the reason.
Expected values come from the wheels' own files (headers, envs.py, platform.py), parsed here.
"""

from __future__ import annotations

import ast
import re

from gspo_ascend import npu_profile

from .test_npu_env_conformance import CXX_READERS, NOT_IN_THE_WHEELS, _env_keys, profile_vars, torch_npu_reader
from .upstream import upstream_file, wheel_root

SETTINGS = {s.name: s for s in npu_profile.SETTINGS}
OPTIONS_H = "torch_npu/include/torch_npu/csrc/core/npu/register/OptionsManager.h"


def _ascend_envs() -> set[str]:
    return _env_keys("vllm_ascend/envs.py", "vllm-ascend", "env_variables")


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
    assert b"Set thread affinity to user-defined range %d-%d success." in _library()
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


def test_aiv_is_left_out_but_vllm_ascend_reads_it():
    """HCCL_OP_EXPANSION_MODE is CANN's (torch_npu never reads it); vllm-ascend 0.11.0 reads it to size its ACL graph
    capture list, so a user who opts in changes the graph sizes too. Left out of env/npu (reason in SETTINGS)."""
    assert SETTINGS["HCCL_OP_EXPANSION_MODE"].where == "left out" and "1091" in SETTINGS["HCCL_OP_EXPANSION_MODE"].why
    assert torch_npu_reader("HCCL_OP_EXPANSION_MODE") is None
    utils = upstream_file("vllm-ascend", "vllm_ascend/utils.py").read_text()
    assert "if os.getenv(\"HCCL_OP_EXPANSION_MODE\") == 'AIV':" in utils
    assert "HCCL_OP_EXPANSION_MODE" not in profile_vars()


def test_vllm_ascend_switches_are_in_0_11_0_and_verls_flashcomm_spelling_is_legacy():
    keys = _ascend_envs()
    for name in (
        "VLLM_ASCEND_ENABLE_FLASHCOMM1",
        "VLLM_ASCEND_ENABLE_DENSE_OPTIMIZE",
        "VLLM_ASCEND_ENABLE_PREFETCH_MLP",
    ):
        assert name in keys and SETTINGS[name].where == "opt-in", name
        assert name not in profile_vars()
    # the guide's VLLM_ASCEND_ENABLE_FLASHCOMM: not a key of 0.11.0's envs.py, read only for backward compatibility
    assert "VLLM_ASCEND_ENABLE_FLASHCOMM" not in keys
    assert "We retain the env VLLM_ASCEND_ENABLE_FLASHCOMM here for backward compatibility" in (
        upstream_file("vllm-ascend", "vllm_ascend/utils.py").read_text()
    )


def test_prefetch_mlp_acts_only_with_dense_optimize():
    context = upstream_file("vllm-ascend", "vllm_ascend/ascend_forward_context.py").read_text()
    condition = re.search(r"prefetch_mlp_enabled = (.*?)\n\s*if prefetch_mlp_enabled", context, re.S)[1]
    assert "VLLM_ASCEND_ENABLE_DENSE_OPTIMIZE" in condition and "VLLM_ASCEND_ENABLE_PREFETCH_MLP" in condition
    assert "num_tokens < 500" in condition
    from gspo_ascend.config import load_config

    cfg = load_config(overrides=["rollout.engine=vllm"], validate=False)
    env = {"VLLM_ASCEND_ENABLE_PREFETCH_MLP": "1"}
    assert any("DENSE_OPTIMIZE=1" in p for p in npu_profile.environment_problems(cfg, "npu", env))
    assert npu_profile.environment_problems(cfg, "npu", {**env, "VLLM_ASCEND_ENABLE_DENSE_OPTIMIZE": "1"}) == []


def test_flashcomm1_with_graphs_keeps_only_multiples_of_tp():
    platform = upstream_file("vllm-ascend", "vllm_ascend/platform.py").read_text()
    assert "update_sizes_for_sequence_parallelism(original_sizes)" in platform and "enable_sp(vllm_config)" in platform
    utils = upstream_file("vllm-ascend", "vllm_ascend/utils.py").read_text()
    assert "or envs_ascend.VLLM_ASCEND_ENABLE_FLASHCOMM1" in utils  # FLASHCOMM1 turns enable_sp on
    from gspo_ascend.config import load_config

    over = ["rollout.engine=vllm", "rollout.enforce_eager=false", "rollout.tensor_parallel_size=2"]
    over += ["trainer.devices_per_node=2", "rollout.cudagraph_capture_sizes=[4,6,7]"]
    cfg = load_config(overrides=over, validate=False)
    env = {"VLLM_ASCEND_ENABLE_FLASHCOMM1": "1", "TASK_QUEUE_ENABLE": "1"}
    (problem,) = npu_profile.environment_problems(cfg, "npu", env)
    assert "[7]" in problem and "multiples of rollout TP 2" in problem


def test_graph_modes_are_those_vllm_ascend_runs():
    """NPU_GRAPH_MODES = the CUDAGraphMode branches of vllm-ascend 0.11.0's check_and_update_config that keep a
    graph mode: NONE is eager, a mode reassigned to another is not run as itself, the else branch falls back."""
    platform = upstream_file("vllm-ascend", "vllm_ascend/platform.py").read_text()
    compared = set(re.findall(r"cudagraph_mode == CUDAGraphMode\.(\w+)", platform))
    reassigned = set(re.findall(r"if compilation_config\.cudagraph_mode == CUDAGraphMode\.(\w+):\n\s*compilation_config"
                                r"\.cudagraph_mode = CUDAGraphMode\.\w+", platform))  # fmt: skip
    assert reassigned == {"FULL_AND_PIECEWISE"}
    assert set(npu_profile.NPU_GRAPH_MODES) == compared - {"NONE"} - reassigned
    assert "cudagraph_mode is not support on NPU. falling back to NONE" in platform
    compilation = upstream_file("vllm", "vllm/config/compilation.py").read_text()
    members = re.search(r"class CUDAGraphMode\(enum\.Enum\):(.*?)\n\n", compilation, re.S)[1]
    assert set(npu_profile.GRAPH_MODES) == set(re.findall(r"^\s+([A-Z_]+) = ", members, re.M))


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
    linear = upstream_file("vllm-ascend", "vllm_ascend/ops/linear.py").read_text()
    after_load = linear[linear.index("def process_weights_after_loading") :][:400]
    assert "if (is_enable_nz(layer.weight.data.dtype)):" in after_load
    assert profile_vars()["VLLM_ASCEND_ENABLE_NZ"] == "0"
