"""Policy losses: GSPO, GSPO-token and GRPO as one clipped surrogate with three importance ratios.

Notation: y_i is response i of a minibatch, |y_i| = L_i its number of response tokens, pi_theta the policy
being trained (``log_prob``), pi_old the policy that produced the rollout (``old_log_prob``), A_i the
group-relative advantage, eps_l / eps_h = ``clip_low`` / ``clip_high``, sg[.] stop-gradient.

    GRPO        r_it = pi_theta(y_it) / pi_old(y_it)                                   (token ratio)
    GSPO        s_i  = (pi_theta(y_i) / pi_old(y_i))^(1/|y_i|)
                     = exp( (1/|y_i|) sum_t log(pi_theta(y_it) / pi_old(y_it)) )       (sequence ratio)
    GSPO-token  s_it = sg[s_i] * pi_theta(y_it) / sg[pi_theta(y_it)]                  (GSPO-token ratio)

and the shared clipped surrogate (PPO) per sequence or token, loss = - objective:

    J = min( ratio * A, clip(ratio, 1 - eps_l, 1 + eps_h) * A )
    dual clip (optional, A < 0 only):  J = max(J, c * A)       with c = ``clip_ratio_c`` > 1

The paper's GSPO objective (eq. 5) is (1/G) sum_i min(s_i A_i, clip(s_i) A_i): one loss per sequence,
averaged over sequences. Here a sequence loss is aggregated as if it were broadcast to its L_i tokens (how
verl and TRL do it), so ``agg_mode="seq-mean-token-mean"`` (the default) is exactly the paper's (1/G) sum_i;
"token-mean" weighs sequence i by L_i / N_tok (ChatLearn's behaviour); "seq-mean-token-sum" by L_i / G;
"seq-mean-token-sum-norm" by L_i / (G T). See aggregation.py for the formulas and the global counts.

Choices:
- Log-ratio clamp: the quantity that goes into exp is clamped symmetrically to [-20, 20] (the mean
  log-ratio for GSPO / GSPO-token, the token log-ratio for GRPO). e^20 ~ 4.9e8 is astronomically outside
  any trust region, so the clamp only acts on samples that are clipped or garbage anyway; it keeps exp
  finite in every dtype (verl clamps GRPO the same way, but GSPO only from above, at 10). Beyond the clamp
  the ratio is constant, so such a sample gets zero gradient.
- Masked positions never leak: log-ratios and advantages are selected with torch.where before any
  arithmetic, so even inf/NaN written into padding cannot reach the loss or the gradient; an all-zero
  mask row gives ratio 1, loss 0 and is not counted as a sequence.
- Log-probs in half precision are promoted to float32 (a mean over 8k bf16 values is too coarse for a
  clip range of 3e-4); float64 stays float64 (the gradient tests use it).
- The clipped branch is selected with torch.where, so a clipped sequence/token has exactly zero gradient
  (no 1/2 tie-splitting of torch.maximum at the boundary).
- clip_ratio_c (dual clip) is honoured by all three losses when given (verl ignores it for GSPO although
  its GSPO scripts set it); None = off, the paper's setting.
- Unknown keyword arguments raise TypeError instead of being ignored.

Metrics are detached 0-d tensors on the input device (so an engine can all-reduce them without a host
sync); they are local to the micro-batch, with ``num_tokens`` / ``num_seqs`` to weight them when averaging
over micro-batches and ranks (reduce seq_ratio_min / _max with MIN / MAX):
  pg_loss                    the loss value
  clipfrac_token / _seq      share of response tokens / of non-empty sequences (token-mean within each
                             sequence) where the clipped branch is active; for GSPO, clipfrac_seq is the
                             fraction of clipped sequences, the number to compare with the paper
  clipfrac_{high,low}_{token,seq}   the same split by side: high = ratio > 1+eps_h with A > 0,
                             low = ratio < 1-eps_l with A < 0 (clipfrac = high + low)
  dual_clipfrac_token        share of tokens where the dual clip caps the loss (0 when off)
  seq_ratio_{mean,min,max}   s_i over non-empty sequences (for GRPO too: exp of the mean token log-ratio)
  kl_k3_token                token-mean of k3 = r - 1 - log r, r = pi_theta / pi_old: estimates
                             KL(pi_old || pi_theta) per token from pi_old's samples (unbiased, >= 0)
  kl_k3_seq                  mean over sequences of s_i - 1 - log s_i: k3 on GSPO's length-normalised
                             sequence ratio (~ (mean log-ratio)^2 / 2), i.e. how far what GSPO clips is from 1
  ppo_kl_k1_token            token-mean of log pi_old - log pi_theta (verl's actor/ppo_kl, for comparison)
  num_tokens, num_seqs       local response tokens and non-empty sequences

Differences from the paper: the paper's objectives are the seq-mean-token-mean case without KL, clamp or
dual clip; the other aggregation modes, the dual clip and the global counts are options (defaults = paper),
the clamp is a numerical guard, and empty responses (which the paper never has) are dropped from G.

Differences from verl (compute_policy_loss_gspo): verl 0.6.1-0.9.0 aggregate GSPO with seq-mean-token-mean
whatever ``loss_agg_mode`` says; verl 0.9.1 honours the mode as we do (its actor default is token-mean, so the
paper's aggregation must be asked for there). verl logs only token-level clip fraction and KL; we log
sequence-level metrics. verl implements "gspo" in the GSPO-token form; we implement eq. 5 directly and keep
GSPO-token as its own loss (same value and gradient when A_it = A_i; tested). ChatLearn aggregates GSPO by
token-mean over the global batch (long responses weigh more); here that is agg_mode="token-mean", opt-in.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gspo_ascend.algorithms.aggregation import Count, agg_loss, agg_seq_loss, check_agg_mode
from gspo_ascend.algorithms.kl import kl_k3

LOG_RATIO_CLAMP = 20.0

PolicyLoss = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]


# ----------------------------------------------------------------------------------------------- helpers
def _check_inputs(log_prob, old_log_prob, advantages, response_mask, clip_low, clip_high, clip_ratio_c, kw):
    if kw:
        raise TypeError(f"unexpected policy-loss keyword(s): {', '.join(sorted(kw))}")
    if log_prob.dim() != 2 or old_log_prob.shape != log_prob.shape or response_mask.shape != log_prob.shape:
        raise ValueError(
            "log_prob, old_log_prob and response_mask must all be [B, T]; got "
            f"{tuple(log_prob.shape)}, {tuple(old_log_prob.shape)}, {tuple(response_mask.shape)}"
        )
    if advantages.shape not in (log_prob.shape[:1], log_prob.shape):
        raise ValueError(
            f"advantages must be [B] or [B, T] for log_prob {tuple(log_prob.shape)}, got {tuple(advantages.shape)}"
        )
    if not (0.0 <= clip_low < 1.0) or clip_high < 0.0:
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}")
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"dual-clip clip_ratio_c must be > 1 (or None to disable), got {clip_ratio_c}")


def _token_log_ratio(log_prob, old_log_prob, response_mask):
    """(mask [B, T] bool, L [B] int, delta [B, T]) with delta_it = log pi_theta - log pi_old on response
    tokens and exactly 0 elsewhere (torch.where, so padding garbage cannot leak)."""
    mask = response_mask.bool()
    dtype = torch.promote_types(log_prob.dtype, torch.float32)
    diff = log_prob.to(dtype) - old_log_prob.to(dtype)
    delta = torch.where(mask, diff, 0.0)
    return mask, mask.sum(-1), delta


def _seq_log_ratio(delta, lengths):
    """log s_i = clamp( (1/|y_i|) sum_t delta_it, -20, 20 ); 0 for empty rows.   # [B, T], [B] -> [B]"""
    mean = delta.sum(-1) / lengths.clamp_min(1).to(delta.dtype)
    return mean.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _token_advantages(advantages, mask, dtype):
    """A_it as [B, 1] (broadcast) or [B, T], 0 off the response (a NaN there would poison the backward)."""
    adv = advantages.to(dtype)
    if adv.dim() == 1:
        return torch.where(mask.any(-1), adv, 0.0).unsqueeze(-1)
    return torch.where(mask, adv, 0.0)


