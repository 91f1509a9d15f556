"""Atomic checkpoints: crashes (exceptions, SIGKILL at every durability point) never yield a resumable
half-checkpoint; commit replaces; explicit resume paths are validated; damage after the commit (truncation,
same-size corruption) is found, announced, moved aside and fallen back from; RNG capture/restore replays draws."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap

import blake3
import numpy as np
import pytest
import torch

from gspo_ascend import checkpoint as ck
from gspo_ascend.errors import UserError
from tests.conftest import REPO

TS = ck.TRAINER_STATE
ABC_BLAKE3 = "6437b3ac38465133ffb63b75273a8db548c558465d79db03fd359c6cd5bd9d85"  # the BLAKE3 spec's vector for "abc"


def save(out, step, content: str, keep_last=None):
    """A stand-in for the engines' writers: a model file, a nested shard, and the content in trainer_state."""
    tmp = ck.begin(out, step)
    (tmp / "model.bin").write_bytes(content.encode() * 1000)
    (tmp / "shards").mkdir()
    (tmp / "shards" / "rank0.bin").write_bytes(content.encode() * 10)
    return ck.commit(tmp, step, {"content": content, "sampler": {"epoch": 0, "position": step}}, keep_last=keep_last)


def consistent(path) -> str:
    """The content a checkpoint holds, after checking its files agree with its trainer_state."""
    content = ck.load_trainer_state(path)["content"]
    assert (path / "model.bin").read_bytes() == content.encode() * 1000
    assert (path / "shards" / "rank0.bin").read_bytes() == content.encode() * 10
    return content


def hidden_entries(out) -> list[str]:
    return sorted(p.name for p in (out / ck.CHECKPOINT_DIR).iterdir() if p.name.startswith("."))


def test_begin_commit_layout_and_state_roundtrip(tmp_path):
    tmp = ck.begin(tmp_path, 7)
    assert tmp.parent == tmp_path / "checkpoints" and tmp.name == f".tmp-step_00000007-{os.getpid()}"
    assert list(tmp.iterdir()) == []
    (tmp / "stale.bin").write_text("x")
    tmp = ck.begin(tmp_path, 7)  # a second begin at the same step starts from an empty directory again
    assert list(tmp.iterdir()) == []
    (tmp / "model.bin").write_bytes(b"abc")
    final = ck.commit(tmp, 7, {"consumed_prompts": 56})
    assert final == tmp_path / "checkpoints" / "step_00000007" and not tmp.exists()
    assert sorted(p.name for p in final.iterdir()) == ["COMPLETE", "model.bin", "trainer_state.json"]
    assert ck.load_trainer_state(final) == {"consumed_prompts": 56, "step": 7}
    marker = json.loads((final / "COMPLETE").read_text())
    state_bytes = (final / TS).read_bytes()
    assert marker == {
        "step": 7,
        "files": {"model.bin": 3, "trainer_state.json": len(state_bytes)},
        "blake3": {"model.bin": ABC_BLAKE3, "trainer_state.json": blake3.blake3(state_bytes).hexdigest()},
    }
    assert ck.find_latest(tmp_path) == final
    assert ck.resolve_resume("auto", tmp_path) == final


def test_commit_rejects_mismatched_step(tmp_path):
    tmp = ck.begin(tmp_path, 3)
    with pytest.raises(ValueError, match="begin"):
        ck.commit(tmp, 4, {})
    with pytest.raises(ValueError, match="trainer_state"):
        ck.commit(tmp, 3, {"step": 2})
    assert ck.find_latest(tmp_path) is None


def test_find_latest_picks_highest_complete_step(tmp_path):
    assert ck.find_latest(tmp_path) is None  # no checkpoints/ directory at all
    for step in (2, 10, 9):
        save(tmp_path, step, f"s{step}")
    assert ck.find_latest(tmp_path).name == "step_00000010"
    assert [s for s, _ in ck.list_checkpoints(tmp_path)] == [2, 9, 10]


def test_writer_exception_leaves_nothing_resumable(tmp_path):
    good = save(tmp_path, 1, "A")
    with pytest.raises(RuntimeError):
        tmp = ck.begin(tmp_path, 2)
        (tmp / "model.bin").write_bytes(b"half")
        raise RuntimeError("writer failed")
    assert ck.find_latest(tmp_path) == good
    assert ck.resolve_resume("auto", tmp_path) == good
    with pytest.raises(UserError, match="not a committed checkpoint"):
        ck.resolve_resume(str(tmp), tmp_path)
    ck.abort(tmp)
    assert hidden_entries(tmp_path) == []


