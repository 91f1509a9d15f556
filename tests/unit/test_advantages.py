"""grpo_advantages: hand-computed values and the degenerate groups (singletons, identical rewards)."""

from __future__ import annotations

import math

import pytest
import torch

from gspo_ascend.algorithms import grpo_advantages

EPS = 1e-6


def test_hand_values_mixed_groups():
    # group 0: rewards 1, 0, 1, 0 -> mean 0.5; unbiased var = 4 * 0.5^2 / (4 - 1) = 1/3; std = 1/sqrt(3)
    #          A = +-0.5 / (1/sqrt(3) + 1e-6)
    # group 1: a single sample -> 0 (one sample has no relative signal)
    # group 2: rewards 2, 2, 2 -> 0 (no spread)
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 5.0, 2.0, 2.0, 2.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 2, 2, 2])
    a = 0.5 / (1 / math.sqrt(3) + EPS)
    expected = torch.tensor([a, -a, a, -a, 0.0, 0.0, 0.0, 0.0])
    out = grpo_advantages(rewards, groups)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    assert out[4:].eq(0).all()


def test_uneven_groups_unordered_ids():
    # group 7: rewards 3, 1, 2 (positions 0, 2, 4): mean 2; unbiased var = (1 + 1 + 0) / 2 = 1; std 1
    #          A = (1, -1, 0) / (1 + 1e-6)
    # group 3: rewards 0, 4 (positions 1, 3): mean 2; var = (4 + 4) / 1 = 8; std = 2 sqrt(2)
    #          A = (-2, 2) / (2 sqrt(2) + 1e-6)
    rewards = torch.tensor([3.0, 0.0, 1.0, 4.0, 2.0], dtype=torch.float64)
    groups = torch.tensor([7, 3, 7, 3, 7])
    b = 2 / (2 * math.sqrt(2) + EPS)
    c = 1 / (1 + EPS)
    expected = torch.tensor([c, -b, -c, b, 0.0], dtype=torch.float64)
    torch.testing.assert_close(grpo_advantages(rewards, groups), expected, rtol=0, atol=1e-12)


def test_string_uids_match_integer_ids():
    rewards = torch.tensor([3.0, 0.0, 1.0, 4.0, 2.0])
    by_int = grpo_advantages(rewards, torch.tensor([7, 3, 7, 3, 7]))
    by_str = grpo_advantages(rewards, ["p7", "p3", "p7", "p3", "p7"])
    torch.testing.assert_close(by_int, by_str)


def test_no_std_normalisation_is_dr_grpo():
    # group 0: mean 0.5 -> A = r - 0.5 ; group 1: mean 2 -> A = r - 2
    rewards = torch.tensor([1.0, 0.0, 1.0, 3.0])
    groups = torch.tensor([0, 0, 1, 1])
    expected = torch.tensor([0.5, -0.5, -1.0, 1.0])
    torch.testing.assert_close(grpo_advantages(rewards, groups, norm_by_std=False), expected)


def test_singletons_and_identical_groups_are_exactly_zero_and_never_nan():
    # 0.1 + 0.1 + 0.1 = 0.30000000000000004 in binary, so mean - r is a 1e-17 residue; still exactly 0
    rewards = torch.tensor([0.1, 0.1, 0.1, 7.0, -3.0], dtype=torch.float64)
    groups = torch.tensor([0, 0, 0, 1, 2])
    for norm in (True, False):
        out = grpo_advantages(rewards, groups, norm_by_std=norm)
        assert torch.isfinite(out).all()
        assert out.eq(0).all()


def test_all_singletons_and_empty_input():
    assert grpo_advantages(torch.tensor([1.0, 2.0]), torch.tensor([0, 1])).eq(0).all()
    assert grpo_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.long)).numel() == 0


def test_integer_rewards_and_dtype():
    out = grpo_advantages(torch.tensor([1, 0]), torch.tensor([0, 0]))
    assert out.dtype == torch.float32
    # mean 0.5, unbiased std = sqrt(0.5) -> A = +-0.5 / sqrt(0.5) = +-sqrt(0.5)
    torch.testing.assert_close(out, torch.tensor([math.sqrt(0.5), -math.sqrt(0.5)]), rtol=0, atol=1e-5)
    out16 = grpo_advantages(torch.tensor([1.0, 0.0], dtype=torch.bfloat16), torch.tensor([0, 0]))
    assert out16.dtype == torch.bfloat16


def test_matches_a_per_group_loop_on_random_data():
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 3, (64,), generator=gen).to(torch.float64)
    groups = torch.randint(0, 10, (64,), generator=gen)
    out = grpo_advantages(rewards, groups)
    for g in groups.unique():
        sel = groups == g
        r = rewards[sel]
        if r.numel() == 1 or bool((r == r[0]).all()):
            assert out[sel].eq(0).all()
        else:
            torch.testing.assert_close(out[sel], (r - r.mean()) / (r.std() + EPS))


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="1-D"):
        grpo_advantages(torch.zeros(2, 2), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="entries"):
        grpo_advantages(torch.zeros(3), torch.zeros(2, dtype=torch.long))
