"""Pure tensor math for GSPO / GRPO: advantages, policy losses, loss aggregation, KL estimators, presets.

No config objects, no Ray, no device calls: tensors in, tensors out, on whatever device they live on.
The equations are in docs/gspo.md and beside the code; module docstrings say where we differ from the
paper and from verl / TRL / ChatLearn.
"""

from gspo_ascend.algorithms.advantages import grpo_advantages
from gspo_ascend.algorithms.aggregation import (
    AGG_MODES,
    agg_loss,
    agg_seq_loss,
    check_agg_mode,
    count_tokens_and_seqs,
)
from gspo_ascend.algorithms.kl import KL_ESTIMATORS, kl_k1, kl_k2, kl_k3, kl_penalty
from gspo_ascend.algorithms.policy_loss import (
    LOG_RATIO_CLAMP,
    POLICY_LOSSES,
    clipped_surrogate,
    get_policy_loss,
    grpo_loss,
    gspo_loss,
    gspo_token_loss,
)
from gspo_ascend.algorithms.presets import PRESET_SOURCES, PRESETS, get_preset

__all__ = [
    "AGG_MODES",
    "KL_ESTIMATORS",
    "LOG_RATIO_CLAMP",
    "POLICY_LOSSES",
    "PRESETS",
    "PRESET_SOURCES",
    "agg_loss",
    "agg_seq_loss",
    "check_agg_mode",
    "clipped_surrogate",
    "count_tokens_and_seqs",
    "get_policy_loss",
    "get_preset",
    "grpo_advantages",
    "grpo_loss",
    "gspo_loss",
    "gspo_token_loss",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_penalty",
]