def test_half_written_final_directories_are_ignored(tmp_path):
    good = save(tmp_path, 1, "A")
    no_marker = tmp_path / "checkpoints" / "step_00000005"
    no_marker.mkdir()
    (no_marker / "model.bin").write_bytes(b"x")
    truncated = save(tmp_path, 4, "B")
    (truncated / "model.bin").write_bytes(b"B" * 10)  # shorter than the manifest says
    wrong_step = save(tmp_path, 3, "C")
    wrong_step.rename(tmp_path / "checkpoints" / "step_00000006")  # marker says 3, name says 6
    assert ck.find_latest(tmp_path) == good
    with pytest.raises(UserError, match="no valid COMPLETE marker") as e:
        ck.resolve_resume(str(no_marker), tmp_path)
    assert "\n" not in str(e.value) and str(good) in str(e.value)
    with pytest.raises(UserError, match="model.bin has 10 bytes"):
        ck.resolve_resume(str(truncated), tmp_path)
    with pytest.raises(UserError, match="marker is for step 3, not 6"):
        ck.resolve_resume(str(tmp_path / "checkpoints" / "step_00000006"), tmp_path)
    (good / "shards" / "rank0.bin").unlink()
    with pytest.raises(UserError, match="rank0.bin listed in COMPLETE is missing"):
        ck.resolve_resume(str(good), tmp_path)
    assert ck.find_latest(tmp_path) is None


def test_commit_replaces_an_existing_checkpoint(tmp_path):
    save(tmp_path, 2, "A")
    final = save(tmp_path, 2, "B")
    assert consistent(final) == "B"
    assert hidden_entries(tmp_path) == []
    assert [s for s, _ in ck.list_checkpoints(tmp_path)] == [2]


def test_resolve_resume_settings(tmp_path):
    assert ck.resolve_resume("auto", tmp_path) is None  # fresh run
    final = save(tmp_path, 3, "A")
    assert ck.resolve_resume("never", tmp_path) is None
    assert ck.resolve_resume("auto", tmp_path) == final
    other_run = tmp_path / "other"
    other = save(other_run, 1, "Z")
    assert ck.resolve_resume(str(other), tmp_path) == other.resolve()  # an explicit path wins over output_dir
    missing = tmp_path / "checkpoints" / "step_00000099"
    with pytest.raises(UserError) as e:
        ck.resolve_resume(str(missing), tmp_path)
    msg = str(e.value)
    assert "trainer.resume" in msg and str(missing) in msg and "does not exist" in msg and "\n" not in msg
    for run_like in (other_run, other_run / "checkpoints"):
        with pytest.raises(UserError, match="is a run directory") as e:
            ck.resolve_resume(str(run_like), tmp_path)
        assert str(other) in str(e.value)  # points at the checkpoint to pass instead


def test_keep_last_prunes_oldest_complete_only(tmp_path):
    incomplete = tmp_path / "checkpoints" / "step_00000000"
    incomplete.mkdir(parents=True)
    for step in range(1, 6):
        save(tmp_path, step, f"s{step}", keep_last=2)
    assert [s for s, _ in ck.list_checkpoints(tmp_path)] == [4, 5]
    assert incomplete.is_dir()  # not ours to judge: never counted, never deleted
    assert ck.prune(tmp_path, 1) == [tmp_path / "checkpoints" / "step_00000004"]
    with pytest.raises(ValueError):
        ck.prune(tmp_path, 0)


def test_cleanup_stale_removes_temp_dirs_and_restores_moved_aside(tmp_path):
    save(tmp_path, 1, "A")
    moved = save(tmp_path, 2, "B")
    root = tmp_path / "checkpoints"
    old = root / ".old-step_00000002-999999999"
    moved.rename(old)  # a kill between moving the old step_2 aside and renaming the new one in
    dead_tmp = root / ".tmp-step_00000003-999999998"
    dead_tmp.mkdir()
    (dead_tmp / "model.bin").write_bytes(b"half")
    own_tmp = ck.begin(tmp_path, 4)  # this process's own save in progress: left alone
    assert ck.find_latest(tmp_path).name == "step_00000001"
    removed = ck.cleanup_stale(tmp_path)
    assert removed == [dead_tmp]
    assert consistent(ck.find_latest(tmp_path)) == "B"
    assert hidden_entries(tmp_path) == [own_tmp.name]


def test_load_trainer_state_errors_are_one_line(tmp_path):
    final = save(tmp_path, 1, "A")
    (final / TS).write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON") as e:
        ck.load_trainer_state(final)
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="cannot read"):
        ck.load_trainer_state(tmp_path)


# --- damage after the commit (issue 18, defects 2 and 3) ---------------------------------------------------


