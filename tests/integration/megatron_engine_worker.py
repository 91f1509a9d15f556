"""One rank of the megatron engine's multi-process checks; launched by test_megatron_engine.py.

Run as ``python megatron_engine_worker.py --cases dense_tp2,moe_ep2 --out DIR`` with RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set. Cases run one after another in one process group (each builds its engine and
closes it, which tears megatron's parallel state down), so the interpreter and megatron start once. Each case
writes ``DIR/<case>.rank<r>.pt`` with what the test compares: log-probs of this rank's rows, update metrics,
exported HF weights (rank 0), timings. The fsdp reference case must come first in a process: the megatron engine
installs the CUDA->CPU shim, which the fsdp engine does not want.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from gspo_ascend.config import load_config
from gspo_ascend.device import get_backend
from gspo_ascend.engines.base import SampleBatch
from gspo_ascend.engines.microbatch import dp_shard
from gspo_ascend.selftest import fixtures
from gspo_ascend.selftest.fixtures import KV2_DIR, MINIBATCHES, UPDATE_OVERRIDES
from gspo_ascend.tiny import ensure_tiny_model

TEMPERATURE = 0.7
BASE = ["actor.engine=megatron", "data.train_batch_size=4", *UPDATE_OVERRIDES]
KL = ["algorithm.kl_coef=0.5"]
BENCH = ["data.train_batch_size=16", "rollout.n=8", "algorithm.minibatches_per_rollout=4", "actor.micro_batch_size=16"]
CASES = {
    # name: (model, config overrides, jobs in run order)
    "fsdp_dense": ("dense", ["actor.engine=fsdp"], ("update",)),
    "fsdp_kv2": ("dense_kv2", ["actor.engine=fsdp"], ("update",)),
    "fsdp_kl": ("dense", ["actor.engine=fsdp", *KL], ("update",)),
    "dense_tp1": ("dense", [], ("log_probs", "export", "update", "save_hf")),
    # the token budget left to the planner too (on the host its host budget: a minibatch in one micro-batch)
    "dense_kl": ("dense", [*KL, "actor.max_tokens_per_micro_batch=auto"], ("update",)),
    "dense_nan": ("dense", [], ("nan",)),
    "dense_offload": ("dense", ["actor.offload=true"], ("offload", "update")),
    "dense_bf16": ("dense", ["model.dtype=bfloat16"], ("checkpoint",)),  # float32 main weights in the optimizer
    "moe_tp1": ("moe", [], ("log_probs", "export")),
    # right-padded micro-batches (the default is one packed THD row per micro-batch)
    "dense_padded": ("dense", ["actor.use_remove_padding=false"], ("log_probs", "update")),
    "moe_padded": ("moe", ["actor.use_remove_padding=false"], ("log_probs",)),
    "dense_tp2": ("dense_kv2", ["actor.tensor_parallel_size=2"], ("log_probs", "export", "update", "saved")),
    # TP 2 over the one KV head of the tiny Qwen3: megatron-core >= 0.16 replicates it on both TP ranks
    "dense_tp2_kv1": ("dense", ["actor.tensor_parallel_size=2"], ("log_probs", "export", "update", "saved")),
    "dense_pp2": ("dense", ["actor.pipeline_parallel_size=2"], ("log_probs", "export", "update")),
    "dense_dp2": ("dense", [], ("log_probs", "update")),  # data parallel: DDP sums, distributed optimizer shards
    "moe_ep2": ("moe", ["actor.expert_parallel_size=2"], ("log_probs", "export", "checkpoint")),
    # timings for docs/engines.md (not run by the tests): 128 samples, R = 32, micro-batches of 16
    "bench_fsdp": ("dense", ["actor.engine=fsdp", *BENCH], ("bench",)),
    "bench_fsdp_padded": ("dense", ["actor.engine=fsdp", "actor.use_remove_padding=false", *BENCH], ("bench",)),
    "bench_megatron": ("dense", BENCH, ("bench",)),
    "bench_megatron_padded": ("dense", ["actor.use_remove_padding=false", *BENCH], ("bench",)),
}


# case -> trainer.device for get_backend (default "cpu"); tests/mindspeed registers "npu" cases (the emulated NPU,
# GSPO_DEVICE_SHIM=1, under the real MindSpeed)
BACKEND: dict[str, str] = {}
# more jobs, registered by other workers: name -> fn(engine) -> dict merged into the case's result
EXTRA_JOBS: dict = {}


def model_path(kind: str, out: Path) -> str:
    if kind == "moe":
        return str(ensure_tiny_model(moe=True))
    if kind == "dense_kv2":
        return str(out / KV2_DIR)
    return str(ensure_tiny_model())


def make_kv2_model(out: Path) -> None:
    """The tiny Qwen3 with two (identical) KV heads, which TP=2 splits without replicating them (megatron-core
    before 0.16 cannot replicate; dense_tp2_kv1 runs the replicated one); written by the test process into ``out``."""
    fixtures.make_kv2_model(ensure_tiny_model(), out)


def sample_batch(model, seed: int, size: int = 16, width: int = 8) -> SampleBatch:
    """A rollout-like batch sampled at TEMPERATURE (gspo_ascend.selftest.fixtures.sample_batch)."""
    return fixtures.sample_batch(model, seed, TEMPERATURE, size, width)


def make_batches(path: Path) -> None:
    """The batches every case uses, written once by the test process (workers must not re-sample them: a
    different thread count could change a sampled token)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ensure_tiny_model(), dtype=torch.float32)
    torch.save({name: sample_batch(model, seed) for seed, name in enumerate(("main", "ckpt1", "ckpt2"))}, path)


