"""The CPU shim's torch_npu ops against hand-derived values and unfused pure-torch compositions.

Every op is reached the way production code reaches it: ``import torch_npu`` after ``shim.install()``.
Gradients are compared in float64 with torch.autograd.grad, inside ``npu_ops.float64_reference()`` (no NPU
kernel takes float64; the shim admits it only there). What torch_npu 2.7.1 refuses is tested in
tests/unit/test_shim_torch_npu_limits.py.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from gspo_ascend.device import shim
from gspo_ascend.device.shim import npu_ops

F64 = torch.float64


@pytest.fixture(scope="module")
def tnpu():
    """torch_npu as installed by the shim; uninstalled again unless someone else had installed it."""
    was_installed = shim.is_installed("npu")
    shim.install(npu=True)
    import torch_npu

    with npu_ops.float64_reference():
        yield torch_npu
    if not was_installed:
        shim.uninstall()


def grads(out: torch.Tensor, inputs: tuple[torch.Tensor, ...], seed: int = 0) -> tuple[torch.Tensor, ...]:
    """d(sum(out * g))/d(inputs) for a fixed random cotangent g."""
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad(out, inputs, grad_outputs=g, allow_unused=True, retain_graph=True)


def assert_close_all(actual, expected, **kw) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, **kw)


def leaf(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64).requires_grad_()


# --------------------------------------------------------------------------------------------------------
# npu_rms_norm
# --------------------------------------------------------------------------------------------------------


def test_rms_norm_hand_values(tnpu):
    x = torch.tensor([[1.0, 1.0, 1.0], [2.0, -2.0, 2.0]])  # mean squares 1 and 4 -> rstd 1 and 1/2
    gamma = torch.tensor([1.0, 2.0, 3.0])
    y, rstd = tnpu.npu_rms_norm(x, gamma, epsilon=0.0)
    torch.testing.assert_close(y, torch.tensor([[1.0, 2.0, 3.0], [1.0, -2.0, 3.0]]))
    torch.testing.assert_close(rstd, torch.tensor([[1.0], [0.5]]))
    assert rstd.shape == (2, 1) and rstd.dtype == torch.float32


def test_rms_norm_dtypes_and_keepdim_shape(tnpu):
    x = torch.randn(2, 3, 4, dtype=torch.bfloat16)
    y, rstd = tnpu.npu_rms_norm(x, torch.ones(3, 4, dtype=torch.bfloat16))  # gamma in x's dtype (2.7.1)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert rstd.dtype == torch.float32 and rstd.shape == (2, 1, 1)


def test_rms_norm_matches_unfused_forward_and_backward(tnpu):
    x, gamma = leaf(4, 6, seed=1), leaf(6, seed=2)
    y, _ = tnpu.npu_rms_norm(x, gamma, epsilon=1e-6)
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * gamma
    torch.testing.assert_close(y, ref)
    assert_close_all(grads(y, (x, gamma)), grads(ref, (x, gamma)))


# --------------------------------------------------------------------------------------------------------
# npu_rotary_mul
# --------------------------------------------------------------------------------------------------------


def hf_rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers' rotate_half, written out."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def test_rotary_hand_values(tnpu):
    x = torch.tensor([1.0, 2.0, 3.0, 4.0]).view(1, 1, 1, 4)
    ones, zeros = torch.ones_like(x), torch.zeros_like(x)
    assert tnpu.npu_rotary_mul(x, zeros, ones).flatten().tolist() == [-3.0, -4.0, 1.0, 2.0]  # half (default)
    inter = tnpu.npu_rotary_mul(x, zeros, ones, rotary_mode="interleave")
    assert inter.flatten().tolist() == [-2.0, 1.0, -4.0, 3.0]
    mixed = tnpu.npu_rotary_mul(x, 0.5 * ones, 2.0 * ones, rotary_mode="interleave")
    assert mixed.flatten().tolist() == [-3.5, 3.0, -6.5, 8.0]  # 0.5*x + 2*rotate(x)
    assert torch.equal(tnpu.npu_rotary_mul(x, ones, zeros), x)


def test_rotary_half_matches_hf_forward_and_backward(tnpu):
    b, n, s, d = 2, 3, 5, 8
    x = leaf(b, n, s, d, seed=3)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=F64) / d))
    angles = torch.outer(torch.arange(s, dtype=F64), inv_freq)
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos()[None, None].requires_grad_(), emb.sin()[None, None].requires_grad_()  # [1, 1, S, D]
    out = tnpu.npu_rotary_mul(x, cos, sin)
    ref = x * cos + hf_rotate_half(x) * sin
    torch.testing.assert_close(out, ref)
    assert_close_all(grads(out, (x, cos, sin)), grads(ref, (x, cos, sin)))


def test_rotary_interleave(tnpu):
    # x read as BSND [B=2, S=4, N=3, D=6] with r1/r2 1S1D: the one broadcast interleave mode takes there
    x, cos, sin = leaf(2, 4, 3, 6, seed=4), leaf(1, 4, 1, 6, seed=5), leaf(1, 4, 1, 6, seed=6)
    out = tnpu.npu_rotary_mul(x, cos, sin, rotary_mode="interleave")
    rot = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).reshape(x.shape)
    ref = x * cos + rot * sin
    torch.testing.assert_close(out, ref)
    assert_close_all(grads(out, (x, cos, sin)), grads(ref, (x, cos, sin)))
    with pytest.raises(ValueError, match="rotary_mode"):
        tnpu.npu_rotary_mul(x, cos, sin, rotary_mode="quarter")


# --------------------------------------------------------------------------------------------------------
# npu_swiglu
# --------------------------------------------------------------------------------------------------------


def test_swiglu_hand_values_and_gradients(tnpu):
    out = tnpu.npu_swiglu(torch.tensor([[0.0, 1.0, 2.0, 3.0]]))  # gate [0, 1], up [2, 3]
    torch.testing.assert_close(out, torch.tensor([[0.0, 3.0 / (1.0 + math.exp(-1.0))]]))
    x = leaf(3, 4, 10, seed=7)
    for dim in (-1, 1):
        out = tnpu.npu_swiglu(x, dim=dim)
        a, b = torch.chunk(x, 2, dim=dim)
        ref = F.silu(a) * b
        torch.testing.assert_close(out, ref)
        assert_close_all(grads(out, (x,)), grads(ref, (x,)))


# --------------------------------------------------------------------------------------------------------
# npu_fusion_attention
# --------------------------------------------------------------------------------------------------------

COMPRESSED = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)


def sdpa(q, k, v, keep=None, scale=None):
    """Reference on BNSD tensors; keep: True = attend (SDPA's boolean convention)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def qkv(b=2, n=4, nkv=4, sq=6, skv=6, d=8, dv=None, seed=10):
    return leaf(b, n, sq, d, seed=seed), leaf(b, nkv, skv, d, seed=seed + 1), leaf(b, nkv, skv, dv or d, seed=seed + 2)


def check_against_sdpa(tnpu, q, k, v, keep, scale=0.35, **fa_kwargs):
    out = tnpu.npu_fusion_attention(q, k, v, q.shape[1], "BNSD", scale=scale, **fa_kwargs)[0]
    ref = sdpa(q, k, v, keep, scale)
    torch.testing.assert_close(out, ref)
    assert_close_all(grads(out, (q, k, v)), grads(ref, (q, k, v)))


def test_fusion_attention_hand_example(tnpu):
    q = torch.tensor([[[[1.0, 0.0]]]])
    k = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]])
    v = torch.tensor([[[[1.0, 2.0], [3.0, 4.0]]]])
    out, smax, ssum, reserved, seed, offset, numels = tnpu.npu_fusion_attention(q, k, v, 1, "BNSD", scale=1.0)
    p0 = math.e / (math.e + 1)  # scores [1, 0]
    torch.testing.assert_close(out, torch.tensor([[[[p0 + 3 * (1 - p0), 2 * p0 + 4 * (1 - p0)]]]]))
    torch.testing.assert_close(smax, torch.ones(1, 1, 1, 8))  # max(scale * q k^T), replicated 8 times
    torch.testing.assert_close(ssum, torch.full((1, 1, 1, 8), 1 + math.exp(-1)))  # sum exp(s - max)
    assert smax.dtype == ssum.dtype == torch.float32 and reserved.numel() == 0 and (seed, offset, numels) == (0, 0, 0)


