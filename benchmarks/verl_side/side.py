"""The verl 0.9.1 sides of benchmarks/e2e_vs_trl.py: verl's own trainer, in its own venv, driven in turns.

The side process (``e2e_vs_trl.py --side-worker verl ...``, our venv) starts ``python -m verl.trainer.main_ppo``
from the verl venv (benchmarks/verl_side/setup.sh) with the overrides of :func:`verl_overrides` and relays turns:
our ``go`` becomes a ``go-<k>`` file the gated trainer waits for, its ``step-<k>.json`` (verl's own metrics of that
step) becomes our ``step`` line (shims/verl_cpu_shims.py, ``install_turn_gate``). Waiting is outside verl's step
timer, so the step times are verl's ``timing_s/step``: generation, reward, old log-probs, advantages, the update
and the weight sync, validation excluded (it runs after the timer, as ours does).

What each side is (README.md in this folder has every shim and setting):
- ``verl``: verl's default GSPO: old log-probs recomputed by the FSDP actor (``timing_s/old_log_prob``);
- ``verl-bypass``: ``algorithm.rollout_correction.bypass_mode=true``: the rollout's log-probs are pi_old (the v1
  trainer copies ``rollout_log_probs`` and keeps ``loss_mode=gspo``): the same choice as our ``ours-vllm``.
Both train padded (``use_remove_padding=False``: verl's padding-free path needs flash-attn), as TRL does.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
DEFAULT_VENV = REPO / ".venv-verl"
HELDOUT_N = 4  # samples per held-out prompt (mean@4), both sides
# verl's Ray actors that hold the weights, the optimizer and the KV cache (vLLM's engine core is the server's child)
MODEL_ACTORS = ("ray::WorkerDict", "ray::vLLMHttpServer")


@dataclass(frozen=True)
class VerlSpec:
    """The shape both sides share (e2e_vs_trl.py's arguments)."""

    model: str
    train_files: tuple[str, ...]
    val_files: tuple[str, ...]
    batch: int
    n: int
    max_new_tokens: int
    lr: float
    steps: int
    minibatches: int
    max_prompt_length: int = 64
    kv_cache_gib: int = 2
    seed: int = 0


def verl_python() -> Path:
    python = Path(os.environ.get("GSPO_VERL_VENV", DEFAULT_VENV)) / "bin" / "python"
    if not python.is_file():
        raise RuntimeError(f"no verl venv at {python.parents[1]}: run bash benchmarks/verl_side/setup.sh first")
    return python


def _listing(values) -> str:
    return "[" + ",".join(json.dumps(str(v)) for v in values) + "]"


def verl_overrides(spec: VerlSpec, bypass: bool, work: Path) -> list[str]:
    """verl 0.9.1 Hydra overrides for the benchmark's shape, GSPO as the paper and verl's GSPO guide set it."""
    samples = spec.batch * spec.n
    a, r = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
    return [
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=False",
        f"algorithm.rollout_correction.bypass_mode={bypass}",
        f"data.train_files={_listing(spec.train_files)}",
        f"data.val_files={_listing(spec.val_files)}",
        f"data.train_batch_size={spec.batch}",
        f"data.max_prompt_length={spec.max_prompt_length}",
        f"data.max_response_length={spec.max_new_tokens}",
        f"data.seed={spec.seed}",
        f"actor_rollout_ref.model.path={spec.model}",
        "actor_rollout_ref.model.use_remove_padding=False",  # the padding-free path needs flash-attn (no CPU build)
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        f"{a}.policy_loss.loss_mode=gspo",
        f"{a}.loss_agg_mode=seq-mean-token-mean",
        f"{a}.clip_ratio_low=3e-4",
        f"{a}.clip_ratio_high=4e-4",
        f"{a}.use_kl_loss=False",
        f"{a}.entropy_coeff=0",
        f"{a}.ppo_epochs=1",
        f"{a}.ppo_mini_batch_size={spec.batch // spec.minibatches}",  # prompts; x n samples per optimizer step
        f"{a}.ppo_micro_batch_size_per_gpu={samples // spec.minibatches}",  # one forward/backward per step
        f"{a}.optim.lr={spec.lr}",
        f"{a}.optim.lr_warmup_steps=0",
        f"{a}.strategy=fsdp2",  # as ours (fully_shard); verl's FSDP1 wants its module states on a GPU
        f"{a}.fsdp_config.strategy=fsdp2",
        f"{a}.use_torch_compile=False",  # inductor on CPU; ours runs eager too
        f"{a}.fsdp_config.use_torch_compile=False",
        f"{a}.fsdp_config.dtype=float32",
        f"{r}.name=vllm",
        f"{r}.mode=async",
        f"{r}.n={spec.n}",
        f"{r}.temperature=1.0",
        f"{r}.top_p=1.0",
        f"{r}.top_k=-1",
        f"{r}.dtype=float32",
        f"{r}.enforce_eager=True",
        f"{r}.tensor_model_parallel_size=1",
        f"{r}.free_cache_engine=False",  # vLLM's CPU build has no sleep mode
        f"+{r}.enable_sleep_mode=False",
        f"{r}.log_prob_micro_batch_size_per_gpu={samples // spec.minibatches}",
        f"{r}.val_kwargs.do_sample=True",  # held-out accuracy sampled as in training, as ours (greedy decoding of
        f"{r}.val_kwargs.n={HELDOUT_N}",  # the small model never reaches a boxed answer: 0.0 on both sides)
        f"{r}.val_kwargs.temperature=1.0",
        f"{r}.val_kwargs.top_p=1.0",
        f"{r}.val_kwargs.top_k=-1",
        f"{r}.agent.num_workers=1",  # verl's defaults start 8 agent-loop and 8 reward workers (~1 GB each): on 2
        "reward.num_workers=1",  # cores they only add processes; ours scores with one worker too
        "data.dataloader_num_workers=0",
        f"reward.custom_reward_function.path={HERE / 'reward.py'}",
        "reward.custom_reward_function.name=compute_score",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        f"trainer.total_training_steps={spec.steps}",
        "trainer.total_epochs=1000",
        f"trainer.test_freq={spec.steps}",  # held-out accuracy after the last step
        "trainer.val_before_train=True",  # and of the initial weights
        "trainer.save_freq=-1",
        "trainer.logger=[console]",
        "trainer.project_name=gspo-bench",
        "trainer.experiment_name=verl",
        f"trainer.default_local_dir={work / 'verl_ckpt'}",
        "+ray_kwargs.ray_init.num_gpus=1",  # a fake GPU: verl's placement asks Ray for one
        "ray_kwargs.ray_init.num_cpus=32",  # TransferQueue's controller and storage need slots of their own
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",  # each unit is a ~720 MB process
    ]


def verl_env(turns: Path, spec: VerlSpec) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(
        VERL_USE_EXTERNAL_MODULES="verl_cpu_platform",  # shim P1, through verl's own plugin hook
        VERL_PLATFORM="cpu",
        VERL_ENGINE_DEVICE="cuda",  # verl's FSDP engine is registered for cuda/npu only; this selects it on cpu
        GSPO_VERL_TURNS=str(turns),
        VLLM_CPU_KVCACHE_SPACE=str(spec.kv_cache_gib),  # as ours-vllm's kv_cache_gib
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        VLLM_CPU_NUM_OF_RESERVED_CPU="0",  # as ours: the trainer is idle during rollout
        VLLM_CPU_SGL_KERNEL="0",
        RAY_worker_niceness="0",
        PYTHONUNBUFFERED="1",
    )
    return env


def _wait_file(path: Path, proc: subprocess.Popen, log: Path) -> dict:
    while not path.exists():
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-6:] if log.exists() else []
            raise RuntimeError(f"verl exited ({proc.returncode}) before {path.name}: {' | '.join(tail)[:300]}")
        time.sleep(0.1)
    return json.loads(path.read_text())


