"""actor.shared_prefix: samples of one prompt share its forward in a packed micro-batch (logprobs.shared_prefix_row,
packed_attention.shared_prefix_forward).

Expected values are independent: one plain Hugging Face forward per sample (its own prompt + response, no packing)
for log-probs, and the gradient of the same weighted sum through those forwards; the row layout by hand.
"""

from __future__ import annotations

import pytest
import torch

from gspo_ascend.engines import packed_attention
from gspo_ascend.engines.base import SampleBatch
from gspo_ascend.engines.logprobs import forward_log_probs, response_tokens, shared_prefix_row
from gspo_ascend.errors import ConfigError
from tests.unit.fsdp_worker import engine_config, make_batch, reference_log_probs

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def model_path() -> str:
    from gspo_ascend.tiny import ensure_tiny_model

    return str(ensure_tiny_model())


def load(path: str, attn: str = "sdpa", dtype=torch.float64):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn).eval()


def grouped_batch(seed: int = 3) -> SampleBatch:
    """Nine samples: four of prompt A (two with empty responses), three of prompt B, one of C alone, and one more of
    A after them (a group need not be adjacent)."""
    b = make_batch(9, 7, seed=seed)
    a, bb, c = b.prompt_ids[0], b.prompt_ids[4], b.prompt_ids[7]
    prompts = [a, a, a, a, bb, bb, bb, c, a]
    mask = b.response_mask.clone()
    mask[1:3] = 0  # two of A's samples answered nothing
    mask[[0, 3, 4, 5, 6, 7, 8], 0] = 1  # the others at least one token
    mask = (mask.cumprod(1) > 0).float()  # right-padded
    return SampleBatch(prompts, torch.where(mask.bool(), b.response_ids, 0), mask, advantages=b.advantages)


def test_the_row_holds_each_shared_prompt_once_by_hand():
    prompts = [[5, 6, 7], [9], [5, 6, 7], [5, 6, 7]]
    responses = [[1, 2], [3, 4, 8], [], [10]]
    row = shared_prefix_row(prompts, responses)
    # prompt [5, 6, 7] once, then its non-empty responses [1, 2] and [10]; [9] alone is one sequence with its answer
    assert row.ids == [5, 6, 7, 1, 2, 10, 9, 3, 4, 8]
    assert row.pos == [0, 1, 2, 3, 4, 3, 0, 1, 2, 3]
    assert row.blocks == [3, 2, 1, 4]
    assert row.prefix_of == [-1, 0, 0, -1]
    t = row.targets
    # sample 0: token 1 from the prompt's last position (2), token 2 from its own block's first (3);
    # sample 3: token 10 from the same position 2; sample 1: from 6 (its prompt's last) and its own tokens
    assert t.rows == [0, 0, 3, 1, 1, 1] and t.cols == [0, 1, 0, 0, 1, 2]
    assert t.keep == [2, 3, 2, 6, 7, 8] and t.labels == [1, 2, 10, 3, 4, 8]


@pytest.fixture
def float64_norms(monkeypatch):
    """Qwen3's RMSNorm computes in float32 whatever the model's dtype; a shared prompt's gradient is then the sum of
    its samples' taken before that float32 step instead of after it: ~1e-7 apart, correctly. In float64 throughout,
    the shared row must equal the per-sample forwards to summation order (1e-12)."""
    from transformers.models.qwen3 import modeling_qwen3

    def forward(self, h):
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    monkeypatch.setattr(modeling_qwen3.Qwen3RMSNorm, "forward", forward)


