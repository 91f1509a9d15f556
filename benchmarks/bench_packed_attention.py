"""One training pass (forward + backward of the log-probs) over a micro-batch of skewed lengths, three layouts.

    PYTHONPATH=. python benchmarks/bench_packed_attention.py [--model small] [--samples 32] [--rounds 3]

Layouts, all through :func:`gspo_ascend.engines.logprobs.forward_log_probs` on the same model and batches:
``padded`` (right-padded [B, T] with a mask), ``packed, [N, N] mask`` (one row; transformers' own block-diagonal
mask, what the packed path was before engines/packed_attention.py) and ``packed, per sequence`` (the row attended
one sequence at a time: what the fsdp engine runs now). A batch: ``--samples`` prompts of the synthetic task's
length (31 tokens) with responses of geometric lengths (mean ``--mean``, capped at ``--max``), the shape of the
e2e benchmark's realistic micro-batch. Every round draws a fresh batch (seeds 1, 2, ...), as RL does: one batch
timed over and over would hide every per-shape cost (a cuDNN plan per sequence length, a recompile) after its first
round (issue #43). Each layout runs the same rounds' batches, so the layouts stay comparable; prints the mean
seconds per round per layout (the first round's apart: it carries the one-off costs), tokens per round (mean) and
the ratios; the three log-prob tensors are checked equal first, on a batch of their own (seed 0).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def batch(samples: int, mean: float, cap: int, seed: int = 0):
    import torch

    from gspo_ascend.engines.base import SampleBatch

    rng = random.Random(seed)
    lengths = [min(cap, 1 + int(rng.expovariate(1.0 / mean))) for _ in range(samples)]
    width = max(lengths)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).float()
    tokens = torch.randint(3, 300, (samples, width), generator=torch.Generator().manual_seed(seed))
    prompts = [
        torch.randint(3, 300, (31,), generator=torch.Generator().manual_seed(seed + i)).tolist() for i in range(samples)
    ]
    return SampleBatch(prompts, (tokens * mask).long(), mask)


def timed(fn, batches: list) -> list[float]:
    """Seconds of ``fn(batch)`` for each batch, in order."""
    seconds = []
    for b in batches:
        t0 = time.perf_counter()
        fn(b)
        seconds.append(time.perf_counter() - t0)
    return seconds


def main(argv: list[str] | None = None) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from gspo_ascend.engines import packed_attention
    from gspo_ascend.engines.logprobs import forward_log_probs
    from gspo_ascend.tiny import ensure_tiny_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("tiny", "small"), default="small")
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--mean", type=float, default=70.0, help="mean response length (geometric)")
    p.add_argument("--max", type=int, default=512, help="response length cap")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds, each on a fresh batch")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    torch.set_num_threads(args.threads)
    path = ensure_tiny_model(size=args.model)
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    per_seq = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    packed_attention.enable(per_seq)
    b = batch(args.samples, args.mean, args.max, seed=0)  # the equality check's: no timed round sees its shapes
    batches = [batch(args.samples, args.mean, args.max, seed=r) for r in range(1, args.rounds + 1)]  # fresh lengths
    layouts = {
        "padded": (plain, False),
        "packed, [N, N] mask": (plain, True),
        "packed, per sequence": (per_seq, True),
    }

    def step(model, packed, one):
        model.zero_grad(set_to_none=True)
        forward_log_probs(model, one, 1.0, packed).sum().backward()

    with torch.no_grad():
        ref = forward_log_probs(plain, b, 1.0, False)
        for name, (model, packed) in layouts.items():
            err = (forward_log_probs(model, b, 1.0, packed) - ref).abs().max().item()
            assert err < 1e-4, f"{name} differs from padded by {err}"
    real = [sum(len(p) for p in x.prompt_ids) + int(x.response_mask.sum()) for x in batches]
    padded_tokens = [
        len(x) * max(len(p) + int(n) for p, n in zip(x.prompt_ids, x.response_lengths.tolist(), strict=True))
        for x in batches
    ]
    rounds = len(batches)
    print(
        f"{args.model} model, {len(b)} samples, {sum(real) / rounds:.0f} tokens ({sum(padded_tokens) / rounds:.0f} "
        f"padded) per round, mean of {rounds} fresh batches, longest response "
        f"{max(int(x.response_lengths.max()) for x in batches)}, {args.threads} threads, forward + backward"
    )
    times = {name: timed(lambda x, m=m, k=k: step(m, k, x), batches) for name, (m, k) in layouts.items()}
    per_seq = sum(times["packed, per sequence"])
    for name, seconds in times.items():
        ratio = sum(seconds) / per_seq
        print(
            f"  {name:24} {sum(seconds) / len(seconds):8.3f} s/round (first {seconds[0]:.3f})   "
            f"{ratio:5.2f}x the per-sequence time"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