def padded_passes(lengths: list[int], minibatches: int) -> tuple[int, int]:
    """(tokens the update's padded passes process, real tokens): verl splits the batch into ``minibatches`` in
    order, one micro-batch each, padded to its longest sample (``to_padded_tensor`` of the nested batch)."""
    size = len(lengths) // minibatches
    processed = sum(len(c) * max(c) for c in (lengths[i : i + size] for i in range(0, len(lengths), size)) if c)
    return processed, sum(lengths)


STAGES = {"gen": "generate", "reward": "reward", "old_log_prob": "old_log_prob", "adv": "adv",
          "update_actor": "update", "update_weights": "sync"}  # fmt: skip


def step_report(m: dict[str, Any], minibatches: int) -> dict[str, Any]:
    """Our ``step`` line from verl's metrics of one step."""
    step_s = m["timing_s/step"]
    stages = {ours: m.get(f"timing_s/{key}") or 0.0 for key, ours in STAGES.items()}
    stages["other"] = max(step_s - sum(stages.values()), 0.0)
    lengths = m.get("gspo/sample_lengths") or []
    processed, real = padded_passes(lengths, minibatches) if lengths else (float("nan"), float("nan"))
    return {
        "step_s": step_s,
        "tokens": m["perf/total_num_tokens"],
        "stages": stages,
        "processed_tokens": processed,
        "real_tokens": real,
        "reward_mean": m["critic/score/mean"],
        "response_length_mean": m["response_length/mean"],
        "response_length_max": m["response_length/max"],
        "prompt_length_mean": m["prompt_length/mean"],
        "validation": heldout(m),
    }


