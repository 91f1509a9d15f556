"""Algorithm presets as data: dotted config keys -> values, applied by the config layer like CLI overrides.

Sources (see docs/gspo.md, "Presets"):
- gspo_paper: GSPO paper (Zheng et al. 2025, arXiv 2507.18071v2), experimental setup: "we set the left and
  right clipping ranges in Equation (5) to 3e-4 and 4e-4"; "each batch of rollout data is partitioned into
  four minibatches for gradient updates" (quoted in TRL docs/source/paper_index.md and TRL issue #3834);
  no KL term in the GSPO objective (the paper author recommended kl_loss_coef=0 in verl PR #2775);
  aggregation = the objective's (1/G) sum_i over sequences = seq-mean-token-mean.
- grpo_paper: the GRPO baseline of the same paper: clipping ranges 0.2 / 0.27 (paper experimental setup;
  checked against the PDF by the rl-llm-wiki review cited in docs/gspo.md), same 4 minibatches and no KL.
  The paper writes GRPO's objective as (1/G) sum_i (1/|y_i|) sum_t, i.e. seq-mean-token-mean; it does not
  state another aggregation for the baseline, so we use the equation's. (The paper's GRPO baseline on MoE
  also needed Routing Replay, a rollout/engine feature, not a loss setting.)

Keys name the fields of the ``algorithm`` section of the config (gspo_ascend.config). PRESET_SOURCES
records, per preset and key, where the number comes from, so ``gspo-ascend plan`` can print it.
"""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    "gspo_paper": {
        "algorithm.loss": "gspo",
        "algorithm.clip_ratio_low": 3e-4,
        "algorithm.clip_ratio_high": 4e-4,
        "algorithm.minibatches_per_rollout": 4,
        "algorithm.kl_coef": 0.0,
        "algorithm.loss_agg_mode": "seq-mean-token-mean",
    },
    "grpo_paper": {
        "algorithm.loss": "grpo",
        "algorithm.clip_ratio_low": 0.2,
        "algorithm.clip_ratio_high": 0.27,
        "algorithm.minibatches_per_rollout": 4,
        "algorithm.kl_coef": 0.0,
        "algorithm.loss_agg_mode": "seq-mean-token-mean",
    },
}

_PAPER = "GSPO paper (arXiv 2507.18071v2) experimental setup"
PRESET_SOURCES: dict[str, dict[str, str]] = {
    "gspo_paper": {
        "algorithm.loss": "GSPO objective, paper eq. 5",
        "algorithm.clip_ratio_low": f"{_PAPER}: left clipping range 3e-4",
        "algorithm.clip_ratio_high": f"{_PAPER}: right clipping range 4e-4",
        "algorithm.minibatches_per_rollout": f"{_PAPER}: rollout batch split into four minibatches",
        "algorithm.kl_coef": "GSPO objective has no KL term; author's advice in verl PR #2775",
        "algorithm.loss_agg_mode": "eq. 5 averages sequence losses: (1/G) sum_i",
    },
    "grpo_paper": {
        "algorithm.loss": "GRPO baseline of the GSPO paper",
        "algorithm.clip_ratio_low": f"{_PAPER}: GRPO left clipping range 0.2",
        "algorithm.clip_ratio_high": f"{_PAPER}: GRPO right clipping range 0.27",
        "algorithm.minibatches_per_rollout": f"{_PAPER}: rollout batch split into four minibatches",
        "algorithm.kl_coef": "the paper's GRPO objective is written without a KL term",
        "algorithm.loss_agg_mode": "the paper's GRPO objective: (1/G) sum_i (1/|y_i|) sum_t",
    },
}


def get_preset(name: str) -> dict[str, Any]:
    """A copy of preset ``name``'s overrides; ValueError naming the valid presets otherwise."""
    if name not in PRESETS:
        raise ValueError(f"unknown algorithm preset {name!r}; valid: {', '.join(PRESETS)}")
    return dict(PRESETS[name])
