"""Packed (padding-free) attention that is not quadratic in the packed row: one causal attention per sequence.

A packed micro-batch is one row holding every prompt + response, positions restarting at 0 per sequence
(:func:`gspo_ascend.engines.logprobs.packed_row`). transformers 5 runs such a row, for ``sdpa`` and ``eager``, as
one attention over the whole row with a block-diagonal causal mask (``masking_utils.find_packed_sequence_indices``):
O(N^2) time in the row length N and an [N, N] mask, although all but the diagonal blocks are masked. At 32
sequences of ~150 tokens that is ~30x the work of the blocks themselves; on CPU it made packing 2x slower than
padding (benchmarks/README.md).

Here the model's attention is routed through ``packed_<inner>`` (a transformers ``AttentionInterface`` entry
wrapping the model's own ``sdpa`` or ``eager``): given the row's sequence boundaries as transformers' varlen
keywords (``cu_seq_lens_q`` / ``cu_seq_lens_k``, the cumulative lengths with a leading 0, which the packed forward
passes inside :func:`packed_forward`, where the mask builder builds nothing: no [N, N] mask), it runs the inner
implementation once per sequence, causal, unmasked: O(sum of L_i^2), exact (the same softmax over the same keys).
Any other call (a padded batch, a KV-cache decode, a forward without the keywords) is the inner implementation
unchanged, with the inner implementation's mask builder.

On CUDA in half precision, ``sdpa`` runs instead as one ``torch.nn.attention.varlen.varlen_attn`` call per layer
over the whole row (FlashAttention-2 on the cumulative lengths, causal, GQA by repeated KV heads before torch
2.12): no call per sequence, and no cuDNN plan per sequence shape (see the device layer's
``avoid_per_shape_attention_plans``). The per-sequence loop stays for CPU and fp32, where varlen_attn has no
kernel. The NPU path is already one call per layer (npu_fusion_attention TND, patches/npu_attention.py).

Only ``sdpa`` / ``eager`` are wrapped: ``flash_attention_2`` and the NPU patches' ``npu_fusion`` already run
packed rows as varlen kernels (they read the same keywords or the restarting positions), and Ulysses SP
(engines/ulysses.py) has its own per-sequence hook, so the fsdp engine enables this only without SP.

How we differ from verl: verl's padding-free path needs flash-attn (or NPU) varlen kernels and has no CPU
equivalent; transformers' own packed sdpa path is the quadratic one described above.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import sys
from collections.abc import Iterator
from typing import Any

import torch

from gspo_ascend.device import upload

PREFIX = "packed_"
SUPPORTED = ("sdpa", "eager")
HALF = (torch.float16, torch.bfloat16)
# set around a packed forward (:func:`packed_forward`): the mask builder then builds nothing. A context variable, not
# an empty mask mapping passed as ``attention_mask``: models whose forward builds its mask directly from
# ``attention_mask`` (Qwen3-MoE in transformers 4.57 and 5.x) cannot take a mapping.
_PACKED = contextvars.ContextVar("gspo_packed_forward", default=False)


def inner_of(name: str, prefix: str = PREFIX) -> str:
    """The implementation a ``<prefix><inner>`` hook wraps (``name`` itself when it is not one)."""
    return name[len(prefix) :] if name.startswith(prefix) else name


def inner_mask_function(config: Any, prefix: str = PREFIX):
    """The mask builder of the implementation a hook wraps (None where transformers registers none)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    return ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(inner_of(config._attn_implementation, prefix))


def register(model: torch.nn.Module, prefix: str, forward: Any, mask_forward: Any) -> str:
    """Register ``forward`` / ``mask_forward`` as the ``<prefix><inner>`` implementation and switch ``model`` to it
    (also the Ulysses hook's, engines/ulysses.py); returns the inner implementation's name."""
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    inner = inner_of(model.config._attn_implementation, prefix)
    AttentionInterface.register(prefix + inner, forward)
    AttentionMaskInterface.register(prefix + inner, mask_forward)
    model.config._attn_implementation = prefix + inner
    return inner


def inner_function(inner: str, module: torch.nn.Module):
    """The attention function ``inner`` names for ``module`` (also the Ulysses hook's, engines/ulysses.py)."""
    if inner == "eager":  # eager is each modeling file's own function, not in the registry
        return sys.modules[type(module).__module__].eager_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[inner]