def count_row_tokens(model) -> list[int]:
    """The length of every row the model's embedding sees."""
    seen: list[int] = []
    model.get_input_embeddings().register_forward_hook(lambda m, args, out: seen.append(args[0].shape[-1]))
    return seen


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_shared_prefix_log_probs_and_gradients_equal_one_forward_per_sample(model_path, attn, float64_norms):
    batch = grouped_batch()
    model, reference = load(model_path, attn), load(model_path, attn)
    assert packed_attention.enable(model) and packed_attention.takes_shared_prefix(model)
    seen = count_row_tokens(model)
    got = forward_log_probs(model, batch, 0.7, packed=True, shared_prefix=True)
    want = reference_log_probs(reference, batch, 0.7)
    lengths = batch.response_mask.sum(1).long().tolist()
    a, b, c = (len(batch.prompt_ids[i]) for i in (0, 4, 7))
    # A once + its 3 non-empty answers, B once + 3, C with its answer: not the 9 prompts of the plain row
    assert seen == [a + b + c + sum(lengths)]
    # eager's softmax is float32 whatever the dtype (transformers' eager_attention_forward): a shared prefix's scores
    # are the same numbers in other matmul shapes, ~1e-7 relative apart after that cast
    tol = 1e-12 if attn == "sdpa" else 1e-5
    assert (got - want).abs().max() <= tol
    weights = torch.randn(got.shape, generator=torch.Generator().manual_seed(1), dtype=got.dtype)
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    ours = dict(model.named_parameters())
    for name, p in reference.named_parameters():
        assert p.grad.abs().max() > 0, name
        assert (ours[name].grad - p.grad).abs().max() <= tol * max(1.0, p.grad.abs().max().item()), name


