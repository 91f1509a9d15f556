"""Where Megatron-LM's ``megatron.training`` comes from, found without importing it.

MindSpeed 26.1.0 imports ``megatron.training`` while its adaptor patches megatron (docs/install-npu.md); PyPI's
megatron-core holds ``megatron/core`` only, and an editable install of the Megatron-LM checkout maps only
``megatron.core`` too, so the checkout's root must be on every worker's path. A one-off ``export PYTHONPATH`` in
the install shell does not reach Ray workers started from another shell (audit 3 finding 1): the driver forwards
the root it finds to every actor (workers.actor_env), and doctor says per node whether it is importable.
"""

from __future__ import annotations

from pathlib import Path

MINDSPEED_NEEDS_IT = ("26.1.0", "0.16.0")  # the MindSpeed branches (doctor's names) that import megatron.training


def training_root() -> str | None:
    """The directory holding ``megatron/training`` on this Python's path (the Megatron-LM checkout), or None."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("megatron.training")
    except (ImportError, ValueError):  # no megatron at all, or a stand-in without a spec (the CPU shim's)
        return None
    if spec is None or not spec.origin or Path(spec.origin).name != "__init__.py":
        return None
    return str(Path(spec.origin).parents[2])
