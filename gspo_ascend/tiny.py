"""The embedded tiny models (dense Qwen3 and Qwen3-MoE) and the synthetic arithmetic task they are warmed on.

Built locally, deterministically (the same bytes on any x86-64 CPU, below), in about two minutes on one CPU core, so
the CPU demo and CI never touch a model hub:

1. a byte-level BPE tokenizer (digits split one per token, like Qwen's) trained in-process on the task's text,
   wrapped as a transformers fast tokenizer with a Qwen-style ``<|im_start|>role ... <|im_end|>`` chat template;
2. a Qwen3ForCausalLM / Qwen3MoeForCausalLM from a config (head_dim 64: vLLM's CPU attention rejects 16);
3. a two-phase supervised warm start on "What is 7 + 5?" -> "7 + 5 = 12. \\boxed{12}":
   a clean phase teaches format and arithmetic, then a *noisy* phase, whose answers are right with
   probability ``noisy_p_correct`` and otherwise off by 1-3, flattens the answer distribution. The model
   keeps the right answer near the centre of what it samples, but samples it rarely: temperature-1
   accuracy starts low but non-zero (~0.2-0.3), which is the regime where GSPO visibly raises it.

How we differ from verl: verl's CPU/e2e tests download Qwen2.5-0.5B (and a tokenizer) from the hub and train
on gsm8k; a hub-free run needs a model whose reward is not stuck at 0 (nothing to learn from) or 1 (nothing to
learn), small enough for CPU rollouts. The noisy second phase is what places it there, by design rather than
by stopping the first phase at a lucky step.

``--device`` (default cpu) runs the warm start and the accuracy eval on an accelerator through the device contract:
the "small" size takes ~40 min on two CPU cores, seconds on a GPU. The weights are initialised on the CPU either way
and saved from it; a device's kernels round differently, so its model is another model than the CPU one, and the
manifest records where it was built (:func:`ensure_tiny_model` tells them apart).

A CPU build is the same bytes on any x86-64 CPU (issue #40: a fresh 2-core box built another model, 0.31 instead
of 0.44 at step 0). What made it differ is what picks kernels by CPU: ATen's vectorised kernels (and Sleef's
exp/log) are dispatched per instruction set (AVX-512, AVX2 or the default), MKL's sgemm picks a code path per CPU
(and vendor), and a reduction split over threads sums in another order. The build therefore runs in a child
process started with :data:`PORTABLE_CPU_ENV` (ATen's ``default`` kernels, MKL's ``COMPATIBLE`` path, one
thread), which both libraries read once, at their first use, so the parent (which has used torch) cannot switch
them. Measured on a 2-core AMD EPYC: the default recipe's bytes were different under ``ATEN_CPU_CAPABILITY=avx2``
than with the machine's AVX-512, and identical with the pinning whatever the parent's capability, thread count or
glibc's libm variant (``GLIBC_TUNABLES`` masking FMA/AVX2). It costs about twice the CPU time (119 s against 58 s
for the warm start on one thread; docs/trainer.md). Test-shrunk models
(TinySpec overrides) build in-process as before unless ``portable=True``: nothing promises their bytes across
CPUs, and the child's imports would cost CI seconds per build.

Why one file over 600 lines: it is the recipe that :data:`RECIPE_VERSION` versions, what decides a built model's
bytes (the task's text, the tokenizer trained on it, the config, the warm start and the portable child that runs
it), with the manifest that records them and the command that builds them; a change to any part of the recipe must
bump the version, so it is kept where one reading sees all of it. The tool-use task is :mod:`.tiny_tools`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from .errors import UserError

RECIPE_VERSION = 3  # bump when the recipe changes: ensure_tiny_model() then rebuilds cached models
# 2: the tokenizer lists model_input_names (transformers 4.x would add token_type_ids); weights unchanged
# 3: CPU builds of the presets run with PORTABLE_CPU_ENV: the same bytes on any x86-64 CPU (other weights than 2's)

# What a CPU build's process is started with, so that its kernels are the same on every x86-64 CPU (module docstring).
# ATen and MKL read these once per process, before their first use; "default" is the capability every x86-64 CPU
# has (avx2 or avx512 would need a CPU that has them), COMPATIBLE the MKL path documented to give the
# same results on Intel and non-Intel CPUs, and one thread fixes the order of every reduction.
PORTABLE_CPU_ENV = {
    "ATEN_CPU_CAPABILITY": "default",
    "MKL_CBWR": "COMPATIBLE",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
# what torch.backends.cpu.get_cpu_capability() calls the "default" capability (torch 2.7 says NO AVX)
DEFAULT_CPU_CAPABILITY = ("DEFAULT", "NO AVX")
_CHILD = False  # True in the portable build's child process: it builds in-process whatever it finds

SYNTHETIC_DATA_SOURCE = "gspo_ascend/synthetic_arithmetic"
# 2: "train" and "test" draw disjoint problems (a held-out quarter); the embedded data directory is named after it
SYNTHETIC_VERSION = 2
HELD_OUT_FRACTION = 0.25
MANIFEST = "gspo_tiny_manifest.json"
PAD, BOS_CHAT, EOS = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# Qwen2.5/Qwen3's chat layout without tools or <think> blocks; `add_generation_prompt` opens the assistant turn.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
MODEL_INPUT_NAMES = ["input_ids", "attention_mask"]  # what a Qwen3 forward takes (no token_type_ids)
QUESTION = "What is {a} {op} {b}? Put the final answer in \\boxed{{}}."


@dataclass(frozen=True)
class TinySpec:
    """Sizes and warm-start recipe. Defaults are the shipped models; tests shrink them."""

    moe: bool = False
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 2
    num_kv_heads: int = 1
    head_dim: int = 64
    intermediate_size: int = 256
    num_experts: int = 4
    experts_per_token: int = 2
    moe_intermediate_size: int = 128
    vocab_size: int = 512
    max_position_embeddings: int = 1024
    max_operand: int = 9
    sft_steps: int = 300  # clean phase
    noisy_sft_steps: int = 60  # flattening phase
    noisy_p_correct: float = 0.25
    batch_size: int = 64
    lr: float = 3e-3
    noisy_lr: float = 3e-4
    eval_prompts: int = 128
    eval_max_new_tokens: int = 32
    # "small" size: after the answer, a geometric number of "Check:" lines (this mean; 0 = none, the shipped tiny
    # models), capped at max_check_lines, so sampled responses have a long right-skewed length distribution
    check_lines_mean: float = 0.0
    max_check_lines: int = 0
    # the "tools" preset (tiny_tools.py): > 0 = the two-digit multiplication task, this share of the warm start's
    # examples calling the calculator (Qwen3's <tool_call> format); 0 = the arithmetic task above
    tool_fraction: float = 0.0


# Named sizes of make-tiny-model (TinySpec overrides). "small" is the benchmark's model (benchmarks/README.md):
# ~22M parameters, GQA 8/4 heads, trained to check its answer a geometric number of times (mean 6 lines, ~11 tokens
# each), so temperature-1 samples run from ~20 tokens to hundreds with a long tail; its warm start packs each batch
# into one row (no padding; the tiny recipe keeps its padded batches, so cached tiny models stay valid).
SIZES: dict[str, dict] = {
    "tiny": {},
    # the tool-use demo (tiny_tools.py, docs/agent.md): the tiny sizes, a longer context for trajectories
    "tools": dict(tool_fraction=0.3, sft_steps=300, noisy_sft_steps=0, max_position_embeddings=1024),
    "small": dict(
        hidden_size=512,
        num_layers=6,
        num_heads=8,
        num_kv_heads=4,
        intermediate_size=1792,
        max_position_embeddings=2048,
        sft_steps=100,
        noisy_sft_steps=20,
        batch_size=32,
        lr=1.5e-3,
        noisy_lr=3e-4,
        eval_prompts=64,
        eval_max_new_tokens=512,
        check_lines_mean=6.0,
        max_check_lines=48,
    ),
}


# ----------------------------------------------------------------------------------------------- the task


def _problem(rng: random.Random, max_operand: int) -> tuple[int, str, int, int]:
    op = rng.choice("+-")
    a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
    if op == "-" and b > a:  # keep results >= 0: one answer format, no sign token to learn
        a, b = b, a
    return a, op, b, a + b if op == "+" else a - b


def problem_space(max_operand: int = 9) -> list[tuple[int, str, int]]:
    """Every distinct problem ``(a, op, b)`` of the task: a + b, and a - b with a >= b (results stay >= 0)."""
    plus = [(a, "+", b) for a in range(max_operand + 1) for b in range(max_operand + 1)]
    return plus + [(a, "-", b) for a in range(max_operand + 1) for b in range(a + 1)]


def held_out_problems(max_operand: int = 9) -> frozenset[tuple[int, str, int]]:
    """The problems RL never trains on: a fixed quarter of :func:`problem_space` (the same for every seed, so runs
    with different seeds validate on the same problems). The "train" split draws only the others, "test" only these."""
    space = problem_space(max_operand)
    rng = random.Random(f"gspo-ascend:held-out:{max_operand}")
    return frozenset(rng.sample(space, round(len(space) * HELD_OUT_FRACTION)))


def synthetic_arithmetic(
    n: int, seed: int = 0, *, split: str = "train", max_operand: int = 9, distinct: bool = False
) -> list[dict]:
    """``n`` records ``{"prompt": [chat messages], "answer": "12", "a", "op", "b"}`` of "What is a +/- b?".

    ``split`` names an independent random stream: "sft" (the warm start), "train" (RL prompts), "test". The
    problem space is small (0..max_operand, + and -: 155 problems at 9), so "train" and "test" draw from disjoint
    sets of problems (:func:`held_out_problems`): validation accuracy on "test" measures prompts RL never saw.
    Any other split (the warm start's) draws from every problem, so the warm start has seen the held-out problems
    with its noisy labels: what RL can show there is that sharpening the arithmetic it half-knows carries over.
    ``distinct``: no problem twice, so at most as many records as the split has problems (an evaluation set:
    a repeat would only re-weight a problem, and cost a greedy validation time for the same answer).
    """
    rng = random.Random(f"gspo-ascend:{seed}:{split}")  # str seeds hash with sha512: stable across runs
    held_out = held_out_problems(max_operand) if split in ("train", "test") else None
    available = len(problem_space(max_operand))
    if held_out is not None:
        available = len(held_out) if split == "test" else available - len(held_out)
    records, seen = [], set()
    while len(records) < (min(n, available) if distinct else n):
        a, op, b, c = _problem(rng, max_operand)
        if held_out is not None and ((a, op, b) in held_out) != (split == "test"):
            continue  # rejection keeps each split's draw distribution that of the whole task, restricted
        if distinct and (a, op, b) in seen:
            continue
        seen.add((a, op, b))
        content = QUESTION.format(a=a, op=op, b=b)
        records.append({"prompt": [{"role": "user", "content": content}], "answer": str(c), "a": a, "op": op, "b": b})
    return records


def solution_text(a: int, op: str, b: int, answer: int, checks: int = 0) -> str:
    check = f" Check: {a} {op} {b} = {answer}." * checks
    return f"{a} {op} {b} = {answer}.{check} \\boxed{{{answer}}}"


def check_lines(rng: random.Random, mean: float, cap: int) -> int:
    """A geometric number of check lines (P(k) = (1 - q) q^k, mean ``mean``), at most ``cap``; 0 when mean is 0."""
    if mean <= 0:
        return 0  # draws nothing: the tiny recipe's random streams are unchanged
    k, go_on = 0, mean / (mean + 1.0)
    while k < cap and rng.random() < go_on:
        k += 1
    return k


def _noisy_answer(rng: random.Random, correct: int, p_correct: float) -> int:
    if rng.random() < p_correct:
        return correct
    delta = rng.choice((-3, -2, -1, 1, 2, 3))
    return correct + delta if correct + delta >= 0 else correct - delta


# ----------------------------------------------------------------------------------------------- tokenizer


def _corpus(seed: int, max_operand: int, checks: bool = False) -> list[str]:
    from .rewards.math_answer import INSTRUCTION

    records = synthetic_arithmetic(2000, seed, split="sft", max_operand=max_operand)
    texts = [
        r["prompt"][0]["content"] + "\n" + solution_text(r["a"], r["op"], r["b"], int(r["answer"])) for r in records
    ]
    if checks:  # the "small" size's check lines get their own merges (~11 tokens a line instead of ~15)
        texts += [solution_text(r["a"], r["op"], r["b"], int(r["answer"]), checks=2) for r in records[:500]]
    # A little general math prose so the vocabulary is not only the task's dozen words.
    texts += [INSTRUCTION, "The answer is the sum of the two numbers. Let us think step by step: add, then check."]
    return texts


def build_tokenizer(
    seed: int = 0, vocab_size: int = 512, max_operand: int = 9, checks: bool = False, tools: bool = False
):
    """A byte-level BPE tokenizer trained here (no download), as a transformers fast tokenizer. ``tools``: the
    multiplication task's text and Qwen3's two tool-call tokens (tiny_tools.py)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from . import tiny_tools

    tok = Tokenizer(models.BPE())
    # Digits one per token (as Qwen's tokenizer does), then GPT-2 style byte-level: every string round-trips.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS_CHAT, EOS, *((tiny_tools.TOOL_OPEN, tiny_tools.TOOL_CLOSE) if tools else ())],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(tiny_tools.corpus(seed) if tools else _corpus(seed, max_operand, checks), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
        model_max_length=1024,
        # transformers 4.x's PreTrainedTokenizerFast also returns token_type_ids, which Qwen3's generate() rejects
        model_input_names=list(MODEL_INPUT_NAMES),
    )


