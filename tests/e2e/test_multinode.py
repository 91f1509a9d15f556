"""Two Ray nodes on one machine, in CI (issue 18, build item 1).

One test, in two halves that share the tiny model, the data and the uninterrupted reference:

1. The CPU launch script for real with ``NNODES=2``, head and worker started the way docs/launch-scripts.md says
   (``NNODES=2 bash scripts/cpu/tiny_gspo.sh`` and ``NODE_RANK=1 HEAD_ADDR=... NNODES=2 bash scripts/...``). Two
   raylets on localhost, separate node ids and one CPU each, so the two training ranks of the 2 x 1 layout can only
   be placed one per node; the driver's ``workers:`` line names both. Each checkpoint holds the shards and rank
   files of both ranks, written from both nodes into one directory. Both launchers stop what they started.
2. The same run on a 2-node cluster started with ``ray start``: after checkpoint ``step_2`` the second node is
   killed (its raylet and the worker processes it started, as a lost machine goes). The driver stops within
   Ray's node-death detection plus our poll, with one line naming that node and what to do. A new node joins, the
   same command resumes from ``step_2``, and the result equals the uninterrupted run of half 1: the same metrics
   (wall times and the rollout-gap diagnostic aside, as in tests/e2e/test_train_e2e.py) and bitwise-equal weights.

Two nodes on one host need their own Ray temp directories (``--temp-dir`` per node): with one shared directory
the second node's runtime-env agent replaces the job's ``working_dir`` under the driver (seen: ``FileNotFoundError``
from ``os.getcwd()``). On a cluster every node has its own disk and this does not arise.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO
from tests.e2e.procs import cmdline, descendants
from tests.e2e.test_train_e2e import final_weights, read_metrics, trajectory
from tests.unit.test_scripts import free_ports, processes_mentioning

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RAY = str(Path(sys.executable).parent / "ray")
STEPS = ("trainer.total_steps=4", "trainer.save_freq=2", "data.train_batch_size=8", "rollout.n=4")


def run_overrides() -> tuple[str, ...]:
    """The run of both halves: 4 steps, checkpoints at 2 and 4; no validation (not under test, and slow)."""
    from gspo_ascend.config import valid_keys

    off = ("trainer.test_freq=0", "trainer.val_before_train=false")
    return STEPS + tuple(o for o in off if o.split("=")[0] in valid_keys())


def raylet_of(ray_start_pid: int) -> tuple[int, str]:
    """(pid, node id) of the raylet a `ray start --block` process started."""
    for pid in descendants(ray_start_pid):
        match = re.search(r"raylet/raylet .*--node_id=([0-9a-f]+)", cmdline(pid))
        if match:
            return pid, match.group(1)
    raise AssertionError(f"no raylet under `ray start` (pid {ray_start_pid})")


def placement(output: str) -> list[str]:
    """Node ids (8 characters) per rank from the driver's `workers:` line (stderr; `ray job submit` merges both)."""
    [line] = [line for line in output.splitlines() if line.startswith("workers: ")]
    return re.findall(r"rank \d+ on node ([0-9a-f]{8})", line)


def stop(proc: subprocess.Popen, timeout: float = 120) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # `ray start --block` stops the processes it started
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def ray_env(tmp_path):
    from gspo_ascend.data import prepare_data
    from gspo_ascend.tiny import ensure_tiny_model

    data = tmp_path / "data"
    prepare_data("synthetic", None, data, seed=0, num_train=64, num_test=8)
    head_tmp = Path(tempfile.mkdtemp(prefix="gh", dir="/tmp"))  # short: Ray's unix sockets live under it
    node_tmp = Path(tempfile.mkdtemp(prefix="gw", dir="/tmp"))
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("NODE_RANK", "HEAD_ADDR", "RAY_ADDRESS")},
        "PYTHON": sys.executable,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(32),  # no ~/.ray/auth_token is written
        "RAY_POLL_S": "1",
        "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",  # Ray's SIGTERM drain (for Serve) would add 30 s
        "RAY_gcs_rpc_server_reconnect_timeout_s": "10",  # a worker node leaves 10 s after its head, not 60
        "OMP_NUM_THREADS": "1",
    }
    yield {
        "env": env,
        "model": ensure_tiny_model(),
        "data": data,
        "head_tmp": head_tmp,
        "node_tmp": node_tmp,
    }
    for tmp in (head_tmp, node_tmp):
        shutil.rmtree(tmp, ignore_errors=True)


