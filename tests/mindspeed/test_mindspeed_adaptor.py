"""The real ``mindspeed.megatron_adaptor`` imports and patches megatron-core 0.12.1 under the shim's stand-ins."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import REPO


def test_real_adaptor_imports_and_patches_megatron(worker):
    result = worker("adaptor")["adaptor"]
    assert result["megatron_imported"]
    assert result["cuda_redirect"]  # importing the transfer_to_npu stand-in installed the CUDA redirection
    assert result["config_init_wrapped"]  # MindSpeed's level-0 features wrap TransformerConfig.__init__
    assert result["compile_patched"].startswith("mindspeed.")  # ... and replace torch.compile


def test_plain_npu_shim_is_not_enough():
    """Without the MindSpeed support the adaptor fails at its first torch_npu import (why the stand-ins exist)."""
    code = (
        "import sys; sys.argv = sys.argv[:1]\n"
        "from gspo_ascend.device import shim; shim.install(npu=True)\n"
        "import mindspeed.megatron_adaptor\n"
    )
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert proc.returncode != 0
    assert "No module named 'torch_npu.contrib'" in proc.stderr


def test_uninstall_removes_every_stand_in(worker):
    result = worker("uninstall")["uninstall"]
    assert result["installed"] == {"torchair": True, "cuda": True, "npu_method": True}
    assert result["left_in_sys_modules"] == []
    assert not result["npu_method"] and result["mapping_restored"] and not result["cuda"]