def _seq_advantages(advantages, mask, lengths, dtype):
    """A_i as [B]. Token-level advantages are reduced by their masked mean, which is A_i for the GRPO
    advantages broadcast over tokens (the only case the paper defines); use gspo_token for advantages that
    really vary within a sequence."""
    if advantages.dim() == 1:
        adv = advantages.to(dtype)
        return torch.where(lengths > 0, adv, 0.0)
    adv = _token_advantages(advantages, mask, dtype)
    return adv.sum(-1) / lengths.clamp_min(1).to(dtype)


def clipped_surrogate(ratio, adv, clip_low, clip_high, clip_ratio_c=None):
    """Per-element PPO loss l = -min(ratio*A, clip(ratio, 1-eps_l, 1+eps_h)*A) (+ dual clip for A < 0).

    ``ratio`` and ``adv`` broadcast ([B] with [B] for GSPO, [B, T] with [B, 1] or [B, T] for token ratios).
    Returns (loss, clipped_high, clipped_low, dual_clipped); the three masks are bool, for metrics.
    """
    unclipped = -adv * ratio  # -r A
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # -clip(r, 1-eps_l, 1+eps_h) A
    # max(-rA, -clip(r)A) = -min(rA, clip(r)A); the clipped branch is active where it is strictly larger,
    # i.e. r > 1+eps_h with A > 0 (high) or r < 1-eps_l with A < 0 (low)
    is_clipped = clipped > unclipped
    loss = torch.where(is_clipped, clipped, unclipped)
    dual = torch.zeros_like(is_clipped)
    if clip_ratio_c is not None:
        # dual-clip PPO (Ye et al. 2020): for A < 0, J = max(J, c A)  <=>  loss = min(loss, -c A)
        cap = -adv * clip_ratio_c
        dual = (adv < 0) & (loss > cap)
        loss = torch.where(dual, cap, loss)
    return loss, is_clipped & (adv > 0), is_clipped & (adv < 0), dual


