"""Packed attention at Qwen3-0.6B's attention shapes, forward + backward: one call per sequence against one varlen call.

    python benchmarks/attention_check.py --device cuda [--dtype bfloat16] [--iters 5] [--layers 28]
        [--sequences 32] [--max-extra 1024] [--seed 0] [--json OUT.json]
    python benchmarks/attention_check.py --device cpu --dtype float32 --sequences 2 --max-extra 16 --iters 1 --layers 2

No engine, no model: torch alone (issue #43's prepared device check). One packed row of ``--sequences`` sequences
of ``256 + floor(max_extra * u^2)`` tokens (u uniform: most short, a long tail), **drawn fresh every iteration** (seed
``--seed + i``; iteration 0 a warm-up, reported apart as ``first_s``); q ``[T, 16, 128]``, k / v ``[T, 8, 128]``
(Qwen3-0.6B's heads), causal per sequence; ``--layers`` calls on the row (28 layers in Qwen3-0.6B), one backward.

* ``per_sequence_cudnn_off`` / ``_on`` (CUDA; ``per_sequence_cpu`` on a CPU): ``engines/packed_attention.py``'s
  ``attention_forward`` through transformers' sdpa: the row as ``[1, H, T, D]`` (a transposed view of
  ``[T, H, D]``) split into per-sequence views, ``F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)``
  each, ``transpose(1, 2).contiguous()``, one ``torch.cat``. ``_on`` is torch's default (cuDNN first on sm90),
  ``_off`` sets ``torch.backends.cuda.enable_cudnn_sdp(False)``. Off runs first, on last, and the JSON is rewritten
  after every run: a run killed at its time limit keeps the cheap results.
* ``varlen``: ``torch.nn.attention.varlen.varlen_attn`` on the ``[T, H, D]`` row, one call per layer, K / V heads
  repeated to 16 (``repeat_interleave``: SDPA's GQA grouping), ``cu_seq`` int32 on the device, ``window_size=(-1,
  0)`` (``is_causal=True`` on torch 2.9). CUDA and bf16 only (a flash kernel); elsewhere the entry says why.
  ``varlen_vs_per_sequence``: max |diff| of its output and q / k / v gradients against the per-sequence path
  (torch's default backends) on a row no timed iteration has, with the reference's max |value| for scale.

Why: the audit's cause #1, cuDNN SDPA builds an execution plan per new shape (cached per exact sizes and strides,
``aten/src/ATen/native/cudnn/MHA.cpp``); in RL every length is new, so each call pays a build (tens of ms). Cause #2:
one call per sequence and layer (896 each way per update at the proof's shape) where one varlen call per layer will do.

How to read it: ``seconds`` per iteration (fwd + bwd of all layers, device-synchronized; ``forward_seconds`` the
forward). If #1 holds, ``per_sequence_cudnn_on`` takes seconds per iteration and ``_off`` tens of ms; ``varlen`` at
a few ms is #2's fix; its diffs should be bf16 rounding (~1e-2 of the scale). ``TORCH_CUDNN_SDPA_CACHE_DEBUG=1``
makes torch report cuDNN's cache hit rate where it has that switch. One summary line; ``--json`` every raw number.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # runnable as `python benchmarks/attention_check.py` from anywhere
    sys.path.insert(0, str(REPO))

HEADS, KV_HEADS, HEAD_DIM, BASE_LENGTH = 16, 8, 128, 256  # Qwen3-0.6B's attention; the shortest sequence
SUMMARY_PREFIX = "attention_check:"


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):  # bad input: one line naming the option, exit 2, no usage block
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = OneLineParser(prog="attention_check.py", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--iters", type=int, default=5, help="timed iterations, each on fresh lengths (after a warm-up)")
    p.add_argument("--layers", type=int, default=28, help="attention calls per iteration (Qwen3-0.6B: 28 layers)")
    p.add_argument("--sequences", type=int, default=32, help="sequences per packed row")
    p.add_argument("--max-extra", type=int, default=1024, help="lengths are 256 + max_extra * u^2 (lower it on a CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    for name, least in (("iters", 1), ("layers", 1), ("sequences", 1), ("max_extra", 0)):
        if getattr(args, name) < least:
            p.error(f"--{name.replace('_', '-')} must be >= {least}, got {getattr(args, name)}")
    from gspo_ascend.device import get_backend
    from gspo_ascend.errors import DeviceError

    try:
        args.backend = get_backend(args.device)  # the device contract: synchronize, the device's name
    except DeviceError:
        p.error(f"--device {args.device}: torch sees no CUDA device")
    return args


def lengths_of(args: argparse.Namespace, iteration: int) -> list[int]:
    rng = random.Random(args.seed + iteration)  # fresh lengths per iteration, the same in every run
    return [BASE_LENGTH + math.floor(args.max_extra * rng.random() ** 2) for _ in range(args.sequences)]


def row(args: argparse.Namespace, lengths: list[int], iteration: int):
    """Leaf q [T, H, D], k / v [T, KV, D] and an upstream gradient [T, H, D], seeded by the iteration."""
    g = torch.Generator().manual_seed(args.seed + iteration)
    total, dtype = sum(lengths), getattr(torch, args.dtype)
    shapes = ((total, HEADS, HEAD_DIM), (total, KV_HEADS, HEAD_DIM), (total, KV_HEADS, HEAD_DIM))
    q, k, v = (torch.randn(s, generator=g).to(args.device, dtype).requires_grad_() for s in shapes)
    return q, k, v, torch.randn(shapes[0], generator=g).to(args.device, dtype)


def per_sequence(q, k, v, lengths: list[int], cu, max_len: int):
    """packed_attention.attention_forward over transformers' sdpa: one SDPA call per sequence of the row."""
    query, key, value = (t.unsqueeze(0).transpose(1, 2) for t in (q, k, v))  # [1, H, T, D] views, as in the model
    outs = [
        F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True).transpose(1, 2).contiguous()
        for a, b, c in zip(*(t.split(lengths, dim=2) for t in (query, key, value)), strict=True)
    ]
    return torch.cat(outs, dim=1)[0]  # [T, H, D]


