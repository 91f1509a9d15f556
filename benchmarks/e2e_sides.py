"""The sides of benchmarks/e2e_vs_trl.py: each one a trainer in its own process, driven one rollout batch per turn.

A side process (``e2e_vs_trl.py --side-worker NAME ...``) sets its trainer up, says ``ready``, then runs one rollout
batch each time the orchestrator writes ``go`` on its stdin and answers with that batch's numbers, one JSON line on
its original stdout (everything the trainers print goes to stderr, a log file). ``stop`` ends it with a ``done``
line (peak RSS, TRL's logs). A failure is an ``error`` line with the reason, so the other sides go on.

Why processes: two of our trainers each start Ray with all the machine's CPUs as one bundle, TRL's colocated vLLM
initialises torch.distributed and vLLM in its own process, and accelerate keeps process-wide state; one process per
side keeps them apart, and while one side runs the others wait on a pipe (no CPU).

What each side measures itself:
- ours: the trainer's own stage timers (``time/*_s``); the batch the stages saw, captured at the old-log-prob
  stage, gives the padded-token share of the update's passes (the engine's own micro-batch plan and layout rule:
  a packed row has no padding, a padded pass is samples x its longest sample) and, with ``old_logprobs=engine``, a
  recompute of the old log-probs on that same batch, timed and then taken out of the step's time (``probe``): what
  the skipped stage would have cost, and how far the engine's log-probs are from the trainer's;
- TRL: wall time between rollout-batch boundaries (a TrainerCallback), stage times from TRL's own profiling
  contexts (generation, reward, the old log-prob forward inside ``_prepare_inputs``, weight sync), the padded-token
  share of the loss passes from the masks ``compute_loss`` receives.
Peak RSS: the high-water mark (``VmHWM``) of the processes that hold the model: TRL's own process (its vLLM runs
in-process); our Ray worker plus its children (the vLLM engine core). Neither side counts its reward workers; ours
does not count the driver (prompts, tokenizer, Ray's own daemons).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any

MINIBATCHES = 4  # the GSPO paper's optimizer steps per rollout batch


@dataclass(frozen=True)
class Side:
    name: str
    trainer: str  # "ours" | "trl" | "verl"
    rollout: str  # "hf" | "vllm"
    old_logprobs: str = "recompute"  # ours only: algorithm.old_logprobs
    note: str = ""
    patched: bool = False  # TRL with a change of ours: reported, never the headline comparison
    partial: bool = False  # ours only: partial rollout, rounds of half the response length (partial_rollout.py)
    onednn: bool = True  # vLLM's oneDNN linears; off = verl's shim P4 on our side too (verl_side/onednn_off)


SIDES = {
    s.name: s
    for s in (
        Side("ours-vllm", "ours", "vllm", "engine", "vLLM rollout, packed fsdp, old log-probs from vLLM"),
        Side("ours-vllm-recompute", "ours", "vllm", "recompute", "vLLM rollout, packed fsdp, old log-probs recomputed"),
        Side(
            "ours-vllm-partial",
            "ours",
            "vllm",
            "engine",
            "ours-vllm with partial rollout: rounds of max_new_tokens / 2, 2 rounds, one batch of extra groups",
            partial=True,
        ),
        Side(
            "ours-vllm-noonednn",
            "ours",
            "vllm",
            "engine",
            "ours-vllm with vLLM's oneDNN linears off, the handicap verl's side carries (verl_side/README.md, P4)",
            onednn=False,
        ),
        Side("ours-hf", "ours", "hf", "recompute", "HF generate rollout, packed fsdp, old log-probs recomputed"),
        Side("trl-hf", "trl", "hf", note="TRL GRPOTrainer, HF generate"),
        Side("trl-vllm", "trl", "vllm", note="TRL GRPOTrainer, vLLM colocate"),
        Side("trl-vllm-reload", "trl", "vllm", note="trl-vllm, weight sync by vLLM's layerwise reload", patched=True),
        Side("verl", "verl", "vllm", "recompute", "verl 0.9.1 GSPO, its default: old log-probs recomputed, padded"),
        Side("verl-bypass", "verl", "vllm", "engine", "verl 0.9.1 GSPO, rollout_correction.bypass_mode: vLLM's pi_old"),
    )
}


# ----------------------------------------------------------------------------------------------- protocol


class Channel:
    """The side's end: JSON lines out on the original stdout, commands in on stdin; prints go to stderr."""

    def __init__(self) -> None:
        out = os.dup(1)
        os.dup2(2, 1)  # anything printed (Ray, vLLM, TRL, our trainer) lands in the side's log, not the protocol
        self._out = os.fdopen(out, "w", buffering=1)

    def send(self, event: str, **payload: Any) -> None:
        self._out.write(json.dumps({"event": event, **payload}, allow_nan=True) + "\n")
        self._out.flush()

    def wait(self) -> bool:
        """True on ``go``, False on ``stop`` (or a closed pipe)."""
        line = sys.stdin.readline().strip()
        return line == "go"