def flip_byte(path, offset=None):
    """Same-size corruption: one byte inverted (the middle one by default)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if offset is None else offset] ^= 0xFF
    path.write_bytes(bytes(data))


def damaged_entries(out) -> list[str]:
    return sorted(p.name for p in (out / ck.CHECKPOINT_DIR).iterdir() if p.name.startswith(ck.DAMAGED_PREFIX))


def test_auto_resume_announces_moves_aside_and_falls_back_from_a_truncated_checkpoint(tmp_path, capsys):
    good = save(tmp_path, 1, "A")
    bad = save(tmp_path, 2, "B")
    (bad / "model.bin").write_bytes(b"B" * 10)  # truncated after the commit
    assert ck.resolve_resume("auto", tmp_path) == good
    (line,) = capsys.readouterr().err.strip().splitlines()  # said once, in one line
    assert line.startswith(f"warning: checkpoint {bad} is damaged (file model.bin has 10 bytes, COMPLETE says 1000)")
    assert line.endswith("moved to damaged-step_00000002, resuming from step_00000001")
    evidence = tmp_path / "checkpoints" / "damaged-step_00000002"
    assert not bad.exists() and (evidence / "model.bin").read_bytes() == b"B" * 10
    # the run then saves step 2 again, and later ones with keep_last: the evidence is neither overwritten nor pruned
    assert consistent(save(tmp_path, 2, "C")) == "C"
    save(tmp_path, 3, "D", keep_last=1)
    assert (evidence / "model.bin").read_bytes() == b"B" * 10 and damaged_entries(tmp_path) == [evidence.name]
    assert [s for s, _ in ck.list_checkpoints(tmp_path)] == [3]


def test_same_size_corruption_is_caught_by_the_checksum(tmp_path, capsys):
    good = save(tmp_path, 1, "A")
    bad = save(tmp_path, 2, "B")
    flip_byte(bad / "shards" / "rank0.bin")
    assert ck.checkpoint_problem(bad) is None  # sizes alone cannot see it
    problem = "file shards/rank0.bin does not match its blake3 checksum in COMPLETE (its content changed)"
    assert ck.checkpoint_problem(bad, verify=True) == problem
    with pytest.raises(UserError) as e:  # an explicit path is verified too, and refused in one line
        ck.resolve_resume(str(bad), tmp_path)
    assert problem in str(e.value) and str(good) in str(e.value) and "\n" not in str(e.value)
    assert ck.resolve_resume("auto", tmp_path) == good
    assert f"warning: checkpoint {bad} is damaged ({problem})" in capsys.readouterr().err
    assert damaged_entries(tmp_path) == ["damaged-step_00000002"]


def test_older_damaged_checkpoints_are_announced_and_moved_aside_too(tmp_path, capsys):
    old = save(tmp_path, 1, "A")
    (old / "model.bin").unlink()
    latest = save(tmp_path, 2, "B")
    assert ck.resolve_resume("auto", tmp_path) == latest
    assert capsys.readouterr().err.strip().endswith("moved to damaged-step_00000001, not resumed from")
    assert damaged_entries(tmp_path) == ["damaged-step_00000001"]


def test_every_checkpoint_damaged_refuses_in_one_line_and_moves_nothing(tmp_path):
    first, second = save(tmp_path, 1, "A"), save(tmp_path, 2, "B")
    (first / "model.bin").unlink()
    flip_byte(second / "model.bin")
    with pytest.raises(UserError) as e:  # not a silent fresh start that would replace the run's history
        ck.resolve_resume("auto", tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and "trainer.resume" in msg and "every checkpoint" in msg and "trainer.resume=never" in msg
    assert "step_00000002: file model.bin does not match its blake3 checksum" in msg
    assert "step_00000001: file model.bin listed in COMPLETE is missing" in msg
    assert first.is_dir() and second.is_dir() and damaged_entries(tmp_path) == []


def test_commit_moves_a_damaged_checkpoint_aside_instead_of_deleting_it(tmp_path, capsys):
    bad = save(tmp_path, 2, "A")
    (bad / "model.bin").write_bytes(b"x")
    assert consistent(save(tmp_path, 2, "B")) == "B"
    assert (tmp_path / "checkpoints" / "damaged-step_00000002" / "model.bin").read_bytes() == b"x"
    assert "replaced by this save" in capsys.readouterr().err
    assert consistent(save(tmp_path, 2, "C")) == "C"  # an intact one is replaced as before
    assert damaged_entries(tmp_path) == ["damaged-step_00000002"] and hidden_entries(tmp_path) == []


def test_markers_from_before_checksums_are_checked_by_size(tmp_path):
    final = save(tmp_path, 1, "A")
    marker = json.loads((final / "COMPLETE").read_text())
    del marker["blake3"]
    (final / "COMPLETE").write_text(json.dumps(marker))
    assert ck.resolve_resume("auto", tmp_path) == final
    (final / "model.bin").write_bytes(b"A")
    assert "model.bin has 1 bytes" in ck.checkpoint_problem(final, verify=True)


# --- SIGKILL ------------------------------------------------------------------------------------------------

KILL_DURING_WRITE = """
import sys, time
from gspo_ascend import checkpoint as ck
out = sys.argv[1]
tmp = ck.begin(out, 1); (tmp / "model.bin").write_bytes(b"A" * 1000); ck.commit(tmp, 1, {"content": "A"})
tmp = ck.begin(out, 2)
with open(tmp / "model.bin", "wb") as f:
    f.write(b"B" * 500)
    f.flush()
    print("WRITING", flush=True)
    time.sleep(60)
