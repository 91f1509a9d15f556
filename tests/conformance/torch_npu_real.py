"""What the pinned torch-npu wheel (2.10.0.post4) declares about its ops, read from the wheel itself.

* ``schema_strings()`` / ``schema(name)``: every op schema of
  ``torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml``, parsed by torch's own schema parser (the grammar
  torch_npu's codegen reads).
* ``python_params(schema)``: the Python signature torchgen derives from a schema (``self`` becomes ``input``).
* ``meta_functions()``: the real meta registrations (``op_plugin/meta/_meta_registrations.py``) as plain Python
  functions. The file is executed unmodified with ``torch.library.impl`` / ``Library`` swapped for recorders
  while it runs, so nothing is registered with the dispatcher and no ``npu`` namespace is needed. Stand-ins for
  what the file imports from torch_npu's compiled part (``_meta_registrations.py:5-10``), each a fact of the
  pinned stack, not a guess:

  - ``torch_npu.utils._error_code``: the real module formats an error-code suffix for messages; the stand-in
    returns a fixed suffix.
  - ``torch_npu.npu._backends.get_soc_version``: 220, ``SocVersion::Ascend910B1`` (the wheel's
    ``include/torch_npu/csrc/core/npu/NpuVariables.h``), the 910B of the Atlas 800T A2 the NPU path targets;
    the file only compares it with 260 (Ascend950, ``_meta_registrations.py:2154``), so B1-B4 are alike.
  - ``torch_npu.npu.utils.get_cann_version`` / ``_is_gte_cann_version``: CANN 9.1.0, the pinned CANN
    (requirements-npu.txt).
  - ``torch_npu.<npu dtype>`` (``hifloat8``, ``float4_e2m1fn_x2``, ...): the enum values the file itself maps
    them from (``TORCH_NPU_DTYPE_TO_STRING_MAP``); the real attributes are those ints.
  - the schemas of the ops the file passes to ``has_side_effect(torch.ops.npu.<op>.default)`` at import
    (``npu_prefetch``, ...), defined from the wheel's own yaml.
"""

from __future__ import annotations

import ast
import functools
import re
import sys
import types
from typing import Any

import torch
import yaml

from .upstream import upstream_file

_YAML = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"
_META = "torch_npu/op_plugin/meta/_meta_registrations.py"


def _funcs(node: Any) -> list[str]:
    """Every ``func:`` string anywhere in the yaml tree."""
    if isinstance(node, dict):
        found = [node["func"]] if isinstance(node.get("func"), str) else []
        return found + [f for key, value in node.items() if key != "func" for f in _funcs(value)]
    if isinstance(node, list):
        return [f for item in node for f in _funcs(item)]
    return []


@functools.cache
def schema_strings() -> dict[str, str]:
    """``name[.overload]`` -> schema string, first occurrence wins (the yaml repeats some under ``symint``)."""
    tree = yaml.safe_load(upstream_file("torch-npu", _YAML).read_text())
    out: dict[str, str] = {}
    for func in _funcs(tree):
        out.setdefault(func.split("(", 1)[0], func)
    return out


@functools.cache
def schema(name: str) -> torch._C.FunctionSchema:
    """The parsed schema of one op (a few unrelated ops use types torch's parser lacks, e.g. ``Dimname``)."""
    return torch._C.parse_schema(schema_strings()[name])


def declared_types(name: str) -> list[str]:
    """Each argument's type as the yaml spells it, in torch's ``Optional[List[...]]`` form. ``parse_schema``
    turns ``ScalarType`` into ``int``, which would hide 2.10's change of npu_grouped_matmul's ``output_dtype``
    from ``ScalarType?`` to ``int?``; this reads the string itself."""
    params = schema_strings()[name].split("(", 1)[1].rsplit(") ->", 1)[0]
    types_ = []
    for param in (p.strip() for p in params.split(",")):
        if param == "*":
            continue
        spelled = param.split()[0]
        optional = spelled.endswith("?")
        spelled = spelled.rstrip("?")
        spelled = re.sub(r"^(\w+)\[\d*\]$", r"List[\1]", spelled)
        types_.append(f"Optional[{spelled}]" if optional else spelled)
    return types_


