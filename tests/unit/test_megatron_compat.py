"""The megatron-core release adapters (gspo_ascend/engines/megatron_compat.py) on stand-in signatures and configs,
so both branches run whichever megatron-core is installed. The fixes themselves are exercised against real
megatron-core 0.12.1 by scripts/check_pinned_stack.sh and against 0.16 by the megatron integration tests."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from gspo_ascend.engines.megatron_compat import decay_every_parameter, uses_decoupled_grads


def test_decay_every_parameter_uses_the_argument_the_release_has():
    def core_016(config, model_chunks, config_overrides=None, use_gloo_process_groups=True): ...

    def core_012(config, model_chunks, no_weight_decay_cond=None, scale_lr_cond=None, lr_mult=1.0): ...

    assert decay_every_parameter(core_016) == {"config_overrides": {}}
    kwargs = decay_every_parameter(core_012)
    assert set(kwargs) == {"no_weight_decay_cond"}
    # megatron's default would exempt exactly these two (a bias, a 1-D norm weight): ours decays them
    assert kwargs["no_weight_decay_cond"]("decoder.final_layernorm.weight", torch.ones(4)) is False
    assert kwargs["no_weight_decay_cond"]("output_layer.bias", torch.ones(4)) is False

    def neither(config, model_chunks): ...

    with pytest.raises(TypeError, match="config_overrides"):
        decay_every_parameter(neither)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"use_precision_aware_optimizer": True, "use_precision_aware_optimizer_no_fp8_or_ds_fp8": False}, False),
        ({"use_precision_aware_optimizer": False, "use_precision_aware_optimizer_no_fp8_or_ds_fp8": True}, True),
        ({"use_precision_aware_optimizer": True}, True),  # megatron-core 0.12: no derived flag
        ({"use_precision_aware_optimizer": False}, False),
    ],
)
def test_decoupled_grads_flag_follows_the_release(fields, expected):
    assert uses_decoupled_grads(SimpleNamespace(**fields)) is expected


# A fresh interpreter: the engine (and other tests) may already have patched moe_utils in this one. No CUDA
# redirection either: the router's gemm runs on plain CPU tensors, and the fix must not depend on the CPU shim
# (the first H100 run met the NameError with no shim at all).
_ROUTER_PROBE = """
import sys, torch
from megatron.core.transformer.moe import moe_utils
inp = torch.randn(5, 8, dtype=torch.float64)
weight = torch.randn(3, 8, dtype=torch.float64)
def route():
    x = inp.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    out = moe_utils.router_gating_linear(x, w, None, torch.float32)
    out.sum().backward()
    return out, x.grad, w.grad
try:
    route()
    print("before: ok")
except NameError as exc:
    print("before: NameError", exc)
from gspo_ascend.engines.megatron_compat import patch_megatron_core
print("applied:", patch_megatron_core())
out, gx, gw = route()
ref = (inp.float() @ weight.float().t())
assert out.dtype == torch.float32 and torch.allclose(out, ref, atol=1e-6), (out, ref)
# d(sum(x W^T))/dx = 1 W (rows of ones times W), d/dW = 1^T x
assert torch.allclose(gx, torch.ones(5, 3, dtype=torch.float64) @ weight, atol=1e-5)
assert torch.allclose(gw, torch.ones(3, 5, dtype=torch.float64) @ inp, atol=1e-5)
assert patch_megatron_core().count("router-gemm-without-te") == 1  # idempotent
print("after: ok")
"""


def test_moe_router_runs_without_transformer_engine():
    """megatron-core 0.16 without TE: RouterGatingLinearFunction reads ``te_general_gemm``, which moe_utils binds
    only when TE imports; patch_megatron_core binds it to None (the torch.mm path). Fails on the old main, where
    only the CPU shim bound it and the H100 proof's MoE checks died with the NameError."""
    pytest.importorskip("megatron.core")
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("Transformer Engine is installed: moe_utils binds te_general_gemm itself")
    probe = subprocess.run([sys.executable, "-c", _ROUTER_PROBE], capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, probe.stderr[-3000:]
    lines = probe.stdout.splitlines()
    assert "before: NameError name 'te_general_gemm' is not defined" in lines
    assert "applied: ['router-gemm-without-te']" in lines
    assert lines[-1] == "after: ok"
