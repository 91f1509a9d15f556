"""The MindSpeed configuration checks that need no MindSpeed (the rest runs against the real MindSpeed in
tests/mindspeed/, through scripts/check_mindspeed.sh)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from gspo_ascend.config import load_config
from gspo_ascend.device import CPU, NPU, NPU_SHIM
from gspo_ascend.engines import mindspeed_setup
from gspo_ascend.errors import ConfigError


def cfg(*overrides: str):
    return load_config(overrides=["actor.engine=megatron", *overrides])


def test_patches_lifted_is_a_no_op_without_mindspeed_in_the_process():
    """The vLLM rollout enters it around every vLLM call, on every set-up: without MindSpeed imported it lifts
    nothing and leaves torch untouched (the real lift: tests/mindspeed/test_mindspeed_engine.py)."""
    view = torch.Tensor.view
    with mindspeed_setup.patches_lifted() as lifted:
        assert lifted == [] and torch.Tensor.view is view


def test_vllm_rollout_calls_vllm_only_with_the_patches_lifted(monkeypatch):
    """Each engine method that calls into vLLM does so inside ``vllm_rollout._lifted``; the weight stream (the
    train engine's code, megatron's gathers under MindSpeed) is pulled outside it. A stand-in for ``vllm.LLM``
    records, for each call, whether the lift was active (a recording stand-in: what it checks is our wiring, not
    vLLM)."""
    from gspo_ascend.engines import vllm_rollout

    state = {"lifted": False}
    calls: list[tuple[str, bool]] = []

    @contextlib.contextmanager
    def lifted():
        assert not state["lifted"]
        state["lifted"] = True
        try:
            yield []
        finally:
            state["lifted"] = False

    class RecordingLLM:
        def __getattr__(self, name):
            return lambda *args, **kwargs: calls.append((name, state["lifted"])) or [[]]

    def stream():
        calls.append(("stream", state["lifted"]))
        yield "w", torch.zeros(2)

    monkeypatch.setattr(vllm_rollout, "_lifted", lifted)
    engine = object.__new__(vllm_rollout.VLLMRolloutEngine)
    engine.llm, engine.dtype, engine._asleep, engine.sleep_supported = RecordingLLM(), torch.float32, [], True
    engine.external_launcher = False  # vLLM's own engine process (TP 1): the weights go as bytes
    engine.update_weights(stream())
    engine.sleep()
    engine.update_weights(stream())  # asleep: wakes the weights first
    engine.wake_up()
    engine.close()
    assert ("stream", False) in calls
    assert {name for name, active in calls if not active} == {"stream"}
    assert [name for name, _ in calls if name != "stream"] == [
        "collective_rpc", "collective_rpc", "collective_rpc", "reset_prefix_cache", "sleep", "wake_up",
        "collective_rpc", "collective_rpc", "collective_rpc", "reset_prefix_cache", "wake_up", "reset_prefix_cache",
    ]  # fmt: skip


def test_mc2_needs_tp_and_sequence_parallel():
    with pytest.raises(ConfigError, match="actor.use_mc2"):
        mindspeed_setup.check_mc2(cfg("actor.use_mc2=true", "actor.tensor_parallel_size=1"))
    legal = ("actor.use_mc2=true", "actor.tensor_parallel_size=2", "actor.sequence_parallel=true",
             "trainer.devices_per_node=2")  # fmt: skip
    with pytest.raises(ConfigError, match="model.dtype bfloat16"):  # torch_npu's MC2 kernels take no fp32
        mindspeed_setup.check_mc2(cfg(*legal))
    mindspeed_setup.check_mc2(cfg(*legal, "model.dtype=bfloat16"))


def test_mindspeed_is_for_the_npu_only():
    assert mindspeed_setup.enabled(NPU)  # a real NPU: always (a missing MindSpeed is an error there)
    assert not mindspeed_setup.enabled(CPU)
    assert mindspeed_setup.enabled(NPU_SHIM) == mindspeed_setup.installed()  # CI's venv: no MindSpeed, plain path


def test_flash_attn_checks_run_with_mindspeeds_dummy_hidden_and_put_back(monkeypatch):
    """MindSpeed core_r0.16.0 puts an empty ``flash_attn`` (a spec without loader) into sys.modules; transformers
    5.5.4's check then raises KeyError (the real case: tests/mindspeed/, every engine case). The checks must run
    with the dummy out of sys.modules and find it back afterwards; a real package (a loader) is never touched."""
    import importlib.machinery
    import sys
    import types

    from transformers.utils import import_utils

    dummy = types.ModuleType("flash_attn")
    dummy.__spec__ = importlib.machinery.ModuleSpec("flash_attn", loader=None)
    real = types.ModuleType("flash_attn_interface")
    real.__spec__ = importlib.machinery.ModuleSpec("flash_attn_interface", loader=importlib.machinery.BuiltinImporter)
    monkeypatch.setitem(sys.modules, "flash_attn", dummy)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", real)
    seen = []
    for name in ("is_flash_attn_2_available", "is_flash_attn_3_available", "is_flash_attn_4_available"):
        monkeypatch.setattr(
            import_utils, name, lambda n=name: seen.append((n, "flash_attn" in sys.modules, "flash_attn_interface"
                                                            in sys.modules)),
        )  # fmt: skip
    mindspeed_setup._settle_flash_attn_checks()
    assert [s[0] for s in seen] == ["is_flash_attn_2_available", "is_flash_attn_3_available",
                                    "is_flash_attn_4_available"]  # fmt: skip
    assert all(not dummy_seen and real_seen for _, dummy_seen, real_seen in seen)
    assert sys.modules["flash_attn"] is dummy and sys.modules["flash_attn_interface"] is real


def test_mc2_linears_take_megatrons_tp_group_and_refuse_another(monkeypatch):
    """MindSpeed core_r0.16.0's MC2 linears take no ``tp_group``, which megatron-core 0.16 passes every column / row
    parallel linear (the real pair: tests/mindspeed/test_mindspeed_engine.py). The wrapper takes it, checks it is
    megatron's TP group (the one MindSpeed's linear runs on) and keeps it as the linear's ``tp_group``; another
    group is refused, naming the key."""
    import types

    from megatron.core import parallel_state

    tp, other = object(), object()
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_group", lambda: tp)

    class MindSpeedMC2RowParallelLinear:  # stands for MindSpeed's: an __init__ without tp_group
        def __init__(self, input_size, output_size, *, config):
            self.built = (input_size, output_size, config)

    wrapped = mindspeed_setup.mc2_tp_group_wrapper(MindSpeedMC2RowParallelLinear)
    assert wrapped.__name__ == "MindSpeedMC2RowParallelLinear" and issubclass(wrapped, MindSpeedMC2RowParallelLinear)
    for given in (tp, None):
        linear = wrapped(4, 8, config="c", tp_group=given)
        assert linear.built == (4, 8, "c") and linear.tp_group is tp
    with pytest.raises(RuntimeError, match=r"another tp_group \(an expert linear.s.*set actor.use_mc2: false"):
        wrapped(4, 8, config="c", tp_group=other)

    def patch(orig_init, impl_init):  # a MindSpeed Patch: megatron's class, MindSpeed's adaptor over its *Impl
        impl = type("MC2RowParallelLinearImpl", (), {"__init__": impl_init})
        adaptor = type("MindSpeedMC2RowParallelLinear", (impl,), {"__init__": lambda self, *a, **kw: None})
        return types.SimpleNamespace(orig_func=type("RowParallelLinear", (), {"__init__": orig_init}),
                                     patch_func=adaptor, wrappers=[])  # fmt: skip

    def manager(found):
        seen = []
        return seen, types.SimpleNamespace(
            patches_info={mindspeed_setup.MC2_LINEARS[1]: found},
            register_patch=lambda target, fn: seen.append((target, fn)),
            apply_patches=lambda: seen.append("applied"),
        )

    megatron_0_16 = lambda self, a, *, tp_group=None: None  # noqa: E731
    megatron_0_12 = lambda self, a: None  # noqa: E731
    mindspeed = lambda self, a, *, parallel_group=None: None  # noqa: E731
    seen, m = manager(patch(megatron_0_16, mindspeed))
    mindspeed_setup._fix_mc2_tp_group(m)
    assert seen == [(mindspeed_setup.MC2_LINEARS[1], mindspeed_setup.mc2_tp_group_wrapper), "applied"]
    for orig, impl in ((megatron_0_12, mindspeed), (megatron_0_16, megatron_0_16)):  # 26.1.0; a fixed MindSpeed
        seen, m = manager(patch(orig, impl))
        mindspeed_setup._fix_mc2_tp_group(m)
        assert seen == []