# ----------------------------------------------------------------------------------------------- our side


def padding_of_update(batch, cfg, shared: bool = False) -> tuple[int, int]:
    """(tokens the update's forward/backward passes process, real tokens among them) for one data-parallel rank:
    the engine's micro-batch plan per minibatch; a packed pass is one row of its samples (no padding), or with
    ``shared`` (actor.shared_prefix as the engine resolves it, :func:`shares_prefix`) its shared-prefix row (each
    prompt once), a padded pass is ``samples x longest sample`` (engines/logprobs.py's layouts)."""
    from gspo_ascend.engines.microbatch import plan_micro_batches, sample_tokens, shared_row_tokens

    a = cfg.actor
    processed = real = 0
    for minibatch in batch.split(cfg.algorithm.minibatches_per_rollout):
        tokens = sample_tokens(minibatch)
        plan = plan_micro_batches(minibatch, a.micro_batch_size, a.max_tokens_per_micro_batch, shared)
        for group in plan.groups:
            sizes = [tokens[i] for i in group]
            real += sum(sizes)
            if shared:
                processed += shared_row_tokens(minibatch.select(group))
            else:
                processed += sum(sizes) if a.use_remove_padding else len(sizes) * max(sizes)
    return processed, real


def shares_prefix(cfg) -> bool:
    """actor.shared_prefix resolved as the fsdp engine does for a dense model on the config's device (the
    benchmark's models are dense; the engine also turns auto off for an MoE one)."""
    from gspo_ascend.config import shared_prefix_on
    from gspo_ascend.device import get_backend

    on_cpu = get_backend(cfg.trainer.device).name == "cpu"
    return cfg.actor.engine == "fsdp" and shared_prefix_on(cfg, on_cpu)


class OurProbe:
    """Wraps the trainer's old-log-prob stage: keeps the batch and, with ``old_logprobs=engine``, times a recompute
    on it (taken out of the step time afterwards) and measures the engine-vs-trainer log-prob gap."""

    def __init__(self, trainer_module, probe_recompute: bool) -> None:
        self.trainer, self.probe_recompute = trainer_module, probe_recompute
        self.original = trainer_module.old_log_probs
        self.batch, self.probe_s, self.gap_max = None, 0.0, float("nan")
        trainer_module.old_log_probs = self

    def __call__(self, run, batch):
        self.batch, self.probe_s, self.gap_max = batch, 0.0, float("nan")
        out = self.original(run, batch)
        if self.probe_recompute and run.cfg.algorithm.old_logprobs == "engine":
            t0 = time.perf_counter()
            recomputed = run.workers.compute_log_probs(batch, run.cfg.rollout.temperature)
            self.probe_s = time.perf_counter() - t0
            mask = batch.response_mask.bool()
            self.gap_max = float((recomputed - batch.rollout_log_probs).abs()[mask].max()) if mask.any() else 0.0
        return out


