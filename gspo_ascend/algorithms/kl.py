"""Per-token KL estimators between the current policy and a reference policy (Schulman's k1, k2, k3).

The samples y_t come from the rollout policy, and log_prob / ref_log_prob are log pi_theta(y_t) and
log pi_ref(y_t). With delta = log pi_ref - log pi_theta the estimators of KL(pi_theta || pi_ref) are

    k1 = -delta = log pi_theta - log pi_ref              unbiased, can be negative, high variance
    k2 = 1/2 delta^2                                     biased, non-negative, low variance
    k3 = exp(delta) - 1 - delta                          unbiased, non-negative, low variance ("low_var_kl")

They are unbiased when the samples come from pi_theta; in RL training they come from pi_old, which is
close enough inside the trust region. A KL penalty is off by default: the GSPO paper uses none
(kl_coef = 0 in presets.py); these exist for GRPO-style runs that want one.

k3 is computed the way verl does for safety: delta is clamped to [-20, 20] before exp (exp(20) ~ 4.9e8
stays finite in bf16/fp16/fp32) and the result is clamped to [-10, 10], so one token with a wild log-prob
cannot dominate the batch. The clamps zero the gradient outside those ranges, a deliberate trust bound.
All functions return a [B, T] tensor; aggregate it with aggregation.agg_loss and the response mask.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_DELTA_CLAMP = 20.0
_K3_CLAMP = 10.0


def kl_k1(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """k1 = log pi_theta - log pi_ref.   # [B, T], [B, T] -> [B, T]"""
    return log_prob - ref_log_prob


def kl_k2(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """k2 = 1/2 (log pi_theta - log pi_ref)^2.   # [B, T], [B, T] -> [B, T]"""
    return 0.5 * (log_prob - ref_log_prob).square()


def kl_k3(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """k3 = exp(delta) - 1 - delta with delta = log pi_ref - log pi_theta, clamped (module doc).

    # [B, T], [B, T] -> [B, T]
    """
    delta = (ref_log_prob - log_prob).clamp(-_DELTA_CLAMP, _DELTA_CLAMP)
    # k3 = (pi_ref / pi_theta) - 1 - log(pi_ref / pi_theta)
    return (torch.exp(delta) - 1.0 - delta).clamp(-_K3_CLAMP, _K3_CLAMP)


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "k1": kl_k1,
    "kl": kl_k1,
    "k2": kl_k2,
    "mse": kl_k2,
    "k3": kl_k3,
    "low_var_kl": kl_k3,
}


def kl_penalty(
    name: str,
    log_prob: torch.Tensor,  # [B, T]
    ref_log_prob: torch.Tensor,  # [B, T]
    response_mask: torch.Tensor | None = None,  # [B, T]
) -> torch.Tensor:
    """Per-token KL estimate by estimator name (k1|kl, k2|mse, k3|low_var_kl).   -> [B, T]

    With ``response_mask``, non-response positions are set to exactly 0 with torch.where, so garbage
    log-probs in padding cannot produce NaN there.
    """
    if name not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {name!r}; valid: {', '.join(KL_ESTIMATORS)}")
    if response_mask is None:
        return KL_ESTIMATORS[name](log_prob, ref_log_prob)
    mask = response_mask.bool()
    kl = KL_ESTIMATORS[name](torch.where(mask, log_prob, 0.0), torch.where(mask, ref_log_prob, 0.0))
    return torch.where(mask, kl, 0.0)
