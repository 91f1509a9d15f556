"""The megatron engine's SDPA core attention (engines/megatron_attention.py) against megatron-core's own
``DotProductAttention`` of the local spec, the module it replaces: same inputs ``[s, b, heads, hn]``, outputs and
gradients of query / key / value equal (float64 to 1e-12), with GQA, two sequences in a batch, TP 1; packed (THD)
sequences in one row against DotProductAttention on each sequence alone; that the engine's forwards are packed by
default; and what it refuses.

Runs in a subprocess (this file as a script): importing megatron needs the CUDA->CPU shim, which the test process
must not get. Through the engine (HF log-probs, the fsdp update): tests/integration/test_megatron_engine.py.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed")


def _worker() -> dict:
    import torch
    import torch.distributed as dist

    from gspo_ascend.device import get_backend
    from gspo_ascend.engines.megatron_setup import _import_megatron

    _import_megatron(get_backend("cpu"))
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from gspo_ascend.engines.megatron_attention import SDPACoreAttention
    from gspo_ascend.errors import ConfigError

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    out: dict = {}
    for name, (heads, groups) in {"mha": (4, 4), "gqa": (4, 2)}.items():
        config = TransformerConfig(
            num_layers=2, hidden_size=32, num_attention_heads=heads, num_query_groups=groups, kv_channels=8,
            params_dtype=torch.float64, attention_dropout=0.0, apply_query_key_layer_scaling=name == "gqa",
        )  # fmt: skip
        g = torch.Generator().manual_seed(3)
        s, b = 11, 2
        q = torch.randn(s, b, heads, 8, generator=g, dtype=torch.float64, requires_grad=True)
        k, v = (torch.randn(s, b, groups, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in "kv")
        upstream = torch.randn(s, b, heads * 8, generator=g, dtype=torch.float64)
        results = []
        for cls in (DotProductAttention, SDPACoreAttention):
            module = cls(config, layer_number=2, attn_mask_type=AttnMaskType.causal, attention_type="self")
            y = module(q, k, v, None, attn_mask_type=AttnMaskType.causal)
            results.append((y, torch.autograd.grad((y * upstream).sum(), (q, k, v))))
        out[name] = _compared(*results)
        out[f"{name}_packed"] = _packed_against_each_sequence(config, heads, groups)
    out["engine"] = _engine_core_attention()
    windowed = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, window_size=(4, 0))
    try:
        SDPACoreAttention(windowed, 1, AttnMaskType.causal, "self")
        out["window"] = "accepted"
    except ConfigError as exc:
        out["window"] = str(exc)
    return out


def _compared(reference, ours) -> dict:
    """(output, gradients) of our module against the reference's."""
    (want, want_g), (got, got_g) = reference, ours
    return {
        "shape": list(got.shape),
        "value": float((got - want).abs().max()),
        "grad": max(float((a - w).abs().max()) for a, w in zip(got_g, want_g, strict=True)),
        "scale": float(want.abs().max()),
    }


def _packed_against_each_sequence(config, heads: int, groups: int) -> dict:
    """THD: three sequences (3, 5, 3 tokens) packed in one row with their boundaries (``PackedSeqParams``, on the
    host as the engine passes them) against DotProductAttention run on each sequence alone."""
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from gspo_ascend.engines.megatron_attention import SDPACoreAttention

    g = torch.Generator().manual_seed(4)
    lengths = [3, 5, 3]
    q = torch.randn(sum(lengths), heads, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(sum(lengths), groups, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in "kv")
    upstream = torch.randn(sum(lengths), heads * 8, generator=g, dtype=torch.float64)
    cu = torch.tensor([0, 3, 8, 11], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=5, max_seqlen_kv=5)
    causal = AttnMaskType.causal
    ours = SDPACoreAttention(config, layer_number=2, attn_mask_type=causal, attention_type="self")
    got = ours(q, k, v, None, attn_mask_type=causal, packed_seq_params=params)
    spec = DotProductAttention(config, layer_number=2, attn_mask_type=causal, attention_type="self")
    parts = zip(*(t.split(lengths) for t in (q, k, v)), strict=True)
    want = torch.cat([spec(*(t.unsqueeze(1) for t in part), None, attn_mask_type=causal)[:, 0] for part in parts])
    return _compared(
        (want, torch.autograd.grad((want * upstream).sum(), (q, k, v))),
        (got, torch.autograd.grad((got * upstream).sum(), (q, k, v))),
    )


def _engine_core_attention() -> dict:
    """The core attention classes the megatron engine builds on CPU (no TE, no MindSpeed): SDPA, not the spec's;
    and how many of their calls in one log-prob pass got packed (THD) micro-batches, the default layout."""
    from gspo_ascend.config import load_config
    from gspo_ascend.device import get_backend
    from gspo_ascend.engines.megatron import MegatronEngine
    from gspo_ascend.tiny import ensure_tiny_model
    from tests.unit.fsdp_worker import make_batch

    cfg = load_config(
        overrides=["actor.engine=megatron", "data.train_batch_size=8", "algorithm.minibatches_per_rollout=1"]
    )
    engine = MegatronEngine(cfg, get_backend("cpu"), str(ensure_tiny_model()))
    cores = [m.self_attention.core_attention for m in engine.models[0].modules() if hasattr(m, "self_attention")]
    calls = {"packed": 0, "padded": 0}

    def count(_module, _args, kwargs) -> None:
        calls["packed" if kwargs.get("packed_seq_params") is not None else "padded"] += 1

    for core in cores:
        core.register_forward_pre_hook(count, with_kwargs=True)
    try:
        engine.compute_log_probs(make_batch(4, 5, seed=1, min_response=1), 1.0)
        return {"classes": sorted({type(core).__name__ for core in cores}), **calls}
    finally:
        engine.close()


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("megatron_attention") / "out.json"
    proc = subprocess.run(
        [sys.executable, __file__, str(out)], capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", ["mha", "gqa"])
def test_sdpa_core_attention_equals_megatrons_dot_product_attention(measured, case):
    m = measured[case]
    assert m["shape"] == [11, 2, 32]
    assert m["scale"] > 0.1  # real outputs, not a vacuous match
    assert m["value"] < 1e-12 and m["grad"] < 1e-12


@pytest.mark.parametrize("case", ["mha_packed", "gqa_packed"])
def test_packed_sequences_attend_as_each_sequence_alone(measured, case):
    m = measured[case]
    assert m["shape"] == [11, 32] and m["scale"] > 0.1
    assert m["value"] < 1e-12 and m["grad"] < 1e-12


def test_the_engine_builds_it_without_te_and_mindspeed_and_packs_by_default(measured):
    engine = measured["engine"]
    assert engine["classes"] == ["SDPACoreAttention"]
    assert engine["packed"] > 0 and engine["padded"] == 0  # actor.use_remove_padding (default true) is honoured


def test_a_window_is_refused_by_name(measured):
    assert "window" in measured["window"] and "Transformer Engine" in measured["window"]


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    Path(sys.argv[1]).write_text(json.dumps(_worker()))
