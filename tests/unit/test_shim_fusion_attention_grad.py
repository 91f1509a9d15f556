"""The shim's ``torch_npu.npu_fusion_attention_grad`` (gspo_ascend.device.shim.npu_ops), the backward MindSpeed's ring
context parallelism calls for every KV block (``ring_context_parallel.py``), held to autograd of the forward
reference in float64. Its signature is checked against torch-npu 2.7.1's schema by tests/conformance."""

from __future__ import annotations

import pytest
import torch

from gspo_ascend.device.shim import npu_ops

B, N, NKV, SQ, SKV, D = 2, 4, 2, 6, 6, 8


def _layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """[B, N, S, D] -> the layout's tensor."""
    b, n, s, d = t.shape
    if layout == "BNSD":
        return t
    if layout == "BSND":
        return t.transpose(1, 2)
    if layout == "BSH":
        return t.transpose(1, 2).reshape(b, s, n * d)
    return t.permute(2, 0, 1, 3).reshape(s, b, n * d)  # SBH


def _inputs(seed: int, layout: str):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, N, SQ, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, NKV, SKV, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, NKV, SKV, D, generator=g, dtype=torch.float64)
    dy = torch.randn(B, N, SQ, D, generator=g, dtype=torch.float64)
    return [_layout(t, layout).contiguous() for t in (q, k, v, dy)]


def _autograd(q, k, v, dy, **kwargs):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = npu_ops.npu_fusion_attention(q, k, v, N, **kwargs)[0]
    return torch.autograd.grad(out, (q, k, v), dy)


MASKS = {
    "none": {},
    "band": {"sparse_mode": 0, "pre_tockens": 2, "next_tockens": 0},  # with the explicit causal mask below
    "causal_compressed": {"sparse_mode": 2},
    "bottom_right": {"sparse_mode": 3},
}


def _mask_kwargs(kind: str) -> dict:
    kwargs = dict(MASKS[kind])
    if kind == "band":
        kwargs["atten_mask"] = torch.triu(torch.ones(SQ, SKV, dtype=torch.bool), 1)
    elif kind != "none":
        kwargs["atten_mask"] = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1)
    return kwargs


@pytest.mark.parametrize("layout", ["BNSD", "BSND", "BSH", "SBH"])
@pytest.mark.parametrize("mask", sorted(MASKS))
@pytest.mark.parametrize("with_stats", [True, False])
def test_grad_equals_autograd_of_the_forward(layout, mask, with_stats):
    with npu_ops.float64_reference():
        q, k, v, dy = _inputs(0, layout)
        kwargs = {"input_layout": layout, "scale": 0.3, **_mask_kwargs(mask)}
        want = _autograd(q, k, v, dy, **kwargs)
        stats = {}
        if with_stats:  # what MindSpeed passes: the forward's outputs 1, 2 and 0
            out, smax, ssum, *_ = npu_ops.npu_fusion_attention(q, k, v, N, **kwargs)
            stats = {"softmax_max": smax, "softmax_sum": ssum, "attention_in": out}
        grad_kwargs = {k_: v_ for k_, v_ in kwargs.items() if k_ not in ("input_layout", "scale")}
        got = npu_ops.npu_fusion_attention_grad(q, k, v, dy, N, layout, scale_value=0.3, **grad_kwargs, **stats)
    assert len(got) == 5 and got[3].numel() == 0 and got[4].numel() == 0  # (dq, dk, dv, dpse, dsink): 2.10
    # the forward's softmax statistics are float32 (as on the NPU): the gradient from them is exact to fp32
    # rounding; recomputed (no statistics) it is exact in float64
    tol = 1e-6 if with_stats else 1e-12
    for g, w, x in zip(got[:3], want, (q, k, v), strict=True):
        assert g.shape == x.shape
        assert torch.allclose(g, w, atol=tol, rtol=tol)


