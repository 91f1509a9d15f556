"""Helpers for tests/unit/test_fsdp_engine.py: deterministic batches, an independent log-prob reference
(one plain forward per sample, full log_softmax), and the data-parallel worker run in spawned processes."""

from __future__ import annotations

import dataclasses

import torch

from gspo_ascend.engines.base import SampleBatch

VOCAB_LOW, VOCAB_HIGH = 3, 500  # token ids of the tiny model's 512 that are neither pad nor eos


def make_batch(n: int, r: int, seed: int, max_prompt: int = 12, min_response: int = 0) -> SampleBatch:
    """``n`` samples with random prompts (1..max_prompt tokens), responses of min_response..r tokens (so some
    empty), right-padded with 0, and random advantages; old_log_probs left unset."""
    g = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(VOCAB_LOW, VOCAB_HIGH, (int(torch.randint(1, max_prompt + 1, (1,), generator=g)),), generator=g)
        for _ in range(n)
    ]
    lengths = torch.randint(min_response, r + 1, (n,), generator=g)
    mask = (torch.arange(r)[None, :] < lengths[:, None]).float()
    tokens = torch.randint(VOCAB_LOW, VOCAB_HIGH, (n, r), generator=g)
    responses = torch.where(mask.bool(), tokens, 0)
    advantages = torch.randn(n, generator=g)
    return SampleBatch([p.tolist() for p in prompts], responses, mask, advantages=advantages)


def with_old_log_probs(batch: SampleBatch, log_probs: torch.Tensor, noise: float, seed: int) -> SampleBatch:
    """old = current log-probs + noise on response tokens (so ratios are near 1, a few clipped)."""
    g = torch.Generator().manual_seed(seed)
    old = log_probs.float() + noise * torch.randn(log_probs.shape, generator=g)
    return batch.replace(old_log_probs=old * batch.response_mask)


def reference_log_probs(model: torch.nn.Module, batch: SampleBatch, temperature: float) -> torch.Tensor:
    """[B, R] log-probs from one unpadded forward per sample and a full log_softmax; differentiable."""
    rows = []
    for i, prompt in enumerate(batch.prompt_ids):
        n = int(batch.response_mask[i].sum())
        row = torch.zeros(batch.response_ids.shape[1], dtype=torch.promote_types(model.dtype, torch.float32))
        if n:
            seq = torch.tensor([prompt + batch.response_ids[i, :n].tolist()])
            logits = model(input_ids=seq, use_cache=False).logits[0].to(row.dtype) / temperature
            logp = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : len(prompt) - 1 + n]
            row = torch.cat([logp.gather(-1, batch.response_ids[i, :n, None]).squeeze(-1), row[n:]])
        rows.append(row)
    return torch.stack(rows)


def batch_to_dict(batch: SampleBatch) -> dict:
    return dataclasses.asdict(batch)


def engine_config(*overrides: str):
    from gspo_ascend.config import load_config

    return load_config(overrides=list(overrides))


def dp_worker(rank: int, world: int, tmp: str, overrides: list[str]) -> None:
    """One data-parallel rank: gloo group over a FileStore, the engine on the rank's shard, results to a file."""
    import torch.distributed as dist

    from gspo_ascend.device import get_backend
    from gspo_ascend.engines.fsdp import FSDPEngine
    from gspo_ascend.engines.microbatch import dp_shard
    from gspo_ascend.tiny import ensure_tiny_model

    torch.set_num_threads(1)  # two ranks on two shared cores
    dist.init_process_group("gloo", store=dist.FileStore(f"{tmp}/store", world), rank=rank, world_size=world)
    try:
        cfg = engine_config(*overrides)
        engine = FSDPEngine(cfg, get_backend("cpu"), str(ensure_tiny_model()))
        batch = SampleBatch(**torch.load(f"{tmp}/batch.pt", weights_only=True))
        shard = dp_shard(batch, rank, world, cfg.algorithm.minibatches_per_rollout)
        log_probs = engine.compute_log_probs(shard, 1.0)
        metrics = engine.update(shard, 1.0)
        weights = {name: tensor.clone() for name, tensor in engine.export_weights()}
        torch.save({"log_probs": log_probs, "metrics": metrics, "weights": weights}, f"{tmp}/out{rank}.pt")
    finally:
        dist.destroy_process_group()


def main(argv: list[str]) -> None:
    """``python -m tests.unit.fsdp_worker WORLD TMP OVERRIDE...``: import the heavy modules once, then fork the
    ranks (cheaper than spawning fresh interpreters that each import transformers; safe because this parent
    has run no torch op, so no thread pool exists yet)."""
    import gspo_ascend.engines.fsdp  # noqa: F401  (imported before the fork on purpose)

    world, tmp, overrides = int(argv[0]), argv[1], argv[2:]
    torch.multiprocessing.start_processes(dp_worker, args=(world, tmp, overrides), nprocs=world, start_method="fork")


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
