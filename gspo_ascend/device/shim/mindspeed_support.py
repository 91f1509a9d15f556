"""Stand-ins for the torch_npu and torchair pieces MindSpeed imports, so the real MindSpeed runs on a CPU.

MindSpeed (branch core_r0.16.0, pinned, against torch_npu 2.10.0.post4; the previous line's 26.1.0_core_r0.12.1 and
2.2.0_core_r0.12.1 against torch_npu 2.7.1) is written for a real torch_npu with CANN (and, core_r0.16.0 and 26.1.0,
Megatron-LM's megatron.training: megatron_training.py). Importing
``mindspeed.megatron_adaptor`` and letting it patch megatron-core touches more of torch_npu than our training
code does. Each piece below was found by importing the unmodified MindSpeed under the shim, one fresh process per
attempt, and adding a stand-in only where something failed (docs/device-shim.md lists them with the MindSpeed call
site). :func:`install_mindspeed_support` puts them in place on top of the NPU half of the shim;
:func:`uninstall_mindspeed_support` removes every one.

Installed only on request (``shim.install(mindspeed=True)``), never with the plain NPU shim: a ``torchair`` in
``sys.modules`` would tell other code (vllm-ascend checks it for its graph mode) that a graph compiler is there,
and importing ``torch_npu.contrib.transfer_to_npu`` redirects every CUDA call of the process, as the real one does.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

from ._import_hooks import spec_with_after_exec

_MISSING = object()
# module names this file puts into sys.modules (and removes again)
_MODULES = (
    "torch_npu.contrib",
    "torch_npu.contrib.transfer_to_npu",
    "torch_npu.utils",
    "torch_npu.utils.collect_env",
    "torch_npu._C",
    "torch_npu._C._distributed_c10d",
    "torchair",
    "torchair.ge",
    "acl",
)
CANN_VERSION = "9.1.0"  # the CANN torch_npu 2.10.0.post4 (SHIM_VERSION) pairs with in the pinned stack; MindSpeed
# reads it only to pick paths for CANN <= 8.0.RC2 (below), the same answer for the previous line's 8.3.RC1
_saved: dict[str, Any] | None = None  # what install replaced; None when not installed
_finder: importlib.abc.MetaPathFinder | None = None


def _new_module(name: str, doc: str, *, package: bool = False) -> types.ModuleType:
    module = types.ModuleType(name, doc)
    module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=package)
    if package:
        module.__path__ = []
    module._gspo_shim = True
    return module


# ---------------------------------------------------------------------------------------------------------
# torch_npu.contrib.transfer_to_npu
# ---------------------------------------------------------------------------------------------------------

_TRANSFER_DOC = """CPU-shim stand-in for torch_npu.contrib.transfer_to_npu (see shim.mindspeed_support).

