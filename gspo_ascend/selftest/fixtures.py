"""Inputs and independent references shared by the selftest and the engine tests (tests/integration/ import them):
the tiny Qwen3 with two KV heads, rollout-like batches, a perturbed copy of a state dict, and per-sample log-probs
from one plain transformers forward each.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..engines.base import SampleBatch

KV2_DIR = "tiny-qwen3-kv2"
MINIBATCHES = 2
# the update the engine comparisons make (two engines, or one before and after a checkpoint): a few micro-batches
# per minibatch, a warm-up and a clip that act, and clip ratios far outside the paper's [1 - 3e-4, 1 + 4e-4],
# which would clip every sequence and leave no gradient to compare
UPDATE_OVERRIDES = [
    f"algorithm.minibatches_per_rollout={MINIBATCHES}",
    "rollout.n=4",
    "actor.micro_batch_size=3",
    "actor.lr=1e-5",
    "actor.warmup_steps=2",
    "actor.grad_clip=1.0",
    "algorithm.clip_ratio_low=0.2",
    "algorithm.clip_ratio_high=0.3",
]


def make_kv2_model(src: str | Path, out: Path) -> Path:
    """The tiny Qwen3 at ``src`` with its one KV head duplicated into two, saved to ``out / KV2_DIR``: the same
    function (each query head reads an identical copy), but TP=2 needs the KV heads to divide by 2."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    state = model.state_dict()
    for name in list(state):
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            state[name] = torch.cat([state[name], state[name]], 0)  # [kv * head_dim, H] -> two identical heads
    model.config.num_key_value_heads = 2
    twin = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
    twin.load_state_dict(state, strict=True)
    twin.save_pretrained(out / KV2_DIR)
    AutoTokenizer.from_pretrained(src).save_pretrained(out / KV2_DIR)
    return out / KV2_DIR


def sample_batch(model, seed: int, temperature: float, size: int = 16, width: int = 8) -> SampleBatch:
    """A rollout-like batch from the HF model: random prompts (2-8 tokens), responses sampled at ``temperature`` and
    cut to random lengths (one full, some empty), old log-probs = the sampling log-probs plus noise (sequence
    ratios near 1, inside the clip range, so the update has a gradient), random advantages."""
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    prompts = [
        torch.randint(3, vocab, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist()
        for _ in range(size)
    ]
    responses = torch.zeros((size, width), dtype=torch.long)
    sampled = torch.zeros((size, width))
    with torch.no_grad():
        for i, prompt in enumerate(prompts):
            ids = list(prompt)
            for t in range(width):
                log_p = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1] / temperature, -1)
                token = int(torch.multinomial(log_p.exp(), 1, generator=g))
                responses[i, t], sampled[i, t] = token, log_p[token]
                ids.append(token)
    lengths = torch.randint(0, width + 1, (size,), generator=g)
    lengths[0] = width
    mask = (torch.arange(width)[None] < lengths[:, None]).float()
    old = (sampled + 0.05 * torch.randn((size, width), generator=g)) * mask
    advantages = torch.randn(size, generator=g)
    return SampleBatch(prompts, responses * mask.long(), mask, old_log_probs=old, advantages=advantages)


def hf_log_probs(model, batch: SampleBatch, temperature: float) -> torch.Tensor:
    """[B, R] log_softmax(logits / T) at each response token, one plain forward per sample (no padding, no packing,
    no cache): independent of the engines' batching code. 0 at padding."""
    device = next(model.parameters()).device
    out = torch.zeros(batch.response_ids.shape)
    with torch.no_grad():
        for i, prompt in enumerate(batch.prompt_ids):
            n = int(batch.response_mask[i].sum())
            response = batch.response_ids[i, :n].tolist()
            logits = model(torch.tensor([prompt + response], device=device)).logits[0].float().cpu()
            log_p = torch.log_softmax(logits / temperature, -1)[len(prompt) - 1 : len(prompt) - 1 + n]
            out[i, :n] = log_p.gather(-1, torch.tensor(response)[:, None])[:, 0]
    return out


def perturbed_state(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """w * 1.01 + N(0, 1e-2^2), seeded: far from the original weights, still a working model."""
    gen = torch.Generator().manual_seed(seed)
    return {
        name: (w.detach().cpu() * 1.01 + 0.01 * torch.randn(w.shape, generator=gen, dtype=w.dtype)).contiguous()
        for name, w in model.state_dict().items()
    }
