"""collectives/weight_sync: the disaggregated rollout's weight sync between two of this node's devices.

Two rank processes (:mod:`.launch`), each in its default world as a pool's process is, build the sync group a run
builds between its trainer pool and its rollout pool (``stateless_process_group`` in device/stateless_group.py, on
the device's comm backend: gloo on a host and under the NPU shim, NCCL on CUDA, HCCL on NPU) and pass hand-made
tensors through :func:`gspo_ascend.weight_sync.send` and :class:`~gspo_ascend.weight_sync.Receiver`, the run's own
code, in buckets small enough that there are several. The receiver checks every tensor, bitwise, against the same
tensors built from the same seed (no second channel to compare over), and the version the stream carried.

It exists because the pieces it joins fail on a node, not in a unit test: a TCPStore port a firewall drops, an
HCCL / NCCL communicator a second group on the same device cannot get, a dtype the device's collective cannot carry
(bf16 travels as bytes: the buckets are uint8). Small on purpose (~3 MiB): seconds on a CPU.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from .launch import free_port, rank_records
from .report import CheckFailed, CheckSkipped

FIX = (
    "docs/disaggregated.md: the sync group is a TCPStore on a free port plus the device's comm backend; run "
    "`gspo-ascend doctor` (HCCL / NCCL env, ports, firewall) and `selftest` collectives"
)
BUCKET_BYTES = 1 << 20  # several buckets from the ~3 MiB below, one tensor larger than a bucket among them
VERSION = 7  # any version other than 0: a receiver that reads no header would report 0 or -1
TIMEOUT_S = 300


def check_weight_sync(backend, devices: int, out: Path) -> str:
    if devices < 2:
        raise CheckSkipped("needs at least 2 devices (--devices 1): one sends, one receives")
    ranks = rank_records(backend, 2, "weight_sync", ["--port", str(free_port())], out, TIMEOUT_S, FIX)
    sent, received = ranks[0], ranks[1]
    if received["bytes"] != sent["bytes"]:  # every header and manifest matched, yet not the same bytes: say so
        raise CheckFailed(f"sent {sent['bytes']} bytes, received {received['bytes']}", FIX)
    gbps = sent["bytes"] / sent["seconds"] / 1e9 if sent["seconds"] > 0 else 0.0
    return (
        f"{received['tensors']} tensors ({', '.join(received['dtypes'])}) bitwise equal after send / Receiver on 2 "
        f"ranks over {backend.comm_backend}: {sent['bytes'] / 2**20:.1f} MiB in {sent['buckets']} buckets of "
        f"<= {BUCKET_BYTES >> 20} MiB, {gbps:.2f} GB/s"
    )


def tensors() -> list[tuple[str, object]]:
    """HF-style names and the tensors a sync carries, the same on every rank (a fixed seed, on the CPU): the
    dtypes of the run's exports and the values a cast or a float copy would change (NaN payloads, -0.0, inf,
    subnormals)."""
    import torch

    gen = torch.Generator().manual_seed(1234)
    special = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf"), 1e-40, 0.0, 1.0, -1.0])
    named = [
        ("model.embed_tokens.weight", torch.randn(512, 1024, generator=gen).to(torch.bfloat16)),  # 1 MiB: alone
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(256, 256, generator=gen).to(torch.bfloat16)),
        ("model.layers.0.mlp.experts.0.up_proj.weight", torch.randn(128, 256, generator=gen).to(torch.float16)),
        ("model.layers.0.input_layernorm.weight", torch.randn(1024, generator=gen)),
        ("model.layers.0.special", torch.cat([special, special.neg()])),
        ("model.layers.0.special_bf16", special.to(torch.bfloat16)),
        ("model.rotary.inv_freq", torch.randn(300, 7, generator=gen, dtype=torch.float64)),  # odd sizes: padding
        ("model.counter", torch.randint(-(2**40), 2**40, (333,), generator=gen)),
        ("model.mask", torch.randint(0, 2, (77,), generator=gen).bool()),
        ("model.bytes", torch.randint(0, 256, (5,), generator=gen).to(torch.uint8)),
        ("lm_head.weight", torch.randn(512, 1024, generator=gen).to(torch.bfloat16)),
    ]
    nan_payload = torch.tensor([0x7FC1, 0xFFC3 - 0x10000], dtype=torch.int16).view(torch.bfloat16)  # NaNs with payloads
    named.append(("model.nan_payloads", nan_payload))
    return named


# ----------------------------------------------------------------------------------------------- one rank


_KEEP: list = []  # the sync group, alive until the rank's os._exit


def rank_main(backend, out: Path, argv: list[str]) -> None:
    """Rank 0 sends, rank 1 receives and compares. Each writes ``weight_sync.rank<r>.json`` (errors, bytes, ...)."""
    import os

    import torch
    import torch.distributed as dist

    from ..device.stateless_group import stateless_process_group
    from ..engines.train_common import select_device
    from ..weight_sync import Receiver, raw_bytes, send

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    rank = dist.get_rank()
    device = select_device(backend, int(os.environ.get("LOCAL_RANK", rank)))
    wire = torch.device("cpu") if backend.comm_backend == "gloo" else device  # where buckets live (workers.py)
    group = stateless_process_group(backend.comm_backend, "127.0.0.1", args.port, rank, 2, timeout_s=120)
    expected = tensors()
    if rank == 0:  # from the device, as an engine's export is
        start = time.perf_counter()
        stats = send(group, [(n, t.to(device)) for n, t in expected], BUCKET_BYTES, VERSION, wire)
        backend.synchronize()
        result = {"errors": [], "bytes": int(stats["sync/bytes"]), "buckets": int(stats["sync/buckets"])}
        result["seconds"] = time.perf_counter() - start
    else:
        receiver = Receiver(group, wire)
        got = [(name, t.cpu().clone()) for name, t in receiver]
        result = {"errors": _compare(expected, got, receiver.version, raw_bytes), "bytes": receiver.bytes}
        result |= {"tensors": len(got), "dtypes": sorted({str(t.dtype).removeprefix("torch.") for _, t in got})}
    # the group is left to the process's end, as rank.py leaves the default one (its _exit says why): kept referenced
    # here, since dropping the last reference when this function returns runs gloo's teardown, which deadlocks now
    # and then (seen: rank 0 idle at rank.py's call of this function after writing its result, 1 run in ~5)
    _KEEP.append(group)
    (out / f"weight_sync.rank{rank}.json").write_text(json.dumps(result))


def _compare(expected: list, got: list, version: int | None, raw_bytes) -> list[str]:
    import torch

    errors = []
    if version != VERSION:
        errors.append(f"the stream carried weights version {version}, sent {VERSION}")
    if [n for n, _ in got] != [n for n, _ in expected]:
        errors.append(f"received names {[n for n, _ in got][:4]}..., sent {[n for n, _ in expected][:4]}...")
        return errors
    for (name, want), (_, have) in zip(expected, got, strict=True):
        if have.dtype != want.dtype or have.shape != want.shape:
            errors.append(f"{name}: received {have.dtype} {tuple(have.shape)}, sent {want.dtype} {tuple(want.shape)}")
        elif not torch.equal(raw_bytes(have), raw_bytes(want)):
            differ = int((raw_bytes(have) != raw_bytes(want)).sum())
            errors.append(f"{name} ({want.dtype}): {differ} of {raw_bytes(want).numel()} bytes differ")
    return errors
