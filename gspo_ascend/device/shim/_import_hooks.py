"""Running a fix-up right after a module's own body, at its first import (the shim's import hooks share this).

The CUDA redirection defines a name megatron-core reads but only binds under Transformer Engine; the MindSpeed
support seeds MindSpeed's op cache when its builder module loads. Both need the module's real loader to run
first, whichever finder provides it (site-packages, an editable install, a test's path).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from typing import Any


class AfterExecLoader(importlib.abc.Loader):
    """Wraps a module's real loader and calls ``after(module)`` right after the module body ran."""

    def __init__(self, inner: importlib.abc.Loader, after: Callable[[Any], None]):
        self._inner, self._after = inner, after

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._inner.exec_module(module)
        self._after(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_code, ... for tracebacks and inspect
        return getattr(self._inner, name)


def spec_with_after_exec(
    finder: object, fullname: str, path: Any, target: Any, after: Callable[[Any], None]
) -> importlib.machinery.ModuleSpec | None:
    """The spec the other meta-path finders give ``fullname``, its loader wrapped to call ``after``; or None."""
    for other in sys.meta_path:
        if other is finder or not hasattr(other, "find_spec"):
            continue
        spec = other.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = AfterExecLoader(spec.loader, after)
            return spec
    return None
