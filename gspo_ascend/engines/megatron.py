"""The ``megatron`` train engine: megatron-core's GPTModel (Qwen2 / Qwen3 / Qwen3-MoE) loaded from a Hugging Face
checkpoint through mbridge (:mod:`.megatron_bridge`), with TP / PP / EP / ETP from ``actor.*``, megatron's DDP
and distributed optimizer, and forward/backward through megatron's pipeline schedules.

Same contract and semantics as the fsdp engine (:mod:`.fsdp`): per minibatch the response-token and sequence
counts are summed over the data-parallel group and passed to the loss as ``global_tokens`` / ``global_seqs``;
a non-finite loss or gradient norm on any rank skips that optimizer and warm-up step
(``actor/nan_steps_skipped``); the warm-up is fsdp's ``warmup_factor``; AdamW decays every parameter (megatron's
default would exempt norms and biases); metric names are fsdp's. How the exact global normalisation survives
megatron: ``calculate_per_token_loss`` is on, so the schedule does not divide the loss by the number of
micro-batches and DDP sums (not averages) gradients over data-parallel ranks; our finalize hook passes no token
count, so nothing rescales them. Every micro-batch loss is already divided by the global counts, so the summed
gradient is exactly the gradient of the global minibatch loss, at any TP / PP / DP / micro-batching.

Data. Like fsdp, every rank is handed its own shard (the driver splits the batch over all ranks). The ranks of
one model-parallel group (TP x PP) must run the same samples, so the engine all-gathers their shards (minibatch
j of the group = the ranks' minibatch j, in group order) and each rank returns its own rows. Micro-batches are
right-padded [b, S] with a causal mask (right padding never reaches earlier positions), because packed
sequences need Transformer Engine's THD attention: ``actor.use_remove_padding`` is ignored here. Micro-batch
counts are equalised over all ranks with zero-weight dummy passes (MoE expert-parallel all-to-alls are
collectives across data-parallel ranks). With ``actor.context_parallel_size`` > 1 the group is TP x CP, each
micro-batch is cut into Megatron's zigzag layout and log-probs are summed over CP: see :mod:`.megatron_cp`.

Log-probs are vocab-parallel: the LM head's output stays sharded over TP and ``log_softmax(logits / T)[y]`` comes
from megatron's ``vocab_parallel_cross_entropy`` (TP all-reduces of the max, the target logit and the sum of
exponentials), computed only at response positions; no rank ever holds the full-vocabulary logits. Only the last
pipeline stage computes them; they are broadcast to the other stages.

How we differ from verl's megatron actor: global-count normalisation instead of per-micro-batch means; the skip
rule above (verl steps on a finite norm only); the driver needs no model-parallel-aware dispatch (the engine
gathers); weights are exported under the exact HF ``state_dict`` names (fused experts in transformers 5), not
mbridge's checkpoint names; the CPU path runs megatron's local layer spec through our CUDA->CPU shim.

Device paths. CPU (and the emulated NPU without MindSpeed, CI's venv): the shim's CUDA redirection is installed
before megatron.core is imported; the local layer spec; no sequence parallelism (impossible with the local spec on
CPU: gloo has no reduce-scatter), so no MoE with TP > 1. CUDA: the Transformer Engine spec when TE is installed,
the local spec otherwise.

NPU, and the emulated NPU where the real MindSpeed is installed (:func:`.mindspeed_setup.enabled`; tests/mindspeed):
MindSpeed is configured from the config, in this process, before anything imports megatron:
``mindspeed_setup.apply(mindspeed_args(cfg, moe=...))`` imports ``mindspeed.megatron_adaptor`` with a neutral
``sys.argv`` (a Ray actor's argv is Ray's) and ``repatch``-es it with our arguments; MindSpeed's TransformerConfig
wrapper then puts them into every config mbridge builds (flash attention, fused RMSNorm / RoPE / SwiGLU, grouped
GEMM for experts, MC2, the CP algorithm). Layer spec: megatron's local spec, on which every one of those features
lands: flash attention patches ``DotProductAttention.forward`` (MindSpeed builds the compressed causal mask,
sparse_mode 2, so the engine's ``attention_mask=None`` works), PTNorm replaces the local norms, the RoPE and
SwiGLU functions are replaced (the dense MLP reaches fused SwiGLU through ``bias_activation_fusion=True``),
``moe_grouped_gemm=True`` builds ``GroupedMLP``, which MindSpeed replaces by ``MindSpeedGmmExperts`` (its own
grouped-matmul op), CP replaces the core attention class (``MindSpeedCPDotProductAttention``, ring algorithm on
Megatron's chunk layout, which :mod:`.megatron_cp` produces), MC2 replaces the column / row parallel linears. The
TE spec (verl's choice on NPU) would get MindSpeed's TE stand-ins instead; its grouped experts
(``MindSpeedTEGroupedLinear``) take the weight gradient with ``npu_grouped_matmul(group_type=2)``, which torch_npu
2.7.1 refuses ("group_type only support -1 and 0"), and mbridge's TE names are already served by
:class:`.megatron_bridge.TENamedView` (grouped experts included). MindSpeed turns megatron's Adam into its AdamW
(``torch._fused_adamw_``): same update (tested against the fsdp engine).

MindSpeed's process-wide patches (its adaptor, for every module of the process; tests/mindspeed lists them):
``torch.compile`` and ``torch.jit.script`` become pass-throughs, ``Tensor.view`` first makes a non-contiguous
tensor contiguous (a view of a copy: writes through it are lost), ``Tensor.type`` / ``Parameter.type`` report
"cuda" for "npu", ``all_reduce`` of float64 goes through float32, ``_all_gather_base`` / ``_reduce_scatter_base``
become their tensor versions, ``importlib.metadata.version("transformer-engine")`` answers 2.2.0,
CUDA's device-capability query is replaced, and stand-in modules (apex, amp_C, flash_attn,
transformer_engine, ...) appear in ``sys.modules``. MindSpeed's float64 all-reduce bypass reduces a float32 *copy*
and drops it, so the caller's tensor keeps its local value: every float64 all-reduce of the process (ours: token
counts, micro-batch counts, the skip flag, metrics) would silently do nothing; :func:`.mindspeed_setup.apply`
wraps it to copy the result back. The vLLM rollout: with ``rollout.tensor_parallel_size`` 1, vLLM 0.11 runs its
engine core and worker in processes it *spawns* (in a Ray actor it forces spawn: ``vllm/utils._maybe_force_spawn``),
which never import MindSpeed, so none of this reaches them. With rollout TP > 1 (``external_launcher``) vLLM runs
in this process, and the rollout engine makes each of its vLLM calls with these torch patches lifted
(:func:`.mindspeed_setup.patches_lifted`), so vLLM / vllm-ascend meet torch as torch_npu leaves it: views alias,
``torch.compile`` compiles (``rollout.enforce_eager: false`` means graphs there too), float64 reduces natively.

One file of ~870 lines because set-up, forward, update, checkpoint and export all work on one model / optimizer /
process-group state under megatron's call protocol; what has a concern of its own lives beside it
(:mod:`.megatron_bridge` weights and names, :mod:`.megatron_cp` context parallelism, :mod:`.megatron_compat`
release differences, :mod:`.mindspeed_setup` MindSpeed's configuration).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gspo_ascend.algorithms import count_tokens_and_seqs, get_policy_loss
from gspo_ascend.config import Config
from gspo_ascend.device import Backend
from gspo_ascend.engines import megatron_bridge as mb
from gspo_ascend.engines import megatron_cp as cp_support
from gspo_ascend.engines import mindspeed_setup
from gspo_ascend.engines.base import SampleBatch, existing_rank_file
from gspo_ascend.engines.hf_export import write_hf_checkpoint
from gspo_ascend.engines.logprobs import response_lengths
from gspo_ascend.engines.megatron_compat import (
    decay_every_parameter,
    destroy_model_parallel,
    patch_megatron_core,
    uses_decoupled_grads,
)
from gspo_ascend.engines.megatron_offload import OFFLOAD_PARTS, Offload, part_bytes
from gspo_ascend.engines.microbatch import micro_batches
from gspo_ascend.engines.train_common import (
    MinibatchRecord,
    check_update_batch,
    ensure_process_group,
    on_device,
    policy_objective,
    select_device,
    update_metrics,
    warmup_factor,
)
from gspo_ascend.errors import ConfigError, UserError
from gspo_ascend.megatron_settings import ddp_config

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
CHECKPOINT_FORMAT = 1


# ----------------------------------------------------------------------------------------------- set-up helpers


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
        (hf.num_key_value_heads % tp == 0, f"num_key_value_heads ({hf.num_key_value_heads}) must divide by TP"),
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


# ----------------------------------------------------------------------------------------------- micro-batches


@dataclass
class _Micro:
    """One forward pass: a right-padded [b, S] token block and where each response token's log-prob comes from
    (row, position predicting it) and goes to (row, column of the [b, R] output)."""

    tokens: torch.Tensor  # [b, S] int64
    position_ids: torch.Tensor  # [b, S]
    rows: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    cols: torch.Tensor  # [N]
    labels: torch.Tensor  # [N]
    shape: tuple[int, int]  # (b, R)
    sample: SampleBatch | None = None  # None for a dummy pass
    index: list[int] | None = None  # rows of the (mini)batch this micro-batch holds
    ref_log_probs: torch.Tensor | None = None  # [b, R], with algorithm.kl_coef > 0


def _build_micro(batch: SampleBatch, pad_id: int, multiple: int, device, index: list[int] | None) -> _Micro:
    lengths = response_lengths(batch)
    seqs = [list(p) + row[:n] for p, row, n in zip(batch.prompt_ids, batch.response_ids.tolist(), lengths, strict=True)]
    width = max(len(s) for s in seqs)
    width = -(-width // multiple) * multiple  # sequence parallelism splits S over TP ranks
    tokens = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    rows, positions, cols, labels = [], [], [], []
    for i, (seq, prompt, n) in enumerate(zip(seqs, batch.prompt_ids, lengths, strict=True)):
        tokens[i, : len(seq)] = torch.tensor(seq)
        rows += [i] * n
        positions += range(len(prompt) - 1, len(prompt) - 1 + n)  # logits at len(prompt)-1+t predict token t
        cols += range(n)
        labels += seq[len(prompt) :]

    def t(values):
        return torch.tensor(values, dtype=torch.long, device=device)

    b, r = batch.response_ids.shape
    return _Micro(
        tokens=tokens.to(device),
        position_ids=torch.arange(width, device=device).expand(len(seqs), width),
        rows=t(rows),
        positions=t(positions),
        cols=t(cols),
        labels=t(labels),
        shape=(b, r),
        sample=batch if index is not None else None,
        index=index,
    )


def _dummy_batch(pad_id: int) -> SampleBatch:
    zeros = torch.zeros((1, 1))
    return SampleBatch([[pad_id]], zeros.long(), zeros)


def vocab_parallel_log_probs(logits: torch.Tensor, micro: _Micro, temperature: float) -> torch.Tensor:
    """[b, R] float32 ``log_softmax(logits / T)[y]`` from TP-sharded logits [b, S, V/TP] (0 at padding), without
    gathering the vocabulary: megatron's vocab-parallel cross entropy all-reduces max / target / sum-exp."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    if micro.rows.numel() == 0:  # keep the graph connected: every rank must take part in the backward
        return logits.new_zeros(micro.shape, dtype=torch.float32) + 0.0 * logits.sum()
    picked = logits[micro.rows, micro.positions].float()  # [N, V/TP]
    if temperature != 1.0:
        picked = picked / temperature
    lp = -vocab_parallel_cross_entropy(picked, micro.labels)  # [N]
    return lp.new_zeros(micro.shape).index_put((micro.rows, micro.cols), lp)


