"""The shim refuses what the pinned torch_npu (2.10.0.post4; 2.7.1 before issue #41) refuses (issue #14, item 2): one
test per case the old shim accepted, and what 2.10 accepts but the shim does not emulate is refused saying so.

Each limit is a fact of the pinned wheel; tests/conformance/test_torch_npu_conformance.py checks each against
the wheel's schemas, meta registrations and op docs. Here the shim is held to them without the wheel.
"""

from __future__ import annotations

import pytest
import torch

from gspo_ascend.device import shim

BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def tnpu():
    was_installed = shim.is_installed("npu")
    shim.install(npu=True)
    import torch_npu

    yield torch_npu
    if not was_installed:
        shim.uninstall()


def qkv(b=1, s=4, n=2, d=8, dtype=torch.float32):
    return tuple(torch.randn(b, s, n, d, dtype=dtype) for _ in range(3))


@pytest.mark.parametrize("argument", ["sink", "dropout_mask"])
def test_fusion_attention_refuses_the_new_arguments_it_does_not_emulate(tnpu, argument):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=f"{argument}.*not emulated"):
        tnpu.npu_fusion_attention(q, k, v, 2, "BSND", **{argument: torch.zeros(2)})


def test_fusion_attention_takes_the_dropout_seed_and_offset(tnpu):
    """2.10's seed / offset seed the dropout RNG: without dropout (keep_prob=1) they change nothing."""
    q, k, v = qkv()
    plain = tnpu.npu_fusion_attention(q, k, v, 2, "BSND")[0]
    assert torch.equal(plain, tnpu.npu_fusion_attention(q, k, v, 2, "BSND", seed=5, offset=9)[0])


def test_fusion_attention_grad_refuses_a_sink(tnpu):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="sink.*not emulated"):
        tnpu.npu_fusion_attention_grad(q, k, v, q, 2, "BSND", sink=torch.zeros(2))


def test_fusion_attention_limits(tnpu):
    q, k, v = qkv(d=1024)
    with pytest.raises(ValueError, match="head dim must be 1-768"):
        tnpu.npu_fusion_attention(q, k, v, 2, "BSND")
    q, k, v = qkv(n=300)
    with pytest.raises(ValueError, match="head_num must be 1-256"):
        tnpu.npu_fusion_attention(q, k, v, 300, "BSND")
    q, k, v = qkv()
    with pytest.raises(ValueError, match="share one dtype"):
        tnpu.npu_fusion_attention(q, k.to(BF16), v, 2, "BSND")
    with pytest.raises(ValueError, match="float64"):
        tnpu.npu_fusion_attention(q.double(), k.double(), v.double(), 2, "BSND")
    t = torch.randn(1025, 2, 8)
    ends = list(range(1, 1026))  # 1025 one-token sequences: over the 1K sequences a TND call takes
    with pytest.raises(ValueError, match="at most 1024 sequences"):
        tnpu.npu_fusion_attention(t, t, t, 2, "TND", actual_seq_qlen=ends, actual_seq_kvlen=ends)


def test_rotary_refuses_a_rotate_matrix(tnpu):
    x = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match="rotate.*not emulated"):
        tnpu.npu_rotary_mul(x, x, x, rotate=torch.eye(4))


def test_rotary_takes_4d_inputs_only(tnpu):
    x, r = torch.randn(3, 2, 4), torch.randn(3, 1, 4)  # TND / 3-D: accepted by later builds, not 2.7.1
    with pytest.raises(ValueError, match="4-D"):
        tnpu.npu_rotary_mul(x, r, r)


def test_rotary_head_dim_limit(tnpu):
    x, r = torch.randn(1, 1, 2, 896), torch.randn(1, 1, 2, 896)
    with pytest.raises(ValueError, match="< 896"):
        tnpu.npu_rotary_mul(x, r, r)
    ok = tnpu.npu_rotary_mul(x[..., :894], r[..., :894], r[..., :894])  # just under the limit
    assert ok.shape == (1, 1, 2, 894)


def test_rotary_batch_and_heads_limits(tnpu):
    x, r = torch.randn(1000, 1, 2, 4), torch.randn(1, 1, 2, 4)  # B = 1000 in BNSD (11SD cos/sin)
    with pytest.raises(ValueError, match="B, N < 1000"):
        tnpu.npu_rotary_mul(x, r, r)
    x = torch.randn(2, 600, 2, 4)  # B*N = 1200 > 1024: refused only when cos / sin need gradients
    assert tnpu.npu_rotary_mul(x, r, r).shape == x.shape
    with pytest.raises(ValueError, match="B\\*N <= 1024"):
        tnpu.npu_rotary_mul(x, r.clone().requires_grad_(), r)


