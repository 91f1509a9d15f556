"""engines/packed_attention.py: a packed row attends per sequence, with the result of separate forwards.

Expected values are independent computations: one plain Hugging Face forward per sequence (no packing, no mask),
and for gradients the sum of the per-sequence losses' gradients. float64, so only summation order differs.
"""

from __future__ import annotations

import pytest
import torch

from gspo_ascend.device import get_backend
from gspo_ascend.engines import packed_attention
from gspo_ascend.engines.logprobs import forward_log_probs
from tests.unit.fsdp_worker import engine_config, make_batch, reference_log_probs

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

LENGTHS = [15, 1, 12, 24, 4]  # a one-token sequence attends to itself only


@pytest.fixture(scope="module")
def model_path() -> str:
    from gspo_ascend.tiny import ensure_tiny_model

    return str(ensure_tiny_model())


def load(path: str, attn: str, dtype=torch.float64):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn).eval()


def packed_inputs(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 500, (1, sum(lengths)), generator=g)
    pos = torch.tensor([[i for n in lengths for i in range(n)]])
    return ids, pos


def separate_logits(model, ids: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    out, start = [], 0
    for n in lengths:
        out.append(model(input_ids=ids[:, start : start + n], use_cache=False).logits)
        start += n
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_row_equals_one_forward_per_sequence(model_path, attn):
    model = load(model_path, attn)
    assert packed_attention.enable(model) and model.config._attn_implementation == f"packed_{attn}"
    ids, pos = packed_inputs(LENGTHS)
    with torch.no_grad():
        expected = separate_logits(load(model_path, attn), ids, LENGTHS)
        kwargs = packed_attention.forward_kwargs(model, LENGTHS)
        with packed_attention.packed_forward():
            got = model(input_ids=ids, position_ids=pos, use_cache=False, **kwargs).logits
        # the same model without the boundaries attends across the whole row: a leak would be O(0.1)
        leaked = model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None], use_cache=False).logits
    assert (got - expected).abs().max() <= 1e-12
    assert (leaked - expected).abs().max() > 1e-3


def test_moe_models_that_build_their_mask_from_attention_mask_take_the_packed_row():
    """Qwen3-MoE (transformers 4.57 and 5.x) builds its mask from ``attention_mask`` directly, with no mapping of
    masks per layer type: the packed forward passes no mask at all (an empty mapping there was an AttributeError
    on the NPU pin's transformers), and equals one forward per sequence."""
    from gspo_ascend.tiny import ensure_tiny_model

    path = str(ensure_tiny_model(moe=True))
    model = load(path, "sdpa", torch.float32)  # transformers' MoE grouped matmul takes no float64
    assert packed_attention.enable(model)
    ids, pos = packed_inputs(LENGTHS)
    with torch.no_grad(), packed_attention.packed_forward():
        got = model(input_ids=ids, position_ids=pos, use_cache=False,
                    **packed_attention.forward_kwargs(model, LENGTHS)).logits  # fmt: skip
    with torch.no_grad():
        expected = separate_logits(load(path, "sdpa", torch.float32), ids, LENGTHS)
    assert (got - expected).abs().max() <= 1e-5


def test_gradients_equal_the_sum_of_per_sequence_gradients(model_path):
    model, reference = load(model_path, "sdpa"), load(model_path, "sdpa")
    packed_attention.enable(model)
    ids, pos = packed_inputs(LENGTHS, seed=1)
    weights = torch.randn(sum(LENGTHS), model.config.vocab_size, generator=torch.Generator().manual_seed(2))
    kwargs = packed_attention.forward_kwargs(model, LENGTHS)
    with packed_attention.packed_forward():
        logits = model(input_ids=ids, position_ids=pos, use_cache=False, **kwargs).logits
    (logits[0] * weights).sum().backward()
    (separate_logits(reference, ids, LENGTHS)[0] * weights).sum().backward()
    got = dict(model.named_parameters())
    for name, p in reference.named_parameters():
        assert p.grad.abs().max() > 0
        assert (got[name].grad - p.grad).abs().max() <= 1e-10 * max(1.0, p.grad.abs().max().item()), name


