"""The fused LM-head log-prob (engines/fused_logprob.py) against full logits.

Expected values: ``log_softmax(h W^T / T)[y]`` from full float64 logits (autograd for the gradients), and the plain
path (model logits -> token_log_probs) on the tiny Qwen3, which the fused path must equal and must replace.
"""

from __future__ import annotations

import pytest
import torch

from gspo_ascend.engines import fused_logprob
from gspo_ascend.engines.fused_logprob import linear_log_probs
from gspo_ascend.engines.logprobs import forward_log_probs
from tests.unit.fsdp_worker import make_batch

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def model_path() -> str:
    from gspo_ascend.tiny import ensure_tiny_model

    return str(ensure_tiny_model())


def _inputs(dtype, n=13, h=8, v=29, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    weight = torch.randn(v, h, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    return hidden, weight, torch.randint(0, v, (n,), generator=g), torch.randn(n, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("chunk", [4, 2048])  # 13 rows in chunks of 4, 4, 4, 1; and in one chunk
def test_values_and_gradients_are_log_softmax_at_the_label(chunk):
    hidden, weight, labels, upstream = _inputs(torch.float64)
    expected = torch.log_softmax(hidden @ weight.t() / 0.7, -1).gather(-1, labels[:, None]).squeeze(-1)
    want = torch.autograd.grad((expected * upstream).sum(), (hidden, weight))
    got = linear_log_probs(hidden, weight, labels, 0.7, chunk=chunk)
    assert got.dtype == torch.float64
    assert (got - expected).abs().max() < 1e-12
    grads = torch.autograd.grad((got * upstream).sum(), (hidden, weight))
    for g, w in zip(grads, want, strict=True):
        assert (g - w).abs().max() < 1e-12


def test_bf16_inputs_give_float32_log_probs_within_bf16_rounding():
    hidden, weight, labels, upstream = _inputs(torch.bfloat16)
    got = linear_log_probs(hidden, weight, labels, 1.0, chunk=4)
    assert got.dtype == torch.float32
    exact = torch.log_softmax(hidden.double() @ weight.double().t(), -1).gather(-1, labels[:, None]).squeeze(-1)
    # logits are rounded to bf16 (8 bits) by the matmul, as the plain path's are: |logit| ~ 3 -> 2^-7 * 3 each
    assert (got.double() - exact).abs().max() < 0.1
    gh, gw = torch.autograd.grad((got * upstream.float()).sum(), (hidden, weight))
    assert gh.dtype == gw.dtype == torch.bfloat16


def test_refuses_a_non_positive_temperature():
    hidden, weight, labels, _ = _inputs(torch.float32)
    with pytest.raises(ValueError, match="temperature"):
        linear_log_probs(hidden, weight, labels, 0.0)


def _plain_model(path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")


def _vocab_sized_linear_calls(model, monkeypatch) -> list[int]:
    """Counts calls of the LM head's own (class) forward: the [N, V] logits the fused path never makes."""
    calls: list[int] = []
    original = torch.nn.Linear.forward

    def counting(self, x):
        if self.out_features == model.config.vocab_size:
            calls.append(x.shape[-2] if x.dim() > 1 else 1)
        return original(self, x)

    monkeypatch.setattr(torch.nn.Linear, "forward", counting)
    return calls


@pytest.mark.parametrize("packed", [True, False])
def test_model_forward_takes_the_fused_head_and_equals_the_plain_path(model_path, packed, monkeypatch):
    batch = make_batch(6, 6, seed=4)
    model = _plain_model(model_path)
    assert fused_logprob.supported(model)
    params = [p for p in model.parameters() if p.requires_grad]
    weights = torch.randn(batch.response_ids.shape, generator=torch.Generator().manual_seed(1))

    def run():
        lp = forward_log_probs(model, batch, 0.8, packed=packed)
        return lp, torch.autograd.grad((lp * weights).sum(), params)

    calls = _vocab_sized_linear_calls(model, monkeypatch)
    fused, fused_grads = run()
    assert calls == []  # the head never produced logits: the fused path was taken
    monkeypatch.setattr(fused_logprob, "supported", lambda m: False)  # the plain path on the same model
    plain, plain_grads = run()
    assert calls  # the plain path does run the head
    assert model.get_output_embeddings().forward.__func__ is torch.nn.Linear.forward  # the swap was undone
    assert ((fused - plain).abs() <= 1e-6 * plain.abs().clamp_min(1.0)).all()
    for f, p in zip(fused_grads, plain_grads, strict=True):
        assert (f - p).abs().max() <= 1e-6 * p.abs().max().clamp_min(1.0)


def test_heads_that_are_not_a_known_bias_free_linear_keep_the_plain_path(model_path):
    model = _plain_model(model_path)
    model.config.model_type = "granite"  # scales its logits after the head (config.logits_scaling)
    assert not fused_logprob.supported(model)
    model.config.model_type = "qwen3"
    head = model.get_output_embeddings()
    head.bias = torch.nn.Parameter(torch.zeros(head.out_features))
    assert not fused_logprob.supported(model)


class _ScalesItsLogits(torch.nn.Module):
    """A family that divides its head's output before returning it (as Granite does), listed by mistake."""

    def __init__(self, inner) -> None:
        super().__init__()
        self.inner, self.config = inner, inner.config

    def get_output_embeddings(self):
        return self.inner.get_output_embeddings()

    def forward(self, **kwargs):
        out = self.inner(**kwargs)
        out.logits = out.logits / 8
        return out


def test_a_family_that_changes_the_heads_output_is_refused_not_mislabelled(model_path):
    model = _ScalesItsLogits(_plain_model(model_path))
    assert fused_logprob.supported(model)
    with pytest.raises(RuntimeError, match="MODEL_TYPES"):
        forward_log_probs(model, make_batch(2, 4, seed=6, min_response=1), 1.0, packed=True)


def test_tied_embeddings_get_both_gradients(model_path):
    # Qwen3-0.6B and Qwen2.5-3B tie lm_head to embed_tokens: the head's gradient and the embedding's add up
    batch = make_batch(5, 6, seed=7, min_response=1)
    grads = []
    for fused in (True, False):
        model = _plain_model(model_path, torch.float64)
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
        if not fused:
            model.config.model_type = "not-listed"
        assert fused_logprob.supported(model) is fused
        lp = forward_log_probs(model, batch, 0.9, packed=True)
        (grads.append(torch.autograd.grad(lp.sum(), model.get_input_embeddings().weight)[0]), grads.append(lp))
    assert (grads[0] - grads[2]).abs().max() < 1e-12 and (grads[1] - grads[3]).abs().max() < 1e-12


def test_an_empty_batch_still_runs_one_connected_forward(model_path):
    batch = make_batch(2, 4, seed=5)
    batch.response_mask.zero_()
    model = _plain_model(model_path)
    lp = forward_log_probs(model, batch, 1.0, packed=True)
    assert torch.equal(lp, torch.zeros_like(lp)) and lp.requires_grad
    lp.sum().backward()  # every FSDP rank must take part in the backward, even with nothing to train


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    """-sum p log p from full float64 logits: the expected value, computed the textbook way."""
    logp = torch.log_softmax(logits.double(), -1)
    return -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("chunk", [4, 2048])
def test_entropy_from_the_same_chunks_is_the_softmax_entropy_and_changes_no_gradient(chunk):
    hidden, weight, labels, upstream = _inputs(torch.float64)
    plain = linear_log_probs(hidden, weight, labels, 0.7, chunk=chunk)
    want = torch.autograd.grad((plain * upstream).sum(), (hidden, weight))
    got, entropy = linear_log_probs(hidden, weight, labels, 0.7, chunk=chunk, entropy=True)
    assert torch.equal(got, plain)
    assert (entropy - _entropy(hidden.detach() @ weight.detach().t() / 0.7)).abs().max() < 1e-12
    assert not entropy.requires_grad  # a metric
    grads = torch.autograd.grad((got * upstream).sum(), (hidden, weight))
    assert all(torch.equal(g, w) for g, w in zip(grads, want, strict=True))


@pytest.mark.parametrize("packed", [True, False])
def test_forward_entropy_fused_and_plain_equal_full_logits(model_path, packed, monkeypatch):
    batch = make_batch(6, 6, seed=4, min_response=1)
    model = _plain_model(model_path, torch.float64)
    expected = torch.zeros(batch.response_ids.shape, dtype=torch.float64)
    with torch.no_grad():
        for i, prompt in enumerate(batch.prompt_ids):
            n = int(batch.response_mask[i].sum())
            seq = torch.tensor([prompt + batch.response_ids[i, :n].tolist()])
            logits = model(input_ids=seq, use_cache=False).logits[0, len(prompt) - 1 : len(prompt) - 1 + n]
            expected[i, :n] = _entropy(logits / 0.8)
    fused_lp, fused = forward_log_probs(model, batch, 0.8, packed=packed, entropy=True)
    assert torch.equal(fused_lp, forward_log_probs(model, batch, 0.8, packed=packed))
    monkeypatch.setattr(fused_logprob, "supported", lambda m: False)
    _, plain = forward_log_probs(model, batch, 0.8, packed=packed, entropy=True)
    for got in (fused, plain):
        assert (got - expected).abs().max() < 1e-10
    assert expected.max() > 1.0  # a real spread over the vocabulary, not a vacuous 0
