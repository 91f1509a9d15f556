"""What the ``megatron`` engine (:mod:`.megatron`) settles before and around building megatron-core's model:
importing megatron on this device (MindSpeed configured first on NPU, the shim's CUDA->CPU redirection on CPU),
the config and model-shape checks that name the key to change, our TransformerConfig settings on top of mbridge's,
and the gradient-finalize hook that keeps the global-count normalisation exact. Imports megatron only inside the
functions."""

from __future__ import annotations

import importlib
import sys
from typing import Any

import torch

from gspo_ascend.config import Config
from gspo_ascend.device import Backend
from gspo_ascend.engines import megatron_bridge as mb
from gspo_ascend.engines import megatron_cp as cp_support
from gspo_ascend.engines import mindspeed_setup
from gspo_ascend.engines.megatron_compat import patch_megatron_core
from gspo_ascend.errors import ConfigError, UserError
from gspo_ascend.megatron_settings import kv_heads_layout, megatron_core_version

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _import_megatron(backend: Backend, mindspeed_args: dict[str, Any] | None = None) -> None:
    """What must happen before ``import megatron.core`` on this device. ``mindspeed_args``
    (:func:`.mindspeed_setup.mindspeed_args`): run under MindSpeed (:func:`.mindspeed_setup.enabled`)."""
    if mindspeed_setup.enabled(backend):
        _configure_mindspeed(backend, mindspeed_args or {})
    elif backend.torch_device_type == "cpu":  # CPU and the emulated NPU without MindSpeed: CUDA calls -> CPU
        from gspo_ascend.device import shim

        mb.prime_device_context()
        shim.install(npu=False, cuda=True)
    try:
        importlib.import_module("megatron.core")
        importlib.import_module("mbridge")
    except ImportError as exc:
        raise UserError(f"actor.engine=megatron needs megatron-core and mbridge ({exc}); see docs/engines.md") from None
    patch_megatron_core()  # what this megatron-core needs (0.12: the cluster pin; 0.16 without TE)


def _configure_mindspeed(backend: Backend, args: dict[str, Any]) -> None:
    """Import MindSpeed's adaptor (neutral argv, never the launcher's) and repatch it with ``args``, before this
    process builds anything with megatron (MindSpeed patches megatron's classes and functions in place, and its
    CP feature wraps ``initialize_model_parallel``). On the emulated NPU the shim's MindSpeed stand-ins go in
    first (``shim.install(mindspeed=True)``; importing its ``transfer_to_npu`` installs the CUDA redirection)."""
    if backend.emulated:
        from gspo_ascend.device import shim

        mb.prime_device_context()
        shim.install(mindspeed=True, mc2=bool(args.get("use_ascend_mc2")))
    if not mindspeed_setup.installed():
        raise UserError(
            "actor.engine=megatron on NPU needs MindSpeed (no mindspeed.megatron_adaptor); install it from source "
            "(the PyPI package is an empty placeholder), see docs/install-npu.md"
        )
    if "megatron.core" in sys.modules and "mindspeed.megatron_adaptor" not in sys.modules:
        raise UserError(
            "megatron.core was imported in this process before MindSpeed's adaptor, so MindSpeed cannot patch it; "
            "build the megatron engine before anything imports megatron (a fresh worker process)"
        )
    try:
        mindspeed_setup.apply(args)
    except ImportError as exc:
        raise UserError(
            f"actor.engine=megatron on NPU: MindSpeed's adaptor failed to import ({exc}); check the MindSpeed / "
            "torch_npu / CANN versions against docs/install-npu.md (`gspo-ascend doctor`)"
        ) from None


def _check_config(cfg: Config, backend: Backend) -> None:
    if cfg.model.dtype not in _DTYPES:
        raise ConfigError(
            f"config key 'model.dtype' = {cfg.model.dtype!r} is not supported by the megatron engine (float16 needs "
            "loss scaling); use bfloat16 or float32"
        )
    a = cfg.actor
    cp_support.check_config(cfg)
    if cfg.model.gradient_checkpointing:
        raise ConfigError(
            "config key 'model.gradient_checkpointing' is the fsdp engine's; with actor.engine=megatron set "
            "'actor.recompute: full' (or 'selective') instead"
        )
    if a.use_mc2 and not mindspeed_setup.enabled(backend):
        raise ConfigError(
            "config key 'actor.use_mc2' is Ascend-only (MindSpeed MC2) and needs MindSpeed; set it to false on this "
            "device"
        )
    mindspeed_setup.check_mc2(cfg)
    if backend.torch_device_type == "cpu" and a.sequence_parallel and not mindspeed_setup.enabled(backend):
        # under MindSpeed (the emulated NPU in .venv-mindspeed) SP runs: torch 2.7.1's gloo has reduce_scatter
        raise ConfigError(
            "config key 'actor.sequence_parallel' cannot be true on CPU: megatron's local layer spec cannot run "
            "sequence parallelism there; set it to false"
        )
    if cfg.algorithm.minibatches_per_rollout is None:
        raise ConfigError(
            "config key 'algorithm.minibatches_per_rollout' is unresolved; load the config with "
            "gspo_ascend.config.load_config (it derives it from actor.ppo_mini_batch_size)"
        )


