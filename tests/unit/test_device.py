"""Device contract: backends as data, resolution rules, one-line errors."""

from __future__ import annotations

import pytest

from gspo_ascend import device
from gspo_ascend.device import shim
from gspo_ascend.errors import DeviceError


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("GSPO_DEVICE", raising=False)
    monkeypatch.delenv("GSPO_DEVICE_SHIM", raising=False)
    yield
    shim.uninstall()


def test_backends_are_vendor_facts():
    assert (device.CPU.comm_backend, device.CPU.ray_resource) == ("gloo", None)
    assert (device.CUDA.visible_devices_env, device.CUDA.ray_resource) == ("CUDA_VISIBLE_DEVICES", "GPU")
    assert device.NPU.visible_devices_env == "ASCEND_RT_VISIBLE_DEVICES"
    assert device.NPU.ray_resource == "NPU"
    assert device.NPU.ray_noset_visible_env == "RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES"
    assert device.NPU.comm_backend == "hccl" and device.CUDA.comm_backend == "nccl"
    # emulated NPU keeps the NPU's launch facts but computes on the CPU over gloo
    assert device.NPU_SHIM.ray_resource == "NPU" and device.NPU_SHIM.torch_device_type == "cpu"
    assert device.NPU_SHIM.comm_backend == "gloo" and device.NPU_SHIM.emulated


def test_compile_policy_eager_on_npu():
    assert device.NPU.use_compile("auto") is False
    assert device.NPU_SHIM.use_compile("auto") is False
    assert device.CPU.use_compile("on") is True and device.CPU.use_compile("off") is False


def test_auto_on_cpu_box_is_cpu():
    assert device.get_backend("auto") is device.CPU


def test_env_gspo_device(monkeypatch):
    monkeypatch.setenv("GSPO_DEVICE", "cpu")
    assert device.get_backend("auto") is device.CPU
    monkeypatch.setenv("GSPO_DEVICE", "tpu")
    with pytest.raises(DeviceError, match="GSPO_DEVICE='tpu'"):
        device.get_backend("auto")


def test_unknown_device_lists_valid_names():
    with pytest.raises(DeviceError) as err:
        device.get_backend("xpu")
    assert "unknown device 'xpu'" in str(err.value) and "auto, cpu, cuda, npu" in str(err.value)


def test_npu_without_npu_or_shim_says_how_to_fix():
    with pytest.raises(DeviceError) as err:
        device.get_backend("npu")
    msg = str(err.value)
    assert "GSPO_DEVICE_SHIM=1" in msg and "CANN" in msg and "\n" not in msg


def test_cuda_without_cuda():
    with pytest.raises(DeviceError, match="trainer.device=cuda"):
        device.get_backend("cuda")


def test_npu_with_shim_env_installs_shim(monkeypatch):
    monkeypatch.setenv("GSPO_DEVICE_SHIM", "1")
    backend = device.get_backend("npu")
    assert backend is device.NPU_SHIM and shim.is_installed("npu")
    import torch

    t = torch.zeros(2, device=backend.device(0))
    assert t.device.type == "cpu"
    backend.set_device(0)
    backend.synchronize()
    backend.manual_seed(3)
    a = torch.rand(2)
    backend.manual_seed(3)
    assert torch.equal(a, torch.rand(2))
    assert backend.device_count() >= 1 and backend.is_bf16_supported()
    assert backend.memory_stats()["peak_allocated"] > 0
    assert backend.device_name() == "Ascend910B-cpushim"  # torch_npu's get_device_name, as the shim serves it
    assert device.CPU.device_name() == "cpu"


def test_auto_prefers_installed_shim():
    shim.install(npu=True)
    assert device.get_backend("auto") is device.NPU_SHIM
