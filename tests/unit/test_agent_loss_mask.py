"""Multi-turn trajectories train the model's own tokens only (issue #45, "loss-mask exactness").

A trajectory's response holds the model's turns and a tool turn between them (``SampleBatch.loss_mask`` 0 there).
The fsdp engine's gradient equals the gradient of the GSPO loss written out by hand over the model's tokens: the
sequence ratio s_i = exp(sum_t m_it (log pi - log pi_old) / sum_t m_it), the clipped objective per sequence, the
aggregation's weights from the model-token counts; the tool tokens are context (the later model tokens attend to
them) and nothing else: whatever pi_old says at them changes no bit of the gradient. In float64, as the engine's
other gradient equivalences (tests/unit/test_fsdp_engine.py).
"""

from __future__ import annotations

import pytest
import torch

from tests.unit.fsdp_worker import make_batch, reference_log_probs
from tests.unit.test_fsdp_engine import F64, assert_close_dicts, full_grads, make_engine, plain_model

pytestmark = pytest.mark.usefixtures("one_thread")
R, TOOL = 16, slice(5, 9)  # response width; the tool turn's positions


@pytest.fixture(scope="module")
def model_path() -> str:
    from gspo_ascend.tiny import ensure_tiny_model

    return str(ensure_tiny_model())


def trajectories(model_path: str, seed: int):
    batch = make_batch(4, R, seed, min_response=12)  # every response reaches past the tool turn
    loss_mask = batch.response_mask.clone()
    loss_mask[:, TOOL] = 0.0
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        current = reference_log_probs(plain_model(model_path, torch.float64), batch, 1.0)
    old = (current + 3e-4 * torch.randn(current.shape, generator=g, dtype=current.dtype)) * batch.response_mask
    # advantages of both signs and ratios on both sides of the clip window (3e-4, 4e-4)
    return batch.replace(
        loss_mask=loss_mask, old_log_probs=old.float(), advantages=torch.tensor([1.0, -0.5, 2.0, -1.5])
    )


def hand_loss(model, batch, agg_mode: str, low=3e-4, high=4e-4):
    """GSPO over the model's tokens, written out: one clipped term per sequence, weighed by the aggregation."""
    lp = reference_log_probs(model, batch, 1.0)
    m = batch.loss_mask.double()
    old = batch.old_log_probs.double()
    n = m.sum(-1)
    s = torch.exp(((lp - old) * m).sum(-1) / n)
    a = batch.advantages.double()
    per_seq = torch.maximum(-a * s, -a * s.clamp(1 - low, 1 + high))
    if agg_mode == "seq-mean-token-mean":  # (1/G) sum_i: each sequence once
        return per_seq.mean()
    assert agg_mode == "token-mean"  # each model token once: sequence i weighs n_i / sum_j n_j
    return (per_seq * n).sum() / n.sum()


@pytest.mark.parametrize("agg_mode", ["seq-mean-token-mean", "token-mean"])
@pytest.mark.parametrize("packed", [True, False])
def test_the_gradient_is_the_hand_written_loss_over_the_model_tokens(model_path, agg_mode, packed):
    batch = trajectories(model_path, seed=3)
    model = plain_model(model_path, torch.float64)
    loss = hand_loss(model, batch, agg_mode)
    model.zero_grad(set_to_none=True)
    loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert max(g.abs().max().item() for g in want.values()) > 1e-4  # a gradient worth comparing
    engine = make_engine(
        model_path, f"algorithm.loss_agg_mode={agg_mode}", f"actor.use_remove_padding={packed}",
        "actor.micro_batch_size=2", **F64,
    )  # fmt: skip
    engine.backward_minibatch(batch, 1.0)
    got = full_grads(engine)
    assert_close_dicts(got, want, atol=1e-10)

    # pi_old at the tool tokens, changed arbitrarily: not one bit of the gradient moves
    garbage = batch.old_log_probs.clone()
    garbage[:, TOOL] = torch.linspace(-50.0, 50.0, 4 * 4).reshape(4, 4)
    engine.optimizer.zero_grad(set_to_none=True)
    engine.backward_minibatch(batch.replace(old_log_probs=garbage), 1.0)
    again = full_grads(engine)
    assert all(torch.equal(again[k], got[k]) for k in got)


def test_without_a_loss_mask_the_tool_tokens_would_train(model_path):
    """The check above can fail: the same batch trained over every response token gives another gradient."""
    batch = trajectories(model_path, seed=3)
    engine = make_engine(model_path, **F64)
    engine.backward_minibatch(batch, 1.0)
    masked = full_grads(engine)
    engine.optimizer.zero_grad(set_to_none=True)
    engine.backward_minibatch(batch.replace(loss_mask=None), 1.0)
    unmasked = full_grads(engine)
    assert max((masked[k] - unmasked[k]).abs().max().item() for k in masked) > 1e-4