def python_params(schema: torch._C.FunctionSchema) -> list[tuple[str, bool, Any]]:
    """(name, keyword-only, default or ``inspect.Parameter.empty``) per argument, as torchgen exposes them."""
    import inspect

    params = []
    for arg in schema.arguments:
        name = "input" if arg.name == "self" else arg.name  # torchgen's Python binding renames `self`
        default = arg.default_value if arg.has_default_value() else inspect.Parameter.empty
        params.append((name, arg.kwarg_only, default))
    return params


def _error_code_stand_in() -> types.ModuleType:
    module = types.ModuleType("torch_npu.utils._error_code")

    class ErrCode:  # the real enum's members are only formatted into messages
        def __getattr__(self, name: str) -> str:
            return name

    module.ErrCode = ErrCode()
    module.ops_error = lambda code, *args: f"[torch_npu error {code}]"
    return module


_SOC_ASCEND910B1 = 220  # NpuVariables.h: SocVersion::Ascend910B1
_CANN = "9.1.0"  # the pinned CANN (requirements-npu.txt)


def _version_key(version: str) -> tuple[int, ...]:
    """``"8.5.0.alpha003"`` -> (8, 5, 0): the release part, enough to order against 9.1.0."""
    return tuple(int(n) for n in re.findall(r"\d+", version)[:3])


def _npu_dtypes(source: str) -> dict[str, int]:
    """``torch_npu.<name>`` -> enum value, from the meta file's own ``TORCH_NPU_DTYPE_TO_STRING_MAP``."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "TORCH_NPU_DTYPE_TO_STRING_MAP":
            mapping = ast.literal_eval(node.value)
            return {name.removeprefix("torch_npu."): value for value, name in mapping.items()}
    raise AssertionError(f"{_META} has no TORCH_NPU_DTYPE_TO_STRING_MAP: the stand-in's dtypes cannot be derived")


def _torch_npu_stand_ins(source: str) -> dict[str, types.ModuleType]:
    """The torch_npu modules the meta file imports, as described in the module docstring."""
    root, npu = types.ModuleType("torch_npu"), types.ModuleType("torch_npu.npu")
    utils, backends = types.ModuleType("torch_npu.npu.utils"), types.ModuleType("torch_npu.npu._backends")
    backends.get_soc_version = lambda: _SOC_ASCEND910B1
    utils.get_cann_version = lambda module="CANN": _CANN
    utils._is_gte_cann_version = lambda version, module="CANN": _version_key(_CANN) >= _version_key(version)
    npu.utils, npu._backends = utils, backends
    root.npu, root.utils = npu, types.ModuleType("torch_npu.utils")
    for name, value in _npu_dtypes(source).items():
        setattr(root, name, value)
    return {
        "torch_npu": root,
        "torch_npu.npu": npu,
        "torch_npu.npu.utils": utils,
        "torch_npu.npu._backends": backends,
        "torch_npu.utils": root.utils,
        "torch_npu.utils._error_code": _error_code_stand_in(),
    }


_LIBRARY_KEEPALIVE: list[Any] = []


@functools.cache
def meta_functions() -> dict[str, Any]:
    """op name (and ``name.overload``) -> the real meta function of the pinned torch_npu."""
    source = upstream_file("torch-npu", _META).read_text()
    fragment = torch.library.Library("npu", "FRAGMENT")  # only what the file touches at import time
    for op in sorted(set(re.findall(r"has_side_effect\(torch\.ops\.npu\.(\w+)\.default\)", source))):
        fragment.define(schema_strings()[op])
    _LIBRARY_KEEPALIVE.append(fragment)
    captured: dict[str, Any] = {}

    def recording_impl(_lib: Any, name: str, *args: Any, **kwargs: Any):
        def keep(fn):
            captured.setdefault(name, fn)
            return fn

        return keep

    class InertLibrary:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

    stand_ins = _torch_npu_stand_ins(source)
    saved_modules = {m: sys.modules.get(m) for m in stand_ins}
    sys.modules.update(stand_ins)  # the file reads the dtypes off ``torch_npu`` itself, so ours, not the shim's
    saved_library = (torch.library.impl, torch.library.Library)
    torch.library.impl, torch.library.Library = recording_impl, InertLibrary
    try:
        exec(compile(source, str(upstream_file("torch-npu", _META)), "exec"), {"__name__": "torch_npu_real_meta"})
    finally:
        torch.library.impl, torch.library.Library = saved_library
        for name, module in saved_modules.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    return captured
