"""The run directory (``trainer.output_dir``): writable, held by one run at a time, and its disk faults said in
one line.

- **Writable.** :func:`writable_problem` (no side effects; ``train --dry-run`` reports it) and
  :func:`open_run_dir` (the run's start, before Ray) turn a read-only, foreign or non-directory ``output_dir`` into
  one line naming the key, instead of a traceback from the first ``mkdir``.
- **The lock.** ``<output_dir>/run.lock`` records the owner's host, PID and start time. It is created with
  ``O_EXCL`` (atomic on local filesystems and on NFSv3+), so of two runs started in one directory exactly one gets
  it and the other stops with one line naming the owner, before it cleans up, reads or writes anything there. A
  lock is *stale* when its owner ran on this host (same host name, boot and PID namespace) and that process is
  gone, or its PID now belongs to a process started later; a stale lock is replaced, and that is said in one
  line. A lock from another host is never judged stale (its PIDs cannot be seen from here): the line says to
  delete the file once that run is known to be gone.
- **Disk full.** :func:`no_space` finds ENOSPC / EDQUOT in an exception: its chain, the text Ray forwards from a
  worker, or, where the writer's own message says nothing of the kind (``torch.save``: "unexpected pos 704 vs
  598"), a 1 MiB write probe into the directory that was being written, made before the partial files are
  removed. The probe runs only for what a failed write raises (an OSError, a plain RuntimeError), so a bug in the
  save path is not reported as a full disk on a nearly full one.

How we differ from verl: verl's only lock is a per-host ``FileLock`` in /tmp around the ``mkdir`` of one
checkpoint directory (``BaseCheckpointManager.local_mkdir``); nothing keeps two runs out of one
``default_local_dir``, so a retried job interleaves its checkpoints and tracker file with the first one's. A full
disk there is reported as whatever the writer raised.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import UserError

LOCK_NAME = "run.lock"
_NO_SPACE = {errno.ENOSPC: "No space left on device", errno.EDQUOT: "Disk quota exceeded"}
_PROBE_BYTES = 1 << 20


# ----------------------------------------------------------------------------------------------- writable


def writable_problem(output_dir: str | os.PathLike) -> str | None:
    """Why this process cannot create / write ``output_dir``, or None. Creates nothing."""
    path = Path(output_dir).expanduser().absolute()
    existing = path
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a directory" if existing == path else f"{existing} is a file, not a directory"
    if os.access(existing, os.W_OK | os.X_OK):
        return None
    try:
        read_only = bool(os.statvfs(existing).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    where = "" if existing == path else f" (the nearest existing directory of {path})"
    why = "is on a read-only filesystem" if read_only else f"is not writable by user {_user()}"
    return f"{existing}{where} {why}"


def _user() -> str:
    try:
        import pwd

        return pwd.getpwuid(os.getuid()).pw_name
    except (ImportError, KeyError):
        return str(os.getuid())


def output_dir_message(output_dir: str | os.PathLike, problem: str) -> str:
    return (
        f"config key 'trainer.output_dir': cannot write the run directory {output_dir}: {problem}; "
        "set trainer.output_dir to a directory this user can write"
    )


def check_writable(output_dir: str | os.PathLike) -> None:
    problem = writable_problem(output_dir)
    if problem:
        raise UserError(output_dir_message(Path(output_dir).expanduser(), problem))


def open_run_dir(output_dir: str | os.PathLike) -> RunLock:
    """Create ``output_dir`` and take its lock; one line (exit 2) when it is not writable or is in use."""
    path = Path(output_dir).expanduser()
    check_writable(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        return acquire(path)
    except OSError as exc:
        reason = _NO_SPACE.get(exc.errno) or exc.strerror or str(exc)
        raise UserError(output_dir_message(path, f"{exc.filename or path}: {reason}")) from None


# ----------------------------------------------------------------------------------------------- the lock


def _proc_stat(pid: int) -> list[str] | None:
    """Fields 3.. of /proc/PID/stat (after the command name, which may hold spaces), or None without /proc."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def _start_ticks(pid: int) -> int | None:
    fields = _proc_stat(pid)
    return int(fields[19]) if fields and len(fields) > 19 else None  # field 22: start time since boot


