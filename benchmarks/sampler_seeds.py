"""What per-request seeds cost vLLM's decode (audit 3 finding 6, issue #41): the same batch generated with a seed on
every request (our rollouts: each sequence then has its own torch.Generator, and vLLM's sampler draws its
exponential noise one sequence at a time) and without (the engine's one seeded stream, one draw for the batch).

Run: ``.venv/bin/python benchmarks/sampler_seeds.py [--seqs 256] [--tokens 64] [--rounds 3]``. The two sides
alternate in one process on one engine, rounds interleaved, so a busy machine skews both alike; prints the decode
tokens/s of each and the ratio. On vLLM's CPU build the tiny model's forward is cheap, so the sampler's share (and
this ratio) is larger than on an NPU, where the audit estimates 5-10 % of eager decode: a measured bound on the CPU,
not an NPU number.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seqs", type=int, default=256)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    import vllm

    from gspo_ascend.tiny import ensure_tiny_model

    llm = vllm.LLM(model=str(ensure_tiny_model()), dtype="float32", max_model_len=128, seed=0, enforce_eager=True,
                   enable_chunked_prefill=False, max_num_seqs=args.seqs)  # fmt: skip
    prompts = [{"prompt_token_ids": [1, 5 + i % 7, 9, 11 + i % 5]} for i in range(args.seqs)]

    def params(seeded: bool) -> list:
        return [
            vllm.SamplingParams(
                temperature=1.0,
                max_tokens=args.tokens,
                min_tokens=args.tokens,
                logprobs=0,
                detokenize=False,
                seed=i if seeded else None,
            )  # fmt: skip
            for i in range(args.seqs)
        ]

    rates: dict[str, list[float]] = {"per-request seeds": [], "engine seed": []}
    llm.generate(prompts, params(True), use_tqdm=False)  # warm-up
    for _ in range(args.rounds):
        for name, seeded in (("per-request seeds", True), ("engine seed", False)):
            start = time.perf_counter()
            out = llm.generate(prompts, params(seeded), use_tqdm=False)
            seconds = time.perf_counter() - start
            rates[name].append(sum(len(o.outputs[0].token_ids) for o in out) / seconds)
    for name, r in rates.items():
        print(f"{name:>18}: {statistics.median(r):8.0f} tok/s (rounds: {', '.join(f'{x:.0f}' for x in r)})")
    ratio = statistics.median(rates["per-request seeds"]) / statistics.median(rates["engine seed"])
    print(f"per-request seeds / engine seed decode rate: {ratio:.3f} ({args.seqs} sequences x {args.tokens} tokens)")


if __name__ == "__main__":
    main()
