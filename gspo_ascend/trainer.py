"""The GSPO driver: one named call per stage of the algorithm (arXiv 2507.18071, Algorithm 1).

    for each step:
        prompts   <- the next rollout batch from the seeded, resumable sampler
        samples   <- rollout: n responses per prompt, with the engine's per-token log-probs
        rewards   <- math-verify (or the user's function), DAPO overlong penalty
        advantages<- group-normalised rewards (one per sequence)
        pi_old    <- recomputed by the train engine, or the rollout engine's own (algorithm.old_logprobs)
        update    <- the batch split into minibatches, one clipped GSPO optimizer step each
        sync      <- the new weights streamed into the rollout engine
        validate  <- every trainer.test_freq steps: held-out prompts, mean@n / pass@k / maj@k (validation.py)
        log, checkpoint

How we differ from verl's ``RayPPOTrainer.fit``: no reference or critic workers (the paper uses no KL; a
reference copy lives inside the train engine when ``algorithm.kl_coef > 0``), the stages are functions of a
:class:`~gspo_ascend.runtime.Run` instead of one 400-line method, and ``old_logprobs=engine`` skips the
recompute pass entirely (the paper's point that sequence-level ratios tolerate train/inference mismatch).
"""

from __future__ import annotations

import contextlib
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch

from . import validation
from .algorithms import grpo_advantages
from .config import Config, behavior_correction, to_dict
from .engines import SampleBatch, SamplingParams
from .errors import Stopped, UserError
from .preempt import GracefulStop
from .runtime import Run, prepare


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
    cfg, timer = run.cfg, Timer()
    versions = None  # each token's weights version, with partial rollout or a rollout pool
    if run.pipeline is not None and run.scheduler is not None:  # rounds one step ahead on a rollout pool
        batch, rewards, versions, metrics = take_rounds(run, step, timer)
    elif run.pipeline is not None:
        batch, rewards, versions, metrics = take_pipelined(run, step, timer)
    elif run.scheduler is None:
        prompts = next_prompts(run)
        with timer("rollout"):
            batch = rollout(run, prompts, step)
        with timer("reward"):
            rewards, metrics = score(run, batch, prompts, step)
        metrics["reward/zero_var_group_frac"] = zero_variance_share(rewards, batch.group_index)
    else:
        batch, rewards, versions, metrics = collect(run, step, timer)
    if cfg.rollout.weights_lag:  # a staleness study: every sample from the weights of exactly `lag` updates ago
        version = max(0, step - 1 - cfg.rollout.weights_lag)
        versions, metrics["async/staleness"] = torch.full_like(batch.response_ids, version), float(step - 1 - version)
    batch.advantages = grpo_advantages(rewards, batch.group_index, norm_by_std=cfg.algorithm.norm_adv_by_std)
    with timer("old_log_prob"):
        batch.old_log_probs = old_log_probs(run, batch)
    if versions is not None and behavior_correction(cfg) == "seq_tis":
        metrics |= correct_behavior(run, batch, versions < step - 1)
    elif cfg.rollout.weights_lag and cfg.algorithm.old_logprobs == "engine":
        with timer("diagnostics"):  # a staleness study: the gap the uncorrected objective trains across, measured
            metrics |= correct_behavior(run, batch, versions < step - 1, apply=False)
    with timer("update"):
        metrics |= run.workers.update(batch, cfg.rollout.temperature, cfg.algorithm.minibatches_per_rollout)
    if run.pipeline is None:
        with timer("sync"):
            metrics |= run.workers.sync_weights()
    elif run.pipeline.max_staleness == 0 or validation.is_due(run, step):  # the rollout pool gets these weights now
        run.pipeline.settle()  # rounds ahead finish on the weights they started with
        with timer("sync"):
            metrics |= sync_pool(run, after_update=True)
        if run.pipeline.max_staleness == 0 and step < cfg.trainer.total_steps:
            run.pipeline.submit(run, step + 1, rollout_params(run, step + 1))
    metrics |= batch_metrics(batch) | timer.metrics(batch.num_tokens())
    lagged = cfg.rollout.weights_lag and validation.is_due(run, step)
    if lagged:  # a staleness study validates the weights it trained, not the lagged ones the rollout generates with
        run.workers.show_weights("current")
    metrics |= validation.due(run, step)  # held-out prompts every trainer.test_freq steps and at the last
    if lagged:
        run.workers.show_weights("lagged")
    run.logger.log(step, metrics)
    return metrics


