"""The weight sync between pools across two Ray nodes (issue #28, must-show 1), with the pools sharing both nodes as
the launch scripts start them (issue #41, audit finding 2): a head raylet and a second raylet on this machine, each
giving Ray one trainer and one rollout share (``gspo_trainer_pool`` / ``gspo_rollout_pool``, as scripts/lib/ray.sh
does), so the trainer pool (2 ranks) and the rollout pool (2 ranks) hold one rank on each node: the layout the
config describes, not PACK's (which puts both trainer ranks on the first node that has room). What then runs is what
runs at scale: a trainer world and a rollout world across both nodes, and the sync group (trainer rank 0 and both
rollout ranks) across them, gloo here. After each sync every tensor each rollout rank holds equals the trainer's
export bitwise (sha256 of the bytes, by HF name), before and after an update changed the weights.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.e2e.test_multinode import join_node, ray_env, start_head, stop  # noqa: F401, F811 (a fixture)
from tests.unit.test_scripts import free_ports

pytestmark = pytest.mark.slow

DRIVER = """
import json, sys
from gspo_ascend.config import load_config
from gspo_ascend.device import get_backend
from gspo_ascend.pools import DisaggregatedWorkers
from gspo_ascend.engines import SamplingParams

model, data = sys.argv[1], sys.argv[2]
cfg = load_config(None, [f"model.path={model}", f"data.train_files=[{data}]", "trainer.device=cpu",
                         "data.train_batch_size=2", "rollout.n=2", "actor.lr=1e-3",
                         "algorithm.minibatches_per_rollout=1", "trainer.nnodes=2", "rollout_pool.nnodes=2",
                         "rollout_pool.devices_per_node=1", "rollout_pool.sync_bucket_mb=1"])
workers = DisaggregatedWorkers(cfg, get_backend("cpu"), model)
report = {"nodes": [n for n, _ in workers.trainer.watch.nodes + workers.rollout.watch.nodes]}
try:
    def digests():
        trainer = workers.trainer._all("weight_digests")[0]
        return trainer, workers.rollout._all("weight_digests")
    report["metrics"] = [workers.sync_weights()]
    report["first"] = digests()
    batch = workers.generate([[1, 2, 3, 4], [5, 6, 7]], SamplingParams(n=2, max_new_tokens=8, seed=3))
    batch.old_log_probs = workers.compute_log_probs(batch, 1.0)
    import torch
    batch.advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    workers.update(batch, 1.0, 1)
    report["metrics"].append(workers.sync_weights())
    report["second"] = digests()
finally:
    workers.shutdown()
print("REPORT " + json.dumps(report))
"""


def test_every_synced_tensor_is_the_trainers_export_bitwise_across_two_nodes(ray_env, tmp_path):  # noqa: F811
    r = ray_env
    gcs, client, agent1, agent2 = free_ports(4)
    temps = [Path(tempfile.mkdtemp(prefix=p, dir="/tmp")) for p in ("gh", "gw")]
    cluster: list[subprocess.Popen] = []
    # each node: one rank of each pool (its shares, as the launcher gives them) and CPUs for both
    shares = ("--num-cpus=2", '--resources={"gspo_trainer_pool": 1, "gspo_rollout_pool": 1}')
    try:
        address = start_head(r, cluster, gcs, client, agent1, temps[0], shares)
        join_node(r, cluster, address, agent2, temps[1], nodes=2, extra=shares)
        done = subprocess.run(
            [sys.executable, "-c", DRIVER, str(r["model"]), str(r["data"] / "train.parquet")],
            env={**r["env"], "RAY_ADDRESS": address},
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=600,
        )
    finally:
        for proc in reversed(cluster):
            stop(proc)
        for tmp in temps:
            shutil.rmtree(tmp, ignore_errors=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout.split("REPORT ", 1)[1])
    trainer_nodes, rollout_nodes = report["nodes"][:2], report["nodes"][2:]
    # each pool has one rank on each node (PACK alone: both trainer ranks on one node, both rollout ranks on the other)
    assert len(set(trainer_nodes)) == 2 and set(rollout_nodes) == set(trainer_nodes), report["nodes"]
    assert "note: this cluster's nodes give no" not in done.stderr
    for trainer, rollouts in (report["first"], report["second"]):
        assert len(rollouts) == 2
        for rollout in rollouts:  # the rank on the trainer's node and the one across the network
            assert len(trainer) > 10 and trainer.keys() <= rollout.keys()
            assert {k: rollout[k] for k in trainer} == trainer  # every exported tensor, bitwise
            # the rollout model's non-persistent rotary buffers: computed from the config, never exported
            extra = {k.rsplit(".", 1)[-1] for k in rollout.keys() - trainer.keys()}
            assert extra <= {"inv_freq", "original_inv_freq"}
    changed = [k for k in report["first"][0] if report["first"][0][k] != report["second"][0][k]]
    assert changed, "the update must have changed the weights the second sync carried"
    assert all(m["sync/buckets"] > 1 for m in report["metrics"])  # 1 MiB buckets: the tiny model in several
