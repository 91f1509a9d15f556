"""The fsdp engine's fast paths (issue #43): layers kept gathered with one gradient reduction per minibatch, fused
AdamW, the planner's choice between them and ZeRO-3, and cuDNN's per-shape attention plans kept out on CUDA.

Each test fails if the fast path is silently not taken (the layers' parameter type and the gradients' presence
between micro-batches are what FSDP2 exposes of its state), and the fast path equals the path it replaces.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from benchmarks.train_throughput import QWEN3_0_6B
from gspo_ascend.config import load_config
from gspo_ascend.device import CPU, CUDA, NPU_SHIM, get_backend
from gspo_ascend.doctor import planner
from gspo_ascend.doctor.modelspec import spec_from_dict
from gspo_ascend.errors import ConfigError
from tests.unit.fsdp_worker import engine_config, make_batch, reference_log_probs, with_old_log_probs

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def model_path() -> str:
    from gspo_ascend.tiny import ensure_tiny_model

    return str(ensure_tiny_model())


def _engine(model_path: str, mode: str):
    from gspo_ascend.engines.fsdp import FSDPEngine

    overrides = [
        "data.train_batch_size=8",
        "algorithm.minibatches_per_rollout=1",
        "actor.lr=1e-3",
        "actor.max_tokens_per_micro_batch=20",  # several micro-batches per minibatch
        f"actor.fsdp_reshard_after_forward={mode}",
    ]
    return FSDPEngine(engine_config(*overrides), get_backend("cpu"), model_path)


def _batch(model_path: str):
    from transformers import AutoModelForCausalLM

    batch = make_batch(8, 6, seed=11, min_response=2)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    with torch.no_grad():
        return with_old_log_probs(batch, reference_log_probs(model, batch, 1.0), 1e-4, 11)


def _layer_params(engine) -> list[torch.Tensor]:
    return [p for name, p in engine.model.named_parameters() if ".layers." in name]


def _watch(engine) -> list[tuple[bool, bool]]:
    """At each micro-batch's loss: (are the layers' parameters gathered, has any reduced (sharded, DTensor) gradient
    appeared). Kept gathered, a parameter is the plain unsharded tensor and its .grad the unsharded accumulation."""
    seen: list[tuple[bool, bool]] = []
    inner = engine.policy_loss

    def loss(*args, **kwargs):
        gathered = not any(isinstance(p, DTensor) for p in _layer_params(engine))
        seen.append((gathered, any(isinstance(p.grad, DTensor) for p in engine.model.parameters())))
        return inner(*args, **kwargs)

    engine.policy_loss = loss
    return seen


def test_kept_gathered_layers_reduce_once_per_minibatch_and_equal_zero3(model_path):
    batch = _batch(model_path)
    results = {}
    for mode in ("off", "on"):
        engine = _engine(model_path, mode)
        assert engine.keep_gathered is (mode == "off")
        assert engine.optimizer.defaults["fused"] is True  # fused AdamW, not foreach
        seen = _watch(engine)
        engine.compute_log_probs(batch, 1.0)
        # a forward without backward reshards what it gathered, whichever mode and the root unit too (FSDP2 never
        # reshards a root after forward): nothing stays gathered into the rollout
        assert all(isinstance(p, DTensor) for p in engine.model.parameters())
        metrics = engine.update(batch, 1.0)
        assert len(seen) >= 3, "the test needs several micro-batches"
        if mode == "off":  # gathered through every micro-batch; no reduced gradient before the last backward
            assert seen == [(True, False)] * len(seen)
        else:  # ZeRO-3: resharded after each forward; each backward reduces
            assert seen == [(False, False)] + [(False, True)] * (len(seen) - 1)
        assert all(isinstance(p, DTensor) for p in _layer_params(engine))  # resharded after the last backward
        results[mode] = (metrics, {n: t.clone() for n, t in engine.export_weights()})
        engine.close()
    (m_off, w_off), (m_on, w_on) = results["off"], results["on"]
    assert m_off["actor/grad_norm"] == pytest.approx(m_on["actor/grad_norm"], rel=1e-6)
    for name, value in w_on.items():  # one rank: the same float32 sums in the same order
        assert (w_off[name] - value).abs().max() <= 1e-6, name


def test_the_kl_reference_is_resharded_after_an_update(model_path):
    from gspo_ascend.engines.fsdp import FSDPEngine

    cfg = engine_config("data.train_batch_size=8", "algorithm.minibatches_per_rollout=1", "algorithm.kl_coef=0.1")
    engine = FSDPEngine(cfg, get_backend("cpu"), model_path)
    engine.update(_batch(model_path), 1.0)
    assert all(isinstance(p, DTensor) for p in engine.ref_model.parameters())  # its root too: forwards only
    engine.close()


def _cfg(*overrides: str):
    return load_config(None, ["actor.engine=fsdp", "model.dtype=bfloat16", *overrides])


def test_planner_keeps_layers_gathered_where_they_fit():
    spec = spec_from_dict({**QWEN3_0_6B, "model_type": "qwen3"})  # Qwen3-0.6B's published config
    auto = _cfg("trainer.devices_per_node=8")
    assert planner.fsdp_keeps_gathered(auto, spec, None, 1)  # one rank: sharding saves nothing
    assert not planner.fsdp_keeps_gathered(auto, spec, None, 8)  # device memory unknown: ZeRO-3
    kept = planner.fsdp_train(_cfg("trainer.devices_per_node=8", "actor.fsdp_reshard_after_forward=off"), spec)
    sharded = planner.fsdp_train(_cfg("trainer.devices_per_node=8", "actor.fsdp_reshard_after_forward=on"), spec)
    p = spec.total_params
    assert kept.parts["gradients"] == sharded.parts["gradients"] == -(-4 * p // 8)  # what stays: the shards
    layer = spec.layer_params(0)  # bf16: every layer gathered instead of two, + the unsharded fp32 accumulation
    assert kept.parts["gathered"] - sharded.parts["gathered"] == 2 * (28 - 2) * layer + 4 * p
    fits = int(kept.total / planner.KEEP_GATHERED_SHARE) + 1
    assert planner.fsdp_keeps_gathered(auto, spec, fits, 8)
    assert not planner.fsdp_keeps_gathered(auto, spec, fits - 2, 8)
    for mode, expected in (("on", False), ("off", True)):  # explicit settings are taken as they are
        assert planner.fsdp_keeps_gathered(_cfg(f"actor.fsdp_reshard_after_forward={mode}"), spec, None, 1) is expected


def test_an_auto_token_budget_is_sized_at_start_and_said(model_path, monkeypatch, capsys):
    """actor.max_tokens_per_micro_batch=auto: the engine asks the planner with the memory its runtime reports (the host
    reports none: the host budget) and says what it chose, once; its micro-batches follow the number."""
    from gspo_ascend.doctor.modelspec import load_spec
    from gspo_ascend.engines.fsdp import FSDPEngine

    overrides = (
        "data.train_batch_size=8",
        "algorithm.minibatches_per_rollout=1",
        "actor.max_tokens_per_micro_batch=auto",
    )
    cfg = engine_config(*overrides)
    backend = get_backend("cpu")
    engine = FSDPEngine(cfg, backend, model_path)
    assert engine.cfg.actor.max_tokens_per_micro_batch == planner.HOST_TOKEN_BUDGET
    assert cfg.actor.max_tokens_per_micro_batch == "auto"  # the caller's config is not changed
    engine.close()
    device = 24 * 2**30  # as if the runtime reported a 24 GiB device
    monkeypatch.setattr(type(backend), "total_memory", lambda self, index=0: device)
    want, mode, how = planner.token_budget(cfg, load_spec(model_path), device, npu=False)
    assert want > planner.HOST_TOKEN_BUDGET and mode == "off"  # the tiny model: the whole minibatch, kept gathered
    engine = FSDPEngine(cfg, backend, model_path)
    assert engine.cfg.actor.max_tokens_per_micro_batch == want and engine.keep_gathered
    engine.close()
    said = [line for line in capsys.readouterr().out.splitlines() if "max_tokens_per_micro_batch=auto" in line]
    assert said == [
        f"note: actor.max_tokens_per_micro_batch=auto: {planner.HOST_TOKEN_BUDGET:,} tokens a micro-batch "
        "(no device memory to size it by (the host))",
        f"note: actor.max_tokens_per_micro_batch=auto: {want:,} tokens a micro-batch ({how})",
    ]


def test_a_token_budget_is_a_positive_number_or_auto():
    assert _cfg("actor.max_tokens_per_micro_batch=auto").actor.max_tokens_per_micro_batch == "auto"
    for bad, fragment in (("lots", "must be int or one of 'auto' or null"), ("0", "must be > 0, auto or null")):
        with pytest.raises(ConfigError, match=fragment):
            _cfg(f"actor.max_tokens_per_micro_batch={bad}")
    # a padded micro-batch is samples x its longest, which a token budget does not bound: auto is for packed ones
    for padded in (["actor.use_remove_padding=false"], ["actor.engine=megatron", "actor.context_parallel_size=2"]):
        with pytest.raises(ConfigError, match=r"'actor.max_tokens_per_micro_batch' \(auto\) sizes packed"):
            _cfg("actor.max_tokens_per_micro_batch=auto", *padded)


def test_the_planner_counts_the_fused_heads_chunk():
    from gspo_ascend.engines.fused_logprob import CHUNK_ROWS

    assert planner.FUSED_CHUNK_ROWS == CHUNK_ROWS
    spec = spec_from_dict({**QWEN3_0_6B, "model_type": "qwen3"})  # Qwen3-0.6B's published config
    fsdp = _cfg("actor.max_tokens_per_micro_batch=16384")
    # one chunk, not the 16k rows; over several chunks, the head's weight gradient in fp32 beside a bf16 product
    assert planner.logits_bytes(fsdp, spec, 1) == 1024 * 151936 * (2 + 12) + (4 + 2) * 151936 * 1024
    one_chunk = _cfg("actor.max_tokens_per_micro_batch=1000")
    assert planner.logits_bytes(one_chunk, spec, 1) == 1000 * 151936 * (2 + 12)
    megatron = _cfg("actor.engine=megatron", "actor.max_tokens_per_micro_batch=16384")
    assert planner.logits_bytes(megatron, spec, 1) == 16384 * 151936 * (2 + 4)


def test_the_setting_is_refused_with_megatron():
    with pytest.raises(ConfigError, match="actor.fsdp_reshard_after_forward"):
        load_config(None, ["actor.engine=megatron", "actor.fsdp_reshard_after_forward=off"])


def test_cudnn_attention_plans_are_switched_off_on_cuda_only(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.backends.cuda, "enable_cudnn_sdp", lambda on: calls.append(on))
    assert not CPU.avoid_per_shape_attention_plans()
    assert not NPU_SHIM.avoid_per_shape_attention_plans()
    assert calls == []
    assert CUDA.avoid_per_shape_attention_plans()
    assert calls == [False]


def test_the_update_logs_the_policys_token_mean_entropy(model_path):
    """``actor/entropy_token``: the token mean of the policy's entropy over the trained tokens, from the update's own
    forwards (before its one optimizer step), over several micro-batches; expected from full logits per sample."""
    from transformers import AutoModelForCausalLM

    batch = _batch(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64)
    total, tokens = 0.0, 0
    with torch.no_grad():
        for i, prompt in enumerate(batch.prompt_ids):
            n = int(batch.trained_mask[i].sum())
            seq = torch.tensor([prompt + batch.response_ids[i, :n].tolist()])
            logp = torch.log_softmax(model(input_ids=seq).logits[0, len(prompt) - 1 : len(prompt) - 1 + n], -1)
            total += float(-(logp.exp() * logp).sum())
            tokens += n
    engine = _engine(model_path, "on")
    metrics = engine.update(batch, 1.0)
    assert metrics["actor/micro_batches"] > 1
    assert metrics["actor/entropy_token"] == pytest.approx(total / tokens, rel=1e-5)
