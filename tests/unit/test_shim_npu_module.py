"""The CPU shim's torch_npu / torch.npu stand-ins: import, device API, RNG, streams, "hccl" and uninstall."""

from __future__ import annotations

import importlib.util
import sys
import time
import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gspo_ascend.device import shim


@pytest.fixture
def npu(monkeypatch):
    """Install the NPU half of the shim for one test (with a clean device environment), then uninstall it."""
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("GSPO_SHIM_NPU_COUNT", raising=False)
    assert not shim.is_installed("npu"), "another test left the shim installed"
    shim.install(npu=True)
    yield torch.npu
    shim.uninstall()


def test_import_torch_npu_after_install(npu):
    import torch_npu
    import torch_npu.npu

    assert torch_npu._gspo_shim is True and torch_npu.__version__.endswith("+cpushim")
    assert torch.npu is torch_npu.npu is sys.modules["torch.npu"] is sys.modules["torch_npu.npu"]
    assert importlib.util.find_spec("torch_npu") is not None  # what transformers' availability probe calls
    assert callable(torch_npu.npu_fusion_attention) and callable(torch_npu.npu_grouped_matmul)
    assert npu.is_available() and npu.get_device_name() == "Ascend910B-cpushim"
    assert 220 <= npu.get_device_properties().soc_version <= 225 and npu.is_bf16_supported()


@pytest.mark.parametrize(
    ("visible", "count"),
    [(None, 8), ("0,1,3", 3), ("1,0", 1), ("0,2x,5", 2), ("", 0), ("0,9", 1), ("x", 0), ("2,3,4,5,6,7", 6)],
)
def test_device_count_honours_ascend_rt_visible_devices(npu, monkeypatch, visible, count):
    if visible is not None:
        monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", visible)
    assert npu.device_count() == count


def test_device_count_default_from_env_and_set_device(npu, monkeypatch):
    monkeypatch.setenv("GSPO_SHIM_NPU_COUNT", "2")
    assert npu.device_count() == 2
    npu.set_device(1)
    assert npu.current_device() == 1
    npu.set_device("npu:0")
    assert npu.current_device() == 0
    with npu.device(1):
        assert npu.current_device() == 1
    assert npu.current_device() == 0
    with pytest.raises(RuntimeError, match="invalid NPU device"):
        npu.set_device(2)


def test_memory_functions(npu):
    free, total = npu.mem_get_info()
    assert 0 < free <= total
    assert npu.memory_allocated() == npu.max_memory_allocated() == npu.memory_reserved() == 0
    npu.reset_peak_memory_stats()
    npu.empty_cache()
    npu.synchronize()
    assert npu.memory_stats()["allocated_bytes.all.current"] == 0


def test_rng_state_round_trip_reproduces_numbers(npu):
    npu.manual_seed(1234)
    assert npu.initial_seed() == 1234
    state = npu.get_rng_state()
    first = torch.rand(5)
    npu.set_rng_state(state)
    assert torch.equal(torch.rand(5), first)
    npu.manual_seed_all(1234)
    assert torch.equal(torch.rand(5), first)


def test_streams_and_events(npu):
    start, end = npu.Event(enable_timing=True), npu.Event(enable_timing=True)
    start.record()
    time.sleep(0.01)
    end.record()
    end.synchronize()
    assert start.query() and end.query()
    assert start.elapsed_time(end) >= 5.0  # milliseconds
    with pytest.raises(RuntimeError, match="enable_timing"):
        npu.Event().elapsed_time(npu.Event())
    side = npu.Stream()
    default = npu.current_stream()
    assert default is npu.default_stream()
    with npu.stream(side):
        assert npu.current_stream() is side
        side.wait_stream(default)
        event = side.record_event()
    assert npu.current_stream() is default
    default.wait_event(event)
    side.synchronize()
    assert side.query()


def test_amp_functions(npu):
    assert torch.bfloat16 in npu.get_amp_supported_dtype()
    assert npu.is_autocast_enabled() is False
    npu.set_autocast_enabled(True)
    npu.set_autocast_dtype(torch.bfloat16)
    assert npu.is_autocast_enabled() and npu.get_autocast_dtype() == torch.bfloat16
    npu.set_autocast_enabled(False)
    npu.set_autocast_dtype(torch.float16)


def test_hccl_backend_registration_is_idempotent(npu):
    from gspo_ascend.device.shim import npu_module

    npu_module.register_hccl_backend()
    npu_module.register_hccl_backend()
    assert "hccl" in dist.Backend.backend_list and dist.Backend.HCCL == "hccl"


def _hccl_worker(rank: int, store_path: str, world_size: int) -> None:
    """Runs in a spawned process: "hccl" process groups (default and new_group) all-reduce over gloo."""
    shim.install(npu=True)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("hccl", store=store, rank=rank, world_size=world_size)
    try:
        assert dist.get_backend() == "hccl"
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        assert t.item() == sum(range(1, world_size + 1)), t
        group = dist.new_group(list(range(world_size)), backend="hccl")
        u = torch.tensor([float(10 * (rank + 1))])
        dist.all_reduce(u, group=group)
        assert u.item() == 10 * sum(range(1, world_size + 1)), u
        dist.barrier()
    finally:
        dist.destroy_process_group()
        shim.uninstall()


@pytest.mark.slow
def test_two_process_all_reduce_with_hccl_backend(tmp_path):
    mp.spawn(_hccl_worker, args=(str(tmp_path / "store"), 2), nprocs=2, join=True)


def test_uninstall_restores_absent_modules_and_attribute():
    assert not shim.is_installed("npu")
    before = {name: sys.modules.get(name) for name in ("torch_npu", "torch_npu.npu", "torch.npu")}
    had_attr = "npu" in torch.__dict__
    shim.install(npu=True)
    shim.install(npu=True)  # idempotent
    import torch_npu  # noqa: F401

    shim.uninstall()
    assert {name: sys.modules.get(name) for name in before} == before
    assert ("npu" in torch.__dict__) == had_attr
    if before["torch_npu"] is None and not had_attr:  # the CPU CI case: nothing of torch_npu existed
        assert "torch_npu" not in sys.modules and not hasattr(torch, "npu")


def test_uninstall_restores_previous_modules_and_attribute(monkeypatch):
    fake_pkg, fake_dev = types.ModuleType("torch_npu"), types.ModuleType("torch_npu.npu")
    monkeypatch.setitem(sys.modules, "torch_npu", fake_pkg)
    monkeypatch.setitem(sys.modules, "torch_npu.npu", fake_dev)
    monkeypatch.setitem(sys.modules, "torch.npu", fake_dev)
    monkeypatch.setattr(torch, "npu", fake_dev, raising=False)
    shim.install(npu=True)
    assert torch.npu is not fake_dev and sys.modules["torch_npu"] is not fake_pkg
    shim.uninstall()
    assert sys.modules["torch_npu"] is fake_pkg and sys.modules["torch_npu.npu"] is fake_dev
    assert sys.modules["torch.npu"] is fake_dev and torch.npu is fake_dev
