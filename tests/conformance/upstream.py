"""The real upstream wheels of the pinned NPU stack, downloaded once and unpacked for reading.

The conformance suite (issue #14) holds our NPU path to torch-npu 2.7.1, vllm-ascend 0.11.0 and the vLLM 0.11.0
that vllm-ascend pins. None of them can be installed here (torch_npu's extension links against CANN; vllm-ascend
imports torch_npu and its own compiled ops), so the suite reads their files: op schemas, meta registrations, op
docs, env definitions and the Python source of the code paths we rely on, and runs that Python where it can.

Wheels come from the package registry with ``pip download --no-deps`` into ``GSPO_UPSTREAM_CACHE`` (default
``~/.cache/gspo-ascend/upstream``) and are unpacked beside it; a second run reuses both. On a machine without the
registry the suite fails with the pip command to run, except where ``GSPO_CONFORMANCE=skip`` says to skip it
(never set in CI: there a missing wheel is a failure, not a skip).
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

# The pinned stack (requirements-npu.txt): what the NPU path must conform to.
PINS = {
    "torch-npu": "2.10.0.post4",
    "vllm-ascend": "0.23.0",
    "vllm": "0.23.0",
}


_LAYOUT = 2  # bump when what is unpacked changes, so caches made by an older suite are unpacked again


def cache_dir() -> Path:
    return Path(os.environ.get("GSPO_UPSTREAM_CACHE", Path.home() / ".cache" / "gspo-ascend" / "upstream"))


def _wheel(dist: str, version: str, folder: Path) -> Path | None:
    stem = dist.replace("-", "_")
    found = sorted(folder.glob(f"{stem}-{version}-*.whl"))
    return found[0] if found else None


def wheel_root(dist: str) -> Path:
    """Unpacked root of the pinned wheel of ``dist`` (a key of PINS); downloads it on first use."""
    version = PINS[dist]
    folder = cache_dir()
    unpacked = folder / f"{dist}-{version}.unpacked-{_LAYOUT}"
    if (unpacked / ".complete").exists():
        return unpacked
    folder.mkdir(parents=True, exist_ok=True)
    wheel = _wheel(dist, version, folder)
    if wheel is None:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(folder), f"{dist}=={version}"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        wheel = _wheel(dist, version, folder)
        if wheel is None:
            message = (
                f"cannot download {dist}=={version} for the conformance suite: {proc.stderr.strip()[-400:]}\n"
                f"run: {' '.join(cmd)}  (or GSPO_CONFORMANCE=skip to skip the suite on an offline machine)"
            )
            if os.environ.get("GSPO_CONFORMANCE") == "skip":
                pytest.skip(message)
            pytest.fail(message)
    with zipfile.ZipFile(wheel) as archive:
        # vLLM's CUDA kernels are hundreds of MB and never read; torch_npu's libtorch_npu.so (58 MB) is kept, the
        # environment variables its C++ reads are found by their names in it.
        members = archive.namelist()
        if dist == "vllm":
            members = [m for m in members if not m.endswith((".so", ".a")) and ".so." not in m]
        archive.extractall(unpacked, members)
    (unpacked / ".complete").write_text(f"{wheel.name}\n{len(members)} members\n")
    return unpacked


def upstream_file(dist: str, relpath: str) -> Path:
    """A file of the unpacked pinned wheel, e.g. ``upstream_file("torch-npu", "torch_npu/_op_plugin_docs.py")``."""
    path = wheel_root(dist) / relpath
    if not path.exists():
        pytest.fail(f"{dist}=={PINS[dist]} has no {relpath}: the pinned wheel's layout changed")
    return path
