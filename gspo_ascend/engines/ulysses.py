"""Ulysses sequence parallelism for the fsdp engine (DeepSpeed-Ulysses, arXiv 2309.14509).

``actor.ulysses_sequence_parallel_size`` = SP ranks form one group that runs the same micro-batches. A micro-batch's
packed row (every prompt + response, positions restarting per sequence: ``logprobs.packed_row``) is padded to a
multiple of SP and cut into SP contiguous token slices, one per rank. Everything but attention works token by
token, so each rank runs the embeddings, norms, MLPs, rotary embeddings (with its slice's own position ids) and
the LM head on its slice only. Inside every attention layer an all-to-all turns this rank's [all heads, N / SP
tokens] into [heads / SP, all N tokens]; attention then runs per sequence over the whole row through the model's
own implementation, and a second all-to-all brings the output back to [all heads, N / SP tokens]. The hook is
one registered transformers attention implementation, ``ulysses_<inner>`` (:func:`attention_forward`), wrapping
the one the model had: ``sdpa`` and ``eager`` run once per sequence (causal, no mask: exact, and no [N, N]
matrix; through engines/packed_attention.py, the non-SP packed path's per-sequence attention),
``flash_attention_2`` and the NPU patches' ``npu_fusion`` (TND) get the full row's position ids and find the
sequence boundaries themselves.

KV heads: the all-to-all scatters heads, so heads and KV heads must split over SP. Fewer KV heads than SP (GQA,
e.g. Qwen2.5-3B: 2 KV heads at SP 4) are repeated SP / KV times before the exchange, which keeps each rank's
query heads with their own KV head; SP and the KV head count must divide one another (:func:`layout_problem`).

Log-probs, loss, gradients (:func:`forward_log_probs`): each rank computes the log-probs of the response tokens
predicted from its slice into a zero [B, R]; an all-reduce SUM over the group assembles the full [B, R] exactly
(the slices are disjoint: every sum adds zeros; the megatron engine's context parallelism does the same,
``megatron_cp.sum_over_cp``). Each rank of the group then evaluates the same loss on it, so
sequence-level quantities (GSPO's per-sequence ratio) see whole sequences. The all-reduce's backward passes the
gradient through unchanged: each rank back-propagates only its own positions, through the all-to-alls of every
layer, and the group's per-rank parameter gradients add up to the gradient of one copy of the loss. FSDP (over
every rank) averages them, so the engine scales the loss by the world size, as it does without SP.

How we differ from verl (``verl/utils/ulysses.py``, ``verl/models/transformers/monkey_patch.py``):
- verl monkey-patches transformers' flash-attention forward, so its Ulysses path needs flash attention; here the
  hook wraps whatever implementation the model runs, sdpa, eager and the NPU patches' fused attention included;
- verl all-gathers the slices' position ids in every attention layer; here the full row's position ids travel
  with the forward call as a keyword argument that transformers hands to every attention call (recomputation
  under gradient checkpointing included), so no extra collective;
- verl all-gathers the log-probs with a backward that multiplies by SP (to undo FSDP's average over the SP
  ranks); here an all-reduce with identity backward, and the world-size loss scale of the data-parallel engine.
As in verl, the token budget is per device (``actor.max_tokens_per_micro_batch``, verl's
``ppo_max_token_len_per_gpu``): a micro-batch of the SP group holds up to SP x as many tokens.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gspo_ascend.engines import packed_attention
from gspo_ascend.engines.base import SampleBatch
from gspo_ascend.engines.logprobs import _scatter, head_log_probs, packed_row, response_tokens, uploaded
from gspo_ascend.engines.megatron_cp import sum_over_cp

KEY = "actor.ulysses_sequence_parallel_size"
PREFIX = "ulysses_"
SUPPORTED = ("sdpa", "eager", "flash_attention_2", "npu_fusion")  # npu_fusion: the NPU patches' implementation


@dataclass(frozen=True)
class SPGroup:
    """This rank's sequence-parallel group."""

    group: Any  # a torch.distributed ProcessGroup
    size: int
    rank: int


# ----------------------------------------------------------------------------------------------- layout


def layout_problem(sp: int, heads: int, kv_heads: int) -> str | None:
    """Why a model with ``heads`` query / ``kv_heads`` KV heads cannot run at SP ``sp`` (one line), or None."""
    if sp <= 1:
        return None
    divisors = [d for d in range(1, heads + 1) if heads % d == 0]
    if heads % sp:
        return (
            f"config key '{KEY}' ({sp}) must divide the model's num_attention_heads ({heads}): the all-to-all splits "
            f"heads over the group; use one of {', '.join(map(str, divisors))}"
        )
    if kv_heads % sp and sp % kv_heads:
        return (
            f"config key '{KEY}' ({sp}) and the model's num_key_value_heads ({kv_heads}) must divide one another "
            "(fewer KV heads than SP are repeated up to SP)"
        )
    return None


