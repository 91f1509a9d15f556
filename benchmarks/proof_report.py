"""The markdown summary of a GPU proof (benchmarks/gpu_proof.py): one table of the steps, then each step's figures.
It is what gets committed as docs/results/gpu/<date>-<commit>.md, so it says what ran, on what, and what it found,
failures included, without the logs (those are in proof-logs.tar.gz)."""

from __future__ import annotations

import math
import statistics


def _num(value, spec: str = ".3g") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return format(value, spec) if isinstance(value, int | float) else str(value)


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_markdown(result: dict) -> str:
    header, steps = result["header"], {s["name"]: s for s in result["steps"]}
    versions = ", ".join(f"{k} {v}" for k, v in header.get("versions", {}).items() if v)
    lines = [
        f"# GPU proof: {header.get('device_name', header.get('backend', '?'))}, commit {header.get('commit')}, "
        f"{header.get('date')}",
        "",
        f"Made by `scripts/device/gpu_proof.sh` (benchmarks/gpu_proof.py), size `{result['size']}`, "
        f"{result['seconds']:.0f} s in all. Python {header.get('python')}; {versions}.",
        "",
        "| step | status | seconds | result |",
        "|---|---|---|---|",
    ]
    lines += [f"| {s['name']} | {s['status']} | {s['seconds']:.1f} | {_cell(s['detail'])} |" for s in steps.values()]
    for name, section in (("attention", _attention), ("selftest", _selftest), ("train", _train), ("trl", _trl)):
        if steps.get(name, {}).get("figures"):
            lines += ["", *section(steps[name]["figures"])]
    names = ("throughput_fsdp", "throughput_fsdp_compiled", "throughput_megatron")
    throughput = [steps[n] for n in names if steps.get(n, {}).get("figures")]
    if throughput:
        lines += ["", *_throughput(throughput)]
    return "\n".join(lines) + "\n"


def _attention(figures: dict) -> list[str]:
    """benchmarks/attention_check.py's runs: seconds per iteration (fwd + bwd of every layer), fresh lengths each."""
    lengths = [n for step in figures.get("iteration_lengths", []) for n in step]
    lines = [
        f"## attention: packed rows at Qwen3-0.6B's attention shapes, {figures.get('dtype')}, "
        f"{figures.get('sequences')} sequences x {figures.get('layers')} layers, fwd + bwd",
        "",
        f"Fresh lengths every iteration ({min(lengths, default=0)}-{max(lengths, default=0)} tokens; "
        f"{_num(_mean(figures.get('iteration_tokens')), ',.0f')} per row on average); "
        + (f"cuDNN {figures['cudnn_version']}, " if figures.get("cudnn_version") else "")
        + f"torch {figures.get('torch')}.",
        "",
        "| run | calls per iteration, each way | first iteration (s) | median per iteration (s) | median forward (s) |",
        "|---|---|---|---|---|",
    ]
    calls = figures.get("calls_per_iteration", {})
    for name, run in figures.get("runs", {}).items():
        if not run.get("available"):
            lines.append(f"| {name} | - | - | {_cell(run.get('reason'))} | - |")
            continue
        forward = _median(run.get("forward_seconds"))
        count = calls.get("varlen" if name == "varlen" else "per_sequence")
        lines.append(f"| {name} | {_num(count, 'd')} | {_num(run['first_s'], '.4f')} | {_num(run['median_s'], '.4f')} "
                     f"| {_num(forward, '.4f')} |")  # fmt: skip
    ratios = figures.get("ratios") or {}
    if ratios:
        lines += ["", "- " + ", ".join(f"{k.replace('_', ' ')}: {v:.3g}x" for k, v in ratios.items())]
    diff = figures.get("varlen_vs_per_sequence") or {}
    if "max_abs_diff" in diff:
        scale = diff["reference_max_abs"]
        lines.append("- varlen vs per-sequence, max |diff| (reference max |value|): " + ", ".join(
            f"{k} {v:.3g} ({scale[k]:.3g})" for k, v in diff["max_abs_diff"].items()))  # fmt: skip
    elif "error" in diff:
        lines.append(f"- varlen vs per-sequence: {diff['error']}")
    return lines


def _mean(values) -> float | None:
    return sum(values) / len(values) if values else None


def _median(values) -> float | None:
    return statistics.median(values) if values else None


