"""End-to-end GSPO step time: our trainer vs TRL's GRPOTrainer, same model, prompts, batch and lengths.

    PYTHONPATH=. python benchmarks/e2e_vs_trl.py [--shape tiny|realistic] [--sides ours-vllm,ours-hf,trl-hf,...]
                         [--steps N] [--batch 16] [--n 8] [--max-new-tokens N] [--model tiny|small]
                         [--sequential | --no-pause] [--set actor.use_remove_padding=false ...] [--json PATH]

Shapes (``--shape``; ``--model``, ``--max-new-tokens``, ``--steps`` and ``--sides`` override them):

    tiny       the embedded tiny Qwen3 (0.4M), 32 new tokens, 8 steps, ours-hf vs trl-hf
    realistic  ``make-tiny-model --size small`` (22M, GQA 8/4, warmed to check its answer a geometric number of
               times: responses from ~20 tokens to past 512, long right tail), 512 new tokens, 5 steps,
               ours-vllm, ours-hf, trl-hf and trl-vllm

Sides (benchmarks/e2e_sides.py): ``ours-vllm`` (vLLM rollout, packed fsdp with per-sequence attention, old
log-probs from vLLM: ``algorithm.old_logprobs=engine``), ``ours-vllm-recompute``, ``ours-hf`` (HF generate
rollout, old log-probs recomputed), ``trl-hf`` (GRPOTrainer, HF generate) and ``trl-vllm`` (GRPOTrainer,
``use_vllm=True, vllm_mode="colocate"``), ``ours-vllm-noonednn`` (ours-vllm with vLLM's oneDNN linears off, the
handicap verl's side carries), and verl 0.9.1's own trainer: ``verl`` (its default, old log-probs recomputed) and
``verl-bypass`` (vLLM's log-probs as pi_old), from a venv of their own (benchmarks/verl_side/README.md). Every side
is a process of its own; by default they take turns, one rollout batch each, so on a shared machine all sides see
the same background load. With a verl side, every side of ours also reports held-out accuracy (mean@4) on the 39 test
prompts before the first and after the last step (outside the step times), as verl's does.

All sides use the synthetic arithmetic prompts (the parquet of ``resolve_train_files``, loaded and chat-templated by
our loader), the same reward: our math-verify scorer (:func:`gspo_ascend.rewards.compute_rewards`) wrapped as a TRL
reward function. One "step" is one rollout batch: ``--batch`` prompts x ``--n`` samples -> rewards -> advantages
-> old log-probs -> 4 minibatch optimizer steps (the GSPO paper's split).

How the TRL side is configured (TRL's documented GSPO recipe, ``trl`` 1.16):

    ours                                      TRL GRPOConfig
    algorithm.loss=gspo                       importance_sampling_level="sequence"
    loss_agg_mode=seq-mean-token-mean         loss_type="grpo" (per-sequence token mean, then batch mean)
    clip_ratio_low/high = 3e-4 / 4e-4         epsilon=3e-4, epsilon_high=4e-4
    kl_coef=0                                 beta=0 (no reference model)
    minibatches_per_rollout=4                 steps_per_generation=4, gradient_accumulation_steps=1,
                                              per_device_train_batch_size = batch*n/4, num_iterations=1
    actor.micro_batch_size = batch*n/4        (one forward/backward per optimizer step on both sides)
    old_logprobs=recompute (ours-hf)          TRL recomputes them (steps_per_generation > grad. accumulation)
    old_logprobs=engine (ours-vllm)           TRL still recomputes; vllm_importance_sampling_correction=False
    rollout.n, temperature, top_p, top_k=-1   num_generations, temperature, top_p, top_k=0
    data.max_response_length                  max_completion_length
    actor.lr, weight_decay, grad_clip,        learning_rate, weight_decay, max_grad_norm,
      constant lr (no warm-up)                  lr_scheduler_type="constant"; both torch AdamW, default betas
    model.dtype float32, no grad. ckpt.       bf16=False, fp16=False, gradient_checkpointing=False
    trainer.device=cpu                        use_cpu=True; report_to="none"; save_strategy="no"

Not matched (printed with the results): TRL 1.16 has no ``max_prompt_length`` (prompts are never truncated;
here none exceeds ours, checked: our loader reports how many it filtered); the prompt order (each side's own
seeded sampler) and the sampling RNG differ, so the sides generate different responses of different lengths,
which is why tokens/s is reported next to the step time; TRL pads, we pack (``use_remove_padding``).

Timing: wall time per rollout batch, excluding one-time setup (model load, Ray and vLLM start) and the first
step (warm-up). Ours: the trainer's own ``time/step_s`` (rollout + reward + old log-probs + update + weight
sync; minus the recompute probe of ``ours-vllm``, see e2e_sides.py). TRL: a callback marks the end of every
``steps_per_generation``-th optimizer step; a rollout batch is the interval between two marks. Tokens per batch
are prompt + completion tokens (EOS included, padding excluded). We print the median step time (the headline
ratio: our first side against the fastest TRL side that ran), the best one (the least disturbed on a shared
machine), tokens/s, per-stage means, the padded-token share of the training passes, peak RSS and, in turns, the
median of per-turn ratios and the cores the waiting sides' processes kept busy during each side's steps (their CPU
seconds over the step time: what a side in its turn competed with). In turns the waiting sides are stopped
(SIGSTOP, continued after the step) so that figure is 0: idle, verl's side kept 0.2 of a core of the 2 busy
through ours, ours 0.05 through verl's; ``--no-pause`` leaves them running, as the runs before the flag did.
vLLM on CPU reserves one core for its scheduler by default; on this benchmark's 2-core box that halves its
threads, so both vLLM sides run with ``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` (the trainer is idle during rollout).

How this differs from TRL's own benchmarks: TRL reports per-optimizer-step times from its logs; a GSPO step
(the unit the paper's 4-minibatch split is defined on) spans 4 of them, so we time whole rollout batches.

Why one file over 600 lines: our configuration and TRL's are built here side by side, as the table above pairs
them, with the arguments and the report that name both; the turns are benchmarks/e2e_turns.py, the sides'
processes benchmarks/e2e_sides.py, verl's side benchmarks/verl_side/.
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
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for _path in (REPO, REPO / "benchmarks"):  # runnable as `python benchmarks/e2e_vs_trl.py` from anywhere
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from e2e_sides import MINIBATCHES, SIDES, Side, side_worker  # noqa: E402
from e2e_turns import SideResult, run_sides  # noqa: E402
from verl_side.side import HELDOUT_N, VERL_NOT_MATCHED, verl_ratios  # noqa: E402

from gspo_ascend.errors import UserError  # noqa: E402

RATIO_LINE = "step-time ratio ours/TRL"  # the smoke test parses this line
SHAPES = {
    "tiny": {"model": "tiny", "max_new_tokens": 32, "steps": 8, "sides": "ours-hf,trl-hf"},
    "realistic": {
        "model": "small",
        "max_new_tokens": 512,
        "steps": 5,
        "sides": "ours-vllm,ours-hf,trl-hf,trl-vllm",
    },
}
NOT_MATCHED = (
    "max_prompt_length: TRL 1.16 has no prompt truncation; ours filters longer prompts ({filtered} filtered)",
    "prompt order and sampling RNG: each side's own seeded sampler, so responses (and their lengths) differ",
    "padding: TRL right-pads prompt+completion for the loss passes; ours packs them (padding-free)",
    "processes: TRL trains in its process; ours drives one Ray worker process holding both engines",
    "old log-probs: ours-vllm takes the rollout engine's (old_logprobs=engine); ours-hf and TRL recompute them",
    "trl-vllm-reload is TRL with its colocated weight sync swapped for vLLM's layerwise reload (e2e_sides.py)",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny", help="preset of model, length, steps, sides")
    p.add_argument("--sides", default=None, help=f"comma-separated, of: {', '.join(SIDES)} (default: the shape's)")
    model = p.add_mutually_exclusive_group()
    model.add_argument(
        "--model", choices=("tiny", "small"), default=None, help="make-tiny-model size (default: shape's)"
    )
    model.add_argument("--model-dir", type=Path, default=None, help="a built make-tiny-model directory instead")
    p.add_argument("--steps", type=int, default=None, help="rollout batches per side, the first is warm-up")
    p.add_argument("--batch", type=int, default=16, help="prompts per rollout batch (a multiple of 4)")
    p.add_argument("--n", type=int, default=8, help="samples per prompt (>= 2)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="max response tokens (default: the shape's)")
    p.add_argument("--lr", type=float, default=1e-4, help="learning rate (the tiny model's, see tiny_gspo.yaml)")
    p.add_argument("--device", default="cpu", help="cpu | cuda | auto (npu: TRL's side is not set up for it)")
    order = p.add_mutually_exclusive_group()
    order.add_argument("--sequential", action="store_true", help="each side runs all its steps before the next starts")
    order.add_argument(
        "--no-pause", action="store_true", help="in turns, leave the waiting sides running (not stopped)"
    )
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra override of our config")
    p.add_argument("--json", type=Path, default=None, help="write every side's per-step numbers here")
    p.add_argument("--side-worker", default=None, help=argparse.SUPPRESS)  # internal: run one side (e2e_sides.py)
    p.add_argument("--work-dir", default=None, help=argparse.SUPPRESS)  # internal: the orchestrator's temp dir
    args = p.parse_args(argv)
    shape = SHAPES[args.shape]
    args.model = args.model or shape["model"]
    args.steps = shape["steps"] if args.steps is None else args.steps
    args.max_new_tokens = shape["max_new_tokens"] if args.max_new_tokens is None else args.max_new_tokens
    args.sides = [s.strip() for s in (args.sides or shape["sides"]).split(",") if s.strip()]
    if args.steps < 2:
        raise UserError(f"--steps must be >= 2 (the first step is warm-up and not measured), got {args.steps}")
    if args.batch <= 0 or args.batch % MINIBATCHES:
        raise UserError(f"--batch must be a positive multiple of {MINIBATCHES} (minibatches), got {args.batch}")
    if args.n < 2:
        raise UserError(f"--n must be >= 2 (group-normalised advantages need a group), got {args.n}")
    if args.max_new_tokens <= 0:
        raise UserError(f"--max-new-tokens must be > 0, got {args.max_new_tokens}")
    unknown = [s for s in args.sides if s not in SIDES]
    if unknown or not args.sides:
        raise UserError(f"--sides: unknown side(s) {', '.join(unknown) or '(none given)'}; valid: {', '.join(SIDES)}")
    if not any(SIDES[s].trainer == "ours" for s in args.sides):
        raise UserError("--sides needs at least one of our sides (ours-*); without a TRL side no ratio to TRL")
    return args


def model_and_data(args: argparse.Namespace) -> tuple[str, list[str]]:
    """The model directory (built first if missing) and the synthetic task's train parquet."""
    from gspo_ascend.runtime import embedded_data_dir
    from gspo_ascend.tiny import ensure_tiny_model

    data = [str(embedded_data_dir() / "train.parquet")]
    if args.model_dir is not None:  # e.g. one built on the GPU (make-tiny-model --device): used as it is
        if not (args.model_dir / "config.json").is_file():
            raise UserError(f"--model-dir {args.model_dir}: no config.json there; build it with make-tiny-model")
        return str(args.model_dir), data
    return str(ensure_tiny_model(size=args.model)), data


