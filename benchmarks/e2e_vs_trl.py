"""End-to-end GSPO step time: our trainer vs TRL's GRPOTrainer, same model, prompts, batch and lengths.

    PYTHONPATH=. python benchmarks/e2e_vs_trl.py [--steps 8] [--batch 16] [--n 8] [--max-new-tokens 32]
                         [--device cpu] [--sequential] [--set actor.use_remove_padding=false ...] [--json PATH]

Both sides run in this one process on the embedded tiny Qwen3 model (``ensure_tiny_model()``), the synthetic
arithmetic prompts (the parquet of ``resolve_train_files``, loaded and chat-templated by our loader, so both
sides see the same prompt set) and the same reward: our math-verify scorer
(:func:`gspo_ascend.rewards.compute_rewards`) wrapped as a TRL reward function. One "step" is one rollout
batch: ``--batch`` prompts x ``--n`` samples -> rewards -> advantages -> old log-probs -> 4 minibatch
optimizer steps (the GSPO paper's split).

How the TRL side is configured (TRL's documented GSPO recipe, ``trl`` 1.16):

    ours                                      TRL GRPOConfig
    algorithm.loss=gspo                       importance_sampling_level="sequence"
    loss_agg_mode=seq-mean-token-mean         loss_type="grpo" (per-sequence token mean, then batch mean)
    clip_ratio_low/high = 3e-4 / 4e-4         epsilon=3e-4, epsilon_high=4e-4
    kl_coef=0                                 beta=0 (no reference model)
    minibatches_per_rollout=4                 steps_per_generation=4, gradient_accumulation_steps=1,
                                              per_device_train_batch_size = batch*n/4, num_iterations=1
    actor.micro_batch_size = batch*n/4        (one forward/backward per optimizer step on both sides)
    old_logprobs=recompute                    TRL recomputes them too (steps_per_generation > grad. accumulation)
    rollout.n, temperature, top_p, top_k=-1   num_generations, temperature, top_p, top_k=0
    data.max_response_length                  max_completion_length
    actor.lr, weight_decay, grad_clip,        learning_rate, weight_decay, max_grad_norm,
      constant lr (no warm-up)                  lr_scheduler_type="constant"; both torch AdamW, default betas
    model.dtype float32, no grad. ckpt.       bf16=False, fp16=False, gradient_checkpointing=False
    trainer.device=cpu                        use_cpu=True; report_to="none"; save_strategy="no"

Not matched (printed with the results): TRL 1.16 has no ``max_prompt_length`` (prompts are never truncated;
here none exceeds ours, checked: our loader reports how many it filtered); the prompt order (each side's own
seeded sampler) and the sampling RNG differ, so the two runs generate different responses of different
lengths, which is why tokens/s is reported next to the step time; TRL pads, we pack (``use_remove_padding``).

Order. By default the two trainers take turns, one rollout batch each: both are set up first (our Ray worker
started, TRL's model loaded), then a TRL callback runs one step of our trainer (``gspo_ascend.trainer``'s own
``train_step``) at the end of every TRL rollout batch, outside TRL's timed interval. On a shared machine, where
the load from other processes changes by the minute, turns give both sides the same conditions; one whole run
after the other measures the neighbours as much as the trainers (seen on the 2-core CI box: 3x one way, 16x the
other, in back-to-back runs). ``--sequential`` runs ``train(cfg)`` to completion (its final checkpoint and HF
export untimed), shuts Ray down, then runs TRL.

Timing: wall time per rollout batch, excluding one-time setup (model load, Ray and worker start) and the first
step (warm-up: allocator, reward worker spawn, first-call overheads). Ours: the trainer's own ``time/step_s``
(rollout + reward + old log-probs + update + weight sync). TRL: a callback marks the end of every
``steps_per_generation``-th optimizer step; a rollout batch is the interval between two marks (generation,
reward, old log-probs, 4 optimizer steps, TRL's logging). Tokens per batch are prompt + completion tokens (EOS
included, padding excluded): our ``perf/tokens_per_s * time/step_s``, TRL's ``state.num_input_tokens_seen``
delta. We print the median step time (the headline ratio), the best one (the least disturbed on a shared
machine) and tokens/s = tokens / time summed over the measured steps. Ray starts worker processes at niceness
15 while TRL runs at the caller's; the benchmark sets ``RAY_worker_niceness=0`` (unless already set) so both
sides compete for a shared CPU at the same priority.

How this differs from TRL's own benchmarks: TRL reports per-optimizer-step times from its logs; a GSPO step
(the unit the paper's 4-minibatch split is defined on) spans 4 of them, so we time whole rollout batches.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # runnable as `python benchmarks/e2e_vs_trl.py` from anywhere
    sys.path.insert(0, str(REPO))

from gspo_ascend.errors import UserError  # noqa: E402

MINIBATCHES = 4  # the GSPO paper's optimizer steps per rollout batch
RATIO_LINE = "step-time ratio ours/TRL"  # the smoke test parses this line
NOT_MATCHED = (
    "max_prompt_length: TRL 1.16 has no prompt truncation; ours filters longer prompts ({filtered} filtered)",
    "prompt order and sampling RNG: each side's own seeded sampler, so responses (and their lengths) differ",
    "padding: TRL right-pads prompt+completion for the loss passes; ours packs them (padding-free)",
    "processes: TRL trains in this process; ours drives one Ray worker process holding both engines",
)


@dataclass
class SideResult:
    name: str
    step_s: list[float] = field(default_factory=list)  # wall time of every rollout batch, warm-up included
    tokens: list[float] = field(default_factory=list)  # prompt + completion tokens of every rollout batch
    reward_mean: list[float] = field(default_factory=list)
    response_length_mean: list[float] = field(default_factory=list)
    prompt_length_mean: float = float("nan")
    stages_s: dict[str, float] = field(default_factory=dict)  # mean seconds per stage over the measured steps

    @property
    def steps(self) -> int:
        return len(self.step_s)

    def median_step_s(self) -> float:
        return statistics.median(self.step_s[1:])  # the first step is warm-up

    def best_step_s(self) -> float:
        return min(self.step_s[1:])  # the least disturbed step, on a shared machine

    def tokens_per_s(self) -> float:
        return sum(self.tokens[1:]) / sum(self.step_s[1:])

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "steps": self.steps,
            "step_s": self.step_s,
            "tokens": self.tokens,
            "reward_mean": self.reward_mean,
            "response_length_mean": self.response_length_mean,
            "prompt_length_mean": self.prompt_length_mean,
            "stages_s": self.stages_s,
            "median_step_s": self.median_step_s(),
            "best_step_s": self.best_step_s(),
            "tokens_per_s": self.tokens_per_s(),
        }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8, help="rollout batches per side (the first is warm-up)")
    p.add_argument("--batch", type=int, default=16, help="prompts per rollout batch (a multiple of 4)")
    p.add_argument("--n", type=int, default=8, help="samples per prompt (>= 2)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="max response tokens")
    p.add_argument("--lr", type=float, default=1e-4, help="learning rate (the tiny model's, see tiny_gspo.yaml)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | auto (npu: TRL's side is not set up for it)")
    p.add_argument("--sequential", action="store_true", help="run train(cfg) to the end, then TRL (no turns)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra override of our config")
    p.add_argument("--json", type=Path, default=None, help="write both sides' per-step numbers here")
    args = p.parse_args(argv)
    if args.steps < 2:
        raise UserError(f"--steps must be >= 2 (the first step is warm-up and not measured), got {args.steps}")
    if args.batch <= 0 or args.batch % MINIBATCHES:
        raise UserError(f"--batch must be a positive multiple of {MINIBATCHES} (minibatches), got {args.batch}")
    if args.n < 2:
        raise UserError(f"--n must be >= 2 (group-normalised advantages need a group), got {args.n}")
    if args.max_new_tokens <= 0:
        raise UserError(f"--max-new-tokens must be > 0, got {args.max_new_tokens}")
    return args


def our_config(args: argparse.Namespace, output_dir: str):
    from gspo_ascend.config import load_config

    overrides = {
        "model.path": "",  # the embedded tiny model
        "model.dtype": "float32",
        "data.train_files": [],  # the synthetic arithmetic task
        "data.train_batch_size": args.batch,
        "data.max_prompt_length": 64,
        "data.max_response_length": args.max_new_tokens,
        "rollout.engine": "hf",
        "rollout.n": args.n,
        "rollout.temperature": 1.0,
        "rollout.top_p": 1.0,
        "rollout.top_k": -1,
        "actor.engine": "fsdp",
        "actor.lr": args.lr,
        "actor.warmup_steps": 0,
        "actor.micro_batch_size": args.batch * args.n // MINIBATCHES,
        "algorithm.loss": "gspo",
        "algorithm.clip_ratio_low": 3e-4,
        "algorithm.clip_ratio_high": 4e-4,
        "algorithm.loss_agg_mode": "seq-mean-token-mean",
        "algorithm.minibatches_per_rollout": MINIBATCHES,
        "algorithm.old_logprobs": "recompute",
        "algorithm.kl_coef": 0.0,
        "trainer.device": args.device,
        "trainer.total_steps": args.steps,
        "trainer.save_freq": 0,
        "trainer.resume": "never",
        "trainer.output_dir": output_dir,
        "trainer.loggers": ["jsonl"],
        "trainer.seed": 0,
    }
    return load_config(None, [f"{k}={json.dumps(v)}" for k, v in overrides.items()] + list(args.set))


# ----------------------------------------------------------------------------------------------- our side


def _same_priority_as_trl() -> None:
    # Ray starts its worker processes at niceness 15 (RayConfig worker_niceness); TRL trains in this process at
    # the caller's priority. On a shared machine that alone makes our worker lose the CPU to every other
    # process, so the worker gets the same priority as TRL (unless the caller set it). No effect on an idle box.
    os.environ.setdefault("RAY_worker_niceness", "0")


def _shutdown_ray() -> None:
    try:
        import ray
    except ImportError:
        return
    if ray.is_initialized():
        ray.shutdown()  # the Ray processes our trainer started must not outlive its run


def ours_result(history: list[dict[str, float]]) -> SideResult:
    out = SideResult("ours")
    for m in history:
        out.step_s.append(m["time/step_s"])
        out.tokens.append(m["perf/tokens_per_s"] * m["time/step_s"])
        out.reward_mean.append(m["reward/mean"])
        out.response_length_mean.append(m["response/length_mean"])
    out.prompt_length_mean = statistics.fmean(m["prompt/length_mean"] for m in history)
    stages = [k for k in history[0] if k.startswith("time/") and k != "time/step_s"]
    out.stages_s = {k[5:-2]: statistics.fmean(m[k] for m in history[1:]) for k in stages}
    return out


def run_ours_sequential(cfg) -> SideResult:
    from gspo_ascend.trainer import train

    _same_priority_as_trl()
    try:
        history = train(cfg)
    finally:
        _shutdown_ray()
    return ours_result(history)


class OurTurns:
    """Our trainer set up once, then driven one step per call, with the driver's own stage functions.

    The loop of ``gspo_ascend.trainer.train`` minus its final checkpoint and HF export (not timed anyway).
    """

    def __init__(self, cfg) -> None:
        from gspo_ascend import trainer

        _same_priority_as_trl()
        self.trainer, self.history = trainer, []
        self.run = trainer.prepare(cfg)
        try:
            trainer.start(self.run)
        except BaseException:
            self.close()
            raise

    def __call__(self) -> None:
        self.history.append(self.trainer.train_step(self.run, self.run.start_step + len(self.history) + 1))

    def close(self) -> None:
        try:
            self.trainer.stop(self.run)
        finally:
            _shutdown_ray()


# ----------------------------------------------------------------------------------------------- TRL side


def trl_reward_function(cfg):
    """Our reward (math-verify on the last \\boxed{}, plus the configured overlong penalty) in TRL's signature."""
    from gspo_ascend.rewards import compute_rewards

    rc = cfg.reward

    def gspo_math_reward(prompts, completions, completion_ids, ground_truth, data_source, **kwargs):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        rewards, _metrics = compute_rewards(
            texts,
            ground_truth,
            data_source,
            reward_fn=rc.reward_fn,
            response_lengths=[len(ids) for ids in completion_ids],
            max_response_length=cfg.data.max_response_length,
            overlong_buffer_length=rc.overlong_buffer_length,
            overlong_penalty_factor=rc.overlong_penalty_factor,
            timeout_s=rc.timeout_s,
            num_workers=rc.num_workers,
        )
        return rewards.tolist()

    return gspo_math_reward