def varlen(q, k, v, lengths: list[int], cu, max_len: int):
    from torch.nn.attention.varlen import varlen_attn

    window = "window_size" in inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if window else {"is_causal": True}  # torch 2.9: is_causal
    k_rep, v_rep = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
    return varlen_attn(q, k_rep, v_rep, cu, cu, max_len, max_len, **causal)


def varlen_unavailable(args: argparse.Namespace) -> str | None:
    """Why varlen_attn cannot run here, or None."""
    try:
        from torch.nn.attention import varlen as _  # noqa: F401
    except ImportError:
        return f"varlen_attn: torch {torch.__version__} has no torch.nn.attention.varlen (2.9+)"
    if args.device != "cuda":
        return "varlen_attn: no CPU kernel (CUDA only)"
    if args.dtype != "bfloat16":
        return f"varlen_attn: a flash kernel, bf16 / fp16 only (--dtype {args.dtype})"
    return None


def iteration(args: argparse.Namespace, fn, index: int) -> tuple[float, float]:
    """(seconds fwd + bwd, seconds of the forward) of ``--layers`` calls of ``fn`` on iteration ``index``'s row."""
    lengths = lengths_of(args, index)
    q, k, v, grad = row(args, lengths, index)
    cu = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32).to(args.device)
    args.backend.synchronize()
    start = time.perf_counter()
    outs = [fn(q, k, v, lengths, cu, max(lengths)) for _ in range(args.layers)]
    args.backend.synchronize()
    forward = time.perf_counter() - start
    torch.autograd.backward(outs, [grad] * len(outs))
    args.backend.synchronize()
    return time.perf_counter() - start, forward


def timed_run(args: argparse.Namespace, fn, cudnn: bool | None = None) -> dict:
    """Iteration 0 (warm-up) then 1..iters, each on fresh lengths; cuDNN SDPA set as asked and restored after."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    if cudnn is not None:
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
    try:
        first, first_forward = iteration(args, fn, 0)
        pairs = [iteration(args, fn, i) for i in range(1, args.iters + 1)]
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
    seconds = [s for s, _ in pairs]
    return {"available": True, "reason": None, "cudnn_sdp": cudnn, "first_s": first, "first_forward_s": first_forward,
            "seconds": seconds, "forward_seconds": [f for _, f in pairs], "median_s": statistics.median(seconds),
            "mean_s": statistics.fmean(seconds)}  # fmt: skip


def compare(args: argparse.Namespace) -> dict:
    """One layer of a row of its own (index iters + 1: its shapes warm no timed iteration's plans) through both
    paths: max |diff| of the output and of q / k / v's gradients."""
    index = args.iters + 1
    lengths = lengths_of(args, index)
    cu = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32).to(args.device)
    found = []
    for fn in (per_sequence, varlen):
        q, k, v, grad = row(args, lengths, index)
        out = fn(q, k, v, lengths, cu, max(lengths))
        out.backward(grad)
        found.append({"out": out.detach().float(), "dq": q.grad.float(), "dk": k.grad.float(), "dv": v.grad.float()})
    ref, new = found
    return {
        "max_abs_diff": {name: (new[name] - ref[name]).abs().max().item() for name in ref},
        "reference_max_abs": {name: ref[name].abs().max().item() for name in ref},
    }


