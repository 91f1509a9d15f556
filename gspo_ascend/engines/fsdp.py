"""The ``fsdp`` train engine: a Hugging Face causal LM sharded with torch FSDP2 (``fully_shard``), data parallel
over every rank of the process group, on whatever device the backend names (CUDA, NPU, CPU, the NPU shim).

One ``update`` = the rank's shard of a rollout batch -> ``algorithm.minibatches_per_rollout`` optimizer steps.
Per minibatch the response-token and sequence counts are summed over all data-parallel ranks first and
passed to the loss as ``global_tokens`` / ``global_seqs``, so every micro-batch loss is already normalised
by the whole minibatch; FSDP averages gradients over ranks, so the local loss is multiplied by the DP size.
Then the accumulated gradient is exactly the gradient of the loss of the full global minibatch, whatever the
micro-batching and the number of ranks (tested: DP2 == DP1, micro-batched == full batch).

With ``actor.ulysses_sequence_parallel_size`` > 1 (:mod:`.ulysses`), consecutive ranks form sequence-parallel groups
that gather their shards and split each packed micro-batch by tokens; the counts are then divided by SP (each
group's minibatch sits on SP ranks) and the loss scale stays the world size (tested: SP2 == SP1, SP2 x DP2 == SP1).

How we differ from verl's FSDP actor (dp_actor.py + fsdp_workers.py):
- the loss normaliser is global (tokens/sequences of the whole minibatch over all ranks) instead of verl's
  per-micro-batch mean times ``micro_batch_size / mini_batch_size``, which weighs tokens differently when
  micro-batches differ in length (token-budget batching);
- a non-finite loss or gradient norm skips that optimizer *and* scheduler step on every rank (decided by an
  all-reduce, so ranks never diverge) and is counted in ``actor/nan_steps_skipped``; verl only skips when the
  grad norm is non-finite;
- micro-batch counts are equalised across ranks with zero-weight dummy passes, because every FSDP
  forward/backward is a collective; verl's dynamic batch size makes ranks agree on the count up front;
- the learning-rate warm-up is linear from lr / warmup_steps on the first step (verl's starts at 0, a
  wasted step); a skipped step does not advance it;
- the reference policy for the KL term (only built when ``algorithm.kl_coef > 0``) lives in this engine,
  sharded like the policy, instead of in a separate ref worker.
Weights are kept in float32 (master); ``model.dtype=bfloat16`` computes in bf16 through FSDP2's
MixedPrecisionPolicy with float32 gradient reduction. float16 is refused (it needs loss scaling).

Why one file over 600 lines: it is one class whose methods share the sharded model, the optimizer and what is
resident where; what stands alone is already a module of its own (:mod:`.ulysses`, :mod:`.routing`,
:mod:`.logprobs`, :mod:`.packed_attention`, :mod:`.compiled_layers`, :mod:`.microbatch`, :mod:`.train_common`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gspo_ascend.algorithms import count_tokens_and_seqs
from gspo_ascend.config import Config, shared_prefix_on
from gspo_ascend.device import Backend
from gspo_ascend.engines import packed_attention, routing, ulysses
from gspo_ascend.engines.base import SampleBatch, existing_rank_file
from gspo_ascend.engines.hf_export import write_hf_checkpoint
from gspo_ascend.engines.hf_load import load_causal_lm
from gspo_ascend.engines.logprobs import forward_log_probs, token_layout, uploaded
from gspo_ascend.engines.microbatch import micro_batches
from gspo_ascend.engines.train_common import (
    MinibatchRecord,
    check_update_batch,
    engine_policy_loss,
    ensure_process_group,
    on_device,
    policy_objective,
    select_device,
    sized_token_budget,
    update_metrics,
    warmup_factor,
)
from gspo_ascend.errors import ConfigError, UserError

# what actor.offload moves, each on its own (FSDPEngine._resident): the policy, the reference policy, AdamW state
FSDP_PARTS = ("params", "ref", "optimizer")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_MEGATRON_ONLY_SIZES = (
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "context_parallel_size",
    "expert_parallel_size",
    "expert_tensor_parallel_size",
)


class FSDPEngine:
    """TrainEngine (engines/base.py) over torch FSDP2; see the module docstring."""

    def __init__(
        self, cfg: Config, backend: Backend, model_path: str, *, master_dtype: torch.dtype = torch.float32
    ) -> None:
        """``master_dtype``: the dtype of the sharded weights, gradients and optimizer state; float64 exists for
        exactness tests (then model.dtype=float32 computes in float64 too)."""
        _check_config(cfg)
        self.cfg, self.backend = cfg, backend
        self.owns_process_group = ensure_process_group(backend)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.device = select_device(backend, self.rank)
        self.cfg = cfg = sized_token_budget(cfg, backend, self.device, model_path, self.rank == 0)
        backend.avoid_per_shape_attention_plans()  # packed shapes change every micro-batch (device/__init__.py)
        from torch.distributed.device_mesh import init_device_mesh

        # FSDP shards over every rank, SP ranks included (verl does the same); SP groups are a second mesh's rows
        self.mesh = init_device_mesh(backend.torch_device_type, (self.world_size,), mesh_dim_names=("dp",))
        self.sp = self._sp_group(cfg.actor.ulysses_sequence_parallel_size)
        self.reports = self.sp is None or self.sp.rank == 0  # one rank per SP group records loss metrics
        self.master_dtype = master_dtype
        self.compute_dtype = master_dtype if cfg.model.dtype == "float32" else _DTYPES[cfg.model.dtype]
        self.keep_gathered = self._keeps_gathered(model_path)
        self.model, self.tied_names = self._build_model(model_path, trainable=True)
        # FSDP averages gradients over all ranks and the loss is normalised globally, so the loss is scaled by
        # the world size to undo the average; where the reduction sums instead, it is not (_dp_reduce_averages).
        # With SP the ranks of a group hold parts of one loss's gradient, so their sum is wanted too: same scale
        self._loss_scale = self.world_size if self._dp_reduce_averages() else 1
        self.ref_model = self._build_model(model_path, trainable=False)[0] if cfg.algorithm.kl_coef > 0 else None
        self.pad_id = int(getattr(self.model.config, "pad_token_id", None) or 0)
        self.routes = self._replay_book()
        if self.routes is not None:  # the old forward's routes come to the host without a wait per micro-batch
            self.routes.wait = backend.synchronize
        self.shared_prefix = self._shared_prefix()
        a = cfg.actor
        # fused: one kernel over every tensor (CUDA, CPU, and NPU, whose torch_npu registers _fused_adamw_ for
        # PrivateUse1: npu_native_functions_by_codegen.yaml in the 2.7.1 and 2.10 wheels); on CPU 10x foreach's step
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=a.lr, weight_decay=a.weight_decay, fused=True)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, warmup_factor(a.warmup_steps))
        self.policy_loss = engine_policy_loss(cfg, backend)  # an attribute so tests can wrap it
        self.nan_steps_total = 0
        # actor.offload: weights (and optimizer state) live on the host between calls, so a colocated rollout
        # engine has the device memory; .to() arguments, so tests can exercise the path with a lossless dtype
        # round trip on a CPU-only box, where a device move would be a no-op
        host = backend.torch_device_type == "cpu"
        self._onload_to: dict[str, Any] = {"device": self.device}
        self._offload_to: dict[str, Any] | None = None if host or not a.offload else {"device": torch.device("cpu")}
        self._on_device = set(FSDP_PARTS)  # built there
        if self._offload_to is not None:
            for part in FSDP_PARTS:
                self._place(part, device=False)

    # ------------------------------------------------------------------------------------------- set-up

    def _build_model(self, model_path: str, trainable: bool) -> tuple[torch.nn.Module, set[str]]:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if not (Path(model_path) / "config.json").is_file():
            raise UserError(f"model.path '{model_path}' is not a Hugging Face model directory (no config.json)")
        m = self.cfg.model
        model = load_causal_lm(
            model_path,
            dtype=self.master_dtype,
            attn_implementation=m.attn_implementation,
            backend=self.backend,
            npu_patches=m.npu_patches,
        )
        # names that alias another parameter (tied embeddings): HF checkpoints store only the first
        tied = {n for n, _ in model.named_parameters(remove_duplicate=False)} - {n for n, _ in model.named_parameters()}
        if self.sp is not None:
            ulysses.enable(model, self.sp.size)  # after the NPU patches picked the attention it wraps
        elif self.cfg.actor.use_remove_padding:
            packed_attention.enable(model)  # sdpa / eager: one attention per packed sequence, not the whole row
        if trainable and self.cfg.model.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if trainable:  # before fully_shard; the policy only (compiled_layers.py)
            from gspo_ascend.engines.compiled_layers import compile_layers

            self.compiled_layers = compile_layers(model, self.backend, self.cfg.actor.compile_layers)
        mp = MixedPrecisionPolicy()
        if self.compute_dtype != self.master_dtype:
            mp = MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=self.master_dtype)
        layer_types = set(getattr(model, "_no_split_modules", None) or ())
        units = [module for module in model.modules() if type(module).__name__ in layer_types]
        for unit in [*units, model]:  # one FSDP unit per decoder layer, then the rest in the root unit
            # the root keeps FSDP2's default (not resharded after forward: backward needs it at once); the keyword
            # is left out for it because torch 2.7 (the previous NPU line) takes no None there
            layer = {} if unit is model else {"reshard_after_forward": not (trainable and self.keep_gathered)}
            fully_shard(unit, mesh=self.mesh, mp_policy=mp, **layer)
            # gloo has no averaging reduce-scatter, and torch 2.8's gloo silently sums for ReduceOp.AVG (DP2
            # gradients came out doubled): have FSDP sum and divide itself, which is exact on every torch
            if self.backend.comm_backend == "gloo" and hasattr(unit, "set_force_sum_reduction_for_comms"):
                unit.set_force_sum_reduction_for_comms(True)
        if not trainable:
            model.requires_grad_(False)
            model.eval()
        return model, tied

    def _shared_prefix(self) -> bool:
        """``actor.shared_prefix`` resolved for this model: it needs the packed attention hook, which a model with
        sliding-window attention (or an implementation the hook does not wrap) does not take, and a dense model: an
        MoE model's routing agreement (and replay) is kept per token of each sample's own sequence. auto is off
        there; on is refused in one line."""
        if not shared_prefix_on(self.cfg, on_cpu=self.backend.name == "cpu"):
            return False
        why = None
        if not packed_attention.takes_shared_prefix(self.model):
            why = f"this model's attention ({self.model.config._attn_implementation}) does not run shared-prefix rows"
        elif self.routes is not None:
            why = "an MoE model's routes are kept per token of each sample's own sequence (engines/routing.py)"
        if why is not None and self.cfg.actor.shared_prefix == "on":  # said, not dropped
            raise ConfigError(f"config key 'actor.shared_prefix' (on): {why}; set it to auto")
        return why is None

    def _replay_book(self) -> routing.ReplayBook | None:
        """Routing replay and agreement (engines/routing.py) on an MoE model; refused on a dense one. Under Ulysses
        SP the routers see a rank's slice of the row, which the replay is not wired for (config refuses replay
        there): no routing metrics, said once."""
        mode, shape = self.cfg.actor.routing_replay, routing.moe_shape(self.model)
        if shape is None:
            if mode != "off":
                kind = self.model.config.model_type
                why = (
                    "transformers 5's router modules (this transformers builds the router as a plain Linear)"
                    if kind in routing.MODEL_TYPES
                    else f"an MoE model with a supported router ({', '.join(routing.MODEL_TYPES)}); {kind} has none"
                )
                raise ConfigError(f"config key 'actor.routing_replay' ({mode}) needs {why}: set it to off")
            return None
        if self.sp is not None:
            if self.rank == 0:
                print("note: routing agreement is not measured under Ulysses sequence parallelism", flush=True)
            return None
        return routing.ReplayBook(mode, *shape)

    def _sp_group(self, size: int) -> ulysses.SPGroup | None:
        """Ulysses SP (engines/ulysses.py): consecutive ranks form a group; data parallel over world / size."""
        if size <= 1:
            return None
        if self.world_size % size:
            raise ConfigError(
                f"config key '{ulysses.KEY}' ({size}) must divide the number of ranks ({self.world_size})"
            )
        from torch.distributed.device_mesh import init_device_mesh

        shape = (self.world_size // size, size)
        group = init_device_mesh(self.backend.torch_device_type, shape, mesh_dim_names=("dp", "sp")).get_group("sp")
        return ulysses.SPGroup(group, size, dist.get_rank(group))

    def _keeps_gathered(self, model_path: str) -> bool:
        """actor.fsdp_reshard_after_forward, resolved by the planner for this model, world and device memory, the
        same on every rank (the smallest device decides: a rank deferring its reduce-scatter while another runs it
        would hang). A model the planner does not know stays ZeRO-3 under auto, said once."""
        import warnings

        from gspo_ascend.doctor.modelspec import load_spec
        from gspo_ascend.doctor.planner import fsdp_keeps_gathered

        total = self.backend.total_memory(self.device.index or 0)
        if self.cfg.actor.fsdp_reshard_after_forward != "auto" or total is None:
            return fsdp_keeps_gathered(self.cfg, None, total, self.world_size)
        try:
            spec = load_spec(model_path)
        except UserError as exc:
            warnings.warn(
                f"actor.fsdp_reshard_after_forward=auto: ZeRO-3, the planner cannot size it ({exc})", stacklevel=2
            )
            return False
        keep = fsdp_keeps_gathered(self.cfg, spec, total, self.world_size)
        return bool(self._all_reduce([float(keep)], dist.ReduceOp.MIN)[0])

    def _dp_reduce_averages(self) -> bool:
        """Whether FSDP's gradient reduce-scatter averages over the DP ranks. NCCL / HCCL do; on gloo FSDP sums and
        divides itself where torch has ``set_force_sum_reduction_for_comms`` (2.8+, set in ``_build_model``). Older
        torch (the NPU pin 2.7.1, on CPU) asks gloo for ReduceOp.AVG, which gloo answers with the sum: DP2 gradients
        came out doubled. A one-element probe with the op FSDP uses tells which, instead of a version table."""
        if self.world_size == 1 or self.backend.comm_backend != "gloo":
            return True
        if hasattr(self.model, "set_force_sum_reduction_for_comms"):
            return True
        if self.master_dtype not in (torch.float32, torch.bfloat16):
            # torch 2.7's FSDP2 asks the collective for AVG only for fp32 / bf16 gradients; others (float64, the
            # exactness tests' master dtype) it sums and divides itself: an average (SP2 float64 grad norms halved)
            return True
        contributions = torch.full((self.world_size,), float(self.rank + 1))
        out = torch.empty(1)
        dist.reduce_scatter_tensor(out, contributions, op=dist.ReduceOp.AVG)
        mean = (self.world_size + 1) / 2  # of 1 .. world; the sum is world times that
        return abs(out.item() - mean) < 1e-6

    @contextlib.contextmanager
    def _resident(self, parts: tuple[str, ...] = FSDP_PARTS):
        """``parts`` (FSDP_PARTS) on the device for the duration; back to the host after. A weight export needs
        only the policy's parameters; compute needs all. Re-entrant: what an outer call brought stays."""
        brought = () if self._offload_to is None else tuple(p for p in parts if p not in self._on_device)
        for part in brought:
            self._place(part, device=True)
        try:
            yield
        finally:
            for part in brought:
                self._place(part, device=False)
            if brought:
                self.backend.empty_cache()

    def _tensors(self, part: str) -> list[torch.Tensor]:
        if part == "optimizer":  # "step": one scalar per tensor (on the device with fused AdamW), left where it is
            return [
                v for s in self.optimizer.state.values() for k, v in s.items() if k != "step" and torch.is_tensor(v)
            ]
        model = self.model if part == "params" else self.ref_model
        return [] if model is None else [*model.parameters(), *model.buffers()]

    def _place(self, part: str, *, device: bool) -> None:
        where = self._onload_to if device else self._offload_to
        if part == "optimizer":
            for state in self.optimizer.state.values():
                for key, value in state.items():
                    if key != "step" and torch.is_tensor(value):
                        state[key] = value.to(**where)
        else:  # FSDP2 re-registers sharded params after Module.to (same Parameter objects: the optimizer stays valid)
            model = self.model if part == "params" else self.ref_model
            if model is not None:
                model.to(**where)
        if device:
            self._on_device.add(part)
        else:
            self._on_device.discard(part)

    def resident_bytes(self) -> dict[str, int]:
        """Bytes of each part on the device now: bookkeeping of which parts were brought up (on a CPU host and
        device are one memory), times the parts' tensor bytes."""
        return {
            p: sum(t.numel() * t.element_size() for t in self._tensors(p)) * (p in self._on_device) for p in FSDP_PARTS
        }

    def close(self) -> None:
        """Tear down the process group if this engine created it (a standalone engine)."""
        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
            self.owns_process_group = False

    # ------------------------------------------------------------------------------------------- helpers

    def _micro_batches(self, batch: SampleBatch):
        a = self.cfg.actor
        budget = a.max_tokens_per_micro_batch
        if budget is not None and self.sp is not None:  # per device: the group's micro-batch holds SP x as many
            budget *= self.sp.size
        micros, plan = micro_batches(batch, a.micro_batch_size, budget, self.shared_prefix)
        # every FSDP forward/backward is a collective: all ranks run the same number of passes
        return micros, plan, int(self._all_reduce([len(micros)], dist.ReduceOp.MAX)[0])

    def _all_reduce(self, values, op=dist.ReduceOp.SUM) -> torch.Tensor:
        t = torch.as_tensor(values, dtype=torch.float64, device=self.device)
        if self.world_size > 1:
            dist.all_reduce(t, op=op)
        return t.cpu()

    def _dummy_batch(self) -> SampleBatch:
        """A one-token sample without response tokens: a forward/backward pass that contributes nothing."""
        zeros = torch.zeros((1, 1))
        return SampleBatch([[self.pad_id]], zeros.long(), zeros)

    def _group_shards(self, batch: SampleBatch) -> list[SampleBatch]:
        """This rank's shard, or with SP every group rank's shard in group order (the group trains on them all)."""
        return [batch] if self.sp is None else ulysses.group_shards(batch, self.sp)

    def _log_probs(self, model: torch.nn.Module, batch: SampleBatch, temperature: float, entropy: bool = False):
        """[B, R] log-probs (with ``entropy``: and entropies, a pair), SP or not."""
        if self.sp is not None:
            return ulysses.forward_log_probs(model, batch, temperature, self.sp, self.pad_id, entropy)
        packed = self.cfg.actor.use_remove_padding
        return forward_log_probs(model, batch, temperature, packed, self.pad_id, entropy, self.shared_prefix)

    # ------------------------------------------------------------------------------------------- contract

    @on_device
    def compute_log_probs(self, batch: SampleBatch, temperature: float) -> torch.Tensor:
        """[B, R] float32 on the host, no grad, micro-batched like ``update``."""
        shards = self._group_shards(batch)
        start = sum(len(s) for s in shards[: self.sp.rank]) if self.sp is not None else 0
        group = SampleBatch.concat(shards) if len(shards) > 1 else batch
        micros, plan, passes = self._micro_batches(group)
        out = torch.zeros(tuple(group.response_ids.shape), dtype=torch.float32)
        self.model.eval()
        if self.routes is not None:
            self.routes.forget()  # this forward's routes replace the last batch's
        done = []  # read back after the loop: a read per micro-batch would wait for each forward before the next
        with torch.no_grad(), self._resharding(self.model):
            for i in range(passes):
                micro = micros[i] if i < len(micros) else None
                with self._routing(micro, "old"):
                    lp = self._log_probs(self.model, micro or self._dummy_batch(), temperature)
                if micro is not None:
                    done.append((plan.groups[i], lp.float()))
        if done:  # micro-batches keep the batch's response width: one copy back for all of them
            rows, lps = zip(*done, strict=True)
            out[[r for group in rows for r in group]] = torch.cat(lps).cpu()
        return out[start : start + len(batch)]  # this rank's rows

    @on_device
    def update(self, batch: SampleBatch, temperature: float) -> dict[str, float]:
        k = self.cfg.algorithm.minibatches_per_rollout
        check_update_batch(batch, k)
        self.model.train()
        records = []
        shards = [s.split(k) for s in self._group_shards(batch)]
        with self._resharding(self.ref_model):  # its forwards have no backward (see _resharding)
            for j in range(k):
                minibatch = SampleBatch.concat([s[j] for s in shards]) if len(shards) > 1 else shards[0][j]
                record = self.backward_minibatch(minibatch, temperature)
                self._step(record)
                records.append(record)
        metrics = self._metrics(records)
        if self.routes is not None:
            metrics.update(self.routes.metrics(self._all_reduce))
        return metrics

    @on_device
    def backward_minibatch(self, minibatch: SampleBatch, temperature: float) -> MinibatchRecord:
        """Forward/backward every micro-batch of one minibatch; gradients are left in the parameters.

        Public for tests and tools that want the gradient of a minibatch without an optimizer step. With SP,
        ``minibatch`` is the SP group's (the same on every rank of the group).
        """
        micros, plan, passes = self._micro_batches(minibatch)
        tokens, seqs = count_tokens_and_seqs(minibatch.trained_mask)
        copies = 1 if self.sp is None else self.sp.size  # each SP group's minibatch is on SP ranks
        global_tokens, global_seqs = (self._all_reduce([int(tokens), int(seqs)]) / copies).tolist()
        record = MinibatchRecord(passes=passes)
        if self.reports:
            record.sums["oversized_samples"] = float(plan.oversized)
        bad = torch.zeros((), dtype=torch.bool, device=self.device)
        norm_length = minibatch.response_ids.shape[1]  # the same T_norm for every micro-batch
        for i in range(passes):
            self._defer_reduction(last=i == passes - 1)
            if i >= len(micros):
                (self._log_probs(self.model, self._dummy_batch(), temperature).sum() * 0.0).backward()
                continue
            with self._routing(micros[i], "update"):  # through backward: checkpointed layers re-run their forward
                loss, metrics = self._micro_loss(micros[i], temperature, global_tokens, global_seqs, norm_length)
                bad |= ~torch.isfinite(loss.detach())
                (loss * self._loss_scale).backward()  # see __init__: undo FSDP's DP average
            if self.reports:
                record.add(metrics)
        (record.skipped,) = record.settle(bad)  # the minibatch's one read of the device (metrics and all)
        return record

    @contextlib.contextmanager
    def _resharding(self, model: torch.nn.Module | None):
        """A forward without a backward (the old log-probs, the reference policy's) leaves what it gathered gathered:
        the layers kept gathered, and under any setting the root unit (embeddings, lm_head), which FSDP2 never
        reshards after forward. Reshard every unit after the body, so nothing stays gathered into the rollout.
        (``reshard()``: torch 2.7, the previous NPU line, has no ``set_reshard_after_forward``.)"""
        try:
            yield
        finally:
            if model is not None:
                from torch.distributed.fsdp import FSDPModule

                for module in model.modules():
                    if isinstance(module, FSDPModule):
                        module.reshard()

    @contextlib.contextmanager
    def _routing(self, micro: SampleBatch | None, phase: str):
        """The policy's routers through one micro-batch's passes (routing.ReplayBook says what they replay and
        compare per phase); the ``old`` forward's own routes are kept for the update. The KL reference policy routes
        for itself. Nothing for a dummy pass or a model without routing replay."""
        book = self.routes
        if book is None or micro is None:
            yield
            return
        starts, lengths, total = token_layout(micro, self.cfg.actor.use_remove_padding)
        replay, compare = (
            None if routes is None else routing.flatten(routes, starts, lengths, total, self.device)
            for routes in book.targets(micro, phase)
        )
        with routing.routed(self.model, replay=replay, compare=compare, record=phase == "old") as log:
            yield
        (book.rollout if phase == "old" else book.update).merge(log.agreement)
        if phase == "old":
            book.remember_flat(micro, log.stacked(), starts, lengths)

    def _defer_reduction(self, last: bool) -> None:
        """With the layers kept gathered, gradients accumulate unsharded in fp32 (FSDP2 upcasts them to the reduce
        dtype) and are reduce-scattered once, after the minibatch's last backward, which also reshards: no gather,
        cast or reduce per micro-batch. Resharding (ZeRO-3) reduces every micro-batch, as FSDP2 does by default."""
        if self.keep_gathered:
            self.model.set_requires_gradient_sync(last)
            self.model.set_reshard_after_backward(last)

    def _micro_loss(self, micro: SampleBatch, temperature: float, global_tokens, global_seqs, norm_length):
        alg = self.cfg.algorithm
        mask, old_log_probs, advantages = uploaded(
            self.device, micro.trained_mask, micro.old_log_probs, micro.advantages
        )
        log_prob, entropy = self._log_probs(self.model, micro, temperature, entropy=True)
        counts = {"global_tokens": global_tokens, "global_seqs": global_seqs, "norm_length": norm_length}
        ref = None
        if self.ref_model is not None:
            with torch.no_grad():
                ref = self._log_probs(self.ref_model, micro, temperature)
        return policy_objective(self.policy_loss, alg, log_prob, old_log_probs, advantages, mask, counts, ref, entropy)

    def _step(self, record: MinibatchRecord) -> None:
        """Clip + optimizer step + scheduler step, or, on a non-finite loss/grad norm on any rank, skip both."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0, error_if_nonfinite=False)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # DTensor -> global norm
        bad = self._all_reduce([float(record.skipped)], dist.ReduceOp.MAX)[0] > 0
        if bad or not torch.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            record.skipped = True
            self.nan_steps_total += 1
            return
        if self.cfg.actor.grad_clip > 0:
            torch.nn.utils.clip_grads_with_norm_(params, self.cfg.actor.grad_clip, norm)
        record.grad_norm, record.lr = float(norm), float(self.optimizer.param_groups[0]["lr"])
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _metrics(self, records: list[MinibatchRecord]) -> dict[str, float]:
        return update_metrics(records, self.device, float(self.optimizer.param_groups[0]["lr"]))

    # ------------------------------------------------------------------------------------------- weights

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter and persistent buffer under its HF state_dict name, full, in the compute dtype
        (what a rollout engine runs), on this rank's device. Collective: every rank must iterate to the end."""
        with self._resident(("params",)):
            for name, tensor in self.model.state_dict().items():
                full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
                full = full.detach()
                yield name, full.to(self.compute_dtype) if full.is_floating_point() else full

    @on_device
    def save_hf(self, path: str, tokenizer: Any) -> None:
        """safetensors (sharded at 5 GiB) + config + generation config + tokenizer, written by rank 0."""
        state = self.model.state_dict()
        write_hf_checkpoint(
            path,
            self.export_weights(),
            rank=self.rank,
            shapes=state,
            names=[n for n in state if n not in self.tied_names],
            dtype=self.compute_dtype,
            hf_config=self.model.config,
            generation_config=getattr(self.model, "generation_config", None),
            tokenizer=tokenizer,
        )
        dist.barrier()

    # ------------------------------------------------------------------------------------------- checkpoints

    def _rank_file(self, path: str) -> Path:
        return Path(path) / f"engine_rank{self.rank}.pt"

    @on_device
    def save_checkpoint(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp

        has_optim = bool(self.optimizer.state)  # get_state_dict on a fresh AdamW would fake a step (step=1)
        dcp.save(self._dcp_state(has_optim), checkpoint_id=path)
        extra = {
            "scheduler": self.scheduler.state_dict(),
            "has_optim": has_optim,
            "nan_steps_total": self.nan_steps_total,
            "cpu_rng": torch.get_rng_state(),
            "device_rng": self._device_rng(),
        }
        torch.save(extra, self._rank_file(path))
        dist.barrier()

    @on_device
    def load_checkpoint(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        rank_file = existing_rank_file(path, self._rank_file(path).name)
        extra = torch.load(rank_file, weights_only=True)
        state = self._dcp_state(extra["has_optim"])
        dcp.load(state, checkpoint_id=path)
        if extra["has_optim"]:
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        else:
            set_model_state_dict(self.model, state["model"])
        self.scheduler.load_state_dict(extra["scheduler"])
        self._apply_configured_lr()
        self.nan_steps_total = extra["nan_steps_total"]
        torch.set_rng_state(extra["cpu_rng"])
        if extra["device_rng"] is not None:
            self.backend.module().set_rng_state(extra["device_rng"])

    def _apply_configured_lr(self) -> None:
        """actor.lr may change on resume (gspo_ascend/resume.py), but the loaded optimizer and scheduler states
        carry the saved one: put the configured lr back, at the warm-up position the scheduler resumed at (the
        same float expression LambdaLR uses, so an unchanged lr resumes bitwise)."""
        lr = self.cfg.actor.lr
        self.scheduler.base_lrs = [lr] * len(self.optimizer.param_groups)
        for group, factor in zip(self.optimizer.param_groups, self.scheduler.lr_lambdas, strict=True):
            group["initial_lr"] = lr
            group["lr"] = lr * factor(self.scheduler.last_epoch)

    def _dcp_state(self, with_optim: bool) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if not with_optim:
            return {"model": get_model_state_dict(self.model)}
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def _device_rng(self) -> torch.Tensor | None:
        if self.backend.torch_device_type == "cpu":
            return None  # the CPU generator is saved already (also for the emulated NPU)
        return self.backend.module().get_rng_state()


# ----------------------------------------------------------------------------------------------- module helpers


def _check_config(cfg: Config) -> None:
    if cfg.model.dtype not in _DTYPES:
        raise ConfigError(
            f"config key 'model.dtype' = {cfg.model.dtype!r} is not supported by the fsdp engine (float16 needs "
            "loss scaling); use bfloat16 or float32"
        )
    a = cfg.actor
    for key in _MEGATRON_ONLY_SIZES:
        if getattr(a, key) != 1:
            raise ConfigError(
                f"config key 'actor.{key}' = {getattr(a, key)} needs actor.engine=megatron; the fsdp engine is "
                "data parallel only (set it to 1)"
            )
    if a.sequence_parallel or a.use_mc2:
        raise ConfigError("config keys 'actor.sequence_parallel' / 'actor.use_mc2' need actor.engine=megatron")
    if a.recompute != "none":
        raise ConfigError(
            f"config key 'actor.recompute' = {a.recompute!r} is Megatron's; with actor.engine=fsdp set "
            "'model.gradient_checkpointing: true' instead"
        )
    if cfg.algorithm.minibatches_per_rollout is None:
        raise ConfigError(
            "config key 'algorithm.minibatches_per_rollout' is unresolved; load the config with "
            "gspo_ascend.config.load_config (it derives it from actor.ppo_mini_batch_size)"
        )