def test_fusion_attention_causal_compressed_mask_mode3(tnpu):
    q, k, v = qkv()
    check_against_sdpa(tnpu, q, k, v, torch.ones(6, 6, dtype=torch.bool).tril(), atten_mask=COMPRESSED, sparse_mode=3)
    q, k, v = qkv(sq=3, skv=6)  # rightDownCausal: keep j <= i + (Skv - Sq)
    keep = torch.arange(6)[None, :] <= torch.arange(3)[:, None] + 3
    check_against_sdpa(tnpu, q, k, v, keep, atten_mask=COMPRESSED, sparse_mode=3)


def test_fusion_attention_mode2_is_top_left_causal(tnpu):
    q, k, v = qkv(sq=3, skv=6)
    keep = torch.arange(6)[None, :] <= torch.arange(3)[:, None]
    check_against_sdpa(tnpu, q, k, v, keep, atten_mask=COMPRESSED, sparse_mode=2)


def test_fusion_attention_explicit_causal_mask_mode0(tnpu):
    q, k, v = qkv()
    mask = torch.triu(torch.ones(6, 6, dtype=torch.bool), diagonal=1)  # True = masked out
    check_against_sdpa(tnpu, q, k, v, ~mask, atten_mask=mask, sparse_mode=0)
    check_against_sdpa(tnpu, q, k, v, ~mask, atten_mask=mask.to(torch.uint8)[None, None], sparse_mode=0)


