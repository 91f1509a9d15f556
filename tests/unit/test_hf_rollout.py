"""The ``hf`` rollout engine against independent references.

References never go through ``model.generate`` or the engine's padding: log-probs come from one plain forward of
each prompt+response on its own (eager attention, no KV cache, no padding), greedy tokens from an argmax loop
over full forwards. Expected masks in the EOS tests are written out by hand.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers

from gspo_ascend.config import Config
from gspo_ascend.device import get_backend
from gspo_ascend.engines.base import SampleBatch, SamplingParams
from gspo_ascend.engines.hf_rollout import HFRolloutEngine, _chunk_seed, _finish, build_hf_rollout
from gspo_ascend.errors import ConfigError, UserError
from gspo_ascend.tiny import ensure_tiny_model

CPU = get_backend("cpu")
QUESTIONS = [
    "What is 3 + 4? Put the final answer in \\boxed{}.",
    "What is 8 - 5?",  # shorter: the batch is left-padded
    "What is 6 + 9? Put the final answer in \\boxed{}. Think step by step.",
]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def model_path() -> str:
    return ensure_tiny_model()


@pytest.fixture(scope="module")
def engine(model_path) -> HFRolloutEngine:
    return HFRolloutEngine(model_path, backend=CPU)


@pytest.fixture(scope="module")
def reference(model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def prompts(engine) -> list[list[int]]:
    tok = engine.tokenizer
    out = []
    for q in QUESTIONS:
        text = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        out.append(tok(text, add_special_tokens=False)["input_ids"])
    assert len({len(p) for p in out}) == 3  # the padding path is really exercised
    return out


def ref_log_probs(model, batch: SampleBatch, temperature: float) -> torch.Tensor:
    """[B, R] log_softmax(logits / T) at each response token: one unpadded full forward per sample."""
    out = torch.zeros(batch.response_ids.shape)
    for i, prompt in enumerate(batch.prompt_ids):
        n = int(batch.response_mask[i].sum())
        response = batch.response_ids[i, :n].tolist()
        with torch.no_grad():
            logits = model(torch.tensor([prompt + response])).logits[0].float()
        steps = logits[len(prompt) - 1 : len(prompt) - 1 + n] / temperature
        out[i, :n] = torch.log_softmax(steps, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]
    return out


def ref_step_logits(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0]
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(response)]


def argmax_decode(model, prompt: list[int], max_new: int, eos: set[int]) -> list[int]:
    seq = list(prompt)
    for _ in range(max_new):
        with torch.no_grad():
            token = int(model(torch.tensor([seq])).logits[0, -1].argmax())
        seq.append(token)
        if token in eos:
            break
    return seq[len(prompt) :]


def assert_well_formed(batch: SampleBatch, engine: HFRolloutEngine, n_prompts: int, n: int, r: int) -> None:
    assert batch.response_ids.shape == (n_prompts * n, r) and batch.response_ids.dtype == torch.long
    assert batch.response_mask.dtype == torch.float32 and batch.rollout_log_probs.dtype == torch.float32
    assert batch.group_index.tolist() == [i for i in range(n_prompts) for _ in range(n)]
    eos = torch.tensor(engine.eos_token_ids)
    for ids, mask, logp in zip(batch.response_ids, batch.response_mask, batch.rollout_log_probs, strict=True):
        length = int(mask.sum())
        assert length >= 1 and mask[:length].eq(1).all() and mask[length:].eq(0).all()  # a 1-prefix, then 0
        eos_at = torch.isin(ids[:length], eos).nonzero().flatten().tolist()
        assert eos_at in ([], [length - 1]), "EOS only as the last unmasked token"
        if not eos_at:
            assert length == r, "a response without EOS runs to the full width"
        assert ids[length:].eq(engine.pad_token_id).all()
        assert logp[length:].eq(0).all() and logp[:length].le(0).all()


# ----------------------------------------------------------------------------------------------- batch layout


def test_finish_masks_up_to_and_including_the_first_eos():
    ids = torch.tensor([[5, 2, 7, 2], [5, 6, 7, 8], [2, 9, 9, 9], [4, 3, 9, 9]])
    logps = -torch.arange(1, 17, dtype=torch.float32).reshape(4, 4)
    out_ids, mask, out_logps = _finish(ids, logps, eos_ids=[2, 3], pad_id=0)
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]]
    assert out_ids.tolist() == [[5, 2, 0, 0], [5, 6, 7, 8], [2, 0, 0, 0], [4, 3, 0, 0]]
    assert out_logps.tolist() == [[-1, -2, 0, 0], [-5, -6, -7, -8], [-9, 0, 0, 0], [-13, -14, 0, 0]]
    # the pad id may itself be an EOS id (base Qwen checkpoints): the mask still comes from the first EOS
    out_ids, mask, _ = _finish(torch.tensor([[7, 2, 2, 2]]), torch.zeros(1, 4), eos_ids=[2], pad_id=2)
    assert mask.tolist() == [[1, 1, 0, 0]] and out_ids.tolist() == [[7, 2, 2, 2]]


def test_shapes_mask_and_eos_semantics(engine, prompts):
    batch = engine.generate(prompts, SamplingParams(n=3, max_new_tokens=24, seed=0))
    assert_well_formed(batch, engine, n_prompts=3, n=3, r=24)
    assert batch.prompt_ids == [p for p in prompts for _ in range(3)]
    assert (batch.response_lengths < 24).any(), "the tiny model answers in ~14 tokens: some rows must end in EOS"
    short = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=3, seed=0))
    assert_well_formed(short, engine, n_prompts=3, n=2, r=3)


def test_empty_request_gives_an_empty_batch(engine):
    batch = engine.generate([], SamplingParams(n=4, max_new_tokens=5))
    assert len(batch) == 0 and batch.response_ids.shape == (0, 5) and batch.rollout_log_probs.shape == (0, 5)


# ----------------------------------------------------------------------------------------------- determinism


def test_same_seed_same_samples_different_seed_different(engine, prompts):
    params = SamplingParams(n=4, max_new_tokens=12, temperature=1.0, seed=7)
    a, b = engine.generate(prompts, params), engine.generate(prompts, params)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.rollout_log_probs, b.rollout_log_probs)
    c = engine.generate(prompts, SamplingParams(n=4, max_new_tokens=12, temperature=1.0, seed=8))
    assert not torch.equal(a.response_ids, c.response_ids)


def test_callers_rng_is_untouched(engine, prompts):
    torch.manual_seed(1234)
    expected = torch.rand(3)
    torch.manual_seed(1234)
    engine.generate(prompts[:1], SamplingParams(n=2, max_new_tokens=4, seed=99))
    assert torch.equal(torch.rand(3), expected)


def test_chunked_request_layout_and_determinism(model_path, engine, prompts):
    chunked = HFRolloutEngine(model_path, backend=CPU, max_batch_size=4)  # 9 rows -> chunks of 4, 4, 1
    params = SamplingParams(n=3, max_new_tokens=10, seed=3)
    a, b = chunked.generate(prompts, params), chunked.generate(prompts, params)
    assert_well_formed(a, chunked, n_prompts=3, n=3, r=10)
    assert torch.equal(a.response_ids, b.response_ids)
    greedy = SamplingParams(n=3, max_new_tokens=10, temperature=0)
    assert torch.equal(chunked.generate(prompts, greedy).response_ids, engine.generate(prompts, greedy).response_ids)
    seeds = {_chunk_seed(s, k) for s in range(4) for k in range(4)}
    assert len(seeds) == 16 and _chunk_seed(5, 0) == 5  # (seed, chunk) pairs never share a stream


# ----------------------------------------------------------------------------------------------- sampling math


def test_greedy_equals_argmax_decoding(engine, reference, prompts):
    batch = engine.generate(prompts, SamplingParams(n=2, temperature=0, max_new_tokens=20))
    eos = set(engine.eos_token_ids)
    for i, prompt in enumerate(prompts):
        expected = argmax_decode(reference, prompt, 20, eos)
        for row in (2 * i, 2 * i + 1):
            n = int(batch.response_mask[row].sum())
            assert batch.response_ids[row, :n].tolist() == expected
    # greedy responses are scored at T = 1
    torch.testing.assert_close(batch.rollout_log_probs, ref_log_probs(reference, batch, 1.0), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "temperature,top_p,top_k",
    [(1.0, 1.0, -1), (0.7, 1.0, -1), (0.7, 0.9, 5), (1.3, 0.8, -1)],
)
def test_log_probs_match_an_unpadded_full_forward(engine, reference, prompts, temperature, top_p, top_k):
    params = SamplingParams(n=3, temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=16, seed=11)
    batch = engine.generate(prompts, params)
    expected = ref_log_probs(reference, batch, temperature)  # pre-truncation: top-p/top-k change nothing here
    # KV-cache decoding and one full forward run different GEMM shapes: in fp32 their log-probs differ by up to
    # 1.01e-5 on some CPUs (measured 2026-11-24 at T=0.7); a leak of truncation or padding would be >= 1e-2
    torch.testing.assert_close(batch.rollout_log_probs, expected, atol=2e-5, rtol=0)


def test_top_k_restricts_and_minus_one_disables(engine, reference, prompts):
    def ranks(batch: SampleBatch) -> list[int]:
        """Rank of every sampled token among its step's logits (0 = the argmax)."""
        out = []
        for i, prompt in enumerate(batch.prompt_ids):
            n = int(batch.response_mask[i].sum())
            response = batch.response_ids[i, :n]
            logits = ref_step_logits(reference, prompt, response.tolist())
            out += (logits > logits.gather(-1, response[:, None])).sum(-1).tolist()
        return out

    hot = dict(n=4, temperature=5.0, max_new_tokens=8, seed=5)  # T=5 puts ~70% of the mass outside the top 50
    assert max(ranks(engine.generate(prompts, SamplingParams(top_k=3, **hot)))) < 3
    # top_k=-1 must not fall back to transformers' global default top_k=50
    assert max(ranks(engine.generate(prompts, SamplingParams(top_k=-1, **hot)))) >= 50


