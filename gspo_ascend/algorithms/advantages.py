"""Group-relative advantages (GRPO / GSPO).

The GSPO paper (Zheng et al. 2025, eq. for A_i) uses the GRPO advantage for every response y_i of a prompt
x sampled in a group of G:

    A_i = (r(x, y_i) - mean({r(x, y_j)}_{j=1..G})) / std({r(x, y_j)}_{j=1..G})

The paper does not say which std (biased or unbiased) nor how a zero std is handled; our choices are in
the docstring of grpo_advantages.

How we differ from verl's compute_grpo_outcome_advantage: verl gives a single-sample group mu = 0 and
sigma = 1, i.e. A = r / (1 + eps); we give it 0, because one sample carries no relative signal (and a
stray singleton should not push the policy by its raw reward). Everything else matches verl (unbiased std,
eps added to sigma, optional Dr. GRPO variant without the std division).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch


def _group_index(group_ids: torch.Tensor | Sequence[Hashable], device: torch.device) -> tuple[torch.Tensor, int]:
    """Map arbitrary group ids (ints, or hashables such as uid strings) to 0..G-1.   -> ([N] int64, G)"""
    if isinstance(group_ids, torch.Tensor):
        uniq, inverse = torch.unique(group_ids, return_inverse=True)
        return inverse.to(device), uniq.numel()
    first_seen: dict[Hashable, int] = {}
    index = [first_seen.setdefault(g, len(first_seen)) for g in group_ids]  # one pass over samples
    return torch.tensor(index, dtype=torch.long, device=device), len(first_seen)


def grpo_advantages(
    rewards: torch.Tensor,  # [N] one scalar reward per response
    group_ids: torch.Tensor | Sequence[Hashable],  # [N] responses with equal id answer the same prompt
    *,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:  # [N]
    """Group-normalised advantages A_i = (r_i - mean_g) / (std_g + eps), one per response.

    Choices:
    - Statistics are per group of equal ``group_ids`` (any ids, need not be contiguous or sorted), computed
      with torch.unique(return_inverse) + index_add_ (no Python loop over groups).
    - std is the unbiased sample std (divide by n - 1), as verl (torch.std) does; the paper does not say.
    - ``eps`` is added to the std (not under the square root), as in verl, so A is bounded by
      |r_i - mean| / eps for tiny but non-zero spreads.
    - A group of one sample, or whose rewards are all identical, gets exactly 0 (never NaN): we detect
      max == min per group and zero the centred reward, because (r - mean) can be a rounding residue like
      1e-17 that would otherwise be divided by eps into a spurious +-1e-11.
    - ``norm_by_std=False`` gives the Dr. GRPO variant A_i = r_i - mean_g.
    - Statistics are computed in float64 (N is small, rewards may be ints); the result has the dtype of
      ``rewards`` when it is a floating type, else float32.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if len(group_ids) != rewards.shape[0]:
        raise ValueError(f"group_ids has {len(group_ids)} entries for {rewards.shape[0]} rewards")
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    r = rewards.to(torch.float64)  # [N]
    idx, n_groups = _group_index(group_ids, r.device)  # [N] in 0..G-1
    counts = r.new_zeros(n_groups).index_add_(0, idx, torch.ones_like(r))  # [G] n_g
    # mean_g = (1/n_g) sum_{i in g} r_i
    mean = torch.zeros_like(counts).index_add_(0, idx, r) / counts  # [G]
    centred = r - mean[idx]  # [N] r_i - mean_g
    g_max = torch.full_like(counts, -torch.inf).scatter_reduce(0, idx, r, "amax")
    g_min = torch.full_like(counts, torch.inf).scatter_reduce(0, idx, r, "amin")
    constant = (g_max == g_min)[idx]  # [N] singleton or all-equal group
    centred = torch.where(constant, 0.0, centred)
    if not norm_by_std:
        return centred.to(out_dtype)
    # std_g = sqrt( sum_{i in g} (r_i - mean_g)^2 / (n_g - 1) ); n_g = 1 gives 0 / 1 = 0 (centred is 0 there)
    sq = torch.zeros_like(counts).index_add_(0, idx, centred.square())
    std = (sq / (counts - 1).clamp_min(1)).sqrt()  # [G]
    # A_i = (r_i - mean_g) / (std_g + eps)
    return (centred / (std[idx] + eps)).to(out_dtype)
