"""The side of the ``vllm`` rollout engine that runs inside vLLM's worker processes: :class:`WeightSyncExtension`,
mixed into vLLM's worker class through ``worker_extension_cls`` (:data:`EXTENSION`, this module's path), whose
``gspo_*`` methods the engine calls by name over ``collective_rpc`` (the weight-update protocol and the sampler's
log-prob mode: :mod:`.vllm_rollout`), and the runtime patches it applies around a weight update: vllm-ascend's MoE
layout after ``wake_up`` (:func:`_undo_ascend_wake_transpose`) and the CPU builds' MoE kernels (:func:`_repack_cpu_moe`,
:func:`_rebuild_ipex_moe`). Imports vLLM only inside the methods."""

from __future__ import annotations

import logging
import sys

import torch

from ..patches._core import APPLIED

log = logging.getLogger("gspo_ascend.engines.vllm_rollout")  # the engine's logger: one name for all its lines

EXTENSION = f"{__name__}.WeightSyncExtension"
LOGPROBS_MODE = "processed_logprobs"  # tempered (and truncated) log-probs of the sampled token (vllm_rollout.py)


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
        model = self.model_runner.get_model()
        restored = _undo_ascend_wake_transpose(model)
        if restored:
            log.info("vllm rollout: put %d MoE expert weights back in vllm-ascend's layout after wake_up", restored)
        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(model)
        self._gspo_layerwise = True
        return True

    def gspo_honour_logprobs_mode(self) -> list[str]:
        """Make this worker's sampler return the engine's ``logprobs_mode`` (vllm-ascend 0.11 builds it without);
        returns ``[patch status, detail, the mode the sampler now returns]``, strings for the RPC reply."""
        from gspo_ascend.patches.vllm_ascend import effective_logprobs_mode, honour_logprobs_mode

        mode = getattr(self.vllm_config.model_config, "logprobs_mode", LOGPROBS_MODE)
        entry = honour_logprobs_mode(self.model_runner, mode)
        return [entry.status, entry.detail, effective_logprobs_mode(self.model_runner) or "unknown"]

    def gspo_load_weights(self, payload: bytes | dict) -> int:
        """One bucket -> ``model.load_weights``: safetensors bytes of HF-named tensors (across processes), or the
        tensors themselves (an in-process engine: the caller's, on the device); returns the tensor count."""
        from safetensors.torch import load
        from vllm.config import set_current_vllm_config

        tensors = payload if isinstance(payload, dict) else load(bytes(payload))
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
        # vLLM 0.30 keeps a MoE layer's expert weights in a ``routed_experts`` child of the layer and its
        # load_weights names them as the layer's own (``mlp.experts.w13_weight``): the same parameter, loaded
        return sorted(n for n in expected - loaded if n.replace(".routed_experts.", ".") not in loaded)


def _undo_ascend_wake_transpose(model: torch.nn.Module) -> int:
    """Runtime patch for vllm-ascend 0.23: undo ``NPUWorker.wake_up``'s transposition of the MoE expert weights
    before a layerwise reload.

    What: for an unquantized model, ``wake_up`` with the "weights" tag replaces each ``w13_weight`` / ``w2_weight``
    (vllm-ascend's processed [E, H, 2I] / [E, I, H], contiguous) by a new Parameter holding its ``transpose(1, 2)``
    view (vllm-ascend worker/worker.py:251-270). The layerwise reload then takes those views as the tensors to copy
    the processed weights into (vLLM reload/layerwise.py:111, 383): the copy fails on the shape ([E, H, 2I] into
    [E, 2I, H]), or when H == 2I writes the transpose, and the eager MoE forward would read the views untransposed
    (``need_trans`` is False, vllm-ascend ops/fused_moe/moe_runtime_args.py:133). Putting back a Parameter on the
    transposed view restores the processed layout on the same storage (captured graphs stay valid). Gate: a 3-D
    expert weight that is the transpose of a contiguous tensor (vLLM itself keeps them contiguous), in a process
    that loaded vllm-ascend; remove when vllm-ascend's wake_up stops transposing. Returns the number restored.
    """
    if "vllm_ascend" not in sys.modules:
        return 0
    restored = 0
    for module in model.modules():
        for attr in ("w13_weight", "w2_weight"):
            param = module._parameters.get(attr)
            if param is None or param.dim() != 3 or param.is_contiguous():
                continue
            if param.transpose(1, 2).is_contiguous():
                setattr(module, attr, torch.nn.Parameter(param.transpose(1, 2), requires_grad=False))
                restored += 1
    return restored


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
