"""Resuming with a changed config (issue 18, defect 4): safe keys are applied and listed, the rest refused in one
line naming the keys, another model refused, total_steps below the checkpoint refused, and none of it rewrites
config.json before the decision. The lr actually applied by the engine: tests/unit/test_fsdp_engine.py."""

from __future__ import annotations

import json
import shutil

import pytest

from gspo_ascend import checkpoint as ck
from gspo_ascend import resume
from gspo_ascend.config import Config, load_config, valid_keys
from gspo_ascend.errors import UserError
from gspo_ascend.tiny import default_tiny_dir, ensure_tiny_model

SMALL = ("data.train_batch_size=8", "rollout.n=4")


@pytest.fixture(scope="module")
def tiny() -> str:
    return str(ensure_tiny_model())


def cfg_of(out, *overrides: str) -> Config:
    return load_config(overrides=[f"trainer.output_dir={out}", *SMALL, *overrides])


def checkpoint_of(out, step: int, cfg: Config, model_path: str, record: bool = True):
    """A committed checkpoint whose trainer_state records ``cfg`` (what trainer.save_checkpoint writes)."""
    tmp = ck.begin(out, step)
    (tmp / "engine.bin").write_bytes(b"w" * 64)
    extra = resume.state_record(cfg, model_path) if record else {}
    return ck.commit(tmp, step, {"sampler": {"epoch": 0, "position": step}, **extra})


def test_every_applied_key_is_in_the_schema():
    keys = set(valid_keys())
    assert set(resume.APPLIED) <= keys, set(resume.APPLIED) - keys
    assert set(resume.NOT_COMPARED) <= keys
    assert any(k.startswith(resume.APPLIED_PREFIXES) for k in keys)


def test_unchanged_and_safe_changes_resume(tmp_path, tiny, capsys):
    path = checkpoint_of(tmp_path, 3, cfg_of(tmp_path), tiny)
    assert resume.check_resume(cfg_of(tmp_path), path, tiny) == 3
    assert capsys.readouterr().out == ""
    other_dir = tmp_path / "moved"  # where a run lives is not what it is
    new = cfg_of(other_dir, "actor.lr=5e-4", "trainer.total_steps=40", "trainer.save_freq=5", "trainer.resume=auto")
    assert resume.check_resume(new, path, tiny) == 3
    assert capsys.readouterr().out.strip() == (
        "resume: config changed since step_00000003, applied from step 4: actor.lr (1e-06 -> 0.0005), "
        "trainer.save_freq (0 -> 5), trainer.total_steps (20 -> 40)"  # from the schema's defaults
    )


def test_unsafe_changes_are_refused_in_one_line_naming_the_keys(tmp_path, tiny):
    path = checkpoint_of(tmp_path, 3, cfg_of(tmp_path), tiny)
    with pytest.raises(UserError) as e:
        resume.check_resume(cfg_of(tmp_path, "data.train_batch_size=16", "algorithm.loss=grpo"), path, tiny)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"cannot resume from {path}: config keys changed since it was saved")
    # ppo_mini_batch_size follows train_batch_size (a quarter of it): both named, with old and new values
    assert (
        'actor.ppo_mini_batch_size (2 -> 4), algorithm.loss ("gspo" -> "grpo"), data.train_batch_size (8 -> 16)' in msg
    )
    assert "trainer.resume=never" in msg and "docs/operations.md" in msg


def test_total_steps_below_the_checkpoint_is_refused(tmp_path, tiny):
    path = checkpoint_of(tmp_path, 3, cfg_of(tmp_path), tiny)
    with pytest.raises(UserError, match=r"'trainer.total_steps' \(2\) is below the step of the checkpoint"):
        resume.check_resume(cfg_of(tmp_path, "trainer.total_steps=2"), path, tiny)
    assert resume.check_resume(cfg_of(tmp_path, "trainer.total_steps=3"), path, tiny) == 3  # complete: no error


