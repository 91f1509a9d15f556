"""The stateless weight-sync group (gspo_ascend/device/stateless_group.py) on gloo, across separate processes.

Three processes stand for a trainer (rank 0) and two rollout processes: each has its own default world of size 1
(as each pool would), then all three build the stateless group. The receivers must hold the sender's bytes
exactly, and every default group must be untouched. Each process is time-bound (a hung rendezvous fails the test
within ~2 minutes and the processes are killed).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO
from tests.unit.stateless_group_worker import back_payload, payload

WORLD = 3
JOIN_TIMEOUT_S = 120


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def test_broadcast_over_stateless_group_leaves_default_worlds_alone(tmp_path):
    sync_port, *own_ports = _free_ports(WORLD + 1)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    }
    env["OMP_NUM_THREADS"] = "1"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.unit.stateless_group_worker",
                str(rank),
                str(WORLD),
                str(sync_port),
                str(own_ports[rank]),
                str(tmp_path / f"rank{rank}.pt"),
            ],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(WORLD)
    ]
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=JOIN_TIMEOUT_S)[0])
    except subprocess.TimeoutExpired:
        pytest.fail("a rank did not finish in time: the stateless group hung")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert [p.returncode for p in procs] == [0] * WORLD, "\n".join(log[-3000:] for log in logs)

    expected = {**payload(), "back": back_payload()}
    for rank in range(WORLD):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        for name, want in expected.items():
            got = result["received"][name]
            assert got.dtype == want.dtype and got.shape == want.shape, (rank, name)
            assert _bytes(got) == _bytes(want), f"rank {rank} {name}: {got} != {want}"
        assert (result["world"], result["rank"]) == (1, 0)  # the default group is still this process alone
        assert result["default"].tolist() == [float(rank + 1)]  # a world-1 all_reduce: its own value


def test_unknown_backend_and_bad_rank_fail_before_any_network():
    from gspo_ascend.device.stateless_group import stateless_process_group

    with pytest.raises(ValueError, match="gloo"):
        stateless_process_group("mpi", "127.0.0.1", 1, 0, 2)
    with pytest.raises(ValueError, match="outside"):
        stateless_process_group("gloo", "127.0.0.1", 1, 2, 2)


def test_hccl_without_torch_npu_is_one_line_device_error():
    """On a box without CANN the hccl group fails with the project's one-line DeviceError, not an ImportError."""
    from gspo_ascend.device import detect
    from gspo_ascend.device.stateless_group import stateless_process_group
    from gspo_ascend.errors import DeviceError

    module = detect.import_torch_npu()[0]
    if module is not None and not getattr(module, "_gspo_shim", False):
        pytest.skip("a real torch_npu imports here")  # the shim's torch_npu has no HCCL: that case is tested
    (port,) = _free_ports(1)
    with pytest.raises(DeviceError, match="torch_npu"):
        stateless_process_group("hccl", "127.0.0.1", port, 0, 1, timeout_s=10)
