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
