"""Loss aggregation: how a matrix of per-token losses (or a vector of per-sequence losses) becomes a scalar.

Every mode is a function of two per-sequence quantities, the token-sum sigma_i = sum_t M_it l_it and the
response length L_i = sum_t M_it, plus one denominator:

    token-mean               loss = sum_i sigma_i / N_tok             N_tok = number of response tokens
    seq-mean-token-mean      loss = sum_i (sigma_i / L_i) / N_seq     N_seq = number of non-empty sequences
    seq-mean-token-sum       loss = sum_i sigma_i / N_seq
    seq-mean-token-sum-norm  loss = sum_i sigma_i / (N_seq * T_norm)  T_norm = mask.shape[-1] unless given

Choices (and why):
- Sequences whose mask row is all zero (padding rows, empty responses) contribute nothing and are not
  counted in N_seq, so padding a micro-batch with dummy rows never dilutes the loss.
- ``global_tokens`` / ``global_seqs`` replace the local N_tok / N_seq. Pass the counts of the whole optimizer
  minibatch (all micro-batches on all data-parallel ranks); then the per-micro-batch losses add up exactly to
  the minibatch loss, and so do their gradients. token-mean uses ``global_tokens``; the three seq-mean modes
  use ``global_seqs``. L_i stays local: a sequence is never split across micro-batches. If either global count
  is given, the one the mode needs must be given too (a half-global normalisation is a bug, so we refuse it).
  Data-parallel engines that average gradients over ranks (DDP/FSDP) must multiply the loss by the DP size
  themselves; this module knows nothing about ranks.
- seq-mean-token-sum-norm follows verl's newer definition ([B] in shared/reference/verl_gspo_npu.md):
  seq-mean-token-sum divided by a constant, by default the padded length T = mask.shape[-1] (Dr. GRPO's
  "max generation length"). Older verl ([A]) divided the plain token sum by T without the 1/N_seq. For exact
  micro-batch equivalence every micro-batch must use the same T: pass ``norm_length`` (the configured max
  response length) when micro-batches are padded to different lengths.
- Zero denominators (a micro-batch without a single response token) give loss 0, never NaN.
- Masked positions are removed with ``torch.where``, not multiplication, so inf/NaN written into padding
  cannot leak into the loss or its gradient (0 * inf = NaN, where(False, inf, 0) = 0).

Differences from verl: verl 0.6.1-0.9.0's GSPO ignores ``loss_agg_mode`` for the policy-gradient term and always
uses seq-mean-token-mean (0.9.1 honours it, default token-mean); we honour the requested mode for every loss.
verl's agg_loss multiplies by the DP size; we leave that to the engine.
"""

from __future__ import annotations

import torch

AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)

Count = int | float | torch.Tensor | None


def check_agg_mode(agg_mode: str) -> None:
    """Raise ValueError naming the valid modes when ``agg_mode`` is not one of them."""
    if agg_mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {agg_mode!r}; valid modes: {', '.join(AGG_MODES)}")


