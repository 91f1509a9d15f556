"""The shipped ``python`` tool (ReTool-style code execution): the model's program in a subprocess, bounded.

The model's code is untrusted: it never runs in the trainer's process. Each call writes it to a fresh temporary
directory and runs ``python -I`` there (isolated mode: no ``PYTHON*`` environment, no user site, the directory
not on ``sys.path``), with an empty environment apart from ``PATH``. Before the program runs, the child limits
itself (soft and hard, so the program cannot raise them back): ``RLIMIT_AS`` (memory), ``RLIMIT_CPU``,
``RLIMIT_FSIZE`` (what it can write, its output included) and installs an audit hook that refuses sockets,
new processes (``subprocess``, ``os.system`` / ``exec*`` / ``spawn*`` / ``fork``) and ``ctypes``. The parent kills
the process group at the wall-clock limit.

No network: where unprivileged user namespaces work (probed once per process), the child runs in a network
namespace of its own (``unshare --user --net``), which has no interface but loopback; elsewhere the audit hook is
the only guard against sockets, which stops Python code but not a C extension, and the first call says so once.
A program that raises is an answer, not a fault: the model gets its exit status and the tail of its traceback.
A program that outlives the limit, or prints more than ``max_output_chars``, is a fault (:class:`ToolFault`).
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from .errors import ToolFault

TIMEOUT_S = 5.0
MEMORY_BYTES = 512 << 20
MAX_OUTPUT_CHARS = 4096

# Runs in the child before the program: limits, the audit hook, then the program as __main__.
_PRELUDE = """
import resource, runpy, sys
mem, cpu, fsize = (int(a) for a in sys.argv[2:5])
for limit, value in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_CPU, cpu), (resource.RLIMIT_FSIZE, fsize)):
    resource.setrlimit(limit, (value, value))
_DENIED = ("socket.", "subprocess.", "os.system", "os.exec", "os.spawn", "os.fork", "os.posix_spawn", "ctypes.",
           "os.kill", "os.putenv", "os.unsetenv")
def _guard(event, args):
    if event.startswith(_DENIED):
        raise PermissionError(f"{event} is not allowed in this sandbox")
sys.addaudithook(_guard)
path = sys.argv[1]
sys.argv = [path]
runpy.run_path(path, run_name="__main__")
"""


def python(code: str) -> str:
    """Run a Python program and return what it prints (stdout and stderr).

    Args:
        code: A complete Python program; print() the values you want to see.
    """
    return run_program(code)


def run_program(
    code: str, timeout_s: float = TIMEOUT_S, memory_bytes: int = MEMORY_BYTES, max_output_chars: int = MAX_OUTPUT_CHARS
) -> str:
    if not isinstance(code, str):
        raise ToolFault("bad_arguments", "code must be a string")
    work = Path(tempfile.mkdtemp(prefix="gspo-tool-python-"))
    try:
        (work / "main.py").write_text(code)
        limits = [str(memory_bytes), str(max(1, int(timeout_s) + 1)), str(4 * max_output_chars + 4096)]
        command = [*_no_network_prefix(), sys.executable, "-I", "-c", _PRELUDE, str(work / "main.py"), *limits]
        with open(work / "output", "wb") as out:
            proc = subprocess.Popen(
                command, cwd=work, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")}, start_new_session=True,
            )  # fmt: skip
            try:
                code_ = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise ToolFault("timeout", f"the program ran past the limit of {timeout_s:g} s") from None
        text = (work / "output").read_bytes().decode("utf-8", errors="replace")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if len(text) > max_output_chars:
        raise ToolFault("too_long", f"the program printed {len(text)} characters, over the limit of {max_output_chars}")
    if code_ == 0:
        return text
    if code_ in (-signal.SIGXCPU, -signal.SIGKILL):
        raise ToolFault("timeout", f"the program used more than {timeout_s:g} s of CPU")
    status = f"killed by signal {-code_}" if code_ < 0 else f"exit status {code_}"
    return f"{text[-2000:]}\n[{status}]".lstrip("\n")


@functools.cache
def _no_network_prefix() -> tuple[str, ...]:
    """``unshare --user --net --map-root-user`` where it works here, else nothing (said once)."""
    unshare = shutil.which("unshare")
    if unshare is not None:
        probe = [unshare, "--user", "--net", "--map-root-user", "true"]
        if subprocess.run(probe, capture_output=True, timeout=10).returncode == 0:
            return (unshare, "--user", "--net", "--map-root-user")
    print(
        "note: the python tool runs without a network namespace here (unprivileged user namespaces are not "
        "available): its audit hook refuses sockets from Python code, not from C extensions",
        file=sys.stderr,
        flush=True,
    )
    return ()