def _read_or_empty(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def _pid_namespace() -> str:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return ""


def _machine() -> dict[str, str]:
    """What makes two PIDs comparable: the same host name, the same boot, the same PID namespace."""
    return {
        "host": socket.gethostname(),
        "boot_id": _read_or_empty("/proc/sys/kernel/random/boot_id"),
        "pid_namespace": _pid_namespace(),
    }


def owner_record() -> dict[str, Any]:
    return {
        **_machine(),
        "pid": os.getpid(),
        "pid_start_ticks": _start_ticks(os.getpid()),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "command": " ".join(sys.argv)[:300],
    }


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    fields = _proc_stat(pid)
    return not (fields and fields[0] in ("Z", "X"))  # a zombie has ended; only its exit status is left


def stale_reason(owner: dict[str, Any]) -> str | None:
    """Why the run that wrote lock record ``owner`` is known to be gone, or None when it may be running."""
    machine = _machine()
    if any(owner.get(key) != value for key, value in machine.items()):
        return None  # another host (or container): its processes cannot be seen from here
    pid = owner.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return None
    if not _running(pid):
        return f"process {pid} is no longer running"
    ticks, recorded = _start_ticks(pid), owner.get("pid_start_ticks")
    if ticks is not None and recorded is not None and ticks != recorded:
        return f"PID {pid} now belongs to another process, started later"
    return None


def _describe(owner: dict[str, Any]) -> str:
    if "unreadable" in owner:
        return f"an unreadable lock ({owner['unreadable'][:60]!r})"
    return f"pid {owner.get('pid')} on host {owner.get('host')}, started {owner.get('started')}"


def _read_lock(path: Path) -> dict[str, Any] | None:
    """The lock's owner record; None when the file vanished. A file that stays empty or invalid for ~2 s (not a
    writer between its create and its write) is reported as unreadable."""
    text = ""
    for _ in range(10):
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        try:
            owner = json.loads(text)
            if isinstance(owner, dict):
                return owner
        except ValueError:
            pass
        time.sleep(0.2)
    return {"unreadable": text}


def _remove_if_unchanged(path: Path, owner: dict[str, Any]) -> bool:
    """Unlink the stale lock ``owner`` unless another starter replaced it meanwhile. Two starters on this host
    are serialised by an flock on the directory (where the filesystem has flock; elsewhere the re-read narrows
    the race to the instant between it and the unlink)."""
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass
        if _read_lock(path) != owner:
            return False
        path.unlink(missing_ok=True)
        return True
    finally:
        os.close(fd)  # releases the flock


@dataclass
class RunLock:
    path: Path
    owner: dict[str, Any]

    def release(self) -> None:
        """Remove the lock if it is still this run's (a user may have deleted it, or a later run replaced it)."""
        try:
            current = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return
        if current == self.owner:
            self.path.unlink(missing_ok=True)


def acquire(output_dir: str | os.PathLike) -> RunLock:
    """Take ``<output_dir>/run.lock`` for this process (see the module docstring)."""
    directory = Path(output_dir)
    path = directory / LOCK_NAME
    owner = owner_record()
    for _ in range(5):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            held = _read_lock(path)
            if held is None:
                continue  # released between our create and our read
            why = stale_reason(held)
            if why is None:
                raise UserError(
                    f"trainer.output_dir {directory} is in use by another run ({_describe(held)}; lock file {path}): "
                    f"wait for it to end or set another trainer.output_dir; if that run is gone (its node died), "
                    f"delete {path}"
                ) from None
            if _remove_if_unchanged(path, held):
                print(f"note: replaced the stale lock {path} of {_describe(held)}: {why}", file=sys.stderr)
            continue
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(json.dumps(owner, indent=1) + "\n")
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            path.unlink(missing_ok=True)  # an empty lock (a full disk) would read as "in use" to the next run
            raise
        return RunLock(path, owner)
    raise UserError(f"could not take the lock {path}: it kept changing (runs starting at once in {directory}?)")


def lock_finding(output_dir: str | os.PathLike) -> str | None:
    """``train --dry-run``: who holds ``output_dir`` now (None when free, or when its lock is stale)."""
    path = Path(output_dir).expanduser() / LOCK_NAME
    if not path.is_file():
        return None
    held = _read_lock(path)
    if held is None or stale_reason(held) is not None:
        return None
    return f"{path.parent} is in use by another run ({_describe(held)}); a run started now would stop"


def output_dir_check(output_dir: str | os.PathLike):
    """``train --dry-run``'s finding on trainer.output_dir: fail when unwritable, warn when another run holds it."""
    from .doctor.check import Check

    problem = writable_problem(output_dir)
    if problem:
        return Check("output-dir", "fail", output_dir_message(output_dir, problem), "set trainer.output_dir")
    held = lock_finding(output_dir)
    if held:
        return Check("output-dir", "warn", held, "wait for that run, or set another trainer.output_dir")
    return Check("output-dir", "ok", f"{output_dir} is writable")


# ----------------------------------------------------------------------------------------------- disk full


def no_space(exc: BaseException, probe_dir: str | os.PathLike | None = None) -> str | None:
    """The reason ("No space left on device", "Disk quota exceeded") when ``exc`` comes from a full disk, else None.

    Looked for in the exception chain (OSError errno, Ray's ``cause``, the text of a worker's traceback), then,
    with ``probe_dir`` and where the chain holds what a failed write raises, by writing 1 MiB there."""
    chain = _chain(exc)
    for e in chain:
        if isinstance(e, OSError) and e.errno in _NO_SPACE:
            return _NO_SPACE[e.errno]
        found = next((reason for reason in _NO_SPACE.values() if reason in str(e)), None)
        if found:
            return found
    # Only a failed write is probed for: an AttributeError raised while saving is a bug, and a nearly full disk
    # must not be blamed for it. Writers fail with an OSError, or with a plain RuntimeError (torch.save's zip
    # writer: "unexpected pos ...", "PytorchStreamWriter failed writing file"); subclasses such as
    # NotImplementedError or RecursionError are not writes. A Ctrl-C or a second SIGTERM is not one either.
    could_be_a_write = any(isinstance(e, OSError) or type(e) is RuntimeError for e in chain)
    if probe_dir is None or not isinstance(exc, Exception) or not could_be_a_write:
        return None
    return _probe(Path(probe_dir))


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and every exception behind it: ``__cause__``, ``__context__`` and Ray's ``cause`` (a RayTaskError
    keeps the worker's own exception there)."""
    seen: dict[int, BaseException] = {}
    stack: list[BaseException | None] = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen[id(e)] = e
        stack += [e.__cause__, e.__context__, getattr(e, "cause", None)]
    return list(seen.values())


def _probe(directory: Path) -> str | None:
    while not directory.is_dir() and directory.parent != directory:
        directory = directory.parent
    probe = directory / f".space-probe-{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * _PROBE_BYTES)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        return _NO_SPACE.get(e.errno)
    finally:
        probe.unlink(missing_ok=True)
    return None


def _free(path: Path) -> str:
    while not path.exists() and path.parent != path:
        path = path.parent
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return "unknown"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if free < 1024:
            return f"{free:.0f} {unit}"
        free /= 1024
    return f"{free:.1f} TiB"


def disk_full(
    exc: BaseException, output_dir: str | os.PathLike, doing: str, probe_dir: str | os.PathLike | None = None
) -> UserError | None:
    """The one-line error for ``exc`` when it comes from a full disk (see ``no_space``), else None."""
    reason = no_space(exc, probe_dir)
    if reason is None:
        return None
    from .checkpoint import find_latest

    where = getattr(exc, "filename", None) or probe_dir or output_dir
    return UserError(no_space_message(reason, doing, where, find_latest(output_dir)))


def no_space_message(reason: str, doing: str, where: str | os.PathLike, last_checkpoint: Path | None) -> str:
    kept = f"the last checkpoint {last_checkpoint} is intact" if last_checkpoint else "no checkpoint was saved yet"
    return (
        f"{reason} while {doing} ({where}; {_free(Path(where))} free there); {kept}. Free space (trainer.keep_last "
        "keeps fewer checkpoints) or set another trainer.output_dir, then run the same command to resume"
    )
