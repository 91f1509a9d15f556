"""Per-token log-probs of sampled responses under a Hugging Face causal LM, packed or padded.

``log p_t = log_softmax(logits_t / T)[y_t]`` (the contract of engines/base.py), computed as
``logits_t[y_t] / T - logsumexp(logits_t / T)`` in float32 over chunks of rows, so no [N, V] log-softmax
matrix is ever materialised beside the logits, and logits themselves are only produced at the positions
that predict a response token (``logits_to_keep`` with an index tensor): prompt positions never reach the
LM head.

Two layouts with the same result:
- packed (``actor.use_remove_padding``): every prompt+response is concatenated into one row; position_ids
  restart at 0 for each sequence. transformers 5.19 turns restarting position_ids into a block-diagonal
  causal mask (masking_utils.find_packed_sequence_indices) for sdpa and eager, but only when no 2-D
  attention mask and no KV cache are passed, so we pass neither (``use_cache=False``: otherwise the model
  creates a DynamicCache and silently attends across sequences). flash_attention_2 derives cu_seqlens from
  the same position_ids. A model routed through engines/packed_attention.py (the fsdp engine's, on sdpa / eager)
  gets the sequence boundaries instead and attends per sequence: no quadratic [N, N] row. The equivalence is
  proved in tests/unit/test_fsdp_engine.py and tests/unit/test_packed_attention.py.
- padded: a right-padded [B, T] batch with an attention mask.

How we differ from verl: verl's remove-padding path unpads with flash-attn's ``unpad_input`` helpers and
needs flash-attn (or NPU's) varlen kernels; ours runs on any attention implementation transformers ships,
and skips the LM head on prompt tokens in both layouts. Log-probs at response padding are exactly 0.
"""

from __future__ import annotations

import contextlib
import itertools

import torch

from gspo_ascend.device import upload
from gspo_ascend.engines import fused_logprob, packed_attention
from gspo_ascend.engines.base import SampleBatch
from gspo_ascend.engines.microbatch import samples_by_prompt

# rows upcast per step: [1024, V] float32 is ~0.6 GiB at Qwen's V = 152k (without grad only one chunk lives at a
# time; with grad autograd keeps what logsumexp's backward needs, as a fused log_softmax would)
LOGSUMEXP_CHUNK = 1024


def token_log_probs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, entropy: bool = False):
    """log_softmax(logits / T) at ``labels``, in float32 (float64 stays float64, for exactness tests); with
    ``entropy`` also the entropy of softmax(logits / T) at each position (no gradient), as a pair.

    # [..., V], [...] -> [...] (or ([...], [...]))
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    flat = logits.reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1)
    dtype = torch.promote_types(logits.dtype, torch.float32)
    out, ent = [], []
    for start in range(0, flat.shape[0], LOGSUMEXP_CHUNK):
        x = flat[start : start + LOGSUMEXP_CHUNK].to(dtype)  # upcast one chunk at a time (bf16 logits)
        if temperature != 1.0:
            x = x / temperature
        picked = x.gather(-1, flat_labels[start : start + LOGSUMEXP_CHUNK, None]).squeeze(-1)
        lse = torch.logsumexp(x, dim=-1)
        out.append(picked - lse)  # log_softmax(x)[y] without the [N, V] matrix
        if entropy:
            with torch.no_grad():
                ent.append(fused_logprob.softmax_entropy(x, lse))
    if not out:
        zeros = flat.new_zeros(labels.shape, dtype=dtype)
        return (zeros, zeros.clone()) if entropy else zeros
    lp = torch.cat(out).reshape(labels.shape)
    return (lp, torch.cat(ent).reshape(labels.shape)) if entropy else lp


def response_lengths(batch: SampleBatch) -> list[int]:
    """L_i per sample; refuses masks that are not a prefix (responses must be right-padded)."""
    mask = batch.response_mask.bool().cpu()
    lengths = mask.sum(-1)
    prefix = torch.arange(mask.shape[1])[None, :] < lengths[:, None]
    if not torch.equal(mask, prefix):
        raise ValueError("response_mask must be 1 on a prefix of each row (right-padded responses)")
    if any(len(p) == 0 for p in batch.prompt_ids):
        raise ValueError("every sample needs a non-empty prompt: the first response token is predicted from it")
    return lengths.tolist()


def response_tokens(batch: SampleBatch) -> list[list[int]]:
    """Each sample's response token ids without padding (checked right-padded by :func:`response_lengths`)."""
    return [row[:n] for row, n in zip(batch.response_ids.tolist(), response_lengths(batch), strict=True)]


