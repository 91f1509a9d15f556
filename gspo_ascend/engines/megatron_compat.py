"""Fixes for megatron-core releases: older ones than CI's, found by running the cluster pins (megatron-core 0.12.1,
``requirements-gpu.txt`` / ``requirements-npu.txt``) on CPU with ``scripts/check_pinned_stack.sh``, and CI's own
0.16 without Transformer Engine, found by the first GPU proof to run the MoE checks on an H100.

Each fix is chosen by probing the installed megatron-core's behaviour, not its version string, so it switches
itself off on a release (or a MindSpeed / Transformer Engine install) that does not need it. Nothing here runs
on import: the megatron engine (and the tests that drive megatron directly) call :func:`patch_megatron_core`
after ``import megatron.core`` and :func:`destroy_model_parallel` instead of megatron's.
How we differ from verl: verl runs megatron-core 0.12 only with Transformer Engine installed and one parallel
layout per process, so it meets none of these problems.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

_PATCHED = "_gspo_empty_fp8_shard_ok"


def patch_megatron_core() -> list[str]:
    """Apply the fixes this megatron-core needs (idempotent); returns the names of those now in place."""
    applied = []
    if _allow_distributed_optimizer_without_te():
        applied.append("fp8-quantize-empty-shard")
    if _route_without_te():
        applied.append("router-gemm-without-te")
    return applied


def _route_without_te() -> bool:
    """megatron-core 0.16 without Transformer Engine: every MoE router forward raises ``NameError: name
    'te_general_gemm' is not defined``.

    ``moe/moe_utils.py`` binds ``te_general_gemm`` only inside its ``try: from ...transformer_engine import``, yet
    ``RouterGatingLinearFunction`` tests ``te_general_gemm is not None`` unconditionally. The fix binds the name
    to None, the value megatron's own TE extension uses for "unavailable", which selects the function's
    ``torch.mm`` path. Probed, not versioned: the function must read the name and the module must lack it (0.12
    has no such function; with TE installed the import binds it). Seen on CUDA without TE (the local layer spec
    docs/engines.md supports) and on CPU; NPU runs megatron-core 0.12.
    """
    try:
        from megatron.core.transformer.moe import moe_utils
    except ImportError:
        return False
    gating = getattr(moe_utils, "RouterGatingLinearFunction", None)
    if gating is None or "te_general_gemm" not in gating.forward.__code__.co_names:
        return False
    if "te_general_gemm" not in vars(moe_utils):
        moe_utils.te_general_gemm = None
    return moe_utils.te_general_gemm is None


def _allow_distributed_optimizer_without_te() -> bool:
    """megatron-core 0.12: without Transformer Engine, every distributed-optimizer step fails.

    ``DistributedOptimizer._copy_main_params_to_model_params`` calls ``fp8_utils.quantize_param_shard`` with the
    (empty) list of FP8 parameters on every step, and 0.12's no-TE fallback raises ``RuntimeError: Invalid
    Transformer Engine version for FP8 distributed optimizer`` even for an empty list (0.16's returns, as do all
    of 0.12's TE implementations). The fix: an empty list returns; anything else still reaches megatron's
    function (and its error, since FP8 does need TE).
    """
    try:
        from megatron.core import fp8_utils
    except ImportError:
        return False
    impl = getattr(fp8_utils, "_quantize_param_shard_impl", None)
    if impl is None:
        return False
    if getattr(impl, _PATCHED, False):
        return True
    try:
        impl([], [], [], None)  # every TE implementation (and megatron-core >= 0.13's fallback) returns here
        return False
    except RuntimeError:
        pass

    @functools.wraps(impl)
    def quantize_param_shard_impl(model_params: list, *args: Any, **kwargs: Any) -> None:
        if len(model_params) == 0:
            return
        impl(model_params, *args, **kwargs)

    setattr(quantize_param_shard_impl, _PATCHED, True)
    fp8_utils._quantize_param_shard_impl = quantize_param_shard_impl  # the module global quantize_param_shard calls
    return True


def decay_every_parameter(get_megatron_optimizer: Any) -> dict[str, Any]:
    """The ``get_megatron_optimizer`` keyword arguments that weight-decay every parameter, norms and biases too.

    megatron-core 0.16 takes ``config_overrides`` ({} = no per-parameter overrides; None would exempt norms and
    biases); 0.12 has no such argument and takes ``no_weight_decay_cond(name, param) -> bool`` instead (None =
    the same exemption).
    """
    params = inspect.signature(get_megatron_optimizer).parameters
    if "config_overrides" in params:
        return {"config_overrides": {}}
    if "no_weight_decay_cond" in params:
        return {"no_weight_decay_cond": _never}
    raise TypeError(
        "this megatron-core's get_megatron_optimizer takes neither config_overrides nor no_weight_decay_cond"
    )


def _never(name: str, param: Any) -> bool:
    return False


def uses_decoupled_grads(optimizer_config: Any) -> bool:
    """Whether this optimizer keeps gradients in ``decoupled_grad`` (what gradient clipping must scale): the flag
    megatron's own clipping passes, ``use_precision_aware_optimizer_no_fp8_or_ds_fp8`` since megatron-core 0.13,
    ``use_precision_aware_optimizer`` in 0.12."""
    flag = getattr(optimizer_config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8", None)
    return bool(optimizer_config.use_precision_aware_optimizer if flag is None else flag)


def destroy_model_parallel() -> None:
    """megatron's ``destroy_model_parallel``, also forgetting the (position-)embedding groups' rank lists.

    megatron-core 0.12 leaves ``_POSITION_EMBEDDING_GLOBAL_RANKS`` and ``_EMBEDDING_GLOBAL_RANKS`` set (0.16
    still leaves the second), and a re-initialisation only overwrites them on ranks inside the new group. A rank
    that was in the old group but is not in the new one (PP 1 -> PP 2 in one process) then "is in" a group that
    does not exist, and finalize_model_grads fails with ``position embedding group is not initialized``.
    """
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    for stale in ("_POSITION_EMBEDDING_GLOBAL_RANKS", "_EMBEDDING_GLOBAL_RANKS"):
        if hasattr(parallel_state, stale):
            setattr(parallel_state, stale, None)
