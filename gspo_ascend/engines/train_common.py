"""Plumbing shared by the train engines (fsdp, megatron): lr warm-up, how loss metrics combine over
micro-batches and ranks, the per-minibatch record, process group and device selection, and the decorator that
keeps weights on the device (offload) for the duration of a call.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from gspo_ascend.device import Backend
from gspo_ascend.errors import UserError

_SUM_KEYS = ("pg_loss", "kl_ref", "num_tokens", "num_seqs")  # already globally normalised / plain counts


def check_update_batch(batch, minibatches: int) -> None:
    """What ``update`` needs of this rank's shard: old log-probs, advantages, and ``minibatches`` equal parts."""
    if batch.old_log_probs is None or batch.advantages is None:
        raise ValueError("update needs a batch with old_log_probs and advantages set")
    if len(batch) % minibatches:
        raise UserError(
            f"this rank's shard of {len(batch)} samples cannot be split into "
            f"algorithm.minibatches_per_rollout={minibatches} minibatches; make the per-rank batch a multiple of it"
        )


def warmup_factor(warmup_steps: int):
    """LambdaLR factor: optimizer step s (0-based) runs at lr * min(1, (s + 1) / warmup_steps)."""

    def factor(step: int) -> float:
        return 1.0 if warmup_steps <= 0 else min(1.0, (step + 1) / warmup_steps)

    return factor


def combine(totals: dict[str, float]) -> dict[str, float]:
    """One minibatch's metric values from its rank-summed weighted sums (``MinibatchRecord.add``)."""
    values = {}
    for key, total in totals.items():
        if key in ("micro", "oversized_samples"):  # bookkeeping, reported separately
            continue
        kind = metric_kind(key)
        denominator = 1.0 if kind == "sum" else totals.get(kind, 0.0)
        values[key] = total / denominator if denominator > 0 else 0.0
    return values


def metric_kind(key: str) -> str:
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
class MinibatchRecord:
    """What one minibatch leaves behind on this rank: local weighted metric sums and the step outcome."""

    sums: dict[str, float] = field(default_factory=dict)
    mins: dict[str, float] = field(default_factory=dict)
    maxs: dict[str, float] = field(default_factory=dict)
    passes: int = 0  # forward/backward passes, dummies included
    skipped: bool = False
    grad_norm: float = math.nan
    lr: float = math.nan

    pending: list[tuple[list[str], torch.Tensor]] = field(default_factory=list)

    def add(self, metrics: dict[str, torch.Tensor]) -> None:
        """Keep one micro-batch's metrics on the device; :meth:`settle` reads every micro-batch's in one copy. Read
        here, each micro-batch would wait for its own backward before the host could queue the next (issue #43)."""
        keys = list(metrics)
        if keys:
            self.pending.append((keys, torch.stack([metrics[k].detach().double() for k in keys])))
        else:
            self.sums["micro"] = self.sums.get("micro", 0.0) + 1.0

    def settle(self, *flags: torch.Tensor) -> list[bool]:
        """Fold the micro-batches' metrics into the weighted sums with one device->host copy, which also brings
        back ``flags`` (0-d bool tensors, e.g. "a loss was not finite") as bools."""
        parts = [values for _, values in self.pending] + [f.reshape(1).double() for f in flags]
        host = torch.cat(parts).tolist() if parts else []
        offset = 0
        for keys, _ in self.pending:
            self._fold(dict(zip(keys, host[offset : offset + len(keys)], strict=True)))
            offset += len(keys)
        self.pending = []
        return [value != 0 for value in host[offset:]]

    def _fold(self, values: dict[str, float]) -> None:
        self.sums["micro"] = self.sums.get("micro", 0.0) + 1.0
        for key, value in values.items():
            kind = metric_kind(key)
            if kind in ("min", "max"):
                if values.get("num_seqs", 1.0) > 0:  # an empty micro-batch reports 1.0, not a ratio
                    book, pick = (self.mins, min) if kind == "min" else (self.maxs, max)
                    book[key] = pick(book.get(key, value), value)
            elif kind == "sum":
                self.sums[key] = self.sums.get(key, 0.0) + value
            else:
                weight = 1.0 if kind == "micro" else values.get(kind, 1.0)
                self.sums[key] = self.sums.get(key, 0.0) + value * weight