def trl_dataset(records):
    from datasets import Dataset

    return Dataset.from_list(
        [{"prompt": r.messages, "ground_truth": r.ground_truth, "data_source": r.data_source} for r in records]
    )


def rollout_clock(steps_per_rollout: int, between: Callable[[], None] | None = None):
    """A TrainerCallback timing TRL's rollout batches (with their token counts) and keeping TRL's logs.

    At the end of each rollout batch it closes the batch's interval, then runs ``between`` (one step of our
    trainer, in turns mode), then opens the next interval: ``between`` is never inside TRL's time.
    """
    from transformers import TrainerCallback

    class RolloutClock(TrainerCallback):
        def __init__(self) -> None:
            self.intervals: list[tuple[float, float]] = []  # (seconds, tokens) per rollout batch
            self.logs: list[dict] = []
            self._t0, self._k0 = 0.0, 0.0

        def _open(self, state) -> None:
            self._t0, self._k0 = time.perf_counter(), float(state.num_input_tokens_seen or 0)

        def on_train_begin(self, args, state, control, **kwargs):
            self._open(state)

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % steps_per_rollout:
                return
            now, tokens = time.perf_counter(), float(state.num_input_tokens_seen or 0)
            self.intervals.append((now - self._t0, tokens - self._k0))
            if between is not None:
                between()
            self._open(state)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                self.logs.append(dict(logs))

    return RolloutClock()