def test_ring_blocks_with_the_global_statistics_add_up_to_the_full_gradient():
    """MindSpeed's ring attention: each KV block's backward gets the statistics and output of the whole
    attention; dq sums over blocks, dk / dv are each block's slice of the full gradient."""
    with npu_ops.float64_reference():
        q, k, v, dy = _inputs(1, "SBH")  # [S, B, N*D]
        mask = torch.triu(torch.ones(SQ, SKV, dtype=torch.bool), 1)  # causal over the whole key range
        want = _autograd(q, k, v, dy, input_layout="SBH", atten_mask=mask, sparse_mode=1)
        out, smax, ssum, *_ = npu_ops.npu_fusion_attention(q, k, v, N, "SBH", atten_mask=mask, sparse_mode=1)
        dq = torch.zeros_like(q)
        dks, dvs = [], []
        for lo, hi in ((0, SKV // 2), (SKV // 2, SKV)):
            block = npu_ops.npu_fusion_attention_grad(
                q, k[lo:hi], v[lo:hi], dy, N, "SBH", atten_mask=mask[:, lo:hi], sparse_mode=1,
                softmax_max=smax, softmax_sum=ssum, attention_in=out,
            )  # fmt: skip
            dq += block[0]
            dks.append(block[1])
            dvs.append(block[2])
    for got, full in ((dq, want[0]), (torch.cat(dks), want[1]), (torch.cat(dvs), want[2])):
        assert torch.allclose(got, full, atol=1e-6, rtol=1e-6)  # fp32 statistics (see above)
        assert (got - full).abs().max() < 1e-3 * full.abs().max()  # and a wrong normalisation would be O(1)


@pytest.mark.parametrize("softmax_layout", ["", "TND"])
def test_tnd_varlen_grad_equals_autograd(softmax_layout):
    g = torch.Generator().manual_seed(2)
    with npu_ops.float64_reference():
        q = torch.randn(7, N, D, generator=g, dtype=torch.float64)  # two sequences: 3 + 4 tokens
        k = torch.randn(7, NKV, D, generator=g, dtype=torch.float64)
        v = torch.randn(7, NKV, D, generator=g, dtype=torch.float64)
        dy = torch.randn(7, N, D, generator=g, dtype=torch.float64)
        mask = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1)
        kwargs = {"atten_mask": mask, "sparse_mode": 3, "actual_seq_qlen": [3, 7], "actual_seq_kvlen": [3, 7]}
        want = _autograd(q, k, v, dy, input_layout="TND", **kwargs)
        out, smax, ssum, *_ = npu_ops.npu_fusion_attention(q, k, v, N, "TND", softmax_layout=softmax_layout, **kwargs)
        got = npu_ops.npu_fusion_attention_grad(
            q, k, v, dy, N, "TND", softmax_max=smax, softmax_sum=ssum, attention_in=out,
            softmax_layout=softmax_layout, **kwargs,
        )  # fmt: skip
    for a, b in zip(got[:3], want, strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-6)  # fp32 statistics


def test_bf16_returns_query_dtype_computed_in_fp32():
    q, k, v, dy = (t.to(torch.bfloat16) for t in _inputs(3, "BNSD"))
    dq, dk, dv, dpse, _dsink = npu_ops.npu_fusion_attention_grad(q, k, v, dy, N, "BNSD", scale_value=0.3)
    assert dq.dtype == dk.dtype == dv.dtype == torch.bfloat16 and dpse.numel() == 0
    ref = _autograd(*(t.float() for t in (q, k, v, dy)), input_layout="BNSD", scale=0.3)
    assert torch.allclose(dq.float(), ref[0], atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"keep_prob": 0.9}, "dropout"),
        ({"pse": torch.zeros(1)}, "pse"),
        ({"softmax_max": torch.zeros(B, N, SQ, 8)}, "together"),
    ],
)
def test_refuses_what_the_forward_refuses(kwargs, message):
    q, k, v, dy = (t.float() for t in _inputs(4, "BNSD"))
    with pytest.raises(ValueError, match=message):
        npu_ops.npu_fusion_attention_grad(q, k, v, dy, N, "BNSD", **kwargs)
