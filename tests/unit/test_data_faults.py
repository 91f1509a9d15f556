"""Bad data is named, not swallowed (issue 18, defect 7): non-UTF-8 files, null questions, empty gsm8k answers,
over-long prompts left out without a word. Each test fails on the code before the fix (c5151b3), as its docstring
says."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gspo_ascend.cli import main
from gspo_ascend.data import load_prompts, prepare_data
from gspo_ascend.errors import UserError
from gspo_ascend.tiny import build_tokenizer, ensure_tiny_model


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(seed=0)


def one_error_line(capsys, code: int) -> str:
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


def latin1_jsonl(path, rows: list[dict], bad_line: int):
    """JSON lines, line ``bad_line`` (1-based) encoded in Latin-1 with an 'é' (0xe9: not UTF-8)."""
    lines = [json.dumps(r, ensure_ascii=False).encode("utf-8") for r in rows]
    lines[bad_line - 1] = json.dumps(rows[bad_line - 1], ensure_ascii=False).encode("latin-1")
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


GSM8K = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=7\n#### 7"},
    {"question": "Combien coûte le café?", "answer": "#### 2"},
    {"question": "Five and five?", "answer": "5+5=10\n#### 10"},
]


def test_prepare_data_names_the_file_and_line_that_is_not_utf8(tmp_path, capsys):
    """Old code: a UnicodeDecodeError traceback naming neither the file nor the line."""
    src = latin1_jsonl(tmp_path / "train.jsonl", GSM8K, bad_line=2)
    code = main(["prepare-data", "--kind", "gsm8k", "--input", str(src), "--output-dir", str(tmp_path / "out")])
    line = one_error_line(capsys, code)
    assert f"dataset file '{src}' line 2 is not UTF-8 text (byte 0xfb)" in line, line  # "û" in Latin-1
    assert "re-encode the file as UTF-8" in line


def test_train_names_the_file_and_line_that_is_not_utf8(tmp_path, capsys):
    """Old code: `gspo-ascend train` on such a file ended in the same anonymous UnicodeDecodeError traceback."""
    rows = [{"prompt": "What is 1 + 1?", "answer": "2"}, {"prompt": "Qu'est-ce que 1 + 1 ? Réponds.", "answer": "2"}]
    data = latin1_jsonl(tmp_path / "train.jsonl", rows, bad_line=2)
    tiny = ensure_tiny_model()
    code = main(["train", f"model.path={tiny}", f"data.train_files=[{data}]", f"trainer.output_dir={tmp_path / 'r'}"])
    line = one_error_line(capsys, code)
    assert f"dataset file '{data}' line 2 is not UTF-8 text (byte 0xe9)" in line, line


def test_a_parquet_string_that_is_not_utf8_is_named_by_row_and_column(tmp_path, tokenizer):
    """Old code: pyarrow's UnicodeDecodeError from to_pylist, without the file, the row or the column."""
    raw = pa.array([b"What is 1 + 1?", b"What is 2 + 2? \xff"], type=pa.binary())
    prompts = pa.Array.from_buffers(pa.string(), len(raw), raw.buffers())  # a string column with a bad cell
    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"prompt": prompts, "answer": pa.array(["2", "4"])}), path)
    with pytest.raises(UserError) as err:
        load_prompts([path], "prompt", tokenizer, 128)
    assert f"dataset file '{path}' row 1 (column 'prompt') is not UTF-8 text (byte 0xff)" in str(err.value)


def test_gsm8k_rows_without_a_question_or_with_an_empty_final_answer_are_skipped_and_reported(tmp_path, capsys):
    """Old code: a null question became the prompt "None\\n<instruction>" and "#### " gave an empty ground truth;
    both rows were kept and nothing was reported."""
    rows = [
        {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=7\n#### 7"},
        {"question": None, "answer": "#### 5"},
        {"question": "   ", "answer": "#### 6"},
        {"question": "What is nothing?", "answer": "no idea\n####   "},
        {"question": "Null answer?", "answer": None},
    ]
    src = tmp_path / "train.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    code = main(["prepare-data", "--kind", "gsm8k", "--input", str(src), "--output-dir", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "train: 1 rows" in printed
    assert "2 without a final answer skipped, 2 without a question skipped" in printed, printed
    table = pq.read_table(out / "train.parquet").to_pylist()
    assert [r["reward_model"]["ground_truth"] for r in table] == ["7"]
    assert not any(r["prompt"][0]["content"].startswith("None") for r in table)


def test_math_and_dapo_rows_without_a_question_are_skipped(tmp_path):
    """Old code: str(None) -> the question "None" for MATH-lighteval's problem and DAPO's user message."""
    math = tmp_path / "math" / "train.jsonl"
    math.parent.mkdir()
    math.write_text(
        json.dumps({"problem": None, "solution": "so \\boxed{3}"})
        + "\n"
        + json.dumps({"problem": "1+2?", "solution": "\\boxed{3}"})
        + "\n"
    )
    summary = prepare_data("math_lighteval", math, tmp_path / "m")
    assert summary["train"]["rows"] == 1 and summary["train"]["skipped_no_question"] == 1
    dapo = tmp_path / "dapo" / "train.jsonl"
    dapo.parent.mkdir()
    reward = {"ground_truth": "3", "style": "rule"}
    dapo.write_text(
        json.dumps({"prompt": [{"role": "user", "content": None}], "reward_model": reward, "data_source": "d"})
        + "\n"
        + json.dumps({"prompt": [{"role": "user", "content": "1+2?"}], "reward_model": reward, "data_source": "d"})
        + "\n"
    )
    summary = prepare_data("dapo_math", dapo, tmp_path / "d")
    assert summary["train"]["rows"] == 1 and summary["train"]["skipped_no_question"] == 1


def test_the_loader_refuses_a_null_message_content(tmp_path, tokenizer):
    """Old code: a chat message with "content": null became the prompt text "None"."""
    path = tmp_path / "train.jsonl"
    rows = [
        {"prompt": [{"role": "user", "content": "What is 1 + 1?"}], "answer": "2"},
        {"prompt": [{"role": "user", "content": None}], "answer": "3"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(UserError) as err:
        load_prompts([path], "prompt", tokenizer, 128)
    message = str(err.value)
    assert message.startswith(f"'{path}' row 1: a message in column 'prompt' (data.prompt_key) has no content (null)")


def test_training_reports_the_over_long_prompts_it_left_out_once(tmp_path, capsys):
    """Old code: data.overlong_prompts=filter dropped them without a word (only data.num_filtered knew)."""
    from gspo_ascend.config import load_config
    from gspo_ascend.runtime import prepare

    rows = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(4)]
    rows += [{"prompt": "What is 1 + 1? " * 40, "answer": "2"}]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    overrides = [
        f"model.path={ensure_tiny_model()}",
        f"data.train_files=[{data}]",
        "data.max_prompt_length=48",
        "data.train_batch_size=4",
        "trainer.total_steps=1",
        f"trainer.output_dir={tmp_path / 'run'}",
    ]
    run = prepare(load_config(None, overrides))
    assert len(run.dataset) == 4 and run.dataset.num_filtered == 1
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert warnings == [
        f"warning: 1 of 5 prompts in {data} are longer than data.max_prompt_length=48 tokens and were left out "
        "(data.overlong_prompts=filter; =error stops instead); raise data.max_prompt_length to keep them"
    ]
