"""CPU-emulated device shim: run NPU-targeted code (ours) and CUDA-targeted code (megatron-core's) on a CPU.

Two independent halves, both installed explicitly and reversible:

* NPU emulation (:mod:`.npu_module`, ops in :mod:`.npu_ops`): after :func:`install`, ``import torch_npu``
  works and ``torch.npu`` exists. Tensors stay on the CPU: our device layer maps "npu" to "cpu" rather than
  renaming torch's PrivateUse1 backend, because after a rename CPU torch cannot allocate on "npu". The
  process-group backend name "hccl" is registered and runs as gloo. Fused ops are faithful CPU references
  of torch_npu's documented semantics, with autograd.
* CUDA-API redirection (:mod:`.cuda_redirect`): makes unmodified megatron-core believe it runs on CUDA while
  every tensor lives on the CPU and collectives go through gloo. Installed only in processes that ask for it
  (``install(cuda=True)``), never as an import side effect.

Unlike ``torch_npu.contrib.transfer_to_npu`` (which rewrites CUDA calls to NPU on real hardware), this shim
targets CI and laptops: its purpose is to execute the production code paths, not to be fast.
"""

from __future__ import annotations

_state = {"npu": False, "cuda": False}


def install(*, npu: bool = True, cuda: bool = False) -> None:
    """Install the requested halves of the shim (idempotent)."""
    if npu and not _state["npu"]:
        from . import npu_module

        npu_module.install_npu()
        _state["npu"] = True
    if cuda and not _state["cuda"]:
        from . import cuda_redirect

        cuda_redirect.install_cuda_redirect()
        _state["cuda"] = True


def uninstall() -> None:
    """Undo everything :func:`install` did, restoring the original torch attributes and sys.modules."""
    if _state["cuda"]:
        from . import cuda_redirect

        cuda_redirect.uninstall_cuda_redirect()
        _state["cuda"] = False
    if _state["npu"]:
        from . import npu_module

        npu_module.uninstall_npu()
        _state["npu"] = False


def is_installed(half: str = "npu") -> bool:
    """Whether the ``"npu"`` or ``"cuda"`` half is currently installed in this process."""
    return _state[half]