def test_no_row_mask_is_built_and_attention_runs_once_per_sequence(model_path, monkeypatch):
    import transformers.masking_utils as masking

    model = load(model_path, "sdpa")
    packed_attention.enable(model)

    def refuse(*args, **kwargs):
        raise AssertionError("a mask was built for the packed row")

    monkeypatch.setattr(masking, "sdpa_mask", refuse)  # (finding the boundaries from positions is linear: kept)
    monkeypatch.setattr(masking, "eager_mask", refuse)
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counting(q, k, v, **kw):
        calls.append((q.shape[2], kw.get("attn_mask") is None, kw.get("is_causal")))
        return sdpa(q, k, v, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)
    ids, pos = packed_inputs(LENGTHS)
    kwargs = packed_attention.forward_kwargs(model, LENGTHS)
    with torch.no_grad(), packed_attention.packed_forward():
        model(input_ids=ids, position_ids=pos, use_cache=False, **kwargs)
    layers = model.config.num_hidden_layers
    # one causal, unmasked attention per sequence and layer, each over that sequence's tokens only
    assert [n for n, _, _ in calls] == LENGTHS * layers
    assert all(no_mask for _, no_mask, _ in calls)
    assert [causal for _, _, causal in calls] == [n > 1 for n in LENGTHS] * layers


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_other_calls_are_the_inner_implementation_bitwise(model_path, attn):
    """A padded batch with a mask, a plain forward and a cached decode (generate) are untouched."""
    plain, model = load(model_path, attn, torch.float32), load(model_path, attn, torch.float32)
    packed_attention.enable(model)
    batch = make_batch(5, 6, seed=3)
    assert torch.equal(
        forward_log_probs(model, batch, 0.7, packed=False), forward_log_probs(plain, batch, 0.7, packed=False)
    )
    ids = torch.tensor([[5, 9, 11, 40, 7], [0, 0, 8, 13, 21]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kw), plain.generate(ids, **kw))


def test_packed_log_probs_match_the_per_sample_reference(model_path):
    model = load(model_path, "sdpa")
    packed_attention.enable(model)
    batch = make_batch(6, 6, seed=2)
    with torch.no_grad():
        got = forward_log_probs(model, batch, 0.7, packed=True)
        expected = reference_log_probs(load(model_path, "sdpa"), batch, 0.7)
    assert (got - expected).abs().max() <= 1e-12


def test_enable_leaves_varlen_and_sliding_window_models_alone(model_path):
    model = load(model_path, "sdpa")
    assert packed_attention.enable(model) and packed_attention.enable(model)  # idempotent
    assert model.config._attn_implementation == "packed_sdpa"
    for attn in ("flash_attention_2", "npu_fusion"):
        model.config._attn_implementation = attn  # as the NPU patches or a flash-attn install would set it
        assert not packed_attention.enable(model) and model.config._attn_implementation == attn
    windowed = load(model_path, "sdpa")
    windowed.config.layer_types = ["sliding_attention"] * windowed.config.num_hidden_layers
    assert not packed_attention.enable(windowed) and windowed.config._attn_implementation == "sdpa"
    assert packed_attention.forward_kwargs(windowed, [3, 4]) == {}  # the old packed path, mask and all


def test_boundaries_that_do_not_cover_the_row_are_refused(model_path):
    model = load(model_path, "sdpa")
    packed_attention.enable(model)
    ids, pos = packed_inputs([3, 4])
    kwargs = packed_attention.forward_kwargs(model, [3, 3])
    with pytest.raises(ValueError, match="does not cover the row"), packed_attention.packed_forward():
        model(input_ids=ids, position_ids=pos, use_cache=False, **kwargs)


@pytest.mark.parametrize("packed", [True, False])
def test_fsdp_engine_routes_packed_attention_only_when_packing(model_path, tmp_path, packed):
    import json

    from transformers import AutoTokenizer

    from gspo_ascend.engines.fsdp import FSDPEngine

    cfg = engine_config("data.train_batch_size=8", f"actor.use_remove_padding={str(packed).lower()}")
    engine = FSDPEngine(cfg, get_backend("cpu"), model_path)
    try:
        assert engine.model.config._attn_implementation == ("packed_sdpa" if packed else "sdpa")
        engine.save_hf(str(tmp_path), AutoTokenizer.from_pretrained(model_path))
        saved = json.loads((tmp_path / "config.json").read_text())
        assert "packed_" not in json.dumps(saved)  # the export names no implementation of ours
    finally:
        engine.close()


