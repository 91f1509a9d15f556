"""benchmarks/train_throughput.py: its arithmetic against hand computations (FLOPs per token, the engines' padded token
counts, the peak table, the qwen3-0.6b shape against the built-in spec of the published config), and one tiny run of
each engine on CPU through the command line, whose JSON is checked against independent expectations (no speed
assertion)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

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
    assert bench.processed_tokens(batch, "fsdp", 10) == (28, 3)  # packed rows hold exactly their tokens
    assert bench.processed_tokens(batch, "megatron", 10) == (2 * 9 + 2 * 7 + 2 * 5, 3)  # right-padded [b, S]


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

    # tokens: the batch the script builds, counted here from its mask; the engine's own response-token count agrees
    shape = bench.SHAPES["tiny"]
    batch = bench.synthetic_batch(shape.samples, shape.prompt_length, shape.max_response_length, 512, seed=0)
    responses = int(batch.response_mask.sum())
    tokens = shape.samples * shape.prompt_length + responses
    assert result["tokens_per_step"] == tokens == sum(result["sequence_lengths"])
    assert result["last_step_metrics"]["actor/num_tokens"] == responses
    assert result["micro_batches_per_step"] == result["planned_micro_batches"] > 1
    padded = result["processed_tokens_per_step"]
    assert padded == result["tokens_per_step"] if engine == "fsdp" else padded > result["tokens_per_step"]

    # time and FLOPs: the reported rates follow from the reported times, the formula from the hand computation above
    assert result["steps"] == len(result["step_seconds"]) == STEPS and min(result["step_seconds"]) > 0
    tokens_per_s = result["tokens_per_step"] * STEPS / sum(result["step_seconds"])
    assert result["tokens_per_second"] == pytest.approx(tokens_per_s)
    lengths = result["sequence_lengths"]
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