def trl_config(cfg, args: argparse.Namespace, output_dir: str, use_cpu: bool):
    from trl import GRPOConfig  # imported (with its warnings filtered) by trl_trainer first

    a, r = cfg.actor, cfg.rollout
    return GRPOConfig(
        output_dir=output_dir,
        importance_sampling_level="sequence",
        loss_type="grpo",
        epsilon=cfg.algorithm.clip_ratio_low,
        epsilon_high=cfg.algorithm.clip_ratio_high,
        beta=cfg.algorithm.kl_coef,
        scale_rewards="group" if cfg.algorithm.norm_adv_by_std else "none",
        num_generations=r.n,
        per_device_train_batch_size=args.batch * args.n // MINIBATCHES,
        gradient_accumulation_steps=1,
        steps_per_generation=MINIBATCHES,
        num_iterations=1,
        max_completion_length=cfg.data.max_response_length,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=0 if r.top_k < 0 else r.top_k,
        learning_rate=a.lr,
        lr_scheduler_type="constant",
        warmup_steps=a.warmup_steps,
        weight_decay=a.weight_decay,
        max_grad_norm=a.grad_clip,
        max_steps=args.steps * MINIBATCHES,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        use_cpu=use_cpu,
        seed=cfg.trainer.seed,
        logging_steps=MINIBATCHES,  # one log per rollout batch (its reward and lengths)
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )


