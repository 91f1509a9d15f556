"""benchmarks/train_throughput.py: its arithmetic against hand computations (FLOPs per token, the engines' padded token
counts, the peak table, the qwen3-0.6b shape against the built-in spec of the published config), a fresh batch for
every update with the first update timed apart (a stand-in engine, and the report's sums over steps of different
sizes), and one tiny run of each engine on CPU through the command line, whose JSON is checked against independent
expectations (no speed assertion)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from gspo_ascend.engines.base import SampleBatch
from tests.conftest import REPO, script_module

SCRIPT = REPO / "benchmarks" / "train_throughput.py"
STEPS = 2


@pytest.fixture(scope="module")
def bench():
    with script_module(SCRIPT, "bench_train_throughput") as module:
        yield module


def batch_of(prompt_lengths: list[int], response_lengths: list[int], width: int = 8) -> SampleBatch:
    mask = (torch.arange(width)[None, :] < torch.tensor(response_lengths)[:, None]).float()
    return SampleBatch([[7] * p for p in prompt_lengths], (mask * 9).long(), mask)


def test_processed_tokens_by_hand(bench):
    # sample tokens (prompt + response) 9 1 3 5 7 3, budget 10; first-fit decreasing: 9 -> A, 7 -> B, 5 -> C,
    # 3 (#2) -> B (10), 3 (#5) -> C (8), 1 -> A (10): A = {9, 1}, B = {3, 7}, C = {5, 3}
    batch = batch_of([4, 1, 2, 3, 4, 1], [5, 0, 1, 2, 3, 2])
    assert bench.sequence_lengths(batch) == [9, 1, 3, 5, 7, 3]
    assert bench.processed_tokens(batch, False, 10) == (28, 3)  # packed rows hold exactly their tokens
    assert bench.processed_tokens(batch, True, 10) == (2 * 9 + 2 * 7 + 2 * 5, 3)  # right-padded [b, S]


def test_flops_per_token_of_the_tiny_shape_by_hand(bench):
    from gspo_ascend.doctor.modelspec import spec_from_dict

    # tiny: hidden 64, 2 layers, 4 heads, 2 KV heads, head_dim 16, intermediate 128, vocab 512, tied
    attention = 64 * 16 * (4 + 2 + 2 + 4)  # q, k, v, o
    norms = 2 * 64 + 2 * 16  # input + post-attention RMSNorm, q / k norm
    mlp = 3 * 64 * 128
    non_embedding = 2 * (attention + norms + mlp) + 64  # + final norm
    lengths = [3, 5]
    context = (3 * 4 / 2 + 5 * 6 / 2) / 8  # token t of a sequence attends t + 1 keys
    spec = spec_from_dict({"model_type": "qwen3", **bench.TINY})
    flops = bench.model_flops(spec, lengths)
    assert flops["non_embedding_params"] == non_embedding == 74112
    assert flops["mean_causal_context"] == pytest.approx(context)
    expected = 6 * non_embedding + 6 * 512 * 64 + 12 * 2 * 4 * 16 * context
    assert flops["per_token"] == pytest.approx(expected)


def test_the_qwen3_shape_is_the_published_config(bench):
    from transformers import Qwen3Config

    from gspo_ascend.doctor.modelspec import builtin_spec, spec_from_dict

    ours = spec_from_dict(Qwen3Config(**bench.QWEN3_0_6B).to_dict())
    published = builtin_spec("Qwen/Qwen3-0.6B", "Qwen/Qwen3-0.6B", "the hub id")
    fields = ("hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate", "vocab", "tied", "qkv_bias")
    assert {f: getattr(ours, f) for f in fields} == {f: getattr(published, f) for f in fields}
    assert bench.QWEN3_0_6B["rope_parameters"]["rope_theta"] == 1e6
    # Qwen3-0.6B's model card: 0.44B non-embedding parameters; per layer q/k/v/o + norms + MLP, 28 layers + final norm
    per_layer = 1024 * 128 * (16 + 8 + 8 + 16) + 2 * 1024 + 2 * 128 + 3 * 1024 * 3072
    assert bench.model_flops(ours, [1])["non_embedding_params"] == 28 * per_layer + 1024 == 440_467_456


def test_peak_table(bench):
    assert bench.peak_tflops("NVIDIA H100 80GB HBM3") == 989.4
    assert bench.peak_tflops("NVIDIA H200") == 989.4
    assert bench.peak_tflops("NVIDIA A100-SXM4-80GB") is None
    assert bench.peak_tflops("NVIDIA H100 PCIe") == 756.0 and bench.peak_tflops("NVIDIA H200 NVL") == 835.0
    assert bench.peak_tflops("NVIDIA H20") == 148.0  # not the H200's


def test_synthetic_batch_is_skewed_and_in_range(bench):
    batch = bench.synthetic_batch(64, 8, 100, 512, seed=1)
    lengths = batch.response_lengths
    assert int(lengths[0]) == 100 and int(lengths.min()) >= 1
    assert float(lengths.float().median()) < 50  # most responses short, a long tail
    assert torch.equal(batch.response_ids * (1 - batch.response_mask.long()), torch.zeros_like(batch.response_ids))


def sizes(steps: int = 2, seed: int = 5) -> argparse.Namespace:
    return argparse.Namespace(samples=16, prompt_length=4, max_response_length=96, seed=seed, steps=steps, group_size=1)


def test_grouped_batches_and_the_tokens_a_shared_prefix_computes(bench):
    """--group-size 4: each prompt answered by 4 consecutive samples; with actor.shared_prefix the computed tokens
    are each micro-batch's shared-prefix row: the prompt once per micro-batch it is in, then the answers."""
    batch = bench.synthetic_batch(8, 5, 20, 512, seed=1, group=4)
    prompts = batch.prompt_ids
    assert prompts[0] == prompts[3] and prompts[4] == prompts[7] and prompts[0] != prompts[4]
    answers = int(batch.response_lengths.sum())
    assert bench.processed_tokens(batch, False, 10_000) == (8 * 5 + answers, 1)
    assert bench.processed_tokens(batch, False, 10_000, shared=True) == (2 * 5 + answers, 1)


