"""The ``fsdp`` train engine: a Hugging Face causal LM sharded with torch FSDP2 (``fully_shard``), data parallel
over every rank of the process group, on whatever device the backend names (CUDA, NPU, CPU, the NPU shim).

One ``update`` = the rank's shard of a rollout batch -> ``algorithm.minibatches_per_rollout`` optimizer steps.
Per minibatch the response-token and sequence counts are summed over all data-parallel ranks first and
passed to the loss as ``global_tokens`` / ``global_seqs``, so every micro-batch loss is already normalised
by the whole minibatch; FSDP averages gradients over ranks, so the local loss is multiplied by the DP size.
Then the accumulated gradient is exactly the gradient of the loss of the full global minibatch, whatever the
micro-batching and the number of ranks (tested: DP2 == DP1, micro-batched == full batch).

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
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gspo_ascend.algorithms import agg_loss, count_tokens_and_seqs, get_policy_loss, kl_penalty
from gspo_ascend.config import Config
from gspo_ascend.device import Backend
from gspo_ascend.engines.base import SampleBatch, existing_rank_file
from gspo_ascend.engines.hf_export import write_hf_checkpoint
from gspo_ascend.engines.logprobs import forward_log_probs
from gspo_ascend.engines.microbatch import micro_batches
from gspo_ascend.errors import ConfigError, UserError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_MEGATRON_ONLY_SIZES = (
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "context_parallel_size",
    "expert_parallel_size",
    "expert_tensor_parallel_size",
)
_SUM_KEYS = ("pg_loss", "kl_ref", "num_tokens", "num_seqs")  # already globally normalised / plain counts


def warmup_factor(warmup_steps: int):
    """LambdaLR factor: optimizer step s (0-based) runs at lr * min(1, (s + 1) / warmup_steps)."""

    def factor(step: int) -> float:
        return 1.0 if warmup_steps <= 0 else min(1.0, (step + 1) / warmup_steps)

    return factor


def _combine(totals: dict[str, float]) -> dict[str, float]:
    """One minibatch's metric values from its rank-summed weighted sums (``_Minibatch.add``)."""
    values = {}
    for key, total in totals.items():
        if key in ("micro", "oversized_samples"):  # bookkeeping, reported separately
            continue
        kind = _metric_kind(key)
        denominator = 1.0 if kind == "sum" else totals.get(kind, 0.0)
        values[key] = total / denominator if denominator > 0 else 0.0
    return values


def _metric_kind(key: str) -> str:
    """How a loss metric combines over micro-batches and ranks (see policy_loss.py's metric list)."""
    if key in _SUM_KEYS:
        return "sum"
    if key in ("seq_ratio_min", "seq_ratio_max"):
        return key[-3:]
    if key.endswith("_token"):
        return "num_tokens"  # a token-mean: weight by the micro-batch's response tokens
    if key.endswith("_seq") or key == "seq_ratio_mean":
        return "num_seqs"
    return "micro"  # unknown: plain mean over micro-batches


@dataclass
class _Minibatch:
    """What one minibatch leaves behind on this rank: local weighted metric sums and the step outcome."""

    sums: dict[str, float] = field(default_factory=dict)
    mins: dict[str, float] = field(default_factory=dict)
    maxs: dict[str, float] = field(default_factory=dict)
    passes: int = 0  # forward/backward passes, dummies included
    skipped: bool = False
    grad_norm: float = math.nan
    lr: float = math.nan

    def add(self, metrics: dict[str, torch.Tensor]) -> None:
        keys = list(metrics)  # one device->host copy for all of them, not one sync per metric
        values = dict(zip(keys, torch.stack([metrics[k].double() for k in keys]).tolist(), strict=True))
        self.sums["micro"] = self.sums.get("micro", 0.0) + 1.0
        for key, value in values.items():
            kind = _metric_kind(key)
            if kind in ("min", "max"):
                if values.get("num_seqs", 1.0) > 0:  # an empty micro-batch reports 1.0, not a ratio
                    book, pick = (self.mins, min) if kind == "min" else (self.maxs, max)
                    book[key] = pick(book.get(key, value), value)
            elif kind == "sum":
                self.sums[key] = self.sums.get(key, 0.0) + value
            else:
                weight = 1.0 if kind == "micro" else values.get(kind, 1.0)
                self.sums[key] = self.sums.get(key, 0.0) + value * weight


