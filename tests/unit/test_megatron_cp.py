"""Context-parallel layout and configuration (gspo_ascend/engines/megatron_cp.py), in process, no megatron run.

The end-to-end checks (CP=2 log-probs == Hugging Face, CP=2 update == fsdp) are in
tests/integration/test_megatron_cp.py."""

from __future__ import annotations

import pytest
import torch

from gspo_ascend.config import load_config
from gspo_ascend.device import NPU, get_backend
from gspo_ascend.engines import megatron_cp as cpm
from gspo_ascend.errors import ConfigError


def test_zigzag_layout_is_megatrons_hand_derived():
    # S = 8, cp = 2: four chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert cpm.zigzag_index(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cpm.zigzag_index(8, 2, 1).tolist() == [2, 3, 4, 5]
    # cp = 3, S = 6: chunks of 1; rank r holds r and 5 - r
    assert [cpm.zigzag_index(6, 3, r).tolist() for r in range(3)] == [[0, 5], [1, 4], [2, 3]]
    with pytest.raises(ValueError, match="2 \\* cp"):
        cpm.zigzag_index(6, 2, 0)


@pytest.mark.parametrize(("cp", "length"), [(1, 4), (2, 8), (2, 16), (3, 12), (4, 24)])
def test_split_then_unsplit_is_the_identity(cp, length):
    positions = torch.cat([cpm.zigzag_index(length, cp, r) for r in range(cp)])
    assert sorted(positions.tolist()) == list(range(length))  # a bijection: every position on exactly one rank
    x = torch.randn(3, length, 5)
    parts = [cpm.split_zigzag(x, 1, cp, r) for r in range(cp)]
    assert all(p.shape == (3, length // cp, 5) for p in parts)
    assert torch.equal(cpm.unsplit_zigzag(torch.cat(parts, 1), 1, cp), x)


def _micro(prompts, responses, pad_id=0):
    from gspo_ascend.engines.base import SampleBatch
    from gspo_ascend.engines.megatron_train import _build_micro

    width = max(len(r) for r in responses)
    ids = torch.tensor([r + [pad_id] * (width - len(r)) for r in responses])
    mask = torch.tensor([[1.0] * len(r) + [0.0] * (width - len(r)) for r in responses])
    batch = SampleBatch(prompts, ids, mask)
    return _build_micro(batch, pad_id, 1, list(range(len(prompts))), packed=False)


def test_shard_micro_gives_every_response_token_to_exactly_one_rank():
    prompts = [[11, 12, 13], [21], [31, 32, 33, 34, 35]]
    responses = [[14, 15, 16, 17], [22, 23, 24, 25, 26, 27], [36]]
    micro = _micro(prompts, responses, pad_id=9)
    seqs = [p + r for p, r in zip(prompts, responses, strict=True)]
    width = 12  # longest sequence 7, padded to a multiple of 2 * cp * multiple = 2 * 2 * 3
    owned = []
    for rank in range(2):
        part = cpm.shard_micro(micro, 2, rank, 3, pad_id=9)
        index = cpm.zigzag_index(width, 2, rank)
        assert part.tokens.shape == (3, width // 2) and part.position_ids[0].tolist() == index.tolist()
        assert part.shape == micro.shape and part.sample is micro.sample
        for row, local, col, label in zip(part.rows, part.positions, part.cols, part.labels, strict=True):
            position = int(index[local])  # the global position predicting response token `col`
            assert position == len(prompts[row]) - 1 + col  # hand-derived: the prompt's last token predicts t = 0
            assert int(part.tokens[row, local]) == seqs[row][position]  # the rank holds that token
            assert int(label) == responses[row][col]
            owned.append((int(row), int(col)))
    expected = [(i, t) for i, r in enumerate(responses) for t in range(len(r))]
    assert sorted(owned) == sorted(expected)  # each token on exactly one rank
    assert {rank for rank in range(2) if len(cpm.shard_micro(micro, 2, rank, 3, 9).rows)} == {0, 1}


def test_sum_over_cp_without_a_group_is_the_identity():
    x = torch.randn(2, 3, requires_grad=True)
    assert cpm.sum_over_cp(x, None) is x


def _cfg(*overrides):
    return load_config(None, ["actor.engine=megatron", *overrides])


def test_cp_with_pipeline_parallelism_is_refused_by_key():
    with pytest.raises(ConfigError, match=r"actor\.context_parallel_size.*pipeline_parallel_size"):
        cpm.check_config(_cfg("actor.context_parallel_size=2", "actor.pipeline_parallel_size=2"))
    from gspo_ascend.engines.megatron import _check_config

    _check_config(_cfg("actor.context_parallel_size=2"), get_backend("cpu"))  # CP alone runs on CPU


def test_world_not_divisible_by_tp_pp_cp_is_refused_by_key():
    with pytest.raises(ConfigError, match=r"actor\.context_parallel_size.*multiple of TP x PP x CP \(2 x 1 x 2\)"):
        cpm.check_world(_cfg("actor.context_parallel_size=2", "actor.tensor_parallel_size=2"), 6)
    cpm.check_world(_cfg("actor.context_parallel_size=2", "actor.tensor_parallel_size=2"), 8)


def test_who_does_the_cp_attention_and_with_which_options():
    cpu, cfg = get_backend("cpu"), _cfg("actor.context_parallel_size=2")
    assert cpm.local_attention_needed(2, cpu, use_te=False)  # CPU: ours
    assert not cpm.local_attention_needed(1, cpu, use_te=False)
    assert not cpm.local_attention_needed(2, cpu, use_te=True)  # TE does it
    assert not cpm.local_attention_needed(2, NPU, use_te=False)  # MindSpeed does it
    assert cpm.transformer_overrides(cfg, cpu, use_te=True) == {"cp_comm_type": "p2p"}
    assert cpm.transformer_overrides(cfg, cpu, use_te=False) == {}
    assert cpm.transformer_overrides(_cfg(), cpu, use_te=True) == {}
    # MindSpeed's ring algorithm comes through its arguments (mindspeed_setup.mindspeed_args), not the config
    assert cpm.transformer_overrides(cfg, NPU, use_te=False) == {}
