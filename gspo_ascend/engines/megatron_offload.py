"""actor.offload for the megatron engine: parameters, gradient buffers and optimizer state to host memory between
calls, each part on its own, so that a weight export brings up only the parameters (the sync runs beside the
rollout engine's weights; with the gradients and optimizer state as well, the 30B layout's sync would need
64.6 GiB of a 64 GiB 910B: issue #25). verl moves the same parts with separate functions (verl/utils/
megatron_utils.py: offload_megatron_model_to_cpu, offload_megatron_grad_to_cpu, offload_megatron_optimizer).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class MegatronEngine(Protocol):
    """What offloading reads of megatron.MegatronEngine (a protocol: that module imports this one)."""

    models: list[Any]  # megatron-core's DDP-wrapped model chunks
    device: torch.device

    def _sub_optimizers(self) -> list[Any]: ...


OFFLOAD_PARTS = ("params", "grads", "optimizer")


def _buffers(engine: MegatronEngine) -> list:
    return [b for m in engine.models for b in getattr(m, "buffers", []) + getattr(m, "expert_parallel_buffers", [])]


def offload_parts(engine: MegatronEngine) -> dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """The offloadable state by part, as (flat DDP buffers, tensors with storage of their own). params: DDP's flat
    parameter buffers, or the parameters themselves where DDP keeps none (no distributed optimizer); grads: the flat
    gradient buffers (fp32: grad_reduce_in_fp32); optimizer: float32 main weights (bf16 runs; fp32 shards are views
    of the buffers and skipped) and AdamW state. Read afresh on each call: AdamW creates its state at its first step."""
    flat_params, loose_params, grads = [], [], []
    for buffer in _buffers(engine):
        grads.append(buffer.grad_data)
        if buffer.param_data is not None:
            flat_params.append(buffer.param_data)
        else:
            loose_params.extend(buffer.params)
    optimizer, own = [], {id(t) for t in loose_params}
    for sub in engine._sub_optimizers():  # fp32 runs without a distributed optimizer step the model's own params
        optimizer.extend(
            p for g in sub.optimizer.param_groups for p in g["params"] if p._base is None and id(p) not in own
        )
        for state in sub.optimizer.state.values():
            optimizer.extend(v for k, v in state.items() if torch.is_tensor(v) and k != "step")
    return {"params": (flat_params, loose_params), "grads": (grads, []), "optimizer": ([], optimizer)}


def part_bytes(engine: MegatronEngine, resident=frozenset(OFFLOAD_PARTS)) -> dict[str, int]:
    """Bytes of each part on the device: a flat buffer's storage as it is (freed when offloaded), the other
    tensors when their part is ``resident`` (on a CPU host and device are one memory: bookkeeping tells them apart)."""

    def storage(tensors: list[torch.Tensor]) -> int:
        return sum(t.untyped_storage().nbytes() for t in tensors)

    return {
        part: storage(flat) + (storage(loose) if part in resident else 0)
        for part, (flat, loose) in offload_parts(engine).items()
    }


class Offload:
    """actor.offload: model weights, gradient buffers and optimizer state to host memory between calls, each part
    on its own (a weight export needs only the parameters).

    Megatron's DDP keeps parameters and gradients as views into flat buffers; freeing a buffer's storage
    (``resize_(0)``) and re-growing it later keeps every view valid, so only the flat buffers move. Parameters
    outside such buffers, float32 main weights and optimizer state move with ``.data``. Gradients are not copied
    back (every update starts by zeroing them).

    ``resident_bytes`` is measured where the CPU can show it (a flat buffer's storage is really freed) and is
    bookkeeping for tensors moved with ``.data`` (on a CPU host and device are one memory: only which parts were
    brought up tells them apart)."""

    def __init__(self, engine: MegatronEngine) -> None:
        self.engine = engine
        self.host: dict[int, torch.Tensor] = {}  # id(flat parameter buffer) -> its host copy while offloaded
        parts = offload_parts(engine)
        # storage bytes of every flat buffer, taken while all are resident (built on the device)
        self.sizes = {id(t): t.untyped_storage().nbytes() for flat, _ in parts.values() for t in flat}
        self.resident: set[str] = set(OFFLOAD_PARTS)

    def to_host(self, parts: tuple[str, ...]) -> None:
        host, going, split = torch.device("cpu"), set(parts) & self.resident, offload_parts(self.engine)
        if "params" in going:  # copied out before any storage is freed
            self.host = {id(t): t.detach().to(host, copy=True) for t in split["params"][0]}
        for part in [p for p in OFFLOAD_PARTS if p in going]:
            flat, loose = split[part]
            for tensor in flat:
                tensor.untyped_storage().resize_(0)
            for tensor in loose:
                tensor.data = tensor.data.to(host, copy=True)
        self.resident -= going

    def to_device(self, parts: tuple[str, ...]) -> tuple[str, ...]:
        """Bring up the ``parts`` not resident yet; returns them (for the caller to put back). Gradients before
        parameters: zeroing a re-grown gradient buffer must never overwrite restored parameters."""
        brought = tuple(p for p in ("grads", "params", "optimizer") if p in set(parts) - self.resident)
        split = offload_parts(self.engine) if brought else {}
        for part in brought:
            flat, loose = split[part]
            for tensor in flat:
                if tensor.untyped_storage().nbytes() != self.sizes[id(tensor)]:
                    tensor.untyped_storage().resize_(self.sizes[id(tensor)])
                if part == "params":
                    tensor.copy_(self.host.pop(id(tensor)))
                else:
                    tensor.zero_()
            for tensor in loose:
                tensor.data = tensor.data.to(self.engine.device)
            self.resident.add(part)
        return brought

    def resident_bytes(self) -> dict[str, int]:
        return part_bytes(self.engine, self.resident)