# ----------------------------------------------------------------------------------------------- model


def tiny_config(spec: TinySpec, tokenizer):
    """The transformers config of the tiny model (Qwen3 or Qwen3-MoE) for ``spec``."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    if len(tokenizer) > spec.vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens, more than vocab_size={spec.vocab_size}")
    common = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,  # as Qwen3-30B-A3B; tied embeddings complicate pipeline-parallel layouts
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    if not spec.moe:
        return Qwen3Config(**common)
    return Qwen3MoeConfig(
        **common,
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.experts_per_token,
        moe_intermediate_size=spec.moe_intermediate_size,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )


def build_model(spec: TinySpec, tokenizer, seed: int):
    """Freshly initialised weights; the same ``seed`` gives bitwise-identical weights."""
    import torch
    from transformers import Qwen3ForCausalLM, Qwen3MoeForCausalLM

    config = tiny_config(spec, tokenizer)
    torch.manual_seed(seed)
    model = (Qwen3MoeForCausalLM if spec.moe else Qwen3ForCausalLM)(config)
    return model.float()


# ----------------------------------------------------------------------------------------------- warm start


def encode_example(tokenizer, record: dict, answer: int, checks: int = 0) -> tuple[list[int], list[int]]:
    """(prompt ids, response ids + eos). Encoded apart so no BPE merge crosses the prompt/response boundary."""
    prompt = tokenizer.apply_chat_template(record["prompt"], add_generation_prompt=True, tokenize=False)
    response = solution_text(record["a"], record["op"], record["b"], answer, checks)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    return prompt_ids, tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def sft_examples(tokenizer, spec: TinySpec, seed: int, steps: int, p_correct: float, stream: str) -> list:
    rng = random.Random(f"gspo-ascend:{seed}:{stream}:labels")
    lines = random.Random(f"gspo-ascend:{seed}:{stream}:checks")
    records = synthetic_arithmetic(steps * spec.batch_size, seed, split=stream, max_operand=spec.max_operand)
    examples = [
        encode_example(
            tokenizer,
            r,
            _noisy_answer(rng, int(r["answer"]), p_correct),
            check_lines(lines, spec.check_lines_mean, spec.max_check_lines),
        )
        for r in records
    ]
    return examples


def _labelled(batch: list) -> list[tuple[list[int], list[int], list[int]]]:
    """(prompt, response, response labels) per example: an example's third element, where given, flags the
    response tokens the loss trains (0 on a tool turn, tiny_tools.py), whose labels are then -100."""
    return [(e[0], e[1], [t if keep else -100 for t, keep in zip(e[1], e[2], strict=True)] if len(e) > 2 else e[1])
            for e in batch]  # fmt: skip


def _collate(batch: list, pad_id: int):
    import torch

    width = max(len(e[0]) + len(e[1]) for e in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)  # [B, T]
    labels = torch.full((len(batch), width), -100, dtype=torch.long)  # [B, T], loss on the response only
    mask = torch.zeros((len(batch), width), dtype=torch.long)  # [B, T]
    for i, (p, r, target) in enumerate(_labelled(batch)):
        n = len(p) + len(r)
        ids[i, :n] = torch.tensor(p + r)
        labels[i, len(p) : n] = torch.tensor(target)
        mask[i, :n] = 1
    return ids, mask, labels


def _packed(batch: list) -> tuple[dict, list[int]]:
    """One row holding every example (positions restarting per example) and the labels of its responses; the
    first token of each example is a prompt token (label -100), so no loss crosses an example boundary."""
    import torch

    ids, pos, labels, lengths = [], [], [], []
    for p, r, target in _labelled(batch):
        ids += p + r
        pos += range(len(p) + len(r))
        labels += [-100] * len(p) + target
        lengths.append(len(p) + len(r))
    row = {"input_ids": torch.tensor([ids]), "position_ids": torch.tensor([pos]), "labels": torch.tensor([labels])}
    return row, lengths


def supervised_pass(
    model, examples: list, *, batch_size: int, lr: float, pad_id: int, warmup: int = 10, packed: bool = False
) -> list[float]:
    """One pass over ``examples`` in order, AdamW with warm-up + cosine decay; returns the loss of each step.

    ``packed``: each batch is one row attended per example (engines/packed_attention.py), no padding; the loss is
    the same mean over the batch's response tokens. The "small" size's lengths are skewed (20 to 500+ tokens), so
    padding a batch to its longest would cost ~3x the tokens. The tiny models keep the padded batches they were
    built with (bitwise-identical weights)."""
    import torch

    from .engines import packed_attention

    if packed and not packed_attention.enable(model):
        raise ValueError(f"packed warm start needs sdpa or eager attention, not {model.config._attn_implementation}")

    steps = len(examples) // batch_size
    if steps == 0:
        return []
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / steps))
    )
    device = next(model.parameters()).device  # the batches are built on the host and go where the model is
    model.train()
    losses = []
    for step in range(steps):
        batch = examples[step * batch_size : (step + 1) * batch_size]
        if packed:
            row, lengths = _packed(batch)
            row = {key: value.to(device) for key, value in row.items()}
            with packed_attention.packed_forward(model):
                loss = model(**row, use_cache=False, **packed_attention.forward_kwargs(model, lengths)).loss
        else:
            ids, mask, labels = (t.to(device) for t in _collate(batch, pad_id))
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    model.eval()
    return losses


# ----------------------------------------------------------------------------------------------- evaluation


def sample_accuracy(model, tokenizer, records: list[dict], *, temperature: float, max_new_tokens: int, seed: int):
    """Fraction of ``records`` answered correctly (math-verify reward) by one sample each; 0 = greedy."""
    import torch

    from .rewards import compute_rewards

    tokenizer.padding_side = "left"  # decoder-only batch generation: pad on the left, generate on the right
    prompts = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in records]
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    enc = {key: value.to(next(model.parameters()).device) for key, value in enc.items()}
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature else {}
    torch.manual_seed(seed)  # seeds the accelerators' generators too: generate() samples on the model's device
    with torch.no_grad():
        out = model.generate(
            **enc,
            **({"do_sample": False} if not temperature else sampling),
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :].cpu(), skip_special_tokens=True)
    _, metrics = compute_rewards(texts, [r["answer"] for r in records])
    return metrics["reward/accuracy"], texts


# ----------------------------------------------------------------------------------------------- build


def gspo_home() -> Path:
    """Where embedded artifacts live: ``$GSPO_HOME``, else ``~/.cache/gspo-ascend``."""
    return Path(os.environ.get("GSPO_HOME") or Path.home() / ".cache" / "gspo-ascend").expanduser()


def default_tiny_dir(moe: bool = False, size: str = "tiny", device_type: str = "cpu") -> Path:
    """Where a model of this recipe lives by default. A build on an accelerator gets a folder of its own
    (``small-qwen3-cuda``): it is another model than the CPU's, and the CPU one (40 minutes for ``small``) must
    not be replaced by it, nor it by a CPU rebuild."""
    name = f"{size}-qwen3-moe" if moe else f"{size}-qwen3"
    return gspo_home() / (name if device_type == "cpu" else f"{name}-{device_type}")


def _size_overrides(size: str, overrides: dict) -> dict:
    if size not in SIZES:
        raise UserError(f"unknown tiny-model size '{size}'; valid sizes: {', '.join(SIZES)}")
    return {**SIZES[size], **overrides}


def _warm_start(model, tokenizer, spec: TinySpec, seed: int) -> dict:
    if spec.tool_fraction > 0:  # the tool-use task: one clean pass over trajectories and direct answers
        from .agent_loop import ToolTurns
        from .tiny_tools import sft_examples as tool_examples

        turns = ToolTurns(tokenizer, EOS)
        examples = tool_examples(tokenizer, turns, spec.sft_steps * spec.batch_size, seed, spec.tool_fraction)
        losses = supervised_pass(model, examples, lr=spec.lr, batch_size=spec.batch_size, pad_id=tokenizer.pad_token_id)
        return {"clean_steps": len(losses), "tool_fraction": spec.tool_fraction, "batch_size": spec.batch_size,
                "lr": spec.lr, "loss_first": losses[0], "loss_last": sum(losses[-10:]) / len(losses[-10:])}  # fmt: skip
    clean = sft_examples(tokenizer, spec, seed, spec.sft_steps, 1.0, "sft")
    noisy = sft_examples(tokenizer, spec, seed, spec.noisy_sft_steps, spec.noisy_p_correct, "sft-noisy")
    kw = dict(batch_size=spec.batch_size, pad_id=tokenizer.pad_token_id, packed=spec.check_lines_mean > 0)
    clean_losses = supervised_pass(model, clean, lr=spec.lr, **kw)
    noisy_losses = supervised_pass(model, noisy, lr=spec.noisy_lr, **kw)
    return {
        "clean_steps": len(clean_losses),
        "noisy_steps": len(noisy_losses),
        "noisy_p_correct": spec.noisy_p_correct,
        "batch_size": spec.batch_size,
        "lr": spec.lr,
        "noisy_lr": spec.noisy_lr,
        "loss_first": clean_losses[0] if clean_losses else None,
        "loss_after_clean": sum(clean_losses[-10:]) / len(clean_losses[-10:]) if clean_losses else None,
        "loss_after_noisy": sum(noisy_losses[-10:]) / len(noisy_losses[-10:]) if noisy_losses else None,
    }


def _evaluate(model, tokenizer, spec: TinySpec, seed: int) -> dict:
    records = synthetic_arithmetic(spec.eval_prompts, seed, split="train", max_operand=spec.max_operand)
    kw = dict(max_new_tokens=spec.eval_max_new_tokens, seed=seed)
    sampled, texts = sample_accuracy(model, tokenizer, records, temperature=1.0, **kw)
    greedy, _ = sample_accuracy(model, tokenizer, records, temperature=0.0, **kw)
    # response tokens of the temperature-1 samples (the eos a finished one ended with included)
    lengths = sorted(len(tokenizer(t, add_special_tokens=False)["input_ids"]) + 1 for t in texts)
    return {
        "sampled_t1": sampled,
        "greedy": greedy,
        "num_prompts": len(records),
        "split": "train",
        "max_new_tokens": spec.eval_max_new_tokens,
        "sampled_length": {
            "mean": round(sum(lengths) / len(lengths), 1) if lengths else 0.0,
            "median": lengths[len(lengths) // 2] if lengths else 0,
            "max": min(lengths[-1], spec.eval_max_new_tokens) if lengths else 0,
            "at_limit": sum(n > spec.eval_max_new_tokens for n in lengths) / max(len(lengths), 1),
        },
        "example": texts[0] if texts else "",
    }


@contextlib.contextmanager
def _deterministic(backend=None):
    """Deterministic kernels for the build. On the CPU (``backend`` None or a host backend) strictly: the shipped
    bytes depend on it. On an accelerator where possible: some kernels have no deterministic variant there, which
    would abort the build, so those only warn (``warn_only``); and CUDA's cuBLAS is deterministic only with a fixed
    workspace, which torch requires to be configured (CUBLAS_WORKSPACE_CONFIG) before its first matmul in the
    process: set here unless the user chose one (torch reads it once, so it stays set)."""
    import torch

    on_host = backend is None or backend.torch_device_type == "cpu"
    if backend is not None and backend.name == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    previous = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=not on_host)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])


def _portable_process() -> bool:
    """Whether this process runs with :data:`PORTABLE_CPU_ENV` (as the build's child does): ATen and MKL read it at
    their first use, so the environment alone is not proof for ATen, whose capability is checked too."""
    import torch

    pinned = all(os.environ.get(key) == value for key, value in PORTABLE_CPU_ENV.items())
    return pinned and torch.backends.cpu.get_cpu_capability() in DEFAULT_CPU_CAPABILITY


@contextlib.contextmanager
def _one_thread(on: bool):
    """One intra-op thread while ``on`` (a reduction split over threads sums in another order), restored after."""
    import torch

    previous = torch.get_num_threads()
    if on:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _build_in_child(out: Path, kwargs: dict) -> dict:
    """Run :func:`make_tiny_model` (``kwargs``, output ``out``) in a child process started with
    :data:`PORTABLE_CPU_ENV`; returns the manifest it wrote. The child prints its own errors (stderr is ours)."""
    env = {**os.environ, **PORTABLE_CPU_ENV}
    # the child imports this package from where the parent did, installed or not
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    request = json.dumps({"output_dir": str(out), **kwargs})
    result = subprocess.run([sys.executable, "-m", "gspo_ascend.tiny", request], env=env, check=False)
    manifest = read_manifest(out)
    if result.returncode != 0 or manifest is None:
        raise RuntimeError(f"the tiny-model build process failed (exit {result.returncode}); its error is above")
    return manifest


def _check_output_dir(out: Path) -> None:
    if out.exists() and any(out.iterdir()) and not (out / MANIFEST).is_file():
        raise UserError(f"'{out}' exists and is not a tiny-model directory; choose another output directory")


def make_tiny_model(
    output_dir: str | Path | None = None,
    *,
    moe: bool = False,
    seed: int = 0,
    sft_steps: int | None = None,
    noisy_sft_steps: int | None = None,
    evaluate: bool = True,
    size: str = "tiny",
    device: str = "cpu",
    portable: bool | None = None,
    **overrides,
) -> dict:
    """Build, warm-start, evaluate and save a tiny model + tokenizer into ``output_dir``; returns the manifest.

    ``output_dir`` None = :func:`default_tiny_dir`. ``size`` names a preset of :data:`SIZES`; ``overrides`` are
    :class:`TinySpec` fields on top of it (tests shrink the model with them). ``device`` (auto | cpu | cuda | npu,
    as trainer.device) runs the warm start and the eval; an unusable one is a one-line DeviceError (exit 2) before
    anything is built. The directory is written next to the target and renamed into place, so a reader never sees
    a half-built model; an existing tiny-model directory is replaced.

    ``portable`` (on the CPU): build in a child process with :data:`PORTABLE_CPU_ENV`, the same bytes on any x86-64
    CPU; None = portable for a preset without ``overrides`` (the models users get), in-process for test-shrunk ones.
    """
    from .device import get_backend

    backend = get_backend(device)
    if portable is None:
        portable = not overrides
    if backend.torch_device_type == "cpu" and portable and not _CHILD and not _portable_process():
        out = Path(output_dir).expanduser() if output_dir is not None else default_tiny_dir(moe, size)
        _check_output_dir(out)
        kwargs = dict(moe=moe, seed=seed, sft_steps=sft_steps, noisy_sft_steps=noisy_sft_steps, evaluate=evaluate)
        return _build_in_child(out, dict(kwargs, size=size, **overrides))
    spec = replace(TinySpec(moe=moe), **_size_overrides(size, overrides))
    spec = replace(spec, sft_steps=spec.sft_steps if sft_steps is None else sft_steps)
    spec = replace(spec, noisy_sft_steps=spec.noisy_sft_steps if noisy_sft_steps is None else noisy_sft_steps)
    out = (
        Path(output_dir).expanduser()
        if output_dir is not None
        else default_tiny_dir(moe, size, backend.torch_device_type)
    )
    _check_output_dir(out)
    start = time.perf_counter()
    with _deterministic(backend), _one_thread(portable and backend.torch_device_type == "cpu"):
        tokenizer = build_tokenizer(
            seed, spec.vocab_size, spec.max_operand, checks=spec.check_lines_mean > 0, tools=spec.tool_fraction > 0
        )
        # initialised on the CPU (the CPU generator, seeded): every device starts from the same weights
        model = build_model(spec, tokenizer, seed).to(backend.device())
        sft = _warm_start(model, tokenizer, spec, seed)
        # the tool task's accuracy needs the tools: its runs measure it (validation at step 0, docs/agent.md)
        accuracy = _evaluate(model, tokenizer, spec, seed) if evaluate and not spec.tool_fraction else None
        model = model.to("cpu")  # saved from the host, as every reader loads it
    seconds = time.perf_counter() - start
    manifest = _manifest(spec, seed, model, tokenizer, sft, accuracy, seconds, backend.torch_device_type)
    _save(out, model, tokenizer, manifest)
    return manifest


def _manifest(
    spec: TinySpec, seed: int, model, tokenizer, sft: dict, accuracy: dict | None, seconds: float, device: str
) -> dict:
    import torch
    import transformers

    return {
        "recipe_version": RECIPE_VERSION,
        "architecture": type(model).__name__,
        "seed": seed,
        "spec": asdict(spec),
        "device": device,  # the torch device type the warm start ran on (the emulated NPU's is cpu)
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "tokenizer_size": len(tokenizer),
        "sft": sft,
        "initial_accuracy": accuracy,
        "build_seconds": round(seconds, 1),
        "torch_threads": torch.get_num_threads(),
        # DEFAULT with MKL_CBWR=COMPATIBLE and 1 thread: a portable build, the same bytes on any x86-64 CPU
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mkl_cbwr": os.environ.get("MKL_CBWR"),
        "portable": _portable_process() and torch.get_num_threads() == 1,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }


def _save(out: Path, model, tokenizer, manifest: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(tmp, safe_serialization=True)
    _portable_model_config(tmp / "config.json")
    tokenizer.padding_side = "left"  # what generation wants; training code pads explicitly
    tokenizer.save_pretrained(tmp)
    _portable_tokenizer_config(tmp / "tokenizer_config.json")
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out, ignore_errors=True)
    try:
        tmp.rename(out)
    except OSError:  # another process (a second Ray worker) finished the same build first: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
        if read_manifest(out) is None:
            raise


def _portable_model_config(path: Path) -> None:
    """Write both the transformers-4.x and 5.x spellings (``rope_theta`` / ``rope_parameters``, ``num_experts`` /
    ``num_local_experts``), whichever release saved the file.

    transformers 5 saves ``rope_parameters`` and ``num_local_experts``, 4.57 saves ``rope_theta`` and
    ``num_experts``; a reader of the other release (and tools reading config.json directly, e.g. weight
    converters) would silently fall back to defaults such as 128 experts. Each release reads the other's keys as
    aliases of the same values (4.x keeps them as plain attributes).
    """
    config = json.loads(path.read_text())
    rope = config.get("rope_parameters") or {"rope_type": "default", "rope_theta": config.get("rope_theta", 10000.0)}
    config["rope_parameters"], config["rope_theta"] = rope, rope["rope_theta"]
    experts = config.get("num_local_experts", config.get("num_experts"))
    if experts is not None:
        config["num_experts"] = config["num_local_experts"] = experts
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _portable_tokenizer_config(path: Path) -> None:
    """Name the class every transformers (4.x and 5.x) knows, inline the chat template, list the model inputs.

    transformers 5 writes ``TokenizersBackend`` and a separate ``chat_template.jinja``; transformers 4.x (which
    some vLLM / vllm-ascend releases pin) knows neither, and loads ``PreTrainedTokenizerFast`` + the template from
    this file. transformers 5 maps that class name back to its fast backend. 4.x's fast tokenizer would also return
    ``token_type_ids`` unless ``model_input_names`` says otherwise.
    """
    config = json.loads(path.read_text())
    config.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=CHAT_TEMPLATE, padding_side="left")
    config["model_input_names"] = list(MODEL_INPUT_NAMES)
    path.write_text(json.dumps(config, indent=2) + "\n")


def read_manifest(path: str | Path) -> dict | None:
    try:
        return json.loads((Path(path) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def ensure_tiny_model(
    moe: bool = False,
    output_dir: str | Path | None = None,
    seed: int = 0,
    size: str = "tiny",
    device: str = "cpu",
    **overrides,
) -> Path:
    """The tiny model directory (what ``model.path: ""`` means), built first unless an identical recipe is there.

    "Identical" = same recipe version, seed, :class:`TinySpec` (defaults + ``size``'s preset + ``overrides``) and
    build device (``device``'s torch device type; the CPU by default); anything else, e.g. a cache from an older
    release or a model built on a GPU where the CPU one is wanted, is rebuilt on ``device``. A manifest written
    before a TinySpec field existed was built with that field's default (new fields default to the old recipe), so
    it counts as such; one without a device was built on the CPU (the only device then).
    """
    from .device import get_backend

    built_on = get_backend(device).torch_device_type
    out = Path(output_dir).expanduser() if output_dir is not None else default_tiny_dir(moe, size, built_on)
    wanted = asdict(replace(TinySpec(moe=moe), **_size_overrides(size, overrides)))
    manifest = read_manifest(out) or {}
    spec = manifest.get("spec")
    spec = {**asdict(TinySpec(moe=moe)), **spec} if isinstance(spec, dict) else spec
    found = (manifest.get("recipe_version"), manifest.get("seed"), spec, manifest.get("device", "cpu"))
    # a preset on the CPU must be the portable build (make_tiny_model's default): a cache built otherwise (e.g. by
    # portable=False, or during the recipe-3 work) is this CPU's model, not the one every machine gets
    stale = built_on == "cpu" and not overrides and manifest.get("portable") is not True
    if found != (RECIPE_VERSION, seed, wanted, built_on) or stale:
        make_tiny_model(out, moe=moe, seed=seed, size=size, device=device, **overrides)
    return out


# ----------------------------------------------------------------------------------------------- CLI


def add_make_tiny_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--output-dir",
        help="default: $GSPO_HOME/<size>-qwen3[-moe][-<device>] ($GSPO_HOME: ~/.cache/gspo-ascend; no suffix on cpu)",
    )
    p.add_argument("--moe", action="store_true", help="build the Qwen3-MoE variant (4 experts, top-2)")
    p.add_argument(
        "--size",
        choices=sorted(SIZES),
        default="tiny",
        help="tiny (default: ~0.4M parameters, short answers) | small (~22M, long skewed responses: the benchmark's)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sft-steps", type=int, default=None, help=f"clean warm-start steps (tiny: {TinySpec.sft_steps})")
    p.add_argument(
        "--noisy-sft-steps", type=int, default=None, help=f"flattening steps (tiny: {TinySpec.noisy_sft_steps})"
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda", "npu", "auto"),
        default="cpu",
        help="where the warm start and the eval run, as trainer.device (default cpu: the shipped models' exact bytes; "
        "a GPU builds --size small in seconds, another model than the CPU's, recorded in the manifest)",
    )


def main_make_tiny_model(args: argparse.Namespace) -> int:
    manifest = make_tiny_model(
        args.output_dir,
        moe=args.moe,
        seed=args.seed,
        sft_steps=args.sft_steps,
        noisy_sft_steps=args.noisy_sft_steps,
        size=args.size,
        device=args.device,
    )
    out = args.output_dir or default_tiny_dir(args.moe, args.size, manifest["device"])
    acc = manifest["initial_accuracy"]
    if acc is None:  # the tools preset: its accuracy needs the calculator (a run's validation at step 0)
        sft = manifest["sft"]
        print(
            f"{manifest['architecture']} ({manifest['num_parameters']:,} parameters) -> {out}\n"
            f"built in {manifest['build_seconds']} s on {manifest['device']}; warm-start loss {sft['loss_first']:.2f}"
            f" -> {sft['loss_last']:.3f}; its accuracy needs the tools: `gspo-ascend train --config "
            "configs/tiny_gspo_tools.yaml` validates it at step 0"
        )
        return 0
    n = acc["sampled_length"]
    print(
        f"{manifest['architecture']} ({manifest['num_parameters']:,} parameters) -> {out}\n"
        f"built in {manifest['build_seconds']} s on {manifest['device']}; "
        f"initial accuracy on {acc['num_prompts']} prompts: "
        f"{acc['sampled_t1']:.2f} sampled at temperature 1, {acc['greedy']:.2f} greedy\n"
        f"sampled response tokens: mean {n['mean']}, median {n['median']}, max {n['max']}, "
        f"{n['at_limit']:.0%} at the {acc['max_new_tokens']}-token limit"
    )
    return 0


if __name__ == "__main__":  # the portable build's child (_build_in_child): one JSON argument, make_tiny_model's
    _CHILD = True
    request = json.loads(sys.argv[1])
    make_tiny_model(request.pop("output_dir"), **request)
