"""The embedded tiny models, at a reduced size (the shipped build takes ~40 s; see docs/data.md for its numbers)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from gspo_ascend.device.detect import cuda_available
from gspo_ascend.errors import UserError
from gspo_ascend.tiny import (
    MANIFEST,
    TinySpec,
    build_model,
    build_tokenizer,
    encode_example,
    ensure_tiny_model,
    make_tiny_model,
    read_manifest,
    sft_examples,
    supervised_pass,
    synthetic_arithmetic,
)

# One layer, one 64-wide head (head_dim stays 64, the smallest vLLM's CPU attention takes), a few steps.
SMALL = dict(
    hidden_size=64,
    num_layers=1,
    num_heads=1,
    num_kv_heads=1,
    intermediate_size=64,
    moe_intermediate_size=32,
    batch_size=8,
    sft_steps=4,
    noisy_sft_steps=2,
    eval_prompts=4,
    eval_max_new_tokens=16,
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(seed=0)


def test_synthetic_arithmetic_is_seeded_and_correct():
    a = synthetic_arithmetic(50, seed=3, split="train")
    assert a == synthetic_arithmetic(50, seed=3, split="train")
    assert a != synthetic_arithmetic(50, seed=3, split="test") and a != synthetic_arithmetic(50, seed=4)
    for r in a:
        assert r["answer"] == str(r["a"] + r["b"] if r["op"] == "+" else r["a"] - r["b"])
        assert int(r["answer"]) >= 0 and "\\boxed{}" in r["prompt"][0]["content"]
    assert {r["op"] for r in a} == {"+", "-"}


def test_tokenizer_round_trip(tokenizer):
    for text in ["7 + 5 = 12. \\boxed{12}", "What is 9 - 3? Put the final answer in \\boxed{}.", "naïve ∑ 3.14 ü"]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text
    assert tokenizer.tokenize("123") == ["1", "2", "3"]  # digits one per token, as Qwen's tokenizer
    assert 256 < len(tokenizer) <= TinySpec.vocab_size
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"


def test_chat_template(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1 + 2?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n"
    with_prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert with_prompt == text + "<|im_start|>assistant\n"
    ids = tokenizer(with_prompt, add_special_tokens=False)["input_ids"]
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3  # special tokens stay single tokens


@pytest.mark.parametrize("moe", [False, True])
def test_model_builds_with_head_dim_64(tokenizer, moe):
    model = build_model(TinySpec(moe=moe, **SMALL), tokenizer, seed=0)
    attn = model.model.layers[0].self_attn
    assert model.config.head_dim == 64 and attn.head_dim == 64
    assert type(model).__name__ == ("Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM")
    if moe:
        assert model.config.num_experts == 4 and model.config.num_experts_per_tok == 2 and model.config.norm_topk_prob
    ids = torch.tensor([tokenizer("What is 1 + 1?")["input_ids"]])
    assert model(input_ids=ids).logits.shape == (1, ids.shape[1], TinySpec.vocab_size)


def test_sft_lowers_the_loss(tokenizer):
    spec = TinySpec(**{**SMALL, "batch_size": 16})
    model = build_model(spec, tokenizer, seed=0)
    examples = sft_examples(tokenizer, spec, seed=0, steps=40, p_correct=1.0, stream="sft")
    losses = supervised_pass(model, examples, batch_size=16, lr=3e-3, pad_id=tokenizer.pad_token_id)
    assert len(losses) == 40
    assert sum(losses[-5:]) / 5 < 0.5 * losses[0]


def test_sft_masks_the_prompt(tokenizer):
    record = synthetic_arithmetic(1, seed=0)[0]
    prompt, response = encode_example(tokenizer, record, int(record["answer"]))
    assert tokenizer.decode(response) == f"{record['a']} {record['op']} {record['b']} = {record['answer']}. " + (
        f"\\boxed{{{record['answer']}}}<|im_end|>"
    )
    assert tokenizer.decode(prompt).endswith("<|im_start|>assistant\n")


def test_same_seed_gives_identical_weights_and_loads(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    first = make_tiny_model(tmp_path / "a", seed=7, **SMALL)
    make_tiny_model(tmp_path / "b", seed=7, **SMALL)
    make_tiny_model(tmp_path / "c", seed=8, **SMALL)
    weights = {d: (tmp_path / d / "model.safetensors").read_bytes() for d in "abc"}
    assert weights["a"] == weights["b"] and weights["a"] != weights["c"]
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()

    manifest = json.loads((tmp_path / "a" / MANIFEST).read_text())
    assert manifest == {**first, "build_seconds": manifest["build_seconds"]}
    assert manifest["seed"] == 7 and manifest["sft"]["clean_steps"] == 4 and manifest["sft"]["noisy_steps"] == 2
    assert 0.0 <= manifest["initial_accuracy"]["sampled_t1"] <= 1.0 and manifest["initial_accuracy"]["num_prompts"] == 4

    tok = AutoTokenizer.from_pretrained(tmp_path / "a")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert model.config.head_dim == 64 and tok.eos_token_id == model.config.eos_token_id


def test_moe_variant_saves(tmp_path):
    manifest = make_tiny_model(tmp_path / "moe", moe=True, evaluate=False, **SMALL)
    assert manifest["architecture"] == "Qwen3MoeForCausalLM" and manifest["initial_accuracy"] is None
    config = json.loads((tmp_path / "moe" / "config.json").read_text())
    assert config["num_experts"] == config["num_local_experts"] == 4 and config["moe_intermediate_size"] == 32
    assert config["rope_theta"] == 10000.0  # the transformers-4.x spellings are written too

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    loaded = AutoConfig.from_pretrained(tmp_path / "moe")
    assert loaded.num_experts == 4 and loaded.rope_parameters["rope_theta"] == 10000.0
    # what the loaded model really uses (transformers 4.57 reads rope_theta, 5.x rope_parameters): 1 / 10000^(2i/64)
    inv_freq = AutoModelForCausalLM.from_pretrained(tmp_path / "moe").model.rotary_emb.inv_freq
    assert torch.allclose(inv_freq, 1.0 / 10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    # transformers 4.x's fast tokenizer adds token_type_ids unless told not to; Qwen3's generate() rejects them
    assert set(AutoTokenizer.from_pretrained(tmp_path / "moe")("1 + 1")) == {"input_ids", "attention_mask"}


def test_ensure_reuses_a_current_build_and_default_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("GSPO_HOME", str(tmp_path / "home"))
    out = tmp_path / "home" / "tiny-qwen3"
    make_tiny_model(None, evaluate=False, **SMALL)  # the default directory under $GSPO_HOME
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(**SMALL) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp  # same recipe: not rebuilt
    ensure_tiny_model(**{**SMALL, "sft_steps": 3})
    assert read_manifest(out)["spec"]["sft_steps"] == 3  # another recipe: rebuilt


def test_refuses_to_overwrite_a_foreign_directory(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(UserError, match="not a tiny-model directory"):
        make_tiny_model(tmp_path / "mine", **SMALL)


# ----------------------------------------------------------------------------------------------- the "small" size


def test_check_lines_are_geometric_and_capped():
    import random

    from gspo_ascend.tiny import check_lines

    rng = random.Random(0)
    state = rng.getstate()
    assert check_lines(rng, 0.0, 48) == 0 and rng.getstate() == state  # mean 0: no draw, the tiny recipe's stream
    draws = [check_lines(rng, 6.0, 48) for _ in range(20000)]
    # P(k) = (1 - q) q^k with q = 6 / 7: P(0) = 1/7, mean 6 (the cap at 48 removes q^49 ~ 5e-4 of the mass)
    assert abs(draws.count(0) / len(draws) - 1 / 7) < 0.01
    assert abs(sum(draws) / len(draws) - 6.0) < 0.25
    assert max(draws) <= 48 and max(check_lines(rng, 6.0, 3) for _ in range(500)) == 3


def test_solution_text_with_check_lines():
    from gspo_ascend.tiny import solution_text

    assert solution_text(7, "+", 5, 12) == "7 + 5 = 12. \\boxed{12}"
    assert solution_text(9, "-", 3, 6, checks=2) == "9 - 3 = 6. Check: 9 - 3 = 6. Check: 9 - 3 = 6. \\boxed{6}"


def test_packed_warm_start_step_equals_the_padded_one():
    """The small size's packed batches (one row, attended per example) train like padded batches: the same loss
    (the mean over response tokens) and, after one step, the same weights."""
    from dataclasses import replace

    from gspo_ascend.tiny import SIZES

    spec = replace(TinySpec(), **{**SIZES["small"], **SMALL, "batch_size": 6})
    tokenizer = build_tokenizer(seed=0, checks=True)
    examples = sft_examples(tokenizer, spec, seed=0, steps=1, p_correct=1.0, stream="sft")
    assert len({len(p) + len(r) for p, r in examples}) > 2  # lengths differ: padding would be real
    models = [build_model(spec, tokenizer, seed=0).double() for _ in range(2)]
    kw = dict(batch_size=6, lr=1e-2, pad_id=tokenizer.pad_token_id, warmup=1)
    padded = supervised_pass(models[0], examples, **kw)
    packed = supervised_pass(models[1], examples, packed=True, **kw)
    # transformers computes the LM loss in float32 whatever the model dtype: agreement to float32's precision
    assert packed == pytest.approx(padded, rel=1e-6)
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-7), name


def test_sizes_name_their_directory_and_old_manifests_stay_valid(tmp_path, monkeypatch):
    monkeypatch.setenv("GSPO_HOME", str(tmp_path))
    with pytest.raises(UserError, match="unknown tiny-model size 'huge'"):
        ensure_tiny_model(size="huge")
    out = ensure_tiny_model(size="small", **SMALL)
    assert out == tmp_path / "small-qwen3"
    spec = read_manifest(out)["spec"]
    assert spec["check_lines_mean"] == 6.0 and spec["num_layers"] == 1  # the preset, then the overrides
    tiny = ensure_tiny_model(**SMALL)
    manifest = read_manifest(tiny)
    for key in ("check_lines_mean", "max_check_lines"):  # a manifest written before these fields existed
        del manifest["spec"][key]
    (tiny / MANIFEST).write_text(json.dumps(manifest))
    stamp = (tiny / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(**SMALL) == tiny
    assert (tiny / "model.safetensors").stat().st_mtime_ns == stamp  # their defaults are the old recipe: no rebuild


# ----------------------------------------------------------------------------------------------- --device


def test_device_option_is_parsed_with_cpu_the_default():
    from gspo_ascend.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["make-tiny-model"]).device == "cpu"  # the shipped models' bytes
    for name in ("cpu", "cuda", "npu", "auto"):
        assert parser.parse_args(["make-tiny-model", "--device", name]).device == name
    with pytest.raises(SystemExit) as bad:
        parser.parse_args(["make-tiny-model", "--device", "tpu"])
    assert bad.value.code == 2


@pytest.mark.skipif(cuda_available(), reason="needs a host without CUDA")
def test_an_unavailable_device_is_a_one_line_error_before_anything_is_built(cli, tmp_path):
    out = tmp_path / "model"
    run = cli("make-tiny-model", "--device", "cuda", "--output-dir", str(out))
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert (
        run.stderr.startswith("error: trainer.device=cuda but torch sees no CUDA device")
        and run.stderr.count("\n") == 1
    )
    assert not out.exists() and not list(tmp_path.iterdir())  # nothing written, not even the temporary directory


def test_the_manifest_records_the_device_and_ensure_rebuilds_another_devices_model(tmp_path):
    out = tmp_path / "m"
    manifest = make_tiny_model(out, evaluate=False, device="cpu", **SMALL)
    assert manifest["device"] == "cpu" and read_manifest(out)["device"] == "cpu"
    cpu_weights = (out / "model.safetensors").read_bytes()
    # a manifest from before the option (no "device") was built on the CPU: still the CPU model, not rebuilt
    legacy = {k: v for k, v in read_manifest(out).items() if k != "device"}
    (out / MANIFEST).write_text(json.dumps(legacy))
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(output_dir=out, **SMALL) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    # a model built on a GPU is another model: the CPU one is wanted, so it is rebuilt on the CPU
    (out / MANIFEST).write_text(json.dumps({**legacy, "device": "cuda"}))
    (out / "model.safetensors").write_bytes(b"not the cpu weights")
    ensure_tiny_model(output_dir=out, **SMALL)
    assert read_manifest(out)["device"] == "cpu" and (out / "model.safetensors").read_bytes() == cpu_weights


def test_determinism_on_an_accelerator_warns_instead_of_aborting_and_configures_cublas(monkeypatch):
    """Checked without a GPU: what the build's deterministic block sets for each backend, and that it restores."""
    from gspo_ascend.device import CPU, CUDA, NPU
    from gspo_ascend.tiny import _deterministic

    # setenv first: monkeypatch then records the variable's original state (unset) and restores it at teardown, so
    # the value _deterministic(CUDA) leaves set does not leak into later tests
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "unset-below")
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    with _deterministic(CPU):  # the shipped bytes: strict
        assert (
            torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()
        )
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    with _deterministic(NPU):
        assert torch.is_deterministic_algorithms_warn_only_enabled() and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    with _deterministic(CUDA):
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"  # one of the two values torch accepts
    assert (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    ) == before
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    with _deterministic(CUDA):
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"  # the user's choice is kept


