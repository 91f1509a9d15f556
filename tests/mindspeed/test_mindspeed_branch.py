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
    # doctor names a 0.12.1 branch by its release (26.1.0, 2.2.0) and core_r0.16.0, which has none, by the version
    # its setup.py declares (what pip shows)
    assert branch == {"core_r0.16.0": "0.16.0"}.get(wanted, wanted), evidence


def test_megatron_training_stand_in_only_where_mindspeed_needs_it():
    """MindSpeed imports megatron.training (Megatron-LM's, absent from PyPI's megatron-core) on our path in two
    branches: 26.1.0's always-applied TE-basic feature imports its fp8 tensor module, which imports it; core_r0.16.0's
    grouped-GEMM experts import the fb-overlap weight-grad store, which imports it. The shim stands in there only."""
    import importlib.util
    from pathlib import Path

    from gspo_ascend.device.shim import megatron_training

    root = Path(importlib.util.find_spec("mindspeed").submodule_search_locations[0])

    def text(relpath: str) -> str:
        path = root / relpath
        return path.read_text() if path.is_file() else ""

    fp8_tensor = text("te/pytorch/fp8/tensor/float8_tensor.py")  # 2.2.0 has no such module
    te_basic = text("features_manager/megatron_basic/transformer_engine_basic.py")
    te_path = "from megatron.training import get_args" in fp8_tensor and "te.pytorch.module.checkpoint" in te_basic
    gmm_util = text("core/transformer/moe/grouped_matmul_util.py")
    grad_store = text("core/transformer/moe/moe_feature/fb_overlap/modules/weight_grad_store.py")
    moe_path = "fb_overlap.modules.weight_grad_store" in gmm_util and "from megatron.training import" in grad_store
    assert megatron_training.needed() == (te_path or moe_path)
    from gspo_ascend.doctor.packages import mindspeed_branch

    assert megatron_training.needed() == (mindspeed_branch(root)[0] in ("26.1.0", "0.16.0"))
