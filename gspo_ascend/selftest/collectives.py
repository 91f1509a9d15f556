"""Layer 2: all-reduce, all-gather and broadcast across the node's devices over the device contract's backend.

One process per device (:mod:`.launch`; two gloo ranks on a CPU host). Each rank first checks exact results on
small integer-valued fp32 tensors (a sum of ranks, each rank's own block, the source rank's values), then times
each collective on a larger buffer and reports bus bandwidth the way nccl-tests / hccl_test do: algorithm bandwidth
``bytes / time`` times ``2 (n - 1) / n`` for all-reduce, ``(n - 1) / n`` for all-gather (bytes = the gathered
output) and 1 for broadcast, so the numbers compare with the link's rated bandwidth.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from .launch import rank_records
from .report import CheckSkipped

FIX = "docs/troubleshooting.md#selftest-collectives: run `gspo-ascend doctor` (HCCL / NCCL env, ports, firewall)"
HOST_BYTES, DEVICE_BYTES = 8 * 2**20, 64 * 2**20  # timed buffer: small on a host (gloo over shared cores)
TIMEOUT_S = 300


def check_collectives(backend, devices: int, out: Path) -> str:
    if devices < 2:
        raise CheckSkipped("needs at least 2 devices (--devices 1)")
    size = HOST_BYTES if backend.torch_device_type == "cpu" else DEVICE_BYTES
    ranks = rank_records(backend, devices, "collectives", ["--bytes", str(size)], out, TIMEOUT_S, FIX)
    bandwidth = ranks[0]["bus_gbps"]
    rates = ", ".join(f"{op} {gbps:.2f} GB/s" for op, gbps in bandwidth.items())
    return (
        f"all_reduce, all_gather, broadcast exact on {devices} ranks over {backend.comm_backend}; bus bandwidth at "
        f"{size // 2**20} MiB: {rates}"
    )


# ----------------------------------------------------------------------------------------------- one rank


def _exactness(device, rank: int, world: int) -> list[str]:
    import torch
    import torch.distributed as dist

    errors = []
    x = torch.full((1024,), float(rank + 1), device=device)
    dist.all_reduce(x)
    if not bool((x == world * (world + 1) / 2).all()):
        errors.append(f"all_reduce on rank {rank}: got {x[:4].tolist()}..., expected {world * (world + 1) / 2}")
    mine = torch.arange(4, dtype=torch.float32, device=device) + 10 * rank
    gathered = [torch.empty(4, device=device) for _ in range(world)]
    dist.all_gather(gathered, mine)
    for r, got in enumerate(gathered):
        if got.tolist() != [10.0 * r + i for i in range(4)]:
            errors.append(f"all_gather on rank {rank}: block {r} is {got.tolist()}")
    src = world - 1
    b = torch.arange(1024, dtype=torch.float32, device=device)
    if rank != src:
        b.fill_(-1.0)
    dist.broadcast(b, src=src)
    if not torch.equal(b.cpu(), torch.arange(1024, dtype=torch.float32)):
        errors.append(f"broadcast on rank {rank}: got {b[:4].tolist()}..., expected 0, 1, 2, ...")
    return errors


def _bus_bandwidth(backend, device, world: int, size: int, iters: int) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    x = torch.ones(size // 4, device=device)
    parts = [torch.empty(size // 4 // world, device=device) for _ in range(world)]
    piece = torch.ones(size // 4 // world, device=device)
    ops = {  # name: (call, bytes moved as nccl-tests counts them, bus factor)
        "all_reduce": (lambda: dist.all_reduce(x), size, 2 * (world - 1) / world),
        "all_gather": (lambda: dist.all_gather(parts, piece), size // world * world, (world - 1) / world),
        "broadcast": (lambda: dist.broadcast(x, src=0), size, 1.0),
    }
    out = {}
    for name, (call, nbytes, factor) in ops.items():
        call()  # warm-up: connection set-up and buffer registration
        backend.synchronize()
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            call()
            backend.synchronize()
            times.append(time.perf_counter() - start)
        out[name] = nbytes / statistics.median(times) * factor / 1e9
    return out


def rank_main(backend, out: Path, argv: list[str]) -> None:
    import os

    import torch.distributed as dist

    from ..engines.train_common import select_device

    parser = argparse.ArgumentParser()
    parser.add_argument("--bytes", type=int, required=True)
    args = parser.parse_args(argv)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = select_device(backend, int(os.environ.get("LOCAL_RANK", rank)))
    result = {"errors": _exactness(device, rank, world)}
    iters = 3 if backend.torch_device_type == "cpu" else 20
    result["bus_gbps"] = _bus_bandwidth(backend, device, world, args.bytes, iters)
    (out / f"collectives.rank{rank}.json").write_text(json.dumps(result))
