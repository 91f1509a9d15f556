"""Shared test helpers."""

from __future__ import annotations

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