def our_step_report(metrics: dict[str, float], probe: OurProbe, cfg) -> dict[str, Any]:
    step_s = metrics["time/step_s"] - probe.probe_s  # the probe is not part of the step
    outside = ("time/step_s", "time/validation_s")  # the step's total, and held-out validation after its timer
    stages = {k[5:-2]: v for k, v in metrics.items() if k.startswith("time/") and k not in outside}
    stages["old_log_prob"] -= probe.probe_s
    stages["generate"] = stages.pop("rollout")
    processed, real = padding_of_update(probe.batch, cfg, shares_prefix(cfg))
    return {
        "step_s": step_s,
        "tokens": metrics["perf/tokens_per_s"] * metrics["time/step_s"],
        "stages": stages,
        "processed_tokens": processed,
        "real_tokens": real,
        "reward_mean": metrics["reward/mean"],
        "response_length_mean": metrics["response/length_mean"],
        "response_length_max": metrics["response/length_max"],
        "prompt_length_mean": metrics["prompt/length_mean"],
        "recompute_probe_s": probe.probe_s,
        "engine_logprob_gap_max": probe.gap_max,
        "sync_bytes": metrics.get("sync/bytes", float("nan")),
        "validation": heldout(metrics),
    }


def heldout(metrics: dict[str, float]) -> dict[str, float]:
    """Our held-out accuracy over all prompts, mean over the samples of each (``val/all/mean@N``)."""
    return {k: v for k, v in metrics.items() if k.startswith("val/all/mean@")}


def run_our_side(side: Side, cfg, channel: Channel) -> None:
    from gspo_ascend import trainer, validation

    os.environ.setdefault("RAY_worker_niceness", "0")  # Ray's default 15 would lose the CPU to TRL's process
    t0 = time.perf_counter()
    run = trainer.prepare(cfg)
    probe = OurProbe(trainer, probe_recompute=side.old_logprobs == "engine")
    try:
        trainer.start(run)
        before = {}
        if run.val_set is not None and cfg.trainer.val_before_train:  # held-out accuracy of the initial weights
            before = heldout(validation.validate(run, 0))
        channel.send("ready", setup_s=time.perf_counter() - t0)
        step = run.start_step
        while channel.wait():
            step += 1
            report = our_step_report(trainer.train_step(run, step), probe, cfg)
            channel.send("step", **report, **({"validation_before": before} if step == 1 else {}))
        from procstats import peak_rss_mib, ray_workers

        channel.send("done", peak_rss_mib=peak_rss_mib(ray_workers()), logs=[])
    finally:
        trainer.stop(run)
        import ray

        if ray.is_initialized():
            ray.shutdown()


# ----------------------------------------------------------------------------------------------- TRL side


class TrlStages:
    """Seconds per stage from TRL's profiling contexts (they only log to W&B / MLflow / Trackio by themselves)."""

    def __init__(self) -> None:
        self.spans: dict[str, float] = {}
        self._preparing = 0

    def install(self) -> TrlStages:
        """Hook TRL's ProfilingContext (process-wide: a side process runs one trainer)."""
        from trl.extras import profiling

        context = profiling.ProfilingContext
        enter, leave = context.__enter__, context.__exit__
        stages = self

        def entering(ctx):
            stages._preparing += _stage_name(ctx.name) == "_prepare_inputs"
            return enter(ctx)

        def leaving(ctx, *exc):
            seconds = time.perf_counter() - ctx._start_time
            stages._preparing -= _stage_name(ctx.name) == "_prepare_inputs"
            stages.add(_stage_name(ctx.name), seconds, inside_prepare=stages._preparing > 0)
            return leave(ctx, *exc)

        context.__enter__, context.__exit__ = entering, leaving
        return self

    def add(self, name: str, seconds: float, inside_prepare: bool) -> None:
        if name in ("transformers.generate", "vLLM.generate", "transformers.generate_batch"):
            key = "generate"
        elif name == "_calculate_rewards":
            key = "reward"
        elif name == "_get_per_token_logps_and_entropies" and inside_prepare:
            key = "old_log_prob"
        elif name == "sync_weights":
            key = "sync"
        elif name == "_prepare_inputs":
            key = "prepare_inputs"
        else:
            return
        self.spans[key] = self.spans.get(key, 0.0) + seconds

    def take(self, step_s: float) -> dict[str, float]:
        """This rollout batch's stages; ``update`` is what the others leave of the step (forward/backward/step)."""
        spans, self.spans = self.spans, {}
        prepare = spans.pop("prepare_inputs", 0.0)  # generation, reward, old log-probs and sync run inside it
        spans.setdefault("sync", 0.0)
        named = sum(spans.get(k, 0.0) for k in ("generate", "reward", "old_log_prob", "sync"))
        spans["update"] = step_s - prepare
        spans["other_prepare"] = max(prepare - named, 0.0)
        return spans


