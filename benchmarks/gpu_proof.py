"""The GPU proof (issue #29): every layer of this build on one accelerator in one prepared run, each step in its own
process with its own time limit, the whole inside a time budget; JSON + a markdown summary into one folder.

    python benchmarks/gpu_proof.py --device cuda --out OUT          # gspo-ascend installed; an H100: ~9 min
    .venv/bin/python benchmarks/gpu_proof.py --device cpu --out OUT   # CI, tiny sizes: ~4 min

``scripts/device/gpu_proof.sh`` is the entry on the device machine (installs the carried bundle first). Steps, in
order of what they prove (a step that finds the budget spent is ``skip`` with that reason; failures are results):

1. ``attention``: ``benchmarks/attention_check.py``, torch alone (no engine, no model): packed attention at
   Qwen3-0.6B's attention shapes, 32 sequences of fresh lengths per iteration x 28 layers, fwd + bwd, one SDPA call
   per sequence with cuDNN SDPA off and on, then ``varlen_attn`` in one call per layer with its max |diff|: whether
   cuDNN's plan per shape is the small model's slow update, and what one call per layer is worth (issue #43).
   First: the cheapest step (an estimated minute on an H100, never measured yet; limit 90 s) and the one that
   says most about the steps after it. At ``--size tiny``: 2 sequences x 2 layers, fp32, one iteration (seconds).
2. ``selftest``: ``gspo-ascend selftest --devices 1 --json``: ops, collectives, hf rollout, the train engines on
   one device (megatron TP=1 log-probs vs HF, one GSPO update fsdp vs megatron, checkpoint, the MoE model's
   two), two GSPO steps through Ray. Its ``training/*`` records are the megatron figures of the summary; a
   selftest killed at its limit is judged on the checks its progress lines say it finished.
3. ``small_model``: ``make-tiny-model --size small`` on the device (the benchmark's 22M Qwen3; ~40 min on 2 CPU
   cores, ~60 s on an H100). ``--size tiny`` uses the embedded tiny model instead.
4. ``train``: ``gspo-ascend train`` of the synthetic task through Ray, fsdp + hf rollout, bf16 (fp32 on a CPU),
   4 steps, validation at the last: reward and validation accuracy, seconds per step by stage. Third, before
   the measurements: the product's own path, which no H100 run has yet seen finish at this size (run 4: 10 of 20
   steps in its limit, 16.7 s a step; run 6: the budget's last 93 s; run 8: 3 of 5 steps in 200 s, 27 s a step
   and two 42 s validations), while the throughput and TRL figures below have two runs each. 4 steps: ~120 s of
   steps, ~60 s of start-up and the one validation.
5. ``throughput_fsdp``, ``throughput_megatron``: ``benchmarks/train_throughput.py``, fwd + bwd + optimizer of a
   Qwen3-0.6B-shaped model at 4k-token micro-batches, a fresh batch every step: tokens/s, MFU, the first update
   apart from the steady state, peak memory against the planner's.
6. ``trl``: ``benchmarks/e2e_vs_trl.py`` ours-hf against TRL's GRPOTrainer (sequence-level IS), same GPU, same
   shape: one step-time ratio from one run.
7. ``throughput_fsdp_compiled``: step 5's fsdp run with ``actor.compile_layers=on`` (norms and SwiGLU through
   inductor, issue #43), its tokens/s against the plain run's: what decides that key's ``auto`` on CUDA. Last, so
   the budget spends itself on the figures that came before it.

Outputs (at most 3 files, so a device call brings them all back): ``proof.json`` (every step's record),
``proof.md`` (the summary committed as docs/results/gpu/<date>-<commit>.md), ``proof-logs.tar.gz`` (each step's
log and its raw results).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks"


@dataclass
class Ctx:
    device: str
    size: str  # full (an accelerator) | tiny (CI on a CPU)
    work: Path
    python: str
    env: dict[str, str]
    deadline: float
    found: dict = field(default_factory=dict)  # what earlier steps left for later ones (the small model's path)

    @property
    def full(self) -> bool:
        return self.size == "full"


@dataclass
class Record:
    name: str
    status: str  # pass | fail | skip | timeout
    seconds: float
    detail: str
    figures: dict = field(default_factory=dict)
    command: list[str] = field(default_factory=list)


class Skip(Exception):
    """The step does not run here; the message says why."""


@dataclass
class Step:
    name: str
    limit_s: dict[str, int]  # per size
    command: Callable[[Ctx], list[str]]
    judge: Callable[[Ctx, int, Path], tuple[str, str, dict]]  # (status, detail, figures) from rc and the log


# ----------------------------------------------------------------------------------------------- the steps


def _gspo(ctx: Ctx, *args: str) -> list[str]:
    return [ctx.python, "-m", "gspo_ascend", *args]


def attention_command(ctx: Ctx) -> list[str]:
    if ctx.device not in ("cuda", "cpu"):
        raise Skip(f"the attention check is CUDA's (on {ctx.device} the packed path is one fused call per layer)")
    out = ctx.work / "attention.json"
    out.unlink(missing_ok=True)  # a reused --work: judge this run's results only
    # full: the check's defaults (bf16, 32 sequences, 28 layers, 5 iterations); tiny: seconds on a CPU
    sizes = [] if ctx.full else ["--dtype", "float32", "--sequences", "2", "--max-extra", "16", "--iters", "1",
                                 "--layers", "2"]  # fmt: skip
    return [ctx.python, str(BENCH / "attention_check.py"), "--device", ctx.device, *sizes, "--json", str(out)]


def judge_attention(ctx: Ctx, rc: int, log: Path) -> tuple[str, str, dict]:
    path = ctx.work / "attention.json"
    if not path.is_file():
        return "fail", f"exit {rc}: {_last_error(log)}", {}
    data = json.loads(path.read_text())  # rewritten after each run: what a run killed at its limit finished
    timed = [name for name, run in data["runs"].items() if run.get("available")]
    if rc or not timed:
        return "fail", f"exit {rc}; runs finished: {timed}: {_last_error(log)}", data
    return "pass", _last_line(log), data


def selftest_command(ctx: Ctx) -> list[str]:
    quick = [] if ctx.full else ["--quick"]  # the training checks cost minutes on 2 cores; unit tests cover them
    return _gspo(ctx, "selftest", "--device", ctx.device, "--devices", "1", "--json", *quick)


def judge_selftest(ctx: Ctx, rc: int, log: Path) -> tuple[str, str, dict]:
    records = _last_json_list(log.with_suffix(".out"))
    partial = records is None  # killed at its limit: the JSON list comes last, the progress lines as it goes
    if partial:
        records = _selftest_progress(log)
        if not records:
            return "fail", f"exit {rc}, no JSON records and no progress lines (see {log.name})", {}
    counts = {s: sum(r["status"] == s for r in records) for s in ("pass", "fail", "skip")}
    failed = [f"{r['name']}: {r['detail']}" for r in records if r["status"] == "fail"]
    detail = ("before it stopped: " if partial else "") + f"{counts['pass']} pass, {counts['fail']} fail, "
    detail += f"{counts['skip']} skip" + (f"; last finished {records[-1]['name']}" if partial else "")
    figures = {"records": records, **counts, "partial": partial}
    return ("fail" if failed or rc else "pass"), detail + ("; " + failed[0] if failed else ""), figures


_PROGRESS = re.compile(r"^\[\s*(pass|fail|skip)\]\s+([0-9.]+)s (\S+): (.*)$")


def _selftest_progress(log: Path) -> list[dict]:
    """The checks a selftest finished, from its progress lines on stderr (``report.render_line``)."""
    if not log.is_file():
        return []
    found = (_PROGRESS.match(line) for line in log.read_text(errors="replace").splitlines())
    return [{"name": m[3], "status": m[1], "seconds": float(m[2]), "detail": m[4]} for m in found if m]


def small_model_command(ctx: Ctx) -> list[str]:
    if not ctx.full:
        raise Skip("--size tiny trains the embedded tiny model")
    out = ctx.work / "small-model"
    shutil.rmtree(out, ignore_errors=True)  # a reused --work: judge this run's model only
    ctx.found["model"] = str(out)
    return _gspo(ctx, "make-tiny-model", "--size", "small", "--device", ctx.device, "--output-dir", str(out))


def judge_small_model(ctx: Ctx, rc: int, log: Path) -> tuple[str, str, dict]:
    from gspo_ascend.tiny import read_manifest

    data = read_manifest(ctx.found["model"]) if "model" in ctx.found else None
    if rc or data is None:
        ctx.found.pop("model", None)
        return "fail", f"exit {rc}: {_last_error(log)}", {}
    figures = {k: data.get(k) for k in ("num_parameters", "initial_accuracy", "build_seconds", "device")}
    acc = data.get("initial_accuracy") or {}
    return (
        "pass",
        (
            f"{data.get('num_parameters', 0):,} parameters built on {data.get('device', '?')} in "
            f"{data.get('build_seconds', math.nan)} s; initial accuracy {acc.get('sampled_t1', math.nan):.2f} sampled, "
            f"{acc.get('greedy', math.nan):.2f} greedy; sampled length {acc.get('sampled_length')}"
        ),
        figures,
    )


def train_overrides(ctx: Ctx) -> list[str]:
    from gspo_ascend.runtime import embedded_data_dir

    data = embedded_data_dir()
    common = [
        f"trainer.device={ctx.device}",
        f"trainer.output_dir={ctx.work / 'train'}",
        "trainer.resume=never",
        "trainer.save_freq=0",
        "trainer.test_freq=5",
        "trainer.val_before_train=true",
        "trainer.loggers=[console,jsonl]",
        "rollout.engine=hf",
        "actor.engine=fsdp",
    ]
    if not ctx.full:
        return [*common, "trainer.total_steps=3", "trainer.test_freq=3", "data.train_batch_size=8"]
    if "model" not in ctx.found:
        raise Skip("the small model was not built (step small_model)")
    return [
        *common,
        f"model.path={ctx.found['model']}",
        f"data.train_files=[{data / 'train.parquet'}]",
        f"data.val_files=[{data / 'test.parquet'}]",
        "model.dtype=bfloat16",
        "data.max_response_length=512",  # the small model's long right tail (benchmarks/README.md)
        "actor.use_remove_padding=true",
        "actor.max_tokens_per_micro_batch=16384",
        # 4 steps and one validation, at the end: run 8 measured 27 s a step, a 40 s first step and 42 s for a
        # greedy validation (39 prompts to 512 tokens) on the H100, so 5 steps with two validations (run 8's
        # setting) needed ~250 s against the step's 200; this fits, and shows the command exiting on a GPU
        "trainer.total_steps=4",
        "trainer.test_freq=4",
        "trainer.val_before_train=false",
    ]


def train_command(ctx: Ctx) -> list[str]:
    overrides = train_overrides(ctx)
    shutil.rmtree(ctx.work / "train", ignore_errors=True)  # a reused --work: judge this run's metrics only
    return _gspo(ctx, "train", *overrides)


def judge_train(ctx: Ctx, rc: int, log: Path) -> tuple[str, str, dict]:
    path = ctx.work / "train" / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    steps = [r for r in rows if r.get("step", 0) >= 1 and "reward/mean" in r]
    if not steps:
        return "fail", f"exit {rc}, no step logged: {_last_error(log)}", {}
    figures = train_figures(rows, steps)
    reward, val = figures["reward_mean"], figures["validation"]
    detail = (
        f"{len(steps)} steps; reward {reward[0]:.3f} -> {reward[-1]:.3f} (first/last {figures['reward_window']} mean "
        f"{figures['reward_first5']:.3f} -> {figures['reward_last5']:.3f}); validation "
        + " -> ".join(f"{v:.3f}" for _, v in val)
        + f"; median step {figures['stage_median_s'].get('step', math.nan):.2f} s"
    )
    return ("pass" if rc == 0 and all(map(math.isfinite, reward)) else "fail"), detail, figures


def train_figures(rows: list[dict], steps: list[dict]) -> dict:
    reward = [float(r["reward/mean"]) for r in steps]
    # greedy validation samples once: its key is mean@1 (mean@n with n = validation.n)
    val = [(r["step"], float(v)) for r in rows for k, v in r.items() if k.startswith("val/all/mean@")]
    stages = sorted({k for r in steps for k in r if k.startswith("time/")})
    timed = steps[1:] or steps  # the first step pays for compilation and allocator warm-up
    k = max(1, min(5, len(reward) // 2))  # first and last k steps, never overlapping
    first, last = statistics.fmean(reward[:k]), statistics.fmean(reward[-k:])
    return {
        "reward_mean": reward,
        "reward_window": k,
        "reward_first5": first,
        "reward_last5": last,
        "reward_rising": last > first,
        "validation": val,
        "validation_rising": len(val) > 1 and val[-1][1] > val[0][1],
        "stage_median_s": {  # a stage only the first step had (a warm-up) has no median: left out
            k[5:-2]: statistics.median(float(r[k]) for r in timed if k in r)
            for k in stages
            if k.endswith("_s") and any(k in r for r in timed)
        },
        "response_length_mean": statistics.fmean(float(r.get("response/length_mean", math.nan)) for r in steps),
    }


def throughput_command(engine: str, variant: str = "", extra: tuple[str, ...] = ()) -> Callable[[Ctx], list[str]]:
    """``train_throughput.py`` for one engine; ``variant`` names a second run of it with ``extra`` options."""

    def command(ctx: Ctx) -> list[str]:
        shape = (
            ["--shape", "qwen3-0.6b", "--steps", "3", "--profile"] if ctx.full else ["--shape", "tiny", "--steps", "2"]
        )
        out = ctx.work / f"throughput_{engine}{variant}.json"
        out.unlink(missing_ok=True)  # a reused --work: judge this run's results only
        return [ctx.python, str(BENCH / "train_throughput.py"), "--device", ctx.device, "--engine", engine,
                "--tokens-per-micro-batch", "4096" if ctx.full else "256", *shape, *extra,
                "--json", str(out)]  # fmt: skip

    return command


def throughput_judge(engine: str, variant: str = "") -> Callable[[Ctx, int, Path], tuple[str, str, dict]]:
    def judge(ctx: Ctx, rc: int, log: Path) -> tuple[str, str, dict]:
        path = ctx.work / f"throughput_{engine}{variant}.json"
        if rc or not path.is_file():
            return "fail", f"exit {rc}: {_last_error(log)}", {}
        data = json.loads(path.read_text())
        detail = _last_line(log)
        if not variant:  # for a variant of this engine later in this run (never a --work's leftover)
            ctx.found[f"throughput_{engine}"] = data.get("tokens_per_second")
        plain = ctx.found.get(f"throughput_{engine}") if variant else None
        if plain and data.get("tokens_per_second"):  # against this run's plain run of the same engine and shape
            data["tokens_per_second_vs_plain"] = data["tokens_per_second"] / plain
            detail = f"{data['tokens_per_second_vs_plain']:.3f}x the plain run's tokens/s; {detail}"
        return "pass", detail, data

    return judge


def trl_command(ctx: Ctx) -> list[str]:
    out = ctx.work / "trl.json"
    out.unlink(missing_ok=True)  # a reused --work: judge this run's results only
    if ctx.full and "model" not in ctx.found:
        raise Skip("the small model was not built (step small_model)")
    sizes = (
        ["--shape", "realistic", "--steps", "3", "--model-dir", ctx.found["model"]]
        if ctx.full
        else ["--steps", "2", "--batch", "4", "--n", "2"]
    )
    return [ctx.python, str(BENCH / "e2e_vs_trl.py"), "--device", ctx.device, "--sides", "ours-hf,trl-hf", *sizes,
            "--json", str(out)]  # fmt: skip


def judge_trl(ctx: Ctx, rc: int, log: Path) -> tuple[str, str, dict]:
    path = ctx.work / "trl.json"
    if not path.is_file():
        return "fail", f"exit {rc}: {_last_error(log)}", {}
    data = json.loads(path.read_text())
    ratio = data.get("step_time_ratio", math.nan)
    keep = ("median_step_s", "tokens_per_s", "stages_s", "error")
    sides = {name: {k: side.get(k) for k in keep} for name, side in data["sides"].items()}
    detail = f"ours-hf / trl-hf median step time {ratio:.3f}x; " + ", ".join(
        f"{n} {s['error'] or format(s['median_step_s'], '.2f') + ' s'}" for n, s in sides.items()
    )
    return ("pass" if math.isfinite(ratio) else "fail"), detail, {"step_time_ratio": ratio, "sides": sides}


STEPS = [
    Step("attention", {"full": 90, "tiny": 60}, attention_command, judge_attention),
    Step("selftest", {"full": 200, "tiny": 240}, selftest_command, judge_selftest),
    Step("small_model", {"full": 120, "tiny": 60}, small_model_command, judge_small_model),
    Step("train", {"full": 200, "tiny": 240}, train_command, judge_train),
    Step("throughput_fsdp", {"full": 120, "tiny": 120}, throughput_command("fsdp"), throughput_judge("fsdp")),
    Step(
        "throughput_megatron", {"full": 150, "tiny": 150}, throughput_command("megatron"), throughput_judge("megatron")
    ),  # fmt: skip
    Step("trl", {"full": 180, "tiny": 240}, trl_command, judge_trl),
    Step(
        "throughput_fsdp_compiled",
        {"full": 150, "tiny": 120},
        throughput_command("fsdp", "_compiled", ("--compile-layers", "on")),
        throughput_judge("fsdp", "_compiled"),
    ),
]


# ----------------------------------------------------------------------------------------------- running


BUDGET_SPENT = "the proof's time budget is spent"


def run_step(step: Step, ctx: Ctx, logs: Path) -> Record:
    left = ctx.deadline - time.monotonic() - 5  # 5 s to write the results
    if left < 20:  # nothing worth starting: a process start alone takes seconds
        return Record(step.name, "skip", 0.0, f"{BUDGET_SPENT} ({max(left, 0):.0f} s left)")
    limit = min(step.limit_s[ctx.size], left)
    try:
        command = step.command(ctx)
    except Skip as why:
        return Record(step.name, "skip", 0.0, str(why))
    log = logs / f"{step.name}.log"
    start = time.monotonic()
    rc = _run(command, {**ctx.env, MARK: f"{ctx.work}:{step.name}"}, log, limit)
    seconds = time.monotonic() - start
    try:  # after a timeout too: what a killed step had written (a run's first steps) is a result
        status, detail, figures = step.judge(ctx, -9 if rc is None else rc, log)
    except Exception as exc:  # a judge reading a half-written result: the step failed, the proof goes on
        status, detail, figures = "fail", f"exit {rc}; its results could not be read: {exc!r}", {}
    if rc is None:
        status, detail = "timeout", f"killed at its limit of {limit:.0f} s; {detail}"
    return Record(step.name, status, seconds, detail, figures, command)


MARK = "GSPO_PROOF_STEP"  # in every step's environment, inherited by all it starts (Ray's daemons too)


def _run(command: list[str], env: dict[str, str], log: Path, limit: float) -> int | None:
    """Exit code, or None when killed at ``limit``; stdout to ``<log>.out`` (the parseable part), stderr to ``log``.
    A step past its limit, or a proof interrupted (Ctrl-C, SIGTERM), leaves nothing of the step running."""
    with log.open("w") as err, log.with_suffix(".out").open("w") as out:
        # cwd: not the checkout, whose bare gspo_ascend/ `python -m` would put before an installed one (no patches/)
        proc = subprocess.Popen(command, stdout=out, stderr=err, env=env, cwd=log.parent, start_new_session=True)
        try:
            return proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            return None
        finally:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            if MARK in env:
                _kill_marked(env[MARK])


def _kill_marked(mark: str) -> None:
    """Every process still carrying this step's mark: Ray's GCS, raylet and workers start sessions of their own, so
    the step's process group misses them, and the next step must not join a half-dead cluster. Only this step's:
    `ray stop` would take any Ray of the machine's user down."""
    import psutil

    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.pid != os.getpid() and proc.environ().get(MARK) == mark:
                proc.kill()