"""

# SIGKILLs itself at the k-th fsync / rename / unlink / rmdir inside commit(): every durability point in turn
KILL_AT_K = """
import os, signal, sys
from gspo_ascend import checkpoint as ck
out, content, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
tmp = ck.begin(out, 2)
(tmp / "model.bin").write_bytes(content.encode() * 1000)
(tmp / "shards").mkdir()
(tmp / "shards" / "rank0.bin").write_bytes(content.encode() * 10)
calls = 0
def hook(real):
    def wrapped(*args, **kwargs):
        global calls
        calls += 1
        if calls == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)
    return wrapped
for name in ("fsync", "rename", "unlink", "rmdir"):
    setattr(os, name, hook(getattr(os, name)))
ck.commit(tmp, 2, {"content": content, "sampler": {"epoch": 0, "position": 2}})
print("DONE", calls)
"""


def _python(script: str, *args: str, **kwargs):
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


@pytest.mark.slow
def test_sigkill_while_writing_leaves_previous_checkpoint(tmp_path):
    proc = _python(KILL_DURING_WRITE, str(tmp_path))
    try:
        assert proc.stdout.readline().strip() == "WRITING", proc.stderr.read()
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        proc.kill()
        proc.wait()
    latest = ck.find_latest(tmp_path)
    assert latest.name == "step_00000001" and ck.resolve_resume("auto", tmp_path) == latest
    (half,) = [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".tmp-step_00000002-")]
    assert (half / "model.bin").stat().st_size == 500
    with pytest.raises(UserError):
        ck.resolve_resume(str(half), tmp_path)
    assert ck.cleanup_stale(tmp_path) == [half]
    assert hidden_entries(tmp_path) == []


@pytest.mark.slow
@pytest.mark.parametrize("replacing", [False, True], ids=["new", "replace"])
def test_sigkill_at_every_commit_point_is_atomic(tmp_path, replacing):
    base = tmp_path / "base"
    save(base, 1, "A")
    if replacing:
        save(base, 2, "A2")
    before = "A2" if replacing else "A"
    seen, k = set(), 0
    while True:
        k += 1
        assert k < 60, "commit never completed"
        out = tmp_path / f"k{k}"
        shutil.copytree(base, out)
        proc = _python(KILL_AT_K, str(out), "B", str(k))
        stdout, stderr = proc.communicate(timeout=60)
        done = proc.returncode == 0
        assert done or proc.returncode == -signal.SIGKILL, stderr
        # before any repair: whatever find_latest returns is complete and self-consistent
        got = consistent(ck.find_latest(out))
        assert got in {before, "A", "B"} and ck.resolve_resume("auto", out) == ck.find_latest(out)
        ck.cleanup_stale(out)
        after = consistent(ck.find_latest(out))
        assert after in {before, "B"} and hidden_entries(out) == []
        assert ck.find_latest(out).name == ("step_00000002" if replacing or after == "B" else "step_00000001")
        seen.add(after)
        if done:
            assert after == "B" and stdout.startswith("DONE")
            break
    assert seen == {before, "B"} and k > 8  # the kills landed on both sides of the commit point


# --- RNG ----------------------------------------------------------------------------------------------------


def _draws():
    return (
        random.random(),
        random.gauss(0.0, 1.0),
        np.random.rand(3).tolist(),
        float(np.random.normal()),
        torch.rand(3).tolist(),
        torch.randn(2).tolist(),
    )


def test_rng_capture_restore_replays_the_same_draws(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.gauss(0.0, 1.0)  # leaves a cached second gaussian in both Python and numpy state
    np.random.normal()
    state = ck.capture_rng()
    assert set(state) == {"python", "numpy", "torch_cpu"}
    json.loads(json.dumps(state))  # JSON friendly as well as torch-save friendly
    first = _draws()
    assert _draws() != first  # the streams move on, so equality below means restore worked
    ck.restore_rng(state)
    assert _draws() == first
    ck.restore_rng(state)
    ck.save_rng(tmp_path)  # rng.pt, loaded with weights_only=True
    _draws()
    ck.load_rng(tmp_path)
    assert _draws() == first
    with pytest.raises(UserError, match="rng.pt is missing"):
        ck.load_rng(tmp_path / "nowhere")
