"""The shim's CPU references for MindSpeed's own compiled ops (gspo_ascend.device.shim.mindspeed_ops)."""

from __future__ import annotations

import pytest


def _rope_reference(x, cos, sin, interleaved):
    """Hand-written: pairs (first half, second half) or (even, odd) rotate by the angle whose cos / sin are given."""
    import torch

    if interleaved:
        x1, x2 = x[..., ::2], x[..., 1::2]
        rotated = torch.stack((-x2, x1), dim=-1).flatten(-2)
    else:
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


@pytest.mark.parametrize("mode", [0, 1])
def test_rotary_position_embedding_matches_formula_and_gradients(mode):
    import torch

    from gspo_ascend.device.shim import mindspeed_ops, npu_ops

    g = torch.Generator().manual_seed(0)
    with npu_ops.float64_reference():
        x = torch.randn(5, 2, 3, 8, dtype=torch.float64, generator=g, requires_grad=True)  # [S, B, N, D]
        theta = torch.randn(5, 1, 1, 4, dtype=torch.float64, generator=g)  # one angle per rotated pair
        angles = theta.repeat_interleave(2, dim=-1) if mode == 1 else torch.cat((theta, theta), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        y = mindspeed_ops.npu_rotary_position_embedding(x, cos, sin, mode)
        assert torch.allclose(y, _rope_reference(x, cos, sin, mode == 1), atol=1e-12)
        assert torch.autograd.gradcheck(lambda t: mindspeed_ops.npu_rotary_position_embedding(t, cos, sin, mode), (x,))
    # a rotation keeps the norm of every pair
    y32 = mindspeed_ops.npu_rotary_position_embedding(x.detach().float(), cos.float(), sin.float(), mode)
    assert torch.allclose(y32.norm(dim=-1), x.detach().float().norm(dim=-1), rtol=1e-5)


@pytest.mark.parametrize(
    ("shape", "cos_shape", "mode", "message"),
    [
        ((5, 2, 8), (5, 1, 8), 0, "4 dimensional"),
        ((5, 2, 3, 7), (5, 1, 1, 7), 0, "even number"),
        ((5, 2, 3, 8), (5, 1, 1, 8), 2, "mode of rotate"),
    ],
)
def test_rotary_position_embedding_refuses_what_mindspeed_refuses(shape, cos_shape, mode, message):
    import torch

    from gspo_ascend.device.shim import mindspeed_ops

    x, cos = torch.ones(shape), torch.ones(cos_shape)
    with pytest.raises(ValueError, match=message):
        mindspeed_ops.npu_rotary_position_embedding(x, cos, cos, mode)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        mindspeed_ops.npu_rotary_position_embedding(torch.ones(5, 2, 3, 8, dtype=torch.float64), cos, cos, 0)


def test_mindspeed_gmm_op_equals_per_group_matmuls(in_one_process):
    """MindSpeed's npu_gmm (torch library op, autograd Function, builder module = the shim's reference), an empty
    group included, against float64 per-group matmuls: output and both gradients."""
    result = in_one_process["gmm"]
    assert result["y"] < 1e-5 * result["scale"]
    assert result["dx"] < 1e-5 * result["scale"] and result["dw"] < 1e-5 * result["scale"]
