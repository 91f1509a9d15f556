"""Shared test helpers, and how the suite runs on two workers (pytest-xdist; docs/testing.md).

The suite runs with ``-n 2`` (pyproject's addopts). Tests that start a Ray cluster, or look for one
(``address='auto'``, processes found by their command line), are one scheduling unit, the Ray lane: they run one
after the other on one worker, so two clusters never share the 2 cores, the ports or ``/tmp/ray``; everything else
spreads over both workers. Before the workers start, the controller builds the two embedded tiny models the suite reads
(dense and MoE) once, so no two workers build the same model at the same time.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Modules outside tests/e2e/ that start a Ray cluster (ray.init, `ray start`, a training run through Ray) or look for
# one (doctor's address='auto' probe): the Ray lane with every e2e test.
RAY_MODULES = {
    "tests/unit/test_ray_actor_resources.py",
    "tests/unit/test_device_bundle.py",
    "tests/unit/test_scripts.py",
    "tests/unit/test_doctor_env.py",
}


def in_ray_lane(nodeid: str) -> bool:
    path = nodeid.split("::", 1)[0]
    return path.startswith("tests/e2e/") or path in RAY_MODULES


@pytest.hookimpl(optionalhook=True)  # xdist's hook: unknown where xdist is not installed (the MindSpeed venvs)
def pytest_xdist_make_scheduler(config, log):
    """xdist's load-group scheduling with the `ray` group by path (every other test is its own unit), the largest
    unit first: the Ray lane starts at once on one worker and the other worker takes everything else. Not xdist's
    xdist_group marks: xdist 3.8 writes the group into ``item._nodeid``, which pytest 9 no longer reads (the marks
    are silently ignored and Ray tests run on both workers at once, seen in the first parallel run)."""
    from xdist.scheduler import LoadGroupScheduling

    class RayLane(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "ray" if in_ray_lane(nodeid) else nodeid

    return RayLane(config, log)


def pytest_configure(config):
    """On the controller of a parallel run (not in a worker, not in a serial run): the embedded tiny models, built
    once before the workers start (a no-op when they are in the cache)."""
    if hasattr(config, "workerinput"):
        # a worker: one intra-op thread for its in-process tensors, since two workers already fill the 2 cores and
        # two OpenMP pools spinning against each other slow small ops ~10-40x (see one_thread); subprocesses a
        # test starts keep torch's default
        import torch

        torch.set_num_threads(1)
        return
    workers = getattr(config.option, "numprocesses", None)
    if not workers or config.option.collectonly:
        return
    if os.environ.get("GSPO_TEST_NO_PREBUILD"):  # a run that needs no model (e.g. only lint or docs tests)
        return
    from gspo_ascend.tiny import ensure_tiny_model

    for moe in (False, True):
        ensure_tiny_model(moe=moe)


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
