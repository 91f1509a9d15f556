"""The tool-use demo's task and warm start (tiny_tools.py, the ``tools`` preset of tiny.py; issue #45): the
held-out split, the multi-turn supervised examples and their labels, the products data. Hand-derived values."""

from __future__ import annotations

import pytest
import torch

from gspo_ascend import tiny, tiny_tools


@pytest.fixture(scope="module")
def tokenizer():
    return tiny.build_tokenizer(0, 512, tools=True)


def test_products_split_into_disjoint_train_and_held_out_problems():
    held = tiny_tools.held_out_products()
    assert len(held) == 2025  # a quarter of 90 x 90
    train = tiny_tools.synthetic_products(500, split="train")
    test = tiny_tools.synthetic_products(64, split="test", distinct=True)
    assert all((r["a"], r["b"]) not in held for r in train) and all((r["a"], r["b"]) in held for r in test)
    assert len({(r["a"], r["b"]) for r in test}) == 64 and test[0]["answer"] == str(test[0]["a"] * test[0]["b"])


def test_the_tool_call_tokens_are_single_tokens(tokenizer):
    for token in (tiny_tools.TOOL_OPEN, tiny_tools.TOOL_CLOSE):
        assert len(tokenizer(token, add_special_tokens=False)["input_ids"]) == 1
    text = tiny_tools.call_text(37, 58)
    assert text == '<tool_call>{"name": "calculator", "arguments": {"expression": "37 * 58"}}</tool_call>'
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text


def test_a_trajectory_example_trains_the_call_and_the_answer_not_the_tool_turn(tokenizer):
    from gspo_ascend.agent_loop import ToolTurns

    turns = ToolTurns(tokenizer, tiny.EOS)
    examples = tiny_tools.sft_examples(tokenizer, turns, 400, seed=0, tool_fraction=0.3)
    with_tool = [e for e in examples if 0 in e[2]]
    assert 0.25 < len(with_tool) / len(examples) < 0.35
    prompt, response, flags = with_tool[0]
    tool = turns.tokens([str(eval_product(tokenizer, prompt))])
    start = flags.index(0)
    assert response[start : start + len(tool)] == tool and flags[start : start + len(tool)] == [0] * len(tool)
    assert flags[:start] == [1] * start and flags[start + len(tool) :] == [1] * (len(flags) - start - len(tool))
    assert tokenizer.decode(response[:start]).startswith("<tool_call>")
    # the supervised pass's labels: -100 on the prompt and on the tool turn, the tokens themselves elsewhere
    ids, mask, labels = tiny._collate([with_tool[0]], tokenizer.pad_token_id)
    n = len(prompt)
    assert labels[0, :n].eq(-100).all() and labels[0, n + start : n + start + len(tool)].eq(-100).all()
    kept = torch.tensor(flags).bool()
    assert torch.equal(labels[0, n : n + len(response)][kept], torch.tensor(response)[kept])
    row, _ = tiny._packed([with_tool[0]])
    assert torch.equal(row["labels"][0], labels[0, : n + len(response)])


def eval_product(tokenizer, prompt: list[int]) -> int:
    """The product a prompt asks for, read back from its text ("What is 37 * 58? ...")."""
    text = tokenizer.decode(prompt)
    a, b = text.split("What is ")[1].split("?")[0].split(" * ")
    return int(a) * int(b)


def test_prepare_data_writes_the_products_task(tmp_path):
    from gspo_ascend.data import prepare_data
    from gspo_ascend.data.sources import read_rows

    summary = prepare_data("synthetic-tools", None, tmp_path, num_train=32, num_test=64)
    assert summary["train"]["rows"] == 32 and summary["test"]["rows"] == 64
    rows = read_rows(tmp_path / "test.parquet", ["data_source", "reward_model"])
    assert {r["data_source"] for r in rows} == {tiny_tools.PRODUCTS_DATA_SOURCE}
