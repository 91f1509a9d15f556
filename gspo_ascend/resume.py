"""Resuming with a changed config: what may change mid-run, decided before anything in the run directory is written.

Every checkpoint's ``trainer_state.json`` records the config it was saved with and the shape of the model
(:func:`state_record`). On resume, :func:`check_resume` (called by ``runtime.prepare`` before ``config.json`` is
rewritten) compares the new config with it key by key:

- a key of :data:`APPLIED` takes effect from the next step; the changes are listed in one line. They change the
  optimizer's step size (``actor.lr`` and its warm-up, ``actor.grad_clip``), where the run ends, how often it saves,
  logs and validates, or only memory and speed (micro-batch sizes, offload, recompute, scoring workers);
- ``trainer.resume`` and ``trainer.output_dir`` are not compared: they say where a run lives, not what it is;
- any other changed key is refused in one line naming the keys with their old and new values: batch sizes,
  the algorithm, sampling, data, the parallel layout and the seed are what the checkpoint's optimizer, sampler
  and RNG states mean something for;
- ``model.path`` may change (a model moved to local disk) when the model has the same shape (its config.json's
  architecture keys): the weights come from the checkpoint. Another model is refused in one line;
- ``trainer.total_steps`` below the checkpoint's step is refused; equal to it means the run is complete.

A key the checkpoint does not record (added to the schema later) is compared with its default. A checkpoint
saved before configs were recorded is resumed without comparison, which is said in one line.

How we differ from verl: verl compares nothing on resume; it takes the step from its tracker file and runs with
whatever config it is given.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from .config import Config, to_dict
from .errors import UserError

# key -> what it changes; the docs (docs/operations.md) list the same groups
APPLIED: dict[str, str] = {
    "actor.lr": "optimizer step size",
    "actor.warmup_steps": "optimizer step size",
    "actor.grad_clip": "optimizer step size",
    "trainer.total_steps": "where the run ends",
    "trainer.save_freq": "checkpoint cadence",
    "trainer.keep_last": "checkpoint cadence",
    "trainer.loggers": "logging",
    "trainer.project_name": "logging",
    "trainer.experiment_name": "logging",
    "trainer.test_freq": "validation",
    "trainer.val_before_train": "validation",
    "data.val_files": "validation",
    "actor.micro_batch_size": "memory / speed",
    "actor.max_tokens_per_micro_batch": "memory / speed",
    "actor.offload": "memory / speed",
    "actor.recompute": "memory / speed",
    "model.gradient_checkpointing": "memory / speed",
    "rollout.gpu_memory_utilization": "memory / speed",
    "rollout.max_num_batched_tokens": "memory / speed",
    "reward.num_workers": "memory / speed",
    "reward.timeout_s": "scoring limits",
    "reward.max_failure_rate": "scoring limits",
}
APPLIED_PREFIXES = ("validation.",)  # how validation samples and reports: never seen by training
NOT_COMPARED = ("trainer.resume", "trainer.output_dir")
# config.json keys that fix the shape of the weights (names, dtypes and versions may differ between copies)
ARCHITECTURE_KEYS = (
    "model_type",
    "architectures",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "tie_word_embeddings",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
)


def applied(key: str) -> bool:
    return key in APPLIED or key.startswith(APPLIED_PREFIXES)


def architecture(model_path: str) -> dict[str, Any] | None:
    """The shape-deciding keys of the model's config.json (None when it cannot be read)."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return {key: config[key] for key in ARCHITECTURE_KEYS if key in config}


