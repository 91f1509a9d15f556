"""The embedded tiny models (dense Qwen3 and Qwen3-MoE) and the synthetic arithmetic task they are warmed on.

Built locally, deterministically, in about a minute on two CPU cores, so the CPU demo and CI never touch a
model hub:

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
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from .errors import UserError

RECIPE_VERSION = 2  # bump when the recipe changes: ensure_tiny_model() then rebuilds cached models
# 2: the tokenizer lists model_input_names (transformers 4.x would add token_type_ids); weights unchanged
SYNTHETIC_DATA_SOURCE = "gspo_ascend/synthetic_arithmetic"
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


# ----------------------------------------------------------------------------------------------- the task


def _problem(rng: random.Random, max_operand: int) -> tuple[int, str, int, int]:
    op = rng.choice("+-")
    a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
    if op == "-" and b > a:  # keep results >= 0: one answer format, no sign token to learn
        a, b = b, a
    return a, op, b, a + b if op == "+" else a - b


def synthetic_arithmetic(n: int, seed: int = 0, *, split: str = "train", max_operand: int = 9) -> list[dict]:
    """``n`` records ``{"prompt": [chat messages], "answer": "12", "a", "op", "b"}`` of "What is a +/- b?".

    ``split`` names an independent random stream: "sft" (the warm start), "train" (RL prompts), "test".
    The problem space is small (0..max_operand, + and -), so splits are disjoint *draws* of one
    distribution, not disjoint problems: the task measures whether RL sharpens what the model half-knows.
    """
    rng = random.Random(f"gspo-ascend:{seed}:{split}")  # str seeds hash with sha512: stable across runs
    records = []
    for _ in range(n):
        a, op, b, c = _problem(rng, max_operand)
        content = QUESTION.format(a=a, op=op, b=b)
        records.append({"prompt": [{"role": "user", "content": content}], "answer": str(c), "a": a, "op": op, "b": b})
    return records


def solution_text(a: int, op: str, b: int, answer: int) -> str:
    return f"{a} {op} {b} = {answer}. \\boxed{{{answer}}}"


def _noisy_answer(rng: random.Random, correct: int, p_correct: float) -> int:
    if rng.random() < p_correct:
        return correct
    delta = rng.choice((-3, -2, -1, 1, 2, 3))
    return correct + delta if correct + delta >= 0 else correct - delta


# ----------------------------------------------------------------------------------------------- tokenizer


def _corpus(seed: int, max_operand: int) -> list[str]:
    from .data.prepare import INSTRUCTION

    records = synthetic_arithmetic(2000, seed, split="sft", max_operand=max_operand)
    texts = [
        r["prompt"][0]["content"] + "\n" + solution_text(r["a"], r["op"], r["b"], int(r["answer"])) for r in records
    ]
    # A little general math prose so the vocabulary is not only the task's dozen words.
    texts += [INSTRUCTION, "The answer is the sum of the two numbers. Let us think step by step: add, then check."]
    return texts


def build_tokenizer(seed: int = 0, vocab_size: int = 512, max_operand: int = 9):
    """A byte-level BPE tokenizer trained here (no download), as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Digits one per token (as Qwen's tokenizer does), then GPT-2 style byte-level: every string round-trips.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS_CHAT, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed, max_operand), trainer)
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


def encode_example(tokenizer, record: dict, answer: int) -> tuple[list[int], list[int]]:
    """(prompt ids, response ids + eos). Encoded apart so no BPE merge crosses the prompt/response boundary."""
    prompt = tokenizer.apply_chat_template(record["prompt"], add_generation_prompt=True, tokenize=False)
    response = solution_text(record["a"], record["op"], record["b"], answer)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    return prompt_ids, tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def sft_examples(tokenizer, spec: TinySpec, seed: int, steps: int, p_correct: float, stream: str) -> list:
    rng = random.Random(f"gspo-ascend:{seed}:{stream}:labels")
    records = synthetic_arithmetic(steps * spec.batch_size, seed, split=stream, max_operand=spec.max_operand)
    return [encode_example(tokenizer, r, _noisy_answer(rng, int(r["answer"]), p_correct)) for r in records]


def _collate(batch: list, pad_id: int):
    import torch

    width = max(len(p) + len(r) for p, r in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)  # [B, T]
    labels = torch.full((len(batch), width), -100, dtype=torch.long)  # [B, T], loss on the response only
    mask = torch.zeros((len(batch), width), dtype=torch.long)  # [B, T]
    for i, (p, r) in enumerate(batch):
        n = len(p) + len(r)
        ids[i, :n] = torch.tensor(p + r)
        labels[i, len(p) : n] = torch.tensor(r)
        mask[i, :n] = 1
    return ids, mask, labels


def supervised_pass(model, examples: list, *, batch_size: int, lr: float, pad_id: int, warmup: int = 10) -> list[float]:
    """One pass over ``examples`` in order, AdamW with warm-up + cosine decay; returns the loss of each step."""
    import torch

    steps = len(examples) // batch_size
    if steps == 0:
        return []
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / steps))
    )
    model.train()
    losses = []
    for step in range(steps):
        ids, mask, labels = _collate(examples[step * batch_size : (step + 1) * batch_size], pad_id)
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
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature else {}
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            **enc,
            **({"do_sample": False} if not temperature else sampling),
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    _, metrics = compute_rewards(texts, [r["answer"] for r in records])
    return metrics["reward/accuracy"], texts