# ----------------------------------------------------------------------------------------------- stages


def next_prompts(run: Run) -> list[Any]:
    return [run.dataset[i] for i in run.sampler.next_batch()]


def rollout(run: Run, prompts: list[Any], step: int) -> SampleBatch:
    return run.workers.generate([p.prompt_ids for p in prompts], rollout_params(run, step))


def rollout_params(run: Run, step: int) -> SamplingParams:
    r = run.cfg.rollout
    return SamplingParams(
        n=r.n,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        max_new_tokens=run.cfg.data.max_response_length,
        seed=run.cfg.trainer.seed * 1_000_003 + step,  # a function of the step: resumed runs sample alike
    )


def score(run: Run, batch: SampleBatch, prompts: list[Any], step: int) -> tuple[torch.Tensor, dict[str, float]]:
    from .rewards import compute_rewards

    rc = run.cfg.reward
    rows = [prompts[int(g)] for g in batch.group_index]
    lengths = batch.response_lengths
    texts = run.tokenizer.batch_decode(
        [ids[:n].tolist() for ids, n in zip(batch.response_ids, lengths, strict=True)], skip_special_tokens=True
    )
    return compute_rewards(
        texts,
        [p.ground_truth for p in rows],
        [p.data_source for p in rows],
        reward_fn=rc.reward_fn,
        extra_infos=[p.extra_info for p in rows],
        response_lengths=lengths,
        max_response_length=run.cfg.data.max_response_length,
        overlong_buffer_length=rc.overlong_buffer_length,
        overlong_penalty_factor=rc.overlong_penalty_factor,
        timeout_s=rc.timeout_s,
        num_workers=rc.num_workers,
        max_failure_rate=rc.max_failure_rate,
        error_log=run.reward_log,
        step=step,
    )


def old_log_probs(run: Run, batch: SampleBatch) -> torch.Tensor:
    if run.cfg.algorithm.old_logprobs == "engine":
        return batch.rollout_log_probs
    return run.workers.compute_log_probs(batch, run.cfg.rollout.temperature)


def collect(run: Run, step: int, timer: Timer) -> tuple[SampleBatch, torch.Tensor, torch.Tensor, dict[str, float]]:
    """Partial rollout / dynamic sampling: rounds until the step's B oldest groups are finished and kept
    (partial_rollout.py); scored as they finish. Returns the batch, its rewards, each token's version, metrics."""
    got = run.scheduler.collect(step, rollout_params(run, step), run.workers.generate_requests, scorer(run), timer)
    return got.batch, got.rewards, got.versions, got.metrics


def take_rounds(run: Run, step: int, timer: Timer) -> tuple[SampleBatch, torch.Tensor, torch.Tensor, dict]:
    """Partial rollout / dynamic sampling one step off (pipeline.RoundsAhead): step ``step``'s rounds, run ahead
    on the rollout pool; then the pool gets the trainer's weights and the rounds of step + 1 start on the rounds'
    thread before this batch is trained. Their stage seconds are logged as ``time/ahead_<stage>_s`` (they overlap
    the training of the step before)."""
    ahead, total = run.pipeline, run.cfg.trainer.total_steps
    with timer("wait_rollout"):
        if not ahead.in_flight:  # the run's first step: generated now, by the current weights
            start_rounds(run, step)
        got, spans, version = ahead.take(step)
    metrics: dict[str, float] = {}
    if step < total:
        with timer("sync"):
            metrics |= sync_pool(run, after_update=False)
        start_rounds(run, step + 1)
    oldest = int(got.versions[got.batch.response_mask.bool()].min())
    bound = ahead.max_staleness + run.scheduler.max_rounds - 1
    if (step - 1) - oldest > bound:
        raise RuntimeError(f"rounds ahead: batch {step} holds tokens {(step - 1) - oldest} versions old, over {bound}")
    metrics |= got.metrics | {f"time/ahead_{k}_s": v for k, v in spans.items()}
    metrics["async/staleness"] = float(step - 1 - version)
    return got.batch, got.rewards, got.versions, metrics