# ----------------------------------------------------------------------------------------------- the engine


class MegatronEngine:
    """TrainEngine (engines/base.py) over megatron-core; see the module docstring."""

    def __init__(self, cfg: Config, backend: Backend, model_path: str, *, force_offload: bool = False) -> None:
        """``force_offload``: run the actor.offload mechanism even on CPU (where it only costs time), for tests."""
        _check_config(cfg, backend)
        self.cfg, self.backend = cfg, backend
        self.owns_process_group = ensure_process_group(backend)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.device = select_device(backend, self.rank)
        self.model_path = model_path
        self.hf_config = mb.load_hf_config(model_path)
        on_cpu = backend.torch_device_type == "cpu"
        self.mindspeed = mindspeed_setup.enabled(backend)
        # MoE + TP needs SP, which the local spec cannot run on CPU; under MindSpeed (the emulated NPU) it runs
        _check_model(cfg, self.hf_config, self.world_size, on_cpu and not self.mindspeed)
        self.moe = bool(getattr(self.hf_config, "num_experts", None))
        # MindSpeed's arguments come from the config, in this process (a Ray actor's sys.argv is Ray's)
        ms_args = mindspeed_setup.mindspeed_args(cfg, moe=self.moe) if self.mindspeed else None
        _import_megatron(backend, ms_args)
        self.compute_dtype = _DTYPES[cfg.model.dtype]
        self.owns_parallel_state = self._init_parallel_state()
        self._init_groups()
        use_te = backend.name == "cuda" and mb.transformer_engine_available()
        self.rename = not use_te  # local-spec names -> TE names for mbridge
        overrides = _transformer_overrides(cfg, backend, self.moe, use_te)
        overrides.update(cp_support.transformer_overrides(cfg, backend, use_te))
        self.bridge = mb.make_bridge(self.hf_config, self.compute_dtype, overrides, use_te)
        self.cp_attention = cp_support.local_attention_needed(self.cp, backend, use_te)
        if self.cp_attention:  # the local spec's attention cannot do CP: ours (megatron_cp.py) takes its place
            cp_support.use_local_cp_attention(self.bridge)
        self.models = self._build_models(trainable=True)
        self.ref_models = self._build_models(trainable=False) if cfg.algorithm.kl_coef > 0 else None
        self.tconfig = mb.unwrap(self.models[0]).config
        self.tconfig.finalize_model_grads_func = _finalize_grads
        self.optimizer = self._build_optimizer()
        self.layout = mb.HFLayout(self.hf_config)
        self.policy_loss = get_policy_loss(cfg.algorithm.loss)  # an attribute so tests can wrap it
        self.pad_id = int(getattr(self.hf_config, "pad_token_id", None) or 0)
        self.seq_multiple = self.tp if self.tconfig.sequence_parallel else 1
        self.optimizer_steps = 0  # the warm-up schedule's position (skipped steps do not advance it)
        self.nan_steps_total = 0
        self._offload = Offload(self) if (force_offload or not on_cpu) and cfg.actor.offload else None
        if self._offload is not None:
            self._offload.to_host(OFFLOAD_PARTS)

    # ------------------------------------------------------------------------------------------- set-up

    def _init_parallel_state(self) -> bool:
        from megatron.core import parallel_state, tensor_parallel

        a = self.cfg.actor
        sizes = (a.tensor_parallel_size, a.pipeline_parallel_size, a.expert_parallel_size)
        sizes += (a.expert_tensor_parallel_size, a.context_parallel_size)
        if parallel_state.model_parallel_is_initialized():
            current = (
                parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_pipeline_model_parallel_world_size(),
                parallel_state.get_expert_model_parallel_world_size(),
                parallel_state.get_expert_tensor_parallel_world_size(),
                parallel_state.get_context_parallel_world_size(),
            )
            if current != sizes:
                raise UserError(
                    f"megatron's parallel state is already set up as TP/PP/EP/ETP/CP {current}, not {sizes}"
                )
            return False
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=sizes[0],
            pipeline_model_parallel_size=sizes[1],
            expert_model_parallel_size=sizes[2],
            expert_tensor_parallel_size=sizes[3],
            context_parallel_size=sizes[4],  # mbridge reads it into the TransformerConfig; DDP reduces over DP x CP
        )
        # the RNG tracker megatron needs for TP (on the shim this also reseeds the CPU generator with the seed)
        tensor_parallel.model_parallel_cuda_manual_seed(self.cfg.trainer.seed)
        return True

    def _init_groups(self) -> None:
        from megatron.core import parallel_state as ps

        self.tp = ps.get_tensor_model_parallel_world_size()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp = ps.get_pipeline_model_parallel_world_size()
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.last_stage = ps.is_pipeline_last_stage()
        self.dp_group = ps.get_data_parallel_group()  # without CP: the CP ranks of a replica share samples
        self.cp, self.cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
        self.cp_group = ps.get_context_parallel_group() if self.cp > 1 else None
        # the ranks that run the same samples: TP x PP, or TP x CP (CP with PP is refused)
        self.mp_group = ps.get_tensor_and_context_parallel_group() if self.cp > 1 else ps.get_model_parallel_group()
        self.mp_size, self.mp_rank = dist.get_world_size(self.mp_group), dist.get_rank(self.mp_group)
        # one rank per data-parallel replica reports metrics (the last stage's first TP and CP rank)
        self.reports = self.last_stage and self.tp_rank == 0 and self.cp_rank == 0

    def _build_models(self, trainable: bool) -> list[torch.nn.Module]:
        a = self.cfg.actor
        ddp = ddp_config(a.use_distributed_optimizer)  # the planner sizes gradients from the same settings
        models = self.bridge.get_model(
            bf16=self.compute_dtype == torch.bfloat16,
            wrap_with_ddp=trainable,
            ddp_config=ddp,
            data_parallel_random_init=False,
        )
        views = [self._view(m) for m in models]
        self.bridge.load_weights(views, self.model_path)
        for view in views:
            view.flush()  # grouped experts (MindSpeed's grouped GEMM) are loaded through staging copies
        if self.cp_attention:
            for model in models:
                cp_support.localise_rope(model, self.cp, self.cp_rank)
        if not trainable:
            for model in models:
                model.requires_grad_(False)
                model.eval()
        return models

    def _view(self, model: torch.nn.Module) -> mb.TENamedView:
        return mb.TENamedView(mb.unwrap(model), self.moe, self.rename)

    def _build_optimizer(self):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        a = self.cfg.actor
        config = OptimizerConfig(
            optimizer="adam",  # torch AdamW (decoupled decay) without TE/Apex, their fused AdamW otherwise
            lr=a.lr,
            min_lr=a.lr,
            weight_decay=a.weight_decay,
            adam_beta1=0.9,
            adam_beta2=0.999,
            adam_eps=1e-8,
            clip_grad=a.grad_clip,
            bf16=self.compute_dtype == torch.bfloat16,
            params_dtype=self.compute_dtype,
            use_distributed_optimizer=a.use_distributed_optimizer,
        )
        # decay every parameter like the fsdp engine (megatron's default exempts norms and biases)
        return get_megatron_optimizer(config, self.models, **decay_every_parameter(get_megatron_optimizer))

    def _sub_optimizers(self) -> list:
        return list(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))

    @contextlib.contextmanager
    def _resident(self, parts: tuple[str, ...] = OFFLOAD_PARTS):
        """``parts`` of the offloaded state on the device for the duration: all of it for compute, only the
        parameters for a weight export (the sync runs beside the rollout engine's weights; the gradient buffers
        and optimizer state would double the sync's peak). Re-entrant: what an outer call brought stays."""
        brought = () if self._offload is None else self._offload.to_device(parts)
        try:
            yield
        finally:
            if brought:
                self._offload.to_host(brought)
                self.backend.empty_cache()

    def resident_bytes(self) -> dict[str, int]:
        """Bytes of each offloadable part on the device now (every part when actor.offload is off)."""
        if self._offload is None:
            return part_bytes(self)
        return self._offload.resident_bytes()

    def close(self) -> None:
        """Tear down megatron's parallel state and the process group if this engine created them."""
        if self.owns_parallel_state:
            destroy_model_parallel()
            self.owns_parallel_state = False
        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
            self.owns_process_group = False

    # ------------------------------------------------------------------------------------------- helpers

    def _all_reduce(self, values, op=dist.ReduceOp.SUM, group=None) -> torch.Tensor:
        t = torch.as_tensor(values, dtype=torch.float64, device=self.device)
        if dist.get_world_size(group) > 1:
            dist.all_reduce(t, op=op, group=group)
        return t.cpu()

    def _group_shards(self, batch: SampleBatch) -> list[SampleBatch]:
        """The shards of every rank of this model-parallel group, in group order (see the module docstring)."""
        if self.mp_size == 1:
            return [batch]
        shards: list[Any] = [None] * self.mp_size
        dist.all_gather_object(shards, batch, group=self.mp_group)
        return shards

    def _micros(self, batch: SampleBatch, ref: torch.Tensor | None = None) -> list[_Micro]:
        """Micro-batches of ``batch`` padded with dummy passes to the most any rank runs."""
        a = self.cfg.actor
        parts, plan = micro_batches(batch, a.micro_batch_size, a.max_tokens_per_micro_batch)
        passes = int(self._all_reduce([len(parts)], dist.ReduceOp.MAX)[0])
        micros = []
        for part, index in zip(parts, plan.groups, strict=True):
            micro = _build_micro(part, self.pad_id, self.seq_multiple, self.device, index)
            micro.ref_log_probs = None if ref is None else ref[index].to(self.device)
            micros.append(micro)
        dummy = _dummy_batch(self.pad_id)  # every pass is a collective (TP, PP, EP): ranks run the same count
        micros += [_build_micro(dummy, self.pad_id, 1, self.device, None) for _ in range(passes - len(parts))]
        if self.cp > 1:  # this rank's zigzag part of every micro-batch (megatron_cp.py)
            micros = [cp_support.shard_micro(m, self.cp, self.cp_rank, self.seq_multiple, self.pad_id) for m in micros]
        self._oversized = plan.oversized
        return micros

    def _schedule(self, models, micros: list[_Micro], forward_only: bool, loss_fn) -> None:
        """One pass of megatron's forward(-backward) schedule (1F1B with PP > 1) over ``micros``."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        one = torch.ones((), dtype=torch.int, device=self.device)

        def forward_step(data_iterator, model):
            micro = next(data_iterator)
            output = model(micro.tokens, micro.position_ids, None)  # last stage: logits [b, S, V/TP]

            def loss(output_tensor):
                value, reported = loss_fn(micro, output_tensor)
                return value, one, reported

            return output, loss

        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(micros),
            model=models,
            num_microbatches=len(micros),
            seq_length=max(m.tokens.shape[1] for m in micros),
            micro_batch_size=max(m.tokens.shape[0] for m in micros),
            forward_only=forward_only,
        )

    def _forward_only(self, models, batch: SampleBatch, temperature: float) -> torch.Tensor:
        """[B, R] float32 host log-probs of the whole (group) batch, on every rank of the pipeline."""
        out = torch.zeros(tuple(batch.response_ids.shape), dtype=torch.float32)

        def loss_fn(micro: _Micro, logits: torch.Tensor):
            lp = cp_support.sum_over_cp(vocab_parallel_log_probs(logits, micro, temperature), self.cp_group)
            if micro.index is not None:
                out[micro.index] = lp.float().cpu()
            return lp.sum() * 0.0, {}

        for model in models:
            model.eval()
        with torch.no_grad():
            self._schedule(models, self._micros(batch), True, loss_fn)
        if self.pp > 1:  # only the last stage computed them
            moved = out.to(self.device)
            dist.broadcast(moved, src=dist.get_global_rank(self.pp_group, self.pp - 1), group=self.pp_group)
            out = moved.cpu()
        return out

    # ------------------------------------------------------------------------------------------- contract

    @on_device
    def compute_log_probs(self, batch: SampleBatch, temperature: float) -> torch.Tensor:
        """[B, R] float32 on the host, no grad, for this rank's rows."""
        shards = self._group_shards(batch)
        full = self._forward_only(self.models, SampleBatch.concat(shards), temperature)
        start = sum(len(s) for s in shards[: self.mp_rank])
        return full[start : start + len(batch)]

    @on_device
    def update(self, batch: SampleBatch, temperature: float) -> dict[str, float]:
        k = self.cfg.algorithm.minibatches_per_rollout
        check_update_batch(batch, k)
        shards = [s.split(k) for s in self._group_shards(batch)]
        records = []
        for j in range(k):
            record = self.backward_minibatch(SampleBatch.concat([s[j] for s in shards]), temperature)
            self._step(record)
            records.append(record)
        return self._metrics(records)

    @on_device
    def backward_minibatch(self, minibatch: SampleBatch, temperature: float) -> MinibatchRecord:
        """Forward/backward every micro-batch of one (model-parallel group) minibatch; the reduced gradients are
        left in megatron's buffers. Public for tests that want a gradient without an optimizer step."""
        tokens, seqs = count_tokens_and_seqs(minibatch.response_mask)
        global_tokens, global_seqs = self._all_reduce([int(tokens), int(seqs)], group=self.dp_group).tolist()
        counts = {
            "global_tokens": global_tokens,
            "global_seqs": global_seqs,
            "norm_length": minibatch.response_ids.shape[1],
        }
        ref = None
        if self.ref_models is not None:
            ref = self._forward_only(self.ref_models, minibatch, temperature)
        micros = self._micros(minibatch, ref)
        record = MinibatchRecord(passes=len(micros))
        if self.reports:
            record.sums["oversized_samples"] = float(self._oversized)
        bad = torch.zeros((), dtype=torch.bool, device=self.device)

        def loss_fn(micro: _Micro, logits: torch.Tensor):
            nonlocal bad
            lp = cp_support.sum_over_cp(vocab_parallel_log_probs(logits, micro, temperature), self.cp_group)
            if micro.sample is None:
                return lp.sum() * 0.0, {}
            loss, metrics = self._micro_loss(lp, micro, counts)
            bad = bad | ~torch.isfinite(loss.detach())
            if self.reports:
                record.add(metrics)
            return loss, {}

        for model in self.models:
            model.train()
            model.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._schedule(self.models, micros, False, loss_fn)
        record.skipped = bool(bad)
        return record

    def _micro_loss(self, log_prob: torch.Tensor, micro: _Micro, counts: dict[str, Any]):
        d, alg, sample = self.device, self.cfg.algorithm, micro.sample
        mask = sample.response_mask.to(d)
        return policy_objective(
            self.policy_loss,
            alg,
            log_prob,
            sample.old_log_probs.to(d),
            sample.advantages.to(d),
            mask,
            counts,
            micro.ref_log_probs,
        )

    def _step(self, record: MinibatchRecord) -> None:
        """Clip + optimizer step, or, on a non-finite loss (any rank) or grad norm, skip it and the warm-up step.
        megatron's own ``optimizer.step()`` would step on a NaN norm without a loss scaler, so we take it apart
        into its public pieces: prepare_grads, get_grad_norm, clip, step_with_ready_grads."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        bad = self._all_reduce([float(record.skipped)], dist.ReduceOp.MAX)[0] > 0
        found_inf = self.optimizer.prepare_grads()
        norm = float(self.optimizer.get_grad_norm() or 0.0)  # global over all model-parallel and DP shards
        if bad or found_inf or not math.isfinite(norm):
            self.optimizer.zero_grad()
            record.skipped = True
            self.nan_steps_total += 1
            return
        if self.cfg.actor.grad_clip > 0:
            for sub in self._sub_optimizers():
                params = sub.get_parameters()
                if params:
                    decoupled = uses_decoupled_grads(sub.config)
                    clip_grad_by_total_norm_fp32(params, self.cfg.actor.grad_clip, norm, decoupled)
        lr = self.cfg.actor.lr * warmup_factor(self.cfg.actor.warmup_steps)(self.optimizer_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
        self.optimizer.step_with_ready_grads()
        self.optimizer_steps += 1
        record.grad_norm, record.lr = norm, lr

    def _metrics(self, records: list[MinibatchRecord]) -> dict[str, float]:
        lr = self.cfg.actor.lr * warmup_factor(self.cfg.actor.warmup_steps)(self.optimizer_steps)
        return update_metrics(records, self.device, lr)

    # ------------------------------------------------------------------------------------------- weights

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor of the HF ``state_dict``, full (TP / EP shards gathered, PP stages broadcast), in the
        compute dtype, on this rank's device. Collective: every rank must iterate to the end."""
        with self._resident(("params",)):
            stream = self.bridge.export_weights([self._view(m) for m in self.models])
            for name, tensor in self.layout.convert(stream):
                yield name, tensor.detach().to(self.compute_dtype).contiguous()

    @on_device
    def save_hf(self, path: str, tokenizer: Any) -> None:
        """safetensors (sharded at 5 GiB) + config + generation config + tokenizer, written by rank 0."""
        generation_config = None
        with contextlib.suppress(OSError):  # a checkpoint without generation_config.json
            from transformers import GenerationConfig

            generation_config = GenerationConfig.from_pretrained(self.model_path)
        write_hf_checkpoint(
            path,
            self.export_weights(),
            rank=self.rank,
            shapes=self.layout.meta_state,
            names=[n for n in self.layout.shapes if n not in self.layout.tied],
            dtype=self.compute_dtype,
            hf_config=self.hf_config,
            generation_config=generation_config,
            tokenizer=tokenizer,
        )
        dist.barrier()

    # ------------------------------------------------------------------------------------------- checkpoints

    def _rank_file(self, path: str) -> Path:
        return Path(path) / f"megatron_rank{self.rank}.pt"

    def _layout_tag(self) -> dict[str, int]:
        a = self.cfg.actor
        return {
            "world": self.world_size,
            "tp": a.tensor_parallel_size,
            "pp": a.pipeline_parallel_size,
            "ep": a.expert_parallel_size,
            "etp": a.expert_tensor_parallel_size,
            "distributed_optimizer": int(a.use_distributed_optimizer),
            # only when > 1, so checkpoints written before CP existed keep their tag
            **({"cp": a.context_parallel_size} if a.context_parallel_size > 1 else {}),
        }

    @on_device
    def save_checkpoint(self, path: str) -> None:
        """This rank's model shard, optimizer shard (inner AdamW state + float32 main weights), warm-up position and
        RNG states (CPU, device, megatron's TP RNG tracker) into ``megatron_rank{r}.pt``: bitwise resume at the
        same parallel layout."""
        from megatron.core import tensor_parallel

        state = {
            "format": CHECKPOINT_FORMAT,
            "layout": self._layout_tag(),
            "models": [mb.unwrap(m).state_dict() for m in self.models],
            "optimizers": [
                {
                    "inner": sub.optimizer.state_dict(),
                    "main": [p.detach().clone() for g in sub.optimizer.param_groups for p in g["params"]],
                }
                for sub in self._sub_optimizers()
            ],
            "optimizer_steps": self.optimizer_steps,
            "nan_steps_total": self.nan_steps_total,
            "cpu_rng": torch.get_rng_state(),
            "device_rng": None if self.backend.torch_device_type == "cpu" else self.backend.module().get_rng_state(),
            "tracker_rng": tensor_parallel.get_cuda_rng_tracker().get_states(),
        }
        Path(path).mkdir(parents=True, exist_ok=True)  # like torch.distributed.checkpoint (what fsdp uses) does
        torch.save(state, self._rank_file(path))
        dist.barrier()

    @on_device
    def load_checkpoint(self, path: str) -> None:
        from megatron.core import tensor_parallel

        rank_file = existing_rank_file(path, self._rank_file(path).name)
        state = torch.load(rank_file, weights_only=False)  # our own file: RNG tracker states are plain objects
        if state.get("layout") != self._layout_tag():
            raise UserError(
                f"checkpoint '{path}' was written with parallel layout {state.get('layout')}, this run is "
                f"{self._layout_tag()}; resume with the same actor.*_parallel_size and world size"
            )
        for model, model_state in zip(self.models, state["models"], strict=True):
            mb.unwrap(model).load_state_dict(model_state, strict=True)
        for sub, saved in zip(self._sub_optimizers(), state["optimizers"], strict=True):
            params = [p for g in sub.optimizer.param_groups for p in g["params"]]
            with torch.no_grad():
                for param, value in zip(params, saved["main"], strict=True):
                    param.copy_(value)
            sub.optimizer.load_state_dict(saved["inner"])
        self.optimizer_steps = state["optimizer_steps"]
        self.nan_steps_total = state["nan_steps_total"]
        torch.set_rng_state(state["cpu_rng"])
        if state["device_rng"] is not None:
            self.backend.module().set_rng_state(state["device_rng"])
        tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker_rng"])