def _causal_mask(n: int, like: torch.Tensor) -> torch.Tensor:
    """The additive [1, 1, n, n] causal mask eager attention adds to its scores."""
    return torch.full((n, n), torch.finfo(like.dtype).min, dtype=like.dtype, device=like.device).triu(1)[None, None]


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    shared_prefix_of: SharedBlocks | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The ``packed_<inner>`` implementation. query [B, H, N, D], key / value [B, KV, N, D] -> ([B, N, H, D], None).

    With ``cu_seq_lens_q`` (one packed row, B = 1): the inner implementation on each sequence's tokens, causal; for
    sdpa on CUDA in half precision one ``varlen_attn`` call over the row instead (the module docstring). With
    ``shared_prefix_of`` the row's blocks are a shared-prefix row's (:func:`shared_prefix_forward`).
    """
    inner = inner_of(module.config._attn_implementation)
    fn = inner_function(inner, module)
    if cu_seq_lens_q is None:
        return fn(module, query, key, value, attention_mask, **kwargs)
    if attention_mask is not None or query.shape[0] != 1 or key.shape[2] != query.shape[2]:
        raise ValueError("packed attention takes one row of self-attention without a mask (the sequences are the mask)")
    same = cu_seq_lens_k is None or cu_seq_lens_k is cu_seq_lens_q  # forward_kwargs passes one tensor twice
    if not same and not torch.equal(cu_seq_lens_k, cu_seq_lens_q):
        raise ValueError("packed attention needs the same query and key boundaries (self-attention)")
    bounds = cu_seq_lens_q.tolist()
    if bounds[0] != 0 or bounds[-1] != query.shape[2]:
        raise ValueError(f"cu_seq_lens_q {bounds[:3]}...{bounds[-1:]} does not cover the row of {query.shape[2]}")
    eager = fn.__name__ == "eager_attention_forward"
    lengths = [end - start for start, end in zip(bounds[:-1], bounds[1:], strict=True)]
    if shared_prefix_of is not None:
        return shared_prefix_forward(fn, eager, module, (query, key, value), lengths, shared_prefix_of, kwargs)
    if inner == "sdpa" and varlen_applies(module, query, kwargs):
        return varlen_forward(query, key, value, cu_seq_lens_q, bounds, kwargs)
    # split, not one slice per sequence: a slice's backward writes its gradient into a zero tensor of the whole
    # row (sequences x row size of fills and adds per layer, ~15% of a 32-sequence pass); split's is one cat
    outs = []
    for q, k, v in zip(*(t.split(lengths, dim=2) for t in (query, key, value)), strict=True):
        mask = _causal_mask(q.shape[2], query) if eager else None  # sdpa: is_causal when no mask
        outs.append(fn(module, q, k, v, mask, **kwargs)[0])
    return torch.cat(outs, dim=1), None


def shared_prefix_forward(fn, eager: bool, module, qkv, lengths: list[int], blocks, kwargs: dict[str, Any]):
    """A shared-prefix row (logprobs.shared_prefix_row): block b attends causally to itself after the keys of its
    prefix block ``blocks.prefix_of[b]`` (-1: none; ``blocks`` a :class:`SharedBlocks`). One call of the inner
    implementation per block, as the per-sequence loop: the same softmax over the same keys as each sample's own
    sequence, and the prefix's keys and values get the gradient of every block reading them. Always this loop
    (also where the plain row would take varlen_attn: its causal is one window per sequence, with no shared
    keys)."""
    if len(blocks) != len(lengths):
        raise ValueError(f"shared_prefix_of has {len(blocks)} blocks, the boundaries {len(lengths)}")
    query = qkv[0]
    qs, ks, vs = (t.split(lengths, dim=2) for t in qkv)
    outs = []
    for q, k, v, p in zip(qs, ks, vs, blocks.prefix_of, strict=True):
        if p < 0:  # sdpa: is_causal when no mask; eager's causal mask is the lower-right one of a square
            mask = blocks.mask(q.shape[2], q.shape[2], query, additive=True) if eager else None
        else:
            k, v = torch.cat((ks[p], k), dim=2), torch.cat((vs[p], v), dim=2)
            mask = blocks.mask(q.shape[2], k.shape[2], query, additive=eager)
        outs.append(fn(module, q, k, v, mask, **kwargs)[0])
    return torch.cat(outs, dim=1), None


class SharedBlocks:
    """A shared-prefix row's blocks for one forward (:func:`forward_kwargs`): ``prefix_of[b]`` is the prefix block
    block ``b`` attends to (-1: none), and the masks of its block shapes, built once and read by every layer (and
    by its recompute under gradient checkpointing): each layer's sdpa keeps its mask for backward, so one copy per
    forward also saves that memory. It lives as long as the forward's keywords and saved tensors, no longer."""

    def __init__(self, prefix_of) -> None:
        self.prefix_of = tuple(int(p) for p in prefix_of)
        self._masks: dict[tuple, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.prefix_of)

    def mask(self, n_q: int, n_k: int, like: torch.Tensor, additive: bool) -> torch.Tensor:
        key = (n_q, n_k, like.dtype, like.device, additive)
        if key not in self._masks:
            self._masks[key] = _lower_right_causal(n_q, n_k, like, additive)
        return self._masks[key]


