"""The weight sync between pools across two Ray nodes (issue #28, must-show 1): a head raylet and a second raylet on
this machine, one CPU each, so the trainer pool (1 rank) and the rollout pool (1 rank) are placed one per node. The
sync group is gloo between them. After each sync every tensor the rollout engine holds equals the trainer's export
bitwise (sha256 of the bytes, by HF name), before and after an update changed the weights.
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
                         "algorithm.minibatches_per_rollout=1", "rollout_pool.devices_per_node=1",
                         "rollout_pool.sync_bucket_mb=1"])
workers = DisaggregatedWorkers(cfg, get_backend("cpu"), model)
report = {"nodes": [n for n, _ in workers.trainer.watch.nodes + workers.rollout.watch.nodes]}
try:
    def digests():
        trainer = workers.trainer._all("weight_digests")[0]
        rollout = workers.rollout._all("weight_digests")[0]
        return trainer, rollout
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
    try:
        address = start_head(r, cluster, gcs, client, agent1, temps[0])
        join_node(r, cluster, address, agent2, temps[1], nodes=2)
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
    assert len(set(report["nodes"])) == 2, report["nodes"]  # the pools on different raylets
    for trainer, rollout in (report["first"], report["second"]):
        assert len(trainer) > 10 and trainer.keys() <= rollout.keys()
        assert {k: rollout[k] for k in trainer} == trainer  # every exported tensor, bitwise
        # the rollout model's non-persistent rotary buffers: computed from the config, not weights, never exported
        assert {k.rsplit(".", 1)[-1] for k in rollout.keys() - trainer.keys()} <= {"inv_freq", "original_inv_freq"}
    changed = [k for k in report["first"][0] if report["first"][0][k] != report["second"][0][k]]
    assert changed, "the update must have changed the weights the second sync carried"
    assert all(m["sync/buckets"] > 1 for m in report["metrics"])  # 1 MiB buckets: the tiny model in several
