"""The CUDA->CPU redirection (shim.install(cuda=True)): factories, device API, RNG, streams and uninstall.

tests/integration/test_megatron_cpu.py shows the same redirection carrying megatron-core training; this file
pins the individual behaviours in-process, and that uninstall leaves stock CPU torch behind.
"""

from __future__ import annotations

import pytest
import torch

from gspo_ascend.device import shim

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="redirection is for CPU-only torch builds")


@pytest.fixture
def cuda():
    assert not shim.is_installed("cuda"), "another test left the CUDA redirection installed"
    shim.install(npu=False, cuda=True)
    yield torch.cuda
    shim.uninstall()


def test_cuda_device_arguments_allocate_on_cpu(cuda):
    assert torch.empty(3, device="cuda").device.type == "cpu"
    assert torch.zeros(2, device=torch.device("cuda", 0)).device.type == "cpu"
    assert torch.ones(2, device=cuda.current_device()).device.type == "cpu"  # megatron's usual spelling
    assert torch.arange(4, device="cuda:0").tolist() == [0, 1, 2, 3]
    t = torch.tensor([1.0, 2.0], device="cuda")
    assert t.new_empty(3, device="cuda").device.type == "cpu"
    assert t.to("cuda").device.type == "cpu" and t.to(device=0, dtype=torch.float64).dtype == torch.float64
    assert t.cuda() is t
    layer = torch.nn.Linear(2, 2).cuda()
    assert layer.weight.device.type == "cpu"
    # megatron's optimizer sorts parameters by these names; a cast to a CUDA type name is a CPU cast.
    assert t.type() == "torch.cuda.FloatTensor"
    assert t.type("torch.cuda.DoubleTensor").dtype == torch.float64


def test_npu_device_strings_are_redirected_only_when_asked(cuda):
    """MindSpeed allocates with device="npu" by name; the MindSpeed support turns that mapping on, and off again."""
    from gspo_ascend.device.shim import cuda_redirect

    with pytest.raises(RuntimeError):
        torch.zeros(2, device="npu:0")
    cuda_redirect.redirect_device_name("npu")
    try:
        assert torch.zeros(2, device="npu:0").device.type == "cpu"
        assert torch.ones(3).to("npu").device.type == "cpu"
    finally:
        cuda_redirect.redirect_device_name("npu", on=False)
    with pytest.raises(RuntimeError):
        torch.zeros(2, device="npu")
    cuda_redirect.redirect_device_name("cuda", on=False)  # "cuda" cannot be switched off
    assert torch.zeros(1, device="cuda").device.type == "cpu"


def test_device_api_and_streams(cuda):
    assert cuda.current_device() == 0 and cuda.is_initialized()
    cuda.synchronize()
    stream = cuda.Stream()
    assert cuda.current_stream() != stream  # megatron's MoE dispatcher compares the two
    with cuda.stream(stream):
        stream.wait_stream(cuda.current_stream())
        event = stream.record_event()
    event.synchronize()
    assert event.query()
    start, end = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
    start.record()
    end.record()
    assert start.elapsed_time(end) >= 0.0


def test_rng_state_save_and_restore_reproduces_random_numbers(cuda):
    cuda.manual_seed(123)
    state = cuda.get_rng_state()
    first = torch.randn(5, device="cuda")
    torch.randn(7, device="cuda")  # advance the generator
    cuda.set_rng_state(state)
    assert torch.equal(torch.randn(5, device="cuda"), first)
    # megatron's _set_cuda_rng_state goes through default_generators[current_device()] instead.
    cuda.random.set_rng_state(state)
    cuda.default_generators[cuda.current_device()].set_state(state)
    assert torch.equal(torch.randn(5, device="cuda"), first)


def _plus_zeros(x: torch.Tensor) -> torch.Tensor:
    return x + torch.zeros(3)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_torchscript_still_compiles_factories(cuda):
    # The wrapped factories are registered as aliases of their aten ops (TorchScript looks functions up).
    assert torch.jit.script(_plus_zeros)(torch.ones(3)).tolist() == [1.0, 1.0, 1.0]


def test_uninstall_restores_originals():
    originals = {
        name: getattr(torch.cuda, name) for name in ("current_device", "get_rng_state", "Stream", "is_initialized")
    }
    tensor_methods = {name: torch.Tensor.__dict__.get(name) for name in ("to", "cuda", "type")}
    factories = {name: getattr(torch, name) for name in ("empty", "zeros", "tensor")}
    all_to_all = torch.distributed.all_to_all_single

    shim.install(npu=False, cuda=True)
    assert torch.cuda.current_device is not originals["current_device"] and torch.empty is not factories["empty"]
    shim.uninstall()

    assert all(getattr(torch.cuda, name) is fn for name, fn in originals.items())
    assert all(torch.Tensor.__dict__.get(name) is fn for name, fn in tensor_methods.items())
    assert all(getattr(torch, name) is fn for name, fn in factories.items())
    assert torch.distributed.all_to_all_single is all_to_all
    assert not torch.cuda.is_initialized()
    with pytest.raises((AssertionError, RuntimeError)):  # stock CPU torch: "Torch not compiled with CUDA"
        torch.empty(3, device="cuda")


def test_device_context_still_works_after_install_in_a_fresh_interpreter():
    """torch caches the factory set of `with torch.device(...)` on first use; if the redirection is installed
    first, the context must still place factories (HF models are built under `torch.device("meta")`)."""
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from gspo_ascend.device import shim\n"
        "shim.install(npu=False, cuda=True)\n"
        "with torch.device('meta'):\n"
        "    print(torch.ones(3).device, torch.arange(4).device)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["meta", "meta"]
