"""The orchestrator's end of benchmarks/e2e_vs_trl.py: side processes driven in turns, and what they report.

Each side (benchmarks/e2e_sides.py) is a child process; :func:`run_sides` gives each one rollout batch per turn
(``go``) and collects the JSON line it answers with. A side that fails (an ``error`` line, or an exit) is recorded
with its reason and the end of its log; the others go on.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

from e2e_sides import SIDES
from procstats import paused, tree_cpu_s


@dataclass
class SideResult:
    name: str
    step_s: list[float] = field(default_factory=list)  # wall time of every rollout batch, warm-up included
    tokens: list[float] = field(default_factory=list)  # prompt + completion tokens of every rollout batch
    reward_mean: list[float] = field(default_factory=list)
    response_length_mean: list[float] = field(default_factory=list)
    prompt_length_mean: float = float("nan")
    stages_s: dict[str, float] = field(default_factory=dict)  # mean seconds per stage over the measured steps
    processed_tokens: list[float] = field(default_factory=list)  # tokens the training passes ran, per step
    real_tokens: list[float] = field(default_factory=list)  # of which real (not padding)
    peak_rss_mib: float = float("nan")
    extra: dict[str, float] = field(default_factory=dict)
    error: str = ""
    others_cpu_s: list[float] = field(default_factory=list)  # CPU-s the other sides used during each step (in turns)

    @property
    def steps(self) -> int:
        return len(self.step_s)

    @property
    def ok(self) -> bool:
        return not self.error and self.steps >= 2

    def median_step_s(self) -> float:
        return statistics.median(self.step_s[1:]) if self.steps >= 2 else math.nan  # the first step is warm-up

    def best_step_s(self) -> float:
        return min(self.step_s[1:]) if self.steps >= 2 else math.nan  # the least disturbed step, on a shared box

    def tokens_per_s(self) -> float:
        return sum(self.tokens[1:]) / sum(self.step_s[1:]) if self.steps >= 2 else math.nan

    def padded_share(self) -> float:
        """Share of the tokens the training passes computed that were padding; 0 for packed rows, also where a
        shared prompt made them compute fewer tokens than the samples hold (:meth:`computed_per_real`)."""
        processed = sum(self.processed_tokens[1:])
        return max(0.0, 1.0 - sum(self.real_tokens[1:]) / processed) if processed else math.nan

    def computed_per_real(self) -> float:
        """Tokens the training passes computed per token the samples hold: > 1 padded, 1 packed, < 1 with each
        prompt computed once for its samples (actor.shared_prefix)."""
        real = sum(self.real_tokens[1:])
        return sum(self.processed_tokens[1:]) / real if real else math.nan

    def others_cores(self) -> float:
        """Cores the other sides' processes kept busy, on average, while this side ran its measured steps."""
        seconds = sum(self.step_s[1:])
        return sum(self.others_cpu_s[1:]) / seconds if seconds and len(self.others_cpu_s) > 1 else math.nan

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
            "padded_token_share": self.padded_share(),
            "computed_per_real_token": self.computed_per_real(),
            "peak_rss_mib": self.peak_rss_mib,
            "others_cpu_s": self.others_cpu_s,
            "others_cores": self.others_cores(),
            "extra": self.extra,
            "error": self.error,
        }


def with_trl_logs(out: SideResult, logs: list[dict], samples_per_batch: int) -> SideResult:
    out.reward_mean = [float(log["reward"]) for log in logs]
    out.response_length_mean = [float(log["completions/mean_length"]) for log in logs]
    prompt_means = [
        tok / samples_per_batch - resp for tok, resp in zip(out.tokens, out.response_length_mean, strict=False)
    ]
    out.prompt_length_mean = statistics.fmean(prompt_means) if prompt_means else float("nan")
    return out


