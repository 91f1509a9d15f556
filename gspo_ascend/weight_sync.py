"""Weights from the trainer pool to the rollout pool: bucketed broadcasts over a sync group of their own.

The sync group (:func:`gspo_ascend.device.stateless_group.stateless_process_group`) holds trainer rank 0 (its rank
0) and every rollout rank, and is built once per run, apart from both pools' own worlds. A sync:

* every trainer rank iterates its engine's ``export_weights()`` (a collective inside the trainer world: FSDP's
  full tensors, megatron's gathers), and rank 0 alone packs the HF-named tensors into flat ``uint8`` buckets of
  ``rollout_pool.sync_bucket_mb`` (a larger tensor travels alone) and broadcasts them;
* each bucket is preceded by its manifest (names, dtypes, shapes, offsets, and the weights version), so a receiver
  knows what it holds before the data arrives; an empty header ends the stream;
* each rollout rank turns the buckets back into ``(name, tensor)`` pairs, bitwise (raw bytes, reinterpreted), and
  feeds them to its engine's ``update_weights``: the same path as the colocated sync (every weight covered, prefix
  cache reset).

How we differ from verl's one-step-off sync (a broadcast per tensor over a Ray collective group, NCCL only) and its
checkpoint engine (ZMQ PUB/SUB for the bucket metadata): the manifest travels over the same group as the data (no
second transport that can drop a message), buckets bound the number of collectives, and the receiving side is the
engine's ordinary ``update_weights`` (phase 1 of the design: through the rollout actor, not device-to-device into
vLLM's worker process).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch

_HEADER = 3  # meta bytes, data bytes, weights version
_ALIGN = 16  # bytes: any dtype's element size divides it (a view of a uint8 slice needs an aligned offset)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"weight sync: unknown dtype {name!r} in a bucket manifest")
    return dtype


def raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's storage as a flat uint8 view (bitwise: no cast)."""
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


def buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive runs of ``named`` of at most ``bucket_bytes`` each (a larger tensor: a run of its own)."""
    run: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if run and size + nbytes > bucket_bytes:
            yield run
            run, size = [], 0
        run.append((name, tensor))
        size += nbytes
    if run:
        yield run


def _pack(run: list[tuple[str, torch.Tensor]], version: int, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    entries, parts, offset = [], [], 0
    for name, tensor in run:
        raw = raw_bytes(tensor)
        entries.append({"name": name, "dtype": str(tensor.dtype), "shape": list(tensor.shape), "offset": offset})
        pad = -raw.numel() % _ALIGN  # each tensor starts aligned: the receiver views the bucket without a copy
        parts += [raw, torch.zeros(pad, dtype=torch.uint8, device=raw.device)] if pad else [raw]
        offset += raw.numel() + pad
    meta = json.dumps({"version": version, "tensors": entries}).encode()
    data = torch.cat([p.to(device) for p in parts]) if parts else torch.empty(0, dtype=torch.uint8, device=device)
    return torch.frombuffer(bytearray(meta), dtype=torch.uint8).to(device), data


def send(
    group: Any, named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, version: int, device: Any
) -> dict[str, float]:
    """Trainer side. ``group`` is the sync group on trainer rank 0 and None on the other trainer ranks, which only
    drain ``named`` (their part of the export's collectives). Returns bytes, buckets and seconds sent."""
    from .device.stateless_group import broadcast

    start, sent, count = time.perf_counter(), 0, 0
    if group is None:
        for _ in named:
            pass
        return {"sync/bytes": 0.0, "sync/buckets": 0.0, "sync/time_s": time.perf_counter() - start}
    for run in buckets(named, bucket_bytes):
        meta, data = _pack(run, version, device)
        broadcast(group, torch.tensor([meta.numel(), data.numel(), version], dtype=torch.int64, device=device))
        broadcast(group, meta)
        broadcast(group, data)
        sent, count = sent + data.numel(), count + 1
    broadcast(group, torch.tensor([0, 0, version], dtype=torch.int64, device=device))  # the end of the stream
    return {"sync/bytes": float(sent), "sync/buckets": float(count), "sync/time_s": time.perf_counter() - start}


class Receiver:
    """Rollout side: iterate it for the ``(name, tensor)`` pairs of one sync, in the sender's order; ``version``
    holds the weights version the stream carried once it is exhausted."""

    def __init__(self, group: Any, device: Any) -> None:
        self.group, self.device = group, device
        self.version: int | None = None
        self.bytes = 0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        from .device.stateless_group import broadcast

        while True:
            header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
            broadcast(self.group, header)
            meta_len, data_len, version = (int(v) for v in header.tolist())
            self.version = version
            if meta_len == 0:
                return
            meta = torch.empty(meta_len, dtype=torch.uint8, device=self.device)
            broadcast(self.group, meta)
            data = torch.empty(data_len, dtype=torch.uint8, device=self.device)
            broadcast(self.group, data)
            self.bytes += data_len
            manifest = json.loads(meta.cpu().numpy().tobytes())
            yield from _unpack(manifest, data)


def _unpack(manifest: dict, data: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    for entry in manifest["tensors"]:
        dtype, shape = _dtype(entry["dtype"]), entry["shape"]
        raw = data[entry["offset"] : entry["offset"] + math.prod(shape) * dtype.itemsize]
        yield entry["name"], (raw.view(dtype) if dtype != torch.uint8 else raw).reshape(shape)
