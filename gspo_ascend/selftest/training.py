"""Layer 4: the train engines on two devices (one with ``--devices 1``): Megatron at TP=2 (TP=1) against HF, one
GSPO step fsdp vs megatron, and a checkpoint save / load round trip.

The selftest process prepares the inputs (the tiny Qwen3 with two KV heads, which TP=2 needs; rollout-like batches
sampled from it) and the reference log-probs (plain transformers, fp32, on the CPU: the reference CI trusts); two
ranks (:mod:`.launch`, one per device; one rank with one device) then run, in one process group:

1. the fsdp engine (DP=2, or DP=1): one GSPO update of the batch (two minibatches);
2. the megatron engine (TP=2, or TP=1; under MindSpeed on an NPU where it is installed): log-probs of the batch,
   then the same update;
3. a checkpoint round trip on the megatron engine (the fsdp engine where megatron cannot run): save, update on a
   second batch (A); a fresh engine loads the checkpoint and makes the same update (B).

The tiny Qwen3-MoE (4 experts, top-2) runs the first two checks again as ``training/moe_megatron_tp1`` and
``training/moe_fsdp_vs_megatron``, always at TP=1 on one rank (MoE with TP > 1 needs sequence parallelism, which
megatron's local spec cannot run on a host; one rank is enough for what it is there for): under MindSpeed its experts
are ``MindSpeedGmmExperts``, so the log-probs run ``npu_gmm`` forward and the update its backward (dx and dw), on the
device, against HF and the fsdp engine; the check fails if MindSpeed is on and the experts are anything else. Off
MindSpeed the experts are megatron's ``SequentialMLP``, and the check still covers routing and the experts' weights
(loaded, updated and exported under HF's names, compared with fsdp's). No checkpoint round trip (the dense one
covers the engine's checkpoint code).

Judged here, with bounds (fp32 model):

* megatron log-probs vs HF: 1e-5 on a host (both sides are fp32 CPU kernels; tests/integration measures ~1e-6),
  1e-3 on a device (fused kernels, TF32 / HF32 matmuls; a wrong TP shard or mask errs by > 1e-1).
* fsdp vs megatron update: every loss metric within 1e-5 (host) / 1e-3 (device), relative above 1; the weights'
  difference within 1/10 of the update itself (max |w_fsdp - w_megatron| <= 0.1 max |w_fsdp - w_0|): Adam moves
  each weight by about lr, so a missing, doubled or sign-flipped update errs by the update's size, while two
  correct implementations differ by rounding.
* checkpoint: A == B bitwise on a host (same kernels, same inputs); on a device, within the update bounds above
  (GPU / NPU reductions need not be deterministic).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .fixtures import MINIBATCHES, UPDATE_OVERRIDES
from .launch import launch_on
from .report import CheckFailed, CheckSkipped, Result, run_check

FIX = "docs/troubleshooting.md#selftest-training: `gspo-ascend doctor` (MindSpeed / megatron pins); actor.engine=fsdp"
TEMPERATURE = 0.7
TIMEOUT_S = 900
BATCH = 8  # samples per batch: 2 minibatches x 2 ranks x 2 (one rank: 2 minibatches x 4)
BASE = [f"data.train_batch_size={BATCH // 4}", *UPDATE_OVERRIDES]
STAGES = ("fsdp", "megatron", "checkpoint")


@dataclass(frozen=True)
class Model:
    """One model the training checks run, each in its own directory and rank launch."""

    moe: bool
    prefix: str  # of the check names: training/<prefix>megatron_tp<world>, training/<prefix>fsdp_vs_megatron
    checkpoint: bool  # the checkpoint round trip too
    one_rank: bool  # TP=1 on one rank whatever the device count (MoE: see the module docstring)


DENSE = Model(moe=False, prefix="", checkpoint=True, one_rank=False)
MOE = Model(moe=True, prefix="moe_", checkpoint=False, one_rank=True)


def world_size(devices: int) -> int:
    """Ranks of the training checks: 2 (TP=2, fsdp DP=2) when the node gives two devices or more, else 1 (TP=1, DP=1),
    so a one-GPU machine still checks both engines and the checkpoint round trip."""
    return 1 if devices < 2 else 2


def _bounds(backend) -> tuple[float, float]:
    """(log-prob bound, metric bound): see the module docstring."""
    return (1e-5, 1e-5) if backend.torch_device_type == "cpu" else (1e-3, 1e-3)


def megatron_blocker(backend) -> str | None:
    """Why the megatron engine cannot run here, or None."""
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("mbridge") is None:
        return "megatron-core / mbridge are not installed (actor.engine=megatron needs them)"
    from ..engines import mindspeed_setup

    if backend.name == "npu" and not backend.emulated and not mindspeed_setup.installed():
        return "MindSpeed is not installed: the megatron engine cannot run on this NPU (docs/install-npu.md)"
    return None


def _mindspeed_note(backend) -> str:
    from ..engines import mindspeed_setup

    if mindspeed_setup.enabled(backend):
        return "under MindSpeed (fused attention, RMSNorm, RoPE, SwiGLU)"
    if backend.name == "npu":
        return "without MindSpeed (not installed: megatron's local layer spec, no fused kernels)"
    return "with megatron-core's layer spec"


# ----------------------------------------------------------------------------------------------- the parent side


def _prepare(out: Path, model_spec: Model) -> tuple[str, dict[str, Any], torch.Tensor]:
    """(model dir, batches, HF reference log-probs of the main batch), written under ``out``: the dense model with
    two KV heads (TP=2 needs them), the MoE model as built (TP=1)."""
    from transformers import AutoModelForCausalLM

    from ..tiny import ensure_tiny_model
    from .fixtures import hf_log_probs, make_kv2_model, sample_batch

    path = ensure_tiny_model(moe=True) if model_spec.moe else make_kv2_model(ensure_tiny_model(), out)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    batches = {name: sample_batch(model, seed, TEMPERATURE, size=BATCH) for seed, name in enumerate(("main", "next"))}
    torch.save(batches, out / "training_batches.pt")
    initial = {n: t.detach().clone() for n, t in model.state_dict().items()}
    return str(path), {"batches": batches, "initial": initial}, hf_log_probs(model, batches["main"], TEMPERATURE)


def _launch(backend, out: Path, path: str, megatron: bool, world: int, checkpoint: bool) -> str | None:
    """Run the ``world`` ranks; None when they succeeded, else the one-line failure."""
    args = ["--model", path] + (["--megatron"] if megatron else []) + ([] if checkpoint else ["--no-checkpoint"])
    run = launch_on(backend, world, "training", args, out, TIMEOUT_S)
    return None if run.ok else run.failure()


def check_training(backend, devices: int, out: Path, quick: bool, log: Path | None = None) -> list[Result]:
    """The dense model's three checks, then the MoE model's two (each model in its own rank launch)."""
    results = []
    for spec, where in ((DENSE, out), (MOE, out / "moe")):
        world = 1 if spec.one_rank else world_size(devices)
        results += check_model(spec, backend, world, where, quick, log)
    return results


def check_model(spec: Model, backend, world: int, out: Path, quick: bool, log: Path | None = None) -> list[Result]:
    names = [f"training/{spec.prefix}megatron_tp{world}", f"training/{spec.prefix}fsdp_vs_megatron"]
    names += ["training/checkpoint"] if spec.checkpoint else []
    if quick:
        return [run_check(name, lambda: _skip("--quick"), FIX) for name in names]
    blocker = megatron_blocker(backend)
    state: dict[str, Any] = {"world": world, "spec": spec}

    def setup() -> dict[str, Any]:
        if "ranks" not in state:
            out.mkdir(parents=True, exist_ok=True)
            path, state["inputs"], state["reference"] = _prepare(out, spec)
            state["failure"] = _launch(backend, out, path, blocker is None, world, spec.checkpoint)
            state["ranks"] = _results(out, world)
        return state

    bodies = [
        lambda: _judge_logprobs(setup(), backend) if blocker is None else _skip(blocker),
        lambda: _judge_update(setup(), backend) if blocker is None else _skip(blocker),
        lambda: _judge_checkpoint(setup(), backend, "megatron" if blocker is None else "fsdp"),
    ]
    return [run_check(name, body, FIX, log) for name, body in zip(names, bodies[: len(names)], strict=True)]


def _skip(why: str) -> str:
    raise CheckSkipped(why)


def _results(out: Path, world: int) -> dict[str, dict[int, dict]]:
    found: dict[str, dict[int, dict]] = {}
    for stage in STAGES:
        for rank in range(world):
            path = out / f"training.{stage}.rank{rank}.pt"
            if path.is_file():
                found.setdefault(stage, {})[rank] = torch.load(path, weights_only=False)
    return found


def _stage(state: dict[str, Any], stage: str) -> dict[int, dict]:
    ranks = state["ranks"].get(stage, {})
    if len(ranks) < state["world"]:
        raise CheckFailed(state["failure"] or f"the ranks wrote no {stage} results")
    return ranks


def _judge_logprobs(state: dict[str, Any], backend) -> str:
    ranks, reference = _stage(state, "megatron"), state["reference"]
    mask = state["inputs"]["batches"]["main"].response_mask
    limit, worst, tp = _bounds(backend)[0], 0.0, state["world"]
    for result in ranks.values():
        start, stop = result["rows"]
        ours = result["log_probs"]
        diff = float(((ours - reference[start:stop]).abs() * mask[start:stop]).max())
        if bool((ours[mask[start:stop] == 0] != 0).any()):
            raise CheckFailed(f"megatron TP={tp} log-probs of rows {start}-{stop} are not 0 at padding")
        worst = max(worst, diff)
    experts = _experts_note(state, backend)
    if worst > limit:
        raise CheckFailed(
            f"megatron TP={tp}{experts} log-probs differ from HF's (fp32, CPU) by {worst:.2e} (bound {limit:g})"
        )
    return f"megatron TP={tp} {_mindspeed_note(backend)}{experts}: max |megatron - HF| = {worst:.1e} (bound {limit:g})"


def _experts_note(state: dict[str, Any], backend) -> str:
    """For the MoE model: which experts class ran (", experts: X"); CheckFailed when MindSpeed is on and they are
    not its grouped-GEMM experts, i.e. npu_gmm was not what this check ran. "" for the dense model."""
    from ..engines import mindspeed_setup

    if not state["spec"].moe:
        return ""
    kinds = sorted({kind for result in state["ranks"]["megatron"].values() for kind in result.get("experts", [])})
    if not kinds:
        raise CheckFailed("the MoE model's megatron engine has no expert modules (mlp.experts)")
    if mindspeed_setup.enabled(backend) and kinds != ["MindSpeedGmmExperts"]:
        raise CheckFailed(f"MindSpeed is on but the experts ran as {', '.join(kinds)}, not MindSpeedGmmExperts")
    gmm = " (npu_gmm)" if kinds == ["MindSpeedGmmExperts"] else ""
    return f", experts: {', '.join(kinds)}{gmm}"


def _metric_problems(ours: dict, theirs: dict, tol: float) -> dict:
    keys = [k for k in theirs if k != "actor/micro_batches"]  # fsdp counts per rank, megatron counts passes
    return {k: (ours[k], theirs[k]) for k in keys if not abs(ours[k] - theirs[k]) <= tol * max(1.0, abs(theirs[k]))}


def _weights_gap(a: dict, b: dict, initial: dict) -> tuple[float, float]:
    """(max |a - b|, max |a - initial|) over every tensor."""
    gap = max(float((a[n] - b[n]).abs().max()) for n in initial)
    moved = max(float((a[n] - initial[n]).abs().max()) for n in initial)
    return gap, moved


def _compare_updates(what: str, ours: tuple[dict, dict], theirs: tuple[dict, dict], before: dict, tol: float) -> str:
    """One update against another: metrics (``tol``), weights (1/10 of the update); the detail, or CheckFailed."""
    if set(ours[1]) != set(theirs[1]):
        raise CheckFailed(f"{what}: the engines export different tensor names")
    if problems := _metric_problems(ours[0], theirs[0], tol):
        name, (a, b) = next(iter(problems.items()))
        raise CheckFailed(f"{what}: {len(problems)} metric(s) differ beyond {tol:g}, first {name}: {a:.6g} vs {b:.6g}")
    gap, moved = _weights_gap(theirs[1], ours[1], before)
    if moved == 0 or gap > 0.1 * moved:
        raise CheckFailed(f"{what}: weights differ by {gap:.2e} after an update of {moved:.2e} (bound 1/10 of it)")
    return f"loss {ours[0]['actor/pg_loss']:.4g}, weights within {gap:.1e} after an update of {moved:.1e}"


def _judge_update(state: dict[str, Any], backend) -> str:
    fsdp, megatron = _stage(state, "fsdp")[0], _stage(state, "megatron")[0]
    tol = _bounds(backend)[1]
    theirs = (fsdp["metrics"], fsdp["weights"])
    ours, initial = (megatron["metrics"], megatron["weights"]), state["inputs"]["initial"]
    detail = _compare_updates("fsdp vs megatron", ours, theirs, initial, tol)
    world = state["world"]
    experts = _experts_note(state, backend)
    return f"one GSPO step, fsdp DP={world} == megatron TP={world}{experts}: {detail}"


def _judge_checkpoint(state: dict[str, Any], backend, engine: str) -> str:
    result = _stage(state, "checkpoint")[0]
    (metrics_a, weights_a), (metrics_b, weights_b) = result["continued"], result["resumed"]
    if backend.torch_device_type == "cpu":
        same = weights_a.keys() == weights_b.keys() and all(torch.equal(weights_a[n], weights_b[n]) for n in weights_a)
        if metrics_a != metrics_b or not same:
            raise CheckFailed(f"{engine} save -> load -> update is not bitwise equal to the uninterrupted update")
        return f"{engine}: save -> fresh engine -> load -> update bitwise equal to the uninterrupted update"
    detail = _compare_updates(f"{engine} resumed vs continued", (metrics_b, weights_b), (metrics_a, weights_a),
                              result["saved"], _bounds(backend)[1])  # fmt: skip
    return f"{engine}: save -> fresh engine -> load -> update == the uninterrupted update ({detail})"


# ----------------------------------------------------------------------------------------------- one rank


def _build(engine: str, backend, model: str, tp: int):
    from ..config import load_config

    if engine == "fsdp":
        from ..engines.fsdp import FSDPEngine

        return FSDPEngine(load_config(None, [*BASE, "actor.engine=fsdp"]), backend, model)
    from ..engines.megatron import MegatronEngine

    cfg = load_config(None, [*BASE, "actor.engine=megatron", f"actor.tensor_parallel_size={tp}"])
    return MegatronEngine(cfg, backend, model)


def _exported(engine) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().cpu().clone() for name, tensor in engine.export_weights()}


def _save(out: Path, stage: str, rank: int, result: dict) -> None:
    torch.save(result, out / f"training.{stage}.rank{rank}.pt")


def _round_trip(engine, name: str, backend, model: str, out: Path, shard) -> dict:
    """save -> update(shard) = continued; fresh engine -> load -> update(shard) = resumed. Closes ``engine``."""
    import torch.distributed as dist

    path = out / f"training.{name}.ckpt"
    if dist.get_rank() == 0:
        path.mkdir(exist_ok=True)
    dist.barrier()
    engine.save_checkpoint(str(path))
    saved = _exported(engine)
    continued = (engine.update(shard, TEMPERATURE), _exported(engine))
    engine.close()
    fresh = _build(name, backend, model, dist.get_world_size())
    fresh.load_checkpoint(str(path))
    resumed = (fresh.update(shard, TEMPERATURE), _exported(fresh))
    fresh.close()
    return {"saved": saved, "continued": continued, "resumed": resumed}


def rank_main(backend, out: Path, argv: list[str]) -> None:
    """fsdp first: the megatron engine installs the shim's CUDA redirection on a host, which fsdp must not see.
    Megatron runs at TP = the world size (2, or 1 on one device)."""
    import torch.distributed as dist

    from ..engines.microbatch import dp_shard

    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--megatron", action="store_true")
    parser.add_argument("--no-checkpoint", action="store_true")
    args = parser.parse_args(argv)
    rank, world = dist.get_rank(), dist.get_world_size()
    if backend.torch_device_type == "cpu" and "OMP_NUM_THREADS" in os.environ:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    batches = torch.load(out / "training_batches.pt", weights_only=False)
    update_shard = dp_shard(batches["main"], rank, world, MINIBATCHES)
    next_shard = dp_shard(batches["next"], rank, world, MINIBATCHES)
    fsdp = _build("fsdp", backend, args.model, world)
    metrics = fsdp.update(update_shard, TEMPERATURE)
    _save(out, "fsdp", rank, {"metrics": metrics, "weights": _exported(fsdp)})
    if not args.megatron:
        if not args.no_checkpoint:
            _save(out, "checkpoint", rank, _round_trip(fsdp, "fsdp", backend, args.model, out, next_shard))
        return
    fsdp.close()
    megatron = _build("megatron", backend, args.model, world)  # TP = the world, so DP = 1
    mine = dp_shard(batches["main"], rank, world, 1)
    result = {
        "rows": [rank * len(mine), (rank + 1) * len(mine)],
        "log_probs": megatron.compute_log_probs(mine, TEMPERATURE),
        "experts": sorted({type(m).__name__ for n, m in megatron.models[0].named_modules() if n.endswith(".experts")}),
    }
    result["metrics"] = megatron.update(update_shard, TEMPERATURE)
    result["weights"] = _exported(megatron)
    _save(out, "megatron", rank, result)
    if args.no_checkpoint:
        megatron.close()
    else:
        _save(out, "checkpoint", rank, _round_trip(megatron, "megatron", backend, args.model, out, next_shard))
