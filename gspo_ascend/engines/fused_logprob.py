"""Log-probs straight from the LM head's input: ``log_softmax(h W^T / T)[y]`` in row chunks, never the [N, V] logits.

The plain path (:func:`gspo_ascend.engines.logprobs.token_log_probs`) takes the model's logits: the LM head writes
[N, V] in the compute dtype, each chunk is upcast to float32, and under autograd every chunk's float32 copy stays
alive for logsumexp's backward, so a training forward holds the whole [N, V] in float32 beside the compute-dtype
logits (at Qwen's V = 152k and a 16k-token micro-batch: 10 GB + 5 GB). Here one autograd function takes the
hidden states and the LM head's weight instead and, per chunk of rows, computes the chunk's logits, upcasts them,
keeps only each row's logsumexp and the picked log-prob, and drops the chunk; backward recomputes each chunk's
logits (one more LM-head matmul) and forms ``d logits = g (onehot(y) - softmax) / T`` chunk by chunk. Peak: one
[chunk, V] float32 block (three in backward) and, when there are several chunks, the weight's gradient summed in a
[V, H] float32 accumulator.

How it is reached: inside the model's own forward. :func:`log_prob_head` swaps the forward of the model's output
embedding (``lm_head``) for the duration of one call, so FSDP2's hooks on the root unit (which gather ``lm_head``'s
weight and reduce its gradient) run as they always do, and what the model returns as ``logits`` is the
[..., kept positions] log-probs. Models whose logits are more than a bias-free linear map of the last hidden states
(a bias, Gemma's final logit soft-capping, a scaled head) keep the plain path (:func:`supported`).

Numerics equal the plain path's: the chunk's logits come from the same matmul in the compute dtype, upcast, divided
by T; float64 stays float64. Gradients are cast to the compute dtype before the two matmuls, as the plain path's
autograd does at its upcast. Tested against the plain path (float32 to 1e-6, forward and gradients) in
tests/unit/test_fused_logprob.py.

How we differ from verl: verl's ``FusedLinearForPPO`` (verl/utils/experimental/torch_functional.py) is the same
idea, computed outside the model's forward from the returned hidden states (both return the entropy, from the same
chunk: ours as a metric, without gradient, as verl's default entropy_coeff 0 needs); here the head runs inside the
forward, so the FSDP2 unit owning ``lm_head`` needs no
special handling, and only the positions ``logits_to_keep`` selects reach it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

# rows per chunk: [1024, V] float32 is 0.6 GiB at V = 152k, as the plain path's chunk; backward holds three such
# blocks (logits, softmax, a temporary) and the chunk's logits in the compute dtype. The planner counts the same
# (doctor/planner.py FUSED_CHUNK_ROWS)
CHUNK_ROWS = 1024


class _LinearLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature: float, chunk: int, entropy: bool):
        # [..., H], [V, H], [...] -> ([...] log-probs, [...] entropies or an empty tensor)
        # the output is a fresh tensor of the labels' shape, not a view of a flat one: a model forward returning a
        # view draws FSDP2's in-place warning
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        out = hidden.new_empty(labels.shape, dtype=dtype)
        ent = hidden.new_empty(labels.shape if entropy else (0,), dtype=dtype)
        flat_h, flat_y, flat_out = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1), out.view(-1)
        lse = hidden.new_empty(flat_y.shape, dtype=dtype)
        for start in range(0, flat_h.shape[0], chunk):
            rows = slice(start, start + chunk)
            x = _chunk_logits(flat_h[rows], weight, temperature, dtype)
            lse[rows] = torch.logsumexp(x, dim=-1)
            flat_out[rows] = x.gather(-1, flat_y[rows, None]).squeeze(-1) - lse[rows]
            if entropy:  # from the chunk already in hand: no second pass over the head
                ent.view(-1)[rows] = softmax_entropy(x, lse[rows])
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(ent)
        return out, ent

    @staticmethod
    def backward(ctx, grad_out, _grad_entropy):  # the entropy is a metric: no gradient through it
        hidden, weight, labels, lse = ctx.saved_tensors
        t, dtype = ctx.temperature, lse.dtype
        flat_h, flat_y, flat_g = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1), grad_out.reshape(-1)
        grad_hidden = torch.empty_like(flat_h) if ctx.needs_input_grad[0] else None
        chunks = -(-flat_h.shape[0] // ctx.chunk)
        # the weight's gradient: one matmul's output for one chunk; over several, summed in fp32 (a [V, H] fp32
        # accumulator beside each chunk's [V, H] product, which the planner counts)
        grad_weight = None
        for start in range(0, flat_h.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            x = _chunk_logits(flat_h[rows], weight, t, dtype)
            g = flat_g[rows].to(dtype)
            d = torch.exp(x - lse[rows, None]).mul_(-g[:, None])  # -g softmax
            d.scatter_add_(-1, flat_y[rows, None], g[:, None])  # + g onehot(y)
            if t != 1.0:
                d.div_(t)
            d = d.to(hidden.dtype)  # the plain path's autograd casts here too (the upcast's backward)
            if grad_hidden is not None:
                grad_hidden[rows] = d @ weight
            if ctx.needs_input_grad[1]:
                product = d.t() @ flat_h[rows]
                if chunks == 1:
                    grad_weight = product
                elif grad_weight is None:
                    grad_weight = product.to(dtype)
                else:
                    grad_weight += product
        if grad_hidden is not None:
            grad_hidden = grad_hidden.view(hidden.shape)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def softmax_entropy(x: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Each row's entropy of softmax(x), given x [rows, V] and its logsumexp [rows]: H = lse - sum_v p_v x_v, through
    one [rows, V] temporary (p, computed and multiplied in place). No gradient: call it under no_grad.

    # [rows, V], [rows] -> [rows]
    """
    return lse - (x - lse[:, None]).exp_().mul_(x).sum(-1)


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float, dtype: torch.dtype):
    x = (hidden @ weight.t()).to(dtype)
    return x / temperature if temperature != 1.0 else x


