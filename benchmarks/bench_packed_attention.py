"""One training pass (forward + backward of the log-probs) over a micro-batch of skewed lengths, three layouts.

    PYTHONPATH=. python benchmarks/bench_packed_attention.py [--model small] [--samples 32] [--rounds 3]

Layouts, all through :func:`gspo_ascend.engines.logprobs.forward_log_probs` on the same model and batch:
``padded`` (right-padded [B, T] with a mask), ``packed, [N, N] mask`` (one row; transformers' own block-diagonal
mask, what the packed path was before engines/packed_attention.py) and ``packed, per sequence`` (the row attended
one sequence at a time: what the fsdp engine runs now). The batch: ``--samples`` prompts of the synthetic task's
length (31 tokens) with responses of geometric lengths (mean ``--mean``, capped at ``--max``), the shape of the
e2e benchmark's realistic micro-batch. Prints the best of ``--rounds`` per layout, tokens processed (padding
included) and the ratios; the three log-prob tensors are checked equal first.
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


def timed(fn, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


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
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = ensure_tiny_model(size=args.model)
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    per_seq = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    packed_attention.enable(per_seq)
    b = batch(args.samples, args.mean, args.max)
    layouts = {
        "padded": (plain, False),
        "packed, [N, N] mask": (plain, True),
        "packed, per sequence": (per_seq, True),
    }

    def step(model, packed):
        model.zero_grad(set_to_none=True)
        forward_log_probs(model, b, 1.0, packed).sum().backward()

    with torch.no_grad():
        ref = forward_log_probs(plain, b, 1.0, False)
        for name, (model, packed) in layouts.items():
            err = (forward_log_probs(model, b, 1.0, packed) - ref).abs().max().item()
            assert err < 1e-4, f"{name} differs from padded by {err}"
    real = sum(len(p) for p in b.prompt_ids) + int(b.response_mask.sum())
    padded_tokens = len(b) * max(
        len(p) + int(n) for p, n in zip(b.prompt_ids, b.response_lengths.tolist(), strict=True)
    )
    print(
        f"{args.model} model, {len(b)} samples, {real} tokens ({padded_tokens} padded), longest response "
        f"{int(b.response_lengths.max())}, {args.threads} threads, best of {args.rounds}, forward + backward"
    )
    times = {name: timed(lambda m=m, k=k: step(m, k), args.rounds) for name, (m, k) in layouts.items()}
    for name, seconds in times.items():
        ratio = seconds / times["packed, per sequence"]
        print(f"  {name:24} {seconds:8.3f} s   {ratio:5.2f}x the per-sequence time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
