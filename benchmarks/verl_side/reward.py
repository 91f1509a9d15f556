"""verl's custom reward function for the benchmark's verl sides: our scorer, so both sides are rewarded alike.

verl calls ``compute_score(data_source, solution_str, ground_truth, extra_info)`` per sample
(``reward.custom_reward_function``); this answers with :func:`gspo_ascend.rewards.math_score`, the math-verify check
of the last ``\\boxed{}`` that our trainer's default reward runs (no overlong penalty on either side). verl's reward
loop runs it in its own worker; the repository is put on ``sys.path`` here because the verl venv does not install
gspo-ascend.
"""

import sys
from pathlib import Path

_REPO = str(Path(__file__).resolve().parents[2])
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

from gspo_ascend.rewards import math_score  # noqa: E402


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    return float(math_score(solution_str, ground_truth))
