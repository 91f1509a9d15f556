"""TEST-ONLY fault injection for ``gspo-ascend selftest``: env ``GSPO_SELFTEST_FAULT``. Nothing else reads it.

The selftest's tests use it to show that a broken layer is caught and named, and that the other checks still run:

* ``GSPO_SELFTEST_FAULT=<op>``, ``<op>`` a fused op of the shim's ``torch_npu`` stand-in (``npu_rms_norm``, ...,
  :data:`~.npu_ops.__all__`) or of its MindSpeed op stand-ins (``mindspeed.npu_rotary_position_embedding``,
  ``mindspeed.npu_gmm``, ``mindspeed.npu_gmm_backward``): inside :func:`perturbed_ops`, that one op returns
  floating-point outputs :data:`SCALE` times too large. The selftest's op checks run inside that block, so exactly
  the check(s) of that op fail, with the op's name and the size of the difference. The perturbation is confined to
  the op checks on purpose: a broken kernel on real hardware would also upset the layers above it, but the test is
  about the op check naming it and about the run going on.
* ``GSPO_SELFTEST_FAULT=rollout_weight_update``: the selftest's rollout check sends one tensor of its weight
  update with its old value (a tensor that "did not arrive"), so the rollout check fails
  (``gspo_ascend.selftest.rollout``).
* Several at once, comma-separated (``npu_swiglu,rollout_weight_update``): each fails its own check in one run,
  which is how the selftest's end-to-end test shows two faults caught without paying for two runs.

Only the shim's stand-ins are ever touched: with a real torch_npu (an Atlas host) or without the shim, an op fault
changes nothing, and the selftest says so in one line. The swap is undone when the block ends.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

ENV = "GSPO_SELFTEST_FAULT"
SCALE = 1.1  # 10 %: far above every op tolerance (bf16: 2e-2), so the failure is certain, and still finite
ROLLOUT_WEIGHT_UPDATE = "rollout_weight_update"
_MINDSPEED = {  # fault name -> (builder OP_NAME in mindspeed_ops.OP_MODULES, function)
    "mindspeed.npu_rotary_position_embedding": ("npu_rotary_position_embedding", "npu_rotary_position_embedding"),
    "mindspeed.npu_gmm": ("grouped_matmul", "npu_gmm"),
    "mindspeed.npu_gmm_backward": ("grouped_matmul", "npu_gmm_backward"),
}


def op_faults() -> tuple[str, ...]:
    from . import npu_ops

    return (*npu_ops.__all__, *_MINDSPEED)


def valid_faults() -> tuple[str, ...]:
    return (*op_faults(), ROLLOUT_WEIGHT_UPDATE)


def requested() -> tuple[str, ...]:
    """The faults named by ``GSPO_SELFTEST_FAULT`` (comma-separated; empty when unset); ValueError naming the
    valid ones when one is not."""
    names = tuple(dict.fromkeys(n.strip() for n in os.environ.get(ENV, "").split(",") if n.strip()))
    for name in names:
        if name not in valid_faults():
            raise ValueError(f"env {ENV}={name!r} names no fault; valid: {', '.join(valid_faults())}")
    return names


def _scaled(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value * SCALE if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(_scaled(v) for v in value)
    return value


def _perturb(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def faulty(*args: Any, **kwargs: Any) -> Any:
        return _scaled(fn(*args, **kwargs))

    return faulty


def _target(name: str) -> tuple[Any, str] | None:
    """(namespace, attribute) holding the shim's op ``name``, or None when no shim stand-in serves it here."""
    module = sys.modules.get("torch_npu")
    if module is None or not getattr(module, "_gspo_shim", False):
        return None  # a real torch_npu (or none): never modified
    if name in _MINDSPEED:
        from .mindspeed_ops import OP_MODULES

        builder, function = _MINDSPEED[name]
        return OP_MODULES[builder], function
    return module, name


@contextlib.contextmanager
def perturbed_ops() -> Iterator[tuple[str, ...]]:
    """Inside the block, the ops named by ``GSPO_SELFTEST_FAULT`` (those the shim serves here) are perturbed.

    Yields the names of the perturbed ops (empty when nothing was perturbed).
    """
    swapped = []
    try:
        for name in requested():
            target = _target(name) if name in op_faults() else None
            if target is not None:
                owner, attr = target
                swapped.append((name, owner, attr, getattr(owner, attr)))
                setattr(owner, attr, _perturb(swapped[-1][3]))
        yield tuple(name for name, *_ in swapped)
    finally:
        for _, owner, attr, original in reversed(swapped):
            setattr(owner, attr, original)
