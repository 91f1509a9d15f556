"""The run directory (issue 18, defects 1 and 6): one run per trainer.output_dir (a lock with its owner and
stale-lock recovery), an unwritable output_dir refused in one line by --dry-run and by the run, and a full disk
said as "No space left on device" with where, for a real ENOSPC under torch.save's own error text."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gspo_ascend import rundir
from gspo_ascend.cli import main
from gspo_ascend.config import load_config
from gspo_ascend.errors import UserError
from tests.conftest import REPO

HOLD_LOCK = """
import sys, time
from gspo_ascend.rundir import acquire
acquire(sys.argv[1])
print("HELD", flush=True)
time.sleep(300)
"""


def python(script: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script), *args], cwd=REPO, stdout=subprocess.PIPE, text=True
    )


@pytest.fixture
def holder(tmp_path):
    """Another process holding tmp_path/run's lock until killed."""
    out = tmp_path / "run"
    out.mkdir()
    proc = python(HOLD_LOCK, str(out))
    try:
        assert proc.stdout.readline().strip() == "HELD"
        yield proc, out
    finally:
        proc.kill()
        proc.wait()


def one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg, msg
    return msg


# ----------------------------------------------------------------------------------------------- the lock


def test_a_second_run_stops_in_one_line_before_touching_the_directory(holder, capsys):
    """Defect 1: run B in run A's directory used to exit 0, replacing A's config.json and metrics and deleting A's
    in-flight checkpoint directory in its start-up clean-up."""
    from gspo_ascend.runtime import prepare

    proc, out = holder
    in_flight = out / "checkpoints" / f".tmp-step_00000003-{proc.pid}"
    in_flight.mkdir(parents=True)
    (in_flight / "model.bin").write_bytes(b"A" * 100)
    (out / "config.json").write_text('{"run": "A"}')
    cfg = load_config(overrides=[f"trainer.output_dir={out}", "data.train_batch_size=8", "rollout.n=4"])
    with pytest.raises(UserError) as e:
        prepare(cfg)
    msg = one_line(e)
    assert f"in use by another run (pid {proc.pid} on host {socket.gethostname()}, started " in msg
    assert str(out / "run.lock") in msg and "trainer.output_dir" in msg
    assert (in_flight / "model.bin").read_bytes() == b"A" * 100  # A's save in progress survives
    assert (out / "config.json").read_text() == '{"run": "A"}'

    proc.kill()  # A dies without releasing: same host, dead pid = a stale lock, replaced and said once
    proc.wait()
    run = prepare(cfg)
    try:
        lines = capsys.readouterr().err.strip().splitlines()
        (note,) = [line for line in lines if "stale lock" in line]  # said once
        host = socket.gethostname()
        assert note.startswith(f"note: replaced the stale lock {out / 'run.lock'} of pid {proc.pid} on host {host}")
        assert note.endswith(f": process {proc.pid} is no longer running")
        owner = json.loads((out / "run.lock").read_text())
        assert owner["pid"] == os.getpid() and owner["host"] == socket.gethostname()
    finally:
        run.lock.release()
    assert not (out / "run.lock").exists()


def test_a_lock_from_another_host_is_never_taken_over(tmp_path):
    record = {**rundir.owner_record(), "host": "node-7", "pid": 4242, "started": "2026-01-02 03:04:05 +0000"}
    (tmp_path / "run.lock").write_text(json.dumps(record))
    assert rundir.stale_reason(record) is None  # its PIDs cannot be seen from here
    with pytest.raises(UserError) as e:
        rundir.acquire(tmp_path)
    msg = one_line(e)
    assert "pid 4242 on host node-7, started 2026-01-02 03:04:05 +0000" in msg
    assert f"if that run is gone (its node died), delete {tmp_path / 'run.lock'}" in msg
    assert json.loads((tmp_path / "run.lock").read_text()) == record  # untouched


def test_stale_means_this_host_and_a_gone_or_reused_pid(tmp_path):
    me = rundir.owner_record()
    assert rundir.stale_reason(me) is None  # this very process: alive
    reused = {**me, "pid_start_ticks": me["pid_start_ticks"] - 1}  # same PID, started at another time
    assert rundir.stale_reason(reused) == f"PID {os.getpid()} now belongs to another process, started later"
    assert rundir.stale_reason({**me, "pid_namespace": "other"}) is None  # another container on this host
    assert rundir.stale_reason({**me, "boot_id": "other"}) is None  # same name, other boot: maybe another node