def launch_two_nodes(r: dict, out: Path) -> tuple[subprocess.CompletedProcess, str]:
    """Half 1: head and worker launchers, as the docs say; returns the head's result and the worker's output."""
    gcs, dashboard, client, agent1, agent2 = free_ports(5)
    common = {
        **r["env"],
        "NNODES": "2",
        "DEVICES_PER_NODE": "1",
        "HEAD_ADDR": "127.0.0.1",
        "RAY_PORT": str(gcs),
        "DASHBOARD_PORT": str(dashboard),
        "RAY_TMPDIR": str(r["head_tmp"]),
        "MODEL_PATH": str(r["model"]),
        "DATA_DIR": str(r["data"]),
        "OUTPUT_DIR": str(out),
    }
    head_args = f"--num-cpus=1 --ray-client-server-port={client} --dashboard-agent-listen-port={agent1}"
    node_args = f"--num-cpus=1 --dashboard-agent-listen-port={agent2} --temp-dir={r['node_tmp']}"
    script = str(REPO / "scripts/cpu/tiny_gspo.sh")
    worker = subprocess.Popen(
        ["bash", script],
        env={**common, "NODE_RANK": "1", "RAY_START_ARGS": node_args},
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        head = subprocess.run(
            ["bash", script, *run_overrides()],
            env={**common, "RAY_START_ARGS": head_args},
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=900,
        )
        worker_out = worker.communicate(timeout=180)[0]  # it serves until its head is gone
    finally:
        stop(worker)
    assert worker.returncode == 0, worker_out[-3000:]
    return head, worker_out


def start_node(r: dict, *args: str, temp: Path, head: bool) -> subprocess.Popen:
    """``ray start --block`` with its own temp directory; what it prints goes to ``temp/ray-start.log``, which
    wait_for_nodes shows if the node dies before it serves."""
    env = dict(r["env"])
    if head:  # the head decides when a silent node is dead: 3 missed checks of 1 s (Ray's default: 5 of 3 s)
        env.update(RAY_health_check_period_ms="1000", RAY_health_check_failure_threshold="3")
    with open(temp / "ray-start.log", "wb") as log:
        proc = subprocess.Popen(
            [RAY, "start", "--block", "--disable-usage-stats", "--num-cpus=1", f"--temp-dir={temp}", *args],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    proc.log = temp / "ray-start.log"  # type: ignore[attr-defined]
    return proc


def start_head(r: dict, cluster: list, gcs: int, client: int, agent: int, temp: Path, extra: tuple = ()) -> str:
    """A head node at 127.0.0.1:``gcs``, kept in ``cluster`` (the caller stops it) before it is waited for; returns
    its address once it serves. ``extra``: more `ray start` arguments (a later one of the same option wins)."""
    args = ("--head", f"--port={gcs}", "--node-ip-address=127.0.0.1", "--include-dashboard=false")
    ports = (f"--ray-client-server-port={client}", f"--dashboard-agent-listen-port={agent}")
    cluster.append(start_node(r, *args, *ports, *extra, temp=temp, head=True))
    address = f"127.0.0.1:{gcs}"
    wait_for_nodes(r, address, 1, cluster[-1:])
    return address


def join_node(
    r: dict, cluster: list, address: str, agent: int, temp: Path, nodes: int, extra: tuple = ()
) -> subprocess.Popen:
    """A worker node joining ``address``, kept in ``cluster``, returned once ``nodes`` nodes serve."""
    args = (f"--address={address}", "--node-ip-address=127.0.0.1", f"--dashboard-agent-listen-port={agent}")
    node = start_node(r, *args, *extra, temp=temp, head=False)
    cluster.append(node)
    wait_for_nodes(r, address, nodes, [node])
    return node


def wait_for_nodes(r: dict, address: str, n: int, started: list, timeout: float = 180) -> None:
    """Until ``n`` nodes are active at ``address``; fails at once, with its log, if a node in ``started`` exits."""
    deadline = time.monotonic() + timeout
    status = None
    while time.monotonic() < deadline:
        for proc in started:
            if proc.poll() is not None:
                log = proc.log.read_text(errors="replace")[-3000:]
                raise AssertionError(f"`ray start` exited ({proc.returncode}) before serving {address}:\n{log}")
        try:
            status = subprocess.run(
                [RAY, "status", f"--address={address}"], env=r["env"], capture_output=True, text=True, timeout=60
            )
        except subprocess.TimeoutExpired:
            continue
        active = status.stdout.split("Active:", 1)[-1].split("Pending:", 1)[0]
        if status.returncode == 0 and active.count("node_") >= n:
            return
        time.sleep(1)
    said = "" if status is None else (status.stdout + status.stderr)[-2000:]
    logs = "".join(f"\n--- {p.log}:\n" + p.log.read_text(errors="replace")[-2000:] for p in started)
    raise AssertionError(f"{n} Ray node(s) did not join {address} within {timeout} s; `ray status`:\n{said}{logs}")


def train_on(r: dict, address: str, out: Path) -> list[str]:
    """The command of half 2: the same run as the launcher's job, joining the cluster at ``address``."""
    return [
        sys.executable,
        "-m",
        "gspo_ascend.cli",
        "train",
        f"model.path={r['model']}",
        f"data.train_files=[{r['data'] / 'train.parquet'}]",
        "trainer.device=cpu",
        "trainer.nnodes=2",
        "trainer.devices_per_node=1",
        f"trainer.output_dir={out}",
        *run_overrides(),
    ]


def assert_both_launchers_trained_and_stopped(r: dict, straight: Path, head, worker_out: str) -> None:
    """Half 1's verdict: the run finished across two nodes, wrote one checkpoint directory from both, and each
    launcher stopped exactly the Ray node it started."""
    assert head.returncode == 0, head.stdout[-4000:] + head.stderr[-3000:]
    assert "succeeded" in head.stdout + head.stderr and "step 4/4" in head.stdout
    assert "# cluster ready: 2 node(s), 2 CPU" in head.stdout
    nodes = placement(head.stdout)
    assert len(nodes) == 2 and nodes[0] != nodes[1], nodes  # rank 0 and rank 1 on different nodes
    for step in (2, 4):  # one directory, written from both nodes
        engine = straight / "checkpoints" / f"step_{step:08d}" / "engine"
        assert {"engine_rank0.pt", "engine_rank1.pt", "__0_0.distcp", "__1_0.distcp"} <= {
            p.name for p in engine.iterdir()
        }
    assert "stopping the Ray node this launcher started" in head.stdout
    assert "serve the cluster until the head stops" in worker_out
    for tmp in (r["head_tmp"], r["node_tmp"]):
        deadline = time.monotonic() + 60
        while processes_mentioning(str(tmp)) and time.monotonic() < deadline:
            time.sleep(1)
        assert processes_mentioning(str(tmp)) == [], tmp  # both launchers stopped what they started


def lose_a_node_after_step_2(r: dict, address: str, node: subprocess.Popen, out_dir: Path, timings: dict):
    """Train on the cluster at ``address``, kill ``node`` (its raylet and the workers it started) once step 2's
    checkpoint is complete; the driver's exit code, stdout, stderr and the lost node's id."""
    driver = subprocess.Popen(
        train_on(r, address, out_dir),
        env={**r["env"], "RAY_ADDRESS": address},
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 600
        while not (out_dir / "checkpoints" / "step_00000002" / "COMPLETE").exists():
            assert driver.poll() is None and time.monotonic() < deadline, "no checkpoint at step 2"
            time.sleep(0.1)
        raylet, lost_node = raylet_of(node.pid)
        victims = [raylet, *descendants(raylet)]  # the raylet and the workers it started: the node is gone
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        t_kill = time.monotonic()
        out, err = driver.communicate(timeout=300)
        timings["node_loss_to_driver_exit_s"] = time.monotonic() - t_kill
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    return driver.returncode, out, err, lost_node


def test_two_nodes_launch_checkpoint_node_loss_and_resume(ray_env, tmp_path):
    r, timings = ray_env, {}
    # ---------------------------------------------------------------------------------------- half 1: launchers
    straight = tmp_path / "straight"
    t0 = time.monotonic()
    head, worker_out = launch_two_nodes(r, straight)
    timings["launch_2_nodes_s"] = time.monotonic() - t0
    assert_both_launchers_trained_and_stopped(r, straight, head, worker_out)

    # ---------------------------------------------------------------------- half 2: node loss, then resume
    gcs, client, agent1, agent2, agent3 = free_ports(5)
    head_tmp = Path(tempfile.mkdtemp(prefix="gh", dir="/tmp"))
    node_tmps = [Path(tempfile.mkdtemp(prefix="gw", dir="/tmp")) for _ in range(2)]
    cluster: list[subprocess.Popen] = []
    try:
        address = start_head(r, cluster, gcs, client, agent1, head_tmp)
        second = join_node(r, cluster, address, agent2, node_tmps[0], nodes=2)

        resumed = tmp_path / "resumed"
        code, out, err, lost_node = lose_a_node_after_step_2(r, address, second, resumed, timings)
        assert code == 1, out[-2000:] + err[-4000:]
        assert "Traceback" not in err, err[-4000:]
        errors = [line for line in err.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1, err[-4000:]
        # the address is the one the node registered (Ray resolves 127.0.0.1 to this host's address)
        assert re.match(
            rf"error: Ray node {lost_node[:8]} \([0-9.]+\), which ran training worker rank\(s\) [01], ", errors[0]
        )
        assert "was lost mid-run" in errors[0] and "Bring the node back into the cluster" in errors[0]
        assert errors[0].endswith(f"it resumes from {resumed.resolve() / 'checkpoints' / 'step_00000002'}")
        assert not (resumed / "checkpoints" / "step_00000004").exists()

        join_node(r, cluster, address, agent3, node_tmps[1], nodes=2)
        t0 = time.monotonic()
        again = subprocess.run(
            train_on(r, address, resumed),
            env={**r["env"], "RAY_ADDRESS": address},
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=900,
        )
        timings["resume_s"] = time.monotonic() - t0
        assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
        assert f"resumed from {resumed.resolve() / 'checkpoints' / 'step_00000002'} at step 2" in again.stdout
        assert len(set(placement(again.stderr))) == 2
    finally:
        for proc in reversed(cluster):
            stop(proc)
        for tmp in (head_tmp, *node_tmps):
            shutil.rmtree(tmp, ignore_errors=True)
    print("timings:", {k: round(v, 1) for k, v in timings.items()})

    ours, theirs = read_metrics(resumed), read_metrics(straight)
    assert [row["step"] for row in ours] == [1, 2, 3, 4]
    assert trajectory(ours) == trajectory(theirs)
    a, b = final_weights(straight), final_weights(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