def build(case: str, out: Path):
    kind, overrides, _ = CASES[case]
    cfg = load_config(None, [*BASE, *overrides])
    backend = get_backend(BACKEND.get(case, "cpu"))
    path = model_path(kind, out)
    if cfg.actor.engine == "fsdp":
        from gspo_ascend.engines.fsdp import FSDPEngine

        return FSDPEngine(cfg, backend, path)
    from gspo_ascend.engines.megatron import MegatronEngine

    return MegatronEngine(cfg, backend, path, force_offload=cfg.actor.offload)


def exported(engine) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().cpu().clone() for name, tensor in engine.export_weights()}


def run_case(case: str, out: Path, rank: int, world: int) -> None:
    _, _, jobs = CASES[case]
    result: dict = {"case": case}
    start = time.perf_counter()
    engine = build(case, out)
    result["build_s"] = time.perf_counter() - start
    result["token_budget"] = engine.cfg.actor.max_tokens_per_micro_batch
    if "bench" in jobs:  # its own batch
        result.update(bench(engine))
        engine.close()
        torch.save(result, out / f"{case}.rank{rank}.pt")
        return
    batches = torch.load(out / "batches.pt", weights_only=False)
    batch = batches["main"]
    mine = dp_shard(batch, rank, world, 1)
    result["rows"] = [rank * len(mine), (rank + 1) * len(mine)]
    for job in jobs:
        if job == "log_probs":
            result["log_probs"] = engine.compute_log_probs(mine, TEMPERATURE)
        elif job == "export":  # before any update: must equal the checkpoint; rank 0 keeps it
            weights = exported(engine)
            result["initial_weights"] = weights if rank == 0 else None
        elif job == "update":
            result["metrics"] = engine.update(dp_shard(batch, rank, world, MINIBATCHES), TEMPERATURE)
            weights = exported(engine)
            result["weights"] = weights if rank == 0 else None
            result["log_probs_after"] = engine.compute_log_probs(mine, TEMPERATURE)
        elif job == "save_hf":
            engine.save_hf(str(out / f"{case}.hf"), None)
        elif job == "checkpoint":
            result.update(checkpoint_round_trip(engine, case, out, rank, world, batches))
        elif job == "offload":
            result.update(offload_round_trip(engine, mine))
        elif job == "saved":
            result["attention_saved_per_token"] = attention_saved_per_token(engine)
        elif job == "nan":
            result.update(nan_step(engine, dp_shard(batch, rank, world, MINIBATCHES)))
        elif job in EXTRA_JOBS:
            result.update(EXTRA_JOBS[job](engine))
    engine.close()
    torch.save(result, out / f"{case}.rank{rank}.pt")


def attention_saved_per_token(engine, tokens: int = 64) -> float:
    """Bytes per token that the first layer's self-attention keeps for backward in one training forward of one
    ``tokens``-long sequence: the storages autograd saves while it runs (saved_tensors_hooks), each counted once,
    parameters left out. What the planner's layer_activation estimates, measured."""
    from gspo_ascend.engines import megatron_bridge as mb

    model = mb.unwrap(engine.models[0])
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    attention = model.decoder.layers[0].self_attention
    forward = attention.forward

    def hooked(*args, **kwargs):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return forward(*args, **kwargs)

    attention.forward = hooked
    try:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, 400, (1, tokens), generator=g)
        model(input_ids=ids, position_ids=torch.arange(tokens)[None], attention_mask=None)
    finally:
        del attention.forward  # the class's again
    return sum(saved.values()) / tokens


