"""Bad input to `gspo-ascend train`: one line naming the file/key and the fix, exit code 2, no traceback, and
nothing started (these all fail in the host-side preparation, before Ray or any engine)."""

from __future__ import annotations

import json

import pytest

from gspo_ascend.cli import main
from gspo_ascend.tiny import ensure_tiny_model


@pytest.fixture(scope="module")
def tiny():
    return str(ensure_tiny_model())


def run_main(capsys, *args: str) -> tuple[int, str]:
    code = main(["train", *args])
    captured = capsys.readouterr()
    return code, captured.err


def assert_one_line(code: int, err: str, *fragments: str) -> None:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_missing_dataset_file(capsys, tmp_path, tiny):
    missing = tmp_path / "nope.parquet"
    code, err = run_main(
        capsys, f"model.path={tiny}", f"data.train_files=[{missing}]", f"trainer.output_dir={tmp_path}"
    )
    assert_one_line(code, err, str(missing), "does not exist", "data.train_files")


def test_dataset_without_prompt_column(capsys, tmp_path, tiny):
    data = write_jsonl(tmp_path / "d.jsonl", [{"question": "1+1?", "answer": "2"}])
    code, err = run_main(capsys, f"model.path={tiny}", f"data.train_files=[{data}]", f"trainer.output_dir={tmp_path}")
    assert_one_line(code, err, "d.jsonl", "no prompt column 'prompt'", "data.prompt_key")


def test_empty_dataset(capsys, tmp_path, tiny):
    data = tmp_path / "empty.jsonl"
    data.write_text("")
    code, err = run_main(capsys, f"model.path={tiny}", f"data.train_files=[{data}]", f"trainer.output_dir={tmp_path}")
    assert_one_line(code, err, "empty.jsonl", "empty")


def test_missing_model_path(capsys, tmp_path):
    code, err = run_main(capsys, f"model.path={tmp_path / 'no-model'}", f"trainer.output_dir={tmp_path}")
    assert_one_line(code, err, "model.path", "no-model", "does not exist")


def test_missing_weights_of_a_model_with_a_builtin_spec(capsys, tmp_path):
    # --dry-run, plan and doctor accept this path through the built-in spec; training needs the weights
    missing = tmp_path / "Qwen3-8B"
    code, err = run_main(capsys, f"model.path={missing}", f"trainer.output_dir={tmp_path / 'run'}")
    assert_one_line(code, err, f"model.path '{missing}' does not exist", "training needs the weights of Qwen/Qwen3-8B")
    assert not (tmp_path / "run").exists()


def test_unknown_reward_function(capsys, tmp_path):
    code, err = run_main(capsys, "reward.reward_fn=no_such_module_xyz:score", f"trainer.output_dir={tmp_path}")
    assert_one_line(code, err, "no_such_module_xyz")


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        (["trainer.devices_per_node=3"], ["data.train_batch_size", "data-parallel size (3"]),
        (
            [
                "data.train_batch_size=2",
                "rollout.n=3",
                "algorithm.minibatches_per_rollout=2",
                "trainer.devices_per_node=2",
            ],
            ["rollout.n", "minibatches_per_rollout (2)", "data-parallel size (2)"],
        ),
        (["algorithm.minibatches_per_rollout=5"], ["algorithm.minibatches_per_rollout", "divide"]),
    ],
)
def test_batch_sizes_that_do_not_divide(capsys, tmp_path, overrides, fragments):
    code, err = run_main(capsys, *overrides, f"trainer.output_dir={tmp_path}")
    assert_one_line(code, err, *fragments)


@pytest.mark.parametrize("key", ["data.max_prompt_length", "data.max_response_length"])
@pytest.mark.parametrize("value", [0, -4])
def test_non_positive_lengths(capsys, tmp_path, key, value):
    code, err = run_main(capsys, f"{key}={value}", f"trainer.output_dir={tmp_path}")
    assert_one_line(code, err, key, "must be > 0")


def test_nothing_written_on_bad_input(capsys, tmp_path):
    out = tmp_path / "run"
    code, _ = run_main(capsys, "data.max_response_length=0", f"trainer.output_dir={out}")
    assert code == 2 and not out.exists()


# --- validation (trainer.test_freq, data.val_files) and `gspo-ascend eval` --------------------------------------


@pytest.fixture
def train_file(tmp_path):
    return write_jsonl(
        tmp_path / "train.jsonl", [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(16)]
    )


def write_empty_parquet(path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "answer": pa.array([], pa.string())}), path)
    return str(path)


@pytest.mark.parametrize(
    ("val_file", "fragments"),
    [
        (lambda d: str(d / "nope.parquet"), ["data.val_files", "nope.parquet", "does not exist"]),
        (lambda d: write_jsonl(d / "empty.jsonl", []), ["data.val_files", "empty.jsonl", "empty"]),
        (lambda d: write_empty_parquet(d / "empty.parquet"), ["data.val_files", "empty.parquet", "empty (no rows)"]),
    ],
)
def test_missing_or_empty_val_file(capsys, tmp_path, tiny, train_file, val_file, fragments):
    out = tmp_path / "run"
    args = (f"model.path={tiny}", f"data.train_files=[{train_file}]", f"trainer.output_dir={out}")
    code, err = run_main(capsys, *args, f"data.val_files=[{val_file(tmp_path)}]", "trainer.test_freq=2")
    assert_one_line(code, err, *fragments)
    assert not out.exists()  # refused before Ray, before the run directory


def test_validation_on_without_val_files(capsys, tmp_path, tiny, train_file):
    # configs/tiny_gspo.yaml validates; with the user's own data there is no held-out split to fall back on
    code, err = run_main(
        capsys, f"model.path={tiny}", f"data.train_files=[{train_file}]", f"trainer.output_dir={tmp_path}"
    )
    assert_one_line(code, err, "data.val_files is empty", "trainer.test_freq=0 trainer.val_before_train=false")


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        (["trainer.test_freq=-1"], ["'trainer.test_freq' must be >= 0"]),
        (
            ["validation.greedy=false", "validation.n=4", "validation.k=[2,8]"],
            ["validation.k", "k=8", "validation.n (samples per prompt, 4)"],
        ),
    ],
)
def test_bad_validation_keys(capsys, tmp_path, overrides, fragments):
    code, err = run_main(capsys, *overrides, f"trainer.output_dir={tmp_path / 'run'}")
    assert_one_line(code, err, *fragments)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--data", "{tmp}/nope.parquet"], ["data.val_files", "nope.parquet", "does not exist"]),
        (["--data", "{train}", "validation.k=[3]"], ["validation.k", "k=3"]),
        ([], ["eval needs prompts", "--data"]),
        (["--data", "{train}", "--model", "{tmp}/no-model"], ["model.path", "no-model", "does not exist"]),
    ],
)
def test_eval_bad_input_is_one_line(capsys, tmp_path, tiny, train_file, args, fragments):
    args = [a.format(tmp=tmp_path, train=train_file) for a in args]
    model = ["--model", tiny] if "--model" not in args else []
    code = main(["eval", *model, *args, "--output", str(tmp_path / "out")])
    assert_one_line(code, capsys.readouterr().err, *fragments)
    assert not (tmp_path / "out").exists()
