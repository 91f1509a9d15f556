"""Stand-in for Megatron-LM's ``megatron.training`` package, for MindSpeed 26.1.0 and core_r0.16.0 on a machine with
megatron-core only (issues #26, #41).

MindSpeed 26.1.0_core_r0.12.1's level-0 ``transformer-engine-basic`` feature (always applied) imports
``mindspeed.te.pytorch.module.checkpoint`` while it registers its patches, and that chain reaches
``mindspeed/te/pytorch/fp8/tensor/float8_tensor.py``, which does ``from megatron.training import get_args`` at
module level. MindSpeed 2.2.0 never imported it on this path. On the cluster ``megatron.training`` comes from the
Megatron-LM checkout (docs/install-npu.md installs it from source); PyPI's megatron-core wheel and
sdist (what CPU venvs install) hold ``megatron/core`` only. So without this stand-in 26.1.0's adaptor cannot be
imported here at all. MindSpeed core_r0.16.0 imports it on the MoE path instead: its grouped-GEMM experts import
``core/transformer/moe/grouped_matmul_util.py``, which imports ``moe_feature/fb_overlap/modules/weight_grad_store.py``,
whose line 10 is ``from megatron.training import get_args`` (the first MoE forward fails without it).

What it emulates: the names MindSpeed 26.1.0 imports or patches in ``megatron.training`` when it finds the package
(``features_manager/megatron_basic/megatron_basic.py`` register_non_mcore_basic_patches: arguments.parse_args /
validate_args / _print_args, yaml_arguments.validate_yaml / _print_args, initialize._compile_dependencies,
dist_signal_handler.get_device, utils.get_device_arch_version; ``args_utils.get_full_args``: global_vars.get_args,
_GLOBAL_ARGS). ``get_args`` behaves as Megatron-LM's before ``initialize_megatron``: it asserts
``'args is not initialized.'``, which MindSpeed's ``get_full_args`` catches to fall back to its own arguments
(the message it matches is Megatron-LM's ``_ensure_var_is_initialized``); core_r0.16.0 also imports
``get_timers``, which asserts the same way. The training-loop functions exist only
to be patched: our engines never parse Megatron-LM's command line or run its training loop, and calling one says
so. With the package present MindSpeed takes the path it takes on the cluster (``only_mcore`` False).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types

# module -> functions it must have (what MindSpeed 26.1.0 patches); get_args / _GLOBAL_ARGS are added separately
_FUNCTIONS = {
    "megatron.training.arguments": ("parse_args", "validate_args", "_print_args"),
    "megatron.training.yaml_arguments": ("validate_yaml", "_print_args"),
    "megatron.training.initialize": ("_compile_dependencies",),
    "megatron.training.dist_signal_handler": ("get_device",),
    "megatron.training.utils": ("get_device_arch_version",),
    "megatron.training.global_vars": (),
}
MODULES = ("megatron.training", *_FUNCTIONS)


# (file of the installed mindspeed package, text in it): MindSpeed reaches megatron.training on our path when the
# file says so. 26.1.0: the always-applied TE-basic feature imports the fp8 chain; core_r0.16.0: the MoE GMM path's
# weight-grad store imports get_args at module level. 2.2.0 has neither.
_IMPORTERS = (
    ("features_manager/megatron_basic/transformer_engine_basic.py", "mindspeed.te.pytorch.module.checkpoint"),
    ("core/transformer/moe/moe_feature/fb_overlap/modules/weight_grad_store.py", "from megatron.training import"),
)


def needed() -> bool:
    """True when the installed MindSpeed imports megatron.training on our path and no real one exists."""
    try:
        if importlib.util.find_spec("megatron.training") is not None:
            return False
        spec = importlib.util.find_spec("mindspeed")
    except (ImportError, ValueError):
        return False
    for location in (spec.submodule_search_locations or []) if spec else []:
        for relpath, text in _IMPORTERS:
            try:
                with open(f"{location}/{relpath}", encoding="utf-8") as f:
                    if text in f.read():
                        return True
            except OSError:
                continue
    return False


def _module(name: str, *, package: bool = False) -> types.ModuleType:
    module = types.ModuleType(name, f"CPU-shim stand-in for Megatron-LM's {name} (gspo_ascend.device.shim).")
    module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=package)
    if package:
        module.__path__ = []
    module._gspo_shim = True
    return module


def _not_emulated(qualname: str):
    def function(*args, **kwargs):
        raise NotImplementedError(f"{qualname} of Megatron-LM is not emulated by the CPU shim (nothing here runs it)")

    function.__name__ = qualname.rsplit(".", 1)[-1]
    function.__qualname__ = function.__name__
    return function


def _uninitialised_getter(global_vars: types.ModuleType, variable: str, what: str):
    """Megatron-LM's ``get_args`` / ``get_timers``: the global, asserted set first with Megatron-LM's message
    (``_ensure_var_is_initialized``: "args is not initialized.", which MindSpeed's ``get_full_args`` matches)."""

    def getter():
        value = getattr(global_vars, variable)
        assert value is not None, f"{what} is not initialized."
        return value

    return getter


def build() -> dict[str, types.ModuleType]:
    """The stand-in modules by name (the caller puts them into sys.modules and removes them again)."""
    modules = {"megatron.training": _module("megatron.training", package=True)}
    for name, functions in _FUNCTIONS.items():
        module = _module(name)
        for function in functions:
            setattr(module, function, _not_emulated(f"{name}.{function}"))
        modules[name] = module
        setattr(modules["megatron.training"], name.rsplit(".", 1)[-1], module)
    global_vars = modules["megatron.training.global_vars"]
    # core_r0.16.0's fb-overlap package imports get_timers too (fb_overlap/vpp_schedules.py:8, reached through its
    # __init__ from the GMM experts); only its interleaved pipeline schedule calls it, which our engines never run
    for getter, variable, what in (("get_args", "_GLOBAL_ARGS", "args"), ("get_timers", "_GLOBAL_TIMERS", "timers")):
        setattr(global_vars, variable, None)
        function = _uninitialised_getter(global_vars, variable, what)
        function.__name__ = function.__qualname__ = getter
        setattr(global_vars, getter, function)
        setattr(modules["megatron.training"], getter, function)
    return modules


def install(saved: dict) -> None:
    """Put the stand-ins in place when :func:`needed`; records what it replaced in ``saved``."""
    if not needed():
        return
    import megatron

    for name, module in build().items():
        saved[name] = sys.modules.get(name)
        sys.modules[name] = module
    saved["megatron.training attr"] = vars(megatron).get("training")
    megatron.training = sys.modules["megatron.training"]


def uninstall(saved: dict) -> None:
    if "megatron.training" not in saved:
        return
    for name in MODULES:
        previous = saved.pop(name, None)
        if previous is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = previous
    megatron = sys.modules.get("megatron")
    previous = saved.pop("megatron.training attr", None)
    if megatron is not None:
        if previous is None:
            vars(megatron).pop("training", None)
        else:
            megatron.training = previous