def test_fusion_attention_mode0_band_from_pre_next(tnpu):
    q, k, v = qkv()
    i, j = torch.arange(6)[:, None], torch.arange(6)[None, :]
    keep = (j - i <= 1) & (i - j <= 2)
    no_mask = torch.zeros(6, 6, dtype=torch.bool)
    check_against_sdpa(tnpu, q, k, v, keep, atten_mask=no_mask, sparse_mode=0, pre_tockens=2, next_tockens=1)


def test_fusion_attention_key_padding_mask(tnpu):
    q, k, v = qkv()
    lengths = torch.tensor([6, 3])
    pad = (torch.arange(6)[None, :] >= lengths[:, None])[:, None, None, :].expand(2, 1, 6, 6)  # [B, 1, S, S]
    check_against_sdpa(tnpu, q, k, v, ~pad, atten_mask=pad, sparse_mode=1)


def test_fusion_attention_gqa(tnpu):
    q, k, v = qkv(n=6, nkv=2)
    check_against_sdpa(tnpu, q, k, v, None)
    check_against_sdpa(tnpu, q, k, v, torch.ones(6, 6, dtype=torch.bool).tril(), atten_mask=COMPRESSED, sparse_mode=3)


def test_fusion_attention_smaller_value_head_dim(tnpu):
    q, k, v = qkv(dv=4)
    check_against_sdpa(tnpu, q, k, v, None)


def to_layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    b, n, s, d = t.shape
    return {
        "BNSD": t,
        "BSND": t.transpose(1, 2),
        "BSH": t.transpose(1, 2).reshape(b, s, n * d),
        "SBH": t.permute(2, 0, 1, 3).reshape(s, b, n * d),
    }[layout]


@pytest.mark.parametrize("layout", ["BSH", "SBH", "BSND", "BNSD"])
def test_fusion_attention_layouts(tnpu, layout):
    q, k, v = qkv(n=4, nkv=2, sq=5, skv=5, dv=4)
    mask = torch.triu(torch.ones(5, 5, dtype=torch.bool), diagonal=1)
    out, smax, ssum, *_ = tnpu.npu_fusion_attention(
        to_layout(q, layout), to_layout(k, layout), to_layout(v, layout), 4, layout, atten_mask=mask, scale=0.3
    )
    ref = sdpa(q, k, v, ~mask, 0.3)
    torch.testing.assert_close(out, to_layout(ref, layout))
    assert smax.shape == ssum.shape == (2, 4, 5, 8)
    assert_close_all(grads(out, (q, k, v)), grads(to_layout(ref, layout), (q, k, v)))