def _model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _scatter(picked, rows: list[int], cols: list[int], shape: tuple[int, int]):
    """[B, R] float32 with ``picked`` at (rows, cols) and 0 elsewhere; differentiable w.r.t. ``picked``. A tuple
    (log-probs, entropies) is scattered member by member, through one upload of the index."""
    values = picked if isinstance(picked, tuple) else (picked,)
    if not rows:  # keep the graph connected (the dummy position's value times 0): every rank must backward
        outs = tuple(v.new_zeros(shape) + 0.0 * v.sum() for v in values)
    else:
        index = uploaded(values[0].device, torch.tensor(rows), torch.tensor(cols))
        outs = tuple(v.new_zeros(shape).index_put(index, v) for v in values)
    return outs if isinstance(picked, tuple) else outs[0]


def uploaded(device: torch.device, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Host-built index and input tensors on the model's device through the device layer's ``upload`` (staged, not
    waited for): built with ``device=`` from Python lists, each would be a copy the host waits on, ~10 per
    micro-batch (issue #43)."""
    return tuple(upload(t, device) for t in tensors)


class _Targets:
    """Where each response token's log-prob comes from (``keep``: a logits index) and goes to (rows, cols)."""

    def __init__(self) -> None:
        self.keep: list[int] = []
        self.labels: list[int] = []
        self.rows: list[int] = []
        self.cols: list[int] = []

    def add(self, row: int, first_keep: int, resp: list[int]) -> None:
        # the logits at position first_keep + t predict response token t
        self.add_at(row, range(first_keep, first_keep + len(resp)), resp)

    def add_at(self, row: int, positions, resp: list[int]) -> None:
        """The logits at ``positions[t]`` predict response token t."""
        self.keep += positions
        self.labels += resp
        self.rows += [row] * len(resp)
        self.cols += range(len(resp))


def packed_row(prompts, responses) -> tuple[list[int], list[int], _Targets]:
    """Token ids and position ids of one row holding every prompt + response, positions restarting at 0 per
    sequence, and where each response token's log-prob comes from (also the Ulysses path's row, engines/ulysses.py)."""
    ids: list[int] = []
    pos: list[int] = []
    targets = _Targets()
    for i, (prompt, resp) in enumerate(zip(prompts, responses, strict=True)):
        targets.add(i, len(ids) + len(prompt) - 1, resp)
        ids += list(prompt) + resp
        pos += range(len(prompt) + len(resp))
    return ids, pos, targets


class SharedRow:
    """A packed row in which samples with the same prompt share one copy of it: the prompt once, then each such
    sample's response as a block of its own, its positions going on from the prompt's (``actor.shared_prefix``).

    ``blocks`` are the row's block lengths in order; ``prefix_of[b]`` is the index of the prompt block block b
    attends to before itself (-1: none, a block that is a whole sequence or a shared prompt). A response's first
    token is predicted from its prompt's last position, which its group shares; its other tokens from its block."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.pos: list[int] = []
        self.blocks: list[int] = []
        self.prefix_of: list[int] = []
        self.targets = _Targets()

    def block(self, ids, start_pos: int, prefix: int = -1) -> int:
        """Append ``ids`` as a block at positions ``start_pos...``; returns its first index in the row."""
        first = len(self.ids)
        self.ids += ids
        self.pos += range(start_pos, start_pos + len(ids))
        self.blocks.append(len(ids))
        self.prefix_of.append(prefix)
        return first


def shared_prefix_row(prompts, responses) -> SharedRow:
    """The row of :class:`SharedRow` for one micro-batch: samples grouped by prompt (by content, in the order of
    each prompt's first sample); a prompt only one sample has stays one block with its response, as in
    :func:`packed_row`. A response of no tokens adds nothing (no target reads it)."""
    row = SharedRow()
    for prompt, members in samples_by_prompt(prompts).items():
        if len(members) == 1:
            (i,) = members
            first = row.block(list(prompt) + responses[i], 0)
            row.targets.add(i, first + len(prompt) - 1, responses[i])
            continue
        row.block(list(prompt), 0)
        shared, last = len(row.blocks) - 1, len(row.ids) - 1
        for i in members:
            resp = responses[i]
            if resp:
                first = row.block(resp, len(prompt), prefix=shared)
                row.targets.add_at(i, [last, *range(first, first + len(resp) - 1)], resp)
    return row


class _Kept:
    """One forward's inputs, the label at each position the LM head runs on (shaped like those positions), and
    how the [n_targets] outputs are picked from the head's output (in the order of ``targets.labels``)."""

    def __init__(self, inputs: dict, labels: torch.Tensor, pick, targets: _Targets) -> None:
        self.inputs, self.labels, self.pick, self.targets = inputs, labels, pick, targets


def _packed_inputs(model, prompts, responses, device, shared_prefix: bool = False) -> _Kept:
    """One row holding every sequence; position_ids restart per sequence -> block-diagonal causal mask. With
    ``shared_prefix`` (a model whose attention takes the blocks: packed_attention.takes_shared_prefix), samples of
    one prompt share it (:func:`shared_prefix_row`)."""
    prefix_of = None
    if shared_prefix and packed_attention.takes_shared_prefix(model):
        row = shared_prefix_row(prompts, responses)
        ids, pos, targets, lengths, prefix_of = row.ids, row.pos, row.targets, row.blocks, row.prefix_of
    else:
        ids, pos, targets = packed_row(prompts, responses)
        lengths = [len(p) + n for p, n in zip(prompts, map(len, responses), strict=True)]
    input_ids, position_ids, keep, labels = uploaded(
        device,
        torch.tensor([ids]),
        torch.tensor([pos]),
        torch.tensor(targets.keep or [0]),
        torch.tensor([targets.labels or [0]]),  # [1, kept]
    )
    inputs = {
        "input_ids": input_ids,
        "position_ids": position_ids,
        "use_cache": False,  # a cache (or a 2-D mask) would switch off transformers' packed-sequence mask
        "logits_to_keep": keep,
        **packed_attention.forward_kwargs(model, lengths, prefix_of),  # the boundaries, on the host (read as lists)
    }
    return _Kept(inputs, labels, lambda out: out[0], targets)


def _padded_inputs(model, prompts, responses, device, pad_id: int) -> _Kept:
    """Right-padded [B, T] with an attention mask; the LM head runs on the union window of response
    positions [min prompt length - 1, max sequence length - 1)."""
    seqs = [list(p) + r for p, r in zip(prompts, responses, strict=True)]
    b, width = len(seqs), max(len(s) for s in seqs)
    lo = min(len(p) for p in prompts) - 1
    hi = max(max(len(s) for s in seqs) - 1, lo + 1)
    input_ids = torch.full((b, width), pad_id, dtype=torch.long)
    attention = torch.zeros((b, width), dtype=torch.long)
    targets = _Targets()
    for i, (seq, prompt, resp) in enumerate(zip(seqs, prompts, responses, strict=True)):
        input_ids[i, : len(seq)] = torch.tensor(seq)
        attention[i, : len(seq)] = 1
        targets.add(i, len(prompt) - 1 - lo, resp)  # index inside the kept window
    labels = torch.zeros((b, hi - lo), dtype=torch.long)  # window positions that predict nothing: label 0, unread
    labels[targets.rows, targets.keep] = torch.tensor(targets.labels, dtype=torch.long)
    rows, keep = torch.tensor(targets.rows or [0]), torch.tensor(targets.keep or [0])
    input_ids, attention, labels, rows, keep = uploaded(device, input_ids, attention, labels, rows, keep)
    inputs = {
        "input_ids": input_ids,
        "attention_mask": attention,
        "position_ids": torch.arange(width, device=device).expand(b, width),
        "use_cache": False,
        "logits_to_keep": torch.arange(lo, hi, device=device),
    }
    if not targets.rows:
        return _Kept(inputs, labels, lambda out: out[0, :1], targets)
    return _Kept(inputs, labels, lambda out: out[rows, keep], targets)


def token_layout(batch: SampleBatch, packed: bool) -> tuple[list[int], list[int], int]:
    """Where each sample's tokens (prompt + response) sit in the flattened input of :func:`forward_log_probs`:
    (starts, lengths, total tokens). Packed: one after another in one row; padded: row i of a [B, T] input."""
    lengths = [len(p) + n for p, n in zip(batch.prompt_ids, response_lengths(batch), strict=True)]
    if packed:
        return [0, *itertools.accumulate(lengths[:-1])], lengths, sum(lengths)
    width = max(lengths)
    return [i * width for i in range(len(lengths))], lengths, width * len(lengths)


def forward_log_probs(
    model: torch.nn.Module,
    batch: SampleBatch,
    temperature: float,
    packed: bool,
    pad_id: int = 0,
    entropy: bool = False,
    shared_prefix: bool = False,
):
    """[B, R] float32 (float64 for a float64 model) log-probs of ``batch.response_ids`` (0 at padding), on
    the model's device; with ``entropy`` also the [B, R] entropies of the same softmax (0 at padding, no gradient),
    as a pair. ``shared_prefix`` (packed only): samples of one prompt share its forward (:func:`shared_prefix_row`)
    where the model's attention takes it; the same log-probs, fewer tokens.

    Where the model's head allows (engines/fused_logprob.py), the LM head itself returns the log-probs, chunked,
    never the [N, V] logits; otherwise the logits at the kept positions go through :func:`token_log_probs`.
    Always runs exactly one forward, even when no sample has a response token (then the result is 0 but
    still connected to the graph), because under FSDP every rank must take part in every forward/backward.
    """
    responses = response_tokens(batch)
    device = _model_device(model)
    if packed:
        kept = _packed_inputs(model, batch.prompt_ids, responses, device, shared_prefix)
    else:
        kept = _padded_inputs(model, batch.prompt_ids, responses, device, pad_id)
    with packed_attention.packed_forward(model) if packed else contextlib.nullcontext():
        picked = head_log_probs(model, kept.inputs, kept.labels, temperature, kept.pick, entropy)
    return _scatter(picked, kept.targets.rows, kept.targets.cols, tuple(batch.response_ids.shape))


def head_log_probs(model, inputs: dict, labels: torch.Tensor, temperature: float, pick, entropy: bool = False):
    """One forward of ``model(**inputs)`` -> the log-probs of ``labels`` (shaped like the positions the LM head runs
    on), picked by ``pick``, and with ``entropy`` their entropies (a pair): from the LM head's input where the head
    allows (engines/fused_logprob.py), else from the logits (also the Ulysses path's, engines/ulysses.py)."""
    if fused_logprob.supported(model):
        entropies: list[torch.Tensor] | None = [] if entropy else None
        with fused_logprob.log_prob_head(model, labels, temperature, entropies) as produced:
            logits = model(**inputs).logits
        head = next((i for i, out in enumerate(produced) if out is logits), None)
        if head is None:  # a family that transforms its head's output after all
            raise RuntimeError(
                f"{type(model).__name__} changed its LM head's output before returning it: remove "
                f"'{model.config.model_type}' from engines/fused_logprob.py MODEL_TYPES"
            )
        return pick(logits) if entropies is None else (pick(logits), pick(entropies[head]))
    return token_log_probs(pick(model(**inputs).logits), pick(labels), temperature, entropy)
