"""The ``megatron`` engine's forward, backward and update (:class:`MegatronTrainStep`, mixed into
:class:`.megatron.MegatronEngine`): the model-parallel group's shards gathered, packed (THD) or right-padded
micro-batches (:class:`_Micro`) built on the host, equalised over ranks with dummy passes, megatron's pipeline
schedule, vocab-parallel log-probs (:func:`vocab_parallel_log_probs`), the policy loss over global token / sequence
counts, and the optimizer step with the non-finite skip rule and fsdp's warm-up. How and why: the module docstring
of :mod:`.megatron`."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
from typing import Any

import torch
import torch.distributed as dist

from gspo_ascend.algorithms import count_tokens_and_seqs
from gspo_ascend.device import upload
from gspo_ascend.engines import megatron_cp as cp_support
from gspo_ascend.engines.base import SampleBatch
from gspo_ascend.engines.logprobs import LOGSUMEXP_CHUNK, response_lengths, uploaded
from gspo_ascend.engines.megatron_compat import uses_decoupled_grads
from gspo_ascend.engines.microbatch import micro_batches
from gspo_ascend.engines.train_common import (
    MinibatchRecord,
    check_update_batch,
    on_device,
    policy_objective,
    update_metrics,
    warmup_factor,
)

# ----------------------------------------------------------------------------------------------- micro-batches


@dataclasses.dataclass
class _Micro:
    """One forward pass: a right-padded [b, S] token block, or with ``cu_seqlens`` one packed [1, T] row (THD), and
    where each response token's log-prob comes from (logits row, position predicting it) and goes to (row, column of
    the [b, R] output). Built on the host (:func:`_build_micro`, with CP :func:`.megatron_cp.shard_micro`), then
    moved whole by :func:`_placed`."""

    tokens: torch.Tensor  # [b, S] int64 ([1, T] packed)
    position_ids: torch.Tensor  # [b, S]
    rows: torch.Tensor  # [N] the output row (sample) of each response token
    positions: torch.Tensor  # [N]
    cols: torch.Tensor  # [N]
    labels: torch.Tensor  # [N]
    shape: tuple[int, int]  # (b, R)
    sample: SampleBatch | None = None  # None for a dummy pass
    index: list[int] | None = None  # rows of the (mini)batch this micro-batch holds
    ref_log_probs: torch.Tensor | None = None  # [b, R], with algorithm.kl_coef > 0
    host_positions: torch.Tensor | None = None  # [S] the columns' sequence positions, on the host (MoE routing)
    cu_seqlens: list[int] | None = None  # packed: the sequences' cumulative ends with a leading 0 (then a padding one)
    at_rows: torch.Tensor | None = None  # packed: the logits row of each response token (0); padded: ``rows``
    packed_seq_params: Any = None  # packed: megatron-core's PackedSeqParams (THD), set by :func:`_placed`


def _build_micro(batch: SampleBatch, pad_id: int, multiple: int, index: list[int] | None, packed: bool) -> _Micro:
    """The micro-batch on the host: right-padded [b, S] or one packed [1, T] row, its width a multiple of
    ``multiple`` (sequence parallelism splits it over TP ranks; packed, the padding is a sequence of its own, since
    megatron's THD attention and RoPE need the boundaries to cover the row)."""
    lengths = response_lengths(batch)
    seqs = [list(p) + row[:n] for p, row, n in zip(batch.prompt_ids, batch.response_ids.tolist(), lengths, strict=True)]
    starts = [0] * len(seqs)
    if packed:
        for i in range(1, len(seqs)):
            starts[i] = starts[i - 1] + len(seqs[i - 1])
    width = starts[-1] + len(seqs[-1]) if packed else max(len(s) for s in seqs)
    width = -(-width // multiple) * multiple
    tokens = torch.full((1 if packed else len(seqs), width), pad_id, dtype=torch.long)
    rows, positions, cols, labels = [], [], [], []
    for i, (seq, prompt, n, start) in enumerate(zip(seqs, batch.prompt_ids, lengths, starts, strict=True)):
        tokens[0 if packed else i, start : start + len(seq)] = torch.tensor(seq)
        rows += [i] * n
        at = start + len(prompt) - 1  # logits at len(prompt)-1+t predict response token t
        positions += range(at, at + n)
        cols += range(n)
        labels += seq[len(prompt) :]

    rows_t, positions_t, cols_t, labels_t = (torch.tensor(v, dtype=torch.long) for v in (rows, positions, cols, labels))
    b, r = batch.response_ids.shape
    micro = _Micro(
        tokens=tokens,
        position_ids=torch.arange(width).expand(len(seqs), width),
        rows=rows_t,
        positions=positions_t,
        cols=cols_t,
        labels=labels_t,
        shape=(b, r),
        sample=batch if index is not None else None,
        index=index,
    )
    if packed:
        ends = [start + len(seq) for start, seq in zip(starts, seqs, strict=True)]
        micro.cu_seqlens = [0, *ends] + ([width] if width > ends[-1] else [])
        micro.position_ids = torch.cat([torch.arange(hi - lo) for lo, hi in itertools.pairwise(micro.cu_seqlens)])[None]
        micro.at_rows = torch.zeros_like(rows_t)
    return micro


def _placed(micro: _Micro, device, boundaries_on_device: bool) -> _Micro:
    """A host-built micro-batch on ``device``, every tensor through the device layer's ``upload`` (issue #43: built
    on the device, or sharded there for CP with a boolean mask, each would be a copy or read the host waits on); its
    columns' positions stay on the host too, for the MoE routers' targets (megatron_routing.py). Packed, the THD
    boundaries go to megatron-core as ``PackedSeqParams``: on the host where only Python reads them (our SDPA core
    attention, megatron's unfused THD RoPE, MindSpeed's flash attention: each a ``.tolist()``, free there),
    ``boundaries_on_device`` for Transformer Engine's kernels."""
    b, width = micro.tokens.shape
    host_positions = micro.position_ids[0]
    fields = (micro.tokens, host_positions, micro.rows, micro.positions, micro.cols, micro.labels)
    tokens, position_ids, rows, positions, cols, labels = uploaded(device, *fields)
    placed = dataclasses.replace(
        micro,
        tokens=tokens,
        position_ids=position_ids.expand(b, width),
        rows=rows,
        positions=positions,
        cols=cols,
        labels=labels,
        host_positions=host_positions,
    )
    if micro.cu_seqlens is not None:
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = torch.tensor(micro.cu_seqlens, dtype=torch.int32)
        longest = max(hi - lo for lo, hi in itertools.pairwise(micro.cu_seqlens))
        cu = upload(cu, device) if boundaries_on_device else cu
        placed.at_rows = uploaded(device, micro.at_rows)[0]
        placed.packed_seq_params = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
        )
    return placed


def _dummy_batch(pad_id: int) -> SampleBatch:
    zeros = torch.zeros((1, 1))
    return SampleBatch([[pad_id]], zeros.long(), zeros)


def _logit_rows(micro: _Micro) -> torch.Tensor:
    return micro.rows if micro.at_rows is None else micro.at_rows


def vocab_parallel_log_probs(logits: torch.Tensor, micro: _Micro, temperature: float) -> torch.Tensor:
    """[b, R] float32 ``log_softmax(logits / T)[y]`` from TP-sharded logits [b, S, V/TP] (0 at padding), without
    gathering the vocabulary: megatron's vocab-parallel cross entropy all-reduces max / target / sum-exp."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    if micro.rows.numel() == 0:  # keep the graph connected: every rank must take part in the backward
        return logits.new_zeros(micro.shape, dtype=torch.float32) + 0.0 * logits.sum()
    picked = logits[_logit_rows(micro), micro.positions].float()  # [N, V/TP]
    if temperature != 1.0:
        picked = picked / temperature
    lp = -vocab_parallel_cross_entropy(picked, micro.labels)  # [N]
    return lp.new_zeros(micro.shape).index_put((micro.rows, micro.cols), lp)


def vocab_parallel_entropy(logits: torch.Tensor, micro: _Micro, temperature: float) -> torch.Tensor:
    """[b, R] float32 entropy of ``softmax(logits / T)`` at the response positions (0 at padding), no gradient, from
    TP-sharded logits [b, S, V/TP]: H = lse - sum_v p_v x_v, with the max and the two sums all-reduced over the TP
    group (two collectives: every TP rank calls this for the same micro-batches). In chunks of LOGSUMEXP_CHUNK rows,
    in place: one [chunk, V/TP] float32 block at a time beside what the log-probs' cross entropy keeps."""
    from megatron.core import parallel_state

    with torch.no_grad():
        n = micro.rows.numel()
        if n == 0:
            return logits.new_zeros(micro.shape, dtype=torch.float32)
        group = parallel_state.get_tensor_model_parallel_group()
        parallel = dist.get_world_size(group) > 1

        def chunk(start: int) -> torch.Tensor:
            rows = slice(start, start + LOGSUMEXP_CHUNK)
            x = logits[_logit_rows(micro)[rows], micro.positions[rows]].float()  # [chunk, V/TP], a copy
            return x.div_(temperature) if temperature != 1.0 else x

        # one pass over each chunk: this rank's max, sum exp(x - max) and sum exp(x - max) x, rescaled to the
        # group's max after its all-reduce
        local = torch.empty(3, n, dtype=torch.float32, device=logits.device)
        for a in range(0, n, LOGSUMEXP_CHUNK):
            x = chunk(a)
            part = local[:, a : a + LOGSUMEXP_CHUNK]
            part[0] = x.amax(-1)
            e = (x - part[0, :, None]).exp_()
            part[1] = e.sum(-1)
            part[2] = e.mul_(x).sum(-1)
        top = local[0].clone()
        if parallel:
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        sums = local[1:] * (local[0] - top).exp()  # [2, N]
        if parallel:
            dist.all_reduce(sums, group=group)
        entropy = sums[0].log() + top - sums[1] / sums[0]
        return entropy.new_zeros(micro.shape).index_put((micro.rows, micro.cols), entropy)


# ----------------------------------------------------------------------------------------------- the engine's part


class MegatronTrainStep:
    """The TrainEngine calls that run the model (``compute_log_probs``, ``update``, ``backward_minibatch``) and
    their helpers, on the state :class:`.megatron.MegatronEngine` sets up (models, optimizer, process groups)."""

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
            micro = _build_micro(part, self.pad_id, self.seq_multiple, index, self.packed)
            micro.ref_log_probs = None if ref is None else uploaded(self.device, ref[index])[0]
            micros.append(micro)
        dummy = _dummy_batch(self.pad_id)  # every pass is a collective (TP, PP, EP): ranks run the same count
        micros += [
            _build_micro(dummy, self.pad_id, self.seq_multiple, None, self.packed) for _ in range(passes - len(parts))
        ]
        if self.cp > 1:  # this rank's zigzag part of every micro-batch (megatron_cp.py), cut on the host
            micros = [cp_support.shard_micro(m, self.cp, self.cp_rank, self.seq_multiple, self.pad_id) for m in micros]
        self._oversized = plan.oversized
        return [_placed(m, self.device, self.use_te) for m in micros]

    def _schedule(self, models, micros: list[_Micro], forward_only: bool, loss_fn, phase: str | None = None) -> None:
        """One pass of megatron's forward(-backward) schedule (1F1B with PP > 1) over ``micros``. ``phase``: the
        policy's ``old`` / ``update`` forwards, whose MoE routers replay and are measured (megatron_routing.py)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        one = torch.ones((), dtype=torch.int, device=self.device)
        routed = phase is not None and self.routing is not None
        scope = self.routing.running(phase, micros, self.device) if routed else contextlib.nullcontext()
        with scope as before_forward:  # MoE routing: the routers' targets must be set per micro-batch, in order

            def forward_step(data_iterator, model):
                micro = next(data_iterator)
                if before_forward is not None:
                    before_forward(micro)
                # last stage: logits [b, S, V/TP] ([1, T, V/TP] packed)
                output = model(micro.tokens, micro.position_ids, None, packed_seq_params=micro.packed_seq_params)

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

    def _forward_only(self, models, batch: SampleBatch, temperature: float, phase: str | None = None) -> torch.Tensor:
        """[B, R] float32 host log-probs of the whole (group) batch, on every rank of the pipeline."""
        out = torch.zeros(tuple(batch.response_ids.shape), dtype=torch.float32)
        done = []  # read back after the schedule: a read per micro-batch would wait for each forward before the next

        def loss_fn(micro: _Micro, logits: torch.Tensor):
            lp = cp_support.sum_over_cp(vocab_parallel_log_probs(logits, micro, temperature), self.cp_group)
            if micro.index is not None:
                done.append((micro.index, lp.float()))
            return lp.sum() * 0.0, {}

        for model in models:
            model.eval()
        with torch.no_grad():
            self._schedule(models, self._micros(batch), True, loss_fn, phase)
        if done:  # one read for the whole batch, not one per micro-batch
            out[[i for index, _ in done for i in index]] = torch.cat([lp for _, lp in done]).cpu()
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
        if self.routes is not None:
            self.routes.forget()  # this forward's routes replace the last batch's
        full = self._forward_only(self.models, SampleBatch.concat(shards), temperature, "old")
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
        metrics = self._metrics(records)
        # a collective over every rank, like the metrics above; the agreement is a ratio per layer, and every rank
        # holding a (token, layer) counts it (TP ranks without SP all do), the same number of times for every layer
        if self.routes is not None:
            metrics.update(self.routes.metrics(self._all_reduce))
        return metrics

    @on_device
    def backward_minibatch(self, minibatch: SampleBatch, temperature: float) -> MinibatchRecord:
        """Forward/backward every micro-batch of one (model-parallel group) minibatch; the reduced gradients are
        left in megatron's buffers. Public for tests that want a gradient without an optimizer step."""
        tokens, seqs = count_tokens_and_seqs(minibatch.trained_mask)
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
            entropy = cp_support.sum_over_cp(vocab_parallel_entropy(logits, micro, temperature), self.cp_group)
            loss, metrics = self._micro_loss(lp, micro, counts, entropy)
            bad = bad | ~torch.isfinite(loss.detach())
            if self.reports:
                record.add(metrics)
            return loss, {}

        for model in self.models:
            model.train()
            model.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._schedule(self.models, micros, False, loss_fn, "update")
        (record.skipped,) = record.settle(bad)  # the minibatch's one read of the device (metrics and all)
        return record

    def _micro_loss(self, log_prob: torch.Tensor, micro: _Micro, counts: dict[str, Any], entropy: torch.Tensor):
        sample = micro.sample
        mask, old_log_probs, advantages = uploaded(
            self.device, sample.trained_mask, sample.old_log_probs, sample.advantages
        )
        alg, ref = self.cfg.algorithm, micro.ref_log_probs
        return policy_objective(self.policy_loss, alg, log_prob, old_log_probs, advantages, mask, counts, ref, entropy)

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
