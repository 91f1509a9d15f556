"""The embedded tool-use task (issue #45): two-digit multiplication, which the tiny model cannot do alone and can
with the ``calculator`` tool, and the warm start that teaches it Qwen3's tool-call format.

"What is 37 * 58?" has 8,100 problems (10..99 each side); a quarter is held out for validation, as for the
arithmetic task (tiny.py). The warm start (the ``tools`` preset of ``make-tiny-model``, tiny.py's recipe with this
module's corpus and examples) mixes two kinds of supervised example:

* with probability ``tool_fraction``, a trajectory: the model's call
  ``<tool_call>{"name": "calculator", "arguments": {"expression": "37 * 58"}}</tool_call>``, the tool turn with
  the product (context: no loss on it, as in RL), then ``37 * 58 = 2146. \\boxed{2146}``;
* otherwise a direct answer ``37 * 58 = 2146. \\boxed{2146}``, which a 2-layer, 128-wide model does not learn to
  compute: its direct answers are almost always wrong.

So the warm-started model calls the calculator in about ``tool_fraction`` of its samples and is right almost only
then: RL with the tool raises the call rate and the accuracy together; the same model trained without tools (its
calls then go unanswered and score 0) can only learn to answer directly. ``<tool_call>`` and ``</tool_call>`` are
tokens of their own, as in Qwen3's tokenizer. Nothing here imports tiny.py (tiny.py imports this module).
"""

from __future__ import annotations

import json
import random
from typing import Any

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
PRODUCT_QUESTION = "What is {a} * {b}? Put the final answer in \\boxed{{}}."
PRODUCTS_DATA_SOURCE = "gspo_ascend/synthetic_products"
LOW, HIGH = 10, 99
HELD_OUT_FRACTION = 0.25


def call_text(a: int, b: int) -> str:
    return TOOL_OPEN + json.dumps({"name": "calculator", "arguments": {"expression": f"{a} * {b}"}}) + TOOL_CLOSE


def answer_text(a: int, b: int, product: int) -> str:
    return f"{a} * {b} = {product}. \\boxed{{{product}}}"


def held_out_products() -> frozenset[tuple[int, int]]:
    """The problems RL never trains on: a fixed quarter of the 8,100 (the same for every seed)."""
    space = [(a, b) for a in range(LOW, HIGH + 1) for b in range(LOW, HIGH + 1)]
    rng = random.Random("gspo-ascend:held-out-products")
    return frozenset(rng.sample(space, round(len(space) * HELD_OUT_FRACTION)))


def synthetic_products(n: int, seed: int = 0, *, split: str = "train", distinct: bool = False) -> list[dict]:
    """``n`` records ``{"prompt": [chat messages], "answer", "a", "b"}``; "train" and "test" draw from disjoint
    problems (:func:`held_out_problems`), any other split (the warm start's) from all of them."""
    rng = random.Random(f"gspo-ascend:{seed}:{split}:products")
    held_out = held_out_products() if split in ("train", "test") else None
    records, seen = [], set()
    while len(records) < n:
        a, b = rng.randint(LOW, HIGH), rng.randint(LOW, HIGH)
        if held_out is not None and ((a, b) in held_out) != (split == "test"):
            continue
        if distinct and (a, b) in seen:
            continue
        seen.add((a, b))
        content = PRODUCT_QUESTION.format(a=a, b=b)
        records.append({"prompt": [{"role": "user", "content": content}], "answer": str(a * b), "a": a, "b": b})
    return records


def corpus(seed: int) -> list[str]:
    """The tokenizer's training text: questions, calls, tool answers and answers."""
    texts = []
    for r in synthetic_products(2000, seed, split="sft-corpus"):
        a, b = r["a"], r["b"]
        texts += [r["prompt"][0]["content"], call_text(a, b), f"tool\n{a * b}", answer_text(a, b, a * b)]
    return texts


def sft_examples(tokenizer: Any, tool_turns: Any, count: int, seed: int, tool_fraction: float) -> list:
    """``count`` warm-start examples ``(prompt ids, response ids, loss flags)``: the flags are 0 on a tool turn."""
    rng = random.Random(f"gspo-ascend:{seed}:products-sft")
    eos = tokenizer.eos_token_id

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    examples = []
    for r in synthetic_products(count, seed, split="sft"):
        a, b = r["a"], r["b"]
        prompt = ids(tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False))
        answer = ids(answer_text(a, b, a * b)) + [eos]
        if rng.random() < tool_fraction:
            call, tool = ids(call_text(a, b)) + [eos], tool_turns.tokens([str(a * b)])
            examples.append((prompt, call + tool + answer, [1] * len(call) + [0] * len(tool) + [1] * len(answer)))
        else:
            examples.append((prompt, answer, [1] * len(answer)))
    return examples
