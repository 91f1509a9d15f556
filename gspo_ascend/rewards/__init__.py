"""Rewards: math answer checking with math-verify, DAPO overlong penalty, user reward functions.

Importing this package does not import torch, so reward worker processes start quickly; torch is imported
inside the functions that return tensors. See :mod:`.math_answer` for why model text is never evaluated.
"""

from .compute import DEFAULT_TIMEOUT_S, compute_rewards, score_responses, shutdown_reward_workers
from .math_answer import extract_boxed, is_equivalent, math_score
from .penalty import overlong_penalty
from .user_fn import load_reward_fn

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "compute_rewards",
    "extract_boxed",
    "is_equivalent",
    "load_reward_fn",
    "math_score",
    "overlong_penalty",
    "score_responses",
    "shutdown_reward_workers",
]