# ----------------------------------------------------------------------------------------------- build


def gspo_home() -> Path:
    """Where embedded artifacts live: ``$GSPO_HOME``, else ``~/.cache/gspo-ascend``."""
    return Path(os.environ.get("GSPO_HOME") or Path.home() / ".cache" / "gspo-ascend").expanduser()


def default_tiny_dir(moe: bool = False) -> Path:
    return gspo_home() / ("tiny-qwen3-moe" if moe else "tiny-qwen3")


def _warm_start(model, tokenizer, spec: TinySpec, seed: int) -> dict:
    clean = sft_examples(tokenizer, spec, seed, spec.sft_steps, 1.0, "sft")
    noisy = sft_examples(tokenizer, spec, seed, spec.noisy_sft_steps, spec.noisy_p_correct, "sft-noisy")
    kw = dict(batch_size=spec.batch_size, pad_id=tokenizer.pad_token_id)
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
    return {
        "sampled_t1": sampled,
        "greedy": greedy,
        "num_prompts": len(records),
        "split": "train",
        "max_new_tokens": spec.eval_max_new_tokens,
        "example": texts[0] if texts else "",
    }


@contextlib.contextmanager
def _deterministic():
    import torch

    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous)


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
    **overrides,
) -> dict:
    """Build, warm-start, evaluate and save a tiny model + tokenizer into ``output_dir``; returns the manifest.

    ``output_dir`` None = :func:`default_tiny_dir`. ``overrides`` are :class:`TinySpec` fields (tests shrink
    the model with them). The directory is written next to the target and renamed into place, so a reader
    never sees a half-built model; an existing tiny-model directory is replaced.
    """
    spec = replace(TinySpec(moe=moe), **overrides)
    spec = replace(spec, sft_steps=spec.sft_steps if sft_steps is None else sft_steps)
    spec = replace(spec, noisy_sft_steps=spec.noisy_sft_steps if noisy_sft_steps is None else noisy_sft_steps)
    out = Path(output_dir).expanduser() if output_dir is not None else default_tiny_dir(moe)
    _check_output_dir(out)
    start = time.perf_counter()
    with _deterministic():
        tokenizer = build_tokenizer(seed, spec.vocab_size, spec.max_operand)
        model = build_model(spec, tokenizer, seed)
        sft = _warm_start(model, tokenizer, spec, seed)
        accuracy = _evaluate(model, tokenizer, spec, seed) if evaluate else None
    manifest = _manifest(spec, seed, model, tokenizer, sft, accuracy, time.perf_counter() - start)
    _save(out, model, tokenizer, manifest)
    return manifest


def _manifest(spec: TinySpec, seed: int, model, tokenizer, sft: dict, accuracy: dict | None, seconds: float) -> dict:
    import torch
    import transformers

    return {
        "recipe_version": RECIPE_VERSION,
        "architecture": type(model).__name__,
        "seed": seed,
        "spec": asdict(spec),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "tokenizer_size": len(tokenizer),
        "sft": sft,
        "initial_accuracy": accuracy,
        "build_seconds": round(seconds, 1),
        "torch_threads": torch.get_num_threads(),
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


def ensure_tiny_model(moe: bool = False, output_dir: str | Path | None = None, seed: int = 0, **overrides) -> Path:
    """The tiny model directory (what ``model.path: ""`` means), built first unless an identical recipe is there.

    "Identical" = same recipe version, seed and :class:`TinySpec` (defaults + ``overrides``); anything else,
    e.g. a cache from an older release, is rebuilt.
    """
    out = Path(output_dir).expanduser() if output_dir is not None else default_tiny_dir(moe)
    wanted = asdict(replace(TinySpec(moe=moe), **overrides))
    manifest = read_manifest(out) or {}
    current = (manifest.get("recipe_version"), manifest.get("seed"), manifest.get("spec"))
    if current != (RECIPE_VERSION, seed, wanted):
        make_tiny_model(out, moe=moe, seed=seed, **overrides)
    return out


# ----------------------------------------------------------------------------------------------- CLI


def add_make_tiny_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output-dir", help="default: $GSPO_HOME/tiny-qwen3[-moe] ($GSPO_HOME: ~/.cache/gspo-ascend)")
    p.add_argument("--moe", action="store_true", help="build the Qwen3-MoE variant (4 experts, top-2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sft-steps", type=int, default=None, help=f"clean warm-start steps (default {TinySpec.sft_steps})")
    p.add_argument(
        "--noisy-sft-steps", type=int, default=None, help=f"flattening steps (default {TinySpec.noisy_sft_steps})"
    )


def main_make_tiny_model(args: argparse.Namespace) -> int:
    manifest = make_tiny_model(
        args.output_dir,
        moe=args.moe,
        seed=args.seed,
        sft_steps=args.sft_steps,
        noisy_sft_steps=args.noisy_sft_steps,
    )
    out = args.output_dir or default_tiny_dir(args.moe)
    acc = manifest["initial_accuracy"]
    print(
        f"{manifest['architecture']} ({manifest['num_parameters']:,} parameters) -> {out}\n"
        f"built in {manifest['build_seconds']} s; initial accuracy on {acc['num_prompts']} prompts: "
        f"{acc['sampled_t1']:.2f} sampled at temperature 1, {acc['greedy']:.2f} greedy"
    )
    return 0