def our_config(args: argparse.Namespace, output_dir: str, side: Side | None = None, model: str = "", data=()):
    """Our config for ``side`` (default: the first of ours in ``args.sides``); ``model`` "" = the tiny model."""
    from gspo_ascend.config import load_config

    side = side or next(SIDES[s] for s in args.sides if SIDES[s].trainer == "ours")
    overrides = {
        "model.path": model,
        "model.dtype": "float32",
        "data.train_files": list(data),  # empty: the synthetic arithmetic task
        "data.train_batch_size": args.batch,
        "data.max_prompt_length": 64,
        "data.max_response_length": args.max_new_tokens,
        "rollout.engine": side.rollout if side.trainer == "ours" else "hf",
        "rollout.n": args.n,
        "rollout.temperature": 1.0,
        "rollout.top_p": 1.0,
        "rollout.top_k": -1,
        "rollout.enforce_eager": True,  # docs/rollout-vllm.md: inductor graphs gain nothing on CPU at this size
        "actor.engine": "fsdp",
        "actor.lr": args.lr,
        "actor.warmup_steps": 0,
        "actor.micro_batch_size": args.batch * args.n // MINIBATCHES,
        "algorithm.loss": "gspo",
        "algorithm.clip_ratio_low": 3e-4,
        "algorithm.clip_ratio_high": 4e-4,
        "algorithm.loss_agg_mode": "seq-mean-token-mean",
        "algorithm.minibatches_per_rollout": MINIBATCHES,
        "algorithm.old_logprobs": side.old_logprobs if side.trainer == "ours" else "recompute",
        "algorithm.kl_coef": 0.0,
        "trainer.device": args.device,
        "trainer.total_steps": args.steps,
        "trainer.save_freq": 0,
        "trainer.test_freq": 0,
        "trainer.resume": "never",
        "trainer.output_dir": output_dir,
        "trainer.loggers": ["jsonl"],
        "trainer.seed": 0,
    }
    if any(SIDES[s].trainer == "verl" for s in args.sides):  # held-out accuracy before and after, as verl's side
        overrides |= {
            "data.val_files": [heldout_file()],
            "trainer.test_freq": args.steps,
            "trainer.val_before_train": True,
            "validation.greedy": False,  # sampled as in training, n per prompt as verl's side (verl_side/side.py)
            "validation.n": HELDOUT_N,
        }
    if side.partial:  # the steady state from the second step: one round of at most half the length per step
        overrides["partial_rollout.round_tokens"] = max(1, args.max_new_tokens // 2)
    return load_config(None, [f"{k}={json.dumps(v)}" for k, v in overrides.items()] + list(args.set))


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

    At the end of each rollout batch it closes the batch's interval, then runs ``between`` (the turn protocol:
    report, then wait for the orchestrator), then opens the next interval: ``between`` is never inside TRL's time.
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