def _kv_heads_fit(kv: int, tp: int) -> tuple[bool, str]:
    version = megatron_core_version()
    layout = kv_heads_layout(kv, tp, version)
    if layout == "mismatch":
        return False, f"num_key_value_heads ({kv}) and TP must divide one by the other"
    why = f"megatron-core {version or 'of unknown version'} cannot replicate them (0.16.0 and later can)"
    return layout != "refused", f"num_key_value_heads ({kv}) must divide by TP: {why}"


def _check_model(cfg: Config, hf: Any, world: int, on_cpu: bool) -> None:
    """Shapes that must divide by the parallel sizes, checked here with the key to change."""
    a = cfg.actor
    tp, pp = a.tensor_parallel_size, a.pipeline_parallel_size
    ep, etp = a.expert_parallel_size, a.expert_tensor_parallel_size
    moe = getattr(hf, "num_experts", None)
    cp_support.check_world(cfg, world)
    rules = [
        (world % (tp * pp) == 0, f"the world size ({world}) must be a multiple of TP x PP ({tp} x {pp})"),
        (world % (etp * ep * pp) == 0, f"the world size ({world}) must be a multiple of ETP x EP x PP"),
        _kv_heads_fit(hf.num_key_value_heads, tp),
        (hf.num_attention_heads % tp == 0, f"num_attention_heads ({hf.num_attention_heads}) must divide by TP"),
        (hf.vocab_size % tp == 0, f"vocab_size ({hf.vocab_size}) must divide by TP (the vocabulary is not padded)"),
        (hf.num_hidden_layers % pp == 0, f"num_hidden_layers ({hf.num_hidden_layers}) must divide by PP"),
        (moe or (ep == 1 and etp == 1), "expert_parallel_size / expert_tensor_parallel_size need a MoE model"),
        (not moe or moe % ep == 0, f"num_experts ({moe}) must divide by expert_parallel_size ({ep})"),
        (not moe or tp == 1 or a.sequence_parallel, "MoE with TP > 1 needs actor.sequence_parallel=true (Megatron)"),
        (not (moe and tp > 1 and on_cpu), "MoE with TP > 1 is impossible on CPU (it needs sequence parallelism)"),
    ]
    for ok, problem in rules:
        if not ok:
            raise ConfigError(
                f"actor.tensor/pipeline/expert(_tensor)_parallel_size = {tp}/{pp}/{ep}/{etp} do not fit "
                f"'{cfg.model.path or 'model'}': {problem}"
            )


def _transformer_overrides(cfg: Config, backend: Backend, moe: bool, use_te: bool) -> dict[str, Any]:
    """Our TransformerConfig settings on top of mbridge's (which assume TE: SP forced on with TP > 1).

    Under MindSpeed its own keys (``use_flash_attn``, ``use_fused_rmsnorm``, ...) are not passed here: its
    TransformerConfig wrapper merges the namespace :func:`.mindspeed_setup.apply` configured into every config.
    Two megatron fields are MindSpeed's switches on the local spec: ``moe_grouped_gemm`` (the local spec's
    ``GroupedMLP``, which MindSpeed replaces by its ``MindSpeedGmmExperts``) and ``bias_activation_fusion`` (the
    dense MLP reaches MindSpeed's fused SwiGLU only through megatron's ``bias_swiglu_impl``)."""
    a = cfg.actor
    overrides: dict[str, Any] = {
        "sequence_parallel": a.sequence_parallel and a.tensor_parallel_size > 1,
        # the global-count normalisation (module docstring): no division by micro-batches, DDP sums
        "calculate_per_token_loss": True,
        "variable_seq_lengths": True,  # micro-batches are padded to their own length
    }
    if moe:
        overrides["moe_router_dtype"] = "fp32"  # HF computes routing probabilities in float32 too
        if a.routing_replay != "off":  # a RouterReplay per router (megatron_routing.py; 0.16 and later)
            overrides["moe_enable_routing_replay"] = True
    if not use_te:  # fusions that need TE or Apex kernels
        overrides.update(
            moe_grouped_gemm=False,
            persist_layer_norm=False,
            bias_activation_fusion=False,
            bias_dropout_fusion=False,
            masked_softmax_fusion=False,
            gradient_accumulation_fusion=False,
            apply_rope_fusion=False,
        )
    else:  # TE's fused RoPE, which takes packed (THD) boundaries on the device; megatron's unfused THD RoPE reads
        # them back to the host (.tolist()) in every layer, for q and for k (rope_utils._apply_rotary_pos_emb_thd)
        overrides["apply_rope_fusion"] = True
    if a.recompute == "full":
        overrides.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif a.recompute == "selective":
        overrides.update(recompute_granularity="selective")
    if mindspeed_setup.enabled(backend):
        overrides.update(moe_grouped_gemm=moe, bias_activation_fusion=True)
    return overrides


def _finalize_grads(model_chunks, num_tokens=None, *args, **kwargs):
    """megatron's finalize_model_grads (DP reduction, tied-embedding and SP layernorm grads) without the division
    by the token count that calculate_per_token_loss would add: our losses are normalised already."""
    from megatron.core.distributed import finalize_model_grads

    return finalize_model_grads(model_chunks, None, *args, **kwargs)