def test_tiny_top_p_keeps_only_the_argmax(engine, prompts):
    greedy = engine.generate(prompts, SamplingParams(n=2, temperature=0, max_new_tokens=16))
    nucleus = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, top_p=1e-6, max_new_tokens=16, seed=4))
    assert torch.equal(nucleus.response_ids, greedy.response_ids)


# ----------------------------------------------------------------------------------------------- weight sync


def _perturbed(model, seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}


def test_update_weights_loads_another_model(model_path, reference, prompts):
    from transformers import AutoModelForCausalLM

    engine = HFRolloutEngine(model_path, backend=CPU)
    ptrs = {k: v.data_ptr() for k, v in engine.model.state_dict().items()}
    new = _perturbed(reference, seed=0)
    other = AutoModelForCausalLM.from_pretrained(model_path, attn_implementation="eager").eval()
    other.load_state_dict(new)

    got = engine.update_weights(iter(new.items()))
    assert got == sum(t.numel() * 4 for t in new.values())
    assert {k: v.data_ptr() for k, v in engine.model.state_dict().items()} == ptrs  # copied in place
    greedy = engine.generate(prompts, SamplingParams(n=1, temperature=0, max_new_tokens=16))
    eos = set(engine.eos_token_ids)
    for i, prompt in enumerate(prompts):
        n = int(greedy.response_mask[i].sum())
        assert greedy.response_ids[i, :n].tolist() == argmax_decode(other, prompt, 16, eos)
    sampled = engine.generate(prompts, SamplingParams(n=2, temperature=0.8, max_new_tokens=12, seed=2))
    torch.testing.assert_close(sampled.rollout_log_probs, ref_log_probs(other, sampled, 0.8), atol=1e-5, rtol=0)