def measure(args: argparse.Namespace, save) -> dict:
    report = {"device": args.device, "dtype": args.dtype, "torch": torch.__version__,
              "device_name": args.backend.device_name(),
              "cudnn_version": torch.backends.cudnn.version() if args.device == "cuda" else None,
              "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "base_length": BASE_LENGTH,
              "max_extra": args.max_extra, "sequences": args.sequences, "layers": args.layers, "iters": args.iters,
              "seed": args.seed, "first_lengths": lengths_of(args, 0),
              "iteration_lengths": [lengths_of(args, i) for i in range(1, args.iters + 1)],
              "calls_per_iteration": {"per_sequence": args.sequences * args.layers, "varlen": args.layers},
              "runs": {}, "varlen_vs_per_sequence": None}  # fmt: skip
    report["iteration_tokens"] = [sum(n) for n in report["iteration_lengths"]]
    runs = report["runs"]
    if args.device == "cuda":  # off first, on last: see the module docstring
        runs["per_sequence_cudnn_off"] = timed_run(args, per_sequence, cudnn=False)
        save(report)
    else:
        runs["per_sequence_cpu"] = timed_run(args, per_sequence)
    run_varlen(args, report)
    save(report)
    if args.device == "cuda":
        runs["per_sequence_cudnn_on"] = timed_run(args, per_sequence, cudnn=True)
    report["ratios"] = ratios(runs)
    return report


def run_varlen(args: argparse.Namespace, report: dict) -> None:
    """The varlen run and its comparison, where they can run; a kernel that refuses this card or shape is a result
    (the reason recorded), not a crash."""
    why = varlen_unavailable(args)
    if why is None:
        try:
            report["runs"]["varlen"] = timed_run(args, varlen)
        except Exception as exc:
            why = f"varlen_attn failed: {first_line(exc)}"
    if why is not None:
        report["runs"]["varlen"] = {"available": False, "reason": why}
        return
    try:
        report["varlen_vs_per_sequence"] = compare(args)
    except Exception as exc:
        report["varlen_vs_per_sequence"] = {"error": first_line(exc)}


def first_line(exc: Exception) -> str:
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"


def ratios(runs: dict) -> dict:
    median = {name: run["median_s"] for name, run in runs.items() if run.get("available")}
    base = median.get("per_sequence_cudnn_off", median.get("per_sequence_cpu"))
    found = {}
    if "per_sequence_cudnn_on" in median and base:
        found["cudnn_on_over_off"] = median["per_sequence_cudnn_on"] / base
    if "varlen" in median and base:
        found["per_sequence_over_varlen"] = base / median["varlen"]
    return found


def summary_line(report: dict) -> str:
    parts = []
    for name, run in report["runs"].items():
        what = f"{run['median_s']:.4f} s (first {run['first_s']:.3f})" if run.get("available") else run["reason"]
        parts.append(f"{name} {what}")
    diff = report["varlen_vs_per_sequence"] or {}
    worst = f"; varlen max|diff| {max(diff['max_abs_diff'].values()):.3g}" if "max_abs_diff" in diff else ""
    return (
        f"{SUMMARY_PREFIX} {report['device_name']} {report['dtype']}, {report['sequences']} sequences x "
        f"{report['layers']} layers, fwd + bwd median per iteration of {report['iters']}: " + "; ".join(parts) + worst
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))

    def save(report: dict) -> None:  # after every run too: a run killed at its time limit keeps the earlier ones
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=1))

    report = measure(args, save)
    save(report)
    print(summary_line(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
