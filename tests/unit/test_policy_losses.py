"""Policy losses: closed-form values, the paper's gradient, GSPO == GSPO-token, micro-batch equivalence,
padding isolation, numerical safety, metrics and input validation.

Expected numbers are derived by hand in the comments and evaluated with ``math``, never by calling the
implementation on the same inputs.
"""

from __future__ import annotations

import math

import pytest
import torch

from gspo_ascend.algorithms import (
    AGG_MODES,
    POLICY_LOSSES,
    count_tokens_and_seqs,
    get_policy_loss,
    grpo_loss,
    gspo_loss,
    gspo_token_loss,
)

F64 = torch.float64
LOSS_NAMES = tuple(POLICY_LOSSES)


# ------------------------------------------------------------------------------------------ hand example
# Two sequences, T = 3, old_log_prob = 0 so delta = log_prob.
#   seq 0: mask [1, 1, 0], delta [0.1, 0.3, (pad)],  L0 = 2, mean log-ratio 0.2,  s0 = e^0.2  = 1.221403
#   seq 1: mask [1, 1, 1], delta [-0.3, 0, -0.3],    L1 = 3, mean log-ratio -0.2, s1 = e^-0.2 = 0.818731
# advantages A = [+1, -2]; clip_low = clip_high = 0.2, so the trust region is [0.8, 1.2].
def hand_batch(pad_value: float = 0.0):
    log_prob = torch.tensor([[0.1, 0.3, pad_value], [-0.3, 0.0, -0.3]], dtype=F64, requires_grad=True)
    old = torch.zeros(2, 3, dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    adv = torch.tensor([1.0, -2.0], dtype=F64)
    return log_prob, old, adv, mask


def from_row_sums(sigma: tuple[float, float], lengths=(2, 3), T: int = 3) -> dict[str, float]:
    """The four aggregation formulas, written out for two non-empty sequences."""
    return {
        "token-mean": (sigma[0] + sigma[1]) / (lengths[0] + lengths[1]),
        "seq-mean-token-mean": (sigma[0] / lengths[0] + sigma[1] / lengths[1]) / 2,
        "seq-mean-token-sum": (sigma[0] + sigma[1]) / 2,
        "seq-mean-token-sum-norm": (sigma[0] + sigma[1]) / (2 * T),
    }


# GSPO: seq 0: A > 0 and s0 = 1.2214 > 1.2 -> clipped branch: l0 = -(1.2 * 1) = -1.2
#       seq 1: A < 0 and s1 = 0.8187 > 0.8 -> unclipped:      l1 = -(s1 * -2) = 2 e^-0.2 = 1.637462
#       broadcast to tokens: sigma0 = 2 * l0 = -2.4, sigma1 = 3 * l1
L0_GSPO = -1.2
L1_GSPO = 2 * math.exp(-0.2)
GSPO_EXPECTED = from_row_sums((2 * L0_GSPO, 3 * L1_GSPO))
# e.g. seq-mean-token-mean = (-1.2 + 1.637462) / 2 = 0.218731 (the paper's (1/G) sum_i)
#      token-mean          = (-2.4 + 4.912385) / 5 = 0.502477

# GRPO token ratios r = e^delta:
#   seq 0 (A = +1): r = e^0.1 = 1.105171 (inside)        -> l = -1.105171
#                   r = e^0.3 = 1.349859 > 1.2 (clipped)  -> l = -1.2            sigma0 = -2.305171
#   seq 1 (A = -2): r = e^-0.3 = 0.740818 < 0.8 (clipped) -> l = -(0.8 * -2) = 1.6
#                   r = 1 (inside)                        -> l = 2
#                   r = e^-0.3 (clipped)                  -> l = 1.6              sigma1 = 5.2
GRPO_EXPECTED = from_row_sums((-math.exp(0.1) - 1.2, 1.6 + 2.0 + 1.6))

# GSPO-token with per-token advantages A_t: seq 0 [+1, +1], seq 1 [-2, +2, -2]; every ratio has value s_i
#   seq 0: s0 = 1.2214 > 1.2 with A > 0 -> clipped, l = -1.2 per token     sigma0 = -2.4
#   seq 1: s1 = 0.8187 in [0.8, 1.2]    -> l = -s1 * A_t = (2 s1, -2 s1, 2 s1)   sigma1 = 2 s1
GSPO_TOKEN_EXPECTED = from_row_sums((-2.4, 2 * math.exp(-0.2)))


@pytest.mark.parametrize("agg_mode", AGG_MODES)
def test_gspo_closed_form(agg_mode):
    loss, _ = gspo_loss(*hand_batch(), clip_low=0.2, clip_high=0.2, agg_mode=agg_mode)
    assert loss.item() == pytest.approx(GSPO_EXPECTED[agg_mode], abs=1e-12)


@pytest.mark.parametrize("agg_mode", AGG_MODES)
def test_gspo_token_level_advantages_reduce_to_the_sequence_advantage(agg_mode):
    # broadcast GRPO advantages [B, T] (garbage on padding): masked mean per sequence = A_i
    log_prob, old, _, mask = hand_batch()
    adv_t = torch.tensor([[1.0, 1.0, -50.0], [-2.0, -2.0, -2.0]], dtype=F64)
    loss, _ = gspo_loss(log_prob, old, adv_t, mask, clip_low=0.2, clip_high=0.2, agg_mode=agg_mode)
    assert loss.item() == pytest.approx(GSPO_EXPECTED[agg_mode], abs=1e-12)


@pytest.mark.parametrize("agg_mode", AGG_MODES)
def test_grpo_closed_form(agg_mode):
    loss, _ = grpo_loss(*hand_batch(), clip_low=0.2, clip_high=0.2, agg_mode=agg_mode)
    assert loss.item() == pytest.approx(GRPO_EXPECTED[agg_mode], abs=1e-12)


@pytest.mark.parametrize("agg_mode", AGG_MODES)
def test_gspo_token_closed_form_with_token_advantages(agg_mode):
    log_prob, old, _, mask = hand_batch()
    adv_t = torch.tensor([[1.0, 1.0, 99.0], [-2.0, 2.0, -2.0]], dtype=F64)  # 99 sits on padding
    loss, _ = gspo_token_loss(log_prob, old, adv_t, mask, clip_low=0.2, clip_high=0.2, agg_mode=agg_mode)
    assert loss.item() == pytest.approx(GSPO_TOKEN_EXPECTED[agg_mode], abs=1e-12)


@pytest.mark.parametrize("agg_mode", AGG_MODES)
def test_gspo_token_with_broadcast_advantages_equals_gspo_closed_form(agg_mode):
    loss, _ = gspo_token_loss(*hand_batch(), clip_low=0.2, clip_high=0.2, agg_mode=agg_mode)
    assert loss.item() == pytest.approx(GSPO_EXPECTED[agg_mode], abs=1e-12)


def test_norm_length_overrides_padded_length():
    # seq-mean-token-sum-norm with T_norm = 10 instead of mask.shape[-1] = 3: (sigma0 + sigma1) / (2 * 10)
    expected = (2 * L0_GSPO + 3 * L1_GSPO) / 20
    loss, _ = gspo_loss(*hand_batch(), clip_low=0.2, clip_high=0.2, agg_mode="seq-mean-token-sum-norm", norm_length=10)
    assert loss.item() == pytest.approx(expected, abs=1e-12)


def test_dual_clip_grpo_and_gspo():
    # one sequence, delta = [log 4, log 0.5], A = -1, clip 0.2 / 0.27 (region [0.8, 1.27])
    log_prob = torch.tensor([[math.log(4.0), math.log(0.5)]], dtype=F64, requires_grad=True)
    old = torch.zeros(1, 2, dtype=F64)
    mask = torch.ones(1, 2)
    adv = torch.tensor([-1.0], dtype=F64)
    kw = {"clip_low": 0.2, "clip_high": 0.27, "agg_mode": "token-mean"}
    # GRPO token 0: r = 4, A < 0: max(-A r, -A clip(r)) = max(4, 1.27) = 4; dual cap -A c = 3 -> 3
    #      token 1: r = 0.5 < 0.8: max(0.5, 0.8) = 0.8 (low clip); 0.8 < 3 -> 0.8
    loss, m = grpo_loss(log_prob, old, adv, mask, clip_ratio_c=3.0, **kw)
    assert loss.item() == pytest.approx((3.0 + 0.8) / 2, abs=1e-12)
    assert m["dual_clipfrac_token"].item() == pytest.approx(0.5)
    assert m["clipfrac_low_token"].item() == pytest.approx(0.5)
    loss.backward()
    assert log_prob.grad.eq(0).all()  # both tokens are capped by a constant
    loss_off, _ = grpo_loss(log_prob, old, adv, mask, clip_ratio_c=None, **kw)
    assert loss_off.item() == pytest.approx((4.0 + 0.8) / 2, abs=1e-12)  # dual clip off
    # GSPO: s = exp((log 4 + log 0.5) / 2) = sqrt(2) = 1.414214 > 1.27, A < 0 -> unclipped, l = sqrt(2);
    #       with c = 1.3 the dual clip caps it at 1.3
    loss_g, _ = gspo_loss(log_prob, old, adv, mask, clip_ratio_c=None, **kw)
    assert loss_g.item() == pytest.approx(math.sqrt(2), abs=1e-12)
    loss_g, m = gspo_loss(log_prob, old, adv, mask, clip_ratio_c=1.3, **kw)
    assert loss_g.item() == pytest.approx(1.3, abs=1e-12)
    assert m["dual_clipfrac_token"].item() == 1.0


# ---------------------------------------------------------------------------------------------- metrics
def test_gspo_metrics_hand_values():
    _, m = gspo_loss(*hand_batch(), clip_low=0.2, clip_high=0.2)
    for v in m.values():
        assert v.dim() == 0 and not v.requires_grad
    # seq 0 clipped (high), seq 1 not: 1 of 2 sequences, 2 of 5 tokens
    assert m["clipfrac_seq"].item() == pytest.approx(0.5)
    assert m["clipfrac_high_seq"].item() == pytest.approx(0.5)
    assert m["clipfrac_low_seq"].item() == 0.0
    assert m["clipfrac_token"].item() == pytest.approx(2 / 5)
    # seq ratios e^0.2 and e^-0.2: mean cosh(0.2)
    assert m["seq_ratio_mean"].item() == pytest.approx(math.cosh(0.2))
    assert m["seq_ratio_min"].item() == pytest.approx(math.exp(-0.2))
    assert m["seq_ratio_max"].item() == pytest.approx(math.exp(0.2))
    # k3 per token: e^d - 1 - d over d = 0.1, 0.3, -0.3, 0, -0.3, averaged over the 5 tokens
    deltas = (0.1, 0.3, -0.3, 0.0, -0.3)
    k3_token = sum(math.exp(d) - 1 - d for d in deltas) / 5
    assert m["kl_k3_token"].item() == pytest.approx(k3_token)
    # k3 on the sequence log-ratios +-0.2: (e^0.2 - 1.2 + e^-0.2 - 0.8) / 2 = cosh(0.2) - 1
    assert m["kl_k3_seq"].item() == pytest.approx(math.cosh(0.2) - 1)
    # k1 = -mean delta = -(0.1 + 0.3 - 0.3 + 0 - 0.3) / 5 = 0.04
    assert m["ppo_kl_k1_token"].item() == pytest.approx(0.04)
    assert m["num_tokens"].item() == 5 and m["num_seqs"].item() == 2


def test_grpo_metrics_hand_values():
    _, m = grpo_loss(*hand_batch(), clip_low=0.2, clip_high=0.2)
    # clipped tokens: seq 0 token 1 (high); seq 1 tokens 0 and 2 (low)
    assert m["clipfrac_token"].item() == pytest.approx(3 / 5)
    assert m["clipfrac_high_token"].item() == pytest.approx(1 / 5)
    assert m["clipfrac_low_token"].item() == pytest.approx(2 / 5)
    # per sequence: 1/2 and 2/3 of the tokens -> (1/2 + 2/3) / 2 = 7/12
    assert m["clipfrac_seq"].item() == pytest.approx(7 / 12)
    assert m["seq_ratio_mean"].item() == pytest.approx(math.cosh(0.2))
    assert m["dual_clipfrac_token"].item() == 0.0


# -------------------------------------------------------------------------------------------- gradients
def random_batch(B=8, T=12, seed=0, lengths=(12, 7, 1, 4, 0, 9, 12, 3)):
    """float64 batch with one empty row; per-sequence mean log-ratios are set far from the clip edges."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, T)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    old = -torch.rand(B, T, generator=gen, dtype=F64) * 5
    # delta = offset_i + zero-mean noise: offsets +-1e-4 (inside [1-3e-4, 1+4e-4]) or +-2e-3 (outside).
    # With the advantages below: rows 1, 5 clipped low, row 6 clipped high, row 7 outside the region but on
    # the unclipped side (A > 0, s < 1), rows 0, 2 (length 1), 3 inside, row 4 empty.
    offsets = torch.tensor([1e-4, -2e-3, 1e-4, -1e-4, 0.0, -2e-3, 2e-3, -2e-3], dtype=F64)
    noise = (torch.rand(B, T, generator=gen, dtype=F64) - 0.5) * 1e-2
    noise = noise * mask
    noise = noise - (noise.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp_min(1)) * mask
    log_prob = (old + offsets[:, None] + noise).requires_grad_(True)
    adv = torch.tensor([1.0, -0.5, 0.7, -1.3, 2.0, -0.9, 1.1, 0.4], dtype=F64)
    return log_prob, old, adv, mask


CLIP = {"clip_low": 3e-4, "clip_high": 4e-4}


def test_gspo_gradient_matches_paper_formula():
    log_prob, old, adv, mask = random_batch()
    loss, _ = gspo_loss(log_prob, old, adv, mask, agg_mode="seq-mean-token-mean", **CLIP)
    loss.backward()
    # paper: grad J = (1/G) sum_i s_i A_i (1/|y_i|) sum_t grad log pi(y_it) for unclipped sequences, so
    # d loss / d log_prob[i, t] = -(1/G) s_i A_i / |y_i| on response tokens; 0 for clipped ones
    G = sum(1 for i in range(8) if mask[i].sum() > 0)  # empty sequences are not counted: G = 7
    expected = torch.zeros_like(log_prob)
    n_clipped = n_free = 0
    for i in range(8):
        L = int(mask[i].sum())
        if L == 0:
            continue
        mean_log_ratio = math.fsum((log_prob[i, t] - old[i, t]).item() for t in range(L)) / L
        s = math.exp(mean_log_ratio)
        a = adv[i].item()
        clipped = (a > 0 and s > 1 + 4e-4) or (a < 0 and s < 1 - 3e-4)
        n_clipped += clipped
        n_free += not clipped
        if not clipped:
            expected[i, :L] = -(1 / G) * s * a / L
    assert n_clipped >= 2 and n_free >= 2  # the batch exercises both cases
    torch.testing.assert_close(log_prob.grad, expected, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("agg_mode", AGG_MODES)
def test_gspo_token_equals_gspo_value_and_gradient(agg_mode):
    lp1, old, adv, mask = random_batch(seed=1)
    lp2 = lp1.detach().clone().requires_grad_(True)
    adv_t = adv[:, None].expand(-1, mask.shape[1]).contiguous()  # A_it = A_i
    l1, m1 = gspo_loss(lp1, old, adv, mask, agg_mode=agg_mode, **CLIP)
    l2, m2 = gspo_token_loss(lp2, old, adv_t, mask, agg_mode=agg_mode, **CLIP)
    l1.backward()
    l2.backward()
    torch.testing.assert_close(l1, l2, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(lp1.grad, lp2.grad, rtol=1e-12, atol=1e-15)
    for key in ("clipfrac_seq", "clipfrac_token", "seq_ratio_mean", "kl_k3_seq"):
        torch.testing.assert_close(m1[key], m2[key])


def test_on_policy_gspo_and_grpo_gradients_coincide():
    # at pi_theta = pi_old every ratio is 1, nothing is clipped, and both gradients are
    # -(1/G) A_i / |y_i| per response token (seq-mean-token-mean)
    lp_a, old, adv, mask = random_batch(seed=2)
    with torch.no_grad():
        lp_a.copy_(old)
    lp_b = lp_a.detach().clone().requires_grad_(True)
    gspo_loss(lp_a, old, adv, mask, **CLIP)[0].backward()
    grpo_loss(lp_b, old, adv, mask, **CLIP)[0].backward()
    torch.testing.assert_close(lp_a.grad, lp_b.grad, rtol=1e-12, atol=1e-15)
    expected = -(adv[:, None] / mask.sum(-1, keepdim=True).clamp_min(1)) * mask / 7  # G = 7 non-empty
    torch.testing.assert_close(lp_a.grad, expected, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("name", LOSS_NAMES)
@pytest.mark.parametrize("agg_mode", AGG_MODES)
def test_micro_batches_with_global_counts_reproduce_full_batch(name, agg_mode):
    fn = get_policy_loss(name)
    kw = {"clip_low": 0.2, "clip_high": 0.27} if name == "grpo" else CLIP
    lp_full, old, adv, mask = random_batch(seed=3)
    if name == "grpo":  # token ratios far enough from 1 that some tokens clip
        with torch.no_grad():
            lp_full.add_(torch.linspace(-0.5, 0.5, lp_full.numel(), dtype=F64).view_as(lp_full) * mask)
    full, _ = fn(lp_full, old, adv, mask, agg_mode=agg_mode, **kw)
    full.backward()
    n_tok, n_seq = count_tokens_and_seqs(mask)
    lp_micro = lp_full.detach().clone().requires_grad_(True)
    total = torch.zeros((), dtype=F64)
    for rows in (slice(0, 3), slice(3, 4), slice(4, 5), slice(5, 8)):  # rows 4: the empty sequence alone
        part, _ = fn(
            lp_micro[rows],
            old[rows],
            adv[rows],
            mask[rows],
            agg_mode=agg_mode,
            global_tokens=n_tok,
            global_seqs=n_seq,
            **kw,
        )
        part.backward()
        total = total + part.detach()
    torch.testing.assert_close(total, full.detach(), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(lp_micro.grad, lp_full.grad, rtol=1e-12, atol=1e-15)


# ------------------------------------------------------------------------------------ padding isolation
@pytest.mark.parametrize("name", LOSS_NAMES)
@pytest.mark.parametrize("agg_mode", AGG_MODES)
@pytest.mark.parametrize("garbage", [1e4, -1e4, math.inf, -math.inf, math.nan])
def test_masked_positions_do_not_leak(name, agg_mode, garbage):
    fn = get_policy_loss(name)
    lp, old, adv, mask = random_batch(seed=4)
    adv_t = adv[:, None].expand(-1, mask.shape[1]).contiguous()
    ref_loss, ref_m = fn(lp, old, adv_t, mask, agg_mode=agg_mode, **CLIP)
    ref_loss.backward()
    pad = mask == 0
    lp2 = lp.detach().clone()
    lp2[pad] = garbage
    lp2.requires_grad_(True)
    old2, adv2 = old.clone(), adv_t.clone()
    old2[pad] = -garbage if not math.isnan(garbage) else garbage
    adv2[pad] = garbage
    loss, m = fn(lp2, old2, adv2, mask, agg_mode=agg_mode, **CLIP)
    loss.backward()
    assert torch.equal(loss, ref_loss)
    assert torch.equal(lp2.grad, lp.grad)
    assert lp2.grad[pad].eq(0).all()
    for key in ref_m:
        assert torch.equal(m[key], ref_m[key]), key


# ------------------------------------------------------------------------------------- numerical safety
@pytest.mark.parametrize("name", LOSS_NAMES)
@pytest.mark.parametrize("agg_mode", AGG_MODES)
def test_all_empty_batch_gives_zero_without_nan(name, agg_mode):
    lp = torch.randn(3, 5, dtype=F64, requires_grad=True)
    loss, m = get_policy_loss(name)(lp, torch.zeros(3, 5), torch.ones(3), torch.zeros(3, 5), **CLIP)
    loss.backward()
    assert loss.item() == 0.0
    assert lp.grad.eq(0).all()
    assert all(torch.isfinite(v).all() for v in m.values())
    assert m["num_seqs"].item() == 0 and m["seq_ratio_mean"].item() == 1.0


def test_log_ratio_clamp_is_symmetric_at_20():
    # seq 0: mean log-ratio +50 with A = -1: unclipped branch (A < 0, s > 1+eps): l0 = s0 = e^20 after clamp
    # seq 1: mean log-ratio -50 with A = +1: unclipped branch (A > 0, s < 1-eps): l1 = -s1 = -e^-20
    log_prob = torch.tensor([[50.0, 50.0], [-50.0, -50.0]], dtype=F64, requires_grad=True)
    loss, m = gspo_loss(log_prob, torch.zeros(2, 2), torch.tensor([-1.0, 1.0]), torch.ones(2, 2), **CLIP)
    assert loss.item() == pytest.approx((math.exp(20) - math.exp(-20)) / 2, rel=1e-12)
    assert m["seq_ratio_max"].item() == pytest.approx(math.exp(20))
    loss.backward()
    assert log_prob.grad.eq(0).all()  # outside the clamp the ratio is constant
    grpo, _ = grpo_loss(log_prob, torch.zeros(2, 2), torch.tensor([-1.0, 1.0]), torch.ones(2, 2), **CLIP)
    assert math.isfinite(grpo.item())


def test_half_precision_inputs_are_computed_in_float32():
    lp = torch.tensor([[-1.0, -2.0]], dtype=torch.bfloat16, requires_grad=True)
    for name in LOSS_NAMES:
        loss, m = get_policy_loss(name)(lp, lp.detach(), torch.ones(1), torch.ones(1, 2), **CLIP)
        assert loss.dtype == torch.float32 and m["seq_ratio_mean"].dtype == torch.float32


# ------------------------------------------------------------------------------------------ validation
def test_registry_and_signature_refusals():
    assert set(POLICY_LOSSES) == {"gspo", "gspo_token", "grpo"}
    with pytest.raises(ValueError, match="valid: gspo, gspo_token, grpo"):
        get_policy_loss("ppo")
    args = hand_batch()
    for fn in POLICY_LOSSES.values():
        with pytest.raises(ValueError) as err:
            fn(*args, clip_low=0.2, clip_high=0.2, agg_mode="seq-mean")
        for mode in AGG_MODES:
            assert mode in str(err.value)
        with pytest.raises(TypeError, match="loss_scale"):
            fn(*args, clip_low=0.2, clip_high=0.2, loss_scale=2.0)
        with pytest.raises(ValueError, match="global_seqs"):
            fn(*args, clip_low=0.2, clip_high=0.2, global_tokens=5)
        with pytest.raises(ValueError, match="global_tokens"):
            fn(*args, clip_low=0.2, clip_high=0.2, agg_mode="token-mean", global_seqs=2)
        with pytest.raises(ValueError, match="clip_ratio_c"):
            fn(*args, clip_low=0.2, clip_high=0.2, clip_ratio_c=0.5)
        with pytest.raises(ValueError, match="clip_low"):
            fn(*args, clip_low=1.5, clip_high=0.2)
        lp, old, adv, mask = args
        with pytest.raises(ValueError, match="advantages"):
            fn(lp, old, adv[:1], mask, clip_low=0.2, clip_high=0.2)
        with pytest.raises(ValueError, match=r"\[B, T\]"):
            fn(lp, old[:, :2], adv, mask, clip_low=0.2, clip_high=0.2)
