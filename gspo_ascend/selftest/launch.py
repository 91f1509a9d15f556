"""Start one process per device for the selftest's multi-device checks, torchrun-style, and wait for them.

Each rank runs ``python -m gspo_ascend.selftest.rank JOB ...`` with RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR /
MASTER_PORT set; rank r uses device r (``select_device`` reads LOCAL_RANK). Its output goes to
``<out>/<job>.rank<r>.log``; a failure is reported as one line (the exit codes and the last error line of the first
failing rank) with the log's path, never as a traceback of the selftest itself.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Launch:
    codes: list[int | None]  # exit code per rank; None = killed at the time limit
    logs: list[Path]

    @property
    def ok(self) -> bool:
        return all(code == 0 for code in self.codes)

    def failure(self) -> str:
        """One line: what went wrong and where the logs are."""
        failed = [i for i, code in enumerate(self.codes) if code not in (0, None)]  # the cause, before ranks killed
        bad = failed[0] if failed else next(i for i, code in enumerate(self.codes) if code is None)
        if self.codes[bad] is None:
            return f"rank {bad} did not finish within the time limit (log: {self.logs[bad]})"
        return f"rank {bad} exited with {self.codes[bad]}: {last_error(self.logs[bad])} (log: {self.logs[bad]})"


def last_error(log: Path) -> str:
    """The last line of a log that looks like an error (a traceback's final line), else its last line."""
    return last_error_of(log.read_text(errors="replace"))


def last_error_of(text: str) -> str:
    """:func:`last_error` of some text."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if "Error" in line or "error:" in line or "Exception" in line:
            return line[:300]
    return lines[-1][:300] if lines else "(no output)"


def host_threads(emulated_or_cpu: bool) -> dict[str, str]:
    """N ranks on a few host cores: one intra-op thread each unless the user chose (on a real device the host
    threads are left alone)."""
    if emulated_or_cpu and "OMP_NUM_THREADS" not in os.environ:
        return {"OMP_NUM_THREADS": "1"}
    return {}


def launch_on(backend, world: int, job: str, args: list[str], out: Path, timeout_s: float) -> Launch:
    """:func:`launch_ranks` on ``backend``'s devices: ``--device``, the shim flag when the device is emulated, one
    intra-op thread per rank on a host."""
    on_host = backend.torch_device_type == "cpu"
    env = host_threads(on_host) | ({"GSPO_DEVICE_SHIM": "1"} if backend.emulated else {})
    return launch_ranks(world, job, ["--device", backend.name, *args], out, env, timeout_s)


def rank_records(backend, world: int, job: str, args: list[str], out: Path, timeout_s: float, fix: str) -> list[dict]:
    """Run ``job``, whose ranks each write ``<job>.rank<r>.json`` with an ``errors`` list, and return those records;
    a failed launch, or any rank's error, raises :class:`~.report.CheckFailed` with ``fix`` (the first error and the
    count)."""
    from .report import CheckFailed

    out.mkdir(parents=True, exist_ok=True)
    run = launch_on(backend, world, job, args, out, timeout_s)
    if not run.ok:
        raise CheckFailed(run.failure(), fix)
    ranks = [json.loads((out / f"{job}.rank{r}.json").read_text()) for r in range(world)]
    errors = [e for r in ranks for e in r["errors"]]
    if errors:
        raise CheckFailed(f"{len(errors)} wrong result(s), first: {errors[0]}", fix)
    return ranks


def launch_ranks(world: int, job: str, args: list[str], out: Path, env: dict[str, str], timeout_s: float) -> Launch:
    """Run ``world`` ranks of ``job`` and wait (at most ``timeout_s`` for all of them together)."""
    procs, logs = start_ranks(world, ["-m", "gspo_ascend.selftest.rank", job, "--out", str(out), *args], out, job, env)
    return Launch(_wait(procs, timeout_s), logs)


def start_ranks(
    world: int, argv: list[str], out: Path, stem: str, env: dict[str, str], cwd: Path | None = None
) -> tuple[list[subprocess.Popen], list[Path]]:
    """Start ``python argv...`` once per rank, torchrun-style (RANK = LOCAL_RANK = r, WORLD_SIZE, MASTER_* on a
    free local port, over the environment plus ``env``), rank r's output in ``<out>/<stem>.rank<r>.log``."""
    base = {**os.environ, **env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world)}
    procs, logs = [], []
    for rank in range(world):
        log = out / f"{stem}.rank{rank}.log"
        logs.append(log)
        with log.open("w") as sink:
            procs.append(
                subprocess.Popen(
                    [sys.executable, *argv],
                    env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                    cwd=cwd,
                )
            )
    return procs, logs


def _wait(procs: list[subprocess.Popen], timeout_s: float, grace_s: float = 15.0) -> list[int | None]:
    """Exit codes; once a rank has failed the others get ``grace_s`` to finish (they would otherwise wait in a
    collective for the dead rank until the time limit), then they are killed (None)."""
    deadline = time.monotonic() + timeout_s
    killed = set()
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                deadline = min(deadline, time.monotonic() + grace_s)
            time.sleep(0.2)
    finally:
        for i, proc in enumerate(procs):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
                killed.add(i)
    return [None if i in killed else p.returncode for i, p in enumerate(procs)]
