"""The fsdp engine on the NPU pin's torch (2.7.1) over gloo: a DP 2 update equals the DP 1 update.

torch 2.7.1's FSDP2 asks gloo for ReduceOp.AVG, which gloo answers with the sum, and it has no
``set_force_sum_reduction_for_comms`` (2.8+): the engine's loss scaling then doubled DP 2 gradients (grad norm
292.4 against 146.2). ``FSDPEngine._dp_reduce_averages`` probes the op and scales accordingly. Runs here because
this venv has torch 2.7.1; CI's main venv (torch 2.13) takes the force-sum path.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile

import pytest
import torch

from tests.conftest import REPO
from tests.unit.fsdp_worker import batch_to_dict, engine_config
from tests.unit.test_fsdp_engine import rollout


@pytest.fixture(scope="module")
def model_path() -> str:
    from gspo_ascend.tiny import ensure_tiny_model

    return str(ensure_tiny_model())


def test_dp2_gradient_norm_equals_dp1_on_torch_2_7(model_path):
    from gspo_ascend.device import get_backend
    from gspo_ascend.engines.fsdp import FSDPEngine

    overrides = ["data.train_batch_size=8", "algorithm.minibatches_per_rollout=2", "actor.lr=1e-3",
                 "algorithm.loss_agg_mode=token-mean"]  # fmt: skip
    batch = rollout(model_path, 8, seed=9)
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(batch_to_dict(batch), f"{tmp}/batch.pt")
        cmd = [sys.executable, "-m", "tests.unit.fsdp_worker", "2", tmp, *overrides]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        dp2 = torch.load(f"{tmp}/out0.pt", weights_only=True)
    engine = FSDPEngine(engine_config(*overrides), get_backend("cpu"), model_path)
    engine.compute_log_probs(batch, 1.0)
    dp1 = engine.update(batch, 1.0)
    # the gradient norm pins the DP scaling (a doubled gradient doubles it); the weights cannot: AdamW's first step
    # is ~lr * sign(g), blind to a uniform scale, and on torch 2.7.1 elements with |g| near 0 differ by up to
    # 1e-5 between the DP 1 and DP 2 summation orders (measured)
    assert dp2["metrics"]["actor/grad_norm"] == pytest.approx(dp1["actor/grad_norm"], rel=1e-5)