def _row_hits(indicator, mask, lengths):
    """Per-sequence count of response tokens where ``indicator`` holds.   # [B] or [B, T] bool -> [B]"""
    if indicator.dim() == 1:  # a sequence-level decision covers all L_i tokens
        return indicator * lengths
    return (indicator.expand(mask.shape) & mask).sum(-1)


@torch.no_grad()
def _metrics(loss, mask, lengths, log_s, delta, high, low, dual) -> dict[str, torch.Tensor]:
    """Detached 0-d metric tensors (module docstring). high/low/dual are [B] or [B, T] bool masks."""
    dtype = delta.dtype
    nonempty = lengths > 0
    n_tok = lengths.sum().clamp_min(1).to(dtype)
    n_seq = nonempty.sum().clamp_min(1).to(dtype)
    safe_len = lengths.clamp_min(1).to(dtype)
    out = {"pg_loss": loss.detach()}
    for side, ind in (("high", high), ("low", low)):
        hits = _row_hits(ind, mask, lengths).to(dtype)  # [B]
        out[f"clipfrac_{side}_token"] = hits.sum() / n_tok  # token-mean of the indicator
        out[f"clipfrac_{side}_seq"] = (hits / safe_len).sum() / n_seq  # seq-mean-token-mean
    out["clipfrac_token"] = out["clipfrac_high_token"] + out["clipfrac_low_token"]
    out["clipfrac_seq"] = out["clipfrac_high_seq"] + out["clipfrac_low_seq"]
    out["dual_clipfrac_token"] = _row_hits(dual, mask, lengths).sum().to(dtype) / n_tok
    s = log_s.exp()  # [B]; empty rows are excluded below by selecting +-inf / 0 outside the min/max/mean
    any_seq = nonempty.any()
    one = s.new_ones(())
    out["seq_ratio_mean"] = torch.where(nonempty, s, 0.0).sum() / n_seq + (~any_seq) * one
    out["seq_ratio_min"] = torch.where(any_seq, torch.where(nonempty, s, torch.inf).amin(), one)
    out["seq_ratio_max"] = torch.where(any_seq, torch.where(nonempty, s, -torch.inf).amax(), one)
    # KL(pi_old || pi_theta) from pi_old's samples: k3 = r - 1 - log r (kl_k3 with pi_old in the first slot);
    # delta is 0 off the response, where k3(0) = 0, so plain sums are masked sums
    token_delta = delta.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    out["kl_k3_token"] = kl_k3(torch.zeros_like(token_delta), token_delta).sum() / n_tok
    out["kl_k3_seq"] = kl_k3(torch.zeros_like(log_s), log_s).sum() / n_seq  # log s_i = 0 for empty rows
    out["ppo_kl_k1_token"] = -delta.sum() / n_tok
    out["num_tokens"] = lengths.sum()
    out["num_seqs"] = nonempty.sum()
    return out