def test_fusion_attention_tnd_varlen(tnpu):
    n, nkv, d = 4, 2, 8
    lens_q, lens_kv = [3, 1, 4], [3, 2, 4]
    q, k, v = leaf(sum(lens_q), n, d, seed=20), leaf(sum(lens_kv), nkv, d, seed=21), leaf(sum(lens_kv), nkv, d, seed=22)
    cum_q = [3, 4, 8, 0]  # a trailing zero: no further batches
    cum_kv = [3, 5, 9, 0]
    out, smax, ssum, *_ = tnpu.npu_fusion_attention(
        q, k, v, n, "TND", atten_mask=COMPRESSED, sparse_mode=3, scale=0.4,
        actual_seq_qlen=cum_q, actual_seq_kvlen=cum_kv, softmax_layout="TND",
    )  # fmt: skip
    pieces, qs, ks = [], 0, 0
    for lq, lk in zip(lens_q, lens_kv, strict=True):
        keep = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
        qi, ki, vi = (t.permute(1, 0, 2)[None] for t in (q[qs : qs + lq], k[ks : ks + lk], v[ks : ks + lk]))
        pieces.append(sdpa(qi, ki, vi, keep, 0.4)[0].permute(1, 0, 2))
        qs, ks = qs + lq, ks + lk
    ref = torch.cat(pieces)
    torch.testing.assert_close(out, ref)
    assert_close_all(grads(out, (q, k, v)), grads(ref, (q, k, v)))
    assert smax.shape == ssum.shape == (8, n, 8)
    # the default softmax_layout keeps the documented [T, N, 8] shape with NTD storage order
    default = tnpu.npu_fusion_attention(q, k, v, n, "TND", scale=0.4, actual_seq_qlen=cum_q, actual_seq_kvlen=cum_kv)
    assert default[1].shape == (8, n, 8)
    tnd = tnpu.npu_fusion_attention(
        q, k, v, n, "TND", scale=0.4, actual_seq_qlen=cum_q, actual_seq_kvlen=cum_kv, softmax_layout="TND"
    )
    torch.testing.assert_close(default[1].reshape(n, 8, 8), tnd[1].transpose(0, 1))


def test_fusion_attention_fully_masked_rows_are_zero(tnpu):
    q, k, v = qkv(b=1, n=2, nkv=2, sq=4, skv=4)
    mask = torch.zeros(4, 4, dtype=torch.bool)
    mask[1] = True  # query row 1 may attend to nothing
    out = tnpu.npu_fusion_attention(q, k, v, 2, "BNSD", atten_mask=mask, scale=0.5)[0]
    assert torch.equal(out[:, :, 1], torch.zeros_like(out[:, :, 1]))
    ref = sdpa(q, k, v, ~mask, 0.5)
    rows = [0, 2, 3]
    torch.testing.assert_close(out[:, :, rows], ref[:, :, rows])
    assert all(torch.isfinite(g).all() for g in grads(out, (q, k, v)))


def test_low_precision_inputs_keep_their_dtype(tnpu):
    q, k, v = (t.detach().to(torch.bfloat16) for t in qkv(n=4, nkv=2))
    out = tnpu.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=COMPRESSED, sparse_mode=3, scale=0.35)[0]
    ref = sdpa(q.float(), k.float(), v.float(), torch.ones(6, 6, dtype=torch.bool).tril(), 0.35)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    x, w = torch.randn(5, 3, dtype=torch.bfloat16), torch.randn(2, 3, 4, dtype=torch.bfloat16)
    y = tnpu.npu_grouped_matmul([x], [w], group_list=[2, 3], split_item=2, group_type=0, group_list_type=1)[0]
    assert y.dtype == torch.bfloat16 and y.shape == (5, 4)
    y32 = tnpu.npu_grouped_matmul(
        [x], [w], group_list=[2, 5], split_item=2, group_type=0, output_dtype=6
    )  # 6: fp32 (2.10: an int enum)
    assert y32[0].dtype == torch.float32
    torch.testing.assert_close(y32[0][:2], x[:2].float() @ w[0].float())


def test_fusion_attention_refuses_what_it_does_not_emulate(tnpu):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="keep_prob"):
        tnpu.npu_fusion_attention(q, k, v, 4, "BNSD", keep_prob=0.9)
    with pytest.raises(ValueError, match="pse"):
        tnpu.npu_fusion_attention(q, k, v, 4, "BNSD", pse=torch.zeros(2, 4, 6, 6, dtype=F64))
    with pytest.raises(ValueError, match="compressed"):
        tnpu.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=torch.ones(6, 6).triu(1).bool(), sparse_mode=3)
    with pytest.raises(ValueError, match="head"):
        tnpu.npu_fusion_attention(q, k[:, :3], v[:, :3], 4, "BNSD")


# --------------------------------------------------------------------------------------------------------
# npu_grouped_matmul
# --------------------------------------------------------------------------------------------------------

COUNTS = [2, 0, 5]  # includes an empty group
CUMSUM = [2, 2, 7]


