"""write_hf_checkpoint: sharding by size, the index, and a checkpoint transformers loads back exactly."""

from __future__ import annotations

import json

import torch

from gspo_ascend.engines import hf_export
from gspo_ascend.tiny import ensure_tiny_model


def test_plan_shards_by_size():
    shapes = {n: torch.empty(s, device="meta") for n, s in {"a": 10, "b": 10, "c": 30, "d": 1}.items()}
    old = hf_export.MAX_SHARD_BYTES
    try:
        hf_export.MAX_SHARD_BYTES = 80  # 20 float32
        assert hf_export.plan_shards(shapes, list(shapes), torch.float32) == [["a", "b"], ["c"], ["d"]]
        # bf16 halves the bytes: a+b+c = 100 > 80 breaks before c, then c (60) + d (2) fit together
        assert hf_export.plan_shards(shapes, list(shapes), torch.bfloat16) == [["a", "b"], ["c", "d"]]
    finally:
        hf_export.MAX_SHARD_BYTES = old
    assert hf_export.shard_file_names(2) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


def test_sharded_checkpoint_round_trips(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ensure_tiny_model())
    state = model.state_dict()
    monkeypatch.setattr(hf_export, "MAX_SHARD_BYTES", 300_000)  # ~1.7 MB model -> several files
    names = [n for n in state if n != "lm_head.weight" or not model.config.tie_word_embeddings]
    hf_export.write_hf_checkpoint(
        tmp_path, iter(state.items()), rank=0, shapes=state, names=names, dtype=torch.float32, hf_config=model.config
    )
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and all((tmp_path / f).is_file() for f in files)
    assert set(index["weight_map"]) == set(names)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = torch.tensor([[1, 5, 9, 42, 7]])
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)