def start_rounds(run: Run, step: int) -> None:
    """The rounds of ``step`` on the rounds' thread, generated by the rollout pool's weights as they are now."""
    version = run.workers.rollout_version

    def rounds() -> tuple[Any, dict[str, float]]:
        timer = Timer()
        params = rollout_params(run, step)
        got = run.scheduler.collect(step, params, run.workers.generate_requests, scorer(run), timer, version=version)
        return got, dict(timer.spans)

    run.pipeline.submit(step, version, rounds)


def scorer(run: Run) -> Any:
    """The scheduler's scoring call (partial_rollout.ScoreFn): a batch of finished groups, their dataset rows."""

    def score_rows(batch: SampleBatch, rows: list[int], at_step: int) -> tuple[torch.Tensor, dict[str, float]]:
        return score(run, batch, [run.dataset[i] for i in rows], at_step)

    return score_rows


def take_pipelined(run: Run, step: int, timer: Timer) -> tuple[SampleBatch, torch.Tensor, torch.Tensor, dict]:
    """A rollout pool (pipeline.py): batch ``step`` from the pool; with max_staleness eta >= 1, when that emptied
    the pool's queue, the pool gets the trainer's weights and starts the next eta batches before this one is scored
    and trained."""
    pipeline = run.pipeline
    with timer("wait_rollout"):  # the trainer's idle time: it has nothing to do until this batch is here
        rows, batch, version = pipeline.take(run, step, rollout_params(run, step))
    metrics: dict[str, float] = {}
    total = run.cfg.trainer.total_steps
    if pipeline.max_staleness >= 1 and not pipeline.in_flight and step < total:
        with timer("sync"):
            metrics |= sync_pool(run, after_update=False)
        pipeline.refill(run, step, total, lambda s: rollout_params(run, s))
    prompts = [run.dataset[i] for i in rows]
    with timer("reward"):
        rewards, scored = score(run, batch, prompts, step)
    metrics |= scored | {"async/staleness": float(step - 1 - version)}
    metrics["reward/zero_var_group_frac"] = zero_variance_share(rewards, batch.group_index)
    return batch, rewards, torch.full_like(batch.response_ids, version), metrics


def sync_pool(run: Run, after_update: bool) -> dict[str, float]:
    """The trainer's weights to the rollout pool, unless it holds them already (a validation step one step off
    synced after its update; the next step's sync has nothing new to send)."""
    workers = run.workers
    if workers.rollout_version == workers.version:
        return {}
    metrics = workers.sync_weights()
    return metrics if not after_update or run.pipeline.max_staleness == 0 else {"sync/extra_s": metrics["sync/time_s"]}


def correct_behavior(run: Run, batch: SampleBatch, stale: torch.Tensor, *, apply: bool = True) -> dict[str, float]:
    """Weigh samples with stale tokens by the capped sequence weight pi_prox / mu (algorithms/behavior.py), applied
    to their advantages (exactly the weight on their clipped surrogate); pi_prox is the recomputed pi_old.
    ``apply=False`` (``rollout.weights_lag`` with ``old_logprobs=engine``): the ``behavior/*`` metrics of the
    correction this run does not apply, pi_prox recomputed for them alone (one forward), so a study compares the
    drift of both pi_old choices on one scale; the update is unchanged."""
    from .algorithms.behavior import behavior_weights

    prox = batch.old_log_probs if apply else run.workers.compute_log_probs(batch, run.cfg.rollout.temperature)
    weights, metrics = behavior_weights(
        prox, batch.rollout_log_probs, stale, batch.response_mask, run.cfg.algorithm.behavior_cap
    )
    if apply:
        batch.advantages = batch.advantages * weights
    return metrics


def zero_variance_share(rewards: torch.Tensor, group_index: torch.Tensor) -> float:
    """The share of groups whose rewards are all equal (zero advantage: the update learns nothing from them)."""
    groups = group_index.unique()
    flat = sum(1 for g in groups if rewards[group_index == g].unique().numel() == 1)
    return flat / max(len(groups), 1)


