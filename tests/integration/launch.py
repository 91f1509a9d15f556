"""Launch N ranks of a worker script torchrun-style (RANK / WORLD_SIZE / MASTER_* in the environment) and wait;
shared by the multi-process integration tests."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from gspo_ascend.selftest.launch import start_ranks
from tests.conftest import REPO

# the multi-process megatron test modules: slow, and skipped where megatron-core / mbridge are absent
MEGATRON_TESTS = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("megatron") is None or importlib.util.find_spec("mbridge") is None,
        reason="megatron-core / mbridge are not installed",
    ),
]


def rank_results(out_dir: Path) -> dict:
    """{case: {rank: result}} from the ``<case>.rank<r>.pt`` files the workers wrote."""
    import torch

    found: dict = {}
    for path in out_dir.glob("*.rank*.pt"):
        case, rank = path.stem.rsplit(".rank", 1)
        found.setdefault(case, {})[int(rank)] = torch.load(path, weights_only=False)
    return found


def launch_ranks(world_size: int, argv: list[str], log_stem: str, out_dir: Path, timeout_s: float) -> None:
    """Run ``python argv...`` once per rank; on any failure, fail the test with every rank's log tail."""
    env = {
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",  # N ranks on 2 cores: one thread each, or they fight
    }
    procs, logs = start_ranks(world_size, argv, out_dir, log_stem, env, cwd=REPO)
    try:
        codes = [proc.wait(timeout=timeout_s) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    if any(codes):
        tails = "\n".join(f"--- {log.name}\n" + "\n".join(log.read_text().splitlines()[-40:]) for log in logs)
        pytest.fail(f"worker {argv[0]} failed (exit codes {codes}):\n{tails}")