def _last_json_list(path: Path) -> list | None:
    if not path.is_file():
        return None
    text = path.read_text()
    start = text.rfind("\n[")
    try:
        return json.loads(text[start + 1 :] if start >= 0 else text)
    except json.JSONDecodeError:
        return None


def _output(log: Path) -> str:
    """A step's stderr then its stdout."""
    return "\n".join(p.read_text(errors="replace") for p in (log, log.with_suffix(".out")) if p.is_file())


def _last_line(log: Path) -> str:
    lines = [line.strip() for line in _output(log).splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no output)"


def _last_error(log: Path) -> str:
    from gspo_ascend.selftest.launch import last_error_of

    return last_error_of(_output(log))


# In a process of its own: a driver that touched the device would hold its context (and memory) for the whole proof.
DEVICE_PROBE = """
import json, sys
from gspo_ascend.device import get_backend
b = get_backend(sys.argv[1])
count = b.device_count() if b.torch_device_type != "cpu" else 0
print(json.dumps({"backend": b.name, "device_name": b.device_name(), "device_count": count}))
"""
PACKAGES = ("torch", "transformers", "ray", "megatron-core", "mbridge", "trl", "accelerate", "vllm")


def environment(ctx: Ctx) -> dict:
    """What ran: device, versions of the stack, commit."""
    from gspo_ascend.selftest.setup import installed

    done = subprocess.run([ctx.python, "-c", DEVICE_PROBE, ctx.device], env=ctx.env, cwd=ctx.work, capture_output=True,
                          text=True, check=False)  # fmt: skip
    found = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else {"error": done.stderr[-300:]}
    versions = installed(PACKAGES)
    commit = os.environ.get("GSPO_PROOF_COMMIT") or _git_commit()
    return {"commit": commit, "date": datetime.date.today().isoformat(), "python": sys.version.split()[0],
            "versions": versions, **found}  # fmt: skip


