"""Context parallelism (``actor.context_parallel_size``) for the ``megatron`` engine.

Layout (Megatron's, which TE's and MindSpeed's CP attention expect). A right-padded ``[b, S]`` micro-batch is
padded so that ``S`` divides by ``2 * cp`` (times TP with sequence parallelism), cut into ``2 * cp`` equal chunks
along S, and CP rank ``r`` keeps chunks ``r`` and ``2 * cp - 1 - r`` (every rank gets the same causal work).
Tokens and position ids follow the layout; the response tokens a rank scores are those whose *predicting
position* it holds. Every rank of a CP group runs the same samples (the engine gathers them over TP x CP).

Log-probs and the loss. Each rank computes vocab-parallel log-probs for its own positions (0 elsewhere), and
:func:`sum_over_cp` all-reduces the ``[b, R]`` result (each token is owned by exactly one rank, so the sum is
exact) with an *identity* backward. Every rank then evaluates the same loss ``L`` on the full log-probs (GSPO's
sequence ratio needs the mean over the whole response); the backward seeds ``dL/dlp`` on every rank, and the
identity backward routes it only into the rank's own tokens' graph. Megatron's DDP sums gradients over the
data-parallel-with-CP group, so the total is ``sum_r dL/dlp . dlp_r/dtheta = dL/dtheta``: each token counted
once, no 1/cp rescaling (a plain differentiable all-reduce would give ``cp * dL/dtheta``).

Attention. On CUDA with Transformer Engine, TE does CP itself (``cp_comm_type: p2p``); under MindSpeed (an NPU,
or the emulated one where MindSpeed is installed) MindSpeed's ``megatron_cp_algo`` (its
``MindSpeedCPDotProductAttention`` replaces megatron's core attention class, and its RoPE slicing replaces
megatron's ``get_pos_emb_on_this_cp_rank``). Elsewhere (the local layer spec: CPU, CUDA without TE) megatron's local
``DotProductAttention`` refuses CP, so :class:`AllGatherKVAttention` takes its place: K and V are all-gathered
over the CP group (reduce-scattered in backward), put back in sequence order, and the local queries attend
causally by their global positions. It is the reference the CPU tests check against Hugging Face.

How we differ from verl / MindSpeed: verl's megatron actor pads and splits in the same layout but computes the
loss on per-rank log-probs and gathers for metrics; we gather log-probs before the loss (GSPO needs whole
sequences) and make the gradient exact with the identity backward. MindSpeed's ``kvallgather_cp_algo`` is a
fused NPU kernel; ours is plain torch for the CPU path (memory ``O(S_local x S)`` per head).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import torch
import torch.distributed as dist

from gspo_ascend.config import Config
from gspo_ascend.device import Backend
from gspo_ascend.engines import mindspeed_setup
from gspo_ascend.errors import ConfigError

# ----------------------------------------------------------------------------------------------- layout


def zigzag_index(length: int, cp: int, rank: int) -> torch.Tensor:
    """Global positions held by CP ``rank``, in its local order: chunks ``rank`` and ``2cp-1-rank`` of ``2cp``."""
    if length % (2 * cp):
        raise ValueError(f"sequence length {length} does not divide into 2 * cp = {2 * cp} chunks")
    chunk = length // (2 * cp)
    first, second = rank * chunk, (2 * cp - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


def split_zigzag(x: torch.Tensor, dim: int, cp: int, rank: int) -> torch.Tensor:
    """This rank's part of ``x`` along ``dim`` (the global sequence axis)."""
    return x.index_select(dim, zigzag_index(x.shape[dim], cp, rank).to(x.device))


def unsplit_zigzag(local_parts: torch.Tensor, dim: int, cp: int) -> torch.Tensor:
    """Every rank's part concatenated along ``dim`` in rank order -> the sequence in global order (the inverse
    of :func:`split_zigzag` over all ranks; differentiable)."""
    length = local_parts.shape[dim]
    order = torch.cat([zigzag_index(length, cp, r) for r in range(cp)])  # gathered slot j holds position order[j]
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(length)
    return local_parts.index_select(dim, inverse.to(local_parts.device))


