"""Forward + backward cost of each policy loss on CPU: 64 sequences x 8192 tokens, float32.

    PYTHONPATH=. python benchmarks/bench_losses.py [--batch 64] [--seq-len 8192] [--iters 20] [--threads N]

Inputs: old log-probs uniform in [-3, 0], log_prob = old + N(0, 1e-3) (requires grad), advantages N(0, 1),
response lengths uniform in [1, seq_len] (fixed seed), loss_agg_mode seq-mean-token-mean, clip 3e-4/4e-4.

Time: ``--iters`` rounds after one untimed warm-up pass per loss; each round times one forward+backward
of every loss in turn (interleaved, so load from other processes hits all losses alike), including the
metrics dict (a trainer computes it every micro-batch too). We print the best and the median time;
throughput, from the best time (the least disturbed on a shared box), is response tokens per second
(padding excluded) and padded positions per second.

Memory: each loss runs in its own fresh subprocess; after building the inputs we read the process peak
resident set size (resource.getrusage ru_maxrss), run one forward+backward, and report the increase of
ru_maxrss. That is the extra host memory the step needed at its peak (tensors plus allocator slack), at
page granularity; tracemalloc cannot see torch's allocations, and torch.profiler's memory events need
post-processing to yield a peak. The input tensors themselves (about 4 x 2 MiB) are not included.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

LOSSES = ("gspo", "gspo_token", "grpo")


def _inputs(batch: int, seq_len: int):
    import torch

    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, seq_len + 1, (batch,), generator=gen)
    mask = (torch.arange(seq_len)[None, :] < lengths[:, None]).to(torch.float32)
    old = -3 * torch.rand(batch, seq_len, generator=gen)
    log_prob = (old + 1e-3 * torch.randn(batch, seq_len, generator=gen)).requires_grad_(True)
    adv = torch.randn(batch, generator=gen)
    return log_prob, old, adv, mask


def _step(name: str, log_prob, old, adv, mask) -> None:
    from gspo_ascend.algorithms import get_policy_loss

    loss, _metrics = get_policy_loss(name)(log_prob, old, adv, mask, clip_low=3e-4, clip_high=4e-4)
    loss.backward()
    log_prob.grad = None


def _peak_memory_child(name: str, batch: int, seq_len: int) -> dict:
    """Runs in a fresh process: increase of peak RSS over one forward+backward (module docstring)."""
    inputs = _inputs(batch, seq_len)
    before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    _step(name, *inputs)
    return {"peak_rss_delta_mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before_kib) / 1024}


def _timings(batch: int, seq_len: int, iters: int, threads: int | None) -> dict[str, list[float]]:
    """Interleaved timing in one process: every round runs each loss once, so load from other processes
    on a shared machine hits all losses alike; we keep every sample and report best and median."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    inputs = _inputs(batch, seq_len)
    times: dict[str, list[float]] = {name: [] for name in LOSSES}
    for name in LOSSES:
        _step(name, *inputs)  # warm-up
    for _ in range(iters):
        for name in LOSSES:
            start = time.perf_counter()
            _step(name, *inputs)
            times[name].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--memory-child", choices=LOSSES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        print(json.dumps(_peak_memory_child(args.memory_child, args.batch, args.seq_len)))
        return
    import torch

    from gspo_ascend.algorithms import count_tokens_and_seqs

    mem = {}
    for name in LOSSES:
        cmd = [sys.executable, __file__, "--memory-child", name, "--batch", str(args.batch)]
        out = subprocess.run(cmd + ["--seq-len", str(args.seq_len)], check=True, capture_output=True, text=True)
        mem[name] = json.loads(out.stdout.strip().splitlines()[-1])["peak_rss_delta_mib"]
    times = _timings(args.batch, args.seq_len, args.iters, args.threads)
    n_tok = int(count_tokens_and_seqs(_inputs(args.batch, args.seq_len)[3])[0])
    best = {name: min(t) for name, t in times.items()}
    print(
        f"policy losses, forward+backward, {args.batch} x {args.seq_len} float32 on CPU "
        f"({torch.get_num_threads()} threads), {n_tok} response tokens, {args.iters} interleaved rounds"
    )
    print(f"{'loss':<11} {'best ms':>9} {'median ms':>10} {'Mtok/s':>8} {'Mpos/s':>8} {'peak RSS +MiB':>14}")
    for name in LOSSES:
        print(
            f"{name:<11} {1e3 * best[name]:>9.2f} {1e3 * statistics.median(times[name]):>10.2f} "
            f"{n_tok / best[name] / 1e6:>8.2f} {args.batch * args.seq_len / best[name] / 1e6:>8.2f} "
            f"{mem[name]:>14.1f}"
        )
    print(
        f"gspo vs grpo: best time x{best['gspo'] / best['grpo']:.2f}, "
        f"peak memory {mem['gspo']:.1f} vs {mem['grpo']:.1f} MiB (x{mem['gspo'] / max(mem['grpo'], 1e-9):.2f})"
    )


if __name__ == "__main__":
    main()
