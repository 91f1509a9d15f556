"""The NPU performance profile (issue #26): verl's NPU GSPO practice guide held to the pinned code.

Each setting of that guide is either part of our NPU runtime environment (``env/npu/``), an opt-in config key, or
left out with its reason; :data:`SETTINGS` is the table (rendered in docs/install-npu.md, "Performance profile",
and read by ``gspo-ascend doctor``'s ``npu-profile`` line). The conformance suite
(tests/conformance/test_npu_profile_conformance.py) holds every "read by" claim to the pinned torch-npu 2.10.0.post4 /
vllm-ascend 0.23.0 / vLLM 0.23.0 wheels.

Rollout graph mode (``rollout.enforce_eager: false``) and its couplings live here too, torch-free:

* :func:`graph_problems` (a config validator: one line, exit 2): the graph keys need graph mode and the vLLM
  engine; vllm-ascend 0.23.0 runs every mode but NONE on NPU (``platform.py:593-640``: NONE is eager, a mode with
  piecewise graphs or one with full graphs is run as itself; 0.11.0 ran only PIECEWISE and FULL_DECODE_ONLY);
  capture sizes within the decode batch one rollout engine runs (a larger size is captured, holds memory and is
  never replayed).
* :func:`environment_problems` (at the start of ``train``, on the driver, whose environment is the job's
  runtime_env): ACL graphs need ``TASK_QUEUE_ENABLE=1`` (the guide; level 2 conflicts with ACL graph capture),
  and the vllm-ascend switches' own couplings read from their source.

Why graph mode is allowed for our rollout on vllm-ascend 0.23.0 (read from its source, not run: no NPU here):
sleep level 1 (``device_allocator/camem.py``) unmaps the weights' and KV cache's physical memory and ``wake_up``
maps new memory at the *same* virtual addresses (``create_and_map(handle)`` with the recorded pointer) and copies
the weights back; our weight update (``update_weights`` -> ``model.load_weights``) copies into the existing
parameters (``param.data.copy_``: same storage); with ``VLLM_ASCEND_ENABLE_NZ=0`` (our profile)
``process_weights_after_loading`` re-lays nothing out (``ops/linear.py:92-98``: ``maybe_trans_nz`` returns the weight
itself when ``weight_nz_mode`` is 0, ``utils.py:261-298``). So the addresses captured in an ACL graph keep holding the
current weights. What would break it is a re-allocating update (``param.data = new``), which the CPU test
tests/integration/test_vllm_graph_weights.py rules out for our update path.

Beside MindSpeed (the megatron engine in the same process as an in-process vLLM, rollout TP > 1): MindSpeed's
adaptor replaces ``torch.compile`` process-wide with a pass-through, under which vLLM would capture nothing (verl
needed ``use_original_torch_compile`` for this). Every vLLM call of our engine, the build that captures included,
runs in ``mindspeed_setup.patches_lifted()`` with torch's own ``torch.compile`` back
(tests/mindspeed/test_mindspeed_engine.py::test_vllm_calls_run_with_the_process_wide_torch_patches_lifted), so
graph mode needs no refusal there.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

# vllm-ascend 0.23.0 platform.py check_and_update_config (593-640): the cudagraph modes it runs on NPU. NONE is eager;
# a mode that requires_piecewise_compilation() (PIECEWISE, FULL_AND_PIECEWISE) or has_full_cudagraphs() (FULL,
# FULL_DECODE_ONLY, FULL_AND_PIECEWISE; vLLM 0.23.0 config/compilation.py:77-84) is run as itself; only a mode in
# neither branch would fall back to NONE, and CUDAGraphMode has none. (0.11.0 ran only PIECEWISE and FULL_DECODE_ONLY.)
NPU_GRAPH_MODES = ("PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
# vLLM 0.23.0 vllm/config/compilation.py:53-63 CUDAGraphMode members (what the key may say on CUDA / CPU)
GRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")

# Where jemalloc's shared library lies on the distributions Ascend supports (Debian/Ubuntu multiarch, RHEL-likes,
# a source build); env/npu/atlas_800t_a2.sh preloads the first that exists (tests keep the two lists equal).
JEMALLOC_PATHS = (
    "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2",
    "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
    "/usr/lib64/libjemalloc.so.2",
    "/usr/local/lib/libjemalloc.so.2",
)


@dataclass(frozen=True)
class Setting:
    name: str  # the environment variable or config key
    value: str  # what the guide sets
    where: str  # env/npu file, config key, "opt-in" (the user's runtime_env) or "left out"
    reader: str  # what of the pinned stack reads it (checked by the conformance suite)
    why: str


SETTINGS = (
    Setting(
        "rollout.enforce_eager", "false", "config key (opt-in)", "vLLM 0.23.0 EngineArgs.enforce_eager",
        "ACL graph rollout (+15-20 % rollout in the guide); allowed with sleep / wake-up and weight updates "
        "(module docstring); eager stays the NPU default",
    ),
    Setting(
        "rollout.cudagraph_mode", "FULL_DECODE_ONLY", "config key (opt-in)",
        "vllm-ascend 0.23.0 platform.py check_and_update_config",
        "every mode but NONE runs on NPU (PIECEWISE, FULL, FULL_DECODE_ONLY, FULL_AND_PIECEWISE); refused in eager "
        "mode",
    ),
    Setting(
        "rollout.cudagraph_capture_sizes", "[8 ... 384]", "config key (opt-in)",
        "vLLM 0.23.0 CompilationConfig.cudagraph_capture_sizes",
        "each size within the sequences one rollout engine decodes at once",
    ),
    Setting(
        "TASK_QUEUE_ENABLE", "1 with ACL graphs, 2 eager", "env/npu/mc2_env.yaml (2) + the vLLM engine's default",
        "torch_npu 2.10.0.post4 OptionsManager GetTaskQueueEnable", "graph mode refused at train start unless it is 1",
    ),
    Setting(
        "CPU_AFFINITY_CONF", "1", "env/npu/mc2_env.yaml", "torch_npu 2.10.0.post4 OptionsManager GetCpuAffinityConf",
        "each actor turns 1 into 1,npu0:a-b, its NPU's share of the node's cores (actor_cpu_affinity): 1 alone binds "
        "every one-NPU actor to all cores",
    ),
    Setting(
        "MULTI_STREAM_MEMORY_REUSE", "1", "left out",
        "torch_npu 2.10.0.post4 OptionsManager GetMultiStreamMemoryReuse (ReuseMode 1 = ERASE_RECORD_STREAM)",
        "1 is torch_npu's default (OptionsManager.cpp, ../shared/reference/upstream-audit-3.md section 4): setting it "
        "changes nothing",
    ),
    Setting(
        "LD_PRELOAD", "libjemalloc.so.2", "env/npu/atlas_800t_a2.sh (when found)", "glibc's dynamic loader",
        "host memory of long Ray runs is returned to the OS; doctor says when jemalloc is missing",
    ),
    Setting(
        "HCCL_OP_EXPANSION_MODE", "AIV", "left out",
        "CANN HCCL; vllm-ascend 0.23.0 only on the A5 (device/device_op.py A5DeviceAdaptor, CCU_SCHED)",
        "A2 documents AIV for inference only and caps HCCL_EXEC_TIMEOUT at 1091 s (ours: 3600); one runtime_env "
        "covers training and rollout processes alike",
    ),
    Setting(
        "VLLM_ASCEND_ENABLE_FLASHCOMM1", "1", "opt-in",
        "vllm-ascend 0.23.0 envs.py (AscendConfig.enable_flashcomm1)",
        "verl's VLLM_ASCEND_ENABLE_FLASHCOMM is read by nothing of 0.23.0 (0.11.0 kept it as a legacy spelling); "
        "needs rollout TP > 1 and, with graphs, capture sizes that are multiples of TP",
    ),
    Setting(
        "VLLM_ASCEND_ENABLE_DENSE_OPTIMIZE", "1", "left out", "nothing of vllm-ascend 0.23.0 (gone from envs.py)",
        "vllm-ascend 0.23.0 dropped the switch (0.11.0 read it); setting it changes nothing",
    ),
    Setting(
        "VLLM_ASCEND_ENABLE_PREFETCH_MLP", "1", "left out", "nothing of vllm-ascend 0.23.0 (gone from envs.py)",
        "0.23.0's MLP weight prefetch is additional_config weight_prefetch_config (ascend_config.py), which our "
        "engine does not pass; setting the variable changes nothing",
    ),
)  # fmt: skip


def actor_cpu_affinity(conf: str | None, npu_ids: list[str], node_npus: int, cores: int) -> str | None:
    """What ``CPU_AFFINITY_CONF`` an actor holding the NPUs ``npu_ids`` (Ray's physical ids) should start torch_npu
    with, on a node of ``node_npus`` NPUs and ``cores`` online cores; None to leave the value as it is.

    torch_npu 2.7.1 (NPUAffinityController.cpp, ../shared/reference/upstream-audit-3.md section 4): mode 1 binds
    the threads of device d to ``ranges[d]``, by default ``[d * block, (d + 1) * block - 1]`` with ``block = cores
    / device_count()``. Ray makes one NPU visible per actor, so device_count() is 1 and "1" binds every actor to
    all cores. An ``npuN:a-b`` option sets a range: each actor gets ``1,npu0:a-b`` with the range its NPU would
    have if the node's NPUs were all visible (verl's layout, where "1" works as the guide means). Only the profile's
    plain "1" is refined; a value with ranges of its own, another mode, or an actor of several NPUs is left alone."""
    if (conf or "").strip() not in ("1", "mode:1") or len(npu_ids) != 1 or node_npus < 1 or cores < node_npus:
        return None
    block, device = cores // node_npus, int(npu_ids[0])
    return f"1,npu0:{device * block}-{(device + 1) * block - 1}"


def decode_batch(cfg, devices: int) -> int:
    """Sequences one rollout engine decodes at once: the batch's samples over the rollout groups of ``devices``,
    the devices that generate (the rollout pool's in a disaggregated run, else the trainer's: config.rollout_world,
    which the caller passes: config imports this module)."""
    groups = max(devices // max(cfg.rollout.tensor_parallel_size, 1), 1)
    return max(cfg.data.train_batch_size * cfg.rollout.n // groups, 1)


# vLLM 0.23.0 engine/arg_utils.py `_set_default_max_num_seqs_and_batched_tokens_args` (2326-2335, 2561-2563; 0.11.0's
# `_set_default_args` said the same): the LLM class's max_num_seqs is min(256, max_num_batched_tokens) on a device
# under 70 GiB (every Atlas A2 NPU: 64 GB); a larger batch never runs
NPU_MAX_NUM_SEQS = 256


def engine_seqs(cfg, devices: int) -> tuple[int, str]:
    """The most sequences one engine decodes at once on ``devices`` generating devices, and what bounds it."""
    limit = decode_batch(cfg, devices)
    why = "the sequences one rollout engine decodes at once (data.train_batch_size x rollout.n / rollout groups)"
    if cfg.trainer.device == "npu":
        seqs = min(NPU_MAX_NUM_SEQS, cfg.rollout.max_num_batched_tokens)
        if seqs < limit:
            limit, why = seqs, "vLLM's max_num_seqs on a 64 GB NPU (min(256, rollout.max_num_batched_tokens))"
    return limit, why


def _graph_keys_set(r) -> list[str]:
    return [k for k in ("cudagraph_mode", "cudagraph_capture_sizes") if getattr(r, k) is not None]


def graph_problems(cfg, devices: int) -> Iterable[str]:
    """One-line problems of the graph-mode keys (a config validator); ``devices``: those that generate."""
    r = cfg.rollout
    keys = _graph_keys_set(r)
    if keys and (r.engine != "vllm" or r.enforce_eager is not False):
        yield (
            f"config key 'rollout.{keys[0]}' applies only to ACL / CUDA graph rollout, which this config does not "
            "run; set rollout.engine: vllm and rollout.enforce_eager: false, or remove it"
        )
        return
    if r.cudagraph_mode is not None:
        modes = NPU_GRAPH_MODES if cfg.trainer.device == "npu" else GRAPH_MODES
        if r.cudagraph_mode not in modes:
            why = " (vllm-ascend 0.23.0 runs NONE eager)" if modes == NPU_GRAPH_MODES else ""
            yield f"config key 'rollout.cudagraph_mode' is '{r.cudagraph_mode}'; use one of {', '.join(modes)}{why}"
    sizes = r.cudagraph_capture_sizes
    if sizes is not None:
        limit, why = engine_seqs(cfg, devices)
        if not sizes or any(s <= 0 for s in sizes):
            yield f"config key 'rollout.cudagraph_capture_sizes' must be a non-empty list of sizes > 0, got {sizes}"
        elif max(sizes) > limit:
            yield (
                f"config key 'rollout.cudagraph_capture_sizes' has {max(sizes)} > {limit}, {why}; such a graph "
                f"is captured and never replayed: keep sizes <= {limit}"
            )


def _flag(env: Mapping[str, str], name: str) -> bool:
    try:
        return bool(int(env.get(name, "0")))  # vllm-ascend 0.23.0 envs.py:75: bool(int(os.getenv(name, "0")))
    except ValueError:
        return False


def environment_problems(cfg, backend_name: str, env: Mapping[str, str]) -> list[str]:
    """The profile's couplings with the job's environment, for an NPU vLLM rollout (empty elsewhere)."""
    r = cfg.rollout
    if backend_name != "npu" or r.engine != "vllm":
        return []
    found = []
    if r.enforce_eager is False and r.cudagraph_mode is not None and r.cudagraph_mode not in NPU_GRAPH_MODES:
        # trainer.device=auto resolved to the NPU: the config validator could not know
        found.append(
            f"config key 'rollout.cudagraph_mode' is '{r.cudagraph_mode}'; on NPU use one of "
            f"{', '.join(NPU_GRAPH_MODES)} (vllm-ascend 0.23.0 runs NONE eager)"
        )
    queue = env.get("TASK_QUEUE_ENABLE")
    if r.enforce_eager is False and queue is not None and queue != "1":
        found.append(
            f"config key 'rollout.enforce_eager' is false (ACL graph rollout), which needs TASK_QUEUE_ENABLE=1; the "
            f'environment has {queue} (env/npu/mc2_env.yaml sets 2 for eager): set TASK_QUEUE_ENABLE: "1" in the '
            "job's runtime_env"
        )
    if _flag(env, "VLLM_ASCEND_ENABLE_FLASHCOMM1") and r.tensor_parallel_size < 2:
        found.append(
            "VLLM_ASCEND_ENABLE_FLASHCOMM1=1 needs rollout.tensor_parallel_size > 1 (vllm-ascend 0.23.0: a "
            "tensor-parallel communication scheme); unset it or raise the rollout TP"
        )
    sizes, tp = r.cudagraph_capture_sizes, r.tensor_parallel_size
    if _flag(env, "VLLM_ASCEND_ENABLE_FLASHCOMM1") and r.enforce_eager is False and sizes and tp > 1:
        odd = [s for s in sizes if s % tp]
        if odd:
            found.append(
                f"config key 'rollout.cudagraph_capture_sizes' has {odd}, not multiples of rollout TP {tp}: with "
                "VLLM_ASCEND_ENABLE_FLASHCOMM1=1 vllm-ascend 0.23.0 drops them (platform.py); use multiples of TP"
            )
    return found


def check_environment(cfg, backend_name: str, env: Mapping[str, str] | None = None) -> None:
    """Raise the first :func:`environment_problems` finding as a ConfigError (one line, exit 2)."""
    from .errors import ConfigError

    found = environment_problems(cfg, backend_name, os.environ if env is None else env)
    if found:
        more = f" (and {len(found) - 1} more: {'; '.join(found[1:])})" if len(found) > 1 else ""
        raise ConfigError(found[0] + more)


def compilation_config(cfg, eager: bool) -> dict:
    """vLLM's ``compilation_config`` for the graph keys; {} in eager mode or when none is set (vLLM's defaults)."""
    r = cfg.rollout
    if eager:
        return {}
    out: dict = {}
    if r.cudagraph_mode is not None:
        out["cudagraph_mode"] = r.cudagraph_mode
    if r.cudagraph_capture_sizes is not None:
        out["cudagraph_capture_sizes"] = sorted(set(r.cudagraph_capture_sizes))
    return out


def jemalloc_path(exists=os.path.exists) -> str | None:
    return next((p for p in JEMALLOC_PATHS if exists(p)), None)


def render_table() -> str:
    """The profile as the markdown table docs/install-npu.md holds ("Performance profile"; a test keeps them equal)."""
    rows = ["| setting | verl's guide | here | read by (pinned) | why |", "|---|---|---|---|---|"]
    rows += [f"| `{s.name}` | {s.value} | {s.where} | {s.reader} | {s.why} |" for s in SETTINGS]
    return "\n".join(rows) + "\n"