def _selftest(figures: dict) -> list[str]:
    lines = ["## selftest (one device)", "", "| check | status | seconds | detail |", "|---|---|---|---|"]
    for r in figures["records"]:
        lines.append(f"| {r['name']} | {r['status']} | {r['seconds']:.1f} | {_cell(r['detail'])} |")
    return lines


def _train(figures: dict) -> list[str]:
    reward = ", ".join(f"{x:.3f}" for x in figures["reward_mean"])
    val = ", ".join(f"step {s}: {v:.3f}" for s, v in figures["validation"])
    stages = ", ".join(f"{k} {v:.2f}" for k, v in sorted(figures["stage_median_s"].items()))
    return [
        "## train: the synthetic task through Ray, fsdp + hf rollout",
        "",
        f"- mean reward per step: {reward}",
        f"- mean of the first {figures['reward_window']} steps {figures['reward_first5']:.3f} -> of the last "
        f"{figures['reward_window']} {figures['reward_last5']:.3f} "
        f"(rising: {'yes' if figures['reward_rising'] else 'no'})",
        f"- validation accuracy (greedy, held-out problems): {val or '-'} "
        f"(rising: {'yes' if figures['validation_rising'] else 'no'})",
        f"- mean response length: {_num(figures['response_length_mean'], '.1f')} tokens",
        f"- seconds per step by stage (median, first step excluded): {stages}",
    ]


def _gib(value) -> float | None:
    return value / 2**30 if isinstance(value, int | float) else None


# (label, the figure from benchmarks/train_throughput.py's JSON, format)
THROUGHPUT_ROWS = [
    ("device", lambda f: f.get("device_name"), "s"),
    ("dtype", lambda f: f.get("dtype"), "s"),
    ("tokens per micro-batch (budget)", lambda f: f.get("tokens_per_micro_batch"), "d"),
    # each timed step a fresh batch of the same length distribution: per-step sizes are means over the timed steps
    ("real tokens per step (mean)", lambda f: f.get("tokens_per_step"), ",.0f"),
    ("tokens computed (with padding, mean)", lambda f: f.get("processed_tokens_per_step"), ",.0f"),
    ("micro-batches per step (mean)", lambda f: f.get("micro_batches_per_step"), ".3g"),
    ("first update, a fresh engine (s)", lambda f: f.get("first_update_s"), ".3f"),  # the warm-up, timed apart
    ("step, mean of the timed steps (s)", lambda f: f.get("mean_step_seconds"), ".3f"),  # tokens/s's denominator
    ("step, median of the timed steps (s)", lambda f: f.get("median_step_seconds"), ".3f"),
    ("tokens/s (real tokens)", lambda f: f.get("tokens_per_second"), ",.0f"),
    ("model GFLOP per token", lambda f: (f.get("flops_per_token") or 0) / 1e9 or None, ".3f"),
    ("model TFLOP/s", lambda f: f.get("tflops_per_second"), ".1f"),
    ("MFU (bf16 dense peak)", lambda f: f.get("mfu"), ".1%"),
    ("peak device memory (GiB)", lambda f: _gib(f.get("peak_memory_bytes")), ".2f"),
    ("planner's prediction (GiB)", lambda f: _gib(f.get("predicted_memory_bytes")), ".2f"),
    ("measured / predicted", lambda f: f.get("memory_ratio"), ".2f"),
]


def _throughput(steps: list[dict]) -> list[str]:
    names = [s["name"].removeprefix("throughput_") for s in steps]
    shape = steps[0]["figures"].get("shape", "?")
    lines = [f"## training throughput: {shape}, random init, fwd + bwd + optimizer", "",
             "| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]  # fmt: skip
    for label, figure, spec in THROUGHPUT_ROWS:
        lines.append(f"| {label} | " + " | ".join(_num(figure(s["figures"]), spec) for s in steps) + " |")
    return lines


def _trl(figures: dict) -> list[str]:
    lines = [
        "## ours vs TRL's GRPOTrainer (sequence-level importance sampling), hf rollout on both sides",
        "",
        f"- median step time ours-hf / trl-hf: **{_num(figures['step_time_ratio'], '.3f')}x**",
    ]
    for name, side in figures["sides"].items():
        step, rate = _num(side["median_step_s"], ".2f"), _num(side["tokens_per_s"], ",.0f")
        stages = ", ".join(f"{k} {v:.2f}" for k, v in (side.get("stages_s") or {}).items())
        what = side["error"] or f"median step {step} s, {rate} tokens/s" + (
            f" (by stage, s: {stages})" if stages else ""
        )
        lines.append(f"- {name}: {what}")
    return lines