def _stage_name(name: str) -> str:
    """TRL names its contexts ``<class>.<what>`` ("GRPOTrainer.vLLM.generate"); the part after the class."""
    return name.split(".", 1)[1] if "." in name else name


def trl_grpo_trainer_class(padding: dict[str, int]):
    """GRPOTrainer that counts the tokens its loss passes process and the real ones (prompt + completion masks)."""
    from trl import GRPOTrainer

    class CountingGRPOTrainer(GRPOTrainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            masks = (inputs["prompt_mask"], inputs["completion_mask"])
            padding["processed"] += sum(int(m.numel()) for m in masks)
            padding["real"] += sum(int(m.sum()) for m in masks)
            return super().compute_loss(model, inputs, *args, **kwargs)

    return CountingGRPOTrainer


def sync_by_reload(generation) -> None:
    """TRL's colocated weight sync, loading through vLLM's layerwise reload instead of ``model.load_weights``.

    TRL 1.16 feeds each tensor to the in-process vLLM model's ``load_weights``; on vLLM's CPU build the linear
    layers were re-packed after the first load and have no ``weight_loader`` any more, so TRL's own sync fails
    ("'Parameter' object has no attribute 'weight_loader'"). ``Worker.reload_weights`` is vLLM's documented
    in-place reload (the path our vllm engine takes): the same names and tensors, then the kernels' re-packing."""

    def sync_weights() -> None:
        worker = generation.llm.llm_engine.model_executor.driver_worker.worker
        worker.reload_weights(weights_iterator=((n, p.detach()) for n, p in generation._iter_named_params()))
        generation.llm.reset_prefix_cache()

    generation.sync_weights = sync_weights


def run_trl_side(side: Side, make_trainer, channel: Channel) -> None:
    """``make_trainer(between, trainer_cls)`` -> (GRPOTrainer, its rollout clock), from the orchestrator module."""
    import resource

    t0 = time.perf_counter()
    stages, padding = TrlStages().install(), {"processed": 0, "real": 0}

    def between() -> None:
        seconds, tokens = clock.intervals[-1]
        channel.send(
            "step",
            step_s=seconds,
            tokens=tokens,
            stages=stages.take(seconds),
            processed_tokens=padding["processed"],
            real_tokens=padding["real"],
        )
        padding["processed"] = padding["real"] = 0
        if not channel.wait():
            trainer.control.should_training_stop = True

    trainer, clock = make_trainer(between, trl_grpo_trainer_class(padding))
    if side.name == "trl-vllm-reload":
        sync_by_reload(trainer.vllm_generation)
    channel.send("ready", setup_s=time.perf_counter() - t0)
    if channel.wait():
        trainer.train()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    channel.send("done", peak_rss_mib=peak, logs=clock.logs)


# ----------------------------------------------------------------------------------------------- entry point


def side_worker(name: str, build) -> int:
    """``e2e_vs_trl.py --side-worker NAME``: ``build(side)`` -> (our config, TRL trainer factory or None); for a
    verl side (its VerlSpec, the work directory)."""
    channel = Channel()
    try:
        side = SIDES[name]
        cfg, make_trainer = build(side)
        if side.trainer == "ours":
            run_our_side(side, cfg, channel)
        elif side.trainer == "verl":  # cfg is the verl side's VerlSpec (verl_side/side.py)
            from verl_side.side import run_verl_side

            run_verl_side(side, cfg, channel, make_trainer)
        else:
            run_trl_side(side, make_trainer, channel)
    except BaseException as exc:  # the orchestrator reports it and carries on with the other sides
        tail = traceback.format_exc().strip().splitlines()[-16:]
        channel.send("error", message=f"{type(exc).__name__}: {exc}".splitlines()[0][:400], traceback=tail)
        return 1
    return 0
