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
packed with ``actor.use_remove_padding`` (the default) and CP 1: one row of the sequences end to end (megatron's
THD format, ``PackedSeqParams`` with their boundaries; RoPE restarts per sequence from them), which every core
attention we build takes: ours without TE (one causal attention per sequence, one varlen call per layer on CUDA in
half precision; :mod:`.megatron_attention`), MindSpeed's flash attention (TND, the same boundaries), Transformer
Engine's. Otherwise (``use_remove_padding: false``, or CP > 1, whose zigzag layout is per padded row: said once)
right-padded [b, S] with a causal mask (right padding never reaches earlier positions). Micro-batch counts are
equalised over all ranks with zero-weight dummy passes (MoE expert-parallel all-to-alls are collectives across
data-parallel ranks). With ``actor.context_parallel_size`` > 1 the group is TP x CP, each
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
the local spec otherwise. On the local spec without MindSpeed the core attention is one fused SDPA call
(:mod:`.megatron_attention`), not the spec's ``DotProductAttention`` and its ``[S, S]`` scores (CP > 1:
:mod:`.megatron_cp`'s).

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

Where the code lives: this module holds the engine class and its set-up (parallel state, groups, models, optimizer,
offload residency, teardown); two mixins add what works on that one model / optimizer / process-group state under
megatron's call protocol: :class:`.megatron_train.MegatronTrainStep` (forward, backward, the optimizer step) and
:class:`.megatron_checkpoint.MegatronCheckpointing` (weight export, checkpoints). :mod:`.megatron_setup` holds what
comes before the model is built (megatron's import on this device, the config checks, our TransformerConfig
settings, the finalize hook). What has a concern of its own lives beside them (:mod:`.megatron_bridge` weights and
names, :mod:`.megatron_cp` context parallelism, :mod:`.megatron_compat` release differences, :mod:`.megatron_offload`
actor.offload, :mod:`.megatron_routing` MoE routing replay and agreement through megatron-core's RouterReplay,
:mod:`.mindspeed_setup` MindSpeed's configuration).
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.distributed as dist

from gspo_ascend.config import Config
from gspo_ascend.device import Backend
from gspo_ascend.engines import megatron_attention, megatron_routing, mindspeed_setup
from gspo_ascend.engines import megatron_bridge as mb
from gspo_ascend.engines import megatron_cp as cp_support
from gspo_ascend.engines.megatron_checkpoint import CHECKPOINT_FORMAT, MegatronCheckpointing
from gspo_ascend.engines.megatron_compat import decay_every_parameter, destroy_model_parallel
from gspo_ascend.engines.megatron_offload import OFFLOAD_PARTS, Offload, part_bytes
from gspo_ascend.engines.megatron_setup import (
    _DTYPES,
    _check_config,
    _check_model,
    _finalize_grads,
    _import_megatron,
    _transformer_overrides,
)
from gspo_ascend.engines.megatron_train import MegatronTrainStep, vocab_parallel_log_probs
from gspo_ascend.engines.train_common import (
    engine_policy_loss,
    ensure_process_group,
    select_device,
    sized_token_budget,
)
from gspo_ascend.errors import UserError
from gspo_ascend.megatron_settings import ddp_config

log = logging.getLogger(__name__)

__all__ = ["CHECKPOINT_FORMAT", "MegatronEngine", "vocab_parallel_log_probs"]


class MegatronEngine(MegatronTrainStep, MegatronCheckpointing):
    """TrainEngine (engines/base.py) over megatron-core; see the module docstring."""

    def __init__(self, cfg: Config, backend: Backend, model_path: str, *, force_offload: bool = False) -> None:
        """``force_offload``: run the actor.offload mechanism even on CPU (where it only costs time), for tests."""
        _check_config(cfg, backend)
        self.hf_config = mb.load_hf_config(model_path)
        megatron_routing.check_model(cfg.actor.routing_replay, self.hf_config)  # before anything starts
        self.cfg, self.backend = cfg, backend
        self.owns_process_group = ensure_process_group(backend)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.device = select_device(backend, self.rank)
        self.cfg = cfg = sized_token_budget(cfg, backend, self.device, model_path, self.rank == 0)
        self.model_path = model_path
        on_cpu = backend.torch_device_type == "cpu"
        self.mindspeed = mindspeed_setup.enabled(backend)
        # MoE + TP needs SP, which the local spec cannot run on CPU; under MindSpeed (the emulated NPU) it runs
        _check_model(cfg, self.hf_config, self.world_size, on_cpu and not self.mindspeed)
        self.moe = bool(getattr(self.hf_config, "num_experts", None))
        # MindSpeed's arguments come from the config, in this process (a Ray actor's sys.argv is Ray's)
        ms_args = mindspeed_setup.mindspeed_args(cfg, moe=self.moe) if self.mindspeed else None
        _import_megatron(backend, ms_args)
        megatron_routing.check_megatron(cfg.actor.routing_replay)
        self.compute_dtype = _DTYPES[cfg.model.dtype]
        self.owns_parallel_state = self._init_parallel_state()
        self._init_groups()
        use_te = backend.name == "cuda" and mb.transformer_engine_available()
        self.rename, self.use_te = not use_te, use_te  # rename: local-spec names -> TE names for mbridge
        self.packed = self._packed(cfg)
        overrides = _transformer_overrides(cfg, backend, self.moe, use_te)
        overrides.update(cp_support.transformer_overrides(cfg, backend, use_te))
        self.bridge = mb.make_bridge(self.hf_config, self.compute_dtype, overrides, use_te)
        self.cp_attention = cp_support.local_attention_needed(self.cp, backend, use_te)
        if self.cp_attention:  # the local spec's attention cannot do CP: ours (megatron_cp.py) takes its place
            cp_support.use_local_cp_attention(self.bridge)
        elif not use_te and not self.mindspeed:  # one fused SDPA call, not the spec's [S, S] scores (#43)
            megatron_attention.use_sdpa_attention(self.bridge)
        self.models = self._build_models(trainable=True)
        self.ref_models = self._build_models(trainable=False) if cfg.algorithm.kl_coef > 0 else None
        if self.mindspeed and self.packed:  # its flash attention takes TND ends without the leading 0
            mindspeed_setup.ends_for_flash_attention([*self.models, *(self.ref_models or [])])
        self.tconfig = mb.unwrap(self.models[0]).config
        self.tconfig.finalize_model_grads_func = _finalize_grads
        self.optimizer = self._build_optimizer()
        # MoE routing replay and agreement (megatron_routing.py): the policy's routers; the KL reference's route freely
        parallel, mode = (self.tp, self.tp_rank, self.cp), cfg.actor.routing_replay
        self.routing = megatron_routing.attach(mode, self.models, self.tconfig, parallel, self.rank == 0)
        self.routes = None if self.routing is None else self.routing.book
        if self.routes is not None:
            self.routes.wait = backend.synchronize  # the old forward's routes are downloaded without a wait
        self.layout = mb.HFLayout(self.hf_config)
        self.policy_loss = engine_policy_loss(cfg, backend)  # an attribute so tests can wrap it
        self.pad_id = int(getattr(self.hf_config, "pad_token_id", None) or 0)
        self.seq_multiple = self.tp if self.tconfig.sequence_parallel else 1
        self.optimizer_steps = 0  # the warm-up schedule's position (skipped steps do not advance it)
        self.nan_steps_total = 0
        self._offload = Offload(self) if (force_offload or not on_cpu) and cfg.actor.offload else None
        if self._offload is not None:
            self._offload.to_host(OFFLOAD_PARTS)

    # ------------------------------------------------------------------------------------------- set-up

    def _packed(self, cfg: Config) -> bool:
        """Packed THD micro-batches (``actor.use_remove_padding``): without CP every core attention we build takes
        them (ours, MindSpeed's flash attention, TE's). With CP > 1 the zigzag layouts are per padded row, so the
        micro-batches stay padded, said once."""
        if cfg.actor.use_remove_padding and self.cp > 1 and self.rank == 0:
            print(
                "note: actor.use_remove_padding: with actor.context_parallel_size > 1 the megatron engine runs "
                "right-padded micro-batches (packed THD needs context_parallel_size 1)",
                flush=True,
            )
        return bool(cfg.actor.use_remove_padding) and self.cp == 1

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
        megatron_routing.release(self.models + (self.ref_models or []))
        if self.owns_parallel_state:
            destroy_model_parallel()
            self.owns_parallel_state = False
        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
            self.owns_process_group = False
