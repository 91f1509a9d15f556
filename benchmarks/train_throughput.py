"""Training throughput of one train engine: tokens/s, model TFLOP/s, MFU and peak memory against the planner.

    PYTHONPATH=. python benchmarks/train_throughput.py --device cpu|cuda|npu --engine fsdp|megatron
        --shape qwen3-0.6b|small|tiny [--tokens-per-micro-batch 4096] [--steps N] [--json OUT.json]
        [--dtype bfloat16|float32] [--attn sdpa|eager|flash_attention_2] [--samples N]
        [--prompt-length N] [--max-response-length N] [--seed N] [--compile-layers auto|on|off]
        [--group-size G] [--shared-prefix auto|on|off]

What runs, in this one process (one rank, a world of 1: the engine makes its own one-process group):

1. A model of ``--shape`` written offline as a Hugging Face directory in a temporary folder, random init, saved in
   bf16: ``qwen3-0.6b`` is Qwen3-0.6B's published config (hidden 1024, 28 layers, 16 heads, 8 KV heads, head_dim
   128, intermediate 3072, vocab 151936, tied embeddings, rope theta 1e6, 40960 positions); ``tiny`` a 2-layer
   version for CPU CI; ``small`` the CPU benchmark's 22M model (``make-tiny-model --size small``'s sizes). No
   tokenizer: ``update`` consumes token ids, and the engines read only the config's pad id.
2. The real engine (``FSDPEngine`` / ``MegatronEngine``) from ``load_config(None, overrides)``, as
   ``gspo_ascend/selftest/training.py`` builds it: ``model.dtype`` (bf16 by default), packed micro-batches
   (``actor.use_remove_padding=true``) of at most ``--tokens-per-micro-batch`` real tokens
   (``actor.max_tokens_per_micro_batch``), one minibatch per update (one optimizer step).
3. Synthetic rollout batches (``SampleBatch``), a fresh one for every update: ``--samples`` random prompts of
   ``--prompt-length`` tokens (``--group-size`` G > 1: each prompt answered by G consecutive samples, a rollout's
   group of n; with ``actor.shared_prefix`` on, ``--shared-prefix``, a micro-batch computes such a prompt once and
   ``step_processed_tokens`` and the FLOPs count that row's tokens, not the samples'), responses of skewed lengths
   (``max_response * u^2``, u uniform: mean a third of the maximum, one sample at the maximum, as RL responses are:
   most short, a long tail), old log-probs at ``-ln V`` (a random-init model's level, so sequence ratios start near
   1) and random advantages. Update ``i`` (0 the warm-up,
   1..``--steps`` the timed ones) draws its batch with seed ``--seed + i``: the same length distribution, new
   lengths every step, as in RL, where no two micro-batches have the same shape. A benchmark that fed one batch to
   every step would hide every per-shape cost (a cuDNN attention plan built per sequence length, a recompile per
   new length: issue #43) in its warm-up.
4. ``engine.update(batch)`` (forward + backward + optimizer step) once as a warm-up, then ``--steps`` times, each
   between two device synchronizations (the device contract's ``synchronize``); the warm-up is timed the same way
   and reported apart (``first_update_s``: the first update of a fresh engine, allocator, kernels, optimizer state
   and per-shape costs together), never in the steady-state figures.
5. On a device, one more update (not timed) under the runtime's sync debug mode: ``host_syncs_per_update``, how
   often the host waited for the device, beside that update's ``host_syncs_micro_batches`` (it should not grow with
   them: issue #43); null on the host.

Engine differences that matter for the numbers:

* fsdp packs every micro-batch into one row (no padding) and applies the LM head only at positions that predict a
  response token (``logits_to_keep``).
* megatron packs each micro-batch into one THD row too (megatron-core's ``PackedSeqParams``; issue #43), but its
  output layer runs at every position.
* ``--padded`` (``actor.use_remove_padding=false``, both engines): the same first-fit-decreasing groups by real
  tokens (``actor.max_tokens_per_micro_batch`` counts prompt + response tokens, not padding), each right-padded to
  its longest sample, ``[b, S]``, so a pass computes ``b x S >=`` the budget's tokens. ``processed_tokens_per_step``
  reports the padded count; tokens/s and MFU count real tokens only.

FLOPs per token (model FLOPs, the MFU convention of Megatron-LM, Narayanan et al. 2021, arXiv 2104.04473, section
5.1, and PaLM, Chowdhery et al. 2022, arXiv 2204.02311, appendix B), forward + backward = 3 x the forward's 2 FLOPs
per multiply-add::

    flops/token = 6 N  +  6 V h  +  12 L H d C
      N  non-embedding parameters (every decoder layer + the final norm; no embedding, no LM head)
      V h  the LM head (vocabulary x hidden; counted once more even when tied to the embedding, as a matmul)
      L H d  layers x attention heads x head_dim: QK^T and AV, 2 x 2 H d FLOPs per (query, key) pair forward
      C  the mean causal context: sum_i L_i (L_i + 1) / 2 / sum_i L_i over the batch's sequences (token t of a
         sequence attends t + 1 keys)

Per step and over the timed steps: tokens differ from step to step, so every rate is a ratio of sums over the
timed steps, never a mean of per-step rates. ``tokens_per_second`` = the real tokens of all timed steps / their
seconds; a step's model FLOPs are ``flops/token x tokens`` with its own lengths (``step_flops``), and
``tflops_per_second`` = their sum / the same seconds. ``flops`` and ``flops_per_token`` are the formula over the
timed steps' sequences together (C over all of them), which makes ``flops_per_token x tokens_per_second`` that same
FLOP/s exactly. ``tokens_per_step``, ``processed_tokens_per_step`` and ``micro_batches_per_step`` are means over
the timed steps (their per-step values: ``step_tokens``, ``step_processed_tokens``, ``step_micro_batches``);
``mean_step_seconds`` and ``median_step_seconds`` the steady state.

PaLM counts the attention term with the full sequence length T (C = T); causal counting makes it about half, which
gives the conservative MFU. Megatron's formula (72 B s l h^2 (1 + s / 6h + V / 12 l h)) is the same three terms
for a GPT without GQA and with full-T attention. The convention counts the LM head at every token; the engines
compute it at fewer (fsdp: response positions only) or more (megatron: padding too) positions: model FLOPs, not
hardware FLOPs. MFU = model FLOP/s / the device's dense bf16 peak: 989.4 TFLOP/s for H100 SXM and H200 (NVIDIA's
datasheets: 1,979 with 2:4 sparsity); other devices print "no peak known" and report no MFU (CPU: none).

Memory: the device contract's ``memory_stats()["peak_allocated"]`` (``max_memory_allocated`` on CUDA / NPU) after the
timed steps. The contract has no reset of the peak counter, so it is the process's peak since start (engine build
included; on a device the update's activations and logits dominate). On the host (CPU, the emulated NPU) the
contract reports host RSS, which is not device memory and not what the planner predicts: ``peak_memory_bytes`` and
the ratio are null there. The prediction is ``gspo_ascend.doctor.planner.train_phase`` for the same config and the
model's ``config.json`` (``ModelSpec``); printed as the ratio measured / predicted.

Prints one summary line; ``--json`` writes every number (field list: :func:`report`).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # runnable as `python benchmarks/train_throughput.py` from anywhere
    sys.path.insert(0, str(REPO))

from gspo_ascend.errors import UserError  # noqa: E402

SUMMARY_PREFIX = "train_throughput:"  # the test finds the summary line by it
TEMPERATURE = 1.0
# dense bf16 peaks (TFLOP/s, NVIDIA's datasheets, half the "with sparsity" figure) by a substring of the device name,
# the first that matches: the PCIe and NVL cards run lower clocks than the SXM ones whose names carry no form factor
# (torch names the H100 SXM "NVIDIA H100 80GB HBM3"); "H200" before "H20" (the H20, our GPU target, is another card)
PEAK_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H200 NVL", 835.0),
    ("H100", 989.4),
    ("H200", 989.4),
    ("H20", 148.0),
)


@dataclass(frozen=True)
class Shape:
    config: dict[str, Any]  # transformers Qwen3Config keywords
    prompt_length: int
    max_response_length: int
    samples: int  # per step
    tokens_per_micro_batch: int  # default budget: several micro-batches per step at the default sizes


QWEN3_0_6B = {  # https://huggingface.co/Qwen/Qwen3-0.6B/blob/main/config.json
    "hidden_size": 1024,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 3072,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "max_position_embeddings": 40960,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "rms_norm_eps": 1e-6,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
TINY = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 512,
    "tie_word_embeddings": True,
    "max_position_embeddings": 1024,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "rms_norm_eps": 1e-6,
}
# the CPU benchmark's model (make-tiny-model --size small, gspo_ascend/tiny.py SIZES: 22M parameters, GQA 8 / 4,
# the tiny tokenizer's 512-token vocabulary), untied as the tiny models are, at its realistic batch (32 responses up to
# 512 tokens): the CPU before / after of issue #43
SMALL = {
    **TINY,
    "hidden_size": 512,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "intermediate_size": 1792,
    "tie_word_embeddings": False,
    "max_position_embeddings": 2048,
}
# qwen3-0.6b: 32 x (256 + ~341) ~ 19k tokens, ~5 micro-batches of 4096; tiny: ~1k tokens, ~4 micro-batches of 256;
# small: 32 x (64 + ~171) ~ 7.5k tokens, ~4 micro-batches of 2048
SHAPES = {
    "small": Shape(SMALL, 64, max_response_length=512, samples=32, tokens_per_micro_batch=2048),
    "qwen3-0.6b": Shape(QWEN3_0_6B, 256, max_response_length=1024, samples=32, tokens_per_micro_batch=4096),
    "tiny": Shape(TINY, 32, max_response_length=96, samples=16, tokens_per_micro_batch=256),
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="train_throughput.py", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda", "npu"))
    p.add_argument("--engine", default="fsdp", choices=("fsdp", "megatron"))
    p.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    p.add_argument("--tokens-per-micro-batch", type=int, default=None, help="default: the shape's (qwen3-0.6b 4096)")
    p.add_argument("--steps", type=int, default=5, help="timed updates after one warm-up, each on a fresh batch")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--attn", default=None, choices=("sdpa", "eager", "flash_attention_2"), help="fsdp only (sdpa)")
    p.add_argument("--samples", type=int, default=None, help="sequences per step (default: the shape's)")
    p.add_argument("--prompt-length", type=int, default=None)
    p.add_argument("--max-response-length", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--padded", action="store_true", help="right-padded micro-batches (actor.use_remove_padding=false)")
    p.add_argument(
        "--compile-layers", default="auto", choices=("auto", "on", "off"), help="fsdp only: actor.compile_layers"
    )
    p.add_argument("--group-size", type=int, default=1, help="samples per prompt (consecutive), as rollout.n")
    p.add_argument(
        "--shared-prefix", default="auto", choices=("auto", "on", "off"), help="actor.shared_prefix (fsdp engine)"
    )
    p.add_argument("--profile", action="store_true", help="after the timed steps, profile one more: top ops on stderr")
    args = p.parse_args(argv)
    if (
        args.attn is not None and args.engine == "megatron"
    ):  # megatron's attention is its layer spec's (docs/engines.md)
        p.error("--attn is the fsdp engine's (model.attn_implementation); megatron's attention is its layer spec's")
    if args.compile_layers != "auto" and args.engine == "megatron":
        p.error("--compile-layers is the fsdp engine's (actor.compile_layers)")
    if args.shared_prefix != "auto" and args.engine == "megatron":
        p.error("--shared-prefix is the fsdp engine's (actor.shared_prefix)")
    args.attn = args.attn or "sdpa"
    shape = SHAPES[args.shape]
    args.tokens_per_micro_batch = args.tokens_per_micro_batch or shape.tokens_per_micro_batch
    args.samples = args.samples or shape.samples
    args.prompt_length = args.prompt_length or shape.prompt_length
    args.max_response_length = args.max_response_length or shape.max_response_length
    for name in ("steps", "tokens_per_micro_batch", "samples", "prompt_length", "max_response_length", "group_size"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    if args.samples % args.group_size:
        p.error(f"--samples ({args.samples}) must be a multiple of --group-size ({args.group_size})")
    return args


# ----------------------------------------------------------------------------------------------- inputs


def write_model(shape: str, out: Path, seed: int) -> Path:
    """A random-init Qwen3ForCausalLM of ``shape`` saved in bf16 under ``out`` (no tokenizer: see the docstring)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(**SHAPES[shape].config)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)  # built in bf16: half the host memory
    model.save_pretrained(out)
    return out