def test_update_weights_rejects_unknown_names_and_shapes(engine):
    with pytest.raises(ValueError, match="model.layers.0.mlp.not_a_weight"):
        engine.update_weights([("model.layers.0.mlp.not_a_weight", torch.zeros(3))])
    with pytest.raises(ValueError, match="model.norm.weight.*shape"):
        engine.update_weights([("model.norm.weight", torch.zeros(7))])


def _tied_model_dir(tmp_path, model_path) -> str:
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tok = AutoTokenizer.from_pretrained(model_path)
    config = Qwen3Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, tie_word_embeddings=True, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    return str(tmp_path)


def test_update_weights_with_tied_embeddings(tmp_path, model_path):
    engine = HFRolloutEngine(_tied_model_dir(tmp_path, model_path), backend=CPU)
    model = engine.model
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert embed.data_ptr() == head.data_ptr()
    new = _perturbed(model, seed=1)
    without_head = {k: v for k, v in new.items() if k != "lm_head.weight"}
    assert engine.update_weights(without_head.items()) == sum(v.numel() * 4 for v in without_head.values())
    assert torch.equal(head, new["model.embed_tokens.weight"]) and head.data_ptr() == embed.data_ptr()
    # only the head in the stream: the embedding follows it
    head_only = torch.randn(head.shape)
    engine.update_weights([("lm_head.weight", head_only)])
    assert torch.equal(embed, head_only) and model.get_input_embeddings().weight.data_ptr() == embed.data_ptr()