@pytest.mark.parametrize(("group_list", "group_list_type"), [(COUNTS, 1), (CUMSUM, 0), (torch.tensor(CUMSUM), 0)])
def test_grouped_matmul_m_split(tnpu, group_list, group_list_type):
    x, w = leaf(7, 3, seed=30), leaf(3, 3, 4, seed=31)  # x [M, K], w [E, K, N]
    kw = dict(group_list=group_list, group_type=0, group_list_type=group_list_type)
    out = tnpu.npu_grouped_matmul([x], [w], split_item=2, **kw)
    assert isinstance(out, list) and len(out) == 1 and out[0].shape == (7, 4)
    starts = [0, *CUMSUM[:-1]]
    ref = torch.cat([x[s:e] @ w[g] for g, (s, e) in enumerate(zip(starts, CUMSUM, strict=True))])
    torch.testing.assert_close(out[0], ref)
    assert_close_all(grads(out[0], (x, w)), grads(ref, (x, w)))
    per_group = tnpu.npu_grouped_matmul([x], [w], split_item=0, **kw)
    assert [t.shape for t in per_group] == [(2, 4), (0, 4), (5, 4)]
    torch.testing.assert_close(torch.cat(per_group), ref)


def test_grouped_matmul_weight_list_with_bias(tnpu):
    x = leaf(7, 3, seed=32)
    ws, bs = [leaf(3, 4, seed=33 + g) for g in range(3)], [leaf(4, seed=40 + g) for g in range(3)]
    out = tnpu.npu_grouped_matmul([x], ws, bias=bs, group_list=COUNTS, split_item=3, group_type=0, group_list_type=1)[0]
    starts = [0, *CUMSUM[:-1]]
    ref = torch.cat([x[s:e] @ ws[g] + bs[g] for g, (s, e) in enumerate(zip(starts, CUMSUM, strict=True))])
    torch.testing.assert_close(out, ref)
    assert_close_all(grads(out, (x, *ws, *bs)), grads(ref, (x, *ws, *bs)))


def test_grouped_matmul_dx_form_of_verls_backward(tnpu):
    """verl's NPUGmmFunction computes dx = gmm(dy, w^T) (M-split), which equals autograd's; its dw form, the
    K-split gmm(x^T, dy, group_type=2), is refused by torch_npu 2.7.1 (tests/unit/test_shim_torch_npu_limits.py)."""
    x, w = leaf(7, 3, seed=60), leaf(3, 3, 4, seed=61)
    kw = dict(group_list=COUNTS, group_list_type=1)
    y = tnpu.npu_grouped_matmul([x], [w], split_item=2, group_type=0, **kw)[0]
    dy = torch.randn(7, 4, dtype=F64)
    dx_auto, _ = torch.autograd.grad(y, (x, w), dy)
    dx = tnpu.npu_grouped_matmul([dy], [w.transpose(1, 2)], split_item=2, group_type=0, **kw)[0]
    torch.testing.assert_close(dx, dx_auto)


def test_grouped_matmul_pairwise_and_refusals(tnpu):
    xs, ws = [leaf(2, 3, seed=70), leaf(4, 3, seed=71)], [leaf(3, 5, seed=72), leaf(3, 5, seed=73)]
    outs = tnpu.npu_grouped_matmul(xs, ws)
    assert_close_all(outs, [xs[0] @ ws[0], xs[1] @ ws[1]])
    torch.testing.assert_close(tnpu.npu_grouped_matmul(xs, ws, split_item=2)[0], torch.cat(outs))
    with pytest.raises(ValueError, match="quantisation"):
        tnpu.npu_grouped_matmul(xs, ws, scale=[torch.ones(5)])
    with pytest.raises(ValueError, match="groups"):
        tnpu.npu_grouped_matmul([xs[0]], [leaf(2, 3, 5)], group_list=[1, 1, 0], group_type=0, group_list_type=1)


# --------------------------------------------------------------------------------------------------------
# MoE routing: permute / unpermute, gating top-k, init / finalize routing
# --------------------------------------------------------------------------------------------------------


