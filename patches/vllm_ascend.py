"""Runtime patches for vllm-ascend, applied inside vLLM's worker processes. Written for 0.11 (the previous line's
pin); on the pinned 0.23.0, 1. is still needed (its runner still builds a bare ``AscendSampler()``) and 2. is not
reached (vLLM 0.23 has the layerwise reload module).

Both are applied by an explicit call from the ``vllm`` rollout engine's worker extension
(``gspo_ascend.engines.vllm_worker.WeightSyncExtension``), never at import. Each acts on live objects of one
worker (its sampler, its model), is gated on the fact it repairs (not on a version string), is idempotent, can be
undone (:func:`restore_logprobs_mode`, :func:`remove_moe_weight_loaders`) and reports a :class:`PatchEntry`.

1. :func:`honour_logprobs_mode` (engine log-probs). vllm-ascend 0.11 builds its sampler without the engine's
   ``logprobs_mode``: ``worker/model_runner_v1.py`` (``NPUModelRunner.__init__``) calls ``AscendSampler()`` (or
   ``Sampler()`` with ``VLLM_ASCEND_ENABLE_TOPK_TOPP_OPTIMIZATION=0``), and ``sample/sampler.py`` builds
   ``AscendTopKTopPSampler()`` without it too ("TODO: support logprobs_mode in vllm-ascend"). vLLM 0.11's own
   runner passes ``Sampler(logprobs_mode=self.model_config.logprobs_mode)`` (``v1/worker/gpu_model_runner.py``).
   So on Ascend the engine returns ``raw_logprobs``: ``log_softmax`` of the logits *before* temperature and
   top-k / top-p, whatever the engine was built with. Fix: set ``logprobs_mode`` on the sampler and on its
   top-k/top-p sampler, the two places vLLM 0.11 reads it per call (``Sampler.forward`` / ``Sampler.sample`` in
   ``v1/sample/sampler.py``; ``forward_native`` in ``v1/sample/ops/topk_topp_sampler.py``, which
   ``AscendTopKTopPSampler`` overrides and reads the same attribute). Gate: the engine's mode differs from the
   sampler's and the top-k/top-p sampler runs its ``forward_native`` (on CUDA, vLLM picks FlashInfer at
   construction when the mode is raw, which cannot return processed log-probs: skipped there, with the reason).
   Remove when vllm-ascend passes ``logprobs_mode`` to its sampler (the conformance test
   ``tests/conformance/test_vllm_ascend_rollout.py`` reads the pinned wheel and says when that changes).

2. :func:`reattach_moe_weight_loaders` (MoE weight sync). ``AscendUnquantizedFusedMoEMethod
   .process_weights_after_loading`` (``ops/common_fused_moe.py``) replaces ``w13_weight`` / ``w2_weight`` by new
   Parameters holding ``data.transpose(1, 2).contiguous()``, i.e. ``[E, H, 2I]`` and ``[E, I, H]`` instead of
   vLLM's ``[E, 2I, H]`` / ``[E, H, I]``, without the ``weight_loader`` attribute, and sets its ``transpose``
   flag to False so a second call does not transpose again. vLLM 0.11 has no layerwise reload module, so weight
   updates are plain ``model.load_weights``, and ``Qwen3MoeModel.load_weights`` (``models/qwen3_moe.py``) reads
   ``param.weight_loader`` of the expert parameters: AttributeError on the first update. Re-attaching vLLM's
   ``FusedMoE.weight_loader`` alone would be wrong: it narrows and copies checkpoint-layout ``[I, H]`` shards into
   a ``[H, 2I]`` expert slice. So the re-attached loader hands vLLM's loader a transposed *view* of the
   parameter (``param.data.transpose(1, 2)``, which has the checkpoint layout): vLLM's own sharding and
   w1 / w3 placement write through the view into vllm-ascend's layout, in place. The parameters keep their
   storage and addresses (ACL graphs captured on them stay valid) and no second copy of the experts is made,
   unlike restoring the checkpoint layout, loading and re-running ``process_weights_after_loading`` (what later
   vllm-ascend releases do, vllm-ascend PR #4626 / #7498). Nothing else in that post-processing needs re-running:
   ``_maybe_pad_weight`` pads on ROCm only (vLLM ``fused_moe/layer.py``), and NZ casting is off for
   bf16 / fp16 / fp32 weights unless speculative (eagle) decoding is on (``utils.is_enable_nz``), which the
   rollout never enables (it also exports ``VLLM_ASCEND_ENABLE_NZ=0``). Gate: a FusedMoE layer's expert
   parameter has no ``weight_loader``; its layout is read from the method's ``transpose`` flag and checked against
   the layer's ``hidden_size`` / ``intermediate_size_per_partition``; any other state raises instead of loading
   into an unknown layout. Remove when the pinned vllm-ascend reloads MoE weights itself (0.12+ moved the
   transpose to ``wake_up``).
"""