def test_every_update_draws_a_fresh_batch_of_the_same_distribution(bench):
    """A benchmark that times one batch over and over hides every per-shape cost in its warm-up (issue #43)."""
    batches = bench.synthetic_batches(sizes(), 512, 3)
    lengths = [tuple(b.response_lengths.tolist()) for b in batches]
    assert len(set(lengths)) == 3, "two updates got the same lengths"
    assert not torch.equal(batches[1].response_ids, batches[2].response_ids)
    # the warm-up's is the single batch of old (seed + 0); every one keeps the distribution's tail at the maximum
    assert torch.equal(batches[0].response_ids, bench.synthetic_batch(16, 4, 96, 512, seed=5).response_ids)
    assert all(n[0] == 96 for n in lengths)


class RecordingEngine:
    def __init__(self):
        self.seen = []

    def update(self, batch, temperature):
        self.seen.append(batch)
        return {"actor/micro_batches": len(self.seen)}


def test_the_first_update_is_timed_apart_and_each_timed_step_has_its_own_batch(bench):
    syncs = []
    backend = SimpleNamespace(synchronize=lambda: syncs.append(1))
    batches = bench.synthetic_batches(sizes(steps=2), 512, 3)
    engine = RecordingEngine()
    first, seconds, metrics = bench.time_updates(engine, batches, backend)
    assert engine.seen == batches  # in order, each once: the warm-up's, then one per timed step
    assert first > 0 and len(seconds) == 2 and min(seconds) > 0
    assert [m["actor/micro_batches"] for m in metrics] == [2, 3]  # the timed steps' own metrics, not the warm-up's
    assert len(syncs) == 2 * 3  # before and after every update, the warm-up included


def test_the_report_sums_steps_of_different_sizes(bench):
    from gspo_ascend.doctor.modelspec import spec_from_dict

    args = argparse.Namespace(**vars(sizes()), shape="tiny", engine="fsdp", dtype="float32", attn="sdpa", padded=False,
                              tokens_per_micro_batch=10_000)  # fmt: skip
    batches = bench.synthetic_batches(args, 512, 3)
    backend = SimpleNamespace(name="cpu", torch_device_type="cpu", device_name=lambda: "cpu")
    raw = {"backend": backend, "batches": batches, "spec": spec_from_dict({"model_type": "qwen3", **bench.TINY}),
           "overrides": [], "first_seconds": 3.0, "seconds": [1.0, 3.0], "peak": None, "predicted": 1,
           "predicted_parts": {}, "metrics": [{"actor/micro_batches": 1}, {"actor/micro_batches": 1}],
           "syncs": bench.count_syncs(None, None, backend), "compiled_layers": 0}  # fmt: skip
    r = bench.report(args, raw)
    assert r["host_syncs_per_update"] is None  # nothing to count on the host
    lengths = [bench.sequence_lengths(b) for b in batches]
    assert r["first_update_s"] == 3.0 and r["first_update_sequence_lengths"] == lengths[0]
    assert r["step_sequence_lengths"] == lengths[1:] and r["step_tokens"] == [sum(n) for n in lengths[1:]]
    assert r["step_tokens"][0] != r["step_tokens"][1]
    assert r["tokens_per_step"] == pytest.approx(sum(r["step_tokens"]) / 2)
    assert (r["mean_step_seconds"], r["median_step_seconds"], r["first_update_over_median"]) == (2.0, 2.0, 1.5)
    assert r["tokens_per_second"] == pytest.approx(sum(r["step_tokens"]) / 4.0)  # sum of tokens / sum of seconds
    # each step's FLOPs from its own lengths; their sum / the seconds == the pooled per-token figure x tokens/s
    own = [bench.model_flops(raw["spec"], n)["per_token"] * sum(n) for n in lengths[1:]]
    assert r["step_flops"] == pytest.approx(own)
    assert r["tflops_per_second"] == pytest.approx(sum(own) / 4.0 / 1e12)
    assert r["tflops_per_second"] == pytest.approx(r["flops_per_token"] * r["tokens_per_second"] / 1e12)
    assert r["batch_seeds"] == [5, 6, 7]