def linear_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    chunk: int = CHUNK_ROWS,
    entropy: bool = False,
):
    """log_softmax(hidden @ weight.T / T)[labels] in float32 (float64 for float64 inputs), chunked by rows; with
    ``entropy`` also each row's entropy of softmax(hidden @ weight.T / T) (no gradient), as a pair.

    # [..., H], [V, H], [...] -> [...] (or ([...], [...]))
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"labels {tuple(labels.shape)} for hidden states {tuple(hidden.shape)}")
    out, ent = _LinearLogProb.apply(hidden, weight, labels, float(temperature), chunk, entropy)
    return (out, ent) if entropy else out


# families whose forward returns the LM head's output as ``logits`` unchanged (transformers' modeling files read):
# others scale or cap it after the head (Granite's logits_scaling, Gemma's soft-capping, Falcon-H1's multiplier), which
# would then apply to log-probs. The planner's families, so every shipped config takes the fused path.
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe")


def supported(model: torch.nn.Module) -> bool:
    """Whether the model's logits are exactly ``lm_head(last hidden states)``: a family known to return the head's
    output unchanged, with a bias-free linear head."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    known = getattr(getattr(model, "config", None), "model_type", None) in MODEL_TYPES
    return known and type(head) is torch.nn.Linear and head.bias is None


@contextlib.contextmanager
def log_prob_head(
    model: torch.nn.Module, labels: torch.Tensor, temperature: float, entropies: list[torch.Tensor] | None = None
) -> Iterator[list[torch.Tensor]]:
    """Inside the body, the model's ``logits`` are the log-probs of ``labels`` (shaped like the kept positions:
    ``labels`` must have the shape of the LM head's input without its hidden dimension). One forward only. Yields
    the list the head's outputs are appended to: the caller checks the model returned one of them unchanged. Given
    ``entropies``, each output's entropies (same shape, no gradient) are appended to it."""
    head = model.get_output_embeddings()
    produced: list[torch.Tensor] = []

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        if entropies is None:
            produced.append(linear_log_probs(hidden, head.weight, labels, temperature))
        else:
            lp, ent = linear_log_probs(hidden, head.weight, labels, temperature, entropy=True)
            produced.append(lp)
            entropies.append(ent)
        return produced[-1]

    head.forward = forward  # an instance attribute: nn.Module.__call__ finds it before the class's
    try:
        yield produced
    finally:
        del head.forward
