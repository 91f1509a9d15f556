"""megatron-core's GPTModel with the real MindSpeed's patches, forward and backward on CPU."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def test_dense_forward_equals_plain_megatron(in_one_process, worker):
    """Flash attention (npu_fusion_attention), fused RMSNorm (npu_rms_norm) and MindSpeed's fused RoPE (its own
    op, the shim's reference) run, and the logits and gradients are megatron's without MindSpeed."""
    ms = in_one_process["forward:dense"]
    plain = worker("forward:plain")["forward:plain"]
    assert ms["calls"] == {
        "npu_rms_norm": 9,
        "npu_fusion_attention": 2,
        "npu_fusion_attention[SBH]": 2,  # a [b, S] batch: MindSpeed's layout for it
        "mindspeed.npu_rotary_position_embedding": 4,
    }
    assert plain["calls"] == {}
    assert max(abs(a - b) for a, b in zip(ms["logits"], plain["logits"], strict=True)) < 1e-6
    assert ms["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-5)


def test_moe_forward_runs_through_mindspeed_grouped_gemm(in_one_process):
    result = in_one_process["forward:moe"]  # right after the dense forward, in its process
    assert result["experts"] == "MindSpeedGmmExperts"  # MindSpeed's class replaced megatron's GroupedMLP
    calls = result["calls"]
    assert calls["mindspeed.npu_gmm"] == 4 and calls["mindspeed.npu_gmm_backward"] == 4  # fc1 / fc2 x 2 layers
    assert calls["npu_swiglu"] == 2  # the experts' activation is MindSpeed's fused SwiGLU
    assert result["grad_norm"] > 0
