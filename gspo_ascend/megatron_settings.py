"""The settings the megatron engine builds megatron-core's DDP with, in one torch-free place: the engine
(engines/megatron.py) passes them to megatron, and the memory planner (doctor/planner.py) sizes the gradient
buffers from them, so `gspo-ascend plan` needs no torch and cannot drift from the engine (issue #25: it had sized
gradients at the model dtype while the engine keeps them in fp32). Likewise what the installed megatron-core can
split over TP, which the engine enforces and the preflight (doctor/preflight.py) reports."""

from __future__ import annotations

import ast
import importlib.machinery
import importlib.metadata
from pathlib import Path

from .doctor.versions import release

# fp32 gradient buffers: a bf16 reduce of many small per-token terms loses the GSPO update's low bits
GRAD_REDUCE_IN_FP32 = True


def ddp_config(use_distributed_optimizer: bool) -> dict[str, bool]:
    return {
        "grad_reduce_in_fp32": GRAD_REDUCE_IN_FP32,
        "use_distributed_optimizer": use_distributed_optimizer,
        "overlap_grad_reduce": False,
        "average_in_collective": False,
    }


def grad_bytes_per_param(model_dtype_bytes: int) -> int:
    """Bytes of megatron's gradient buffer per parameter (param_and_grad_buffer.py: torch.float when
    ``grad_reduce_in_fp32``, the parameter dtype otherwise)."""
    return 4 if GRAD_REDUCE_IN_FP32 else model_dtype_bytes


def megatron_core_version(path: list[str] | None = None) -> str | None:
    """The version of the ``megatron.core`` an import would load from ``path`` (default ``sys.path``), read from
    its ``package_info.py`` without importing it (the engine must not import ``megatron.core`` before MindSpeed has
    patched it; the doctor runs without it); the megatron-core distribution's metadata where no such file is found.

    Not the metadata first: on NPU the Megatron-LM checkout MindSpeed needs (``megatron.training``) goes first on
    each worker's PYTHONPATH, so ``megatron.core`` comes from the checkout whatever pip installed beside it."""
    found = _package_info(path)
    if found is not None:
        return found
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return None


def _package_info(path: list[str] | None) -> str | None:
    """``megatron/core/package_info.py``'s MAJOR.MINOR.PATCH + PRE_RELEASE where the import system would find
    ``megatron.core`` (PathFinder: a regular ``megatron`` package anywhere on the path wins, else the namespace
    package of every ``megatron`` folder, in path order); None where there is none or it has no such constants."""
    top = importlib.machinery.PathFinder.find_spec("megatron", path)  # finds, never executes
    locations = list(top.submodule_search_locations or []) if top is not None else []
    core = importlib.machinery.PathFinder.find_spec("megatron.core", locations) if locations else None
    if core is None or not core.origin:
        return None
    info = Path(core.origin).parent / "package_info.py"
    if not info.is_file():
        return None
    names = {"MAJOR", "MINOR", "PATCH", "PRE_RELEASE"}
    values = {}
    for node in ast.parse(info.read_text()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and getattr(node.targets[0], "id", None) in names:
            if isinstance(node.value, ast.Constant):
                values[node.targets[0].id] = node.value.value
    if not {"MAJOR", "MINOR", "PATCH"} <= set(values):
        return None
    return f"{values['MAJOR']}.{values['MINOR']}.{values['PATCH']}{values.get('PRE_RELEASE') or ''}"


def replicates_kv_heads(version: str | None) -> bool:
    """Whether this megatron-core runs TP over more ranks than the model has KV heads (TP a multiple of them).
    0.16.0 does: its TransformerConfig takes ``num_query_groups`` that divide TP ("must be a multiple or divisor",
    ``transformer/transformer_config.py:939-946``), and ``SelfAttention`` all-gathers the QKV projection over TP
    and keeps the rank's KV group and query heads (``transformer/attention.py``, "When tp_size > num_kv_heads").
    0.12.1 through 0.15.0 refuse ("must be a multiple of tensor_model_parallel_size", read in each release's
    wheel)."""
    return version is not None and release(version) >= (0, 16, 0)


def kv_heads_layout(kv_heads: int, tp: int, version: str | None) -> str:
    """How megatron-core ``version`` lays ``kv_heads`` over TP ``tp``: "split" (TP divides them), "replicated" (TP a
    multiple of them, a release that replicates), "refused" (TP a multiple, a release that cannot, or an unknown
    one: None), "mismatch" (neither divides the other). The engine refuses the last two; the preflight reports."""
    if kv_heads % tp == 0:
        return "split"
    if tp % kv_heads:
        return "mismatch"
    return "replicated" if replicates_kv_heads(version) else "refused"
