"""The vllm rollout engine's vllm-ascend handling without vLLM (issue #14, items 3 and 5).

Item 3: what the engine does with the log-prob mode its workers report (patched -> processed; a worker that
cannot be patched -> raw: refused with ``algorithm.old_logprobs=engine`` where it matters, one warning
otherwise), and the gates of :mod:`gspo_ascend.patches.vllm_ascend` on stand-in objects. The patches themselves
run against the real vllm-ascend / vLLM 0.11 code in ``tests/conformance/test_vllm_ascend_rollout.py``.

Item 5: ``TASK_QUEUE_ENABLE`` must be in a Ray actor's environment when its process starts, because the actor
imports torch_npu (resolving the npu backend) before it builds any engine.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.unit.fake_ray import ray_modules

REPO = Path(__file__).resolve().parents[2]


def _cfg(**overrides):
    from gspo_ascend.config import load_config

    base = {"rollout.engine": "vllm", "rollout.enforce_eager": "null", **overrides}
    return load_config(overrides=[f"{k}={v}" for k, v in base.items()])


# ----------------------------------------------------------------------------------------------- item 3


class _TopK:
    """Stands in for vLLM 0.11's ``TopKTopPSampler``: ``logprobs_mode`` is read per call by ``forward_native``;
    ``__init__`` binds ``forward`` to ``forward_native`` off CUDA, to a FlashInfer path on CUDA for raw modes."""

    def __init__(self, mode: str, native: bool = True):
        self.logprobs_mode = mode
        self.forward = self.forward_native if native else self.forward_cuda

    def forward_native(self):
        return self.logprobs_mode

    def forward_cuda(self):
        raise AssertionError("FlashInfer cannot return processed log-probs")


def _runner(mode: str = "raw_logprobs", native: bool = True):
    """Stands in for vllm-ascend's ``NPUModelRunner``: ``AscendSampler()`` keeps vLLM's default mode."""
    return SimpleNamespace(sampler=SimpleNamespace(logprobs_mode=mode, topk_topp_sampler=_TopK(mode, native)))


def test_honour_logprobs_mode_gates_on_the_sampler():
    from gspo_ascend.patches.vllm_ascend import (
        effective_logprobs_mode,
        honour_logprobs_mode,
        restore_logprobs_mode,
    )

    runner = _runner()
    assert honour_logprobs_mode(runner, "processed_logprobs").status == "applied"
    assert runner.sampler.topk_topp_sampler.forward() == "processed_logprobs"
    assert honour_logprobs_mode(runner, "processed_logprobs").status == "already applied"
    assert restore_logprobs_mode(runner) and effective_logprobs_mode(runner) == "raw_logprobs"
    assert not restore_logprobs_mode(runner)
    built_right = _runner("processed_logprobs")  # vLLM's own runners pass the mode
    entry = honour_logprobs_mode(built_right, "processed_logprobs")
    assert entry.status == "skipped" and "already" in entry.detail
    flashinfer = _runner(native=False)
    entry = honour_logprobs_mode(flashinfer, "processed_logprobs")
    assert entry.status == "skipped" and "forward_native" in entry.detail
    assert effective_logprobs_mode(flashinfer) == "raw_logprobs"
    assert honour_logprobs_mode(SimpleNamespace(), "processed_logprobs").status == "skipped"


class _FakeLLM:
    """Stands in for ``vllm.LLM``: ``collective_rpc`` calls the named method of every worker's extension, as
    vLLM does (``worker_extension_cls``); the workers hold stand-in runners."""

    def __init__(self, runners):
        from gspo_ascend.engines.vllm_rollout import WeightSyncExtension

        self.workers = []
        for runner in runners:
            worker = WeightSyncExtension()
            worker.model_runner = runner
            worker.vllm_config = SimpleNamespace(model_config=SimpleNamespace(logprobs_mode="processed_logprobs"))
            self.workers.append(worker)
        self.closed = False

    def collective_rpc(self, method, args=()):
        return [getattr(worker, method)(*args) for worker in self.workers]

    def get_tokenizer(self):
        return SimpleNamespace(pad_token_id=0, eos_token_id=2)


@pytest.fixture
def engine_for(tmp_path, monkeypatch):
    """Build a VLLMRolloutEngine on the CPU backend whose vLLM is a :class:`_FakeLLM` over ``runners``."""
    from gspo_ascend.device import CPU
    from gspo_ascend.engines import vllm_rollout

    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 64, "num_hidden_layers": 1}))
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # apply_env_defaults keeps an exported value

    def build(cfg, runners):
        fake = _FakeLLM(runners)
        monkeypatch.setattr(vllm_rollout.VLLMRolloutEngine, "_build_llm", lambda self, path: fake)
        monkeypatch.setattr(vllm_rollout.VLLMRolloutEngine, "close", lambda self: setattr(fake, "closed", True))
        return vllm_rollout.VLLMRolloutEngine(str(tmp_path), backend=CPU, cfg=cfg), fake

    return build


def test_vllm_ascend_sampler_is_patched_at_engine_start(engine_for, caplog):
    runners = [_runner(), _runner()]
    with caplog.at_level(logging.INFO, logger="gspo_ascend.engines.vllm_rollout"):
        engine, _ = engine_for(_cfg(**{"rollout.temperature": 0.7, "algorithm.old_logprobs": "engine"}), runners)
    assert engine.logprobs_mode == "processed_logprobs"
    assert all(
        r.sampler.logprobs_mode == r.sampler.topk_topp_sampler.logprobs_mode == "processed_logprobs" for r in runners
    )
    assert "raw_logprobs -> processed_logprobs" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_raw_log_probs_are_refused_where_they_are_pi_old(engine_for):
    from gspo_ascend.errors import ConfigError

    cfg = _cfg(**{"rollout.temperature": 0.7, "rollout.top_k": 20, "algorithm.old_logprobs": "engine"})
    with pytest.raises(ConfigError) as err:
        engine_for(cfg, [_runner(native=False)])
    message = str(err.value)
    assert "\n" not in message and "algorithm.old_logprobs" in message and "recompute" in message
    assert "rollout.temperature, rollout.top_k" in message and "raw_logprobs" in message


def test_raw_log_probs_warn_once_when_recomputed(engine_for, caplog, monkeypatch):
    from gspo_ascend.engines.base import SamplingParams

    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(SamplingParams=dict))  # generate() builds requests
    with caplog.at_level(logging.WARNING, logger="gspo_ascend.engines.vllm_rollout"):
        engine, fake = engine_for(_cfg(**{"rollout.top_p": 0.9}), [_runner(native=False)])
        engine.llm.generate = lambda *a, **k: []  # the warning is the point here, not the samples
        engine._to_batch = lambda *a: None
        engine.generate([[1, 2]], SamplingParams(n=1, temperature=0.5, top_p=0.9, max_new_tokens=4, seed=0))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "rollout.top_p" in warnings[0] and "rollout/logprob_gap" in warnings[0]
    assert engine.logprobs_mode == "raw_logprobs" and not fake.closed


def test_raw_log_probs_are_silent_where_they_equal_processed(engine_for, caplog):
    """T = 1 (or greedy) without truncation: log_softmax(logits) is the processed value, nothing to say."""
    with caplog.at_level(logging.WARNING, logger="gspo_ascend.engines.vllm_rollout"):
        engine, _ = engine_for(_cfg(**{"algorithm.old_logprobs": "engine"}), [_runner(native=False)])
    assert engine.logprobs_mode == "raw_logprobs" and not caplog.records


def test_moe_loader_gate_refuses_an_unknown_layout():
    import torch
    from gspo_ascend.patches.vllm_ascend import reattach_moe_weight_loaders

    class Layer(torch.nn.Module):  # stands in for a FusedMoE layer after vllm-ascend's post-processing
        def __init__(self, transpose):
            super().__init__()
            self.quant_method = SimpleNamespace(transpose=transpose)
            self.hidden_size, self.intermediate_size_per_partition = 8, 3
            self.w13_weight = torch.nn.Parameter(torch.zeros(2, 8, 6), requires_grad=False)
            self.w2_weight = torch.nn.Parameter(torch.zeros(2, 3, 8), requires_grad=False)

        def weight_loader(self, param, loaded, name, shard_id, expert_id, return_success=False):
            return True

    with pytest.raises(RuntimeError, match="layout is unknown"):
        reattach_moe_weight_loaders(Layer(transpose=True))  # says checkpoint layout, shapes say transposed
    with pytest.raises(RuntimeError, match="layout is unknown"):
        reattach_moe_weight_loaders(Layer(transpose=None))  # not vllm-ascend's method: no flag to read
    assert reattach_moe_weight_loaders(torch.nn.Linear(2, 2)).status == "skipped"


# ----------------------------------------------------------------------------------------------- item 5


def test_process_start_env():
    from gspo_ascend.device import CPU, CUDA, NPU, NPU_SHIM
    from gspo_ascend.engines.vllm_rollout import process_start_env

    assert process_start_env(_cfg(), NPU) == {"TASK_QUEUE_ENABLE": "2"}  # eager by default on NPU
    assert process_start_env(_cfg(**{"rollout.enforce_eager": "false"}), NPU_SHIM) == {"TASK_QUEUE_ENABLE": "1"}
    assert process_start_env(_cfg(**{"rollout.engine": "hf"}), NPU) == {}
    assert process_start_env(_cfg(), CUDA) == {} and process_start_env(_cfg(), CPU) == {}


class _Ref:
    """A stand-in ObjectRef: distinct and hashable per call, holding its value."""

    def __init__(self, value):
        self.value = value


def _fake_ray(captured: list[dict]) -> dict[str, types.ModuleType]:
    """Stand-ins for the Ray calls ``WorkerGroup.__init__`` makes; ``options(...)`` keyword arguments are kept."""
    # each remote() call returns a distinct reference holding its value, as Ray's ObjectRefs do
    handle = SimpleNamespace(
        address=SimpleNamespace(remote=lambda: _Ref(("127.0.0.1", 1))),
        node=SimpleNamespace(remote=lambda: _Ref(("0" * 56, "127.0.0.1"))),
        setup=SimpleNamespace(remote=lambda *a: _Ref(None)),
    )
    actor = SimpleNamespace(options=lambda **kw: captured.append(kw) or SimpleNamespace(remote=lambda *a: handle))
    ray = types.ModuleType("ray")
    ray.is_initialized = lambda: True
    ray.cluster_resources = lambda: {"CPU": 2.0, "NPU": 2.0}
    ray.wait = lambda refs, timeout, num_returns=1: (refs, [])
    ray.get = lambda ref: [r.value for r in ref] if isinstance(ref, list) else getattr(ref, "value", ref)
    ray.remote = lambda cls: actor
    # no node known: rank = bundle
    return ray_modules(ray, bundle_nodes={}, strategy=lambda *a, **k: None)


def _start_actor_process(env_vars: dict[str, str], tmp_path) -> str:
    """Run ``PolicyWorker.setup`` (engine builders stubbed out) in a fresh interpreter whose environment is the
    driver's plus ``env_vars``, as Ray starts an actor process with its ``runtime_env``; prints the value of
    ``TASK_QUEUE_ENABLE`` at the moment the npu backend installs torch_npu (the CPU shim's)."""
    script = f"""
import os
import gspo_ascend.engines as engines
from gspo_ascend.config import to_dict, load_config
from gspo_ascend.device import shim
from gspo_ascend.workers import PolicyWorker

seen = []
original = shim.install
shim.install = lambda *a, **k: seen.append(os.environ.get("TASK_QUEUE_ENABLE")) or original(*a, **k)
engines.build_train_engine = engines.build_rollout_engine = lambda *a: None
cfg = load_config(overrides=["rollout.engine=vllm", "trainer.device=npu"])
worker = PolicyWorker(to_dict(cfg), "{tmp_path}", 0, 1, 1)
worker.setup("127.0.0.1", {_port()})
worker.shutdown()
print("TASK_QUEUE_ENABLE at torch_npu start:", seen)
"""
    env = {k: v for k, v in os.environ.items() if k != "TASK_QUEUE_ENABLE"}
    env.update(env_vars, GSPO_DEVICE_SHIM="1")
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_actors_start_with_task_queue_enable(monkeypatch, tmp_path):
    from gspo_ascend.device import NPU_SHIM
    from gspo_ascend.workers import WorkerGroup

    captured: list[dict] = []
    for name, module in _fake_ray(captured).items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delenv("TASK_QUEUE_ENABLE", raising=False)
    WorkerGroup(_cfg(**{"trainer.devices_per_node": 2}), NPU_SHIM, str(tmp_path))
    assert [kw["runtime_env"] for kw in captured] == [{"env_vars": {"TASK_QUEUE_ENABLE": "2"}}] * 2
    out = _start_actor_process(captured[0]["runtime_env"]["env_vars"], tmp_path)
    assert "TASK_QUEUE_ENABLE at torch_npu start: ['2']" in out
    monkeypatch.setenv("TASK_QUEUE_ENABLE", "1")  # exported on the driver: the user's value goes to the actors
    captured.clear()
    WorkerGroup(_cfg(), NPU_SHIM, str(tmp_path))
    assert captured[0]["runtime_env"] == {"env_vars": {"TASK_QUEUE_ENABLE": "1"}}


def test_late_task_queue_enable_is_reported(monkeypatch, caplog):
    """Rollout TP runs vLLM in-process: a TASK_QUEUE_ENABLE first set when the engine is built comes too late."""
    from gspo_ascend.engines.vllm_rollout import _warn_late_process_env

    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    with caplog.at_level(logging.WARNING, logger="gspo_ascend.engines.vllm_rollout"):
        _warn_late_process_env({"TASK_QUEUE_ENABLE": "2"}, {"TASK_QUEUE_ENABLE": "2"})
        _warn_late_process_env({}, {"TASK_QUEUE_ENABLE": "2"})  # the process started with it: nothing to say
    assert len(caplog.records) == 1 and "TASK_QUEUE_ENABLE=2 set after torch_npu started" in caplog.text


def test_raw_and_processed_differ_only_where_sampling_transforms_the_logits():
    from gspo_ascend.engines.vllm_rollout import _raw_differs

    assert _raw_differs(1.0, 1.0, -1) == []
    assert _raw_differs(0.7, 1.0, -1) == ["rollout.temperature"]
    assert _raw_differs(1.0, 0.9, 5) == ["rollout.top_p", "rollout.top_k"]
    # greedy: vLLM 0.11 scores an all-greedy batch on the raw logits, truncation or not (v1/sample/sampler.py)
    assert _raw_differs(0.0, 0.9, 5) == []
