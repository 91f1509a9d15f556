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
# one (doctor's address='auto' probe): in a Ray lane with every e2e test.
RAY_MODULES = {
    "tests/unit/test_ray_actor_resources.py",
    "tests/unit/test_device_bundle.py",
    "tests/unit/test_scripts.py",
    "tests/unit/test_doctor_env.py",
}
# Ray tests that must not run beside another cluster: they start nodes with `ray start` and find them by command line,
# or probe address='auto' (the two-node run failed beside a second cluster, issue #40). They hold the Ray lock
# exclusively; every other Ray test holds it shared (ray_lock below).
RAY_ALONE = {
    "tests/e2e/test_multinode.py",
    "tests/e2e/test_disaggregated_multinode.py",
    "tests/unit/test_scripts.py",
    "tests/unit/test_doctor_env.py",
}
# The second Ray lane: collected last, so the worker that finishes the tests outside Ray takes it while the first
# lane is still running, and both workers end together (sized by the measured lane times, docs/testing.md: on
# 2026-12-01 the first lane's tests summed to 1842 s, the rest 913 s and this lane 581 s, so the pytest stage waited
# ~350 s on the first lane alone; the GPU proof's run, ~100 s, moved here; on 2026-12-02 the plain-CPU selftest left
# the first lane, -133 s of its 1660 s, and the weights-lag run, ~47 s, went back to it: 1574 s against 1588 s
# projected, 1474 s against 839 s + 617 s measured in the next clean-clone run; on 2026-12-03 the first lane 1573 s,
# the rest 1054 s + this lane 695 s, so the faults run, ~57 s, went to the first lane).
RAY_TAIL = {
    "tests/e2e/test_gpu_proof_e2e.py",
    "tests/e2e/test_train_e2e.py",
    "tests/e2e/test_train_ulysses_e2e.py",
    "tests/unit/test_device_bundle.py",
    "tests/unit/test_ray_actor_resources.py",
}


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def ray_lane(nodeid: str) -> str | None:
    """The Ray lane a test runs in ("ray", or "ray-tail" for RAY_TAIL), None for a test that starts no Ray."""
    path = module_of(nodeid)
    if not (path.startswith("tests/e2e/") or path in RAY_MODULES):
        return None
    return "ray-tail" if path in RAY_TAIL else "ray"


def scheduling_unit(nodeid: str) -> str:
    """What one worker runs as a whole outside the Ray lanes: a test class (its class-scoped fixture is built once,
    and two TP 2 vLLM pairs of tests/integration/test_vllm_rollout_tp.py at once collide on vLLM's fixed shared-memory
    names, errno 17), else the test."""
    parts = nodeid.split("::")
    return "::".join(parts[:2]) if len(parts) > 2 else nodeid


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """The first Ray lane first, its RAY_ALONE tests at its head (they run before the second lane can start), and
    the second lane last; a stable sort, so each group keeps its order. The scheduler below hands work out in it."""
    rank = {"ray": 1, None: 2, "ray-tail": 3}

    def key(item) -> int:
        lane = ray_lane(item.nodeid)
        return 0 if lane == "ray" and module_of(item.nodeid) in RAY_ALONE else rank[lane]

    items.sort(key=key)


@pytest.hookimpl(optionalhook=True)  # xdist's hook: unknown where xdist is not installed (the MindSpeed venvs)
def pytest_xdist_make_scheduler(config, log):
    """xdist's load-group scheduling with the Ray lanes by path (every other test is its own unit), in collection
    order: one worker starts the first lane at once, the other takes the tests outside Ray one by one and then the
    second lane. Not xdist's xdist_group marks: xdist 3.8 writes the group into ``item._nodeid``, which pytest 9 no
    longer reads (the marks were silently ignored and Ray tests ran on both workers at once, seen in the first
    parallel run)."""
    from xdist.scheduler import LoadGroupScheduling

    class RayLanes(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return ray_lane(nodeid) or scheduling_unit(nodeid)

    config.option.loadscopereorder = False  # collection order, not largest unit first
    return RayLanes(config, log)


@pytest.fixture(autouse=True)
def ray_lock(request):
    """Two Ray tests may overlap (the lanes' ends), never a RAY_ALONE test and another Ray test: a file lock per
    test run, exclusive for RAY_ALONE, shared for the rest. Tests that start no Ray take no lock."""
    lane = ray_lane(request.node.nodeid)
    if lane is None:
        yield
        return
    import fcntl
    import tempfile

    run = getattr(request.config, "workerinput", {}).get("testrunuid", str(os.getpid()))
    alone = module_of(request.node.nodeid) in RAY_ALONE
    with open(Path(tempfile.gettempdir()) / f"gspo-tests-ray-{run}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        yield


@pytest.fixture(autouse=True)
def world_env_restored():
    """The distributed launcher variables as they were before each test. A test that built an engine inside the
    session's process group (a train engine leaves its one-process group) and did not close it left RANK /
    WORLD_SIZE behind, and every later subprocess of that pytest worker inherited them: TRL's side in the GPU
    proof then asked for MASTER_ADDR (CI, 2026-12-03). The engine's own variables plus a worker setup's
    MASTER_*; imported here, not at the top, so the controller does not import torch for it."""
    from gspo_ascend.engines.vllm_env import LAUNCHER_ENV, restore_env

    before = {k: os.environ.get(k) for k in (*LAUNCHER_ENV, "MASTER_ADDR", "MASTER_PORT")}
    yield
    restore_env(before)


def pytest_configure(config):
    """In a worker: one intra-op thread. On the controller of a parallel run: the embedded tiny models, built once
    before the workers start (a no-op when they are in the cache). A serial run does neither."""
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