def shard_micro(micro: Any, cp: int, rank: int, multiple: int, pad_id: int) -> Any:
    """The engine's ``_Micro`` as CP ``rank`` runs it: tokens / global position ids in the zigzag layout (the
    width padded to a multiple of ``2 * cp * multiple``) and only the response tokens predicted from a position
    this rank holds, with those positions renumbered to local indices. ``shape`` (b, R) is unchanged."""
    b, width = micro.tokens.shape
    unit = 2 * cp * multiple
    padded = -(-width // unit) * unit
    tokens = torch.nn.functional.pad(micro.tokens, (0, padded - width), value=pad_id)
    index = zigzag_index(padded, cp, rank).to(tokens.device)
    local_of = torch.full((padded,), -1, dtype=torch.long, device=tokens.device)
    local_of[index] = torch.arange(index.numel(), device=tokens.device)
    local = local_of[micro.positions]
    mine = local >= 0
    return dataclasses.replace(
        micro,
        tokens=tokens.index_select(1, index),
        position_ids=index.expand(b, index.numel()),
        rows=micro.rows[mine],
        positions=local[mine],
        cols=micro.cols[mine],
        labels=micro.labels[mine],
    )


# ----------------------------------------------------------------------------------------------- collectives


class _SumIdentityBackward(torch.autograd.Function):
    """All-reduce SUM forward, identity backward: see the module docstring for why the gradient is exact."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def sum_over_cp(log_probs: torch.Tensor, group) -> torch.Tensor:
    """[b, R] per-rank log-probs (0 where another rank owns the token) -> the full [b, R] on every CP rank."""
    if group is None or dist.get_world_size(group) == 1:
        return log_probs
    return _SumIdentityBackward.apply(log_probs, group)


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 forward; backward: all-reduce the gradient and keep this rank's slice, i.e. a
    reduce-scatter built from all_reduce, which gloo has (its reduce_scatter does not exist)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group, ctx.rank, ctx.size = group, dist.get_rank(group), dist.get_world_size(group)
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(ctx.size)]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, 0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        return total.chunk(ctx.size, 0)[ctx.rank].contiguous(), None


# ----------------------------------------------------------------------------------------------- attention


class LocalCoreAttention(torch.nn.Module):
    """What a drop-in for the local spec's ``DotProductAttention`` reads at construction (the same keywords): this TP
    rank's query heads and KV groups, the softmax scale, the dropout; plain causal attention only (``refusal``: the
    one-line message for a model that asks for another softmax or a window)."""

    refusal = "actor.context_parallel_size > 1 on the local layer spec supports plain causal attention"

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout=None,
        softmax_scale=None,
        cp_comm_type=None,
        pg_collection=None,
    ) -> None:
        super().__init__()
        from megatron.core import parallel_state as ps

        if getattr(config, "softmax_type", "vanilla") != "vanilla" or getattr(config, "window_size", None):
            raise ConfigError(self.refusal)
        self.config = config
        tp = ps.get_tensor_model_parallel_world_size() if pg_collection is None else pg_collection.tp.size()
        self.heads = config.num_attention_heads // tp
        self.groups = max(1, config.num_query_groups // tp)
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout


class AllGatherKVAttention(LocalCoreAttention):
    """Causal core attention under CP for megatron's local layer spec (drop-in for its ``DotProductAttention``:
    same constructor keywords, same ``forward(query, key, value, attention_mask, ...)``, ``[sq, b, np * hn]``
    out). Inputs are this rank's zigzag part of the sequence; see the module docstring."""

    def __init__(self, config, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        from megatron.core import parallel_state as ps

        self.cp_group = ps.get_context_parallel_group()
        self.cp, self.cp_rank = dist.get_world_size(self.cp_group), dist.get_rank(self.cp_group)
        self.dropout = torch.nn.Dropout(self.dropout_p)

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        # query [sq, b, np, hn], key / value [sq, b, ng, hn]: this rank's zigzag part of the sequence
        if attention_mask is not None or attention_bias is not None or packed_seq_params is not None:
            raise NotImplementedError("AllGatherKVAttention supports causal attention without masks or packing")
        sq = query.shape[0]
        length = sq * self.cp
        key = unsplit_zigzag(_GatherSequence.apply(key, self.cp_group), 0, self.cp)  # [S, b, ng, hn]
        value = unsplit_zigzag(_GatherSequence.apply(value, self.cp_group), 0, self.cp)
        repeat = self.heads // self.groups
        q = query.permute(1, 2, 0, 3)  # [b, np, sq, hn]
        k = key.permute(1, 2, 0, 3).repeat_interleave(repeat, dim=1)  # [b, np, S, hn]
        v = value.permute(1, 2, 0, 3).repeat_interleave(repeat, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)).float() * self.scale  # [b, np, sq, S]
        q_pos = zigzag_index(length, self.cp, self.cp_rank).to(query.device)
        future = torch.arange(length, device=query.device)[None, :] > q_pos[:, None]  # [sq, S]
        probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1).to(query.dtype)
        if self.training and self.dropout.p > 0:
            from megatron.core import tensor_parallel

            with tensor_parallel.get_cuda_rng_tracker().fork():
                probs = self.dropout(probs)
        context = torch.matmul(probs, v)  # [b, np, sq, hn]
        return context.permute(2, 0, 1, 3).reshape(sq, query.shape[1], -1)