def trl_config(cfg, args: argparse.Namespace, output_dir: str, use_cpu: bool, side: Side | None = None):
    from trl import GRPOConfig  # imported (with its warnings filtered) by trl_trainer first

    a, r = cfg.actor, cfg.rollout
    vllm = {}
    if side is not None and side.rollout == "vllm":
        vllm = dict(
            use_vllm=True,
            vllm_mode="colocate",
            vllm_max_model_length=cfg.data.max_prompt_length + cfg.data.max_response_length,
            vllm_enable_sleep_mode=False,  # the CPU build has no sleep mode
            vllm_importance_sampling_correction=False,  # the same loss as the HF side and ours
        )
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
        **vllm,
    )


def trl_trainer(cfg, args, records, model_path: str, output_dir: str, clock, side=None, trainer_cls=None):
    """TRL's GRPOTrainer (or ``trainer_cls``, a subclass), set up (model loaded) but not started."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback

    with warnings.catch_warnings():  # TRL warns at import that it was not tested with our vLLM
        warnings.filterwarnings("ignore", message="TRL currently supports vLLM")
        from trl import GRPOTrainer

    from gspo_ascend.device import get_backend

    torch.manual_seed(cfg.trainer.seed)
    use_cpu = get_backend(cfg.trainer.device).name == "cpu"
    model = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=torch.float32, attn_implementation=cfg.model.attn_implementation
    )
    trainer = (trainer_cls or GRPOTrainer)(
        model=model,
        reward_funcs=[trl_reward_function(cfg)],
        args=trl_config(cfg, args, output_dir, use_cpu, side),
        train_dataset=trl_dataset(records),
        processing_class=AutoTokenizer.from_pretrained(model_path),
        callbacks=[clock],
    )
    trainer.remove_callback(PrinterCallback)  # it prints every log dict; the table below is the output
    return trainer


# ----------------------------------------------------------------------------------------------- the side processes


def prompts_of(cfg, model: str, data):
    """The prompts as our trainer loads them (chat template, length filter): what every side is given."""
    from gspo_ascend.data import load_prompts
    from gspo_ascend.runtime import load_tokenizer

    d = cfg.data
    tokenizer = load_tokenizer(cfg, model)
    return load_prompts(data, d.prompt_key, tokenizer, d.max_prompt_length, d.overlong_prompts, answer_key=d.answer_key)


def side_setup(args: argparse.Namespace):
    """In a side process: ``build(side)`` for :func:`e2e_sides.side_worker`."""
    model, data = model_and_data(args)
    work = Path(args.work_dir)

    def build(side: Side):
        if side.trainer == "verl":
            return verl_spec(args, model, data), work
        cfg = our_config(args, str(work / side.name), side, model, data)
        if side.trainer == "ours":
            return cfg, None
        records = prompts_of(cfg, model, data).records

        def make(between, trainer_cls):
            clock = rollout_clock(MINIBATCHES, between=between)
            return trl_trainer(cfg, args, records, model, str(work / side.name), clock, side, trainer_cls), clock

        return cfg, make

    return build


def verl_spec(args: argparse.Namespace, model: str, data: list[str]):
    """The shape of our config for the verl side (benchmarks/verl_side/side.py)."""
    from verl_side.side import VerlSpec

    val = (heldout_file(),)
    return VerlSpec(model, tuple(data), val, args.batch, args.n, args.max_new_tokens, args.lr, args.steps, MINIBATCHES)


def heldout_file() -> str:
    """The synthetic task's 39 held-out prompts, on which every side reports accuracy when a verl side runs."""
    from gspo_ascend.runtime import embedded_data_dir

    return str(embedded_data_dir() / "test.parquet")