def test_another_model_is_refused_and_a_moved_one_accepted(tmp_path, tiny, capsys):
    path = checkpoint_of(tmp_path, 3, cfg_of(tmp_path), tiny)
    moe = str(ensure_tiny_model(moe=True))
    with pytest.raises(UserError) as e:
        resume.check_resume(cfg_of(tmp_path, f"model.path={moe}"), path, moe)
    msg = str(e.value)
    assert "\n" not in msg and "config key 'model.path' names another model" in msg
    assert 'model_type "qwen3" -> "qwen3_moe"' in msg and "num_experts null -> 4" in msg
    moved = tmp_path / "local-copy"
    shutil.copytree(default_tiny_dir(), moved)
    assert resume.check_resume(cfg_of(tmp_path, f"model.path={moved}"), path, str(moved)) == 3
    assert "model.path changed" in capsys.readouterr().err


def test_a_checkpoint_without_a_recorded_config_is_resumed_with_a_note(tmp_path, tiny, capsys):
    path = checkpoint_of(tmp_path, 2, cfg_of(tmp_path), tiny, record=False)
    assert resume.check_resume(cfg_of(tmp_path, "data.train_batch_size=16"), path, tiny) == 2
    assert "records no config" in capsys.readouterr().err


def test_keys_added_after_the_checkpoint_compare_with_their_default(tmp_path, tiny):
    path = checkpoint_of(tmp_path, 3, cfg_of(tmp_path), tiny)
    state = json.loads((path / ck.TRAINER_STATE).read_text())
    del state["config"]["algorithm"]["kl_coef"]  # as if written before the key existed
    assert resume.changed_keys(state["config"], cfg_of(tmp_path)) == []
    assert resume.changed_keys(state["config"], cfg_of(tmp_path, "algorithm.kl_coef=0.1")) == [
        ("algorithm.kl_coef", 0.0, 0.1)
    ]


# ----------------------------------------------------------------------------------------------- prepare()


def test_prepare_refuses_before_config_json_is_rewritten(tmp_path, tiny):
    """The decision comes before the run directory is written: a refused resume leaves config.json as it was."""
    from gspo_ascend.runtime import prepare

    checkpoint_of(tmp_path, 3, cfg_of(tmp_path), tiny)
    (tmp_path / "config.json").write_text('{"written by": "the run that saved step 3"}')
    for overrides in (("data.train_batch_size=16",), ("trainer.total_steps=2",)):
        with pytest.raises(UserError):
            prepare(cfg_of(tmp_path, *overrides))
        assert (tmp_path / "config.json").read_text() == '{"written by": "the run that saved step 3"}'
        assert not (tmp_path / "run.lock").exists()  # a refused start leaves the directory free
    run = prepare(cfg_of(tmp_path, "actor.lr=5e-4"))
    try:
        assert run.start_step == 3 and json.loads((tmp_path / "config.json").read_text())["actor"]["lr"] == 5e-4
    finally:
        run.lock.release()


def test_load_failure_is_one_line_naming_the_checkpoint_and_the_previous_one(tmp_path, tiny):
    first = checkpoint_of(tmp_path, 1, cfg_of(tmp_path), tiny)
    second = checkpoint_of(tmp_path, 2, cfg_of(tmp_path), tiny)
    error = RuntimeError("PytorchStreamReader failed reading zip archive: failed finding central directory\n  ...")
    msg = str(resume.load_failure(second, error))
    assert msg == (
        f"cannot load checkpoint {second} into the train engine (RuntimeError: PytorchStreamReader failed reading "
        f"zip archive: failed finding central directory); resume from another checkpoint or start a new run: "
        f"trainer.resume={first}"
    )
    refusal = UserError("checkpoint 'x' was written with parallel layout tp2, this run is tp1; resume with ...")
    wrapped = RuntimeError("ray task failed")
    wrapped.cause = refusal  # Ray keeps the worker's own exception here
    assert resume.load_failure(second, wrapped) is refusal  # its own line and exit code

    class Lost(UserError):
        exit_code = 1

    lost = Lost("a training worker died")
    assert resume.load_failure(second, lost) is lost