def heldout(metrics: dict[str, Any]) -> dict[str, float]:
    """verl's held-out accuracy, mean over the samples of each prompt (``val-core/<source>/acc/mean@N``)."""
    return {k: v for k, v in metrics.items() if k.startswith("val-core/") and "/acc/mean@" in k}


def run_verl_side(side, spec: VerlSpec, channel, work: Path) -> None:
    """The side's life: start verl, ``ready`` when its trainer waits before step 1, one step per ``go``."""
    from procstats import peak_rss_mib, ray_workers

    t0 = time.perf_counter()
    turns, log = work / f"{side.name}-turns", work / f"{side.name}-verl.log"
    turns.mkdir(parents=True, exist_ok=True)
    overrides = verl_overrides(spec, side.old_logprobs == "engine", work)
    command = [str(verl_python()), "-m", "verl.trainer.main_ppo", *overrides]
    with log.open("w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=verl_env(turns, spec),
                                cwd=work, start_new_session=True)  # fmt: skip
    try:
        _wait_file(turns / "ready.json", proc, log)
        before = json.loads((turns / "val-0.json").read_text()) if (turns / "val-0.json").exists() else {}
        channel.send("ready", setup_s=time.perf_counter() - t0)
        step = 0
        while channel.wait():
            step += 1
            (turns / f"go-{step}").touch()
            report = step_report(_wait_file(turns / f"step-{step}.json", proc, log), spec.minibatches)
            if step == 1:
                report["validation_before"] = heldout(before)
            channel.send("step", **report)
        peak = peak_rss_mib(ray_workers(MODEL_ACTORS))
        (turns / "stop").touch()
        proc.wait(timeout=300)
        channel.send("done", peak_rss_mib=peak, logs=[])
    finally:
        _kill_tree(proc)


def _kill_tree(proc: subprocess.Popen) -> None:
    """verl's driver and every process it started (its own Ray cluster: ``ray stop`` would take the other sides'
    clusters down too)."""
    import psutil
    from procstats import descendants

    children = descendants(proc.pid)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for pid in children:
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            continue


# ----------------------------------------------------------------------------------------------- the report

VERL_RATIO_LINE = "step-time ratio ours/verl"
VERL_NOT_MATCHED = (
    "verl 0.9.1 runs its own pins (vllm-cpu 0.24.0, torch 2.11.0 CUDA build on CPU, transformers 5.9.0) and the CPU "
    "shims P1-P4 of benchmarks/verl_side/README.md; ours vllm-cpu 0.32.0, torch 2.13.0+cpu, transformers 5.19.0",
    "verl's vLLM runs without oneDNN linears (shim P4); ours-vllm-noonednn carries the same handicap, ours-vllm not",
    "verl trains padded (use_remove_padding=False: its padding-free path needs flash-attn); ours packs",
    "verl's rollout goes through its vLLM HTTP server and one agent-loop worker (TransferQueue in between)",
)


def verl_ratios(results: list, sides: dict) -> dict:
    """Every (our side, verl side) step-time ratio of medians; the headline is our first side against the fastest
    verl side, the goal <= 0.5."""
    ours = [r for r in results if sides[r.name].trainer == "ours" and r.ok]
    verls = [r for r in results if sides[r.name].trainer == "verl" and r.ok]
    pairs = {f"{o.name}/{v.name}": o.median_step_s() / v.median_step_s() for o in ours for v in verls}
    lines = [f"step-time ratio {pair}: {ratio:.3f}x" for pair, ratio in pairs.items()]
    headline = None
    if ours and verls:
        fastest = min(verls, key=lambda r: r.median_step_s())
        headline = {"ours": ours[0].name, "verl": fastest.name, "ratio": pairs[f"{ours[0].name}/{fastest.name}"]}
        verdict = "met" if headline["ratio"] <= 0.5 else "not met"
        pair = f"{ours[0].name} / {fastest.name}"
        lines.append(f"{VERL_RATIO_LINE}: {headline['ratio']:.4f} ({pair}; goal <= 0.5: {verdict})")
    return {"pairs": pairs, "headline": headline, "lines": lines}


if __name__ == "__main__":  # the overrides a side passes verl at the realistic shape, for running verl by hand
    model = sys.argv[1] if len(sys.argv) > 1 else "<model dir>"
    spec = VerlSpec(model, ("<train.parquet>",), ("<test.parquet>",), 16, 8, 512, 1e-4, 5, 4)
    print(" ".join(verl_overrides(spec, bypass=False, work=Path("."))))