def _git_commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else "unknown"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda", choices=("cuda", "npu", "cpu"))
    p.add_argument("--size", choices=("full", "tiny"), default=None, help="default: full on a device, tiny on cpu")
    p.add_argument("--out", type=Path, required=True, help="proof.json, proof.md, proof-logs.tar.gz go here")
    p.add_argument("--budget-s", type=float, default=560.0, help="the whole proof; later steps skip when it is spent")
    p.add_argument("--only", default=None, help=f"comma-separated steps (default all): {[s.name for s in STEPS]}")
    p.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    args = p.parse_args(argv)
    args.size = args.size or ("tiny" if args.device == "cpu" else "full")
    names = [s.name for s in STEPS]
    args.only = [s.strip() for s in args.only.split(",")] if args.only else names
    if unknown := [s for s in args.only if s not in names]:
        p.error(f"--only: unknown step(s) {unknown}; valid: {names}")
    return args


def _terminated(signum, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through _run's finally, which kills the running step


def main(argv: list[str] | None = None) -> int:
    from proof_report import render_markdown  # benchmarks/ is this script's folder: on sys.path when run as a file

    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    signal.signal(signal.SIGTERM, _terminated)  # a device call's time limit: the running step is cleaned up too
    start = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    # absolute: the steps run in work/logs, and their arguments name paths under work
    work = (args.work or Path(tempfile.mkdtemp(prefix="gspo-proof-"))).resolve()
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    # the checkout last: an installed gspo-ascend (the bundle's site) has patches/, env/, configs/ where the package
    # expects them (pyproject's package-dir), the bare checkout does not
    path = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(REPO)]))
    env = dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1")
    ctx = Ctx(args.device, args.size, work, sys.executable, env, start + args.budget_s)
    header = environment(ctx)
    print(f"gpu proof: {json.dumps(header)}", flush=True)
    records = []
    for step in STEPS:
        chosen = step.name in args.only
        record = run_step(step, ctx, logs) if chosen else Record(step.name, "skip", 0.0, "not in --only")
        print(f"[{record.status:>7}] {record.seconds:6.1f}s {record.name}: {record.detail}", flush=True)
        records.append(record)
    result = {"header": header, "size": args.size, "seconds": time.monotonic() - start,
              "steps": [asdict(r) for r in records]}  # fmt: skip
    (args.out / "proof.json").write_text(json.dumps(result, indent=1, default=str, allow_nan=True))
    (args.out / "proof.md").write_text(render_markdown(result))
    with tarfile.open(args.out / "proof-logs.tar.gz", "w:gz") as tar:
        tar.add(logs, arcname="logs")
        for raw in [*work.glob("*.json"), work / "train" / "metrics.jsonl"]:
            if raw.is_file():
                tar.add(raw, arcname=f"raw/{raw.name}")
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    # a step asked for but left unrun for lack of time is no success either
    failed = [r.name for r in records if r.status in ("fail", "timeout") or r.detail.startswith(BUDGET_SPENT)]
    counts = ", ".join(f"{sum(r.status == s for r in records)} {s}" for s in ("pass", "fail", "timeout", "skip"))
    print(
        f"gpu proof: {counts} in {result['seconds']:.0f} s; {args.out / 'proof.md'}"
        + (f"; failed or not run for time: {failed}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