def kv_repeats(sp: int, kv_heads: int) -> int:
    """How many copies of each KV head go into the all-to-all: SP / KV when there are fewer KV heads than SP."""
    return max(sp // kv_heads, 1)


def check_model(config: Any, sp: int) -> str | None:
    """:func:`layout_problem` for a transformers config, plus what the hook cannot do (sliding windows)."""
    heads = config.num_attention_heads
    problem = layout_problem(sp, heads, getattr(config, "num_key_value_heads", None) or heads)
    if problem is None and sp > 1 and "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        problem = f"config key '{KEY}' ({sp}): the model uses sliding-window attention, which Ulysses SP does not do"
    return problem


# ----------------------------------------------------------------------------------------------- collectives


def _all_to_all(x: torch.Tensor, group: Any, size: int, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Chunk ``scatter_dim`` into ``size`` parts, send part k to rank k, concatenate what arrives along
    ``gather_dim`` in rank order."""
    send = torch.stack(x.chunk(size, dim=scatter_dim)).contiguous()  # [size, *part]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """The exchange and its adjoint: the backward is the reverse exchange (gather_dim <-> scatter_dim)."""

    @staticmethod
    def forward(ctx, x, group, size, scatter_dim, gather_dim):
        ctx.reverse = (group, size, gather_dim, scatter_dim)
        return _all_to_all(x, group, size, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad.contiguous(), *ctx.reverse), None, None, None, None


def exchange(x: torch.Tensor, sp: SPGroup | SPRow) -> torch.Tensor:
    """[B, heads, N / SP, D] -> [B, heads / SP, N, D] for q / k / v; the same call takes the attention output
    [B, N, heads / SP, D] -> [B, N / SP, heads, D] (scatter dim 1, gather dim 2 in both directions)."""
    return _AllToAll.apply(x, sp.group, sp.size, 1, 2)


def group_shards(batch: SampleBatch, sp: SPGroup) -> list[SampleBatch]:
    """Every group rank's shard of the driver's batch, in group order (the group trains on all of them)."""
    shards: list[Any] = [None] * sp.size
    dist.all_gather_object(shards, batch, group=sp.group)
    return shards


# ----------------------------------------------------------------------------------------------- attention hook


@dataclass
class SPRow:
    """What every attention call of one forward needs about the full packed row; passed to the model as the
    keyword ``ulysses``, which transformers forwards to each attention call."""

    group: Any
    size: int
    position_ids: torch.Tensor  # [1, N] the whole row's positions (N a multiple of size)
    cu_seq_lens: torch.Tensor  # [S + 1] int32 sequence boundaries over the row, from 0 (the padding tail is one), host


def _module_view(module: torch.nn.Module, groups: int, inner: str) -> torch.nn.Module:
    """The attention module as the inner implementation must see it after the exchange: KV heads repeated for SP
    change the query-to-KV ratio sdpa / eager repeat by (``num_key_value_groups``), and flash attention picks
    its kernel from ``config._attn_implementation``, which must name the inner implementation, not ours. A shallow
    copy (same parameters, same class: eager's function is found through the class's module)."""
    view = copy.copy(module)
    view.num_key_value_groups = groups
    view.config = _ConfigView(module.config, inner)
    return view


class _ConfigView:
    def __init__(self, config: Any, inner: str) -> None:
        self._config, self._attn_implementation = config, inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


def inner_of(name: str) -> str:
    return packed_attention.inner_of(name, PREFIX)


def attention_forward(module, query, key, value, attention_mask, ulysses: SPRow | None = None, **kwargs):
    """The ``ulysses_<inner>`` attention implementation. query [B, H, N / SP, D], key / value [B, KV, N / SP, D]
    -> ([B, N / SP, H, D], None). Without ``ulysses`` (a forward outside the SP path) it is the inner implementation."""
    from transformers.models.llama.modeling_llama import repeat_kv  # [B, KV, S, D] -> each head n times in a row

    inner = inner_of(module.config._attn_implementation)
    if ulysses is None:
        return packed_attention.inner_function(inner, module)(module, query, key, value, attention_mask, **kwargs)
    if attention_mask is not None:
        raise ValueError("Ulysses SP attention takes no attention mask (sequences are found from the full row)")
    times = kv_repeats(ulysses.size, key.shape[1])
    q = exchange(query, ulysses)
    k, v = (exchange(repeat_kv(t, times), ulysses) for t in (key, value))
    view = _module_view(module, q.shape[1] // k.shape[1], inner)
    kwargs = {**kwargs, "position_ids": ulysses.position_ids}  # the row's, not this rank's slice's
    if inner in packed_attention.SUPPORTED:  # sdpa / eager: once per sequence, causal, unmasked
        out = packed_attention.attention_forward(view, q, k, v, None, cu_seq_lens_q=ulysses.cu_seq_lens, **kwargs)[0]
    else:  # flash attention / npu_fusion find the sequences from the full row's restarting positions
        out = packed_attention.inner_function(inner, module)(view, q, k, v, None, **kwargs)[0]
    return exchange(out, ulysses), None


def attention_mask_forward(*args, **kwargs):
    """The mask builder registered beside :func:`attention_forward`: the inner implementation's, so a forward outside
    the SP path is that implementation's exactly. The SP path builds no mask (it passes an empty mask mapping)."""
    inner = packed_attention.inner_mask_function(kwargs["config"], PREFIX)
    return inner(*args, **kwargs) if inner is not None else None


def enable(model: torch.nn.Module, sp: int) -> str:
    """Route ``model``'s attention through the hook (after any NPU patches chose the inner implementation);
    returns the inner implementation's name. Refuses (ConfigError, one line) what the hook cannot run."""
    from gspo_ascend.errors import ConfigError

    config = model.config
    if problem := check_model(config, sp):
        raise ConfigError(problem)
    inner = inner_of(config._attn_implementation)
    if inner not in SUPPORTED:
        raise ConfigError(
            f"config key '{KEY}' ({sp}) needs one of {', '.join(SUPPORTED)} attention; the model runs {inner!r} "
            "(model.attn_implementation)"
        )
    return packed_attention.register(model, PREFIX, attention_forward, attention_mask_forward)


# ----------------------------------------------------------------------------------------------- log-probs


def _slice(length: int, sp: SPGroup) -> tuple[int, int, int]:
    """(first, end, padding) of this rank's tokens in a row of ``length`` padded to a multiple of SP."""
    padded = -(-length // sp.size) * sp.size
    per_rank = padded // sp.size
    return sp.rank * per_rank, (sp.rank + 1) * per_rank, padded - length


def forward_log_probs(
    model: torch.nn.Module, batch: SampleBatch, temperature: float, sp: SPGroup, pad_id: int = 0, entropy: bool = False
):
    """[B, R] log-probs of ``batch.response_ids`` (0 at padding), the same on every rank of the group, computed as
    described in the module docstring; one forward per call, connected to the graph even when this rank's slice
    predicts no response token (every rank of the group must run every backward: the all-to-alls are collectives).
    With ``entropy`` also the [B, R] entropies (no gradient), as a pair (logprobs.forward_log_probs)."""
    responses = response_tokens(batch)
    lengths = [len(r) for r in responses]
    ids, pos, targets = packed_row(batch.prompt_ids, responses)
    first, end, padding = _slice(len(ids), sp)
    ends = torch.tensor([len(p) + n for p, n in zip(batch.prompt_ids, lengths, strict=True)]).cumsum(0).tolist()
    if padding:  # the padding tail is a sequence of its own (positions restart at 0): it attends to nothing real
        ids, pos, ends = ids + [pad_id] * padding, pos + list(range(padding)), ends + [len(ids) + padding]
    mine = [j for j, k in enumerate(targets.keep) if first <= k < end]
    device = next(model.parameters()).device
    cu_seq_lens = torch.tensor([0, *ends], dtype=torch.int32)  # on the host: read as a list in every layer
    row_pos, input_ids, position_ids, keep, labels = uploaded(
        device,
        torch.tensor([pos]),
        torch.tensor([ids[first:end]]),
        torch.tensor([pos[first:end]]),
        torch.tensor([targets.keep[j] - first for j in mine] or [0]),
        torch.tensor([[targets.labels[j] for j in mine] or [0]]),  # [1, kept]
    )
    row = SPRow(sp.group, sp.size, row_pos, cu_seq_lens)
    layer_types = set(getattr(model.config, "layer_types", None) or ["full_attention"])
    inputs = {
        "input_ids": input_ids,
        "position_ids": position_ids,
        "attention_mask": dict.fromkeys(layer_types),  # a ready mask mapping: the model builds no mask for the slice
        "use_cache": False,
        "logits_to_keep": keep,
        "ulysses": row,
    }
    picked = head_log_probs(model, inputs, labels, temperature, lambda out: out[0], entropy)
    rows, cols = [targets.rows[j] for j in mine], [targets.cols[j] for j in mine]
    local = _scatter(picked, rows, cols, tuple(batch.response_ids.shape))
    # the megatron engine's CP sum: all-reduce, identity backward
    return tuple(sum_over_cp(t, sp.group) for t in local) if entropy else sum_over_cp(local, sp.group)