def nan_step(engine, batch: SampleBatch) -> dict:
    """The first micro-batch loss is NaN: minibatch 1 must be skipped (weights untouched, warm-up not advanced),
    minibatch 2 must step at the first warm-up learning rate."""
    before = exported(engine)
    original, calls = engine.policy_loss, []

    def poisoned(*args, **kwargs):
        loss, metrics = original(*args, **kwargs)
        calls.append(1)
        return (loss * float("nan"), metrics) if len(calls) == 1 else (loss, metrics)

    engine.policy_loss = poisoned
    metrics = engine.update(batch, TEMPERATURE)
    after = exported(engine)
    changed = sum(not torch.equal(before[n], after[n]) for n in before)
    finite = all(bool(torch.isfinite(t).all()) for t in after.values())
    steps = engine.optimizer_steps
    return {"nan_metrics": metrics, "nan_changed_tensors": changed, "nan_finite": finite, "steps": steps}


def checkpoint_round_trip(engine, case: str, out: Path, rank: int, world: int, batches: dict) -> dict:
    """update(b1) -> save -> update(b2) = A; a fresh engine: load -> update(b2) = B. A and B must be bitwise equal
    (metrics and every exported weight)."""
    first, second = (dp_shard(batches[name], rank, world, MINIBATCHES) for name in ("ckpt1", "ckpt2"))
    engine.update(first, TEMPERATURE)
    path = out / f"{case}.ckpt"
    if rank == 0:
        path.mkdir(exist_ok=True)
    dist.barrier()
    engine.save_checkpoint(str(path))
    metrics_a = engine.update(second, TEMPERATURE)
    weights_a = exported(engine)
    engine.close()
    resumed = build(case, out)
    resumed.load_checkpoint(str(path))
    metrics_b = resumed.update(second, TEMPERATURE)
    weights_b = exported(resumed)
    resumed.close()
    same = weights_a.keys() == weights_b.keys() and all(torch.equal(weights_a[n], weights_b[n]) for n in weights_a)
    return {"ckpt_metrics": (metrics_a, metrics_b), "ckpt_weights_equal": same}


def offload_round_trip(engine, batch: SampleBatch) -> dict:
    """actor.offload on CPU (forced): between calls the flat parameter and gradient buffers hold no storage; the
    results (here and of the update job after it) must equal those of the engine without offload. What is on the
    device in each phase (issue #25), by part, from the engine's own accounting (engines/megatron_offload.py):
    between calls, inside a weight export (its first tensor out), inside an update (its first loss)."""
    phases = {"idle": engine.resident_bytes()}
    log_probs = engine.compute_log_probs(batch, TEMPERATURE)
    stream = engine.export_weights()
    next(stream)
    phases["export"] = engine.resident_bytes()
    for _ in stream:
        pass
    phases["after_export"] = engine.resident_bytes()
    loss, seen = engine.policy_loss, []
    engine.policy_loss = lambda *a, **k: seen.append(engine.resident_bytes()) or loss(*a, **k)
    from gspo_ascend.engines.megatron_offload import offload_parts

    sizes = [t.untyped_storage().nbytes() for flat, _ in offload_parts(engine).values() for t in flat]
    return {"log_probs": log_probs, "offloaded_bytes": sizes, "phases": phases, "update_phase": seen}


def bench(engine, repeats: int = 5) -> dict:
    """Seconds per compute_log_probs / update of 128 samples (prompts 1-40 tokens, responses 1-32, R = 32) and
    per full export_weights, min and median over ``repeats`` after one warm-up call; exported bytes."""
    g = torch.Generator().manual_seed(0)
    size, width = 128, 32
    prompts = [torch.randint(3, 512, (int(torch.randint(1, 41, (1,), generator=g)),), generator=g).tolist()]
    prompts += [torch.randint(3, 512, (int(torch.randint(1, 41, (1,), generator=g)),), generator=g).tolist()
                for _ in range(size - 1)]  # fmt: skip
    lengths = torch.randint(1, width + 1, (size,), generator=g)
    mask = (torch.arange(width)[None] < lengths[:, None]).float()
    batch = SampleBatch(prompts, torch.randint(3, 512, (size, width), generator=g) * mask.long(), mask)
    old = engine.compute_log_probs(batch, 1.0)
    batch = batch.replace(old_log_probs=old, advantages=torch.randn(size, generator=g))
    calls = {
        "log_probs": lambda: engine.compute_log_probs(batch, 1.0),
        "update": lambda: engine.update(batch, 1.0),
        "export": lambda: sum(t.numel() * t.element_size() for _, t in engine.export_weights()),
    }
    out = {"tokens": batch.num_tokens()}
    for name, call in calls.items():
        value = call()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        times.sort()
        out[name] = (times[0], times[len(times) // 2])
        if name == "export":
            out["export_bytes"] = value
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", required=True, help="comma-separated names from CASES")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)  # ranks share two cores in CI
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for case in args.cases.split(","):
            run_case(case, args.out, rank, world)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