WORLD_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def side_env(side: Side, cfg, model: str) -> dict[str, str]:
    # the checkout after what the caller put on the path (the GPU proof's site of carried packages), not instead
    onednn_off = None if side.onednn else str(REPO / "benchmarks" / "verl_side" / "onednn_off")
    path = os.pathsep.join(filter(None, [onednn_off, os.environ.get("PYTHONPATH"), str(REPO)]))
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONPATH=path)
    # each side is a world of its own: a torch.distributed world around the benchmark (a torchrun shell, a test
    # session that built an in-process engine) would make accelerate join it ("MASTER_ADDR expected")
    for key in WORLD_ENV:
        env.pop(key, None)
    if side.rollout == "vllm":
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")  # see the module docstring
    if side.trainer == "trl" and side.rollout == "vllm":
        from gspo_ascend.engines.vllm_rollout import kv_cache_gib

        hf_config = json.loads((Path(model) / "config.json").read_text())
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # colocate = vLLM's external launcher, in-process
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib(cfg, hf_config)))  # what ours gets
    return env


# ----------------------------------------------------------------------------------------------- the report

STAGES = ("generate", "reward", "old_log_prob", "update", "sync")


def headline(results: list[SideResult]) -> tuple[SideResult | None, SideResult | None]:
    """(our first side that ran, the fastest unmodified TRL side that ran), by median step time."""
    ours = next((r for r in results if SIDES[r.name].trainer == "ours" and r.ok), None)
    trls = [r for r in results if SIDES[r.name].trainer == "trl" and not SIDES[r.name].patched and r.ok]
    return ours, min(trls, key=SideResult.median_step_s, default=None)