def on_device(method):
    """Run an engine method with the weights on the device (matters with actor.offload)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._resident():
            return method(self, *args, **kwargs)

    return wrapper


def ensure_process_group(backend: Backend) -> bool:
    """Join the existing world, or make a one-process group (an in-process store: no port, no file)."""
    if dist.is_initialized():
        return False
    dist.init_process_group(backend.comm_backend, store=dist.HashStore(), rank=0, world_size=1)
    return True


def select_device(backend: Backend, rank: int) -> torch.device:
    if backend.torch_device_type == "cpu":
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", rank % max(1, backend.device_count())))
    backend.set_device(local_rank)
    return backend.device(local_rank)


def engine_policy_loss(cfg, backend: Backend):
    """``algorithm.loss``'s function, compiled when ``trainer.compile`` asks for it (compile.py: never on NPU; a
    dynamo / inductor failure runs it eagerly from then on, with one warning). The loss is what the step compiles:
    elementwise work over every token, with a small backward; its shapes change every micro-batch (packed lengths),
    hence ``dynamic=True``. ``auto`` is eager on every backend today (Backend.compile_by_default)."""
    from gspo_ascend.algorithms import get_policy_loss
    from gspo_ascend.compile import maybe_compile

    loss = get_policy_loss(cfg.algorithm.loss)
    return maybe_compile(loss, backend, cfg.trainer.compile, compile_kwargs={"dynamic": True})


def policy_objective(
    policy_loss, alg, log_prob, old_log_prob, advantages, mask, counts, ref_log_prob=None, entropy=None
):
    """The clipped policy loss of one micro-batch (globally normalised through ``counts``), plus
    ``alg.kl_coef`` x the aggregated KL to the reference policy when ``ref_log_prob`` is given. ``entropy`` ([B, R],
    the policy's per-token entropy, no gradient) becomes the ``entropy_token`` metric: a token mean, like verl's
    ``actor/entropy`` under token-mean aggregation (and whatever ``loss_agg_mode``: a metric, not a loss term)."""
    from gspo_ascend.algorithms import agg_loss, kl_penalty

    loss, metrics = policy_loss(
        log_prob,
        old_log_prob,
        advantages,
        mask,
        clip_low=alg.clip_ratio_low,
        clip_high=alg.clip_ratio_high,
        clip_ratio_c=alg.clip_ratio_c,
        agg_mode=alg.loss_agg_mode,
        **counts,
    )
    if ref_log_prob is not None:
        kl = agg_loss(kl_penalty(alg.kl_estimator, log_prob, ref_log_prob, mask), mask, alg.loss_agg_mode, **counts)
        loss = loss + alg.kl_coef * kl
        metrics = {**metrics, "kl_ref": kl.detach()}
    if entropy is not None:
        trained = mask.bool()
        tokens = trained.sum().clamp_min(1).to(entropy.dtype)
        metrics = {**metrics, "entropy_token": torch.where(trained, entropy, 0.0).sum() / tokens}
    return loss, metrics


def sized_token_budget(cfg, backend: Backend, device: torch.device, model_path: str, verbose: bool):
    """``cfg`` with ``actor.max_tokens_per_micro_batch=auto`` resolved by the planner for this device
    (``planner.token_budget``, from the memory the runtime reports; with fsdp's ``auto`` layout, that layout too),
    the smallest over the ranks (they run the same micro-batching; ZeRO-3 if any rank needs it: it fits wherever
    keeping the layers gathered does), said once; any other config as it is. On the host, or for a model the planner
    cannot size, the planner's host budget."""
    if cfg.actor.max_tokens_per_micro_batch != "auto":
        return cfg
    from gspo_ascend.doctor import planner
    from gspo_ascend.doctor.modelspec import load_spec

    total, spec, unsized = backend.total_memory(device.index or 0), None, None
    if total is not None:
        try:
            spec = load_spec(model_path)
        except UserError as exc:
            total, unsized = None, f"the planner cannot size this model: {exc}"
    own, mode, how = planner.token_budget(cfg, spec, total, backend.name == "npu")
    budget, kept = (int(v) for v in _all_reduce([own, float(mode != "on")], dist.ReduceOp.MIN, device))
    if verbose:
        why = unsized or (how if budget == own else "the smallest device's")
        print(f"note: actor.max_tokens_per_micro_batch=auto: {budget:,} tokens a micro-batch ({why})", flush=True)
    out = planner.with_value(cfg, planner.TOKEN_BUDGET_KEY, budget)
    return planner.with_value(out, planner.RESHARD_KEY, "off" if kept else "on") if mode else out


def _all_reduce(values, op, device) -> torch.Tensor:
    t = torch.as_tensor(values, dtype=torch.float64, device=device)
    if dist.get_world_size() > 1:
        dist.all_reduce(t, op=op)
    return t.cpu()


def update_metrics(records: list[MinibatchRecord], device, current_lr: float) -> dict[str, float]:
    """An update's metrics: per-minibatch global values (every rank's weighted sums, min/max over ranks), then
    the mean over the minibatches that stepped (over all of them when none did). Ranks that report no loss
    metrics (megatron's non-last pipeline stages) contribute zeros / +-inf."""
    for record in records:
        record.settle()  # the engines settle after each minibatch's loop; a record built elsewhere may not be
    local = tuple(sorted({k for r in records for k in getattr(r, book)}) for book in ("sums", "mins", "maxs"))
    keys = [local] * dist.get_world_size()
    if len(keys) > 1:  # a rank may hold keys another lacks
        dist.all_gather_object(keys, local)
    sum_keys, min_keys, max_keys = (sorted({k for entry in keys for k in entry[i]}) for i in range(3))
    sums = _all_reduce([[r.sums.get(k, 0.0) for k in sum_keys] for r in records], dist.ReduceOp.SUM, device)
    # MIN and MAX in one MAX all-reduce: min x = -max(-x); +-inf = no non-empty sequence anywhere
    ext = [[-r.mins.get(k, math.inf) for k in min_keys] + [r.maxs.get(k, -math.inf) for k in max_keys] for r in records]
    ext = _all_reduce(ext, dist.ReduceOp.MAX, device) if min_keys or max_keys else None
    per_mb = []
    for j in range(len(records)):
        values = combine(dict(zip(sum_keys, sums[j].tolist(), strict=True)))
        if ext is not None:
            for key, value in zip(min_keys + max_keys, ext[j].tolist(), strict=True):
                values[key] = 1.0 if math.isinf(value) else (-value if key in min_keys else value)
        per_mb.append(values)
    stepped = [j for j, r in enumerate(records) if not r.skipped] or list(range(len(records)))
    out = {f"actor/{k}": sum(per_mb[j][k] for j in stepped) / len(stepped) for k in per_mb[0]}
    norms = [r.grad_norm for r in records if not r.skipped]
    lrs = [r.lr for r in records if not r.skipped]
    out["actor/grad_norm"] = sum(norms) / len(norms) if norms else math.nan
    out["actor/lr"] = lrs[-1] if lrs else current_lr
    out["actor/nan_steps_skipped"] = float(sum(r.skipped for r in records))
    out["actor/micro_batches"] = float(sum(r.passes for r in records))
    index = sum_keys.index("oversized_samples") if "oversized_samples" in sum_keys else None
    out["actor/oversized_samples"] = float(sums[:, index].sum()) if index is not None else 0.0
    return out
