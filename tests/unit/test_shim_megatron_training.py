"""The CPU shim's stand-in for Megatron-LM's megatron.training (gspo_ascend/device/shim/megatron_training.py):
what MindSpeed 26.1.0 imports and patches there, and nothing left behind after uninstall."""

from __future__ import annotations

import sys

import pytest

from gspo_ascend.device.shim import megatron_training


def test_get_args_behaves_as_megatron_lm_before_initialisation():
    modules = megatron_training.build()
    get_args = modules["megatron.training"].get_args
    # MindSpeed's args_utils.get_full_args falls back to its own arguments on exactly this message
    with pytest.raises(AssertionError, match=r"^args is not initialized\.$"):
        get_args()
    modules["megatron.training.global_vars"]._GLOBAL_ARGS = marker = object()
    assert get_args() is marker and modules["megatron.training.global_vars"].get_args() is marker


def test_get_timers_behaves_as_megatron_lm_before_initialisation():
    """MindSpeed core_r0.16.0 imports it (fb_overlap/vpp_schedules.py:8); Megatron-LM's asserts the same way."""
    modules = megatron_training.build()
    with pytest.raises(AssertionError, match=r"^timers is not initialized\.$"):
        modules["megatron.training"].get_timers()
    modules["megatron.training.global_vars"]._GLOBAL_TIMERS = marker = object()
    assert modules["megatron.training.global_vars"].get_timers() is marker


@pytest.mark.parametrize(
    ("module", "function"),
    [
        ("megatron.training.arguments", "parse_args"),
        ("megatron.training.arguments", "validate_args"),
        ("megatron.training.yaml_arguments", "validate_yaml"),
        ("megatron.training.initialize", "_compile_dependencies"),
        ("megatron.training.dist_signal_handler", "get_device"),
        ("megatron.training.utils", "get_device_arch_version"),
    ],
)
def test_patch_targets_exist_and_say_they_are_not_emulated(module, function):
    modules = megatron_training.build()
    with pytest.raises(NotImplementedError, match=f"{module}.{function} of Megatron-LM is not emulated"):
        getattr(modules[module], function)()
    assert getattr(modules["megatron.training"], module.rsplit(".", 1)[-1]) is modules[module]


def test_install_only_when_needed_and_uninstall_restores(monkeypatch):
    pytest.importorskip("megatron.core")
    saved: dict = {}
    monkeypatch.setattr(megatron_training, "needed", lambda: False)
    megatron_training.install(saved)
    assert saved == {} and not getattr(sys.modules.get("megatron.training"), "_gspo_shim", False)
    monkeypatch.setattr(megatron_training, "needed", lambda: True)
    before = {name: sys.modules.get(name) for name in megatron_training.MODULES}
    megatron_training.install(saved)
    try:
        from megatron.training import get_args  # what MindSpeed 26.1.0's fp8 tensor module does

        assert sys.modules["megatron.training"]._gspo_shim and callable(get_args)
    finally:
        megatron_training.uninstall(saved)
    assert {name: sys.modules.get(name) for name in megatron_training.MODULES} == before and saved == {}
    assert not hasattr(sys.modules["megatron"], "training") or not getattr(
        sys.modules["megatron"].training, "_gspo_shim", False
    )