def test_update_weights_accepts_per_expert_checkpoint_names(tmp_path):
    """vLLM/mbridge-style per-expert tensors land where transformers' own checkpoint conversion puts them."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    moe_path = ensure_tiny_model(moe=True)
    ckpt = load_file(f"{moe_path}/model.safetensors")
    assert any(".experts.0.gate_proj.weight" in k for k in ckpt)  # the checkpoint layout, per expert
    gen = torch.Generator().manual_seed(3)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in ckpt.items()}
    shutil.copytree(moe_path, tmp_path, dirs_exist_ok=True)
    save_file(new, f"{tmp_path}/model.safetensors", metadata={"format": "pt"})
    expected = AutoModelForCausalLM.from_pretrained(str(tmp_path)).state_dict()  # transformers fuses the experts

    engine = HFRolloutEngine(moe_path, backend=CPU)
    assert engine.update_weights(new.items()) == sum(v.numel() * 4 for v in new.values())
    got = engine.model.state_dict()
    # transformers 5 fuses the experts (the mapping under test); 4.57 keeps one Linear per expert (names map 1:1)
    assert any(k.endswith("experts.gate_up_proj") for k in got) == (int(transformers.__version__.split(".")[0]) >= 5)
    for k, v in expected.items():
        torch.testing.assert_close(got[k], v, atol=0, rtol=0, msg=k)


def test_sleep_and_wake_up_keep_the_engine_usable(engine, prompts):
    params = SamplingParams(n=1, temperature=0, max_new_tokens=6)
    before = engine.generate(prompts, params)
    engine.sleep()
    engine.wake_up()
    assert torch.equal(engine.generate(prompts, params).response_ids, before.response_ids)


# ----------------------------------------------------------------------------------------------- config / errors


def test_factory_follows_the_model_config(model_path):
    cfg = Config()
    cfg.model.dtype, cfg.model.attn_implementation = "bfloat16", "eager"
    engine = build_hf_rollout(cfg, CPU, model_path)
    assert engine.model.dtype == torch.bfloat16 and engine.model.config._attn_implementation == "eager"
    batch = engine.generate([[1, 2, 3]], SamplingParams(n=2, max_new_tokens=4))
    assert batch.rollout_log_probs.dtype == torch.float32


def test_checkpoint_sampling_defaults_are_ignored(tmp_path, model_path, engine, prompts):
    """A Qwen3-style generation_config.json (T=0.6, top_k=20, repetition penalty) must not leak into sampling."""
    import json

    shutil.copytree(model_path, tmp_path, dirs_exist_ok=True)
    gen = json.loads((tmp_path / "generation_config.json").read_text())
    gen.update(do_sample=True, temperature=0.6, top_k=1, top_p=0.5, repetition_penalty=5.0, min_new_tokens=15)
    (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    other = HFRolloutEngine(str(tmp_path), backend=CPU)
    for params in (SamplingParams(n=2, max_new_tokens=16, seed=1), SamplingParams(n=1, temperature=0)):
        a, b = other.generate(prompts, params), engine.generate(prompts, params)
        assert torch.equal(a.response_ids, b.response_ids)


def test_bad_input_raises_user_errors(model_path, engine):
    with pytest.raises(ConfigError, match="model.dtype"):
        HFRolloutEngine(model_path, backend=CPU, dtype="float8")
    with pytest.raises(UserError, match="model.path"):
        HFRolloutEngine("/nonexistent/model", backend=CPU)
    with pytest.raises(ConfigError, match="rollout.top_k"):
        engine.generate([[1, 2]], SamplingParams(top_k=0))
    with pytest.raises(ConfigError, match="rollout.top_p"):
        engine.generate([[1, 2]], SamplingParams(top_p=0.0))
    with pytest.raises(UserError, match="prompt 1 is empty"):
        engine.generate([[1, 2], []], SamplingParams())
    with pytest.raises(UserError, match="token id 100000"):
        engine.generate([[1, 100000]], SamplingParams())
