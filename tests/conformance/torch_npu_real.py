"""What the pinned torch-npu 2.7.1 wheel declares about its ops, read from the wheel itself.

* ``schema_strings()`` / ``schema(name)``: every op schema of
  ``torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml``, parsed by torch's own schema parser (the grammar
  torch_npu's codegen reads).
* ``python_params(schema)``: the Python signature torchgen derives from a schema (``self`` becomes ``input``).
* ``meta_functions()``: the real meta registrations (``op_plugin/meta/_meta_registrations.py``) as plain Python
  functions. The file is executed unmodified with ``torch.library.impl`` / ``Library`` swapped for recorders
  while it runs, so nothing is registered with the dispatcher and no ``npu`` namespace is needed. Stand-ins:
  ``torch_npu.utils._error_code`` (the real module formats an error-code suffix for messages; the stand-in
  returns a fixed suffix) and the schema of ``npu_prefetch``, which the file references at import
  (``has_side_effect(torch.ops.npu.npu_prefetch.default)``) and which is defined from the wheel's own yaml.
"""

from __future__ import annotations

import functools
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
    module.ops_error = lambda code, *args: f"[torch_npu 2.7.1 error {code}]"
    return module


_LIBRARY_KEEPALIVE: list[Any] = []


@functools.cache
def meta_functions() -> dict[str, Any]:
    """op name (and ``name.overload``) -> the real meta function of torch_npu 2.7.1."""
    source = upstream_file("torch-npu", _META).read_text()
    fragment = torch.library.Library("npu", "FRAGMENT")  # only what the file touches at import time
    fragment.define(schema_strings()["npu_prefetch"])
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

    saved_modules = {m: sys.modules.get(m) for m in ("torch_npu", "torch_npu.utils", "torch_npu.utils._error_code")}
    sys.modules.setdefault("torch_npu", types.ModuleType("torch_npu"))
    sys.modules.setdefault("torch_npu.utils", types.ModuleType("torch_npu.utils"))
    sys.modules["torch_npu.utils._error_code"] = _error_code_stand_in()
    saved_library = (torch.library.impl, torch.library.Library)
    torch.library.impl, torch.library.Library = recording_impl, InertLibrary
    try:
        exec(compile(source, str(upstream_file("torch-npu", _META)), "exec"), {"__name__": "torch_npu_2_7_1_meta"})
    finally:
        torch.library.impl, torch.library.Library = saved_library
        for name, module in saved_modules.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    return captured