from __future__ import annotations

from typing import Any

from ._core import ALREADY, APPLIED, SKIPPED, PatchEntry

_ORIGINAL_MODE = "_gspo_original_logprobs_mode"  # set on a sampler we changed: what it had before
_REATTACHED = "_gspo_reattached"  # marks a weight_loader this module attached


# ----------------------------------------------------------------------------------------------- log-probs


def honour_logprobs_mode(model_runner: Any, mode: str) -> PatchEntry:
    """Make ``model_runner.sampler`` return ``mode`` log-probs (the engine's ``logprobs_mode``); see the header."""
    target = f"{type(model_runner).__name__}.sampler"
    sampler = getattr(model_runner, "sampler", None)
    topk = getattr(sampler, "topk_topp_sampler", None)
    if not (hasattr(sampler, "logprobs_mode") and hasattr(topk, "logprobs_mode")):
        return PatchEntry("logprobs_mode", target, SKIPPED, "the sampler has no logprobs_mode attribute to set")
    if sampler.logprobs_mode == mode and topk.logprobs_mode == mode:
        if hasattr(sampler, _ORIGINAL_MODE):
            return PatchEntry("logprobs_mode", target, ALREADY, f"returns {mode}")
        return PatchEntry("logprobs_mode", target, SKIPPED, f"not needed: the sampler already returns {mode}")
    if getattr(topk, "forward", None) != getattr(topk, "forward_native", None):
        return PatchEntry(
            "logprobs_mode",
            target,
            SKIPPED,
            f"the top-k/top-p sampler does not run forward_native, so it cannot return {mode}; "
            f"log-probs stay {sampler.logprobs_mode}",
        )
    for holder in (sampler, topk):
        setattr(holder, _ORIGINAL_MODE, holder.logprobs_mode)
        holder.logprobs_mode = mode
    return PatchEntry(
        "logprobs_mode",
        target,
        APPLIED,
        f"{getattr(topk, _ORIGINAL_MODE)} -> {mode} (the runner built its sampler without the mode)",
    )


def restore_logprobs_mode(model_runner: Any) -> bool:
    """Undo :func:`honour_logprobs_mode`; returns whether anything was restored."""
    sampler = getattr(model_runner, "sampler", None)
    restored = False
    for holder in (sampler, getattr(sampler, "topk_topp_sampler", None)):
        if holder is not None and hasattr(holder, _ORIGINAL_MODE):
            holder.logprobs_mode = getattr(holder, _ORIGINAL_MODE)
            delattr(holder, _ORIGINAL_MODE)
            restored = True
    return restored


def effective_logprobs_mode(model_runner: Any) -> str | None:
    """The log-probs the runner's sampler returns now (None when it has no such attribute)."""
    sampler = getattr(model_runner, "sampler", None)
    modes = {
        getattr(sampler, "logprobs_mode", None),
        getattr(getattr(sampler, "topk_topp_sampler", None), "logprobs_mode", None),
    }
    return modes.pop() if len(modes) == 1 else "mixed: " + ", ".join(sorted(map(str, modes)))


# ----------------------------------------------------------------------------------------------- MoE loaders