def count_tokens_and_seqs(response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Local (response tokens, non-empty sequences) of a micro-batch, as 0-d int64 tensors.

    Sum these over the micro-batches of a minibatch and all-reduce them over data-parallel ranks to get the
    ``global_tokens`` / ``global_seqs`` arguments.
    """
    mask = response_mask.bool()  # [B, T]
    lengths = mask.sum(-1)  # [B]
    return lengths.sum(), (lengths > 0).sum()


def _denominator(local: torch.Tensor, global_count: Count, like: torch.Tensor) -> torch.Tensor | float:
    """The normaliser: the global count when given, else the local one; at least 1 so 0/0 becomes 0. A global count
    given as a number stays a number: made a tensor on the device, it would be a copy the host waits on in every
    micro-batch (issue #43)."""
    if global_count is None:
        return local.to(like.dtype).clamp_min(1)
    if isinstance(global_count, torch.Tensor):
        return global_count.to(device=like.device, dtype=like.dtype).clamp_min(1)
    return max(float(global_count), 1.0)


def _required_global(agg_mode: str, global_tokens: Count, global_seqs: Count) -> None:
    if global_tokens is None and global_seqs is None:
        return
    needs_tokens = agg_mode == "token-mean"
    missing = global_tokens is None if needs_tokens else global_seqs is None
    if missing:
        need = "global_tokens" if needs_tokens else "global_seqs"
        raise ValueError(
            f"loss_agg_mode {agg_mode!r} normalises by {need}, but only the other global count was given; "
            "pass both (from count_tokens_and_seqs summed over the minibatch) or neither"
        )


def aggregate_rows(
    row_sums: torch.Tensor,  # [B] sigma_i = sum_t M_it l_it
    row_means: torch.Tensor,  # [B] sigma_i / L_i, 0 for empty rows
    lengths: torch.Tensor,  # [B] L_i (int or float)
    agg_mode: str,
    *,
    global_tokens: Count = None,
    global_seqs: Count = None,
    norm_length: int | float,
) -> torch.Tensor:
    """Reduce per-sequence token-sums / token-means to the scalar loss (see the module docstring)."""
    check_agg_mode(agg_mode)
    _required_global(agg_mode, global_tokens, global_seqs)
    lengths = lengths.to(row_sums.dtype)
    if agg_mode == "token-mean":
        # loss = sum_i sigma_i / N_tok
        return row_sums.sum() / _denominator(lengths.sum(), global_tokens, row_sums)
    n_seq = _denominator((lengths > 0).sum(), global_seqs, row_sums)
    if agg_mode == "seq-mean-token-mean":
        # loss = (1/N_seq) sum_i (1/L_i) sum_t l_it      (the paper's (1/G) sum_i (1/|y_i|) sum_t)
        return row_means.sum() / n_seq
    if agg_mode == "seq-mean-token-sum":
        # loss = (1/N_seq) sum_i sum_t l_it
        return row_sums.sum() / n_seq
    # seq-mean-token-sum-norm: loss = (1/(N_seq * T_norm)) sum_i sum_t l_it
    return row_sums.sum() / (n_seq * float(norm_length))


def agg_loss(
    token_loss: torch.Tensor,  # [B, T] l_it
    response_mask: torch.Tensor,  # [B, T] nonzero = response token
    agg_mode: str,
    *,
    global_tokens: Count = None,
    global_seqs: Count = None,
    norm_length: int | float | None = None,
) -> torch.Tensor:
    """Aggregate a per-token loss matrix to a scalar with ``agg_mode`` (see the module docstring)."""
    mask = response_mask.bool()
    lengths = mask.sum(-1)  # [B] L_i
    row_sums = torch.where(mask, token_loss, 0.0).sum(-1)  # [B] sigma_i
    row_means = row_sums / lengths.clamp_min(1).to(row_sums.dtype)  # [B]; empty rows: 0 / 1 = 0
    return aggregate_rows(
        row_sums,
        row_means,
        lengths,
        agg_mode,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        norm_length=mask.shape[-1] if norm_length is None else norm_length,
    )


def agg_seq_loss(
    seq_loss: torch.Tensor,  # [B] l_i, one loss per sequence
    lengths: torch.Tensor,  # [B] L_i
    agg_mode: str,
    *,
    norm_length: int | float,
    global_tokens: Count = None,
    global_seqs: Count = None,
) -> torch.Tensor:
    """Aggregate a per-sequence loss exactly as ``agg_loss`` would aggregate it broadcast to its tokens.

    Broadcasting l_i to the L_i response tokens of sequence i gives sigma_i = L_i * l_i and token-mean
    sigma_i / L_i = l_i; we use these closed forms instead of materialising a [B, T] matrix (less memory, and
    seq-mean-token-mean is then exactly mean_i l_i without a multiply-divide round trip).
    Empty sequences (L_i = 0) contribute 0 whatever l_i is.
    """
    row_means = torch.where(lengths > 0, seq_loss, 0.0)  # [B] l_i
    row_sums = row_means * lengths.to(seq_loss.dtype)  # [B] L_i l_i
    return aggregate_rows(
        row_sums,
        row_means,
        lengths,
        agg_mode,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        norm_length=norm_length,
    )
