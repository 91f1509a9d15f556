"""Aggregation modes on a hand matrix, KL estimators on hand values, presets as valid data."""

from __future__ import annotations

import math

import pytest
import torch

from gspo_ascend.algorithms import (
    AGG_MODES,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    PRESET_SOURCES,
    PRESETS,
    agg_loss,
    agg_seq_loss,
    count_tokens_and_seqs,
    get_preset,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_penalty,
)

# token losses, T = 4:  row 0 = [1, 2, 3, pad]  (L = 3, sum 6, mean 2)
#                       row 1 = [4, pad, ...]   (L = 1, sum 4, mean 4)
#                       row 2 = all padding     (L = 0, not a sequence)
LOSS = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 100.0, 100.0, 100.0], [7.0, 7.0, 7.0, 7.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
HAND = {
    "token-mean": (6 + 4) / 4,  # 4 response tokens
    "seq-mean-token-mean": (2 + 4) / 2,  # 2 non-empty sequences
    "seq-mean-token-sum": (6 + 4) / 2,
    "seq-mean-token-sum-norm": (6 + 4) / (2 * 4),  # T = 4
}


@pytest.mark.parametrize("mode", AGG_MODES)
def test_agg_loss_hand_values(mode):
    assert agg_loss(LOSS, MASK, mode).item() == pytest.approx(HAND[mode])


@pytest.mark.parametrize("mode", AGG_MODES)
def test_global_counts_replace_local_ones(mode):
    # global: 10 tokens, 5 sequences -> token-mean 10/10; seq-mean-token-mean 6/5; token-sum 10/5; norm 10/20
    expected = {
        "token-mean": 1.0,
        "seq-mean-token-mean": 1.2,
        "seq-mean-token-sum": 2.0,
        "seq-mean-token-sum-norm": 0.5,
    }[mode]
    got = agg_loss(LOSS, MASK, mode, global_tokens=torch.tensor(10), global_seqs=5)
    assert got.item() == pytest.approx(expected)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_seq_loss_aggregation_equals_broadcast_to_tokens(mode):
    seq_loss = torch.tensor([0.5, -2.0, 9.0], dtype=torch.float64)
    lengths = MASK.sum(-1)
    broadcast = seq_loss[:, None].expand(-1, 4)
    got = agg_seq_loss(seq_loss, lengths, mode, norm_length=4)
    torch.testing.assert_close(got, agg_loss(broadcast, MASK, mode), rtol=1e-15, atol=0)


def test_count_tokens_and_seqs():
    n_tok, n_seq = count_tokens_and_seqs(MASK)
    assert (n_tok.item(), n_seq.item()) == (4, 2)


def test_invalid_mode_lists_valid_modes():
    with pytest.raises(ValueError) as err:
        agg_loss(LOSS, MASK, "token-sum")
    for mode in AGG_MODES:
        assert mode in str(err.value)


def test_kl_estimators_hand_values():
    # pi_theta = 0.5, pi_ref = 0.25:  k1 = log 2;  k2 = (log 2)^2 / 2;
    # k3 = pi_ref/pi_theta - 1 - log(pi_ref/pi_theta) = 0.5 - 1 + log 2
    lp = torch.tensor([[math.log(0.5)]], dtype=torch.float64)
    ref = torch.tensor([[math.log(0.25)]], dtype=torch.float64)
    assert kl_k1(lp, ref).item() == pytest.approx(math.log(2))
    assert kl_k2(lp, ref).item() == pytest.approx(math.log(2) ** 2 / 2)
    assert kl_k3(lp, ref).item() == pytest.approx(-0.5 + math.log(2))
    assert kl_penalty("low_var_kl", lp, ref).item() == pytest.approx(-0.5 + math.log(2))
    assert kl_penalty("mse", lp, ref).item() == pytest.approx(math.log(2) ** 2 / 2)


def test_k3_clamps_and_mask():
    # delta = ref - lp = 30 -> clamped to 20 -> e^20 - 21 -> clamped to 10
    assert kl_k3(torch.tensor([0.0]), torch.tensor([30.0])).item() == 10.0
    # delta = -30 -> -20 -> e^-20 - 1 + 20 ~ 19 -> clamped to 10
    assert kl_k3(torch.tensor([0.0]), torch.tensor([-30.0])).item() == 10.0
    lp = torch.tensor([[0.0, math.nan]])
    out = kl_penalty("k3", lp, torch.tensor([[0.0, math.inf]]), torch.tensor([[1, 0]]))
    assert out.tolist() == [[0.0, 0.0]]
    with pytest.raises(ValueError, match="k1"):
        kl_penalty("k4", lp, lp)
    assert set(KL_ESTIMATORS) >= {"k1", "k2", "k3", "low_var_kl"}


def test_presets_are_valid_and_documented():
    assert set(PRESETS) == {"gspo_paper", "grpo_paper"}
    for name, preset in PRESETS.items():
        assert preset["algorithm.loss"] in POLICY_LOSSES
        assert preset["algorithm.loss_agg_mode"] in AGG_MODES
        assert preset["algorithm.kl_coef"] == 0.0
        assert set(PRESET_SOURCES[name]) == set(preset)  # every number has a source
    gspo = get_preset("gspo_paper")
    assert (gspo["algorithm.clip_ratio_low"], gspo["algorithm.clip_ratio_high"]) == (3e-4, 4e-4)
    assert gspo["algorithm.minibatches_per_rollout"] == 4
    grpo = get_preset("grpo_paper")
    assert (grpo["algorithm.clip_ratio_low"], grpo["algorithm.clip_ratio_high"]) == (0.2, 0.27)
    gspo["algorithm.loss"] = "changed"
    assert PRESETS["gspo_paper"]["algorithm.loss"] == "gspo"  # get_preset hands out a copy
    with pytest.raises(ValueError, match="gspo_paper"):
        get_preset("dapo")


def test_algorithms_package_is_pure_tensor_math():
    # design principle 2: algorithms/ imports only torch and the standard library (no Ray, no config
    # objects, no device layer) and never names torch.cuda / torch_npu
    import ast
    import pathlib

    import gspo_ascend.algorithms as pkg

    allowed = ("torch", "__future__", "collections", "typing", "math", "gspo_ascend.algorithms")
    for path in pathlib.Path(pkg.__file__).parent.glob("*.py"):
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert name.split(".")[0] in allowed or name.startswith(allowed[-1]), f"{path.name}: {name}"
                assert not name.startswith("torch.cuda"), f"{path.name}: {name}"
        for banned in ("torch.cuda", "torch_npu", ".cuda("):
            assert banned not in text, f"{path.name} mentions {banned}"