# ----------------------------------------------------------------------------------------------- losses
def gspo_loss(
    log_prob: torch.Tensor,  # [B, T] log pi_theta(y_it), requires grad
    old_log_prob: torch.Tensor,  # [B, T] log pi_old(y_it)
    advantages: torch.Tensor,  # [B] A_i (or [B, T], reduced to its masked mean per sequence)
    response_mask: torch.Tensor,  # [B, T] nonzero on response tokens
    *,
    clip_low: float,
    clip_high: float,
    agg_mode: str = "seq-mean-token-mean",
    global_tokens: Count = None,
    global_seqs: Count = None,
    clip_ratio_c: float | None = None,
    norm_length: int | None = None,
    **kw,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (paper eq. 5): sequence-level ratio s_i, sequence-level clipping, one loss per sequence.

    J_GSPO = (1/G) sum_i min( s_i A_i, clip(s_i, 1-eps_l, 1+eps_h) A_i ),  loss = -J.
    Gradient of an unclipped sequence (paper, gradient analysis): s_i A_i (1/|y_i|) sum_t grad log pi(y_it).
    ``agg_mode``, global counts and ``norm_length``: see the module docstring and aggregation.py.
    """
    _check_inputs(log_prob, old_log_prob, advantages, response_mask, clip_low, clip_high, clip_ratio_c, kw)
    check_agg_mode(agg_mode)
    mask, lengths, delta = _token_log_ratio(log_prob, old_log_prob, response_mask)
    # s_i = exp( (1/|y_i|) sum_t log(pi_theta(y_it) / pi_old(y_it)) )   (paper: sequence importance ratio)
    log_s = _seq_log_ratio(delta, lengths)  # [B]
    adv = _seq_advantages(advantages, mask, lengths, delta.dtype)  # [B]
    seq_loss, high, low, dual = clipped_surrogate(log_s.exp(), adv, clip_low, clip_high, clip_ratio_c)
    loss = agg_seq_loss(
        seq_loss,
        lengths,
        agg_mode,
        norm_length=mask.shape[-1] if norm_length is None else norm_length,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
    )
    return loss, _metrics(loss, mask, lengths, log_s, delta, high, low, dual)


def _token_level_loss(ratio, advantages, mask, lengths, log_s, delta, clip, agg_mode, counts):
    """Shared tail of the token-level losses (GSPO-token, GRPO): clipped surrogate per token, then aggregate."""
    adv = _token_advantages(advantages, mask, delta.dtype)  # [B, 1] or [B, T]
    token_loss, high, low, dual = clipped_surrogate(ratio, adv, *clip)
    loss = agg_loss(token_loss, mask, agg_mode, **counts)
    return loss, _metrics(loss, mask, lengths, log_s, delta, high, low, dual)


def gspo_token_loss(
    log_prob: torch.Tensor,  # [B, T] log pi_theta(y_it), requires grad
    old_log_prob: torch.Tensor,  # [B, T] log pi_old(y_it)
    advantages: torch.Tensor,  # [B] A_i or [B, T] A_it
    response_mask: torch.Tensor,  # [B, T]
    *,
    clip_low: float,
    clip_high: float,
    agg_mode: str = "seq-mean-token-mean",
    global_tokens: Count = None,
    global_seqs: Count = None,
    clip_ratio_c: float | None = None,
    norm_length: int | None = None,
    **kw,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO-token (paper, GSPO-token variant): token-level advantages with a ratio whose value is s_i.

    s_it = sg[s_i] * pi_theta(y_it) / sg[pi_theta(y_it)]  =  exp( sg[log s_i] + log pi - sg[log pi] ),
    J = (1/G) sum_i (1/|y_i|) sum_t min( s_it A_it, clip(s_it) A_it ),  per-token clipping.
    With A_it = A_i the value and the gradient equal GSPO's (seq-mean-token-mean).
    """
    _check_inputs(log_prob, old_log_prob, advantages, response_mask, clip_low, clip_high, clip_ratio_c, kw)
    check_agg_mode(agg_mode)
    mask, lengths, delta = _token_log_ratio(log_prob, old_log_prob, response_mask)
    log_s = _seq_log_ratio(delta, lengths)  # [B]
    lp = log_prob.to(delta.dtype)
    # log pi - sg[log pi]: value 0, gradient 1; torch.where keeps padding garbage (NaN - NaN) out
    live = torch.where(mask, lp - lp.detach(), 0.0)  # [B, T]
    # log s_it = sg[log s_i] + log pi_theta(y_it) - sg[log pi_theta(y_it)]   (paper: GSPO-token ratio)
    ratio = torch.exp(log_s.detach().unsqueeze(-1) + live)  # [B, T], value s_i
    clip = (clip_low, clip_high, clip_ratio_c)
    counts = {"global_tokens": global_tokens, "global_seqs": global_seqs, "norm_length": norm_length}
    return _token_level_loss(ratio, advantages, mask, lengths, log_s, delta, clip, agg_mode, counts)


def grpo_loss(
    log_prob: torch.Tensor,  # [B, T] log pi_theta(y_it), requires grad
    old_log_prob: torch.Tensor,  # [B, T] log pi_old(y_it)
    advantages: torch.Tensor,  # [B] A_i or [B, T] A_it
    response_mask: torch.Tensor,  # [B, T]
    *,
    clip_low: float,
    clip_high: float,
    agg_mode: str = "seq-mean-token-mean",
    global_tokens: Count = None,
    global_seqs: Count = None,
    clip_ratio_c: float | None = None,
    norm_length: int | None = None,
    **kw,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO (as the GSPO paper writes it, without KL): token ratios, token clipping, optional dual clip.

    r_it = exp( clamp(log pi_theta(y_it) - log pi_old(y_it), -20, 20) ),
    J = (1/G) sum_i (1/|y_i|) sum_t min( r_it A_it, clip(r_it, 1-eps_l, 1+eps_h) A_it )
    (that weighting is agg_mode="seq-mean-token-mean"; DAPO's is "token-mean").
    """
    _check_inputs(log_prob, old_log_prob, advantages, response_mask, clip_low, clip_high, clip_ratio_c, kw)
    check_agg_mode(agg_mode)
    mask, lengths, delta = _token_log_ratio(log_prob, old_log_prob, response_mask)
    # r_it = pi_theta(y_it) / pi_old(y_it)
    ratio = torch.exp(delta.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # [B, T]; 1 on padding
    log_s = _seq_log_ratio(delta, lengths)  # reported only: sequence ratio of GRPO's update
    clip = (clip_low, clip_high, clip_ratio_c)
    counts = {"global_tokens": global_tokens, "global_seqs": global_seqs, "norm_length": norm_length}
    return _token_level_loss(ratio, advantages, mask, lengths, log_s, delta, clip, agg_mode, counts)


POLICY_LOSSES: dict[str, PolicyLoss] = {
    "gspo": gspo_loss,
    "gspo_token": gspo_token_loss,
    "grpo": grpo_loss,
}


def get_policy_loss(name: str) -> PolicyLoss:
    """The loss function registered as ``name``; ValueError naming the valid ones otherwise."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; valid: {', '.join(POLICY_LOSSES)}")
    return POLICY_LOSSES[name]
