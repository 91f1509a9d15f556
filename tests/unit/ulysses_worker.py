"""Ranks for tests/unit/test_ulysses.py: ``python -m tests.unit.ulysses_worker WORLD TMP`` forks WORLD gloo ranks that
run every case of ``TMP/cases.json`` in order, each with a fresh FSDPEngine, and write ``TMP/<case>.rank<r>.pt``.

A case: ``name``, ``model`` (a model directory), ``overrides`` (config overrides), ``device`` ("cpu", or "npu" for
the CPU shim with the NPU patches; npu cases must come after every cpu case: the patches are process-wide),
``master_dtype`` ("float32" / "float64") and ``ops``, any of:
- ``log_probs``: ``compute_log_probs`` of this rank's ``dp_shard`` of ``TMP/<batch>.pt``;
- ``grads``: ``backward_minibatch`` of the whole batch (world = SP: one group holding it all), full gradients;
- ``update``: ``update`` of this rank's shard, then its metrics and the full exported weights.
"""

from __future__ import annotations

import json

import torch

from gspo_ascend.engines.base import SampleBatch

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def _backend(device: str):
    from gspo_ascend.device import NPU_SHIM, get_backend, shim

    if device == "npu":
        if not shim.is_installed("npu"):
            shim.install(npu=True)
        return NPU_SHIM
    return get_backend("cpu")


def run_case(case: dict, rank: int, world: int, tmp: str) -> dict:
    from gspo_ascend.config import load_config
    from gspo_ascend.engines.fsdp import FSDPEngine
    from gspo_ascend.engines.microbatch import dp_shard

    cfg = load_config(overrides=case["overrides"])
    engine = FSDPEngine(cfg, _backend(case["device"]), case["model"], master_dtype=DTYPES[case["master_dtype"]])
    batch = SampleBatch(**torch.load(f"{tmp}/{case['batch']}.pt", weights_only=True))
    shard = dp_shard(batch, rank, world, cfg.algorithm.minibatches_per_rollout)
    out: dict = {"attn": engine.model.config._attn_implementation}
    if "log_probs" in case["ops"]:
        out["log_probs"] = engine.compute_log_probs(shard, case.get("temperature", 1.0))
    if "grads" in case["ops"]:
        record = engine.backward_minibatch(batch, 1.0)
        grads = {n: p.grad for n, p in engine.model.named_parameters() if p.grad is not None}
        out["grads"] = {n: g.full_tensor().clone() for n, g in grads.items()}
        out["passes"] = record.passes
        engine.optimizer.zero_grad(set_to_none=True)
    if "update" in case["ops"]:
        out["metrics"] = engine.update(shard, 1.0)
        out["weights"] = {name: tensor.clone() for name, tensor in engine.export_weights()}
    return out


def worker(rank: int, world: int, tmp: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)  # several ranks on two shared cores
    dist.init_process_group("gloo", store=dist.FileStore(f"{tmp}/store", world), rank=rank, world_size=world)
    try:
        for case in json.loads(open(f"{tmp}/cases.json").read()):
            torch.save(run_case(case, rank, world, tmp), f"{tmp}/{case['name']}.rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def main(argv: list[str]) -> None:
    """Import the heavy modules once, then fork the ranks (see tests/unit/fsdp_worker.py for why fork)."""
    import gspo_ascend.engines.fsdp  # noqa: F401  (imported before the fork on purpose)

    world, tmp = int(argv[0]), argv[1]
    torch.multiprocessing.start_processes(worker, args=(world, tmp), nprocs=world, start_method="fork")


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
