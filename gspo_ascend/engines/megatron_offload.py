"""actor.offload for the megatron engine: parameters, gradient buffers and optimizer state to host memory between
calls, each part on its own, so that a weight export brings up only the parameters (the sync runs beside the
rollout engine's weights; with the gradients and optimizer state as well, the 30B layout's sync would need
64.6 GiB of a 64 GiB 910B: issue #25). verl moves the same parts with separate functions (verl/utils/
megatron_utils.py: offload_megatron_model_to_cpu, offload_megatron_grad_to_cpu, offload_megatron_optimizer).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .megatron import MegatronEngine

OFFLOAD_PARTS = ("params", "grads", "optimizer")


def _buffers(engine: MegatronEngine) -> list:
    return [b for m in engine.models for b in getattr(m, "buffers", []) + getattr(m, "expert_parallel_buffers", [])]


def offload_parts(engine: MegatronEngine) -> dict[str, list[torch.Tensor]]:
    """The offloadable state by part. params: DDP's flat parameter buffers, or the parameters themselves where
    DDP keeps none (no distributed optimizer); grads: the flat gradient buffers (fp32: grad_reduce_in_fp32);
    optimizer: float32 main weights (bf16 runs; fp32 shards are views of the buffers and skipped) and AdamW state."""
    params, grads = [], []
    for buffer in _buffers(engine):
        grads.append(buffer.grad_data)
        params.extend([buffer.param_data] if buffer.param_data is not None else buffer.params)
    optimizer, own = [], {id(t) for t in params}
    for sub in engine._sub_optimizers():  # fp32 runs without a distributed optimizer step the model's own params
        optimizer.extend(
            p for g in sub.optimizer.param_groups for p in g["params"] if p._base is None and id(p) not in own
        )
        for state in sub.optimizer.state.values():
            optimizer.extend(v for k, v in state.items() if torch.is_tensor(v) and k != "step")
    return {"params": params, "grads": grads, "optimizer": optimizer}


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
        # storage bytes of every flat buffer, taken while all are resident (built on the device)
        self.sizes = {id(t): t.untyped_storage().nbytes() for part in ("grads", "params") for t in self._flat(part)}
        self.resident: set[str] = set(OFFLOAD_PARTS)
        # megatron-core shares one storage between a bucket's parameters and gradients for MXFP8 parameters
        # (param_and_grad_buffer.py, shared_buffer): there the two parts can only move together
        self.linked = any(
            b.param_data is not None
            and b.param_data.untyped_storage().data_ptr() == b.grad_data.untyped_storage().data_ptr()
            for b in _buffers(engine)
        )

    def _flat(self, part: str) -> list[torch.Tensor]:
        """The flat DDP buffers of a part: their storage is freed and re-grown, every view stays valid."""
        if part == "grads":
            return [b.grad_data for b in _buffers(self.engine)]
        if part == "params":
            return [b.param_data for b in _buffers(self.engine) if b.param_data is not None]
        return []

    def _loose(self, part: str) -> list[torch.Tensor]:
        """Tensors of a part with storage of their own (moved with ``.data``)."""
        flat = {id(t) for t in self._flat(part)}
        return [t for t in offload_parts(self.engine)[part] if id(t) not in flat]

    def _expand(self, parts: tuple[str, ...]) -> set[str]:
        return set(parts) | ({"params", "grads"} if self.linked and {"params", "grads"} & set(parts) else set())

    def to_host(self, parts: tuple[str, ...]) -> None:
        host, going = torch.device("cpu"), self._expand(parts) & self.resident
        if "params" in going:  # copied out before any storage is freed
            self.host = {id(t): t.detach().to(host, copy=True) for t in self._flat("params")}
        for part in [p for p in OFFLOAD_PARTS if p in going]:
            for tensor in self._flat(part):
                tensor.untyped_storage().resize_(0)
            for tensor in self._loose(part):
                tensor.data = tensor.data.to(host, copy=True)
        self.resident -= going

    def to_device(self, parts: tuple[str, ...]) -> tuple[str, ...]:
        """Bring up the ``parts`` not resident yet; returns them (for the caller to put back). Gradients before
        parameters: zeroing a re-grown gradient buffer must never overwrite restored parameters."""
        brought = tuple(p for p in ("grads", "params", "optimizer") if p in self._expand(parts) - self.resident)
        for part in brought:
            for tensor in self._flat(part):
                if tensor.untyped_storage().nbytes() != self.sizes[id(tensor)]:
                    tensor.untyped_storage().resize_(self.sizes[id(tensor)])
                if part == "params":
                    tensor.copy_(self.host.pop(id(tensor)))
                else:
                    tensor.zero_()
            for tensor in self._loose(part):
                tensor.data = tensor.data.to(self.engine.device)
            self.resident.add(part)
        return brought

    def resident_bytes(self) -> dict[str, int]:
        out = {}
        for part in OFFLOAD_PARTS:
            flat = sum(t.untyped_storage().nbytes() for t in self._flat(part))
            loose = sum(t.untyped_storage().nbytes() for t in self._loose(part)) if part in self.resident else 0
            out[part] = flat + loose
        return out
