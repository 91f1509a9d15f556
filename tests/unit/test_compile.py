"""gspo_ascend.compile: eager on NPU, eager fallback when dynamo/inductor fails, vLLM enforce_eager policy."""

from __future__ import annotations

import logging

import pytest
import torch

from gspo_ascend import compile as gcompile
from gspo_ascend.compile import EagerFallback, maybe_compile, resolve_enforce_eager
from gspo_ascend.device import CPU, CUDA, NPU, NPU_SHIM
from gspo_ascend.errors import ConfigError


def ours(caplog) -> list[str]:
    """Messages logged by gspo_ascend.compile (dynamo logs its own records too)."""
    return [r.getMessage() for r in caplog.records if r.name == "gspo_ascend.compile"]


def square_sum(x: torch.Tensor) -> torch.Tensor:
    return (x * x).sum()


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(gcompile, "_warned", set())


@pytest.fixture
def compile_calls(monkeypatch):
    """Record torch.compile calls; the fake returns a compiled function that fails like inductor does."""
    calls = []

    def fake_compile(fn, **kwargs):
        calls.append(kwargs)

        def compiled(*args, **kw):
            raise RuntimeError("backend='inductor' raised:\nraise e.remove_dynamo_frames() from None")

        return compiled

    monkeypatch.setattr(torch, "compile", fake_compile)
    return calls


@pytest.mark.parametrize("backend", [NPU, NPU_SHIM])
@pytest.mark.parametrize("setting", ["auto", "on", "off"])
def test_npu_never_attempts_compilation(compile_calls, backend, setting):
    wrapped = maybe_compile(square_sum, backend, setting)
    assert wrapped is square_sum
    assert wrapped(torch.ones(3)).item() == 3.0
    assert compile_calls == []


def test_npu_warns_once_when_compile_is_forced_on(compile_calls, caplog):
    with caplog.at_level(logging.WARNING, logger="gspo_ascend.compile"):
        maybe_compile(square_sum, NPU, "on")
        maybe_compile(square_sum, NPU, "on")
    assert ours(caplog) == [
        "trainer.compile=on is ignored on npu: graph mode does not work for RL there; running eagerly"
    ]


@pytest.mark.parametrize(("backend", "setting"), [(CPU, "auto"), (CPU, "off"), (CUDA, "auto"), (CUDA, "off")])
def test_compile_off_returns_the_function_itself(compile_calls, backend, setting):
    assert maybe_compile(square_sum, backend, setting) is square_sum
    assert compile_calls == []


def test_compiler_failure_falls_back_to_eager_with_one_warning(compile_calls, caplog):
    wrapped = maybe_compile(square_sum, CPU, "on", compile_kwargs={"dynamic": True})
    assert isinstance(wrapped, EagerFallback) and wrapped.__name__ == "square_sum"
    with caplog.at_level(logging.WARNING, logger="gspo_ascend.compile"):
        results = [wrapped(torch.full((2,), float(i))).item() for i in range(3)]
    assert results == [0.0, 2.0, 8.0]
    assert compile_calls == [{"dynamic": True}]  # compiled once; the eager decision is cached
    assert wrapped.eager
    (message,) = ours(caplog)
    assert "\n" not in message
    assert "failed for square_sum (RuntimeError: raise e.remove_dynamo_frames() from None)" in message


def test_real_dynamo_backend_failure_falls_back(caplog):
    """Through the real torch.compile: a dynamo backend that raises (as inductor does on an unsupported stack)."""

    def failing_backend(graph_module, example_inputs):
        raise RuntimeError("inductor is not usable here")

    def fn(x):
        return torch.sin(x) + 1

    wrapped = maybe_compile(fn, CPU, "on", compile_kwargs={"backend": failing_backend})
    with caplog.at_level(logging.WARNING, logger="gspo_ascend.compile"):
        torch.testing.assert_close(wrapped(torch.zeros(4)), torch.ones(4))
        torch.testing.assert_close(wrapped(torch.zeros(4)), torch.ones(4))
    (message,) = ours(caplog)
    assert wrapped.eager and "(RuntimeError: inductor is not usable here)" in message