def test_the_lock_is_released_only_by_its_owner(tmp_path):
    lock = rundir.acquire(tmp_path)
    with pytest.raises(UserError, match=f"pid {os.getpid()} on host"):  # not re-entrant: the owner is alive
        rundir.acquire(tmp_path)
    later = {**lock.owner, "pid": lock.owner["pid"] + 1}
    (tmp_path / "run.lock").write_text(json.dumps(later))  # a user deleted it and another run took it
    lock.release()
    assert json.loads((tmp_path / "run.lock").read_text()) == later
    (tmp_path / "run.lock").unlink()
    lock.release()  # already gone: nothing to do


def test_an_unreadable_lock_is_refused(tmp_path):
    (tmp_path / "run.lock").write_text("")
    with pytest.raises(UserError) as e:
        rundir.acquire(tmp_path)
    assert "an unreadable lock ('')" in one_line(e)


# ----------------------------------------------------------------------------------------------- writable


def test_an_unwritable_output_dir_is_one_line_for_dry_run_and_for_the_run(tmp_path, capsys):
    """Defect 6: --dry-run said the config was fine and the run died in a raw traceback (rc 1)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    out = blocker / "run"
    code = main(["train", "--dry-run", f"trainer.output_dir={out}"])
    captured = capsys.readouterr()
    assert code == 2
    assert f"[fail] output-dir: config key 'trainer.output_dir': cannot write the run directory {out}" in captured.out
    assert f"{blocker} is a file, not a directory" in captured.out
    code = main(["train", f"trainer.output_dir={out}"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert err.startswith(f"error: config key 'trainer.output_dir': cannot write the run directory {out}: {blocker}")


def test_dry_run_warns_about_a_directory_in_use(holder, capsys):
    proc, out = holder
    assert main(["train", "--dry-run", f"trainer.output_dir={out}"]) == 0
    assert f"[warn] output-dir: {out} is in use by another run (pid {proc.pid} on host" in capsys.readouterr().out


# ----------------------------------------------------------------------------------------------- disk full


def test_no_space_is_found_in_the_chain_and_in_forwarded_text(tmp_path):
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/data/run/metrics.jsonl")
    try:
        try:
            raise full
        except OSError as inner:
            raise RuntimeError("unexpected pos 704 vs 598") from inner
    except RuntimeError as outer:
        assert rundir.no_space(outer) == "No space left on device"
    remote = RuntimeError("ray::PolicyWorker.save_hf() ...\nOSError: [Errno 122] Disk quota exceeded")
    assert rundir.no_space(remote) == "Disk quota exceeded"
    wrapped = RuntimeError("task failed")
    wrapped.cause = OSError(errno.EDQUOT, "quota")  # Ray's RayTaskError keeps the worker's exception here
    assert rundir.no_space(wrapped) == "Disk quota exceeded"
    plain = RuntimeError("unexpected pos 704 vs 598")
    assert rundir.no_space(plain) is None and rundir.no_space(plain, tmp_path) is None  # the probe fits here
    assert not list(tmp_path.iterdir())  # and is removed


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
        capture_output=True,
    )
    return probe.returncode == 0


needs_tmpfs = pytest.mark.skipif(
    not _unshare_works(), reason="needs unprivileged user + mount namespaces (unshare -rm) to mount a small tmpfs"
)


def in_small_tmpfs(mount: Path, code: str, arg: str, options: str = "size=1m") -> subprocess.CompletedProcess:
    """``python -c code arg`` with a fresh 1 MiB tmpfs (``options``) mounted at ``mount``, in its own user and mount
    namespace."""
    mount.mkdir()
    script = f'mount -t tmpfs -o {options} tmpfs {mount} && exec "$@"'
    return subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script, "sh"]
        + [sys.executable, "-c", textwrap.dedent(code), arg],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )


# A checkpoint save on a 1 MiB filesystem: step 1 fits, step 2 (a 2 MiB tensor) does not. torch.save reports it
# as its own zip-writer error, without errno or "No space left".
SAVE_ON_FULL_DISK = """
import sys, types
from pathlib import Path
import torch
from gspo_ascend import trainer
from gspo_ascend.config import load_config
from gspo_ascend.errors import UserError
from gspo_ascend.schedules.synchronous import Synchronous

out = Path(sys.argv[1])
size = {"n": 1}
class Workers:
    def save_checkpoint(self, path):
        Path(path).mkdir(parents=True, exist_ok=True)
        torch.save(torch.zeros(size["n"]), Path(path) / "engine_rank0.pt")
class Sampler:
    def state_dict(self):
        return {"epoch": 0, "position": 0}