def test_gradient_checkpointing_recomputes_the_same_row_and_builds_each_mask_once(
    model_path, float64_norms, monkeypatch
):
    """With the engine's gradient checkpointing (non-reentrant: each layer's forward runs again in backward) the
    shared row gives the per-sample forwards' gradients; every layer and every recompute reads the forward's one
    mask per block shape (packed_attention.SharedBlocks): A's 3 answers and B's 3 are 6 blocks of <= 6 shapes."""
    batch = grouped_batch()
    model, reference = load(model_path), load(model_path)
    packed_attention.enable(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()  # checkpointing runs only in training mode; the tiny Qwen3 has no dropout
    built: list[tuple[int, int]] = []
    original = packed_attention._lower_right_causal

    def counted(n_q, n_k, like, additive):
        built.append((n_q, n_k))
        return original(n_q, n_k, like, additive)

    monkeypatch.setattr(packed_attention, "_lower_right_causal", counted)
    got = forward_log_probs(model, batch, 0.7, packed=True, shared_prefix=True)
    want = reference_log_probs(reference, batch, 0.7)
    weights = torch.randn(got.shape, generator=torch.Generator().manual_seed(2), dtype=got.dtype)
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    assert (got - want).abs().max() <= 1e-12
    ours = dict(model.named_parameters())
    for name, p in reference.named_parameters():
        assert (ours[name].grad - p.grad).abs().max() <= 1e-12 * max(1.0, p.grad.abs().max().item()), name
    row = shared_prefix_row(batch.prompt_ids, response_tokens(batch))
    prefixed = [(n, row.blocks[p] + n) for n, p in zip(row.blocks, row.prefix_of, strict=True) if p >= 0]
    assert model.config.num_hidden_layers > 1 and len(prefixed) == 6
    assert sorted(built) == sorted(set(prefixed))  # once per shape, not per layer, block or recompute


def test_a_leak_between_answers_would_show(model_path, float64_norms, monkeypatch):
    """The test above can fail: answers of one prompt attending to each other (no prefix blocks, one causal
    sequence per group) moves the log-probs by O(0.1)."""
    batch = grouped_batch()
    model = load(model_path)
    packed_attention.enable(model)
    want = reference_log_probs(load(model_path), batch, 0.7)
    original = packed_attention.shared_prefix_forward

    def one_sequence_per_group(fn, eager, module, qkv, lengths, blocks, kwargs):
        merged: list[int] = []  # a response block follows its prompt's block or another of its answers
        for n, p in zip(lengths, blocks.prefix_of, strict=True):
            if p >= 0:
                merged[-1] += n
            else:
                merged.append(n)
        return original(fn, eager, module, qkv, merged, packed_attention.SharedBlocks([-1] * len(merged)), kwargs)

    monkeypatch.setattr(packed_attention, "shared_prefix_forward", one_sequence_per_group)
    with torch.no_grad():
        leaked = forward_log_probs(model, batch, 0.7, packed=True, shared_prefix=True)
    assert (leaked - want).abs().max() > 1e-2


def test_without_the_hook_the_row_is_the_plain_one(model_path):
    """A model whose attention is not the packed hook (here: never enabled) gets the plain packed row, and a
    shared-prefix row is refused for it by name."""
    batch = grouped_batch()
    model = load(model_path)
    seen = count_row_tokens(model)
    with torch.no_grad():
        forward_log_probs(model, batch, 0.7, packed=True, shared_prefix=True)
    assert seen == [sum(len(p) for p in batch.prompt_ids) + int(batch.response_mask.sum())]
    with pytest.raises(ValueError, match="packed attention hook"):
        packed_attention.forward_kwargs(model, [3, 2], [-1, 0])


def engine_step(model_path: str, batch: SampleBatch, *overrides: str):
    """One fsdp engine on the whole batch as one micro-batch: its log-probs, its gradients (full tensors) and the
    tokens its packed rows held."""
    from gspo_ascend.device import get_backend
    from gspo_ascend.engines.fsdp import FSDPEngine

    cfg = engine_config(f"data.train_batch_size={len(batch)}", "algorithm.minibatches_per_rollout=1", *overrides)
    cfg.actor.micro_batch_size = len(batch)
    engine = FSDPEngine(cfg, get_backend("cpu"), model_path)
    assert engine.shared_prefix is ("actor.shared_prefix=on" in overrides)
    seen = count_row_tokens(engine.model)
    old = engine.compute_log_probs(batch, 1.0)
    engine.backward_minibatch(batch.replace(old_log_probs=old), 1.0)
    grads = {n: p.grad.full_tensor().clone() for n, p in engine.model.named_parameters()}
    engine.close()
    return old, grads, sum(seen)


def largest_gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_engine_updates_equal_with_and_without_a_shared_prefix(model_path):
    """The fsdp engine with actor.shared_prefix on and off: the same log-probs and update, in float32 (1e-6 of the
    log-probs, 1e-5 of the largest gradient: summation order), and on really ran shorter rows."""
    batch = grouped_batch(seed=5)
    lp_off, g_off, n_off = engine_step(model_path, batch, "actor.shared_prefix=off")
    lp_on, g_on, n_on = engine_step(model_path, batch, "actor.shared_prefix=on")
    assert n_on < n_off
    assert ((lp_on - lp_off).abs() <= 1e-6 * lp_off.abs().clamp_min(1)).all()
    scale = max(g.abs().max().item() for g in g_off.values())
    assert largest_gap(g_on, g_off) <= 1e-5 * scale


def test_in_bfloat16_a_shared_prefix_is_as_close_to_float32_as_the_plain_row(model_path):
    """bf16 compute (FSDP2's MixedPrecisionPolicy; float32 master weights and reduction) moves the plain row's
    log-probs by ~4e-3 and its gradients by ~4e-2 of the largest one from the float32 update (measured on this
    batch): that is bf16's own error, and on and off differ from each other by as much. So the bound is relative to
    it: the shared-prefix row's error against the float32 update is at most 1.5x the plain row's (measured 1.1-1.3x:
    a prompt's gradient is summed once in bf16 instead of once per sample). A wrong mask or position errs by O(1)."""
    batch = grouped_batch(seed=5)
    lp_ref, g_ref, _ = engine_step(model_path, batch, "actor.shared_prefix=off")
    lp_off, g_off, n_off = engine_step(model_path, batch, "actor.shared_prefix=off", "model.dtype=bfloat16")
    lp_on, g_on, n_on = engine_step(model_path, batch, "actor.shared_prefix=on", "model.dtype=bfloat16")
    assert n_on < n_off

    def lp_error(lp):
        return ((lp - lp_ref).abs() / lp_ref.abs().clamp_min(1)).max().item()

    assert 0 < lp_error(lp_on) <= 1.5 * lp_error(lp_off)  # 0 <: bf16 really computed
    assert 0 < largest_gap(g_on, g_ref) <= 1.5 * largest_gap(g_off, g_ref)


@pytest.mark.parametrize(
    "overrides, why",
    [
        (["actor.engine=megatron"], "fsdp engine"),
        (["actor.use_remove_padding=false"], "use_remove_padding"),
        (["actor.ulysses_sequence_parallel_size=2", "trainer.devices_per_node=2"], "ulysses"),
        (["actor.routing_replay=r2"], "routing_replay"),
        (["model.attn_implementation=flash_attention_2"], "attn_implementation"),
        (["trainer.device=npu"], "NPU"),
    ],
)
def test_on_is_refused_where_it_cannot_run_and_auto_is_off_there(overrides, why):
    from gspo_ascend.config import load_config, shared_prefix_on

    with pytest.raises(ConfigError, match=f"actor.shared_prefix.*{why}"):
        load_config(overrides=[*overrides, "actor.shared_prefix=on"])
    try:
        cfg = load_config(overrides=overrides)
    except ConfigError:  # refused for a reason of its own (e.g. routing replay wants an MoE model elsewhere)
        return
    assert not shared_prefix_on(cfg, on_cpu=True)


def test_auto_is_on_on_the_host_only_and_off_for_an_moe_model_which_refuses_on(model_path):
    from gspo_ascend.config import load_config, shared_prefix_on
    from gspo_ascend.device import get_backend
    from gspo_ascend.engines.fsdp import FSDPEngine
    from gspo_ascend.tiny import ensure_tiny_model

    auto, on, off = (load_config(overrides=o) for o in ([], OVERRIDE_ON, ["actor.shared_prefix=off"]))
    assert shared_prefix_on(auto, on_cpu=True) and not shared_prefix_on(auto, on_cpu=False)
    assert shared_prefix_on(on, on_cpu=False) and not shared_prefix_on(off, on_cpu=True)
    moe = str(ensure_tiny_model(moe=True))
    base = ("data.train_batch_size=8", "algorithm.minibatches_per_rollout=1")
    assert FSDPEngine(engine_config(*base), get_backend("cpu"), moe).shared_prefix is False  # auto: off, silently
    with pytest.raises(ConfigError, match="actor.shared_prefix.*MoE"):
        FSDPEngine(engine_config(*base, *OVERRIDE_ON), get_backend("cpu"), moe)


OVERRIDE_ON = ["actor.shared_prefix=on"]


def test_the_budget_planner_keeps_a_prompt_s_samples_together_by_hand():
    """Budget 10; prompt A (3 tokens) answered by 4, 2 and 5 tokens, prompt B (2) by 6. Pieces: A's first two (3 + 4
    + 2 = 9), A's third (3 + 5 = 8, the 14 of all three would not fit), B's (8); first-fit decreasing places each
    alone. The plain planner (costs 7, 5, 8, 8) needs four."""
    from gspo_ascend.engines.microbatch import plan_micro_batches

    lengths = [4, 2, 5, 6]
    mask = (torch.arange(6)[None] < torch.tensor(lengths)[:, None]).float()
    batch = SampleBatch([[1, 2, 3]] * 3 + [[4, 5]], mask.long() * 7, mask)
    shared = plan_micro_batches(batch, max_tokens=10, shared_prefix=True)
    assert shared.groups == [[0, 1], [2], [3]] and shared.oversized == 0
    assert len(plan_micro_batches(batch, max_tokens=10)) == 4
    over = plan_micro_batches(batch, max_tokens=8, shared_prefix=True)  # A's first two cost 9 > 8: apart
    assert over.groups == [[0], [1], [2], [3]] and over.oversized == 0
