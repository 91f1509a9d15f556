"""`gspo-ascend selftest` on the emulated NPU where the real MindSpeed is installed (issue #15): the training layer
runs the megatron engine at TP=2 under MindSpeed (its fused kernels on the shim's ops) against HF and the fsdp
engine, and the layers whose packages this venv lacks (vLLM, Ray) are skipped with their reason, not failed."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow


def test_selftest_trains_under_mindspeed_and_skips_what_is_not_installed(tmp_path):
    env = {
        **os.environ,
        "GSPO_DEVICE_SHIM": "1",
        "TORCH_DEVICE_BACKEND_AUTOLOAD": "0",
        "TORCH_EXTENSIONS_DIR": str(tmp_path / "torch_extensions"),  # MindSpeed creates it at import
    }
    proc = subprocess.run(
        [sys.executable, "-m", "gspo_ascend.cli", "selftest", "--device", "npu", "--json"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=1800,
    )
    print(proc.stderr)
    assert proc.returncode == 0, proc.stderr[-4000:]
    found = {r["name"]: r for r in json.loads(proc.stdout)}
    assert "under MindSpeed (fused attention, RMSNorm, RoPE, SwiGLU)" in found["training/megatron_tp2"]["detail"]
    for name in ("training/megatron_tp2", "training/fsdp_vs_megatron", "training/checkpoint", "rollout/hf"):
        assert found[name]["status"] == "pass", found[name]
    assert all(r["status"] == "pass" for n, r in found.items() if n.startswith(("ops/", "setup/", "collectives")))
    expected_skips = {
        "rollout/vllm": ("vLLM is not installed", importlib.util.find_spec("vllm") is None),
        "e2e/ray_gspo": ("Ray is not installed", importlib.util.find_spec("ray") is None),
    }
    for name, (reason, missing) in expected_skips.items():
        assert (found[name]["status"], reason in found[name]["detail"]) == (
            ("skip", True) if missing else ("pass", False)
        )