Importing the real module rewrites the process's CUDA API to the NPU: ``torch.cuda.*`` becomes ``torch.npu.*``,
"cuda" device arguments become "npu", ``Tensor.cuda`` becomes ``Tensor.npu``, nccl becomes hccl. Importing this
one installs the shim's CUDA redirection (gspo_ascend.device.shim.cuda_redirect), which sends the same calls to the
emulated NPU, i.e. the CPU. Differences: ``torch.cuda.is_available()`` stays False (the real module makes it
answer for the NPU), ``init_process_group("nccl")`` is not rewritten (callers choose "hccl" or "gloo"), and only the
CUDA call sites megatron-core needs are redirected (cuda_redirect's docstring lists them), not torch_npu's whole
list (profiler, FSDP, device mesh, pipelining, ``torch.Generator``).
"""


class _TransferToNpuLoader(importlib.abc.Loader):
    """Executing ``torch_npu.contrib.transfer_to_npu`` installs the CUDA redirection, as the real module's import
    patches torch (a module object sitting in sys.modules would have no import to hook)."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name, _TRANSFER_DOC)
        module._gspo_shim = True
        module.__all__ = []  # the real module exports nothing either
        return module

    def __init__(self, redirect_cuda: Callable[[], None]) -> None:
        self.redirect_cuda = redirect_cuda

    def exec_module(self, module: types.ModuleType) -> None:
        self.redirect_cuda()
        contrib = sys.modules.get("torch_npu.contrib")
        if contrib is not None:
            contrib.transfer_to_npu = module


# ---------------------------------------------------------------------------------------------------------
# MindSpeed's op builders: CPU references in place of the kernels they would compile against CANN
# ---------------------------------------------------------------------------------------------------------

_BUILDER_MODULE = "mindspeed.op_builder.builder"
_seeded: dict[str, Any] = {}  # the entries we put into MindSpeedOpBuilder._loaded_ops


def _seed_op_cache(module: types.ModuleType) -> None:
    """Put the CPU references (:data:`.mindspeed_ops.OP_MODULES`) into MindSpeed's cache of loaded op modules
    (``MindSpeedOpBuilder._loaded_ops``, keyed by the builder's ``OP_NAME``): ``load()`` returns a cached module
    without compiling, so MindSpeed's op wrappers call the reference."""
    from .mindspeed_ops import OP_MODULES

    cache = module.MindSpeedOpBuilder._loaded_ops
    for name, ops in OP_MODULES.items():
        if name not in cache:
            cache[name] = _seeded[name] = ops


def _alias_npu_kernels_to_cpu(library: Any) -> None:
    """Kernels MindSpeed registers in its ``mindspeed`` torch library for the NPU's dispatch key (``@impl(AS_LIBRARY,
    "npu_gmm.Tensor", "PrivateUse1")``, Python functions that call the op builders' modules) are registered for the
    CPU key too: the emulated NPU's tensors are CPU tensors, as the shim's "hccl" backend serves CPU tensors.
    Wraps the library object's ``impl`` (torch.library.impl(lib, name, key) calls ``lib.impl``)."""
    impl = library.impl

    def impl_also_on_cpu(op_name: str, fn: Any, dispatch_key: str = "", **kwargs: Any) -> Any:
        result = impl(op_name, fn, dispatch_key, **kwargs)
        if dispatch_key == "PrivateUse1":
            impl(op_name, fn, "CPU", **kwargs)
        return result

    library.impl = impl_also_on_cpu


def _unseed_op_cache() -> None:
    module = sys.modules.get(_BUILDER_MODULE)
    cache = module.MindSpeedOpBuilder._loaded_ops if module is not None else {}
    for name, ops in _seeded.items():
        if cache.get(name) is ops:
            del cache[name]
    _seeded.clear()


def _after_builder_exec(module: types.ModuleType) -> None:
    """Right after MindSpeed's builder module ran: seed its op cache, alias its NPU kernels to CPU."""
    _seed_op_cache(module)
    _alias_npu_kernels_to_cpu(module.AS_LIBRARY)


class _Finder(importlib.abc.MetaPathFinder):
    """Serves the transfer_to_npu stand-in and hooks the import of MindSpeed's builder module. ``redirect_cuda``
    is the shim's ``install(cuda=True)``, passed in by the shim package (which imports this module)."""

    def __init__(self, redirect_cuda: Callable[[], None]) -> None:
        self.redirect_cuda = redirect_cuda

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname == "torch_npu.contrib.transfer_to_npu":
            return importlib.machinery.ModuleSpec(fullname, _TransferToNpuLoader(self.redirect_cuda))
        if fullname != _BUILDER_MODULE:
            return None
        return spec_with_after_exec(self, fullname, path, target, _after_builder_exec)


# ---------------------------------------------------------------------------------------------------------
# "npu" device strings and Tensor.npu(): MindSpeed allocates on the NPU by name
# ---------------------------------------------------------------------------------------------------------


# "npu" device strings: MindSpeed allocates on the NPU by name where megatron would use the current device (its
# causal mask, torch.ones(..., device='npu') in generate_mask.py; CP index tensors; .to('npu')). With real
# torch_npu "npu" is a device type; here the emulated NPU is the CPU, so install_mindspeed_support() has the CUDA
# redirection map "npu" / "npu:N" strings to "cpu" too (cuda_redirect.redirect_device_name). torch.device("npu")
# itself still fails (the shim does not rename PrivateUse1; see npu_module) and stays unmapped.


def _tensor_npu(self: torch.Tensor, device: Any = None, non_blocking: bool = False, **_: Any) -> torch.Tensor:
    """Tensor.npu() (torch_npu adds it to torch.Tensor): the tensor already lives on the emulated NPU, and
    ``.npu()`` of a resident tensor returns the tensor itself (as the CUDA redirection's ``Tensor.cuda``)."""
    return self


# ---------------------------------------------------------------------------------------------------------
# torch_npu.npu internals MindSpeed calls
# ---------------------------------------------------------------------------------------------------------


def _lazy_call(callback: Any) -> None:
    """torch_npu.npu._lazy_call: runs ``callback`` now.

    The real one queues callbacks until the device is initialised and runs them at once afterwards; the emulated
    device is always initialised (``torch.npu.is_initialized()`` is True). MindSpeed's ``_set_cuda_rng_state``
    (which replaces megatron's) restores RNG states through it.
    """
    callback()


def _default_generators() -> tuple[torch.Generator, ...]:
    """torch_npu.npu.default_generators: one generator per visible device; here each is the CPU default generator
    (the shim's RNG functions drive it: there is no device generator)."""
    from . import npu_module

    return (torch.default_generator,) * max(1, npu_module.device_count())


# ---------------------------------------------------------------------------------------------------------
# torch_npu._C._distributed_c10d.ProcessGroupHCCL.Options
# ---------------------------------------------------------------------------------------------------------


class _HcclOptions:
    """Stand-in for ``torch_npu._C._distributed_c10d.ProcessGroupHCCL.Options`` (HCCL process-group options).

    MindSpeed wraps megatron's ``get_nccl_options`` (``mindspeed/functional/profiler/profiler_info.py``): when the
    class has ``hccl_config`` it creates options and stores ``{"group_name": <megatron's group name>}`` in them, and
    megatron passes them to ``new_group(pg_options=...)``. The shim's "hccl" backend is gloo, which ignores them
    (so does torch for a "gloo" group). As in torch_npu, ``hccl_config`` returns a copy: update it by assignment.
    """

    def __init__(self, is_high_priority_stream: bool = False):
        self.is_high_priority_stream = is_high_priority_stream
        self._hccl_config: dict[str, Any] = {}

    @property
    def hccl_config(self) -> dict[str, Any]:
        return dict(self._hccl_config)

    @hccl_config.setter
    def hccl_config(self, value: dict[str, Any]) -> None:
        self._hccl_config = dict(value)


def _build_torch_npu_c() -> tuple[types.ModuleType, types.ModuleType]:
    c = _new_module("torch_npu._C", "CPU-shim stand-in for torch_npu's C extension (HCCL options only).", package=True)
    c10d = _new_module("torch_npu._C._distributed_c10d", "CPU-shim stand-in: ProcessGroupHCCL.Options only.")
    c10d.ProcessGroupHCCL = type("ProcessGroupHCCL", (), {"Options": _HcclOptions, "__doc__": _HcclOptions.__doc__})
    c._distributed_c10d = c10d
    return c, c10d


# ---------------------------------------------------------------------------------------------------------
# torch_npu.utils.collect_env
# ---------------------------------------------------------------------------------------------------------


def get_cann_version() -> str:
    """torch_npu.utils.collect_env.get_cann_version: the CANN version the shim emulates (8.3.RC1).

    The real one reads ``version=`` from the ``ascend_*_install.info`` file under ``ASCEND_HOME_PATH``. MindSpeed's
    MoE token dispatchers call it at import to pick code paths for CANN <= 8.0.RC2 (``cann_version_check``).
    """
    return CANN_VERSION


def _build_torch_npu_utils() -> tuple[types.ModuleType, types.ModuleType]:
    utils = _new_module("torch_npu.utils", "CPU-shim stand-in for torch_npu.utils (collect_env only).", package=True)
    collect_env = _new_module(
        "torch_npu.utils.collect_env", "CPU-shim stand-in for torch_npu.utils.collect_env (get_cann_version only)."
    )
    collect_env.get_cann_version = get_cann_version
    utils.collect_env = collect_env
    return utils, collect_env


# ---------------------------------------------------------------------------------------------------------
# torchair (torch_npu's graph compiler, shipped inside torch_npu 2.7.1 as torch_npu/dynamo/torchair)
# ---------------------------------------------------------------------------------------------------------

_TORCHAIR_DOC = """CPU-shim stand-in for torchair, torch_npu's graph-mode compiler (see shim.mindspeed_support).

MindSpeed imports it to register GE converters for its custom ops (``@register_fx_node_ge_converter(...)`` in
``mindspeed/op_builder/*``). Converters run only when a graph is compiled for the NPU with torchair, which never
happens here: ``register_fx_node_ge_converter`` returns its function unchanged and records the op, and the ``ge``
graph-building API raises when called. ``get_npu_backend`` / ``get_compiler`` are absent (eager mode only).
"""


class _GraphModeUnavailable(RuntimeError):
    pass


def _graph_only(name: str) -> Any:
    def unavailable(*args: Any, **kwargs: Any) -> Any:
        raise _GraphModeUnavailable(
            f"torchair.ge.{name}: the CPU shim has no torchair graph compiler (eager mode only; a GE converter ran)"
        )

    unavailable.__name__ = name
    return unavailable


def _build_torchair() -> tuple[types.ModuleType, types.ModuleType]:
    torchair = _new_module("torchair", _TORCHAIR_DOC, package=True)
    ge = _new_module("torchair.ge", "CPU-shim stand-in for torchair.ge (graph building; raises when called).")
    converters: dict[Any, Any] = {}

    def register_fx_node_ge_converter(aten_op: Any) -> Any:
        """Records ``aten_op`` -> converter and returns the converter unchanged (no graph is ever compiled)."""

        def register(converter: Any) -> Any:
            converters[aten_op] = converter
            return converter

        return register

    torchair.register_fx_node_ge_converter = register_fx_node_ge_converter
    torchair._gspo_converters = converters
    torchair.ge = ge

    class Tensor:  # noqa: D401 (names of the real API)
        """Stand-in for torchair.ge.Tensor (a GE graph tensor); used by MindSpeed only in type annotations."""

    class TensorSpec:
        """Stand-in for torchair.ge.TensorSpec (a meta description of a graph input); annotations only."""

    class DataType:
        """Stand-in for torchair.ge.DataType: the GE dtype enumeration (the values of GE's ``DT_*``)."""

        DT_FLOAT = 0
        DT_FLOAT16 = 1
        DT_INT8 = 2
        DT_INT32 = 3
        DT_UINT8 = 4
        DT_INT16 = 6
        DT_UINT16 = 7
        DT_UINT32 = 8
        DT_INT64 = 9
        DT_UINT64 = 10
        DT_DOUBLE = 11
        DT_BOOL = 12
        DT_BF16 = 27

    class Format:
        """Stand-in for torchair.ge.Format (GE tensor layouts)."""

        FORMAT_ND = 2

    ge.Tensor, ge.TensorSpec, ge.DataType, ge.Format = Tensor, TensorSpec, DataType, Format
    for name in ("custom_op", "Const", "Cast", "Clone"):
        setattr(ge, name, _graph_only(name))
    ge.__all__ = ["custom_op", "Const", "Cast", "DataType", "Format", "Tensor", "TensorSpec", "Clone"]
    return torchair, ge


# ---------------------------------------------------------------------------------------------------------
# acl (pyACL, CANN's Python binding of AscendCL)
# ---------------------------------------------------------------------------------------------------------


def _build_acl() -> types.ModuleType:
    """``acl``: MindSpeed's MoE modules import it at module level (``moe_layer_overlap_allgather.py`` and the
    other overlap / adaptive-memory files) and ask ``acl.get_soc_name()`` for the chip. The real module is CANN's
    C extension; this one knows only the chip name, the 910B the NPU shim emulates (npu_module.SOC_VERSION 220 =
    Ascend910B1). ``acl.rt`` (memory queries of the adaptive-recompute features) is absent."""
    acl = _new_module("acl", _build_acl.__doc__ or "")

    def get_soc_name() -> str:
        """The emulated chip: Ascend910B1."""
        return "Ascend910B1"

    acl.get_soc_name = get_soc_name
    return acl


# ---------------------------------------------------------------------------------------------------------
# Install / uninstall
# ---------------------------------------------------------------------------------------------------------

# attributes added to the NPU shim's torch_npu and torch_npu.npu module objects
_TORCH_NPU_ATTRS = ("__file__", "contrib", "utils", "_C", "unsupported_dtype")
# torch_npu's ``torch_npu.unsupported_dtype``: the quantised dtypes the NPU has no storage for, the same five in
# 2.10.0.post4 (``_init/registry/backend.py``) as in 2.7.1 (its __init__.py); held to the pinned wheel by
# tests/conformance/test_torch_npu_conformance.py. MindSpeed's dist-train TensorSyncTool (built when TransformerConfig
# validates its features) numbers every other torch dtype.
UNSUPPORTED_DTYPES = (torch.quint8, torch.quint4x2, torch.quint2x4, torch.qint32, torch.qint8)
_DEVICE_ATTRS = ("_lazy_call", "default_generators")


# ---------------------------------------------------------------------------------------------------------
# HCCL communicator names: MindSpeed's MC2 linears (use_ascend_mc2)
# ---------------------------------------------------------------------------------------------------------


def install_mc2_support() -> None:
    """``group._get_backend(torch.device("npu")).get_hccl_comm_name(rank)``, which MindSpeed's MC2 linears call
    (``core/tensor_parallel/mc2_feature/linear_function.py``) to address the TP group in ``npu_all_gather_base_mm``
    / ``npu_mm_reduce_scatter_base`` (:mod:`.npu_mc2_ops`). Needs :func:`install_mindspeed_support` first; called
    by ``shim.install(mc2=True)``, i.e. only in a process whose config turns MC2 on.

    torch_npu renames torch's PrivateUse1 backend "npu"; the shim otherwise does not (npu_module): a rename cannot
    be undone in the process, and a renamed PrivateUse1 without torch_npu's C++ hooks breaks torch's accelerator
    detection (``dist.barrier`` calls ``torch._C._get_accelerator()``, which then raises "Please register
    PrivateUse1HooksInterface"). So: renamed here, for MC2 processes only, and the accelerator query answers
    "cpu" where it would raise that (the emulated NPU's tensors live on the CPU). Every process group answers the
    "npu" device with an :class:`~.npu_mc2_ops.EmulatedHcclBackend` (real torch_npu: its ``ProcessGroupHCCL``);
    other devices get the group's own backend.
    """
    from . import npu_mc2_ops

    if _saved is None:
        raise RuntimeError("install the MindSpeed stand-ins first: shim.install(mindspeed=True, mc2=True)")
    if "mc2 _get_backend" in _saved:
        return
    if torch._C._get_privateuse1_backend_name() != "npu":
        torch.utils.rename_privateuse1_backend("npu")
    group_type = torch.distributed.ProcessGroup
    original_backend, original_accelerator = group_type._get_backend, torch._C._get_accelerator
    _saved["mc2 _get_backend"], _saved["mc2 _get_accelerator"] = original_backend, original_accelerator

    def _get_backend(self: Any, device: Any) -> Any:
        if torch.device(device).type == "npu":
            return npu_mc2_ops.EmulatedHcclBackend(self)
        return original_backend(self, device)

    def _get_accelerator(*args: Any, **kwargs: Any) -> Any:
        try:
            return original_accelerator(*args, **kwargs)
        except RuntimeError as exc:
            if "PrivateUse1HooksInterface" not in str(exc):
                raise
            return torch.device("cpu")

    group_type._get_backend = _get_backend
    torch._C._get_accelerator = _get_accelerator


def install_mindspeed_support(redirect_cuda: Callable[[], None]) -> None:
    """Install the stand-ins (idempotent). Needs the NPU half of the shim (``shim.install(npu=True)``);
    ``redirect_cuda`` installs the shim's CUDA redirection (importing transfer_to_npu calls it)."""
    global _saved, _finder
    if _saved is not None:
        return
    torch_npu = sys.modules.get("torch_npu")
    if torch_npu is None or not getattr(torch_npu, "_gspo_shim", False):
        raise RuntimeError("install the NPU shim first: gspo_ascend.device.shim.install(npu=True, mindspeed=True)")
    device = torch_npu.npu
    saved: dict[str, Any] = {name: sys.modules.get(name, _MISSING) for name in _MODULES}
    saved["torch_npu attrs"] = {name: vars(torch_npu).get(name, _MISSING) for name in _TORCH_NPU_ATTRS}
    saved["device attrs"] = {name: vars(device).get(name, _MISSING) for name in _DEVICE_ATTRS}

    # MindSpeed's op builders locate torch_npu's headers and libraries from its __file__ at construction
    # (mindspeed/op_builder/builder.py); nothing is compiled here: the file that defines the stand-in answers.
    from . import npu_module

    torch_npu.__file__ = os.path.abspath(npu_module.__file__)
    contrib = _new_module("torch_npu.contrib", "CPU-shim stand-in for torch_npu.contrib.", package=True)
    torch_npu.contrib = contrib
    sys.modules["torch_npu.contrib"] = contrib
    sys.modules.pop("torch_npu.contrib.transfer_to_npu", None)
    utils, collect_env = _build_torch_npu_utils()
    torch_npu.utils = utils
    sys.modules["torch_npu.utils"] = utils
    sys.modules["torch_npu.utils.collect_env"] = collect_env
    torch_npu.unsupported_dtype = list(UNSUPPORTED_DTYPES)
    c, c10d = _build_torch_npu_c()
    torch_npu._C = c
    sys.modules["torch_npu._C"] = c
    sys.modules["torch_npu._C._distributed_c10d"] = c10d
    _finder = _Finder(redirect_cuda)
    sys.meta_path.insert(0, _finder)
    if _BUILDER_MODULE in sys.modules:  # MindSpeed's builders imported before the shim: seed the cache now (its
        # kernels registered so far have no CPU alias: install the shim before importing MindSpeed)
        _seed_op_cache(sys.modules[_BUILDER_MODULE])

    from . import cuda_redirect

    cuda_redirect.redirect_device_name("npu")  # MindSpeed allocates with device="npu" by name (see above)
    saved["Tensor.npu"] = vars(torch.Tensor).get("npu", _MISSING)
    torch.Tensor.npu = _tensor_npu

    device._lazy_call = _lazy_call
    device.default_generators = _default_generators()

    torchair, ge = _build_torchair()
    sys.modules["torchair"] = torchair
    sys.modules["torchair.ge"] = ge
    sys.modules["acl"] = _build_acl()
    from . import megatron_training

    saved["megatron.training"] = {}
    megatron_training.install(saved["megatron.training"])  # MindSpeed 26.1.0 imports it; megatron-core lacks it
    _saved = saved


def uninstall_mindspeed_support() -> None:
    """Remove every stand-in :func:`install_mindspeed_support` added (the CUDA redirection that importing
    ``transfer_to_npu`` installed is removed by ``shim.uninstall()``). What MindSpeed itself did stays: its
    patches of megatron and torch, and the CPU kernels registered in its ``mindspeed`` torch library."""
    global _saved, _finder
    if _saved is None:
        return
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    _finder = None
    _unseed_op_cache()
    from . import cuda_redirect

    cuda_redirect.redirect_device_name("npu", on=False)
    for owner, name in ((torch.distributed.ProcessGroup, "_get_backend"), (torch._C, "_get_accelerator")):
        if f"mc2 {name}" in _saved:
            setattr(owner, name, _saved[f"mc2 {name}"])
    if _saved["Tensor.npu"] is _MISSING:
        del torch.Tensor.npu
    else:
        torch.Tensor.npu = _saved["Tensor.npu"]
    torch_npu = sys.modules.get("torch_npu")
    for owner, key in ((torch_npu, "torch_npu attrs"), (getattr(torch_npu, "npu", None), "device attrs")):
        if owner is None:
            continue
        for name, previous in _saved[key].items():
            if previous is _MISSING:
                vars(owner).pop(name, None)
            else:
                setattr(owner, name, previous)
    from . import megatron_training

    megatron_training.uninstall(_saved["megatron.training"])
    for name in _MODULES:
        previous = _saved[name]
        if previous is _MISSING:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = previous
    _saved = None