# ----------------------------------------------------------------------------------------------- engine hooks


def check_config(cfg: Config) -> None:
    """Combinations the CP path cannot run, refused by key."""
    a = cfg.actor
    if a.context_parallel_size < 1:
        raise ConfigError(f"config key 'actor.context_parallel_size' must be >= 1, got {a.context_parallel_size}")
    if a.context_parallel_size > 1 and a.pipeline_parallel_size > 1:
        raise ConfigError(
            "config key 'actor.context_parallel_size' > 1 cannot be combined with actor.pipeline_parallel_size > 1 "
            "in the megatron engine (samples are gathered over TP x CP only); set one of them to 1"
        )


def check_world(cfg: Config, world: int) -> None:
    a = cfg.actor
    model_parallel = a.tensor_parallel_size * a.pipeline_parallel_size * a.context_parallel_size
    if a.context_parallel_size > 1 and world % model_parallel:  # CP = 1: engines/megatron.py names TP x PP
        raise ConfigError(
            f"config key 'actor.context_parallel_size' = {a.context_parallel_size}: the world size ({world}) must "
            f"be a multiple of TP x PP x CP ({a.tensor_parallel_size} x {a.pipeline_parallel_size} x "
            f"{a.context_parallel_size}); change the CP size or the number of ranks"
        )


def local_attention_needed(cp: int, backend: Backend, use_te: bool) -> bool:
    """Our all-gather attention replaces the local spec's core attention unless TE or MindSpeed does CP."""
    return cp > 1 and not use_te and not mindspeed_setup.enabled(backend)


def transformer_overrides(cfg: Config, backend: Backend, use_te: bool) -> dict[str, Any]:
    """TransformerConfig settings for CP: TE's p2p ring on CUDA. Under MindSpeed nothing: its ring algorithm
    (``context_parallel_algo: megatron_cp_algo``, ``attention_mask_type: causal``) is chosen through the arguments
    :func:`.mindspeed_setup.mindspeed_args` gives ``repatch``, which MindSpeed's TransformerConfig wrapper merges
    into every config (they are per-instance fields, so a filter on the class's fields would drop them)."""
    if cfg.actor.context_parallel_size == 1:
        return {}
    if use_te:
        return {"cp_comm_type": "p2p"}
    return {}


def use_local_cp_attention(bridge: Any) -> None:
    """Make ``bridge`` (already using the local spec) build :class:`AllGatherKVAttention` as core attention."""
    use_core_attention(bridge, AllGatherKVAttention)


def use_core_attention(bridge: Any, core_attention: type) -> None:
    """Make ``bridge`` (already using the local spec) build ``core_attention`` in every self-attention layer (also
    megatron_attention's SDPA core attention)."""
    bridge.__class__ = _core_attention_spec_class(type(bridge), core_attention)


@functools.cache
def _core_attention_spec_class(base: type, core_attention: type) -> type:
    def _get_transformer_layer_spec(self, vp_stage=None):
        return with_core_attention(base._get_transformer_layer_spec(self, vp_stage), core_attention)

    # a subclass, like megatron_bridge's local-spec class: mbridge calls the spec builder through self
    name = f"{core_attention.__name__}{base.__name__}"
    return type(name, (base,), {"_get_transformer_layer_spec": _get_transformer_layer_spec})


def with_core_attention(block_spec: Any, core_attention: type) -> Any:
    """A copy of a decoder block spec whose self-attention layers build ``core_attention``."""

    def swap(layer_spec):
        attention = layer_spec.submodules.self_attention
        inner = dataclasses.replace(attention.submodules, core_attention=core_attention)
        submodules = dataclasses.replace(
            layer_spec.submodules, self_attention=dataclasses.replace(attention, submodules=inner)
        )
        return dataclasses.replace(layer_spec, submodules=submodules)

    if hasattr(block_spec, "layer_specs"):
        return dataclasses.replace(block_spec, layer_specs=[swap(s) for s in block_spec.layer_specs])
    return swap(block_spec)


def localise_rope(model: torch.nn.Module, cp: int, cp_rank: int) -> None:
    """RoPE tables in the zigzag layout without megatron's own slicing (``get_pos_emb_on_this_cp_rank`` pins
    host memory, which a CPU-only torch cannot): megatron builds the table for the full length
    (``local S x cp``); a forward hook keeps this rank's rows."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    def keep_mine(_module, _inputs, emb):
        return split_zigzag(emb, 0, cp, cp_rank)

    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.cp_group = None  # megatron slices only when it has a CP group of size > 1
            module.register_forward_hook(keep_mine)