def test_rotary_cos_sin_must_broadcast_as_documented(tnpu):
    x, r = torch.randn(2, 3, 5, 4), torch.randn(1, 1, 1, 4)  # one position for all: no layout lists it
    with pytest.raises(ValueError, match="does not fit"):
        tnpu.npu_rotary_mul(x, r, r)


def test_grouped_matmul_refuses_the_k_split(tnpu):
    """2.10 accepts group_type=2 (K-split), which the shim does not emulate; 1 is refused by both."""
    x, dy = torch.randn(4, 6), torch.randn(6, 3)
    counts = torch.tensor([2, 4])
    with pytest.raises(ValueError, match="group_type=2 .*not emulated"):
        tnpu.npu_grouped_matmul([x], [dy], group_list=counts, split_item=3, group_type=2, group_list_type=1)
    with pytest.raises(ValueError, match="group_type only supports -1, 0 and 2"):
        tnpu.npu_grouped_matmul([x], [dy], group_list=counts, split_item=3, group_type=1, group_list_type=1)


def test_grouped_matmul_output_dtype_is_torch_npus_int_enum(tnpu):
    """2.10's schema: ``int? output_dtype`` (was ScalarType?): 6 = fp32, a torch.dtype is a TypeError."""
    x, w = torch.randn(5, 3, dtype=BF16), torch.randn(2, 3, 4, dtype=BF16)
    (y,) = tnpu.npu_grouped_matmul([x], [w], group_list=[2, 5], split_item=2, group_type=0, output_dtype=6)
    assert y.dtype == torch.float32
    with pytest.raises(TypeError, match="output_dtype must be an int"):
        tnpu.npu_grouped_matmul([x], [w], group_list=[2, 5], split_item=2, group_type=0, output_dtype=torch.float32)
    with pytest.raises(ValueError, match="int32.*not emulated"):
        tnpu.npu_grouped_matmul([x], [w], group_list=[2, 5], split_item=2, group_type=0, output_dtype=3)


def test_grouped_matmul_group_list_is_int64(tnpu):
    x, w = torch.randn(4, 3), torch.randn(2, 3, 5)
    with pytest.raises(ValueError, match="group_list must be int64"):
        tnpu.npu_grouped_matmul([x], [w], group_list=torch.tensor([1, 3], dtype=torch.int32), group_type=0)


def test_permute_takes_bf16_tokens_and_int64_indices(tnpu):
    tokens, indices = torch.randn(3, 4), torch.tensor([[0, 1], [1, 0], [0, 1]])
    with pytest.raises(ValueError, match="tokens must be bfloat16"):
        tnpu.npu_moe_token_permute(tokens, indices)
    with pytest.raises(ValueError, match="indices must be int64"):
        tnpu.npu_moe_token_permute(tokens.to(BF16), indices.to(torch.int32))
    permuted, _ = tnpu.npu_moe_token_permute(tokens.to(BF16), indices)
    assert permuted.dtype == BF16


def test_unpermute_takes_bf16_tokens_and_probs(tnpu):
    tokens, indices = torch.randn(3, 4, dtype=BF16), torch.tensor([[0, 1], [1, 0], [0, 1]])
    permuted, row_map = tnpu.npu_moe_token_permute(tokens, indices)
    probs = torch.full((3, 2), 0.5)
    with pytest.raises(ValueError, match="probs must be bfloat16"):
        tnpu.npu_moe_token_unpermute(permuted, row_map, probs=probs)
    with pytest.raises(ValueError, match="permuted_tokens must be bfloat16"):
        tnpu.npu_moe_token_unpermute(permuted.float(), row_map, probs=probs.to(BF16))
    torch.testing.assert_close(tnpu.npu_moe_token_unpermute(permuted, row_map, probs=probs.to(BF16)), tokens)


def test_rms_norm_gamma_must_share_the_input_dtype(tnpu):
    with pytest.raises(ValueError, match="gamma dtype"):
        tnpu.npu_rms_norm(torch.randn(2, 4, dtype=BF16), torch.ones(4))


def test_top_k_top_p_limits(tnpu):
    logits = torch.randn(2, 8)
    with pytest.raises(ValueError, match="cannot both be None"):
        tnpu.npu_top_k_top_p(logits)
    with pytest.raises(ValueError, match="k must be int32"):
        tnpu.npu_top_k_top_p(logits, k=torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="k must be in"):
        tnpu.npu_top_k_top_p(logits, k=torch.tensor([0, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="p must be"):
        tnpu.npu_top_k_top_p(logits, p=torch.tensor([0.5, 0.5], dtype=BF16))
