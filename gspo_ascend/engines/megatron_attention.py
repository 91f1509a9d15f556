"""Core attention for megatron's local layer spec without Transformer Engine: torch's fused SDPA, not the spec's
``DotProductAttention``.

The local spec's ``DotProductAttention`` (megatron/core/transformer/dot_product_attention.py) computes the raw
scores ``[b x heads, S, S]`` with ``baddbmm``, a softmax over them (an ``[S, S]`` causal mask built beside), and a
second ``bmm``: quadratic memory per layer, kept for backward (on the GPU at 4k tokens 2.45x the planner's training
memory, issue #43), and three kernels where one would do. :class:`SDPACoreAttention` is a drop-in with the same
constructor and ``forward`` (``[sq, b, np, hn]`` in, ``[sq, b, np * hn]`` out) that calls
``torch.nn.functional.scaled_dot_product_attention`` once, causal: FlashAttention-2 or memory-efficient attention on
CUDA in half precision, the flash CPU kernel on the host; GQA through ``enable_gqa`` (no repeated K / V). Where torch
has no fused kernel for the call (fp32 on CUDA, a head dimension over 256, some GQA cases on the memory-efficient
backend) it falls back to its math kernel, which does keep the scores, as the spec did.

Packed micro-batches (megatron's THD format, the engine's default: ``PackedSeqParams`` with the sequences'
boundaries, which the engine passes on the host): megatron-core hands the core attention ``[t, heads, hn]`` and the
boundaries; each sequence attends causally within itself, one SDPA call per sequence (the fsdp engine's packed path
does the same, engines/packed_attention.py), or on CUDA in half precision one ``varlen_attn`` call per layer over the
whole row. The local spec's ``DotProductAttention`` refuses packed input.

Where it runs (engines/megatron.py): the local spec without MindSpeed and without context parallelism, that is a
GPU without TE, and the CPU. Not under MindSpeed, which patches ``DotProductAttention.forward`` itself with the
NPU's fused attention; not with CP > 1 (megatron_cp.AllGatherKVAttention); not with TE (its own fused attention).
Refused by config key where the spec asks for what it does not do: a softmax other than vanilla, a window.

Numerics: the same softmax(q k^T * scale) v; megatron's ``apply_query_key_layer_scaling`` divides the scale by the
layer number and multiplies it back inside its softmax, so the product is the plain scale here. Half precision: the
spec rounds the scores to bf16 before its fp32 softmax, the fused kernels keep them in fp32 (closer to exact).
Tested against ``DotProductAttention`` itself (tests/unit/test_megatron_attention.py) and, through the engine,
against Hugging Face log-probs and the fsdp engine's update (tests/integration/test_megatron_engine.py).

How we differ from verl: verl's Megatron path needs Transformer Engine (its fused attention); without TE we still
run a fused attention.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any

import torch

from gspo_ascend.engines import packed_attention
from gspo_ascend.engines.megatron_cp import LocalCoreAttention, use_core_attention
from gspo_ascend.errors import ConfigError


class SDPACoreAttention(LocalCoreAttention):
    """Causal core attention through one SDPA call (the module docstring)."""

    refusal = (
        "the megatron engine's SDPA core attention (local layer spec, no Transformer Engine) supports plain causal "
        "attention; this model asks for another softmax or a window: install Transformer Engine"
    )

    def __init__(self, config, layer_number: int, attn_mask_type, *args, **kwargs) -> None:
        super().__init__(config, layer_number, attn_mask_type, *args, **kwargs)
        from megatron.core.transformer.enums import AttnMaskType

        if attn_mask_type != AttnMaskType.causal or getattr(config, "context_parallel_size", 1) != 1:
            raise ConfigError("SDPACoreAttention is causal self-attention without context parallelism")
        self.sequence_parallel = bool(getattr(config, "sequence_parallel", False))

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        # query [sq, b, np, hn], key / value [sk, b, ng, hn] -> [sq, b, np * hn]; THD: [t, np, hn] -> [t, np * hn]
        if attention_mask is not None or attention_bias is not None:
            raise NotImplementedError("SDPACoreAttention takes causal attention without masks or biases")
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
        extra: dict[str, Any] = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
        p = self.dropout_p if self.training else 0.0
        with _dropout_rng(p, self.sequence_parallel):
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, dropout_p=p, is_causal=True, scale=self.scale, **extra
            )
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)

    def _packed(self, query, key, value, params):
        """THD: each sequence of the packed row attends causally within itself. On CUDA in half precision one
        ``varlen_attn`` call over the row (engines/packed_attention.py); elsewhere one SDPA call per sequence."""
        if params.qkv_format != "thd" or params.cu_seqlens_q_padded is not None:
            raise NotImplementedError("SDPACoreAttention takes THD packing without per-sequence padding")
        cu = params.cu_seqlens_q
        if params.cu_seqlens_kv is not cu and not torch.equal(params.cu_seqlens_kv, cu):
            raise NotImplementedError("SDPACoreAttention takes packed self-attention (the same query and key bounds)")
        bounds = cu.tolist()  # the engine passes them on the host (megatron_train._placed): no device read
        if bounds[0] != 0 or bounds[-1] != query.shape[0]:
            raise ValueError(
                f"cu_seqlens {bounds[:3]}...{bounds[-1:]} does not cover the packed row of {query.shape[0]}"
            )
        q, k, v = (t.permute(1, 0, 2).unsqueeze(0) for t in (query, key, value))  # [1, heads, t, hn]
        p = self.dropout_p if self.training else 0.0
        if p == 0.0 and packed_attention.varlen_applies(self, q, {}):
            out = packed_attention.varlen_forward(q, k, v, cu, bounds, {"scaling": self.scale})[0]  # [1, t, np, hn]
            return out.reshape(query.shape[0], -1)
        extra: dict[str, Any] = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
        lengths = [end - start for start, end in itertools.pairwise(bounds)]
        outs = []
        with _dropout_rng(p, self.sequence_parallel):
            # split, not one slice per sequence: split's backward is one cat (packed_attention.attention_forward)
            for qi, ki, vi in zip(*(t.split(lengths, dim=2) for t in (q, k, v)), strict=True):
                outs.append(
                    torch.nn.functional.scaled_dot_product_attention(
                        qi, ki, vi, dropout_p=p, is_causal=True, scale=self.scale, **extra
                    )
                )
        return torch.cat(outs, dim=2)[0].permute(1, 0, 2).reshape(query.shape[0], -1)


def _dropout_rng(p: float, sequence_parallel: bool):
    """Megatron's model-parallel RNG region for attention dropout, where DotProductAttention draws it (without
    sequence parallelism); none without dropout."""
    if p == 0.0 or sequence_parallel:
        return contextlib.nullcontext()
    from megatron.core import tensor_parallel

    return tensor_parallel.get_cuda_rng_tracker().fork()


def use_sdpa_attention(bridge: Any) -> None:
    """Make ``bridge`` (already using the local spec) build :class:`SDPACoreAttention` as core attention."""
    use_core_attention(bridge, SDPACoreAttention)
