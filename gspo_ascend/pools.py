"""Disaggregated rollout: a trainer pool and a rollout pool on devices of their own, joined by a sync group.

``trainer.nnodes x trainer.devices_per_node`` actors hold the train engine only (no KV cache), and
``rollout_pool.nnodes x rollout_pool.devices_per_node`` actors the rollout engine only (no optimizer state); each
pool is a :class:`~gspo_ascend.workers.WorkerGroup` with its own placement group and its own ``torch.distributed``
world, so megatron's parallel state and vLLM's external launcher see only their pool. Trainer rank 0 and every
rollout rank form the sync group (weight_sync.py), built once. :class:`DisaggregatedWorkers` answers the colocated
group's calls (the trainer's stages go to the trainer pool, generation to the rollout pool), so the driver's code
is the same for both, plus :meth:`~DisaggregatedWorkers.submit` for generation the driver does not wait for
(schedules/pool.py).

How we differ from verl's one-step-off (``verl/experimental/one_step_off_policy``): no second trainer class and no
AgentLoop server mode; the same offline engines, the same worker class with role flags, and the version of the
weights on each side counted, so the staleness bound is checked, not assumed.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any

from .cluster import ClusterWatch
from .config import Config
from .engines import Request, SampleBatch, SamplingParams
from .workers import Pending, WorkerGroup


def pool_config(cfg: Config) -> Config:
    """The config the rollout pool's actors get: the rollout pool's layout as their (trainer.*) world."""
    pool = cfg.rollout_pool
    return replace(cfg, trainer=replace(cfg.trainer, nnodes=pool.nnodes, devices_per_node=pool.devices_per_node))


def build_workers(cfg: Config, backend, model_path: str) -> WorkerGroup | DisaggregatedWorkers:
    if cfg.rollout_pool.devices_per_node > 0:
        return DisaggregatedWorkers(cfg, backend, model_path)
    return WorkerGroup(cfg, backend, model_path)


class DisaggregatedWorkers:
    """The two pools behind the colocated group's interface. ``version`` counts the trainer's optimizer phases
    (the weights version it holds), ``rollout_version`` the version the rollout pool last received."""

    def __init__(self, cfg: Config, backend, model_path: str) -> None:
        self.cfg = cfg
        t, pool = cfg.trainer, cfg.rollout_pool
        actors = t.nnodes * t.devices_per_node + pool.nnodes * pool.devices_per_node
        self.trainer = WorkerGroup(cfg, backend, model_path, rollout=False, actors=actors, pool="trainer")
        try:
            rollout_cfg = pool_config(cfg)
            self.rollout = WorkerGroup(rollout_cfg, backend, model_path, train=False, actors=actors, pool="rollout")
        except BaseException:
            self.trainer.shutdown()
            raise
        self.world_size = self.trainer.world_size
        self.watch = ClusterWatch(
            self.trainer.workers + self.rollout.workers,
            self.trainer.watch.nodes + self.rollout.watch.nodes,
            cfg.trainer.output_dir,
        )
        self.version = self.rollout_version = 0
        print(
            f"pools: trainer {self.trainer.world_size} rank(s), rollout {self.rollout.world_size} rank(s); weights "
            f"synced in buckets of {pool.sync_bucket_mb} MiB, max staleness {pool.max_staleness}",
            file=sys.stderr,
            flush=True,
        )
        try:
            self._join_sync()
        except BaseException:  # the driver never gets this object: free both pools' actors and bundles here
            self.shutdown()
            raise

    def _join_sync(self) -> None:
        """Trainer rank 0 is the sync group's rank 0 (and its store's host); rollout rank r is r + 1. Every member
        must join at once: the group's rendezvous waits for all of them."""
        addr, port = self.trainer._get([self.trainer.workers[0].address.remote()])[0]
        world = 1 + self.rollout.world_size
        refs = [self.trainer.workers[0].join_sync.remote(addr, port, 0, world)]
        refs += [w.join_sync.remote(addr, port, r + 1, world) for r, w in enumerate(self.rollout.workers)]
        self._get_both(refs)

    def _get_both(self, refs: list) -> list:
        """Fail-fast gathering over both pools' actors (a call that pairs them, a sync, fails as one line: a rank
        stuck in a broadcast whose peer died is not waited for)."""
        try:
            return self.watch.get(refs)
        finally:
            if self.watch.broken:  # nothing graceful is answered by a pool whose peer died mid-collective
                self.trainer.watch.broken = self.rollout.watch.broken = True

    # -- the rollout pool -------------------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> SampleBatch:
        return self.rollout.generate(prompts, params)

    def submit(self, prompts: list[list[int]], params: SamplingParams) -> Pending:
        return self.rollout.submit(prompts, params)

    def generate_requests(self, requests: list[Request], params: SamplingParams) -> SampleBatch:
        return self.rollout.generate_requests(requests, params)

    def generate_each(self, requests: list, on_done: Any = None) -> list[SampleBatch]:
        return self.rollout.generate_each(requests, on_done)

    # -- the trainer pool -------------------------------------------------------------------------------------

    def compute_log_probs(self, batch: SampleBatch, temperature: float):
        return self.trainer.compute_log_probs(batch, temperature)

    def update(self, batch: SampleBatch, temperature: float, minibatches: int) -> dict[str, float]:
        metrics = self.trainer.update(batch, temperature, minibatches)
        self.version += 1
        return metrics

    def save_checkpoint(self, path: str) -> None:
        self.trainer.save_checkpoint(path)

    def load_checkpoint(self, path: str) -> None:
        self.trainer.load_checkpoint(path)

    def save_hf(self, path: str) -> None:
        self.trainer.save_hf(path)

    # -- between them -----------------------------------------------------------------------------------------

    def sync_weights(self) -> dict[str, float]:
        """The trainer's weights (version ``self.version``) to every rollout rank. Both sides are called at once:
        the broadcasts pair the trainer's export with the rollout ranks' loads, bucket by bucket."""
        bucket = self.cfg.rollout_pool.sync_bucket_mb << 20
        sends = [w.send_weights.remote(bucket, self.version) for w in self.trainer.workers]
        loads = [w.receive_weights.remote() for w in self.rollout.workers]
        done = self._get_both(sends + loads)
        sent, received = done[0], done[len(sends) :]
        versions = {int(m["sync/version"]) for m in received}
        if versions != {self.version}:
            raise RuntimeError(f"weight sync: the rollout ranks received versions {versions}, sent {self.version}")
        self.rollout_version = self.version
        seconds = max(max(m["sync/time_s"] for m in done[: len(sends)]), max(m["sync/load_s"] for m in received))
        return {
            "sync/bytes": received[0]["sync/bytes"],  # the weights loaded, as the colocated sync counts them
            "sync/time_s": seconds,
            "sync/buckets": sent["sync/buckets"],
            # over the wire: the buckets' bytes, alignment padding included
            "perf/sync_GBps": sent["sync/bytes"] / seconds / 1e9 if seconds > 0 else 0.0,
        }

    def shutdown(self) -> None:
        try:
            self.rollout.shutdown()
        finally:
            self.trainer.shutdown()
