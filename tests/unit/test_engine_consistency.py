"""The two engines of the default pipeline agree before any update: the hf rollout engine's per-token
log-probs of its own samples == the fsdp train engine's recomputed log-probs (fp32, <= 1e-5), packed and
padded, at T=1 and at T=0.7 — so algorithm.old_logprobs=engine starts exactly on-policy on CPU."""

from __future__ import annotations

import pytest
import torch

from gspo_ascend.config import load_config
from gspo_ascend.device import get_backend
from gspo_ascend.engines import SamplingParams
from gspo_ascend.engines.fsdp import FSDPEngine
from gspo_ascend.engines.hf_rollout import build_hf_rollout
from gspo_ascend.tiny import ensure_tiny_model


@pytest.fixture(scope="module")
def engines():
    path = str(ensure_tiny_model())
    cfg = load_config(None, ["actor.micro_batch_size=8"])
    backend = get_backend("cpu")
    train = FSDPEngine(cfg, backend, path)
    rollout = build_hf_rollout(cfg, backend, path)
    yield cfg, train, rollout, path
    train.close()


def prompts(path: str, count: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from gspo_ascend.tiny import synthetic_arithmetic

    tok = AutoTokenizer.from_pretrained(path)
    texts = [
        tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
        for r in synthetic_arithmetic(count, seed=3, split="test")
    ]
    return tok(texts, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("packed", [True, False])
def test_rollout_log_probs_equal_trainer_log_probs(engines, temperature, packed):
    cfg, train, rollout, path = engines
    cfg.actor.use_remove_padding = packed
    batch = rollout.generate(prompts(path, 6), SamplingParams(n=4, temperature=temperature, max_new_tokens=24, seed=5))
    assert batch.response_mask.sum() > 6 * 4  # real responses, not empty ones
    recomputed = train.compute_log_probs(batch, temperature)
    mask = batch.response_mask.bool()
    assert torch.equal(recomputed[~mask], torch.zeros_like(recomputed[~mask]))
    diff = (recomputed - batch.rollout_log_probs).abs()[mask]
    assert diff.max() <= 1e-5, float(diff.max())


def test_greedy_continuation_is_the_one_round_response(engines):
    """Partial rollout's continuation (tests/continuation.py) under frozen weights: token-identical to one round,
    and the continued segment's engine log-probs == the trainer's recompute (<= 1e-5, as above)."""
    from tests.continuation import continued_in_two_rounds

    cfg, train, rollout, path = engines
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=24, seed=5)
    one, joined, continued = continued_in_two_rounds(rollout, prompts(path, 8), params, first=6)
    assert continued.any()  # some answers are longer than 6 tokens: they were continued
    assert torch.equal(joined.response_ids, one.response_ids)
    assert torch.equal(joined.response_mask, one.response_mask)
    recomputed = train.compute_log_probs(joined, 1.0)  # greedy samples are scored at T = 1
    diff = (recomputed - joined.rollout_log_probs).abs()[continued]
    assert diff.max() <= 1e-5, float(diff.max())


def test_requests_with_their_own_budgets_in_one_call(engines):
    """hf generate_requests: rows of smaller budgets stop at them (greedy: the prefix of the full-budget row), EOS
    inside a budget marks the sample finished, and a budget cut does not."""
    from gspo_ascend.engines import Request, requests_for

    _, _, rollout, path = engines
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=24, seed=5)
    full = rollout.generate(prompts(path, 6), params)
    requests = [
        Request(q.prompt_ids, 1, budget, q.seed)
        for q, budget in zip(requests_for(prompts(path, 6), params), [3, 24, 8, 1, 24, 12], strict=True)
    ]
    cut = rollout.generate_requests(requests, params)
    for i, q in enumerate(requests):
        k = int(cut.response_lengths[i])
        assert k == min(q.max_new_tokens, int(full.response_lengths[i]))
        assert torch.equal(cut.response_ids[i, :k], full.response_ids[i, :k])
        assert bool(cut.finished[i]) == (bool(full.finished[i]) and int(full.response_lengths[i]) <= q.max_new_tokens)
        assert not cut.response_mask[i, k:].any() and not cut.rollout_log_probs[i, k:].any()
    assert not bool(cut.finished[3]) and int(cut.response_lengths[3]) == 1  # one token: no answer ends there