def _lower_right_causal(n_q: int, n_k: int, like: torch.Tensor, additive: bool) -> torch.Tensor:
    """[1, 1, n_q, n_k]: query i (the last n_q of n_k positions) sees keys up to its own position n_k - n_q + i;
    additive (eager's scores) or boolean, True = attend (sdpa's; transformers then passes no is_causal)."""
    keep = torch.ones((n_q, n_k), dtype=torch.bool, device=like.device).tril(n_k - n_q)
    if not additive:
        return keep[None, None]
    zeros = torch.zeros((n_q, n_k), dtype=like.dtype, device=like.device)
    return zeros.masked_fill(~keep, torch.finfo(like.dtype).min)[None, None]


@functools.cache
def varlen_kernel() -> Any | None:
    """torch's ``varlen_attn`` (torch.nn.attention.varlen: FlashAttention-2 over cumulative lengths, with autograd)
    where it takes ``window_size`` (torch >= 2.10: causal is window (-1, 0)); None on older torch."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn if _takes(varlen_attn, "window_size") else None


@functools.cache
def _takes(fn: Any, keyword: str) -> bool:
    """Whether ``fn`` has the keyword, read once: the varlen call is made in every layer of every forward."""
    return keyword in inspect.signature(fn).parameters


def varlen_applies(module: torch.nn.Module, query: torch.Tensor, kwargs: dict[str, Any]) -> bool:
    """One varlen call per layer instead of one SDPA call per sequence: where the kernel exists (CUDA, half
    precision; it has no CPU or fp32 kernel) and the call asks for what it does (causal, no dropout, no
    soft-capping, no window)."""
    causal = kwargs.get("is_causal") is not False and getattr(module, "is_causal", True)
    plain = not kwargs.get("dropout") and kwargs.get("softcap") is None and kwargs.get("sliding_window") is None
    on_device = query.device.type == "cuda" and query.dtype in HALF
    return causal and plain and on_device and varlen_kernel() is not None


def varlen_forward(query, key, value, cu_host: torch.Tensor, bounds: list[int], kwargs: dict[str, Any]):
    """query [1, H, N, D], key / value [1, KV, N, D] -> ([1, N, H, D], None) through one ``varlen_attn`` call."""
    kernel = varlen_kernel()
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # [N, heads, D]
    extra: dict[str, Any] = {}
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and _takes(kernel, "enable_gqa"):  # torch >= 2.12
        extra["enable_gqa"] = True
    elif groups > 1:  # repeat the KV heads, as transformers' eager attention does
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    cu = _on_device(cu_host, q.device)
    longest = kwargs.get("max_length_q") or max(b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True))
    out = kernel(q, k, v, cu, cu, longest, longest, scale=kwargs.get("scaling"), window_size=(-1, 0), **extra)
    return out.unsqueeze(0), None


def _on_device(cu_host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The boundaries on ``device``, copied once per forward: every layer gets the same host tensor
    (:func:`forward_kwargs`), so the copy is kept on it."""
    cached = getattr(cu_host, "_gspo_on_device", None)
    if cached is None or cached.device != device:
        cached = upload(cu_host, device)  # pinned: from pageable memory the copy would wait for the device
        cu_host._gspo_on_device = cached
    return cached


def attention_mask_forward(*args: Any, **kwargs: Any):
    """The mask builder registered beside :func:`attention_forward`: the inner implementation's (a padded batch or a
    decode step builds the mask it always did); inside :func:`packed_forward` none (the sequences are the mask)."""
    if _PACKED.get():
        return None
    return inner_mask_function(kwargs["config"])(*args, **kwargs)


