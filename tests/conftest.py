"""Shared test helpers."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_cli(*args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run `gspo-ascend ARGS` in a fresh interpreter, the way a user would."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "gspo_ascend.cli", *args],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=cwd or REPO,
        timeout=300,
    )


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module's in-process model work: the tiny models gain nothing from more, and on
    a shared 2-core box two OpenMP threads that fight other processes make every small op ~10-40x slower."""
    import torch  # lazily: importing this module must not import torch for tests that check import order

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@contextlib.contextmanager
def script_module(path: Path, name: str):
    """A script of benchmarks/ imported as module ``name``, registered in sys.modules while in use (dataclasses look
    their module up by name) and removed after."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(name, None)