def _transposed_view_loader(layer_loader: Any) -> Any:
    """A ``weight_loader`` for a ``[E, X, Y]`` parameter stored as ``[E, Y, X]``: vLLM's loader writes the
    checkpoint-layout shard into ``param.data.transpose(1, 2)``, a view of the same storage."""

    def load(param: Any, loaded_weight: Any, *args: Any, **kwargs: Any) -> Any:
        return layer_loader(param.data.transpose(1, 2), loaded_weight, *args, **kwargs)

    setattr(load, _REATTACHED, "transposed")
    return load


def _plain_loader(layer_loader: Any) -> Any:
    def load(param: Any, loaded_weight: Any, *args: Any, **kwargs: Any) -> Any:
        return layer_loader(param, loaded_weight, *args, **kwargs)

    setattr(load, _REATTACHED, "plain")
    return load


def _expert_layout(name: str, layer: Any) -> str:
    """ "transposed" (vllm-ascend's ``[E, H, 2I]`` / ``[E, I, H]``) or "checkpoint" (vLLM's ``[E, 2I, H]`` /
    ``[E, H, I]``) for a FusedMoE layer whose expert parameters lost their loader; raises when unsure."""
    flag = getattr(getattr(layer, "quant_method", None), "transpose", None)
    h, i = getattr(layer, "hidden_size", None), getattr(layer, "intermediate_size_per_partition", None)
    w13, w2 = tuple(layer.w13_weight.shape[1:]), tuple(layer.w2_weight.shape[1:])
    if flag is False and (h is None or (w13, w2) == ((h, 2 * i), (i, h))):
        return "transposed"  # process_weights_after_loading ran its transposing branch (transpose -> False)
    if flag is True and (h is None or (w13, w2) == ((2 * i, h), (h, i))):
        return "checkpoint"
    raise RuntimeError(
        f"vllm rollout: MoE layer '{name}' ({type(getattr(layer, 'quant_method', None)).__name__}) lost its expert "
        f"weight loaders and its layout is unknown (transpose flag {flag!r}, w13 {w13}, w2 {w2}, hidden {h}, "
        f"intermediate {i}); refusing to load weights into it"
    )


def reattach_moe_weight_loaders(model: Any) -> PatchEntry:
    """Give every FusedMoE expert parameter that lost its ``weight_loader`` one that writes vllm-ascend's layout
    (module header, item 2). Call before each ``model.load_weights`` of a weight update; cheap when done."""
    applied, already = [], 0
    for name, layer in model.named_modules():
        if not (hasattr(layer, "w13_weight") and hasattr(layer, "w2_weight") and hasattr(layer, "weight_loader")):
            continue
        params = [layer.w13_weight, layer.w2_weight]
        if all(getattr(getattr(p, "weight_loader", None), _REATTACHED, None) for p in params):
            already += 1
            continue
        if all(hasattr(p, "weight_loader") for p in params):
            continue  # vLLM's own loaders: nothing to repair
        layout = _expert_layout(name, layer)
        wrap = _transposed_view_loader if layout == "transposed" else _plain_loader
        for param in params:
            if not hasattr(param, "weight_loader"):
                param.weight_loader = wrap(layer.weight_loader)
        applied.append(f"{name} ({layout})")
    target = "FusedMoE w13_weight / w2_weight .weight_loader"
    if applied:
        shown = ", ".join(applied[:2]) + (f" and {len(applied) - 2} more" if len(applied) > 2 else "")
        return PatchEntry("moe_weight_loader", target, APPLIED, f"{len(applied)} MoE layer(s): {shown}")
    if already:
        return PatchEntry("moe_weight_loader", target, ALREADY, f"{already} MoE layer(s)")
    return PatchEntry("moe_weight_loader", target, SKIPPED, "no MoE layer lost its weight loaders")


def remove_moe_weight_loaders(model: Any) -> int:
    """Undo :func:`reattach_moe_weight_loaders`; returns the number of loaders removed."""
    removed = 0
    for param in model.parameters():
        if getattr(getattr(param, "weight_loader", None), _REATTACHED, None):
            del param.weight_loader
            removed += 1
    return removed


__all__ = [
    "effective_logprobs_mode",
    "honour_logprobs_mode",
    "reattach_moe_weight_loaders",
    "remove_moe_weight_loaders",
    "restore_logprobs_mode",
]