def _cells(results: list[SideResult], fn, fmt: str = "{:.3f}") -> list[str]:
    out = []
    for r in results:
        try:
            value = fn(r)
        except (KeyError, ValueError, ZeroDivisionError, statistics.StatisticsError):
            value = math.nan
        out.append("n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else fmt.format(value))
    return out


def table_rows(results: list[SideResult], trl_best: SideResult | None) -> list[tuple[str, list[str]]]:
    base = trl_best.median_step_s() if trl_best else math.nan
    rows = [
        ("step time, median (s)", _cells(results, SideResult.median_step_s)),
        ("step time, best (s)", _cells(results, SideResult.best_step_s)),
        (
            f"ratio to {trl_best.name if trl_best else 'TRL'} (median)",
            _cells(results, lambda r: r.median_step_s() / base, "{:.3f}x"),
        ),
        ("tokens/s (prompt+completion)", _cells(results, SideResult.tokens_per_s, "{:.1f}")),
    ]
    rows += [(f"  {stage} (s)", _cells(results, lambda r, s=stage: r.stages_s[s])) for stage in STAGES]
    rows += [
        ("padded share, training passes", _cells(results, SideResult.padded_share, "{:.1%}")),
        ("tokens computed / held, training passes", _cells(results, SideResult.computed_per_real, "{:.2f}")),
        ("peak RSS (MiB)", _cells(results, lambda r: r.peak_rss_mib, "{:.0f}")),
        ("other sides' CPU during the step (cores)", _cells(results, SideResult.others_cores, "{:.2f}")),
        ("response tokens, mean", _cells(results, lambda r: statistics.fmean(r.response_length_mean), "{:.1f}")),
        ("prompt tokens, mean", _cells(results, lambda r: r.prompt_length_mean, "{:.1f}")),
        ("reward mean", _cells(results, lambda r: statistics.fmean(r.reward_mean))),
        ("held-out accuracy, before", _cells(results, lambda r: r.extra["heldout_before"])),
        ("held-out accuracy, after", _cells(results, lambda r: r.extra["heldout_after"])),
        ("steps run (measured)", [f"{r.steps} ({max(r.steps - 1, 0)})" for r in results]),
    ]
    return rows


def report(results: list[SideResult], args: argparse.Namespace, filtered: int, load: tuple) -> dict:
    ours, trl = headline(results)
    ratio = ours.median_step_s() / trl.median_step_s() if ours and trl else math.nan
    paired = None
    if ours and trl and not args.sequential and ours.steps == trl.steps:  # step i of each side ran back to back
        paired = statistics.median(a / b for a, b in zip(ours.step_s[1:], trl.step_s[1:], strict=True))
    order = "one side after the other" if args.sequential else "in turns, one rollout batch per side"
    order += ", the waiting sides left running" if args.no_pause else ""
    print(
        f"\nGSPO end-to-end, model {args.model_dir or args.model}, {args.batch} prompts x n={args.n}, up to "
        f"{args.max_new_tokens} new "
        f"tokens, {MINIBATCHES} minibatches/rollout batch, device {args.device}, {order}, first step excluded; "
        f"load average {load[0]:.1f} before, {load[1]:.1f} after (1 min)"
    )
    width = max(12, *(len(r.name) + 1 for r in results))
    print(f"{'':34}" + "".join(f"{r.name:>{width}}" for r in results))
    for label, cells in table_rows(results, trl):
        print(f"{label:34}" + "".join(f"{c:>{width}}" for c in cells))
    for r in results:
        if r.error:
            print(f"{r.name} did not run to the end: {r.error}; the end of its log:")
            print("\n".join("    " + line[:200] for line in r.extra.get("log_tail", [])))
            if r.extra.get("traceback"):
                print("  where it failed:\n" + "\n".join("    " + line[:200] for line in r.extra["traceback"]))
    if paired is not None:
        print(f"median of the per-turn ratios {ours.name}/{trl.name} (adjacent steps, same load): {paired:.3f}x")
    for r in results:
        if ours and SIDES[r.name].patched and r.ok:
            print(f"{ours.name} / {r.name} ({SIDES[r.name].note}): {ours.median_step_s() / r.median_step_s():.3f}x")
    saved = engine_saving(results)
    if saved:
        print(saved["line"])
    verl = verl_ratios(results, SIDES)
    for line in verl["lines"]:
        print(line)
    verdict = "met" if ratio <= 0.5 else "not met" if math.isfinite(ratio) else "no unmodified TRL side ran"
    sides = f"{ours.name if ours else '-'} / {trl.name if trl else '-'}"
    print(f"{RATIO_LINE}: {ratio:.4f} ({sides}; goal <= 0.5: {verdict})")
    print("not matched between the sides:")
    verl_lines = VERL_NOT_MATCHED if any(SIDES[r.name].trainer == "verl" for r in results) else ()
    for line in (*NOT_MATCHED, *verl_lines):
        print("  - " + line.format(filtered=filtered))
    return {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "sides": {r.name: r.to_dict() for r in results},
        "ours": ours.to_dict() if ours else None,
        "trl": trl.to_dict() if trl else None,
        "step_time_ratio": ratio,
        "paired_step_time_ratio": paired,
        "old_logprobs_engine_saving": saved,
        "verl": verl,
        "load_average": list(load),
        "not_matched": [line.format(filtered=filtered) for line in (*NOT_MATCHED, *verl_lines)],
    }


def engine_saving(results: list[SideResult]) -> dict | None:
    """What ``old_logprobs=engine`` saves on a side that probed the recompute: seconds per step, and their share of
    the training phase as it would be with the recompute (old log-probs + update)."""
    for r in results:
        probe = r.extra.get("recompute_probe_s")
        if r.ok and probe:
            training = probe + r.stages_s.get("old_log_prob", 0.0) + r.stages_s.get("update", 0.0)
            gap = r.extra.get("engine_logprob_gap_max", math.nan)
            line = (
                f"{r.name}: old_logprobs=engine skips a recompute of {probe:.3f} s per step (measured on the same "
                f"batches): {probe / training:.1%} of the training phase (old log-probs + update = {training:.3f} s "
                f"with the recompute); max |engine - trainer| log-prob over those batches {gap:.2e}"
            )
            return {
                "side": r.name,
                "recompute_s": probe,
                "training_phase_s": training,
                "share": probe / training,
                "logprob_gap_max": gap,
                "line": line,
            }
    return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parse_args(argv)
        if args.side_worker:  # one side, in its own process (e2e_sides.py)
            return side_worker(args.side_worker, side_setup(args))
        with tempfile.TemporaryDirectory(prefix="gspo-bench-") as tmp:
            model, data = model_and_data(args)
            cfg = our_config(args, str(Path(tmp) / "check"), None, model, data)
            records = prompts_of(cfg, model, data)
            before = os.getloadavg()[0]
            command = [sys.executable, str(Path(__file__).resolve()), *argv]
            envs = [(n, side_env(SIDES[n], our_config(args, tmp, SIDES[n], model, data), model)) for n in args.sides]
            results = run_sides(
                envs, command, args.steps, args.sequential, Path(tmp), args.batch * args.n, not args.no_pause
            )
            load = (before, os.getloadavg()[0])
    except UserError as exc:  # ConfigError is one too: a bad --set names its key
        print(f"error: {exc}", file=sys.stderr)
        return 2
    result = report(results, args, records.num_filtered, load)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2, allow_nan=True))
    # 0: the headline ratio exists, or no unmodified TRL side was asked for and every side ran (a patched-side run)
    asked_unmodified = any(SIDES[n].trainer == "trl" and not SIDES[n].patched for n in args.sides)
    ran = all(r.ok for r in results)
    return 0 if math.isfinite(result["step_time_ratio"]) or (not asked_unmodified and ran) else 1


if __name__ == "__main__":
    sys.exit(main())