def synthetic_batch(samples: int, prompt_length: int, max_response: int, vocab: int, seed: int, group: int = 1):
    """A rollout-like ``SampleBatch``: random token ids, skewed response lengths (see the module docstring); each
    prompt answered by ``group`` consecutive samples."""
    import torch

    from gspo_ascend.engines.base import SampleBatch

    g = torch.Generator().manual_seed(seed)
    distinct = torch.randint(0, vocab, (samples // group, prompt_length), generator=g).tolist()
    prompts = [p for p in distinct for _ in range(group)]
    lengths = (max_response * torch.rand(samples, generator=g) ** 2).ceil().clamp(1, max_response).long()
    lengths[0] = max_response  # the tail: one response at the limit
    mask = (torch.arange(max_response)[None] < lengths[:, None]).float()
    responses = torch.randint(0, vocab, (samples, max_response), generator=g) * mask.long()
    old = torch.full((samples, max_response), -math.log(vocab)) * mask
    advantages = torch.randn(samples, generator=g)
    return SampleBatch(prompts, responses, mask, old_log_probs=old, advantages=advantages)


def synthetic_batches(args: argparse.Namespace, vocab: int, count: int) -> list:
    """``count`` batches of the run's sizes, batch ``i`` drawn with seed ``args.seed + i`` (0: the warm-up's): one
    length distribution, new lengths every update (see the module docstring)."""
    sizes = (args.samples, args.prompt_length, args.max_response_length, vocab)
    return [synthetic_batch(*sizes, seed=args.seed + i, group=args.group_size) for i in range(count)]


def sequence_lengths(batch) -> list[int]:
    """Prompt + response tokens of every sample (padding excluded)."""
    return [len(p) + int(n) for p, n in zip(batch.prompt_ids, batch.response_lengths.tolist(), strict=True)]


def overrides(args: argparse.Namespace, model_dir: Path) -> list[str]:
    """The config of the run (also what the planner is asked about)."""
    return [
        f"model.path={model_dir}",
        f"model.dtype={args.dtype}",
        f"model.attn_implementation={args.attn}",
        f"trainer.device={args.device}",
        f"trainer.seed={args.seed}",
        f"actor.engine={args.engine}",
        f"actor.compile_layers={args.compile_layers}",
        *([f"actor.shared_prefix={args.shared_prefix}"] if args.engine == "fsdp" else []),
        f"actor.use_remove_padding={str(not args.padded).lower()}",
        f"actor.max_tokens_per_micro_batch={args.tokens_per_micro_batch}",
        f"data.train_batch_size={args.samples}",
        f"data.max_prompt_length={args.prompt_length}",
        f"data.max_response_length={args.max_response_length}",
        "rollout.n=1",
        "algorithm.minibatches_per_rollout=1",  # one optimizer step per update: a step is one update
        "actor.lr=1e-6",
        "algorithm.clip_ratio_low=0.2",  # wide enough that the synthetic ratios are not clipped (a full gradient)
        "algorithm.clip_ratio_high=0.28",
    ]


# ----------------------------------------------------------------------------------------------- arithmetic


def model_flops(spec, lengths: list[int]) -> dict[str, float]:
    """Model FLOPs per token of one update over sequences of ``lengths`` (formula: the module docstring)."""
    non_embedding = spec.total_params - spec.embedding_params * (1 if spec.tied else 2)
    lm_head = spec.vocab * spec.hidden
    tokens = sum(lengths)
    context = sum(n * (n + 1) / 2 for n in lengths) / tokens  # mean keys per query, causal
    attention = 12 * spec.layers * spec.heads * spec.head_dim * context
    return {
        "non_embedding_params": non_embedding,
        "lm_head_params": lm_head,
        "mean_causal_context": context,
        "dense": 6 * non_embedding,
        "lm_head": 6 * lm_head,
        "attention": attention,
        "per_token": 6 * non_embedding + 6 * lm_head + attention,
    }


def processed_tokens(batch, padded: bool, budget: int, shared: bool = False) -> tuple[int, int]:
    """(tokens the passes compute, micro-batches): the engines' own plan; padded, each micro-batch to its longest;
    ``shared`` (actor.shared_prefix ran), each micro-batch's shared-prefix row."""
    from gspo_ascend.engines.microbatch import plan_micro_batches, sample_tokens, shared_row_tokens

    plan = plan_micro_batches(batch, max_tokens=budget, shared_prefix=shared)
    sizes = sample_tokens(batch)
    if shared:
        return sum(shared_row_tokens(batch.select(g)) for g in plan.groups), len(plan)
    if not padded:  # packed rows: exactly the samples' tokens
        return sum(sizes), len(plan)
    return sum(len(g) * max(sizes[i] for i in g) for g in plan.groups), len(plan)


def attention_name(engine: str, attn: str, backend) -> str:
    """Which attention ran: megatron's depends on the device (see docs/engines.md), not on model.attn_implementation."""
    if engine == "fsdp":
        return attn
    from gspo_ascend.engines import megatron_bridge, mindspeed_setup

    if mindspeed_setup.enabled(backend):
        return "megatron local spec under MindSpeed (npu_fusion_attention)"
    if backend.name == "cuda" and megatron_bridge.transformer_engine_available():
        return "megatron TE spec"
    return "megatron local spec (SDPACoreAttention: fused SDPA, per sequence when packed; varlen on CUDA)"


def peak_tflops(name: str) -> float | None:
    return next((peak for key, peak in PEAK_TFLOPS if key in name), None)


# ----------------------------------------------------------------------------------------------- the run


def build_engine(cfg, backend, model_dir: Path):
    """As gspo_ascend/selftest/training.py's ``_build``; the engine makes a one-process group when none exists."""
    if cfg.actor.engine == "fsdp":
        from gspo_ascend.engines.fsdp import FSDPEngine

        return FSDPEngine(cfg, backend, str(model_dir))
    from gspo_ascend.engines.megatron import MegatronEngine

    return MegatronEngine(cfg, backend, str(model_dir))


def timed_update(engine, batch, backend) -> tuple[float, dict[str, float]]:
    """One update between two device synchronizations: (seconds, the engine's metrics)."""
    backend.synchronize()
    start = time.perf_counter()
    metrics = engine.update(batch, TEMPERATURE)
    backend.synchronize()
    return time.perf_counter() - start, metrics


def time_updates(engine, batches: list, backend) -> tuple[float, list[float], list[dict[str, float]]]:
    """The first update (``batches[0]``: the warm-up, allocator, kernels / autotuning, optimizer state) and one timed
    update per further batch, each a fresh one: (first seconds, the timed steps' seconds, their metrics)."""
    first, _ = timed_update(engine, batches[0], backend)
    seconds, metrics = [], []
    for batch in batches[1:]:
        elapsed, step_metrics = timed_update(engine, batch, backend)
        seconds.append(elapsed)
        metrics.append(step_metrics)
    return first, seconds, metrics


def profile_update(engine, batch, backend) -> None:
    """One more update under torch.profiler (not timed), on a fresh batch like every timed step's: the ops that take
    the time, on stderr. Where a step's time goes on a device is the question a low MFU raises; a host-side gap shows
    as CPU time without device time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if backend.name == "cuda" else [])
    with profile(activities=activities) as prof:
        engine.update(batch, TEMPERATURE)
        backend.synchronize()
    sort = "self_cuda_time_total" if backend.name == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=60)
    print(f"profile of one update (torch {torch.__version__}), by {sort}:\n{table}", file=sys.stderr, flush=True)


def count_syncs(engine, batch, backend) -> dict[str, Any]:
    """One more update (not timed) under the device runtime's sync debug mode: how often the host waited for the
    device, against the update's micro-batches (issue #43: it should not grow with them). Nulls on the host, where
    there is nothing to count (and no extra update is run)."""
    if backend.torch_device_type == "cpu":
        return {"host_syncs_per_update": None, "host_syncs_micro_batches": None, "host_syncs_first_messages": None}
    with backend.counting_syncs() as seen:
        metrics = engine.update(batch, TEMPERATURE)
    return {
        "host_syncs_per_update": None if seen is None else len(seen),
        "host_syncs_micro_batches": int(metrics.get("actor/micro_batches", 0)),
        "host_syncs_first_messages": None if seen is None else sorted(set(seen))[:5],
    }


def predicted_memory(cfg, model_dir: Path) -> tuple[int, dict[str, int]]:
    from gspo_ascend.doctor.modelspec import load_spec
    from gspo_ascend.doctor.planner import train_phase

    phase = train_phase(cfg, load_spec(str(model_dir)))
    return phase.total, dict(phase.parts)


def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Build, time and measure; the report's raw numbers."""
    from gspo_ascend.config import load_config
    from gspo_ascend.device import get_backend
    from gspo_ascend.doctor.modelspec import load_spec

    backend = get_backend(args.device)  # before the model: a bad --device fails in one line, not after minutes
    model_dir = write_model(args.shape, tmp / args.shape, args.seed)
    over = overrides(args, model_dir)
    cfg = load_config(None, over)
    spec = load_spec(str(model_dir))
    # the warm-up's, one per timed step, and the profiled update's (seed + steps + 1): all fresh
    batches = synthetic_batches(args, spec.vocab, args.steps + 1 + args.profile)
    predicted, parts = predicted_memory(cfg, model_dir)
    engine = build_engine(cfg, backend, model_dir)
    try:
        first, seconds, metrics = time_updates(engine, batches[: args.steps + 1], backend)
        syncs = count_syncs(engine, batches[args.steps], backend)  # the last timed batch again: counted, not timed
        if args.profile:
            profile_update(engine, batches[-1], backend)
        on_device = backend.torch_device_type != "cpu"  # host RSS is not device memory (module docstring)
        peak = backend.memory_stats()["peak_allocated"] if on_device else None
        # modules that ran compiled (actor.compile_layers; fsdp only): 0 where eager, so no run claims it silently
        from gspo_ascend.engines.compiled_layers import compiled_count

        compiled = compiled_count(getattr(engine, "compiled_layers", []))
        shared = bool(getattr(engine, "shared_prefix", False))  # actor.shared_prefix as the engine resolved it
    finally:
        engine.close()
    return {
        "backend": backend,
        "batches": batches[: args.steps + 1],  # [0]: the warm-up's
        "spec": spec,
        "overrides": [o for o in over if not o.startswith("model.path=")],  # the temporary path means nothing later
        "first_seconds": first,
        "seconds": seconds,
        "metrics": metrics,
        "peak": peak,
        "predicted": predicted,
        "predicted_parts": parts,
        "syncs": syncs,
        "compiled_layers": compiled,
        "shared_prefix": shared,
    }


def report(args: argparse.Namespace, raw: dict[str, Any]) -> dict[str, Any]:
    """The JSON: what ran, tokens, time, FLOPs, MFU, memory (null where not measurable, see the docstring). Every
    timed step had its own batch: per-step lists (``step_*``), means over them, rates as ratios of sums."""
    backend, seconds, spec = raw["backend"], raw["seconds"], raw["spec"]
    warmup, *timed = raw["batches"]
    lengths = [sequence_lengths(b) for b in timed]
    tokens = [sum(n) for n in lengths]
    shared = raw.get("shared_prefix", False)
    pairs = [processed_tokens(b, args.padded, args.tokens_per_micro_batch, shared) for b in timed]
    processed, planned = [p for p, _ in pairs], [n for _, n in pairs]
    engine_counts = [int(m.get("actor/micro_batches", p)) for m, p in zip(raw["metrics"], planned, strict=True)]
    # model FLOPs of the tokens computed: a shared prompt counts once (the per-token rate of the samples' lengths)
    computed = processed if shared else tokens
    step_flops = [model_flops(spec, n)["per_token"] * t for n, t in zip(lengths, computed, strict=True)]
    flops = model_flops(spec, [n for step in lengths for n in step])  # over all timed steps: see the docstring
    tokens_per_s = sum(tokens) / sum(seconds)
    tflops = sum(step_flops) / sum(seconds) / 1e12  # unshared: == flops["per_token"] * tokens_per_s / 1e12
    name = backend.device_name()
    peak = peak_tflops(name) if backend.torch_device_type != "cpu" else None
    ratio = raw["peak"] / raw["predicted"] if raw["peak"] is not None and raw["predicted"] else None
    return {
        "shape": args.shape,
        "engine": args.engine,
        "device": backend.name,
        "device_name": name,
        "dtype": args.dtype,
        "attention": attention_name(args.engine, args.attn, backend),
        "compiled_layers": raw["compiled_layers"],
        "group_size": args.group_size,
        "shared_prefix": shared,
        "tokens_per_micro_batch": args.tokens_per_micro_batch,
        "samples_per_step": len(timed[0]),
        "batch_seeds": [args.seed + i for i in range(len(raw["batches"]))],  # [0]: the warm-up's
        "step_sequence_lengths": lengths,
        "step_tokens": tokens,
        "step_processed_tokens": processed,
        "step_micro_batches": engine_counts,
        "step_planned_micro_batches": planned,
        "tokens_per_step": statistics.fmean(tokens),
        "processed_tokens_per_step": statistics.fmean(processed),
        "micro_batches_per_step": statistics.fmean(engine_counts),
        "planned_micro_batches": statistics.fmean(planned),
        "warmup_steps": 1,
        "first_update_s": raw["first_seconds"],
        "first_update_tokens": sum(sequence_lengths(warmup)),
        "first_update_sequence_lengths": sequence_lengths(warmup),
        "steps": len(seconds),
        "step_seconds": seconds,
        "mean_step_seconds": statistics.fmean(seconds),
        "median_step_seconds": statistics.median(seconds),
        "first_update_over_median": raw["first_seconds"] / statistics.median(seconds),
        "tokens_per_second": tokens_per_s,
        "step_flops": step_flops,
        "flops": flops,
        "flops_per_token": flops["per_token"],
        "tflops_per_second": tflops,
        "peak_tflops": peak,
        "mfu": tflops / peak if peak else None,
        "peak_memory_bytes": raw["peak"],
        "predicted_memory_bytes": raw["predicted"],
        "predicted_memory_parts": raw["predicted_parts"],
        **raw["syncs"],
        "memory_ratio": ratio,
        "config_overrides": raw["overrides"],
        "last_step_metrics": raw["metrics"][-1],
    }


def summary_line(r: dict[str, Any]) -> str:
    gib = 2**30
    mfu = f"MFU {r['mfu']:.1%}" if r["mfu"] is not None else "MFU n/a"
    predicted = f"planner {r['predicted_memory_bytes'] / gib:.3g} GiB"
    if r["peak_memory_bytes"] is None:
        memory = f"peak device memory n/a on the host ({predicted})"
    else:
        memory = f"peak {r['peak_memory_bytes'] / gib:.3g} GiB / {predicted} = {r['memory_ratio']:.2f}"
    return (
        f"{SUMMARY_PREFIX} {r['shape']} {r['engine']} on {r['device_name']} ({r['dtype']}): "
        f"{r['tokens_per_step']:,.0f} tokens/step ({r['processed_tokens_per_step']:,.0f} computed, "
        f"{r['micro_batches_per_step']:.3g} micro-batches; means of {r['steps']} fresh batches), "
        f"first update {r['first_update_s']:.3f} s, then {r['mean_step_seconds']:.3f} s/step (mean, as tokens/s; "
        f"median {r['median_step_seconds']:.3f}), {r['tokens_per_second']:,.0f} tokens/s, "
        f"{r['flops_per_token'] / 1e9:.4g} GFLOP/token, "
        f"{r['tflops_per_second']:.4g} TFLOP/s, {mfu}; {memory}"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        with tempfile.TemporaryDirectory(prefix="gspo-throughput-") as tmp:
            raw = run(args, Path(tmp))
    except UserError as exc:  # ConfigError and DeviceError are UserErrors: one line, exit 2
        print(f"error: {exc}", file=sys.stderr)
        return 2
    result = report(args, raw)
    if result["device"] != "cpu" and result["peak_tflops"] is None:
        print(f"no peak known for '{result['device_name']}': MFU omitted")
    print(summary_line(result), flush=True)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
