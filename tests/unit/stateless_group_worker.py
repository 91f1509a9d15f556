"""One pool process for tests/unit/test_stateless_group.py:
``python -m tests.unit.stateless_group_worker RANK WORLD SYNC_PORT OWN_PORT OUT``.

Like a trainer (rank 0) or rollout process, it first initialises its own default world (gloo, world size 1, on
OWN_PORT), then joins the stateless weight-sync group of WORLD ranks on SYNC_PORT. Rank 0 broadcasts the tensors
of :func:`payload`; rank 1 broadcasts one back (src=1). It saves what it holds afterwards, and what its default
group looks like, to OUT.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from gspo_ascend.device.stateless_group import broadcast, destroy, stateless_process_group

TIMEOUT_S = 60.0


def payload() -> dict[str, torch.Tensor]:
    """Hand-made values, chosen so that only a bitwise copy reproduces them: signed zero, a subnormal, the extremes,
    infinities and NaN for float32; values that bfloat16 holds exactly; every byte boundary for uint8."""
    return {
        "float32": torch.tensor(
            [1.0, -0.0, 0.1, 3.4028234663852886e38, 1e-45, float("inf"), float("-inf"), float("nan"), -7.25],
            dtype=torch.float32,
        ),
        "bfloat16": torch.tensor([[1.0, -2.5, 0.0078125], [65280.0, -0.0, float("nan")]], dtype=torch.bfloat16),
        "uint8": torch.tensor([0, 1, 127, 128, 254, 255], dtype=torch.uint8),
    }


def back_payload() -> torch.Tensor:
    return torch.tensor([3.0, -1.5, 1e-40], dtype=torch.float32)


def main(rank: int, world: int, sync_port: int, own_port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{own_port}", rank=0, world_size=1)
    pg = stateless_process_group("gloo", "127.0.0.1", sync_port, rank, world, timeout_s=TIMEOUT_S)
    received = {}
    for name, sent in payload().items():
        tensor = sent.clone() if rank == 0 else torch.full_like(sent, 7)  # receivers start from other bytes
        broadcast(pg, tensor, src=0)
        received[name] = tensor
    back = back_payload() if rank == 1 else torch.zeros(3)
    broadcast(pg, back, src=1)
    received["back"] = back
    default = torch.tensor([float(rank + 1)])
    dist.all_reduce(default)  # the default group (world 1) still works after the stateless one was built
    destroy(pg)
    torch.save({"received": received, "world": dist.get_world_size(), "rank": dist.get_rank(), "default": default}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    r, w, sync, own = (int(a) for a in sys.argv[1:5])
    main(r, w, sync, own, sys.argv[5])