def megatron_permute(tokens, indices, num_out_tokens=None):
    topk = indices.shape[1]
    order = torch.argsort(indices.reshape(-1), stable=True)
    if num_out_tokens is not None:
        order = order[:num_out_tokens]
    return tokens.index_select(0, order // topk), order


def megatron_unpermute(permuted, order, probs):
    out = torch.zeros(probs.numel(), permuted.shape[-1], dtype=permuted.dtype)
    out = out.index_copy(0, order, permuted).reshape(-1, probs.shape[1], permuted.shape[-1])
    return (out * probs.unsqueeze(-1)).sum(dim=1)


def test_permute_hand_example(tnpu):
    bf16 = torch.bfloat16  # the only token dtype torch_npu 2.7.1's permute takes; these values are exact in it
    tokens = torch.tensor([[10.0], [20.0], [30.0]], dtype=bf16)
    indices = torch.tensor([[1, 0], [2, 0], [1, 2]])  # int64; flat experts [1, 0, 2, 0, 1, 2]
    permuted, sorted_indices = tnpu.npu_moe_token_permute(tokens, indices)
    assert permuted.flatten().tolist() == [10.0, 20.0, 10.0, 30.0, 20.0, 30.0]  # expert 0, 0, 1, 1, 2, 2
    assert sorted_indices.tolist() == [2, 0, 4, 1, 3, 5] and sorted_indices.dtype == torch.int32
    probs = torch.tensor([[0.25, 0.75], [0.5, 0.5], [1.0, 0.0]], dtype=bf16)
    restored = tnpu.npu_moe_token_unpermute(2 * permuted, sorted_indices, probs=probs)
    torch.testing.assert_close(restored, 2 * tokens)  # each token's probs sum to 1


@pytest.mark.parametrize("num_out_tokens", [None, 7, -3])
def test_permute_unpermute_match_megatron(tnpu, num_out_tokens):
    n, topk, experts = 6, 2, 4
    tokens, probs = leaf(n, 5, seed=80), leaf(n, topk, seed=81)
    indices = torch.stack(
        [torch.randperm(experts, generator=torch.Generator().manual_seed(i))[:topk] for i in range(n)]
    )
    permuted, sorted_indices = tnpu.npu_moe_token_permute(tokens, indices, num_out_tokens=num_out_tokens)
    kept = None if num_out_tokens is None else (num_out_tokens if num_out_tokens > 0 else n * topk + num_out_tokens)
    ref_permuted, order = megatron_permute(tokens, indices, kept)
    torch.testing.assert_close(permuted, ref_permuted)
    assert torch.equal(sorted_indices.long(), torch.argsort(torch.argsort(indices.reshape(-1), stable=True)))
    assert_close_all(grads(permuted, (tokens,)), grads(ref_permuted, (tokens,)))
    restored = tnpu.npu_moe_token_unpermute(permuted, sorted_indices, probs=probs)
    ref_restored = megatron_unpermute(ref_permuted, order, probs)
    torch.testing.assert_close(restored, ref_restored)
    assert_close_all(grads(restored, (tokens, probs)), grads(ref_restored, (tokens, probs)))
    if num_out_tokens is None:  # round trip: top-k copies weighted by probs
        torch.testing.assert_close(restored, tokens * probs.sum(-1, keepdim=True))
    with pytest.raises(ValueError, match="padded_mode"):
        tnpu.npu_moe_token_permute(tokens, indices, padded_mode=True)


def test_gating_top_k_softmax_hand_example(tnpu):
    x = torch.tensor([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0], [0.0, 0.0, 5.0]])
    y, expert_idx, row_idx = tnpu.npu_moe_gating_top_k_softmax(x, k=2)
    e = [math.exp(v) for v in (1.0, 2.0, 3.0)]
    p_top, p_mid = e[2] / sum(e), e[1] / sum(e)  # not renormalised over the top-k
    torch.testing.assert_close(y[:2], torch.tensor([[p_top, p_mid], [p_top, p_mid]]))
    assert expert_idx[:2].tolist() == [[2, 1], [0, 1]]
    assert row_idx.tolist() == [[0, 3], [1, 4], [2, 5]]  # arange(N*k).view(k, N).T
    assert expert_idx.dtype == row_idx.dtype == torch.int32
    finished = torch.tensor([False, True, False])
    _, idx_finished, _ = tnpu.npu_moe_gating_top_k_softmax(x, finished, k=2)
    assert idx_finished[1].tolist() == [3, 3] and idx_finished[0].tolist() == [2, 1]


