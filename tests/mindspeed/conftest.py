"""The real MindSpeed on CPU under the device shim.

These tests run only where MindSpeed is installed: ``bash scripts/check_mindspeed.sh`` builds the venv of a branch
(core_r0.16.0, the pinned line's: ``.venv-mindspeed-16/`` with torch 2.10.0, megatron-core 0.16.0, transformers
5.5.4, mbridge 0.15.1; ``--branch 26.1.0`` / ``2.2.0``: the previous line's, torch 2.7.1 and megatron-core 0.12.1;
MindSpeed from source in each) and runs them.
Elsewhere (CI's ``.venv``) every test here is skipped. MindSpeed runs in fresh subprocesses
(``mindspeed_worker.py``): its adaptor patches the whole process and registers a torch library at import.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

SKIP_REASON = "needs the real MindSpeed: run `bash scripts/check_mindspeed.sh` (builds .venv-mindspeed-16/)"


def _mindspeed_installed() -> bool:
    try:  # the adaptor module, not only a placeholder `mindspeed` package (PyPI's is empty)
        return importlib.util.find_spec("mindspeed.megatron_adaptor") is not None
    except ImportError:
        return False


def pytest_collection_modifyitems(config, items):
    """Skip this directory's tests (before any fixture runs) unless MindSpeed is importable."""
    if _mindspeed_installed():
        return
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.skip(reason=SKIP_REASON))


def run_worker(*cases: str, tmp_path=None, timeout: int = 1200) -> dict[str, dict]:
    """Run ``mindspeed_worker`` CASES in one fresh interpreter; returns {case: result}. Fails with its output.

    ``timeout`` is a hang guard (test_mindspeed_engine.py's TIMEOUT_S): beside ``stress --cpu 4`` on the 2-core box,
    ``forward:plain`` (137 s at load 9-14) was killed at the former 300 s."""
    from gspo_ascend.selftest.launch import free_port

    # a port of its own for the one-rank process group (forward cases): CI runs the two branches' tests side by
    # side (.ci/run), and the worker's fixed default would then be bound by both
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port())}
    if tmp_path is not None:  # MindSpeed creates torch's JIT-extension directory at import
        env["TORCH_EXTENSIONS_DIR"] = str(tmp_path / "torch_extensions")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.mindspeed.mindspeed_worker", *cases],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=timeout,
    )
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
            results[result.pop("case")] = result
    assert proc.returncode == 0 and len(results) == len(cases), (
        f"mindspeed_worker {' '.join(cases)} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    )
    return results


@pytest.fixture(scope="session")
def in_one_process(tmp_path_factory):
    """The cases that need MindSpeed imported but no fresh process of their own, run in one worker: MindSpeed's
    dense and MoE forwards (one config after the other: the repatching test shows the second leaves nothing of the
    first) and its gmm op. Each worker process costs 15-30 s of imports on the CI box (torch, megatron-core,
    MindSpeed's adaptor and what it reaches); these three ran in three."""
    return run_worker("forward:dense", "forward:moe", "gmm", tmp_path=tmp_path_factory.mktemp("ms-one-process"))


@pytest.fixture
def worker(tmp_path):
    return lambda *cases, **kw: run_worker(*cases, tmp_path=tmp_path, **kw)