def state_record(cfg: Config, model_path: str) -> dict[str, Any]:
    """What a checkpoint's trainer_state.json records for the next resume's comparison."""
    return {"config": to_dict(cfg), "model": {"path": model_path, "architecture": architecture(model_path)}}


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out |= _flatten(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def _show(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def changed_keys(saved: dict, cfg: Config) -> list[tuple[str, Any, Any]]:
    """(key, saved value, new value) for every compared key that differs, sorted by key."""
    old, new, default = _flatten(saved), _flatten(to_dict(cfg)), _flatten(to_dict(Config()))
    out = []
    for key in sorted(new):
        before = old.get(key, default.get(key))
        if key not in NOT_COMPARED and before != new[key]:
            out.append((key, before, new[key]))
    return out


def check_resume(cfg: Config, checkpoint: Path | None, model_path: str) -> int:
    """The step the run continues after (0 for a fresh run); refuses, in one line, what cannot change mid-run."""
    from .checkpoint import load_trainer_state

    if checkpoint is None:
        return 0
    state = load_trainer_state(checkpoint)
    step, total = int(state["step"]), cfg.trainer.total_steps
    if total < step:
        raise UserError(
            f"config key 'trainer.total_steps' ({total}) is below the step of the checkpoint this run resumes from "
            f"({checkpoint}, step {step}); raise trainer.total_steps to continue that run, or start a new one "
            "(trainer.resume=never, or another trainer.output_dir)"
        )
    if not isinstance(state.get("config"), dict):
        print(
            f"note: {checkpoint} records no config (saved by an older version); the config is not compared",
            file=sys.stderr,
        )
        return step
    changes = changed_keys(state["config"], cfg)
    model_change = next((c for c in changes if c[0] == "model.path"), None)
    if model_change is not None:
        _check_model(checkpoint, state.get("model") or {}, model_change, model_path)
        changes.remove(model_change)
    refused = [c for c in changes if not applied(c[0])]
    if refused:
        listed = ", ".join(f"{key} ({_show(a)} -> {_show(b)})" for key, a, b in refused)
        raise UserError(
            f"cannot resume from {checkpoint}: config keys changed since it was saved that cannot change mid-run: "
            f"{listed}; set them back, or start a new run (trainer.resume=never, or another trainer.output_dir). "
            "What may change on resume: docs/operations.md"
        )
    if changes:
        listed = ", ".join(f"{key} ({_show(a)} -> {_show(b)})" for key, a, b in changes)
        print(f"resume: config changed since {checkpoint.name}, applied from step {step + 1}: {listed}", flush=True)
    return step


def _check_model(checkpoint: Path, saved_model: dict, change: tuple[str, Any, Any], model_path: str) -> None:
    saved, now = saved_model.get("architecture"), architecture(model_path)
    _, old_path, new_path = change
    if saved is not None and saved == now:
        print(
            f"note: model.path changed ({_show(old_path)} -> {_show(new_path)}) but the model has the same shape; "
            f"the weights come from {checkpoint.name}",
            file=sys.stderr,
        )
        return
    if saved is not None and now is not None:
        differs = ", ".join(
            f"{k} {_show(saved.get(k))} -> {_show(now.get(k))}" for k in ARCHITECTURE_KEYS if saved.get(k) != now.get(k)
        )
    else:
        differs = "the checkpoint records no model shape" if saved is None else "its config.json cannot be read"
    raise UserError(
        f"cannot resume from {checkpoint}: config key 'model.path' names another model ({_show(old_path)} -> "
        f"{_show(new_path)}: {differs}); resume with the model the checkpoint was trained from, or start a new "
        "run (trainer.resume=never, or another trainer.output_dir)"
    )


def load_failure(checkpoint: Path, exc: BaseException) -> UserError:
    """One line for an engine that could not load ``checkpoint`` (its files verified, so the bytes are as saved:
    written by another version or layout, or a checkpoint from before checksums); names the previous one."""
    from .checkpoint import CHECKPOINT_DIR, list_checkpoints

    cause = getattr(exc, "cause", None) or exc  # a worker's exception arrives wrapped by Ray
    if isinstance(cause, UserError):  # the engine's own one-line refusal (another parallel layout), a lost worker
        return cause
    lines = str(cause).strip().splitlines()
    first = lines[0][:200] if lines else ""
    earlier = []
    if checkpoint.parent.name == CHECKPOINT_DIR:
        earlier = [p for _, p in list_checkpoints(checkpoint.parent.parent) if p.name < checkpoint.name]
    hint = f"trainer.resume={earlier[-1]}" if earlier else "trainer.resume=never or another trainer.output_dir"
    return UserError(
        f"cannot load checkpoint {checkpoint} into the train engine ({type(cause).__name__}: {first}); resume from "
        f"another checkpoint or start a new run: {hint}"
    )
