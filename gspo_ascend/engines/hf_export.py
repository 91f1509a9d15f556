"""Writing a Hugging Face checkpoint from a train engine's weight stream (shared by every train engine).

The stream is the same ``(HF name, full tensor)`` sequence that refreshes the rollout engine, so the exported
checkpoint is exactly what vLLM / the hf engine were serving. Every rank consumes the stream (it is a
collective: FSDP all-gathers, Megatron gathers TP/EP shards and broadcasts PP stages); rank 0 buffers only
the tensors of the current safetensors file and writes it as soon as it is complete, so peak host memory is
one shard (5 GiB, Hugging Face's default), not the model.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

MAX_SHARD_BYTES = 5 * 1024**3


def element_size(tensor: torch.Tensor, dtype: torch.dtype) -> int:
    """Bytes per element once exported: floating tensors in ``dtype``, others (e.g. int buffers) as they are."""
    return (torch.empty((), dtype=dtype) if tensor.is_floating_point() else tensor).element_size()


def plan_shards(shapes: dict[str, torch.Tensor], names: list[str], dtype: torch.dtype) -> list[list[str]]:
    """Consecutive names grouped into files of at most MAX_SHARD_BYTES (a bigger tensor gets its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name in names:
        nbytes = shapes[name].numel() * element_size(shapes[name], dtype)
        if shards[-1] and size + nbytes > MAX_SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def shard_file_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def write_hf_checkpoint(
    path: str | Path,
    stream: Iterable[tuple[str, torch.Tensor]],
    *,
    rank: int,
    shapes: dict[str, torch.Tensor],  # name -> a tensor of the exported shape (real, DTensor or meta)
    names: list[str],  # what to write (tied aliases left out), in the order the stream yields them
    dtype: torch.dtype,
    hf_config: Any,
    generation_config: Any = None,
    tokenizer: Any = None,
) -> None:
    """safetensors (+ index when sharded) + config + generation config + tokenizer under ``path``."""
    from safetensors.torch import save_file

    out = Path(path)
    shards = plan_shards(shapes, names, dtype)
    files = shard_file_names(len(shards))
    shard_of = {n: i for i, shard in enumerate(shards) for n in shard}
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    pending: dict[str, torch.Tensor] = {}
    for name, tensor in stream:  # collective on every rank: iterate to the end everywhere
        if rank != 0 or name not in shard_of:
            continue
        pending[name] = tensor.detach().cpu().clone()  # the stream may reuse its buffers
        shard = shards[shard_of[name]]
        if all(n in pending for n in shard):
            save_file({n: pending.pop(n) for n in shard}, str(out / files[shard_of[name]]), {"format": "pt"})
    if rank != 0:
        return
    if len(shards) > 1:
        total = sum(shapes[n].numel() * element_size(shapes[n], dtype) for n in shard_of)
        index = {"metadata": {"total_size": total}, "weight_map": {n: files[i] for n, i in shard_of.items()}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
    config = copy.deepcopy(hf_config)
    config.dtype = dtype
    config.save_pretrained(out)
    if generation_config is not None:
        generation_config.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