run = types.SimpleNamespace(output_dir=out, workers=Workers(), sampler=Sampler(), model_path=str(out),
                            cfg=load_config(overrides=[f"trainer.output_dir={out}"]))
run.schedule = Synchronous(run)
trainer.save_checkpoint(run, 1)
size["n"] = 1 << 19
try:
    trainer.save_checkpoint(run, 2)
except UserError as exc:
    print("USERERROR", exc)
except Exception as exc:
    print("RAW", type(exc).__name__, str(exc).splitlines()[0])
print("LEFT", sorted(p.name for p in (out / "checkpoints").iterdir()))
"""


@needs_tmpfs
def test_disk_full_during_a_checkpoint_save_says_no_space_left_and_where(tmp_path):
    """Defect 6: a real ENOSPC under torch.save ("unexpected pos ...") becomes one line naming the reason, the
    directory, and the intact previous checkpoint; the partial save is removed."""
    mount = tmp_path / "small"
    proc = in_small_tmpfs(mount, SAVE_ON_FULL_DISK, str(mount / "run"))
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines[-1] == "LEFT ['step_00000001']", proc.stdout + proc.stderr
    assert lines[0].startswith(
        f"USERERROR No space left on device while saving checkpoint step 2 ({mount}/run/checkpoints/.tmp-step_00000002-"
    ), lines
    assert f"the last checkpoint {mount}/run/checkpoints/step_00000001 is intact" in lines[0]


# A full 1 MiB filesystem: what the save path raises decides whether the disk is blamed.
BLAME_ON_FULL_DISK = """
import sys
from pathlib import Path
from gspo_ascend import rundir

full = Path(sys.argv[1])
try:
    with open(full / "filler", "wb") as f:
        while True:
            f.write(b"\\0" * 4096)
            f.flush()
except OSError:
    pass
cases = {
    "bug": AttributeError("'SimpleNamespace' object has no attribute 'pipeline'"),
    "not-a-write": NotImplementedError("no save_hf for this engine"),
    "torch.save": RuntimeError("unexpected pos 704 vs 598"),
    "os": OSError("write failed"),
}
for name, exc in cases.items():
    print(name, rundir.no_space(exc, full))
"""


@needs_tmpfs
def test_a_bug_in_the_save_path_is_not_blamed_on_a_full_disk(tmp_path):
    """On a full disk, only what a failed write raises is probed for and reported as no space; an AttributeError
    from the save path is the bug it is (old main said "No space left on device" for every exception there)."""
    mount = tmp_path / "full"
    proc = in_small_tmpfs(mount, BLAME_ON_FULL_DISK, str(mount))
    assert proc.stdout.splitlines() == [
        "bug None",
        "not-a-write None",
        "torch.save No space left on device",
        "os No space left on device",
    ], proc.stdout + proc.stderr


@needs_tmpfs
def test_a_read_only_output_dir_is_refused_in_one_line(tmp_path):
    mount = tmp_path / "ro"
    code = "from gspo_ascend import rundir; print(rundir.writable_problem(__import__('sys').argv[1]))"
    proc = in_small_tmpfs(mount, code, str(mount / "run"), options="ro,size=1m")
    assert (
        proc.stdout.strip() == f"{mount} (the nearest existing directory of {mount}/run) is on a read-only filesystem"
    )


def test_sigkill_leaves_a_lock_the_next_run_recovers(tmp_path):
    """The lock a SIGKILLed run leaves behind (no release) is stale on this host."""
    proc = python(HOLD_LOCK, str(tmp_path))
    assert proc.stdout.readline().strip() == "HELD"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    held = json.loads((tmp_path / "run.lock").read_text())
    assert held["pid"] == proc.pid and rundir.stale_reason(held) == f"process {proc.pid} is no longer running"
    rundir.acquire(tmp_path).release()


def test_a_full_disk_anywhere_else_in_the_run_is_one_line_too(monkeypatch, tmp_path):
    """metrics.jsonl, config.json, TensorBoard: an ENOSPC escaping the run becomes the same kind of line."""
    from gspo_ascend import trainer

    target = tmp_path / "metrics.jsonl"

    def fill_the_disk(cfg, sigterm):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(target))

    monkeypatch.setattr(trainer, "_train", fill_the_disk)
    with pytest.raises(UserError) as e:
        trainer.train(load_config(overrides=[f"trainer.output_dir={tmp_path}"]))
    msg = one_line(e)
    assert msg.startswith(f"No space left on device while writing the run's outputs ({target}; ")
    assert "no checkpoint was saved yet" in msg