def enable(model: torch.nn.Module) -> bool:
    """Route ``model``'s attention through ``packed_<inner>`` when it runs ``sdpa`` / ``eager`` over full attention
    only (sliding windows are left alone); returns whether it did. Idempotent."""
    config = model.config
    if is_enabled(model):
        return True
    inner = config._attn_implementation
    sliding = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
    if inner not in SUPPORTED or sliding or "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return False
    register(model, PREFIX, attention_forward, attention_mask_forward)
    return True


def is_enabled(model: torch.nn.Module) -> bool:
    return str(getattr(model.config, "_attn_implementation", "")).startswith(PREFIX)


# implementations outside this module that run a packed row from host boundaries given as transformers' varlen
# keywords: the NPU patches' npu_fusion_attention TND takes them as host lists (patches/npu_attention.py); without
# them it derives them from the device's position_ids, a host read in every forward
HOST_BOUNDARIES = ("npu_fusion",)


def takes_boundaries(model: torch.nn.Module) -> bool:
    """Whether ``model``'s attention runs a packed row from :func:`forward_kwargs`' boundaries."""
    return is_enabled(model) or getattr(model.config, "_attn_implementation", None) in HOST_BOUNDARIES


def takes_shared_prefix(model: torch.nn.Module) -> bool:
    """Whether ``model``'s attention runs a shared-prefix row (:func:`shared_prefix_forward`): only this module's
    hook; flash_attention_2 and the NPU's TND kernel would read the blocks as independent sequences."""
    return is_enabled(model)


def forward_kwargs(model: torch.nn.Module, lengths: list[int], prefix_of: list[int] | None = None) -> dict[str, Any]:
    """Keywords of a packed forward of sequences of ``lengths`` tokens (in row order) for a model whose attention
    takes the boundaries (:func:`enable` routed it, or it is in ``HOST_BOUNDARIES``); run the forward inside
    :func:`packed_forward` (with the model), so transformers builds no [N, N] mask. {} otherwise (the model then
    derives the block-diagonal mask from the restarting positions, as before).

    The boundaries stay on the host whatever the model's device: only the attention reads them, as a list, in every
    layer; on a device that read would wait for the device each time. ``prefix_of``: the lengths are the blocks of a
    shared-prefix row (logprobs.shared_prefix_row), for a model that :func:`takes_shared_prefix` only."""
    if prefix_of is not None and not takes_shared_prefix(model):
        raise ValueError("a shared-prefix row needs the packed attention hook (packed_attention.enable)")
    if not takes_boundaries(model):
        return {}
    cu = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    longest = max(lengths, default=0)
    out = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}
    if prefix_of is not None:
        out["shared_prefix_of"] = SharedBlocks(prefix_of)
    return out


@contextlib.contextmanager
def packed_forward(model: torch.nn.Module | None = None) -> Iterator[None]:
    """The body's model forwards are packed ones (:func:`forward_kwargs`): no attention mask is built. Given a
    ``model`` whose attention takes the boundaries, transformers also skips deriving the sequences from the
    positions (``find_packed_sequence_indices``: a host read of the device in every forward, for a mask nothing
    reads); a model without them still gets that mask, as transformers builds it."""
    token = _PACKED.set(True)
    known = _KNOWN_BOUNDARIES.set(model is not None and takes_boundaries(model))
    _skip_sequence_detection()
    try:
        yield
    finally:
        _KNOWN_BOUNDARIES.reset(known)
        _PACKED.reset(token)


_KNOWN_BOUNDARIES = contextvars.ContextVar("gspo_known_boundaries", default=False)


@functools.cache
def _skip_sequence_detection() -> None:
    """Wrap transformers' ``masking_utils.find_packed_sequence_indices`` (once) to return None (no packed sequences
    found) inside :func:`packed_forward` of a model that takes the boundaries; it ends in ``(...).all()`` on the
    device, read by the host. Its result only feeds the mask builder, which builds nothing there."""
    from transformers import masking_utils

    original = masking_utils.find_packed_sequence_indices

    @functools.wraps(original)
    def find_packed_sequence_indices(position_ids: torch.Tensor) -> torch.Tensor | None:
        return None if _KNOWN_BOUNDARIES.get() else original(position_ids)

    masking_utils.find_packed_sequence_indices = find_packed_sequence_indices
