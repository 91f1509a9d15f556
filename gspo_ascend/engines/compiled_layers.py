"""``actor.compile_layers``: the fsdp engine's RMSNorms and MLPs through ``torch.compile``, one compiled graph per kind
of module (issue #43, "unfused layer code").

What is compiled: every ``*RMSNorm`` module (the decoder layers' two, Qwen3's per-head q / k norms, the final norm)
and every gated MLP (``gate_proj`` / ``up_proj`` / ``down_proj`` + ``act_fn``: Qwen3's SwiGLU, the dense layers and
shared experts of the MoE models), each instance's ``forward`` wrapped in :class:`gspo_ascend.compile.EagerFallback`
with ``dynamic=True``. Inductor fuses the norm's fp32 round trip (cast, square, mean, rsqrt, scale, cast) and the
SiLU * up product into one kernel each, forward and backward. Dynamic shapes and torch's inlining of module calls
give six graphs for a whole dense Qwen3 (hidden-size norm, head-dim norm, MLP; with and without grad), whatever the
layer count or the packed row's length: no recompilation per step, which RL's fresh lengths would otherwise cause.

Only the policy is compiled: the reference policy (``algorithm.kl_coef > 0``) runs one no-grad forward a step, and
its frozen parameters would be more variants of the same code objects (see ``compile_layers``). What is not:
attention (our packed attention is a loop over sequences or a varlen call: engines/packed_attention.py)
and the rotary embedding, a module-level function of transformers' modeling file (compiling it would change every
model of the process, the reference policy's and the hf rollout engine's too; it was worth 5% of the step on CPU
bf16, below). MoE routers and expert loops stay eager (routing replay hooks them: engines/routing.py).

How this differs from verl, which compiles nothing in its FSDP actor by default and offers Liger's Triton kernels
(``use_liger``) on CUDA: this is torch's own compiler, so it runs wherever inductor does (CUDA, CPU), and never on
NPU (graph mode is not usable for RL there: gspo_ascend/compile.py; ``on`` is said once and ignored).

Measured (benchmarks/README.md, "Compiled norms and SwiGLU"; CPU, the 22M ``small`` model, 32 sequences of fresh
lengths a step, 4 steps, off and on in turns): bfloat16 1.15x tokens/s (median of four pairs, 0.97-1.22x), float32
0.95x (a float32 update on two cores is bound by its matmuls). CUDA is not measured yet (the GPU proof's
``throughput_fsdp_compiled`` step), so ``auto`` is off on every backend until a measurement says where it pays.
"""

from __future__ import annotations

from typing import Any

import torch

from gspo_ascend.compile import EagerFallback, maybe_compile
from gspo_ascend.device import Backend

_MLP_PARTS = ("gate_proj", "up_proj", "down_proj", "act_fn")
# dynamo's per-code-object variant limit while layers are compiled (see compile_layers): 6 for a dense Qwen3, up to
# ~10 with checkpointing and one-row dummy passes; still a bound against a recompilation loop
RECOMPILE_LIMIT = 16


def compilable(module: torch.nn.Module) -> bool:
    """An RMSNorm or a gated MLP (see the module docstring): elementwise work around at most three matmuls."""
    name = type(module).__name__
    return name.endswith("RMSNorm") or (name.endswith("MLP") and all(hasattr(module, p) for p in _MLP_PARTS))


def _on_rows(compiled: EagerFallback) -> Any:
    """The compiled forward called on a 2-D ``[rows, features]`` view: the packed row ``[1, T, H]`` and the q / k
    norms' ``[1, T, heads, head_dim]`` are one shape family then, and no head count (1 KV head: dynamo specialises
    sizes 0 and 1) or batch layout becomes a guard. Every module compiled here is row-wise."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        out = compiled(x.reshape(-1, x.shape[-1]))
        return out.reshape(*x.shape[:-1], out.shape[-1])  # not view(..., -1): a 0-row input has no -1 to infer

    forward.fallback = compiled  # type: ignore[attr-defined]
    return forward


def compile_layers(model: torch.nn.Module, backend: Backend, setting: str) -> list[EagerFallback]:
    """Wrap the ``forward`` of every compilable module of ``model`` per ``actor.compile_layers``; returns the
    wrappers (none where the setting or the backend says eager). Before ``fully_shard``: FSDP2's units are the
    decoder layers, whose hooks gather the parameters these forwards then read.

    Graphs: dynamo keeps one cache per code object (``Qwen3RMSNorm.forward`` for every norm), guarded on the
    parameters' shapes and on grad mode, and past ``recompile_limit`` (8) variants of one code object it runs new
    ones eagerly with a warning of its own. A dense Qwen3 needs 6: two norm widths (hidden, head_dim) and one MLP,
    each with and without grad (the log-prob passes run under no_grad); lengths never add one, but a one-row input
    (the dummy pass that evens out micro-batch counts across ranks: dynamo specialises sizes 0 and 1) and the
    recomputation of activation checkpointing each may (tests/unit/test_fsdp_engine.py). So the limit is raised to
    ``RECOMPILE_LIMIT`` while this is on: the variants are bounded by the model's module kinds, not by the data."""
    # auto is off here by this key's own measurement (module docstring), not Backend.compile_by_default, which is
    # trainer.compile's policy
    setting = "off" if setting == "auto" else setting
    wrappers: list[EagerFallback] = []
    for module in model.modules():
        if not compilable(module):
            continue
        compiled: Any = maybe_compile(
            module.forward, backend, setting, compile_kwargs={"dynamic": True}, key="actor.compile_layers"
        )
        if not isinstance(compiled, EagerFallback):  # eager: the same answer for every module
            break
        module.forward = _on_rows(compiled)  # the instance's attribute: nn.Module.__call__ finds it first
        wrappers.append(compiled)
    if wrappers:
        import torch._dynamo.config as dynamo

        for name in ("recompile_limit", "cache_size_limit"):  # the name torch 2.7+ reads, and its older alias
            if hasattr(dynamo, name):
                setattr(dynamo, name, max(getattr(dynamo, name), RECOMPILE_LIMIT))
    return wrappers


def compiled_count(wrappers: list[EagerFallback]) -> int:
    """How many wrapped forwards run compiled now (a compiler failure turns a wrapper eager, said once)."""
    return sum(1 for w in wrappers if w.compiled is not None and not w.eager)


__all__ = ["compilable", "compile_layers", "compiled_count"]