def batch_metrics(batch: SampleBatch) -> dict[str, float]:
    lengths = batch.response_lengths.float()
    mask = batch.response_mask.bool()
    metrics = {
        "response/length_mean": float(lengths.mean()),
        "response/length_max": float(lengths.max()),
        "response/clip_ratio": float((lengths >= batch.response_ids.shape[1]).float().mean()),
        "prompt/length_mean": sum(len(p) for p in batch.prompt_ids) / len(batch),
    }
    if batch.old_log_probs is not batch.rollout_log_probs and batch.rollout_log_probs is not None:
        # the train/inference mismatch the paper says GSPO tolerates: |log pi_rollout - log pi_train| per token
        gap = (batch.rollout_log_probs - batch.old_log_probs).abs()[mask]
        metrics["rollout/logprob_gap_mean"] = float(gap.mean()) if gap.numel() else 0.0
        metrics["rollout/logprob_gap_max"] = float(gap.max()) if gap.numel() else 0.0
    return metrics


# ----------------------------------------------------------------------------------------------- lifecycle


def start(run: Run) -> None:
    from .checkpoint import load_rng, load_trainer_state
    from .metrics import MetricsLogger
    from .partial_rollout import build_scheduler, load_scheduler
    from .pipeline import build_pipeline, load_pipeline
    from .pools import build_workers
    from .resume import load_failure
    from .simulated import announce

    announce()  # GSPO_SIMULATED_ENGINES (tests and benchmarks only): said once, before anything is timed
    run.workers = build_workers(run.cfg, run.backend, run.model_path)
    run.scheduler = build_scheduler(run.cfg, run.sampler, run.dataset)
    run.pipeline = build_pipeline(run.cfg)
    stale_pi_old_note(run.cfg)
    if run.resume_from is not None and run.cfg.rollout.weights_lag:
        raise UserError(
            f"rollout.weights_lag={run.cfg.rollout.weights_lag}: a checkpoint holds no older weights, so a resume "
            "would not be the same study; start it again (trainer.resume=never) or set rollout.weights_lag=0"
        )
    if run.resume_from is not None:
        state = load_trainer_state(run.resume_from)
        try:
            run.workers.load_checkpoint(str(run.resume_from / "engine"))
        except Exception as exc:
            raise load_failure(run.resume_from, exc) from None
        load_pipeline(run.pipeline, run.resume_from)
        if hasattr(run.workers, "rollout_version"):  # two pools: the loaded weights' version
            run.workers.version = int(state["step"])
        # the rollout engine still holds the initial weights. With a batch in flight (loaded above), the step that
        # trains it sends them, as the uninterrupted run did at that step
        if run.pipeline is None or not run.pipeline.in_flight:
            run.workers.sync_weights()
        run.sampler.load_state_dict(state["sampler"])
        load_scheduler(run.scheduler, run.resume_from)
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


def save_checkpoint(run: Run, step: int) -> None:
    from .checkpoint import abort, begin, commit, save_rng
    from .partial_rollout import STATE_FILE
    from .pipeline import save_pipeline
    from .resume import state_record
    from .rundir import disk_full

    tmp = begin(run.output_dir, step)
    try:
        run.workers.save_checkpoint(str(tmp / "engine"))
        save_rng(tmp)
        if run.pipeline is not None:
            run.pipeline.settle()  # rounds ahead move the scheduler's groups and the sampler: let them finish first
        if run.scheduler is not None:  # the groups in flight, every token of them: a resume continues them
            torch.save(run.scheduler.state_dict(), tmp / STATE_FILE)
        save_pipeline(run.pipeline, tmp)  # the batch in flight, waited for (before the sampler state below)
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
        if getattr(run, "pipeline", None) is not None:  # after the pools: rounds still in flight fail and return
            run.pipeline.close()
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


class Timer:
    """Wall time per stage -> ``time/<stage>_s``, ``time/step_s`` and ``perf/tokens_per_s``."""

    def __init__(self) -> None:
        self.start, self.spans = time.perf_counter(), {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        """Adds the time spent inside to stage ``name`` (a stage may run several times in a step: rounds)."""
        t0 = time.perf_counter()
        yield
        self.spans[name] = self.spans.get(name, 0.0) + time.perf_counter() - t0

    def metrics(self, tokens: int) -> dict[str, float]:
        total = time.perf_counter() - self.start
        return {f"time/{k}_s": v for k, v in self.spans.items()} | {
            "time/step_s": total,
            "perf/tokens_per_s": tokens / total if total > 0 else 0.0,
        }