# ----------------------------------------------------------------------------------------------- the command line


def run_engine(engine: str, out) -> tuple[dict, str]:
    path = out / f"{engine}.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--engine", engine, "--shape", "tiny"]
        + ["--steps", str(STEPS), "--json", str(path)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},  # tiny ops on a shared 2-core box: threads only fight
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(path.read_text()), proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["fsdp", "megatron"])
def test_tiny_run_on_cpu(bench, engine, tmp_path):
    from transformers import Qwen3Config

    from gspo_ascend.config import load_config
    from gspo_ascend.doctor.modelspec import load_spec
    from gspo_ascend.doctor.planner import train_phase

    result, stdout = run_engine(engine, tmp_path)
    summary = [line for line in stdout.splitlines() if line.startswith(bench.SUMMARY_PREFIX)]
    assert len(summary) == 1 and f"tiny {engine} on cpu" in summary[0]
    assert (result["shape"], result["engine"], result["device"], result["dtype"]) == ("tiny", engine, "cpu", "bfloat16")

    # tokens: the batches the script builds (seed 0 the warm-up's, 1.. the timed steps'), counted here from their
    # masks; the engine's own response-token count of the last step agrees
    shape = bench.SHAPES["tiny"]
    batches = [bench.synthetic_batch(shape.samples, shape.prompt_length, shape.max_response_length, 512, seed=i)
               for i in range(STEPS + 1)]  # fmt: skip
    responses = [int(b.response_mask.sum()) for b in batches]
    tokens = [shape.samples * shape.prompt_length + n for n in responses]
    assert result["first_update_tokens"] == tokens[0] and result["first_update_s"] > 0
    assert result["step_tokens"] == tokens[1:] == [sum(n) for n in result["step_sequence_lengths"]]
    assert result["step_sequence_lengths"][0] != result["step_sequence_lengths"][1]  # a fresh batch every step
    assert result["tokens_per_step"] == pytest.approx(sum(tokens[1:]) / STEPS)
    assert result["last_step_metrics"]["actor/num_tokens"] == responses[-1]
    assert result["step_micro_batches"] == result["step_planned_micro_batches"]
    assert min(result["step_micro_batches"]) > 1

    # time and FLOPs: the reported rates follow from the reported times, the formula from the hand computation above
    assert result["steps"] == len(result["step_seconds"]) == STEPS and min(result["step_seconds"]) > 0
    tokens_per_s = sum(tokens[1:]) / sum(result["step_seconds"])
    assert result["tokens_per_second"] == pytest.approx(tokens_per_s)
    lengths = [n for step in result["step_sequence_lengths"] for n in step]
    context = sum(n * (n + 1) / 2 for n in lengths) / sum(lengths)
    assert result["flops_per_token"] == pytest.approx(6 * 74112 + 6 * 512 * 64 + 12 * 2 * 4 * 16 * context)
    assert result["tflops_per_second"] == pytest.approx(result["flops_per_token"] * tokens_per_s / 1e12)

    # CPU: no peak FLOP/s, no device memory (host RSS is not comparable); the planner's prediction is there
    assert result["peak_tflops"] is None and result["mfu"] is None
    assert result["peak_memory_bytes"] is None and result["memory_ratio"] is None
    Qwen3Config(**bench.TINY).save_pretrained(tmp_path / "config")
    cfg = load_config(None, [*result["config_overrides"], f"model.path={tmp_path / 'config'}"])
    predicted = train_phase(cfg, load_spec(str(tmp_path / "config")))
    assert result["predicted_memory_bytes"] == predicted.total > 0
    assert result["predicted_memory_parts"] == predicted.parts