class SideProcess:
    """The orchestrator's end of one side: ``go`` -> one rollout batch's numbers."""

    def __init__(self, name: str, command: list[str], work: Path, env: dict[str, str]) -> None:
        self.name, self.log = name, work / f"{name}.log"
        command = [*command, "--side-worker", name, "--work-dir", str(work)]
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env
            )
        self.result = SideResult(name)

    def attempt(self, action) -> None:
        """``action(self)`` unless this side already failed; a failure is recorded, not raised."""
        if self.result.error:
            return
        try:
            action(self)
        except Exception as exc:  # noqa: BLE001 - reported in the table, the other sides go on
            self.fail(exc)

    def expect(self, event: str) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} exited ({self.proc.wait()}); see its log {self.log}")
        message = json.loads(line)
        if message["event"] == "error":
            self.result.extra["traceback"] = message.get("traceback", [])
            raise RuntimeError(message["message"])
        if message["event"] != event:
            raise RuntimeError(f"{self.name} sent {message['event']!r}, expected {event!r}")
        return message

    def send(self, command: str) -> None:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def step(self) -> None:
        self.send("go")
        m = self.expect("step")
        r = self.result
        r.step_s.append(m["step_s"])
        r.tokens.append(m["tokens"])
        r.processed_tokens.append(m["processed_tokens"])
        r.real_tokens.append(m["real_tokens"])
        r.extra.setdefault("steps", []).append(m)

    def finish(self) -> None:
        self.send("stop")
        m = self.expect("done")
        self.proc.wait(timeout=300)
        self.result.peak_rss_mib = m["peak_rss_mib"]
        self.result.extra["logs"] = m["logs"]

    def fail(self, exc: BaseException) -> None:
        self.result.error = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
        # the side's log lives in the run's temporary directory: keep where it failed
        self.result.extra["log_tail"] = self.log.read_text(errors="replace").strip().splitlines()[-12:]
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def summarise(side: SideProcess, samples: int) -> SideResult:
    """Stage means, lengths and rewards over the measured steps, from what the side reported."""
    r, steps = side.result, side.result.extra.pop("steps", [])
    if SIDES[side.name].trainer == "trl":
        with_trl_logs(r, r.extra.pop("logs", []), samples)
    else:
        r.extra.pop("logs", None)
        r.reward_mean = [m["reward_mean"] for m in steps]
        r.response_length_mean = [m["response_length_mean"] for m in steps]
        r.prompt_length_mean = statistics.fmean(m["prompt_length_mean"] for m in steps) if steps else math.nan
        probes = [m["recompute_probe_s"] for m in steps[1:] if m.get("recompute_probe_s")]
        if probes:
            r.extra["recompute_probe_s"] = statistics.fmean(probes)
            r.extra["engine_logprob_gap_max"] = max(m["engine_logprob_gap_max"] for m in steps[1:])
        r.extra["response_length_max"] = max((m["response_length_max"] for m in steps), default=math.nan)
        if steps and steps[0].get("validation_before") and steps[-1].get("validation"):  # sampled, held-out prompts
            r.extra["heldout_before"] = next(iter(steps[0]["validation_before"].values()))
            r.extra["heldout_after"] = next(iter(steps[-1]["validation"].values()))
    measured = steps[1:]
    keys = sorted({k for m in measured for k in m["stages"]})
    r.stages_s = {k: statistics.fmean(m["stages"].get(k, 0.0) for m in measured) for k in keys} if measured else {}
    return r


def run_sides(
    sides: list[tuple[str, dict[str, str]]],
    command: list[str],
    steps: int,
    sequential: bool,
    work: Path,
    samples: int,
    pause_waiting: bool = True,
) -> list[SideResult]:
    """Start every side (name, environment) as ``command + --side-worker NAME``, then ``steps`` rollout batches
    each: in turns (round by round), or one side's all before the next side starts (``sequential``: a side's
    process is only started after the previous one ended, so no set-up runs beside another side's steps). In turns
    the waiting sides' processes are stopped through each side's step (``pause_waiting``, :func:`paused`), so each
    side has the machine to itself, as sequentially, while the turns still share out slow drifts of the machine."""
    groups = [[side] for side in sides] if sequential else [sides]
    done = []
    for group in groups:
        procs = [SideProcess(name, command, work, env) for name, env in group]
        for side in procs:
            side.attempt(lambda s: s.result.extra.__setitem__("setup_s", s.expect("ready")["setup_s"]))
        for _ in range(steps):
            for side in procs:
                others = [p.proc.pid for p in procs if p is not side]
                with paused(others) if pause_waiting else nullcontext():
                    before = sum(map(tree_cpu_s, others))
                    side.attempt(SideProcess.step)
                    # what the waiting sides' processes ran meanwhile: on 2 cores any of it slows the side in its
                    # turn (0 when they are paused)
                    side.result.others_cpu_s.append(sum(map(tree_cpu_s, others)) - before)
        for side in procs:
            side.attempt(SideProcess.finish)
            failed = f", FAILED: {side.result.error}" if side.result.error else ""
            print(f"{side.name}: {side.result.steps} steps{failed}", flush=True)
        done += procs
    return [summarise(p, samples) for p in done]
