"""What leaves and re-enters the ``megatron`` engine (:class:`MegatronCheckpointing`, mixed into
:class:`.megatron.MegatronEngine`): the weights as full Hugging Face tensors (``export_weights``, streamed to the
rollout engine, and ``save_hf``), and the per-rank checkpoint files (``megatron_rank{r}.pt``: model and optimizer
shards, warm-up position, RNG states) for a bitwise resume at the same parallel layout."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gspo_ascend.engines import megatron_bridge as mb
from gspo_ascend.engines.base import existing_rank_file
from gspo_ascend.engines.hf_export import write_hf_checkpoint
from gspo_ascend.engines.train_common import on_device
from gspo_ascend.errors import UserError

CHECKPOINT_FORMAT = 1


class MegatronCheckpointing:
    """Weight export and checkpoints, on the state :class:`.megatron.MegatronEngine` sets up."""

    # ------------------------------------------------------------------------------------------- weights

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor of the HF ``state_dict``, full (TP / EP shards gathered, PP stages broadcast), in the
        compute dtype, on this rank's device. Collective: every rank must iterate to the end."""
        with self._resident(("params",)):
            stream = self.bridge.export_weights([self._view(m) for m in self.models])
            for name, tensor in self.layout.convert(stream):
                yield name, tensor.detach().to(self.compute_dtype).contiguous()

    @on_device
    def save_hf(self, path: str, tokenizer: Any) -> None:
        """safetensors (sharded at 5 GiB) + config + generation config + tokenizer, written by rank 0."""
        generation_config = None
        with contextlib.suppress(OSError):  # a checkpoint without generation_config.json
            from transformers import GenerationConfig

            generation_config = GenerationConfig.from_pretrained(self.model_path)
        write_hf_checkpoint(
            path,
            self.export_weights(),
            rank=self.rank,
            shapes=self.layout.meta_state,
            names=[n for n in self.layout.shapes if n not in self.layout.tied],
            dtype=self.compute_dtype,
            hf_config=self.hf_config,
            generation_config=generation_config,
            tokenizer=tokenizer,
        )
        dist.barrier()

    # ------------------------------------------------------------------------------------------- checkpoints

    def _rank_file(self, path: str) -> Path:
        return Path(path) / f"megatron_rank{self.rank}.pt"

    def _layout_tag(self) -> dict[str, int]:
        a = self.cfg.actor
        return {
            "world": self.world_size,
            "tp": a.tensor_parallel_size,
            "pp": a.pipeline_parallel_size,
            "ep": a.expert_parallel_size,
            "etp": a.expert_tensor_parallel_size,
            "distributed_optimizer": int(a.use_distributed_optimizer),
            # only when > 1, so checkpoints written before CP existed keep their tag
            **({"cp": a.context_parallel_size} if a.context_parallel_size > 1 else {}),
        }

    @on_device
    def save_checkpoint(self, path: str) -> None:
        """This rank's model shard, optimizer shard (inner AdamW state + float32 main weights), warm-up position and
        RNG states (CPU, device, megatron's TP RNG tracker) into ``megatron_rank{r}.pt``: bitwise resume at the
        same parallel layout."""
        from megatron.core import tensor_parallel

        state = {
            "format": CHECKPOINT_FORMAT,
            "layout": self._layout_tag(),
            "models": [mb.unwrap(m).state_dict() for m in self.models],
            "optimizers": [
                {
                    "inner": sub.optimizer.state_dict(),
                    "main": [p.detach().clone() for g in sub.optimizer.param_groups for p in g["params"]],
                }
                for sub in self._sub_optimizers()
            ],
            "optimizer_steps": self.optimizer_steps,
            "nan_steps_total": self.nan_steps_total,
            "cpu_rng": torch.get_rng_state(),
            "device_rng": None if self.backend.torch_device_type == "cpu" else self.backend.module().get_rng_state(),
            "tracker_rng": tensor_parallel.get_cuda_rng_tracker().get_states(),
        }
        Path(path).mkdir(parents=True, exist_ok=True)  # like torch.distributed.checkpoint (what fsdp uses) does
        torch.save(state, self._rank_file(path))
        dist.barrier()

    @on_device
    def load_checkpoint(self, path: str) -> None:
        from megatron.core import tensor_parallel

        rank_file = existing_rank_file(path, self._rank_file(path).name)
        state = torch.load(rank_file, weights_only=False)  # our own file: RNG tracker states are plain objects
        if state.get("layout") != self._layout_tag():
            raise UserError(
                f"checkpoint '{path}' was written with parallel layout {state.get('layout')}, this run is "
                f"{self._layout_tag()}; resume with the same actor.*_parallel_size and world size"
            )
        for model, model_state in zip(self.models, state["models"], strict=True):
            mb.unwrap(model).load_state_dict(model_state, strict=True)
        for sub, saved in zip(self._sub_optimizers(), state["optimizers"], strict=True):
            params = [p for g in sub.optimizer.param_groups for p in g["params"]]
            with torch.no_grad():
                for param, value in zip(params, saved["main"], strict=True):
                    param.copy_(value)
            sub.optimizer.load_state_dict(saved["inner"])
        self.optimizer_steps = state["optimizer_steps"]
        self.nan_steps_total = state["nan_steps_total"]
        torch.set_rng_state(state["cpu_rng"])
        if state["device_rng"] is not None:
            self.backend.module().set_rng_state(state["device_rng"])
        tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker_rng"])
