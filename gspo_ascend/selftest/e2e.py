"""Layer 5: two GSPO steps of the tiny model through Ray on this node, the way a user runs training.

``gspo-ascend train`` in a fresh process (the embedded default config: the tiny Qwen3 and the synthetic arithmetic
task) with ``trainer.device`` this device, one worker per selected device, two steps, output under the selftest's
work directory. Engines: on a GPU / NPU node the production pair where installed (megatron, under MindSpeed on NPU;
vLLM / vllm-ascend), else fsdp + hf; on a host (CPU, emulated NPU) fsdp + hf, because the production pair costs
minutes there and CI runs it in tests/e2e/test_train_e2e.py. Passes when both steps are logged with finite reward,
loss and gradient norm, the weights reached the rollout engine (``sync/bytes`` > 0) and the rollout engine's
log-probs agree with the train engine's recompute (``rollout/logprob_gap_max``) within 10x the rollout check's
bound: the gap is a maximum over every token of a batch, and a weight sync that did not happen shows as > 1e-1.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

from .launch import last_error
from .report import CheckFailed, CheckSkipped
from .rollout import bound
from .training import megatron_blocker

FIX = "docs/troubleshooting.md#selftest-end-to-end: read the run log; `gspo-ascend doctor` checks Ray and the env"
TIMEOUT_S = 900
STEPS = 2


def engines(backend) -> tuple[str, str]:
    """(actor.engine, rollout.engine) for this device; see the module docstring."""
    if backend.torch_device_type == "cpu":
        return "fsdp", "hf"
    actor = "megatron" if megatron_blocker(backend) is None else "fsdp"
    vllm = importlib.util.find_spec("vllm") is not None
    if backend.name == "npu":
        vllm = vllm and importlib.util.find_spec("vllm_ascend") is not None
    return actor, "vllm" if vllm else "hf"


def prompts(devices: int) -> int:
    """Prompts per step: the fewest that the default 4 minibatches and ``devices`` data-parallel ranks both divide
    (4 on one or two devices; 2 per device, as before, left one device with 2 prompts for 4 minibatches: refused)."""
    return math.lcm(4, devices)


def command(backend, devices: int, out: Path) -> list[str]:
    actor, rollout = engines(backend)
    return [
        sys.executable, "-m", "gspo_ascend.cli", "train",
        f"trainer.device={backend.name}", f"trainer.devices_per_node={devices}", f"trainer.total_steps={STEPS}",
        f"trainer.output_dir={out}", "trainer.save_freq=0", "trainer.resume=never", "trainer.loggers=[console,jsonl]",
        f"data.train_batch_size={prompts(devices)}", "rollout.n=4",
        f"actor.engine={actor}", f"rollout.engine={rollout}",
    ]  # fmt: skip


def check_e2e(backend, devices: int, out: Path) -> str:
    if importlib.util.find_spec("ray") is None:
        raise CheckSkipped("Ray is not installed (gspo-ascend train runs its workers through Ray)")
    run_dir, log = out / "e2e-run", out / "e2e-run.log"
    env = {**os.environ, **({"GSPO_DEVICE_SHIM": "1"} if backend.emulated else {})}
    with log.open("w") as sink:
        try:
            code = subprocess.run(
                command(backend, devices, run_dir), stdout=sink, stderr=subprocess.STDOUT, env=env, timeout=TIMEOUT_S
            ).returncode
        except subprocess.TimeoutExpired:
            raise CheckFailed(f"training did not finish {STEPS} steps within {TIMEOUT_S} s (log: {log})") from None
    if code != 0:
        raise CheckFailed(f"gspo-ascend train exited with {code}: {last_error(log)} (log: {log})")
    return _judge(run_dir / "metrics.jsonl", backend, devices, log)


def _judge(metrics: Path, backend, devices: int, log: Path) -> str:
    lines = metrics.read_text().splitlines() if metrics.is_file() else []
    rows = [row for row in map(json.loads, filter(str.strip, lines)) if "actor/pg_loss" in row]  # not validation rows
    if [r.get("step") for r in rows] != list(range(1, STEPS + 1)):
        raise CheckFailed(
            f"{metrics} holds training steps {[r['step'] for r in rows]}, expected 1-{STEPS} (log: {log})"
        )
    for row in rows:
        bad = [
            k for k in ("reward/mean", "actor/pg_loss", "actor/grad_norm") if not math.isfinite(row.get(k, math.nan))
        ]
        if bad:
            raise CheckFailed(f"step {row['step']}: {', '.join(bad)} missing or not finite (log: {log})")
        if not row.get("sync/bytes", 0) > 0:
            raise CheckFailed(f"step {row['step']}: no weights reached the rollout engine (sync/bytes = 0)")
        gap = row.get("rollout/logprob_gap_max")
        if gap is not None and not gap <= 10 * bound(backend):
            raise CheckFailed(
                f"step {row['step']}: rollout log-probs differ from the train engine's by {gap:.2e} "
                f"(bound {10 * bound(backend):g}): the weight sync or one engine is off"
            )
    actor, rollout = engines(backend)
    rewards = " -> ".join(f"{r['reward/mean']:.2f}" for r in rows)
    return f"{STEPS} GSPO steps through Ray on {devices} device(s), {actor} + {rollout}: reward {rewards}"