def test_a_model_built_on_an_accelerator_has_a_default_folder_of_its_own(monkeypatch, tmp_path):
    """The CPU build of the small model takes ~40 minutes: a GPU build (another model) must not replace it by
    default, nor be replaced by a CPU rebuild."""
    from gspo_ascend.tiny import default_tiny_dir

    monkeypatch.setenv("GSPO_HOME", str(tmp_path))
    assert default_tiny_dir(size="small") == tmp_path / "small-qwen3"
    assert default_tiny_dir(size="small", device_type="cuda") == tmp_path / "small-qwen3-cuda"
    assert default_tiny_dir(moe=True, device_type="npu") == tmp_path / "tiny-qwen3-moe-npu"


# ----------------------------------------------------------------------------------------------- portable CPU build


def _lower_capability() -> str | None:
    """An ATen CPU capability below this CPU's own (what a CPU without its widest vector unit dispatches to)."""
    native = torch.backends.cpu.get_cpu_capability()
    return {"AVX512": "avx2", "AVX2": "default"}.get(native)


@pytest.mark.skipif(_lower_capability() is None, reason="needs an x86-64 CPU with AVX2 or AVX-512")
def test_a_portable_build_is_the_same_bytes_on_another_cpu_type(tmp_path, monkeypatch):
    """Issue #40: a CPU build was bitwise on one machine, another model on another CPU type. Another CPU type is
    emulated here by what it changes: ATen's kernels one instruction set lower, MKL's automatic code path, another
    thread count, and glibc's libm without FMA/AVX2 variants. The portable build's child pins the first three
    (PORTABLE_CPU_ENV), so both builds are the same bytes; without the pinning they differ (ATen's AVX-512 and
    AVX2 kernels round differently)."""
    import hashlib

    from gspo_ascend.tiny import DEFAULT_CPU_CAPABILITY, PORTABLE_CPU_ENV

    for key in (*PORTABLE_CPU_ENV, "GLIBC_TUNABLES"):  # this machine as it is
        monkeypatch.delenv(key, raising=False)
    this_cpu = make_tiny_model(tmp_path / "this", portable=True, evaluate=False, **SMALL)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", _lower_capability())
    monkeypatch.setenv("MKL_CBWR", "AUTO")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.cpu.hwcaps=-AVX512F,-AVX2,-FMA,-FMA4,-AVX")
    other_cpu = make_tiny_model(tmp_path / "other", portable=True, evaluate=False, **SMALL)

    def sha(name):
        return hashlib.sha256((tmp_path / name / "model.safetensors").read_bytes()).hexdigest()

    assert sha("this") == sha("other")
    for manifest in (this_cpu, other_cpu):
        assert manifest["portable"] and manifest["torch_threads"] == 1
        assert manifest["cpu_capability"] in DEFAULT_CPU_CAPABILITY
    # a test-shrunk model builds in-process unless asked (no child process to import torch in)
    assert not make_tiny_model(tmp_path / "shrunk", evaluate=False, **SMALL)["portable"]