def _varlen_stand_in(calls: list, gqa: bool = False):
    """TEST-ONLY stand-in for torch.nn.attention.varlen.varlen_attn, which has no CPU kernel (CUDA half precision
    only): its documented semantics computed plainly (per segment of cu_seq, softmax(q k^T * scale) v with the
    causal window (-1, 0), K / V heads as given), so what is tested is our plumbing around it (layout, GQA heads,
    boundaries, scale, output shape), not the kernel. The kernel itself is checked on a GPU by the selftest's
    TND attention case (gspo_ascend/selftest/ops.py) against the shim's reference."""

    def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
        assert window_size == (-1, 0) and torch.equal(cu_q, cu_k) and cu_q.dtype == torch.int32
        assert q.shape[1] == k.shape[1] == v.shape[1], "KV heads must arrive repeated (no enable_gqa before 2.12)"
        return attend(q, k, v, cu_q, max_q, max_k, scale)

    def varlen_attn_gqa(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
        # torch >= 2.12: the KV heads as the model has them, the kernel groups the query heads
        assert enable_gqa and window_size == (-1, 0) and q.shape[1] == 2 * k.shape[1]
        k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        return attend(q, k, v, cu_q, max_q, max_k, scale)

    def attend(q, k, v, cu_q, max_q, max_k, scale):
        bounds = cu_q.tolist()
        assert max_q == max_k == max(b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True))
        calls.append(len(bounds) - 1)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        out = []
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))  # [H, L, D]
            scores = qs @ ks.transpose(-1, -2) * scale
            scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
            out.append((scores.softmax(-1) @ vs).transpose(0, 1))
        return torch.cat(out)

    return varlen_attn_gqa if gqa else varlen_attn


@pytest.mark.parametrize("gqa", [False, True], ids=["kv-repeated", "enable_gqa"])
def test_varlen_path_is_one_call_per_layer_and_equals_the_per_sequence_loop(model_path, monkeypatch, gqa):
    model, looped = load(model_path, "sdpa"), load(model_path, "sdpa")
    assert model.config.num_attention_heads == 2 * model.config.num_key_value_heads  # GQA, 2 query heads per KV
    for m in (model, looped):
        packed_attention.enable(m)
    ids, pos = packed_inputs(LENGTHS, seed=3)
    weights = torch.randn(sum(LENGTHS), model.config.vocab_size, generator=torch.Generator().manual_seed(4))

    def run(m):
        kwargs = packed_attention.forward_kwargs(m, LENGTHS)
        with packed_attention.packed_forward():
            logits = m(input_ids=ids, position_ids=pos, use_cache=False, **kwargs).logits
        (logits[0] * weights).sum().backward()
        return logits

    expected = run(looped)  # the per-sequence loop (CPU: varlen does not apply)
    calls: list[int] = []
    monkeypatch.setattr(packed_attention, "varlen_kernel", lambda: _varlen_stand_in(calls, gqa))
    monkeypatch.setattr(packed_attention, "HALF", (torch.float64,))  # float64 stands for half precision here
    original = packed_attention.varlen_applies  # and the CPU query for a CUDA one, in the device check only
    monkeypatch.setattr(packed_attention, "varlen_applies", lambda m, q, kw: original(m, _AsCuda(q), kw))
    got = run(model)
    assert calls == [len(LENGTHS)] * model.config.num_hidden_layers  # one call per layer, every sequence in it
    assert (got - expected).abs().max() <= 1e-10
    ref = dict(looped.named_parameters())
    for name, p in model.named_parameters():
        assert (p.grad - ref[name].grad).abs().max() <= 1e-10 * max(1.0, ref[name].grad.abs().max().item()), name


class _AsCuda:
    """A query seen by varlen_applies as a CUDA tensor (its device check), everything else from the real one."""

    def __init__(self, t: torch.Tensor) -> None:
        self.dtype, self.device = t.dtype, torch.device("cuda")
