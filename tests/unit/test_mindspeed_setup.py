"""The MindSpeed configuration checks that need no MindSpeed (the rest runs against the real MindSpeed in
tests/mindspeed/, through scripts/check_mindspeed.sh)."""

from __future__ import annotations

import pytest

from gspo_ascend.config import load_config
from gspo_ascend.device import CPU, NPU, NPU_SHIM
from gspo_ascend.engines import mindspeed_setup
from gspo_ascend.errors import ConfigError


def cfg(*overrides: str):
    return load_config(overrides=["actor.engine=megatron", *overrides])


def test_in_process_vllm_refuses_acl_graphs_under_mindspeed():
    """rollout TP > 1 runs vLLM in the training process, where MindSpeed makes torch.compile a pass-through."""
    in_process = ("rollout.engine=vllm", "rollout.tensor_parallel_size=2", "trainer.devices_per_node=2")
    with pytest.raises(ConfigError, match="rollout.enforce_eager"):
        mindspeed_setup.check_in_process_rollout(cfg(*in_process, "rollout.enforce_eager=false"))
    mindspeed_setup.check_in_process_rollout(cfg(*in_process))  # null: eager on NPU, nothing to refuse
    # TP 1: vLLM spawns its own processes, which never import MindSpeed
    mindspeed_setup.check_in_process_rollout(cfg("rollout.engine=vllm", "rollout.enforce_eager=false"))


def test_mc2_needs_tp_and_sequence_parallel():
    with pytest.raises(ConfigError, match="actor.use_mc2"):
        mindspeed_setup.check_mc2(cfg("actor.use_mc2=true", "actor.tensor_parallel_size=1"))
    mindspeed_setup.check_mc2(cfg("actor.use_mc2=true", "actor.tensor_parallel_size=2", "actor.sequence_parallel=true",
                                  "trainer.devices_per_node=2"))  # fmt: skip


def test_mindspeed_is_for_the_npu_only():
    assert mindspeed_setup.enabled(NPU)  # a real NPU: always (a missing MindSpeed is an error there)
    assert not mindspeed_setup.enabled(CPU)
    assert mindspeed_setup.enabled(NPU_SHIM) == mindspeed_setup.installed()  # CI's venv: no MindSpeed, plain path
