"""How doctor runs external commands (npu-smi, nvidia-smi, a Ray probe): behind a two-method runner, so
tests feed recorded outputs instead of needing the hardware.

``SystemRunner`` never raises: a missing tool is ``None``, a hang is a result with ``returncode=124``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class CommandResult:
    returncode: int
    stdout: str
    stderr: str = ""


class SystemRunner:
    """Runs real commands. ``extra_dirs`` are searched after PATH: on Atlas hosts npu-smi often lives in
    /usr/local/sbin or the driver's tools directory, which a login shell may not put on PATH."""

    def __init__(self, extra_dirs: Sequence[Path] = ()):
        self.extra_dirs = [str(d) for d in extra_dirs]

    def which(self, tool: str) -> str | None:
        path = os.pathsep.join([os.environ.get("PATH", ""), *self.extra_dirs])
        return shutil.which(tool, path=path)

    def run(self, argv: Sequence[str], timeout: float = 15.0) -> CommandResult | None:
        exe = argv[0] if os.path.isabs(argv[0]) else self.which(argv[0])
        if exe is None:
            return None
        try:
            proc = subprocess.run([exe, *argv[1:]], capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return CommandResult(124, "", f"{argv[0]} did not answer within {timeout:g} s")
        except OSError as exc:
            return CommandResult(126, "", f"{argv[0]} could not be run: {exc}")
        return CommandResult(proc.returncode, proc.stdout, proc.stderr)


@dataclass
class RecordedRunner:
    """Answers from recordings keyed by the command's first word (``npu-smi``, ``nvidia-smi``, ``python``);
    a tool without a recording is "not installed". ``calls`` records what was asked, for assertions."""

    recordings: Mapping[str, CommandResult] = field(default_factory=dict)
    calls: list[list[str]] = field(default_factory=list)

    def run(self, argv: Sequence[str], timeout: float = 15.0) -> CommandResult | None:
        self.calls.append(list(argv))
        tool = Path(argv[0]).name
        return self.recordings.get("python" if tool.startswith("python") else tool)
