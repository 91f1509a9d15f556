"""CPU-emulated device shim: run NPU-targeted code (ours) and CUDA-targeted code (megatron-core's) on a CPU.

Independent parts, each installed explicitly and reversible:

* NPU emulation (:mod:`.npu_module`, ops in :mod:`.npu_ops`): after :func:`install`, ``import torch_npu``
  works and ``torch.npu`` exists. Tensors stay on the CPU: our device layer maps "npu" to "cpu" rather than
  renaming torch's PrivateUse1 backend, because after a rename CPU torch cannot allocate on "npu". The
  process-group backend name "hccl" is registered and runs as gloo. Fused ops are faithful CPU references
  of torch_npu's documented semantics, with autograd.
* CUDA-API redirection (:mod:`.cuda_redirect`): makes unmodified megatron-core believe it runs on CUDA while
  every tensor lives on the CPU and collectives go through gloo. Installed only in processes that ask for it
  (``install(cuda=True)``), never as an import side effect.
* MindSpeed support (:mod:`.mindspeed_support`, ``install(mindspeed=True)``, implies the NPU half): the further
  torch_npu and torchair pieces the real MindSpeed imports. Its ``torch_npu.contrib.transfer_to_npu``
  installs the CUDA redirection when imported, as the real module redirects CUDA to the NPU.

Unlike ``torch_npu.contrib.transfer_to_npu`` (which rewrites CUDA calls to NPU on real hardware), this shim
targets CI and laptops: its purpose is to execute the production code paths, not to be fast.
"""

from __future__ import annotations

_state = {"npu": False, "cuda": False, "mindspeed": False}


def install(*, npu: bool = True, cuda: bool = False, mindspeed: bool = False, mc2: bool = False) -> None:
    """Install the requested parts of the shim (idempotent); ``mindspeed=True`` needs and installs the NPU half;
    ``mc2=True`` (with ``mindspeed``) adds the HCCL communicator names of MindSpeed's MC2 linears, renaming torch's
    PrivateUse1 backend "npu" for the rest of the process (see ``mindspeed_support.install_mc2_support``)."""
    if (npu or mindspeed) and not _state["npu"]:
        from . import npu_module

        npu_module.install_npu()
        _state["npu"] = True
    if cuda and not _state["cuda"]:
        from . import cuda_redirect

        cuda_redirect.install_cuda_redirect()
        _state["cuda"] = True
    if mindspeed and not _state["mindspeed"]:
        from . import mindspeed_support

        mindspeed_support.install_mindspeed_support(lambda: install(npu=False, cuda=True))
        _state["mindspeed"] = True
    if mc2:
        from . import mindspeed_support

        mindspeed_support.install_mc2_support()  # idempotent


def uninstall() -> None:
    """Undo everything :func:`install` did, restoring the original torch attributes and sys.modules."""
    if _state["mindspeed"]:
        from . import mindspeed_support

        mindspeed_support.uninstall_mindspeed_support()
        _state["mindspeed"] = False
    if _state["cuda"]:
        from . import cuda_redirect

        cuda_redirect.uninstall_cuda_redirect()
        _state["cuda"] = False
    if _state["npu"]:
        from . import npu_module

        npu_module.uninstall_npu()
        _state["npu"] = False


def is_installed(half: str = "npu") -> bool:
    """Whether the ``"npu"``, ``"cuda"`` or ``"mindspeed"`` part is currently installed in this process."""
    return _state[half]
