"""The MindSpeed this venv runs is the branch scripts/check_mindspeed.sh was asked for, as doctor finds it."""

from __future__ import annotations

import os

import pytest


def test_doctor_finds_the_branch_the_script_installed():
    wanted = os.environ.get("MINDSPEED_BRANCH")
    if not wanted:
        pytest.skip("run through scripts/check_mindspeed.sh, which says which branch it installed")
    from gspo_ascend.doctor.packages import mindspeed_branch, mindspeed_package_dir

    branch, evidence = mindspeed_branch(mindspeed_package_dir())
    assert branch == wanted, evidence


def test_megatron_training_stand_in_only_where_mindspeed_needs_it():
    """MindSpeed 26.1.0's always-applied TE-basic feature imports its fp8 tensor module, which imports
    megatron.training (Megatron-LM's, absent from PyPI's megatron-core): the shim stands in for it there only."""
    import importlib.util
    from pathlib import Path

    from gspo_ascend.device.shim import megatron_training

    root = Path(importlib.util.find_spec("mindspeed").submodule_search_locations[0])
    fp8_file = root / "te/pytorch/fp8/tensor/float8_tensor.py"  # 2.2.0 has no such module
    fp8_tensor = fp8_file.read_text() if fp8_file.is_file() else ""
    te_basic = (root / "features_manager/megatron_basic/transformer_engine_basic.py").read_text()
    imports_training = "from megatron.training import get_args" in fp8_tensor
    reaches_it = "mindspeed.te.pytorch.module.checkpoint" in te_basic
    assert megatron_training.needed() == (imports_training and reaches_it)
    from gspo_ascend.doctor.packages import mindspeed_branch

    assert megatron_training.needed() == (mindspeed_branch(root)[0] == "26.1.0")
