"""The GSPO driver: one named call per stage of the algorithm (arXiv 2507.18071, Algorithm 1).

    for each step:
        batch     <- the schedule's next batch: prompts from the seeded, resumable sampler, n responses per prompt
                     with the engine's per-token log-probs, rewards (math-verify or the user's function, DAPO
                     overlong penalty), and each token's weights version where it can be older than the trainer's
        advantages<- group-normalised rewards (one per sequence)
        pi_old    <- recomputed by the train engine, or the rollout engine's own (algorithm.old_logprobs)
        behaviour <- samples from older weights weighed by the capped sequence weight (algorithm.behavior_correction)
        update    <- the batch split into minibatches, one clipped GSPO optimizer step each
        hand on   <- the new weights to the rollout side, when the schedule's rhythm says
        validate  <- every trainer.test_freq steps: held-out prompts, mean@n / pass@k / maj@k (validation.py)
        log, checkpoint (with what the schedule has in flight)

The schedule (gspo_ascend/schedules/: synchronous, partial-rollout rounds, a rollout pool ahead, rounds ahead on a
pool, the staleness study's lag) is built once at start; the step never asks which one it has.

How we differ from verl's ``RayPPOTrainer.fit``: no reference or critic workers (the paper uses no KL; a
reference copy lives inside the train engine when ``algorithm.kl_coef > 0``), the stages are functions of a
:class:`~gspo_ascend.runtime.Run` instead of one 400-line method, the asynchronous modes are schedules given to one
trainer instead of trainer classes of their own, and ``old_logprobs=engine`` skips the
recompute pass entirely (the paper's point that sequence-level ratios tolerate train/inference mismatch).
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import torch

from . import validation
from .algorithms import grpo_advantages, kl_k3
from .config import Config, behavior_correction, to_dict
from .engines import SampleBatch
from .errors import Stopped, UserError
from .metrics import Timer
from .preempt import GracefulStop
from .runtime import Run, prepare
from .schedules import Produced


def train(cfg: Config) -> list[dict[str, float]]:
    """Run GSPO as configured; returns the metrics of every step run by this call. On SIGTERM the step finishes,
    its checkpoint is saved and :class:`~gspo_ascend.errors.Stopped` ends the run (exit 143; preempt.py)."""
    from .rundir import disk_full

    sigterm = GracefulStop()
    sigterm.install()  # a SIGTERM during set-up waits for the first safe point too
    try:
        return _train(cfg, sigterm)
    except UserError:
        raise  # already one line (a full disk during a save says which save)
    except Exception as exc:
        full = disk_full(exc, cfg.trainer.output_dir, "writing the run's outputs")  # metrics, config, TensorBoard
        if full is not None:
            raise full from None
        raise
    finally:
        sigterm.restore()


def _train(cfg: Config, sigterm: GracefulStop) -> list[dict[str, float]]:
    run, t = prepare(cfg), cfg.trainer
    history, last = [], run.start_step
    try:
        if run.start_step >= t.total_steps:  # resumed at its last step (below it is refused by check_resume)
            _already_complete(run)
        else:
            start(run)
            sigterm.install()  # Ray's start-up replaced our handler with its own (a stack dump, exit code 134)
            validation.before_training(run)
            for step in range(run.start_step + 1, t.total_steps + 1):
                if sigterm.requested:  # only before the first step: later ones stop after their save below
                    break
                history.append(train_step(run, step))
                last = step
                if step == t.total_steps or sigterm.requested or (t.save_freq and step % t.save_freq == 0):
                    save_checkpoint(run, step)
                if sigterm.requested:
                    break
            if last == t.total_steps:
                export_hf(run)
    finally:
        stop(run)
    val_files = run.val_set.files if run.val_set is not None else None
    print("\n".join(run_summary(run.output_dir, t.loggers, t.project_name, val_files)), flush=True)
    if sigterm.requested:
        raise Stopped(_stopped_message(run, last), sigterm.signum)
    return history


def _already_complete(run: Run) -> None:
    print(
        f"checkpoint {run.resume_from} is at trainer.total_steps ({run.start_step}): nothing left to train; raise "
        "trainer.total_steps to continue this run",
        flush=True,
    )
    if not (run.output_dir / "hf").is_dir():  # killed between the last checkpoint and the HF export
        start(run)
        export_hf(run)


def _stopped_message(run: Run, last: int) -> str:
    from .checkpoint import checkpoint_name, checkpoints_root, find_latest

    if last > run.start_step:
        saved = checkpoints_root(run.output_dir) / checkpoint_name(last)
        return f"SIGTERM: stopped after step {last} with checkpoint {saved}; run the same command to resume"
    latest = find_latest(run.output_dir)
    return f"SIGTERM before this run's first step: nothing new to save (last checkpoint: {latest or 'none'})"


def train_step(run: Run, step: int) -> dict[str, float]:
    """One step of Algorithm 1. Where the batch comes from, and when the rollout side gets the new weights, is the
    run's schedule's (gspo_ascend/schedules/: one file per way of producing a batch)."""
    cfg, timer = run.cfg, Timer()
    got = run.schedule.next_batch(step, timer)
    batch, metrics = got.batch, got.metrics
    batch.advantages = grpo_advantages(got.rewards, batch.group_index, norm_by_std=cfg.algorithm.norm_adv_by_std)
    with timer("old_log_prob"):
        batch.old_log_probs = old_log_probs(run, batch)
    metrics |= behaviour(run, batch, got, step, timer)
    with timer("update"):
        metrics |= run.workers.update(batch, cfg.rollout.temperature, cfg.algorithm.minibatches_per_rollout)
    metrics |= run.schedule.hand_on(step, timer)
    metrics |= batch_metrics(batch) | timer.metrics(batch.num_tokens())
    with run.schedule.validating(step):
        metrics |= validation.due(run, step)  # held-out prompts every trainer.test_freq steps and at the last
    run.logger.log(step, metrics)
    return metrics


# ----------------------------------------------------------------------------------------------- stages


def old_log_probs(run: Run, batch: SampleBatch) -> torch.Tensor:
    if run.cfg.algorithm.old_logprobs == "engine":
        return batch.rollout_log_probs
    return run.workers.compute_log_probs(batch, run.cfg.rollout.temperature)


def behaviour(run: Run, batch: SampleBatch, got: Produced, step: int, timer: Timer) -> dict[str, float]:
    """Samples with tokens from older weights than the trainer's (version step - 1): weighed by the behaviour
    correction (``algorithm.behavior_correction``), or, for the staleness study, the correction measured only."""
    if got.versions is None:
        return {}
    stale = got.versions < step - 1
    if behavior_correction(run.cfg) == "seq_tis":
        return correct_behavior(run, batch, stale)
    if got.measure_drift:
        with timer("diagnostics"):  # the gap the uncorrected objective trains across, measured
            return correct_behavior(run, batch, stale, apply=False)
    return {}


def correct_behavior(run: Run, batch: SampleBatch, stale: torch.Tensor, *, apply: bool = True) -> dict[str, float]:
    """Weigh samples with stale tokens by the capped sequence weight pi_prox / mu (algorithms/behavior.py), applied
    to their advantages (exactly the weight on their clipped surrogate); pi_prox is the recomputed pi_old.
    ``apply=False`` (``rollout.weights_lag`` with ``old_logprobs=engine``): the ``behavior/*`` metrics of the
    correction this run does not apply, pi_prox recomputed for them alone (one forward), so a study compares the
    drift of both pi_old choices on one scale; the update is unchanged."""
    from .algorithms.behavior import behavior_weights

    prox = batch.old_log_probs if apply else run.workers.compute_log_probs(batch, run.cfg.rollout.temperature)
    weights, metrics = behavior_weights(
        prox, batch.rollout_log_probs, stale, batch.trained_mask, run.cfg.algorithm.behavior_cap
    )
    if apply:
        batch.advantages = batch.advantages * weights
    return metrics


def batch_metrics(batch: SampleBatch) -> dict[str, float]:
    lengths = batch.response_lengths.float()
    mask = batch.trained_mask.bool()  # the gap at the model's own tokens (a tool turn has no engine log-probs)
    metrics = {
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max()),
        "response/clip_ratio": float((lengths >= batch.response_ids.shape[1]).float().mean()),
        "prompt/length_mean": sum(len(p) for p in batch.prompt_ids) / len(batch),
    }
    if batch.old_log_probs is not batch.rollout_log_probs and batch.rollout_log_probs is not None:
        # the train/inference mismatch the paper says GSPO tolerates: |log pi_rollout - log pi_train| per token
        delta = (batch.rollout_log_probs - batch.old_log_probs)[mask]
        gap = delta.abs()
        metrics["rollout/logprob_gap_mean"] = float(gap.mean()) if gap.numel() else 0.0
        metrics["rollout/logprob_gap_max"] = float(gap.max()) if gap.numel() else 0.0
        # KL(pi_rollout || pi_train) per token, k3 (algorithms/kl.py) with r = pi_train / pi_rollout: unbiased on the
        # rollout's own samples; the mismatch measure verl and the MoE-replay papers report beside the mean |diff|
        k3 = kl_k3(batch.rollout_log_probs, batch.old_log_probs)[mask]
        metrics["rollout/logprob_gap_k3"] = float(k3.mean()) if gap.numel() else 0.0
    return metrics


# ----------------------------------------------------------------------------------------------- lifecycle


def start(run: Run) -> None:
    from .checkpoint import load_rng, load_trainer_state
    from .metrics import MetricsLogger
    from .pools import build_workers
    from .resume import load_failure
    from .schedules import build_schedule
    from .simulated import announce

    announce()  # GSPO_SIMULATED_ENGINES (tests and benchmarks only): said once, before anything is timed
    run.workers = build_workers(run.cfg, run.backend, run.model_path)
    run.schedule = build_schedule(run)
    stale_pi_old_note(run.cfg)
    unseeded_note(run.cfg, run.backend.torch_device_type == "cpu")
    if run.resume_from is not None:
        state = load_trainer_state(run.resume_from)
        try:
            run.workers.load_checkpoint(str(run.resume_from / "engine"))
        except Exception as exc:
            raise load_failure(run.resume_from, exc) from None
        if hasattr(run.workers, "rollout_version"):  # two pools: the loaded weights' version
            run.workers.version = int(state["step"])
        run.schedule.resume(run.resume_from, state["sampler"])  # in flight, the sampler; the weights to rollout
        load_rng(run.resume_from)
        run.start_step = int(state["step"])
        print(f"resumed from {run.resume_from} at step {run.start_step}", flush=True)
    t = run.cfg.trainer
    run.logger = MetricsLogger(
        run.output_dir,
        t.loggers,
        total_steps=t.total_steps,
        start_step=run.start_step,
        config_dict=to_dict(run.cfg),
        project_name=t.project_name,
        experiment_name=t.experiment_name or run.output_dir.name,
    )


def stale_pi_old_note(cfg: Config) -> None:
    """One line when GSPO's narrow window meets the engine's stale log-probs as pi_old (partial rollout, a rollout
    pool one step off): what the staleness study measured it costs, and the setting that avoids it. Not for GRPO,
    whose window absorbed the lag, nor for the study's own forced lag (rollout.weights_lag), which asks for it."""
    from .config import stale_samples_possible

    a = cfg.algorithm
    if a.old_logprobs != "engine" or a.loss == "grpo" or cfg.rollout.weights_lag or not stale_samples_possible(cfg):
        return
    print(
        f"note: {a.loss} with algorithm.old_logprobs=engine and samples from older weights: pi_old is the stale "
        "rollout policy, so the narrow clip window clips more (the staleness study: 50-55% of sequences against "
        "31-34%, and a lower reward, at 1-4 versions); algorithm.old_logprobs=recompute corrects for it "
        "(docs/partial-rollout.md)",
        file=sys.stderr,
        flush=True,
    )


def unseeded_note(cfg: Config, on_host: bool) -> None:
    """One line when vLLM's requests go unseeded (``rollout.seed_requests`` off, or auto on a GPU / NPU): what that
    gives up, and the setting that keeps it."""
    from .config import seeded_requests

    if cfg.rollout.engine != "vllm" or seeded_requests(cfg, on_host):
        return
    why = "off" if cfg.rollout.seed_requests == "off" else "auto off the host"
    print(
        f"note: vLLM's requests are unseeded (rollout.seed_requests {why}): its sampler draws every sequence's noise "
        "in one call per decode step, so a sample depends on the requests beside it and, at rollout TP 1, on their "
        "timing (a resumed run repeats its samples only in-process, TP > 1, where each call starts from its own "
        "seed); rollout.seed_requests=on seeds each request (one RNG kernel per sequence per step)",
        file=sys.stderr,
        flush=True,
    )


def save_checkpoint(run: Run, step: int) -> None:
    from .checkpoint import abort, begin, commit, save_rng
    from .resume import state_record
    from .rundir import disk_full

    tmp = begin(run.output_dir, step)
    try:
        run.workers.save_checkpoint(str(tmp / "engine"))
        save_rng(tmp)
        run.schedule.save(tmp)  # what is in flight, waited for: before the sampler state that drew it
        state = {"step": step, "sampler": run.sampler.state_dict(), **state_record(run.cfg, run.model_path)}
        commit(tmp, step, state, keep_last=run.cfg.trainer.keep_last)
    except BaseException as exc:
        # probed before abort frees the partial files: torch.save says "unexpected pos", not "No space left"
        full = disk_full(exc, run.output_dir, f"saving checkpoint step {step}", tmp)
        abort(tmp)  # a failed save leaves nothing behind; the previous checkpoint stays the latest
        if full is not None:
            raise full from None
        raise


def export_hf(run: Run) -> None:
    from .rundir import disk_full

    hf = run.output_dir / "hf"
    try:
        run.workers.save_hf(str(hf))
    except Exception as exc:
        full = disk_full(exc, run.output_dir, "exporting the Hugging Face model", hf)
        if full is not None:
            raise full from None
        raise


def stop(run: Run) -> None:
    try:
        if run.logger is not None:
            run.logger.close()
        if run.workers is not None:
            run.workers.shutdown()
        if run.schedule is not None:  # after the pools: rounds still in flight fail and return
            run.schedule.close()
    finally:
        if run.lock is not None:
            run.lock.release()  # trainer.output_dir is free for the next run (rundir.py)


def run_summary(
    output_dir: str | Path, loggers: list[str], project_name: str = "", val_files: list[str] | None = None
) -> list[str]:
    """The closing lines of a run: where its outputs are and the commands that show them. Only what exists is
    named as a path; a sink left out of ``trainer.loggers`` is named as such, so an absent file is explained.
    With ``val_files`` (the run validated) and an export, the `gspo-ascend eval` command that reproduces the last
    validation from the export."""
    from .checkpoint import find_latest
    from .metrics import JSONL_NAME, TENSORBOARD_DIR

    run_dir = Path(output_dir).resolve()
    latest, hf = find_latest(run_dir), run_dir / "hf"
    metrics, tensorboard = run_dir / JSONL_NAME, run_dir / TENSORBOARD_DIR

    def where(path: Path | None, logger: str | None = None, missing: str = "none") -> str:
        if logger is not None and logger not in loggers:
            return f"not written (trainer.loggers has no '{logger}')"
        return str(path) if path is not None and path.exists() else missing

    lines = [
        f"run finished; outputs in {run_dir}",
        f"  run directory    {run_dir} (config.json: the resolved config)",
        f"  last checkpoint  {where(latest, missing='none saved (trainer.save_freq, or no step ran)')}",
        f"  HF export        {where(hf, missing='none written')}",
        f"  metrics          {where(metrics, 'jsonl')}",
        f"  TensorBoard      {where(tensorboard, 'tensorboard')}",
    ]
    if "wandb" in loggers:
        lines.append(f"  W&B              project '{project_name}' (trainer.project_name)")
    commands = []
    if metrics.exists():  # `plot` reads metrics.jsonl
        commands.append(f"  gspo-ascend plot {shlex.quote(str(run_dir))}   # PNG curves into {run_dir / 'plots'}")
    if tensorboard.exists():
        commands.append(f"  tensorboard --logdir {shlex.quote(str(tensorboard))}")
    if val_files and hf.exists():
        data = " ".join(f"--data {shlex.quote(str(f))}" for f in val_files)
        config = shlex.quote(str(run_dir / "config.json"))
        commands.append(f"  gspo-ascend eval --model {shlex.quote(str(hf))} --config {config} {data}")
    return lines + (["look at it:", *commands] if commands else [])
