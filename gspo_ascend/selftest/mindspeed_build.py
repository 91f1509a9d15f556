"""``setup/mindspeed_ops``: build MindSpeed's JIT-compiled ops once, in this process, before any rank starts.

MindSpeed 2.2.0 compiles some kernels itself (``mindspeed/op_builder/builder.py``): ``MindSpeedOpBuilder.load()``
calls ``torch.utils.cpp_extension.load(name=OP_NAME, ...)`` on ``mindspeed/ops/csrc`` against torch_npu's headers
and CANN (``ASCEND_HOME_PATH``; ninja and a C++ compiler needed) the first time an op runs. It passes no
``build_directory``, so the build lands in torch's extensions root, ``$TORCH_EXTENSIONS_DIR`` or
``~/.cache/torch_extensions/py<XY>_cpu`` (torch_npu's torch has no CUDA version, hence ``_cpu``), in
``<root>/<OP_NAME>/``, guarded by torch's file baton ``<root>/<OP_NAME>/lock``: the first process builds, the others
poll until the lock file is gone, with no time limit, so a build killed half-way leaves a lock that blocks every
later run. Without this step the first MoE forward of a run is that build, in 8 ranks per node at once (minutes of
compile inside the first step's timing, and one interrupted rank hangs the others).

MindSpeed's adaptor import (``megatron_adaptor.patch_features``) first calls ``delete_lock_file()``: under a
``multiprocessing.Lock()`` made fresh in each process (so it excludes no other process), it lists the *files
directly in* the extensions root whose name ends in ``lock`` and, if there is any, removes the whole root (every
built extension, whoever is building in it). Torch's batons sit one level down (``<root>/<OP_NAME>/lock``) and never
match, so an extension built here survives the ranks' adaptor imports; a stray ``*lock`` file in the root would
not, and this check refuses it.

The builders are those our MindSpeed configuration reaches (``engines/mindspeed_setup.mindspeed_args``; traced in
the 2.2.0 archive, docs/device-shim.md's builder table): fused RoPE (``use_fused_rotary_pos_emb``:
``mindspeed/ops/npu_rotary_position_embedding.py``, ``RotaryPositionEmbeddingOpBuilder``) and, for MoE models,
grouped GEMM (``moe_grouped_gemm`` -> ``MindSpeedGmmExperts`` -> ``core/fusions/grouped_matmul.py`` ->
``ops/gmm.py``'s ``GMMOpBuilder``, group_list_type 0). Flash attention, RMSNorm, SwiGLU and MC2 are torch_npu ops
(nothing to build); ``GMMV2OpBuilder`` (group_list_type 1), ``AlgorithmOpBuilder`` (``reuse_fp32_param``) and the
ring-attention / permute / matmul-add builders belong to features we leave off.
"""

from __future__ import annotations

import importlib
import os
import time
from pathlib import Path
from typing import Any

from .report import CheckFailed, CheckSkipped

FIX = (
    "docs/troubleshooting.md#selftest-setup: source CANN's set_env.sh (ASCEND_HOME_PATH), install ninja and a C++ "
    "compiler; MindSpeed's build log is in the setup log"
)
# (builder class in mindspeed.op_builder, its OP_NAME = the extension's name, the MindSpeed feature that loads it)
BUILDERS = (
    ("RotaryPositionEmbeddingOpBuilder", "npu_rotary_position_embedding", "use_fused_rotary_pos_emb"),
    ("GMMOpBuilder", "grouped_matmul", "moe_grouped_gemm"),
)
_instances: dict[str, Any] = {}


def builder(class_name: str) -> Any:
    """One instance per builder class and process: a builder's constructor defines its op schemas in the process-wide
    ``torch.library.Library("mindspeed", "DEF")`` (``GMMOpBuilder``: ``npu_gmm.Tensor`` / ``.List``), and defining
    them twice raises; so the op checks and the prebuild share these instances."""
    if class_name not in _instances:
        _instances[class_name] = getattr(importlib.import_module("mindspeed.op_builder"), class_name)()
    return _instances[class_name]


def _extensions_root() -> Path:
    """Where torch (and so MindSpeed, which passes no build directory) builds: see the module docstring."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory("", verbose=False))


def _blocking_locks(root: Path) -> list[Path]:
    """Lock files that would make this build wait forever (a baton of a killed build) or make every rank's adaptor
    import delete the root (a ``*lock`` file directly in it)."""
    stray = [p for p in root.iterdir() if p.is_file() and p.name.endswith("lock")] if root.is_dir() else []
    batons = [root / name / "lock" for _, name, _ in BUILDERS if (root / name / "lock").exists()]
    return stray + batons


def _build_all(root: Path) -> list[str]:
    """Load every builder; one 'name seconds (compiled | already built)' per builder."""
    done = []
    for class_name, name, _ in BUILDERS:
        built_before = any((root / name).glob(f"{name}*.so"))
        start = time.perf_counter()
        try:
            builder(class_name).load()
        except Exception as exc:
            raise CheckFailed(f"MindSpeed's {class_name} ({name}) did not build: {type(exc).__name__}: {exc}") from exc
        how = "already built" if built_before else "compiled"
        done.append(f"{name} {time.perf_counter() - start:.1f} s ({how})")
    return done


def _emulated() -> str:
    from ..device.shim import mindspeed_ops

    missing = [name for _, name, _ in BUILDERS if name not in mindspeed_ops.OP_MODULES]
    if missing:
        raise CheckFailed(f"the shim has no stand-in for MindSpeed's {', '.join(missing)} (device/shim/mindspeed_ops)")
    names = ", ".join(name for _, name, _ in BUILDERS)
    return f"emulated NPU: nothing built; the shim's CPU stand-ins serve {names} (mindspeed_ops.OP_MODULES)"


def check_mindspeed_ops(backend) -> str:
    """The check's body: build (or find built) every builder of :data:`BUILDERS`, seconds per builder."""
    from ..engines import mindspeed_setup

    if backend.name != "npu":
        raise CheckSkipped(f"MindSpeed's JIT-built ops are NPU-only (this is {backend.name})")
    if backend.emulated:
        return _emulated()
    if not mindspeed_setup.installed():
        raise CheckSkipped("MindSpeed is not installed: nothing to build (docs/install-npu.md)")
    if not os.environ.get("ASCEND_HOME_PATH"):
        raise CheckFailed("ASCEND_HOME_PATH is not set: MindSpeed's op builders compile against CANN's headers")
    root = _extensions_root()
    if locks := _blocking_locks(root):
        raise CheckFailed(
            f"lock file(s) from an interrupted build: {', '.join(map(str, locks))}; with no build running on "
            "this node, remove them (a build waits on them forever; a *lock file in the root makes MindSpeed's "
            "adaptor delete every built extension)",
            FIX,
        )
    return f"in {root}: " + ", ".join(_build_all(root))
