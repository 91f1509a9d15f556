"""DAPO's soft overlong punishment (Yu et al. 2025, arXiv 2503.14476, eq. 13).

With L_max = ``max_response_length`` and L_cache = ``buffer_length``::

    R_length(y) = 0                                  if |y| <= L_max - L_cache
                = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
                = -1                                 if L_max < |y|

scaled by ``penalty_factor`` and added to the task reward. How we differ from verl: verl's DAPO reward manager
computes ``min(-exceed / buffer * factor, 0)`` with no floor (harmless there, responses are cut at L_max); we
keep the paper's floor at ``-penalty_factor`` so a caller counting lengths past L_max cannot get a larger
penalty, and accept ``buffer_length == 0`` as a hard step (0 up to L_max, ``-penalty_factor`` beyond it)
where verl would divide by zero.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def overlong_penalty(
    response_length: int | float | torch.Tensor,
    max_response_length: int,
    buffer_length: int,
    penalty_factor: float = 1.0,
) -> float | torch.Tensor:
    """The length penalty (<= 0) for one length (returns a float) or a tensor of lengths (same shape)."""
    import torch  # here, not at import time: reward worker processes import this package without needing torch

    if max_response_length <= 0:
        raise ValueError(f"max_response_length must be > 0, got {max_response_length}")
    if not 0 <= buffer_length <= max_response_length:
        raise ValueError(f"buffer_length must be in [0, {max_response_length}], got {buffer_length}")
    scalar = not isinstance(response_length, torch.Tensor)
    length = torch.as_tensor(response_length, dtype=torch.float64)  # float64: exact ramp values at hand-picked lengths
    start = max_response_length - buffer_length
    if buffer_length == 0:
        ramp = torch.zeros_like(length)
    else:
        ramp = ((start - length) / buffer_length).clamp(max=0.0)
    penalty = torch.where(length > max_response_length, torch.full_like(length, -1.0), ramp) * penalty_factor
    return float(penalty) if scalar else penalty.to(torch.float32)