def _on_device(method):
    """Run an engine method with the weights on the device (matters with actor.offload)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._resident():
            return method(self, *args, **kwargs)

    return wrapper


class FSDPEngine:
    """TrainEngine (engines/base.py) over torch FSDP2; see the module docstring."""

    def __init__(
        self, cfg: Config, backend: Backend, model_path: str, *, master_dtype: torch.dtype = torch.float32
    ) -> None:
        """``master_dtype``: the dtype of the sharded weights, gradients and optimizer state; float64 exists for
        exactness tests (then model.dtype=float32 computes in float64 too)."""
        _check_config(cfg)
        self.cfg, self.backend = cfg, backend
        self.owns_process_group = _ensure_process_group(backend)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.device = _select_device(backend, self.rank)
        from torch.distributed.device_mesh import init_device_mesh

        self.mesh = init_device_mesh(backend.torch_device_type, (self.world_size,), mesh_dim_names=("dp",))
        self.master_dtype = master_dtype
        self.compute_dtype = master_dtype if cfg.model.dtype == "float32" else _DTYPES[cfg.model.dtype]
        self.model, self.tied_names = self._build_model(model_path, trainable=True)
        self.ref_model = self._build_model(model_path, trainable=False)[0] if cfg.algorithm.kl_coef > 0 else None
        self.pad_id = int(getattr(self.model.config, "pad_token_id", None) or 0)
        a = cfg.actor
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=a.lr, weight_decay=a.weight_decay, foreach=True)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, warmup_factor(a.warmup_steps))
        self.policy_loss = get_policy_loss(cfg.algorithm.loss)  # an attribute so tests can wrap it
        self.nan_steps_total = 0
        # actor.offload: weights (and optimizer state) live on the host between calls, so a colocated rollout
        # engine has the device memory; .to() arguments, so tests can exercise the path with a lossless dtype
        # round trip on a CPU-only box, where a device move would be a no-op
        host = backend.torch_device_type == "cpu"
        self._onload_to: dict[str, Any] = {"device": self.device}
        self._offload_to: dict[str, Any] | None = None if host or not a.offload else {"device": torch.device("cpu")}
        self._resident_depth = 0
        if self._offload_to is not None:
            self._place(self._offload_to)

    # ------------------------------------------------------------------------------------------- set-up

    def _build_model(self, model_path: str, trainable: bool) -> tuple[torch.nn.Module, set[str]]:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from transformers import AutoModelForCausalLM

        if not (Path(model_path) / "config.json").is_file():
            raise UserError(f"model.path '{model_path}' is not a Hugging Face model directory (no config.json)")
        model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=self.master_dtype, attn_implementation=self.cfg.model.attn_implementation
        )
        # names that alias another parameter (tied embeddings): HF checkpoints store only the first
        tied = {n for n, _ in model.named_parameters(remove_duplicate=False)} - {n for n, _ in model.named_parameters()}
        if trainable and self.cfg.model.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        mp = MixedPrecisionPolicy()
        if self.compute_dtype != self.master_dtype:
            mp = MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=self.master_dtype)
        layer_types = set(getattr(model, "_no_split_modules", None) or ())
        for module in model.modules():  # one FSDP unit per decoder layer, then the rest in the root unit
            if type(module).__name__ in layer_types:
                fully_shard(module, mesh=self.mesh, mp_policy=mp)
        fully_shard(model, mesh=self.mesh, mp_policy=mp)
        if not trainable:
            model.requires_grad_(False)
            model.eval()
        return model, tied

    @contextlib.contextmanager
    def _resident(self):
        """Weights and optimizer state on the device for the duration (re-entrant); back to the host after."""
        outer = self._resident_depth == 0 and self._offload_to is not None
        if outer:
            self._place(self._onload_to)
        self._resident_depth += 1
        try:
            yield
        finally:
            self._resident_depth -= 1
            if outer:
                self._place(self._offload_to)
                self.backend.empty_cache()

    def _place(self, where: dict[str, Any]) -> None:
        # FSDP2 re-registers sharded params after Module.to (same Parameter objects: the optimizer stays valid)
        for model in (self.model, self.ref_model):
            if model is not None:
                model.to(**where)
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if key != "step" and torch.is_tensor(value):  # AdamW keeps "step" on the host anyway
                    state[key] = value.to(**where)

    def close(self) -> None:
        """Tear down the process group if this engine created it (a standalone engine)."""
        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
            self.owns_process_group = False

    # ------------------------------------------------------------------------------------------- helpers

    def _micro_batches(self, batch: SampleBatch):
        a = self.cfg.actor
        micros, plan = micro_batches(batch, a.micro_batch_size, a.max_tokens_per_micro_batch)
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

    def _log_probs(self, model: torch.nn.Module, batch: SampleBatch, temperature: float) -> torch.Tensor:
        return forward_log_probs(model, batch, temperature, self.cfg.actor.use_remove_padding, self.pad_id)

    # ------------------------------------------------------------------------------------------- contract

    @_on_device
    def compute_log_probs(self, batch: SampleBatch, temperature: float) -> torch.Tensor:
        """[B, R] float32 on the host, no grad, micro-batched like ``update``."""
        micros, plan, passes = self._micro_batches(batch)
        out = torch.zeros(tuple(batch.response_ids.shape), dtype=torch.float32)
        self.model.eval()
        with torch.no_grad():
            for i in range(passes):
                lp = self._log_probs(self.model, micros[i] if i < len(micros) else self._dummy_batch(), temperature)
                if i < len(micros):
                    out[plan.groups[i]] = lp.float().cpu()
        return out

    @_on_device
    def update(self, batch: SampleBatch, temperature: float) -> dict[str, float]:
        if batch.old_log_probs is None or batch.advantages is None:
            raise ValueError("update needs a batch with old_log_probs and advantages set")
        k = self.cfg.algorithm.minibatches_per_rollout
        if len(batch) % k:
            raise UserError(
                f"this rank's shard of {len(batch)} samples cannot be split into "
                f"algorithm.minibatches_per_rollout={k} minibatches; make the per-rank batch a multiple of it"
            )
        self.model.train()
        records = []
        for minibatch in batch.split(k):
            record = self.backward_minibatch(minibatch, temperature)
            self._step(record)
            records.append(record)
        return self._metrics(records)

    @_on_device
    def backward_minibatch(self, minibatch: SampleBatch, temperature: float) -> _Minibatch:
        """Forward/backward every micro-batch of one minibatch; gradients are left in the parameters.

        Public for tests and tools that want the gradient of a minibatch without an optimizer step.
        """
        micros, plan, passes = self._micro_batches(minibatch)
        tokens, seqs = count_tokens_and_seqs(minibatch.response_mask)
        global_tokens, global_seqs = self._all_reduce([int(tokens), int(seqs)]).tolist()
        record = _Minibatch(passes=passes)
        record.sums["oversized_samples"] = float(plan.oversized)
        bad = torch.zeros((), dtype=torch.bool, device=self.device)
        norm_length = minibatch.response_ids.shape[1]  # the same T_norm for every micro-batch
        for i in range(passes):
            if i >= len(micros):
                (self._log_probs(self.model, self._dummy_batch(), temperature).sum() * 0.0).backward()
                continue
            loss, metrics = self._micro_loss(micros[i], temperature, global_tokens, global_seqs, norm_length)
            bad |= ~torch.isfinite(loss.detach())
            # FSDP averages gradients over the DP ranks; the loss is normalised globally, so undo the average
            (loss * self.world_size).backward()
            record.add(metrics)
        record.skipped = bool(bad)
        return record

    def _micro_loss(self, micro: SampleBatch, temperature: float, global_tokens, global_seqs, norm_length):
        d = self.device
        alg = self.cfg.algorithm
        mask = micro.response_mask.to(d)
        log_prob = self._log_probs(self.model, micro, temperature)
        counts = {"global_tokens": global_tokens, "global_seqs": global_seqs, "norm_length": norm_length}
        loss, metrics = self.policy_loss(
            log_prob,
            micro.old_log_probs.to(d),
            micro.advantages.to(d),
            mask,
            clip_low=alg.clip_ratio_low,
            clip_high=alg.clip_ratio_high,
            clip_ratio_c=alg.clip_ratio_c,
            agg_mode=alg.loss_agg_mode,
            **counts,
        )
        if self.ref_model is not None:
            with torch.no_grad():
                ref = self._log_probs(self.ref_model, micro, temperature)
            kl = agg_loss(kl_penalty(alg.kl_estimator, log_prob, ref, mask), mask, alg.loss_agg_mode, **counts)
            loss = loss + alg.kl_coef * kl
            metrics = {**metrics, "kl_ref": kl.detach()}
        return loss, metrics

    def _step(self, record: _Minibatch) -> None:
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

    def _metrics(self, records: list[_Minibatch]) -> dict[str, float]:
        """Global per-minibatch metrics (two all-reduces for the whole update), then the mean over the
        minibatches that stepped (over all of them when none did)."""
        sum_keys = sorted({k for r in records for k in r.sums})
        min_keys = sorted({k for r in records for k in r.mins})
        max_keys = sorted({k for r in records for k in r.maxs})
        sums = self._all_reduce([[r.sums.get(k, 0.0) for k in sum_keys] for r in records])
        # MIN and MAX in one MAX all-reduce: min x = -max(-x); +-inf = no non-empty sequence anywhere
        ext = [
            [-r.mins.get(k, math.inf) for k in min_keys] + [r.maxs.get(k, -math.inf) for k in max_keys] for r in records
        ]
        ext = self._all_reduce(ext, dist.ReduceOp.MAX)
        per_mb = []
        for j in range(len(records)):
            totals = dict(zip(sum_keys, sums[j].tolist(), strict=True))
            values = _combine(totals)
            for key, value in zip(min_keys + max_keys, ext[j].tolist(), strict=True):
                values[key] = 1.0 if math.isinf(value) else (-value if key in min_keys else value)
            per_mb.append(values)
        stepped = [j for j, r in enumerate(records) if not r.skipped] or list(range(len(records)))
        out = {f"actor/{k}": sum(per_mb[j][k] for j in stepped) / len(stepped) for k in per_mb[0]}
        norms = [r.grad_norm for r in records if not r.skipped]
        lrs = [r.lr for r in records if not r.skipped]
        out["actor/grad_norm"] = sum(norms) / len(norms) if norms else math.nan
        out["actor/lr"] = lrs[-1] if lrs else float(self.optimizer.param_groups[0]["lr"])
        out["actor/nan_steps_skipped"] = float(sum(r.skipped for r in records))
        out["actor/micro_batches"] = float(sum(r.passes for r in records))
        out["actor/oversized_samples"] = float(sums[:, sum_keys.index("oversized_samples")].sum())
        return out

    # ------------------------------------------------------------------------------------------- weights

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter and persistent buffer under its HF state_dict name, full, in the compute dtype
        (what a rollout engine runs), on this rank's device. Collective: every rank must iterate to the end."""
        with self._resident():
            for name, tensor in self.model.state_dict().items():
                full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
                full = full.detach()
                yield name, full.to(self.compute_dtype) if full.is_floating_point() else full

    @_on_device
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

    @_on_device
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

    @_on_device
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
        self.nan_steps_total = extra["nan_steps_total"]
        torch.set_rng_state(extra["cpu_rng"])
        if extra["device_rng"] is not None:
            self.backend.module().set_rng_state(extra["device_rng"])

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


def _ensure_process_group(backend: Backend) -> bool:
    """Join the existing world, or make a one-process group (an in-process store: no port, no file)."""
    if dist.is_initialized():
        return False
    dist.init_process_group(backend.comm_backend, store=dist.HashStore(), rank=0, world_size=1)
    return True


def _select_device(backend: Backend, rank: int) -> torch.device:
    if backend.torch_device_type == "cpu":
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", rank % max(1, backend.device_count())))
    backend.set_device(local_rank)
    return backend.device(local_rank)
