"""torch.compile where it helps, eager where it cannot work: the graph-mode policy of each backend.

* :func:`maybe_compile` wraps a function according to ``trainer.compile`` (auto | on | off) and the backend.
  On NPU torch.compile is never attempted: graph mode is not usable for RL there (field failure #2,
  ``raise e.remove_dynamo_frames() from None`` in inductor; MindSpeed even replaces torch.compile with a
  pass-through), so ``on`` is downgraded to eager with one warning. Elsewhere, when compiling is requested, the
  wrapper calls the compiled function and, if dynamo / inductor raises, runs the call eagerly, logs ONE warning
  line and keeps using eager from then on (the decision is cached per wrapper).
* :func:`resolve_enforce_eager` turns ``rollout.enforce_eager`` (None = auto) into vLLM's ``enforce_eager``.

Limitation: inductor compiles a backward graph lazily, at the first ``.backward()``; a failure there surfaces
from the backward call, outside this wrapper. Functions compiled here are loss/metric helpers whose backward
is small; if that ever bites, use ``trainer.compile=off``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from .device import Backend
from .errors import ConfigError

log = logging.getLogger(__name__)

SETTINGS = ("auto", "on", "off")
_warned: set[str] = set()  # one warning per function name per process, however many wrappers exist


def _warn_once(key: str, message: str, *args: Any) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message, *args)


def _describe(exc: BaseException) -> str:
    """One line: the innermost cause (dynamo wraps the backend's error; its own first line is "backend=... raised:")."""
    inner = getattr(exc, "inner_exception", None) or exc.__cause__
    if isinstance(inner, BaseException) and inner is not exc:
        return _describe(inner)
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = next((line for line in lines if not line.endswith("raised:")), lines[0] if lines else "")
    return f"{type(exc).__name__}: {text[:200]}"


def _name(fn: Callable) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def _passes_through(exc: BaseException) -> bool:
    """Control flow of torch's own, not a compiler failure: non-reentrant activation checkpointing stops its
    recomputation early by raising ``_StopRecomputationError`` through the recomputed forward; running that forward
    again eagerly would trip the checkpoint's hooks (``target_frame.early_stop is set``)."""
    import torch.utils.checkpoint as checkpoint

    stop = getattr(checkpoint, "_StopRecomputationError", None)
    return stop is not None and isinstance(exc, stop)


class EagerFallback:
    """Calls ``torch.compile(fn)``; on a compiler error runs ``fn`` eagerly and stays eager from then on.

    An error that the eager call raises too is the function's own: it propagates (with the compiler error as
    its context) and the compiled path is kept for the next call.
    """

    def __init__(self, fn: Callable, compile_kwargs: dict[str, Any], key: str = "trainer.compile"):
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.compile_kwargs = compile_kwargs
        self.key = key  # the config key that asked for it, named in the warning
        self.compiled: Callable | None = None
        self.eager = False  # the cached decision: True once compilation has failed

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.eager:
            return self.fn(*args, **kwargs)
        try:
            if self.compiled is None:
                import torch

                self.compiled = torch.compile(self.fn, **self.compile_kwargs)
            return self.compiled(*args, **kwargs)
        except Exception as exc:
            if _passes_through(exc):
                raise
            result = self.fn(*args, **kwargs)  # re-raises here if the error is fn's, not the compiler's
            self.eager, self.compiled = True, None
            _warn_once(
                _name(self.fn),
                "torch.compile failed for %s (%s); running it eagerly from now on (%s=off hides this)",
                _name(self.fn),
                _describe(exc),
                self.key,
            )
            return result


def maybe_compile(
    fn: Callable,
    backend: Backend,
    setting: str = "auto",
    *,
    compile_kwargs: dict[str, Any] | None = None,
    key: str = "trainer.compile",
) -> Callable:
    """``fn`` itself (eager) or an :class:`EagerFallback` around ``torch.compile(fn, **compile_kwargs)``.

    ``setting`` is ``trainer.compile``: auto = the backend's policy (``Backend.use_compile``: off on NPU and,
    by default, elsewhere too), on, off. ``compile_kwargs`` go to torch.compile (e.g. ``{"dynamic": True}``;
    its ``backend`` key is the dynamo backend, unrelated to the device ``backend`` here). ``key``: the config key
    ``setting`` came from, named in the messages (``actor.compile_layers`` uses this too).
    """
    if setting not in SETTINGS:
        raise ConfigError(f"{key}={setting!r} is not valid; use one of: {', '.join(SETTINGS)}")
    if backend.name == "npu":  # also the emulated NPU: the decision must be the one the hardware gets
        if setting == "on":
            _warn_once(
                f"npu:{key}",
                "%s=on is ignored on npu: graph mode does not work for RL there; running eagerly",
                key,
            )
        return fn
    if not backend.use_compile(setting):
        return fn
    return EagerFallback(fn, dict(compile_kwargs or {}), key)


def resolve_enforce_eager(cfg_value: bool | None, backend: Backend) -> bool:
    """vLLM's ``enforce_eager`` from ``rollout.enforce_eager``: None = auto = graphs on CUDA, eager elsewhere.

    Eager on NPU (graph mode is not usable for RL there) and on CPU, where vLLM's torch.compile adds about a
    minute of engine start for no measured throughput gain on our models.

    An explicit value wins: vllm-ascend's ACL graph capture does work for rollout on recent stacks (verl's
    newer NPU scripts set enforce_eager=False with TASK_QUEUE_ENABLE=1).
    """
    if cfg_value is not None:
        return bool(cfg_value)
    return backend.name != "cuda"


__all__ = ["EagerFallback", "SETTINGS", "maybe_compile", "resolve_enforce_eager"]
