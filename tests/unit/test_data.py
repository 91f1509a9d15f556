"""Data: preprocessors on small local fixtures in each public layout, the prompt loader, the resumable sampler."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gspo_ascend.data import INSTRUCTION, PromptSampler, load_prompts, prepare_data
from gspo_ascend.data.prepare import dapo_question, output_schema
from gspo_ascend.errors import UserError
from gspo_ascend.tiny import build_tokenizer

DAPO_HEAD = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_TAIL = '\n\nRemember to put your answer on its own line after "Answer:".'


def write_parquet(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_empty_parquet(path, columns):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.schema([(c, pa.string()) for c in columns]).empty_table(), path)
    return path


def read(path):
    table = pq.read_table(path)
    return table.schema, table.to_pylist()


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(seed=0)


# ----------------------------------------------------------------------------------------------- prepare


def test_gsm8k(tmp_path):
    src = tmp_path / "gsm8k" / "main"
    write_parquet(
        src / "train-00000-of-00001.parquet",
        [
            {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=<<3+4=7>>7\n#### 7"},
            {"question": "A farm earns 1,200 a day for 2 days.", "answer": "1200*2=2400\n#### 2,400"},
            {"question": "No final answer marker.", "answer": "just text"},
        ],
    )
    write_parquet(src / "test-00000-of-00001.parquet", [{"question": "1+1?", "answer": "#### 2"}])
    summary = prepare_data("gsm8k", src, tmp_path / "out")
    assert summary["train"]["rows"] == 2 and summary["train"]["skipped_no_answer"] == 1
    schema, rows = read(tmp_path / "out" / "train.parquet")
    assert schema.equals(output_schema())
    assert rows[0] == {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": f"Tom has 3 apples and buys 4. How many?\n{INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "7"},
        "extra_info": {"split": "train", "index": 0},
    }
    assert rows[1]["reward_model"]["ground_truth"] == "2400"  # thousands separator removed
    _, test_rows = read(tmp_path / "out" / "test.parquet")
    assert test_rows[0]["extra_info"] == {"split": "test", "index": 0}


def test_math_lighteval_jsonl(tmp_path):
    src = tmp_path / "math"
    write_jsonl(
        src / "train.jsonl",
        [
            {
                "problem": "Compute $1/2+0$.",
                "solution": "It is $\\boxed{\\frac{1}{2}}$.",
                "level": "Level 1",
                "type": "A",
            },
            {"problem": "No box.", "solution": "The answer is 3.", "level": "Level 2", "type": "A"},
        ],
    )
    summary = prepare_data("math_lighteval", src, tmp_path / "out")
    assert summary == {
        "train": {
            "rows": 1,
            "skipped_no_answer": 1,
            "skipped_no_question": 0,
            "duplicates_dropped": 0,
            "path": str(tmp_path / "out" / "train.parquet"),
        }
    }
    _, rows = read(tmp_path / "out" / "train.parquet")
    assert rows[0]["data_source"] == "DigitalLearningGmbH/MATH-lighteval"
    assert rows[0]["reward_model"]["ground_truth"] == "\\frac{1}{2}"
    assert not (tmp_path / "out" / "test.parquet").exists()


def test_dapo_math_rewrites_instruction_and_dedupes(tmp_path):
    row = {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": DAPO_HEAD + "Find $x$ if $x+1=3$." + DAPO_TAIL}],
        "ability": "MATH",
        "reward_model": {"ground_truth": "2", "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": "a-uuid"},
    }
    other = {**row, "prompt": [{"role": "user", "content": DAPO_HEAD + "Find $y$." + DAPO_TAIL}]}
    src = write_parquet(tmp_path / "dapo-math-17k.parquet", [row, row, other, row])
    summary = prepare_data("dapo_math", src, tmp_path / "out")
    assert summary["train"]["rows"] == 2 and summary["train"]["duplicates_dropped"] == 2
    _, rows = read(tmp_path / "out" / "train.parquet")
    assert rows[0]["prompt"][0]["content"] == f"Find $x$ if $x+1=3$.\n{INSTRUCTION}"
    assert rows[0]["data_source"] == "math_dapo"
    assert rows[0]["reward_model"] == {"style": "rule", "ground_truth": "2"}
    assert rows[1]["extra_info"] == {"split": "train", "index": 2}
    assert prepare_data("dapo_math", src, tmp_path / "all", dedupe=False)["train"]["rows"] == 4
    assert dapo_question("Plain question") == "Plain question"


def test_synthetic(tmp_path):
    summary = prepare_data("synthetic", None, tmp_path, num_train=32, num_test=8, seed=1)
    assert summary["train"]["rows"] == 32 and summary["test"]["rows"] == 8
    schema, rows = read(tmp_path / "train.parquet")
    assert schema.equals(output_schema())
    assert "\\boxed{}" in rows[0]["prompt"][0]["content"]
    a, op, b = rows[0]["prompt"][0]["content"].split("?")[0].split()[-3:]
    assert rows[0]["reward_model"]["ground_truth"] == str(int(a) + int(b) if op == "+" else int(a) - int(b))


@pytest.mark.parametrize(
    "setup, kind, fragment",
    [
        (lambda d: d / "missing.parquet", "gsm8k", "does not exist"),
        (
            lambda d: write_parquet(d / "train.parquet", [{"question": "q", "solution": "s"}]),
            "gsm8k",
            "no column 'answer'",
        ),
        (lambda d: write_jsonl(d / "train.jsonl", []), "gsm8k", "is empty"),
        (lambda d: write_empty_parquet(d / "train.parquet", ["question", "answer"]), "gsm8k", "it is empty"),
        (
            lambda d: write_parquet(d / "train.parquet", [{"question": "q", "answer": "a"}]),
            "gsm9k",
            "valid kinds: gsm8k",
        ),
        (lambda d: write_parquet(d / "empty" / "x.txt", []).parent.parent / "empty", "gsm8k", "no .parquet"),
    ],
)
def test_prepare_errors_are_one_line(tmp_path, setup, kind, fragment):
    with pytest.raises(UserError) as err:
        prepare_data(kind, setup(tmp_path), tmp_path / "out")
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_directory_scan_skips_metadata_json(tmp_path):
    write_parquet(tmp_path / "data" / "train-00000-of-00001.parquet", [{"question": "q", "answer": "#### 1"}])
    (tmp_path / "data" / "dataset_info.json").write_text('{"description": "metadata, not rows"}')
    assert prepare_data("gsm8k", tmp_path / "data", tmp_path / "out")["train"]["rows"] == 1


def test_prepare_refuses_several_dataset_folders(tmp_path):
    for sub in ("main", "socratic"):
        write_parquet(tmp_path / "gsm8k" / sub / "train.parquet", [{"question": "q", "answer": "#### 1"}])
    with pytest.raises(UserError, match="several folders \\(main, socratic\\)"):
        prepare_data("gsm8k", tmp_path / "gsm8k", tmp_path / "out")


def test_missing_column_names_present_columns(tmp_path):
    src = write_parquet(tmp_path / "train.parquet", [{"problem": "p", "solution": "s"}])
    with pytest.raises(UserError, match=r"no column 'question' \(columns present: \['problem', 'solution'\]\)"):
        prepare_data("gsm8k", src, tmp_path / "out")


# ----------------------------------------------------------------------------------------------- loader


@pytest.fixture
def prepared(tmp_path):
    prepare_data("synthetic", None, tmp_path, num_train=40, num_test=8)
    return tmp_path / "train.parquet"


def test_load_prompts_tokenizes_with_chat_template(prepared, tokenizer):
    data = load_prompts([prepared], "prompt", tokenizer, max_prompt_length=128)
    assert len(data) == 40 and data.num_filtered == 0
    rec = data[0]
    text = tokenizer.decode(rec.prompt_ids)
    assert text.startswith("<|im_start|>user\nWhat is") and text.endswith("<|im_start|>assistant\n")
    assert rec.ground_truth.isdigit()  # no 'answer' column: read from verl's reward_model.ground_truth
    assert rec.data_source == "gspo_ascend/synthetic_arithmetic" and rec.extra_info["split"] == "train"


def test_overlong_prompts_filter_or_error(tmp_path, tokenizer):
    rows = [{"prompt": "What is 1 + 1?", "answer": "2"}, {"prompt": "What is 1 + 1? " * 40, "answer": "2"}]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    data = load_prompts(str(path), "prompt", tokenizer, max_prompt_length=32, overlong="filter")
    assert len(data) == 1 and data.num_filtered == 1 and data[0].ground_truth == "2"
    with pytest.raises(UserError) as err:
        load_prompts(str(path), "prompt", tokenizer, max_prompt_length=32, overlong="error")
    message = str(err.value)
    assert f"'{path}' row 1" in message and "data.max_prompt_length=32" in message and "\n" not in message
    with pytest.raises(UserError, match="all 2 prompts .* longer than data.max_prompt_length=4"):
        load_prompts(str(path), "prompt", tokenizer, max_prompt_length=4)


def test_loader_errors(tmp_path, prepared, tokenizer):
    with pytest.raises(UserError, match="no prompt column 'question' .*columns present: .*'prompt'.*data.prompt_key"):
        load_prompts([prepared], "question", tokenizer, 128)
    with pytest.raises(UserError, match="does not exist"):
        load_prompts([tmp_path / "nope.parquet"], "prompt", tokenizer, 128)
    empty_jsonl = write_jsonl(tmp_path / "e.jsonl", [])
    empty_parquet = write_empty_parquet(tmp_path / "e.parquet", ["prompt", "answer"])
    for empty in (empty_jsonl, empty_parquet):
        with pytest.raises(UserError, match=f"'{empty}' is empty"):
            load_prompts([empty], "prompt", tokenizer, 128)


# ----------------------------------------------------------------------------------------------- sampler


def drain(sampler, k):
    return [sampler.next_batch() for _ in range(k)]


def test_sampler_deterministic_and_covers_each_epoch():
    a, b = PromptSampler(10, 3, seed=5), PromptSampler(10, 3, seed=5)
    first, second = drain(a, 6), drain(b, 6)
    assert first == second
    assert sorted(i for batch in first[:3] for i in batch) == sorted(set(i for batch in first[:3] for i in batch))
    assert first[:3] != first[3:6]  # a new shuffle each epoch (seed + epoch)
    assert a.state_dict()["epoch"] == 1 and PromptSampler(10, 3, seed=6).next_batch() != first[0]
    assert drain(PromptSampler(4, 2, shuffle=False), 3) == [[0, 1], [2, 3], [0, 1]]


@pytest.mark.parametrize("k", [0, 2, 3, 7])
def test_sampler_resume_matches_uninterrupted(k):
    reference = drain(PromptSampler(10, 3, seed=1), k + 5)
    interrupted = PromptSampler(10, 3, seed=1)
    drain(interrupted, k)
    state = json.loads(json.dumps(interrupted.state_dict()))  # as a checkpoint would store it
    resumed = PromptSampler(10, 3, seed=1)
    resumed.load_state_dict(state)
    assert drain(resumed, 5) == reference[k:]


def test_sampler_errors():
    with pytest.raises(UserError, match="fewer than data.train_batch_size=8"):
        PromptSampler(5, 8)
    sampler = PromptSampler(12, 4)
    with pytest.raises(UserError, match="num_prompts=10"):
        sampler.load_state_dict({**PromptSampler(10, 4).state_dict()})