def test_working_compilation_is_used_without_warnings(caplog):
    # dynamo's "eager" backend: real tracing, no inductor code generation (fast)
    wrapped = maybe_compile(square_sum, CPU, "on", compile_kwargs={"backend": "eager"})
    with caplog.at_level(logging.WARNING, logger="gspo_ascend.compile"):
        assert wrapped(torch.arange(3.0)).item() == 5.0
    assert not wrapped.eager and wrapped.compiled is not None and ours(caplog) == []


def test_the_functions_own_errors_propagate(compile_calls):
    def bad(x):
        raise ValueError("shape mismatch in the user's code")

    wrapped = maybe_compile(bad, CPU, "on")
    with pytest.raises(ValueError, match="shape mismatch"):
        wrapped(torch.ones(1))
    assert not wrapped.eager  # not a compiler problem: the compiled path stays selected


def test_invalid_setting_is_a_config_error():
    with pytest.raises(ConfigError, match="trainer.compile='yes'"):
        maybe_compile(square_sum, CPU, "yes")


@pytest.mark.parametrize(
    ("cfg_value", "backend", "expected"),
    [
        (None, NPU, True),
        (None, NPU_SHIM, True),
        (None, CUDA, False),
        (None, CPU, True),  # vLLM CPU: compile costs ~60 s of start, no throughput gain
        (False, NPU, False),  # explicit: ACL graph capture on vllm-ascend
        (True, CUDA, True),
    ],
)
def test_resolve_enforce_eager(cfg_value, backend, expected):
    assert resolve_enforce_eager(cfg_value, backend) is expected


def test_trainer_compile_on_parses_although_yaml_reads_on_as_true():
    from gspo_ascend.config import load_config

    assert [load_config(None, [f"trainer.compile={v}"]).trainer.compile for v in ("on", "off", "auto")] == [
        "on",
        "off",
        "auto",
    ]


def test_the_engines_policy_loss_follows_trainer_compile_and_compiled_equals_eager():
    """engines/train_common.engine_policy_loss, what both train engines call: the registry's function itself unless
    trainer.compile=on; compiled (inductor, dynamic shapes), the loss and its gradient equal eager's on two shapes."""
    from gspo_ascend.algorithms import get_policy_loss
    from gspo_ascend.config import load_config
    from gspo_ascend.engines.train_common import engine_policy_loss

    gspo = get_policy_loss("gspo")
    assert engine_policy_loss(load_config(None, []), CPU) is gspo
    assert engine_policy_loss(load_config(None, ["trainer.compile=on"]), NPU_SHIM) is gspo  # never on NPU
    wrapped = engine_policy_loss(load_config(None, ["trainer.compile=on"]), CPU)
    assert isinstance(wrapped, EagerFallback) and wrapped.fn is gspo and wrapped.compile_kwargs == {"dynamic": True}
    g = torch.Generator().manual_seed(0)
    kw = {"clip_low": 3e-4, "clip_high": 4e-4, "clip_ratio_c": None, "agg_mode": "seq-mean-token-mean"}
    for b, t in ((4, 7), (6, 11)):
        lp = (torch.randn(b, t, generator=g) * 0.1 - 1).requires_grad_()
        old, adv, mask = (
            lp.detach() + torch.randn(b, t, generator=g) * 1e-3,
            torch.randn(b, generator=g),
            torch.ones(b, t),
        )
        got, _ = wrapped(lp, old, adv, mask, **kw)
        (grad_got,) = torch.autograd.grad(got, lp)
        want, _ = gspo(lp, old, adv, mask, **kw)
        (grad_want,) = torch.autograd.grad(want, lp)
        assert not wrapped.eager  # compiled, not fallen back
        assert torch.allclose(got, want, atol=1e-7) and torch.allclose(grad_got, grad_want, atol=1e-7)