def trl_trainer(cfg, args: argparse.Namespace, records, model_path: str, output_dir: str, clock):
    """TRL's GRPOTrainer, set up (model loaded) but not started."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback

    with warnings.catch_warnings():  # TRL warns at import that it was not tested with our vLLM; it is not used here
        warnings.filterwarnings("ignore", message="TRL currently supports vLLM")
        from trl import GRPOTrainer

    from gspo_ascend.device import get_backend

    torch.manual_seed(cfg.trainer.seed)
    use_cpu = get_backend(cfg.trainer.device).name == "cpu"
    model = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=torch.float32, attn_implementation=cfg.model.attn_implementation
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[trl_reward_function(cfg)],
        args=trl_config(cfg, args, output_dir, use_cpu),
        train_dataset=trl_dataset(records),
        processing_class=AutoTokenizer.from_pretrained(model_path),
        callbacks=[clock],
    )
    trainer.remove_callback(PrinterCallback)  # it prints every log dict; the table below is the output
    return trainer


def trl_result(clock, samples_per_batch: int) -> SideResult:
    out = SideResult("trl")
    out.step_s = [seconds for seconds, _ in clock.intervals]
    out.tokens = [tokens for _, tokens in clock.intervals]
    out.reward_mean = [float(log["reward"]) for log in clock.logs]
    out.response_length_mean = [float(log["completions/mean_length"]) for log in clock.logs]
    prompt_means = [
        tok / samples_per_batch - resp for tok, resp in zip(out.tokens, out.response_length_mean, strict=True)
    ]
    out.prompt_length_mean = statistics.fmean(prompt_means) if prompt_means else float("nan")
    return out


# ----------------------------------------------------------------------------------------------- the run


def run_both(cfg, args: argparse.Namespace, records, model_path: str, tmp: Path) -> tuple[SideResult, SideResult]:
    samples = args.batch * args.n
    if args.sequential:
        t0 = time.perf_counter()
        ours = run_ours_sequential(cfg)
        print(f"ours: {ours.steps} steps in {time.perf_counter() - t0:.1f} s (setup included)", flush=True)
        clock = rollout_clock(MINIBATCHES)
        trl_trainer(cfg, args, records, model_path, str(tmp / "trl"), clock).train()
        return ours, trl_result(clock, samples)
    turns = OurTurns(cfg)
    try:
        clock = rollout_clock(MINIBATCHES, between=turns)
        trl_trainer(cfg, args, records, model_path, str(tmp / "trl"), clock).train()
    finally:
        turns.close()
    return ours_result(turns.history), trl_result(clock, samples)


def report(ours: SideResult, trl: SideResult, args: argparse.Namespace, filtered: int) -> dict:
    ratio = ours.median_step_s() / trl.median_step_s()
    best_ratio = ours.best_step_s() / trl.best_step_s()
    tps_ratio = ours.tokens_per_s() / trl.tokens_per_s()
    paired = None
    if not args.sequential and ours.steps == trl.steps:  # in turns, step i of each side ran back to back
        paired = statistics.median(a / b for a, b in zip(ours.step_s[1:], trl.step_s[1:], strict=True))
    rows = [
        ("step time, median (s)", f"{ours.median_step_s():.3f}", f"{trl.median_step_s():.3f}", f"{ratio:.3f}x"),
        ("step time, best (s)", f"{ours.best_step_s():.3f}", f"{trl.best_step_s():.3f}", f"{best_ratio:.3f}x"),
        (
            "tokens/s (prompt+completion)",
            f"{ours.tokens_per_s():.1f}",
            f"{trl.tokens_per_s():.1f}",
            f"{tps_ratio:.3f}x",
        ),
        ("prompt tokens/sample", f"{ours.prompt_length_mean:.1f}", f"{trl.prompt_length_mean:.1f}", ""),
        ("response tokens/sample", _mean(ours.response_length_mean), _mean(trl.response_length_mean), ""),
        ("reward mean (all steps)", _mean(ours.reward_mean, 3), _mean(trl.reward_mean, 3), ""),
        ("steps run (measured)", f"{ours.steps} ({ours.steps - 1})", f"{trl.steps} ({trl.steps - 1})", ""),
    ]
    order = "one after the other" if args.sequential else "in turns, one rollout batch each"
    print(
        f"\nGSPO end-to-end, {args.batch} prompts x n={args.n}, {args.max_new_tokens} new tokens, "
        f"{MINIBATCHES} minibatches/rollout batch, device {args.device}, {order}, first step excluded"
    )
    print(f"{'':30} {'ours':>12} {'TRL':>12} {'ours/TRL':>10}")
    for label, a, b, c in rows:
        print(f"{label:30} {a:>12} {b:>12} {c:>10}")
    if paired is not None:
        print(f"median of the per-turn ratios ours/TRL (adjacent steps, same load): {paired:.3f}x")
    print("ours, mean s per stage: " + ", ".join(f"{k} {v:.3f}" for k, v in ours.stages_s.items()))
    print(f"{RATIO_LINE}: {ratio:.4f} (goal <= 0.5: {'met' if ratio <= 0.5 else 'not met'})")
    print("not matched between the two sides:")
    for line in NOT_MATCHED:
        print("  - " + line.format(filtered=filtered))
    return {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "ours": ours.to_dict(),
        "trl": trl.to_dict(),
        "step_time_ratio": ratio,
        "best_step_time_ratio": best_ratio,
        "paired_step_time_ratio": paired,
        "tokens_per_s_ratio": tps_ratio,
        "not_matched": [line.format(filtered=filtered) for line in NOT_MATCHED],
    }


def _mean(values: list[float], digits: int = 1) -> str:
    return f"{statistics.fmean(values):.{digits}f}" if values else "n/a"


def main(argv: list[str] | None = None) -> int:
    from gspo_ascend.data import load_prompts
    from gspo_ascend.runtime import load_tokenizer, resolve_model_path, resolve_train_files

    try:
        args = parse_args(argv)
        with tempfile.TemporaryDirectory(prefix="gspo-bench-") as tmp:
            cfg = our_config(args, str(Path(tmp) / "ours"))
            model_path = resolve_model_path(cfg)
            d = cfg.data
            tokenizer = load_tokenizer(cfg, model_path)
            files = resolve_train_files(cfg)
            records = load_prompts(
                files, d.prompt_key, tokenizer, d.max_prompt_length, d.overlong_prompts, answer_key=d.answer_key
            )
            ours, trl = run_both(cfg, args, records.records, model_path, Path(tmp))
    except UserError as exc:  # ConfigError is one too: a bad --set names its key
        print(f"error: {exc}", file=sys.stderr)
        return 2
    result = report(ours, trl, args, records.num_filtered)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2, allow_nan=True))
    return 0 if math.isfinite(result["step_time_ratio"]) else 1


if __name__ == "__main__":
    sys.exit(main())