def test_init_routing_hand_example(tnpu):
    x = torch.tensor([[0.1] * 4, [0.2] * 4, [0.3] * 4])  # torch_npu's documented example
    row_idx = torch.tensor([[0, 3], [1, 4], [2, 5]], dtype=torch.int32)
    expert_idx = torch.tensor([[1, 2], [0, 1], [0, 2]], dtype=torch.int32)
    expanded_x, expanded_row_idx, expanded_expert_idx = tnpu.npu_moe_init_routing(x, row_idx, expert_idx, 3)
    assert expanded_expert_idx.tolist() == [0, 0, 1, 1, 2, 2]
    assert expanded_row_idx.tolist() == [2, 0, 1, 4, 3, 5]
    torch.testing.assert_close(expanded_x, x[[1, 2, 0, 1, 0, 2]])
    assert expanded_row_idx.dtype == expanded_expert_idx.dtype == torch.int32
    assert tnpu.npu_moe_init_routing(x, row_idx, expert_idx, 2)[0].shape == (4, 4)  # min(N, active) * k rows


def test_init_and_finalize_routing_round_trip_against_naive_loop(tnpu):
    n, hidden, experts, k = 5, 3, 4, 2
    x, skip, bias, logits = (
        leaf(n, hidden, seed=90),
        leaf(n, hidden, seed=91),
        leaf(experts, hidden, seed=92),
        leaf(n, experts, seed=93),
    )
    scales, expert_idx, row_idx = tnpu.npu_moe_gating_top_k_softmax(logits, k=k)
    expanded_x, expanded_row_idx, expanded_expert_idx = tnpu.npu_moe_init_routing(x, row_idx, expert_idx, n)
    expert_out = expanded_x * (expanded_expert_idx.to(F64) + 1).unsqueeze(-1)  # expert e multiplies by e + 1
    out = tnpu.npu_moe_finalize_routing(expert_out, skip, None, bias, scales, expanded_row_idx, expert_idx)
    naive = []
    for i in range(n):
        row = skip[i]
        for j in range(k):
            e = int(expert_idx[i, j])
            row = row + scales[i, j] * (x[i] * (e + 1) + bias[e])
        naive.append(row)
    ref = torch.stack(naive)
    torch.testing.assert_close(out, ref)
    assert_close_all(grads(out, (x, skip, bias, logits)), grads(ref, (x, skip, bias, logits)))
    row_order = expanded_row_idx.view(k, n).t().reshape(-1)  # drop_pad_mode 2: [i*K + k] instead of [i + k*N]
    out_rows = tnpu.npu_moe_finalize_routing(expert_out, skip, None, bias, scales, row_order, expert_idx, 2)
    torch.testing.assert_close(out_rows, ref)


# --------------------------------------------------------------------------------------------------------
# npu_top_k_top_p (vllm-ascend's sampler on 910B)
# --------------------------------------------------------------------------------------------------------


def test_top_k_top_p_hand_example(tnpu):
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 1.0]])
    inf = float("-inf")
    k = torch.tensor([2, 4], dtype=torch.int32)
    # row 0 keeps its 2 largest (3, 2); row 1 keeps all 4
    assert tnpu.npu_top_k_top_p(logits, None, k).tolist() == [[inf, 3.0, 2.0, inf], [0.0, 0.0, 5.0, 1.0]]
    # top-p 0.9 on row 1: softmax of (0, 0, 1, 5) ascending -> cumulative 0.0065, 0.0131, 0.0308, 1.0; the first
    # three are <= 0.1 and go, only 5.0 stays; row 0 with p = 1.0 drops nothing (cumulative <= 0 never holds)
    p = torch.tensor([1.0, 0.9])
    assert tnpu.npu_top_k_top_p(logits, p, None).tolist() == [[1.0, 3.0, 2.0, 0.0], [inf, inf, 5.0, inf]]


def test_top_k_top_p_equals_vllms_reference(tnpu):
    """The formula vLLM's pure-torch apply_top_k_top_p implements (sort ascending, mask, scatter back)."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 50, generator=gen)
    k = torch.randint(1, 50, (6,), generator=gen, dtype=torch.int32)
    p = torch.rand(6, generator=gen) * 0.5 + 0.4
    srt, idx = logits.sort(dim=-1, descending=False)
    srt = srt.masked_fill(srt < srt.gather(1, (50 - k.long()).unsqueeze(1)), float("-inf"))
    cum = srt.softmax(-1).cumsum(-1)
    mask = cum <= 1 - p.unsqueeze(1)
    mask[:, -1] = False
    expected = srt.masked_fill(mask, float("-inf")).scatter(-1, idx, srt.masked_fill(mask, float("-inf")))
    assert torch.equal(tnpu.npu_top_k_top_p(logits, p, k), expected)
