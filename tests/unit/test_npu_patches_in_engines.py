"""The NPU patches run in production (issue #14, item 1): the fsdp engine and the hf rollout apply them on npu.

Under the CPU shim, with the npu backend: the engines load the model through the patches (summary printed once,
model routed to npu_fusion attention), and their log-probs / greedy generations equal the same engines built
with ``model.npu_patches=false`` (an unpatched run). On main before this change ``apply_npu_patches`` had no
caller outside tests, so an NPU run trained and generated on plain sdpa.
"""

from __future__ import annotations

import pytest
import torch

from gspo_ascend.device import NPU_SHIM, shim
from gspo_ascend.engines import hf_load
from gspo_ascend.engines.base import SamplingParams
from tests.unit.fsdp_worker import engine_config, make_batch

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture
def npu_shim(monkeypatch):
    from gspo_ascend.patches import remove_npu_patches

    was_installed = shim.is_installed("npu")
    shim.install(npu=True)
    monkeypatch.setattr(hf_load, "_summary_printed", False)
    yield
    remove_npu_patches()
    if not was_installed:
        shim.uninstall()


@pytest.fixture(scope="module")
def model_path() -> str:
    from gspo_ascend.tiny import ensure_tiny_model

    return str(ensure_tiny_model())


def fsdp_engine(model_path: str, *overrides: str):
    from gspo_ascend.engines.fsdp import FSDPEngine

    cfg = engine_config("data.train_batch_size=8", "algorithm.minibatches_per_rollout=1", *overrides)
    return FSDPEngine(cfg, NPU_SHIM, model_path)


def test_fsdp_engine_on_npu_applies_the_patches_and_keeps_log_probs(npu_shim, model_path, capsys):
    batch = make_batch(6, 6, seed=4)
    # unpatched first: the patches swap class methods process-wide, so an unpatched engine must come first
    plain = fsdp_engine(model_path, "model.npu_patches=false")
    # packed sdpa (engines/packed_attention.py wraps sdpa for padding-free passes), not the NPU patches' attention
    assert plain.model.config._attn_implementation == "packed_sdpa"
    want = plain.compute_log_probs(batch, 0.7)
    assert "NPU patches" not in capsys.readouterr().out
    patched = fsdp_engine(model_path)
    printed = capsys.readouterr().out
    assert "NPU patches for qwen3" in printed and "npu_fusion" in printed  # the summary, once
    assert patched.model.config._attn_implementation == "npu_fusion"
    got = patched.compute_log_probs(batch, 0.7)
    assert got.shape == want.shape
    # float32 log-probs through other kernels (the shim's fused attention and RMSNorm against sdpa): 1.14e-5 apart on
    # a box with AMX when gspo_ascend.engines.fsdp was imported before the shim was installed (an earlier test in
    # the worker; why the import order moves it is not established), under 1e-5 otherwise; a wrong patch is O(1e-2)
    assert (got - want).abs().max().item() <= 2e-5
    fsdp_engine(model_path)  # a second engine in the process (the reference model) prints nothing more
    assert "NPU patches" not in capsys.readouterr().out


def test_hf_rollout_on_npu_applies_the_patches_and_generates_the_same(npu_shim, model_path):
    from gspo_ascend.engines.hf_rollout import HFRolloutEngine

    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=3)  # seeded: a pure function
    plain = HFRolloutEngine(model_path, backend=NPU_SHIM, npu_patches=False)
    want = plain.generate(prompts, params)
    patched = HFRolloutEngine(model_path, backend=NPU_SHIM)
    assert patched.model.config._attn_implementation == "npu_fusion"
    got = patched.generate(prompts, params)
    assert torch.equal(got.response_ids, want.response_ids)
    assert (got.rollout_log_probs - want.rollout_log_probs).abs().max().item() <= 1e-5


def test_other_backends_never_touch_the_patches(monkeypatch, model_path):
    from gspo_ascend.device import CPU

    calls = []
    monkeypatch.setattr(hf_load, "apply_patches", lambda *a: calls.append(a))
    model = hf_load.load_causal_lm(
        model_path, dtype=torch.float32, attn_implementation="sdpa", backend=CPU, npu_patches=True
    )
    assert calls == [] and model.config._attn_implementation == "sdpa"


def test_a_family_without_patches_is_said_in_one_line(npu_shim, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2))  # fmt: skip
    hf_load.apply_patches(model, NPU_SHIM)
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines == ["NPU patches: model type 'llama' has none (covered: qwen2, qwen3, qwen3_moe); plain ops"]


def test_packed_npu_fusion_takes_the_host_boundaries(npu_shim, model_path, monkeypatch):
    """Issue #43 (NPU): a packed forward gives npu_fusion_attention's TND layout the sequence boundaries from the host
    (transformers' varlen keywords); before, it derived them from the device's position_ids in every forward
    (``nonzero().tolist()``, a host sync on the NPU). Same log-probs either way."""
    import gspo_ascend.patches.npu_attention as npu_attention

    from gspo_ascend.engines import packed_attention

    batch = make_batch(6, 6, seed=9, min_response=1)
    engine = fsdp_engine(model_path)
    calls = []
    real = npu_attention._packed_ends
    monkeypatch.setattr(npu_attention, "_packed_ends", lambda *a: calls.append(1) or real(*a))
    with monkeypatch.context() as m:
        m.setattr(packed_attention, "HOST_BOUNDARIES", (), raising=False)  # as before: no boundaries given
        derived = engine.compute_log_probs(batch, 0.7)
    assert calls  # derived from the positions
    calls.clear()
    got = engine.compute_log_probs(batch, 0.7)
    assert calls == []  # given: nothing derived on the device
    assert torch.equal(got, derived)
