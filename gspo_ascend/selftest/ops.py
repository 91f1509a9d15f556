"""Layer 1: every fused op the engines call, forward and backward, on this device against the shim's CPU reference.

Each :class:`OpCase` is one call the way our code makes it (the arguments of ``patches/npu_fused_ops.py``,
``patches/npu_attention.py``, ``patches/npu_moe.py``, vllm-ascend's sampler, and MindSpeed's compiled RoPE / grouped
matmul), run on seeded inputs made on the host. The device runs it on a copy of those inputs; the reference is the
shim's CPU implementation of torch-npu 2.7.1's documented semantics (``gspo_ascend.device.shim.npu_ops`` /
``mindspeed_ops``), which CI holds to the real wheels (``tests/conformance/``), on the same inputs. Backward: the
gradients of ``sum(outputs * c)`` for one seeded cotangent ``c``, the same on both sides. One case is ours, not a
vendor op: the fsdp engine's fused LM-head log-probs (engines/fused_logprob.py) on the device against full logits
on the host (its own ``reference``). On CUDA the TND attention case runs the engine's packed path, i.e. one
``varlen_attn`` call in bf16 (engines/packed_attention.py), against the same reference as the NPU's fused op.

What "the device" runs:

* npu (an Atlas host): torch_npu's op on the NPU; MindSpeed's ops from its op builders (compiled against CANN on first
  use), skipped when MindSpeed is not installed.
* npu emulated (``GSPO_DEVICE_SHIM=1``): the shim's ``torch_npu`` stand-in, i.e. the reference itself (the check then
  exercises the plumbing; ``GSPO_SELFTEST_FAULT`` perturbs it, see ``shim/selftest_fault.py``).
* cuda and cpu: what our engines run there instead of the fused op, i.e. transformers' own RMSNorm, rotary,
  SiLU-gated MLP and sdpa attention; ops with no counterpart on that path are skipped with the reason.

Tolerances (max |device - reference| over max |reference|, per output and gradient):

* fp32, 1e-3: the kernels sum in another order than the reference (tiling, flash attention's online softmax), which
  moves fp32 results by ~1e-6 of their scale, and Ascend's cube unit may run fp32 matmuls as HF32 (10-bit mantissa,
  ~5e-4) where ``torch.npu.matmul.allow_hf32`` is on. 1e-3 admits both and still fails every wrong layout, mask,
  scale or gradient, which err by O(1) of the scale.
* bf16, 2e-2: bf16 keeps 8 significant bits (unit roundoff 2^-8 = 3.9e-3). The reference computes in fp32 and rounds
  once; kernels also round intermediates (flash attention casts the probabilities to bf16 before P.V, a backward
  chains two or three rounded products), so a few units of roundoff: 2e-2 is about 5 of them.
* integer outputs (permutation indices): exact.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .report import CheckFailed, CheckSkipped, Result, first_line, run_check

TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 2e-2}
FIX = "docs/troubleshooting.md#selftest-ops: check torch_npu / CANN against `gspo-ascend doctor`; report the op"
_SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16"}
_COMPRESSED = 2048  # npu_fusion_attention's sparse modes 2-4 take this fixed triu mask (patches/npu_attention.py)
_TND_LENGTHS = (5, 11, 8)  # three packed sequences


@dataclass(frozen=True)
class OpCase:
    name: str  # the check is ops/<name>
    op: str  # the op it exercises: a torch_npu attribute, or mindspeed.<function> (GSPO_SELFTEST_FAULT's names)
    dtypes: tuple[torch.dtype, ...]
    make: Callable[[torch.dtype, torch.Generator], dict[str, Any]]  # host inputs
    call: Callable[[Any, dict[str, Any]], tuple[torch.Tensor, ...]]  # (op namespace, inputs) -> outputs
    grads: tuple[str, ...] = ()  # inputs differentiated (backward); () = forward only
    torch_path: Callable[[dict[str, Any]], tuple[torch.Tensor, ...]] | None = None  # cuda / cpu: the engines' path
    no_torch_path: str = ""  # why there is none
    mindspeed_builder: tuple[str, str] | None = None  # (MindSpeed builder class, its OP_NAME) serving the op
    labels: tuple[str, ...] = ()  # names of the outputs in messages (default "output i")
    also: tuple[str, ...] = ()  # further ops the call exercises (GSPO_SELFTEST_FAULT names that fail this check)
    # the reference where it is not the shim's op (op ""): an independent plain-torch computation, on the host
    reference: Callable[[dict[str, Any]], tuple[torch.Tensor, ...]] | None = None

    @property
    def ops(self) -> tuple[str, ...]:
        return (self.op, *self.also) if self.op else self.also


# ----------------------------------------------------------------------------------------------- inputs and calls


def _randn(g: torch.Generator, *shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    return torch.randn(shape, generator=g) * scale + shift  # fp32 on the host; cast by the caller


def _compressed_mask(device: torch.device) -> torch.Tensor:
    return torch.triu(torch.ones(_COMPRESSED, _COMPRESSED, dtype=torch.bool, device=device), diagonal=1)


def _attention_bsnd_inputs(dtype, g):
    b, s, n, nkv, d = 2, 24, 4, 2, 64  # GQA: 2 query heads per KV head, as Qwen3
    return _qkv(g, dtype, (b, s, n, d), (b, s, nkv, d))


def _qkv(g, dtype, q_shape, kv_shape) -> dict[str, torch.Tensor]:
    return {
        "q": _randn(g, *q_shape).to(dtype),
        "k": _randn(g, *kv_shape).to(dtype),
        "v": _randn(g, *kv_shape).to(dtype),
    }


def _attention_bsnd(ns, t):
    q, k, v = t["q"], t["k"], t["v"]
    mask = _compressed_mask(q.device)
    out = ns.npu_fusion_attention(
        q, k, v, q.shape[2], "BSND", scale=q.shape[-1] ** -0.5, keep_prob=1.0, atten_mask=mask, sparse_mode=3
    )
    return (out[0],)


def _sdpa(q, k, v, mask):
    """transformers' sdpa attention function (what the engines call off NPU): BNSD in, [B, S, N, D] out."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = types.SimpleNamespace(is_causal=True, num_key_value_groups=q.shape[1] // k.shape[1])
    return sdpa_attention_forward(module, q, k, v, mask, scaling=q.shape[-1] ** -0.5, is_causal=True)[0]


def _attention_bsnd_torch(t):
    return (_sdpa(*(x.transpose(1, 2) for x in (t["q"], t["k"], t["v"])), None),)


def _attention_tnd_inputs(dtype, g):
    total, n, nkv, d = sum(_TND_LENGTHS), 4, 2, 64
    return _qkv(g, dtype, (total, n, d), (total, nkv, d))


def _ends() -> list[int]:
    return [sum(_TND_LENGTHS[: i + 1]) for i in range(len(_TND_LENGTHS))]


def _attention_tnd(ns, t):
    q, k, v = t["q"], t["k"], t["v"]
    ends, mask = _ends(), _compressed_mask(q.device)
    out = ns.npu_fusion_attention(
        q, k, v, q.shape[1], "TND", scale=q.shape[-1] ** -0.5, keep_prob=1.0,
        actual_seq_qlen=ends, actual_seq_kvlen=ends, atten_mask=mask, sparse_mode=3,
    )  # fmt: skip
    return (out[0],)


def _attention_tnd_torch(t):
    """The packed path off NPU, as the fsdp engine runs it (engines/packed_attention.py): one ``varlen_attn`` call over
    the row on CUDA in bf16, one sdpa per sequence elsewhere; [T, N, D] in and out."""
    from ..engines import packed_attention

    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (t["q"], t["k"], t["v"]))  # [1, N, T, D]
    if q.device.type == "cuda" and q.dtype in packed_attention.HALF and packed_attention.varlen_kernel() is None:
        raise CheckFailed(  # correct, but the slow path: say so rather than pass on the per-sequence loop
            f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn with window_size (2.10+): the "
            "packed path runs one attention per sequence here"
        )
    cu = torch.tensor([0, *_ends()], dtype=torch.int32)
    config = types.SimpleNamespace(_attn_implementation=packed_attention.PREFIX + "sdpa")
    module = types.SimpleNamespace(is_causal=True, num_key_value_groups=q.shape[1] // k.shape[1], config=config)
    out, _ = packed_attention.attention_forward(
        module, q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(_TND_LENGTHS),
        scaling=q.shape[-1] ** -0.5, dropout=0.0,
    )  # fmt: skip
    return (out[0],)


def _log_prob_inputs(dtype, g):
    rows, hidden, vocab = 40, 64, 300
    return {
        "hidden": _randn(g, rows, hidden).to(dtype),
        "weight": _randn(g, vocab, hidden, scale=0.3).to(dtype),
        "labels": torch.randint(0, vocab, (rows,), generator=g),
    }


def _fused_log_probs(ns, t):
    """The fsdp engine's log-probs from the LM head's input (engines/fused_logprob.py), in chunks of 16 rows so the
    40 rows take three; on every device (no vendor op: ``ns`` is unused)."""
    from ..engines.fused_logprob import linear_log_probs

    return (linear_log_probs(t["hidden"], t["weight"], t["labels"], 0.7, chunk=16),)


def _full_logits_log_probs(t):
    """The reference: the full [rows, V] logits in the compute dtype, log_softmax in float32, the label's entry."""
    logits = (t["hidden"] @ t["weight"].t()).float() / 0.7
    return (torch.log_softmax(logits, -1).gather(-1, t["labels"][:, None]).squeeze(-1),)


def _rms_inputs(dtype, g):
    return {"x": _randn(g, 2, 24, 128).to(dtype), "gamma": _randn(g, 128, scale=0.1, shift=1.0).to(dtype)}


def _rms(ns, t):
    return (ns.npu_rms_norm(t["x"], t["gamma"], 1e-6)[0],)


def _rms_torch(t):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    norm = Qwen3RMSNorm(t["x"].shape[-1], eps=1e-6)
    return (torch.func.functional_call(norm, {"weight": t["gamma"]}, (t["x"],)),)


def _rotary_inputs(dtype, g):
    b, n, s, d = 2, 4, 24, 64
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, d, 2).float() / d))  # Qwen3's rope_theta
    freqs = torch.outer(torch.arange(s).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1).expand(b, s, d)  # [B, S, D], as the rotary module returns
    return {"q": _randn(g, b, n, s, d).to(dtype), "cos": emb.cos().to(dtype), "sin": emb.sin().to(dtype)}


def _rotary(ns, t):
    return (ns.npu_rotary_mul(t["q"], t["cos"].unsqueeze(1), t["sin"].unsqueeze(1)),)


def _rotary_torch(t):
    from transformers.models.qwen3 import modeling_qwen3

    from ..patches._core import original_of

    apply = original_of(modeling_qwen3, "apply_rotary_pos_emb")  # transformers' own, even after our NPU patches
    return (apply(t["q"], t["q"], t["cos"], t["sin"], unsqueeze_dim=1)[0],)


def _swiglu_inputs(dtype, g):
    return {"x": _randn(g, 2, 24, 512).to(dtype)}


def _swiglu(ns, t):
    return (ns.npu_swiglu(t["x"], dim=-1),)


def _swiglu_torch(t):
    from transformers.activations import ACT2FN

    gate, up = t["x"].chunk(2, dim=-1)
    return (ACT2FN["silu"](gate) * up,)


def _gmm_inputs(dtype, g):
    counts = torch.tensor([7, 0, 9, 8], dtype=torch.int64)  # rows per expert, one expert without tokens
    m = int(counts.sum())
    return {
        "x": _randn(g, m, 128).to(dtype),
        "w": _randn(g, 4, 64, 128, scale=0.1).to(dtype),  # [E, N, K]: nn.Linear layout, as the experts store it
        "counts": counts,
        "dy": _randn(g, m, 64).to(dtype),
    }


def _gmm(ns, t):
    """patches/npu_moe.py's GroupedLinear: the forward and the backward's dx are both M-split gmm calls."""
    kw = {"group_list": t["counts"], "split_item": 2, "group_type": 0, "group_list_type": 1}
    y = ns.npu_grouped_matmul([t["x"]], [t["w"].transpose(1, 2)], **kw)[0]
    dx = ns.npu_grouped_matmul([t["dy"]], [t["w"]], **kw)[0]
    return y, dx


def _routing(g, tokens: int, experts: int = 4, k: int = 2) -> torch.Tensor:
    return torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])  # [T, k] distinct ids


def _permute_inputs(dtype, g):
    return {"tokens": _randn(g, 16, 64).to(dtype), "indices": _routing(g, 16)}


def _permute(ns, t):
    permuted, inverse = ns.npu_moe_token_permute(t["tokens"], t["indices"])
    return permuted, inverse


def _unpermute_inputs(dtype, g):
    probs = torch.softmax(_randn(g, 16, 2), dim=-1)
    order = torch.randperm(32, generator=g).to(torch.int32)  # permuted row of each (token, slot)
    return {"rows": _randn(g, 32, 64).to(dtype), "order": order, "probs": probs.to(dtype)}


def _unpermute(ns, t):
    return (ns.npu_moe_token_unpermute(t["rows"], t["order"], probs=t["probs"]),)


def _top_k_top_p_inputs(dtype, g):
    """Distinct logits (multiples of 1/8, exact in fp32) and a top-p cut midway between two cumulative sums, so
    no rounding can move an entry across it."""
    vocab = 512
    logits = torch.stack([(torch.randperm(vocab, generator=g) - vocab // 2).float() / 8 for _ in range(4)])
    k = torch.tensor([1, 3, 50, vocab], dtype=torch.int32)
    p = []
    for row, kk in zip(logits.double(), k.tolist(), strict=True):
        kept = row.sort().values.clone()
        kept[: vocab - kk] = float("-inf")
        cumulative = torch.softmax(kept, -1).cumsum(-1)
        m = min(kk, 3)  # keep the m largest: cut between the cumulative sums just below and at them
        p.append(1 - float(cumulative[vocab - m - 1] + cumulative[vocab - m]) / 2)
    return {"logits": logits.to(dtype), "p": torch.tensor(p).to(dtype), "k": k}


def _top_k_top_p(ns, t):
    return (ns.npu_top_k_top_p(t["logits"], t["p"], t["k"]),)


def _ms_rope_inputs(dtype, g):
    s, b, n, d = 24, 2, 4, 64  # MindSpeed's SBND
    angles = _randn(g, s, 1, 1, d // 2)
    angles = torch.cat((angles, angles), dim=-1)
    return {"x": _randn(g, s, b, n, d).to(dtype), "cos": angles.cos().to(dtype), "sin": angles.sin().to(dtype)}


def _ms_rope(ns, t):
    return (ns.npu_rotary_position_embedding(t["x"], t["cos"], t["sin"], 0),)


def _ms_gmm_inputs(dtype, g):
    ends = torch.tensor([7, 7, 16, 24], dtype=torch.int64)  # cumulative (group_list_type 0), one empty group
    x, w, dy = _randn(g, 24, 128).to(dtype), _randn(g, 4, 128, 64, scale=0.1).to(dtype), _randn(g, 24, 64).to(dtype)
    return {"x": x, "w": w, "ends": ends, "dy": dy}


def _ms_gmm(ns, t):
    """MindSpeed's GMMFunction (its grouped-GEMM experts): forward npu_gmm, backward npu_gmm_backward."""
    y = ns.npu_gmm([t["x"]], [t["w"]], [], t["ends"], 0, 0)[0]
    dx, dw, _ = ns.npu_gmm_backward([t["dy"]], [t["x"]], [t["w"]], t["ends"], 0)
    return y, dx[0], dw[0]


BOTH = (torch.float32, torch.bfloat16)
_NO_MOE = "off NPU the MoE experts run transformers' / megatron's own expert code, no fused op"
CASES = (
    OpCase("npu_fusion_attention[BSND]", "npu_fusion_attention", BOTH, _attention_bsnd_inputs, _attention_bsnd,
           ("q", "k", "v"), _attention_bsnd_torch),
    OpCase("npu_fusion_attention[TND]", "npu_fusion_attention", BOTH, _attention_tnd_inputs, _attention_tnd,
           ("q", "k", "v"), _attention_tnd_torch),
    OpCase("npu_rms_norm", "npu_rms_norm", BOTH, _rms_inputs, _rms, ("x", "gamma"), _rms_torch),
    OpCase("npu_rotary_mul", "npu_rotary_mul", BOTH, _rotary_inputs, _rotary, ("q",), _rotary_torch),
    OpCase("npu_swiglu", "npu_swiglu", BOTH, _swiglu_inputs, _swiglu, ("x",), _swiglu_torch),
    OpCase("npu_grouped_matmul", "npu_grouped_matmul", BOTH, _gmm_inputs, _gmm, no_torch_path=_NO_MOE,
           labels=("forward y", "the backward's dx")),
    # torch_npu 2.7.1's permute / unpermute take bfloat16 only (op docs); fp32 MoE uses a plain-torch sort
    OpCase("npu_moe_token_permute", "npu_moe_token_permute", (torch.bfloat16,), _permute_inputs, _permute,
           ("tokens",), no_torch_path=_NO_MOE),
    OpCase("npu_moe_token_unpermute", "npu_moe_token_unpermute", (torch.bfloat16,), _unpermute_inputs, _unpermute,
           ("rows", "probs"), no_torch_path=_NO_MOE),
    # vllm-ascend's sampler on 910B; vLLM samples from fp32 logits
    OpCase("npu_top_k_top_p", "npu_top_k_top_p", (torch.float32,), _top_k_top_p_inputs, _top_k_top_p,
           no_torch_path="vLLM's own sampler kernels run the top-k / top-p step off NPU (not an engine of ours)"),
    OpCase("fused_log_probs", "", BOTH, _log_prob_inputs, _fused_log_probs, ("hidden", "weight"),
           lambda t: _fused_log_probs(None, t), reference=_full_logits_log_probs),
    OpCase("mindspeed.npu_rotary_position_embedding", "mindspeed.npu_rotary_position_embedding", BOTH,
           _ms_rope_inputs, _ms_rope, ("x",), no_torch_path="MindSpeed runs on NPU only",
           mindspeed_builder=("RotaryPositionEmbeddingOpBuilder", "npu_rotary_position_embedding")),
    OpCase("mindspeed.npu_gmm", "mindspeed.npu_gmm", BOTH, _ms_gmm_inputs, _ms_gmm,
           no_torch_path="MindSpeed runs on NPU only", mindspeed_builder=("GMMOpBuilder", "grouped_matmul"),
           labels=("npu_gmm y", "npu_gmm_backward dx", "npu_gmm_backward dw"), also=("mindspeed.npu_gmm_backward",)),
)  # fmt: skip


# ----------------------------------------------------------------------------------------------- running a case


def _mindspeed_module(case: OpCase, backend) -> Any:
    """The module serving a MindSpeed op on this device: the shim's stand-in when emulated, else MindSpeed's op
    builder (compiles against CANN the first time, as in training)."""
    from ..device.shim import mindspeed_ops

    builder_class, op_name = case.mindspeed_builder
    if backend.emulated:
        return mindspeed_ops.OP_MODULES[op_name]
    from ..engines import mindspeed_setup

    if not mindspeed_setup.installed():
        raise CheckSkipped(
            "MindSpeed is not installed: the megatron engine cannot run on this NPU (docs/install-npu.md)"
        )
    from .mindspeed_build import builder

    return builder(builder_class).load()  # the instance setup/mindspeed_ops built (one per class and process)


def device_call(case: OpCase, backend) -> Callable[[dict[str, Any]], tuple]:
    """What this device runs for ``case`` (see the module docstring); CheckSkipped where nothing does."""
    if backend.name != "npu":
        if case.torch_path is None:
            raise CheckSkipped(f"not on the {backend.name} path: {case.no_torch_path}")
        return case.torch_path
    if case.mindspeed_builder is not None:
        module = _mindspeed_module(case, backend)
        return lambda t: case.call(module, t)
    from ..device.detect import import_torch_npu

    npu, reason = import_torch_npu()
    if npu is None:
        raise CheckFailed(f"torch_npu is not usable: {reason}")
    return lambda t: case.call(npu, t)


def reference_call(case: OpCase) -> Callable[[dict[str, Any]], tuple]:
    from ..device.shim import mindspeed_ops, npu_ops

    if case.reference is not None:
        return case.reference
    module = mindspeed_ops if case.mindspeed_builder is not None else npu_ops
    return lambda t: case.call(module, t)


def _evaluate(fn, host: dict[str, Any], case: OpCase, device) -> list[tuple[str, torch.Tensor]]:
    """Outputs (and gradients of sum(outputs * c) for a seeded cotangent c) of ``fn`` on copies of ``host`` made on
    ``device``, as labelled host tensors."""
    grads = case.grads
    inputs = {
        name: value.detach().to(device).requires_grad_(name in grads) if isinstance(value, torch.Tensor) else value
        for name, value in host.items()
    }
    with torch.enable_grad():
        outputs = fn(inputs)
        labels = case.labels or tuple(f"output {i}" for i in range(len(outputs)))
        found = list(zip(labels, outputs, strict=True))
        if grads:
            floats = [out for out in outputs if out.is_floating_point()]
            g = torch.Generator().manual_seed(1)
            cotangents = [torch.randn(out.shape, generator=g).to(device=out.device, dtype=out.dtype) for out in floats]
            values = torch.autograd.grad(floats, [inputs[n] for n in grads], cotangents)
            found += [(f"backward: gradient of {n}", v) for n, v in zip(grads, values, strict=True)]
    return [(label, t.detach().cpu()) for label, t in found]


def _error(label: str, ours: torch.Tensor, ref: torch.Tensor, where: str, tol: float) -> float:
    """max |ours - ref| / max |ref| (0 for exact integer agreement); CheckFailed naming ``where`` beyond ``tol``."""
    if ours.shape != ref.shape or ours.dtype != ref.dtype:
        raise CheckFailed(f"{where} {label}: device gives {tuple(ours.shape)} {ours.dtype}, "
                          f"the reference {tuple(ref.shape)} {ref.dtype}")  # fmt: skip
    if not ref.is_floating_point():
        wrong = int((ours != ref).sum())
        if wrong:
            raise CheckFailed(f"{where} {label}: {wrong} of {ref.numel()} entries differ from the reference")
        return 0.0
    ours64, ref64 = ours.double(), ref.double()
    infinite = torch.isinf(ref64)
    if not torch.equal(infinite, torch.isinf(ours64)) or bool(torch.isnan(ours64).any()):
        raise CheckFailed(
            f"{where} {label}: non-finite entries (NaN / inf) where the reference has none, or vice versa"
        )
    finite = ~infinite
    diff = float((ours64 - ref64)[finite].abs().max()) if bool(finite.any()) else 0.0
    scale = float(ref64[finite].abs().max()) if bool(finite.any()) else 0.0
    relative = diff / scale if scale > 0 else diff
    if relative > tol:
        raise CheckFailed(f"{where} {label}: max |device - reference| = {diff:.2e}, {relative:.1e} of its scale "
                          f"{scale:.2e} (tolerance {tol:g})")  # fmt: skip
    return relative


def compare_case(case: OpCase, backend) -> str:
    """The check body for ``case``: the pass detail, or CheckFailed / CheckSkipped."""
    on_device = device_call(case, backend)
    device = backend.device(0) if backend.torch_device_type != "cpu" else torch.device("cpu")
    parts = []
    for dtype in case.dtypes:
        if dtype == torch.bfloat16 and not backend.is_bf16_supported():
            parts.append("bf16 skipped (not supported here)")
            continue
        host = case.make(dtype, torch.Generator().manual_seed(0))
        where = f"{case.op or case.name} {_SHORT[dtype]}"
        try:
            ours = _evaluate(on_device, host, case, device)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise CheckFailed(f"{where}: the device call raised {first_line(exc)}") from None
        reference = _evaluate(reference_call(case), host, case, torch.device("cpu"))
        worst = {"fwd": 0.0, "bwd": 0.0}
        for (label, mine), (_, ref) in zip(ours, reference, strict=True):
            phase = "bwd" if label.startswith("backward") else "fwd"
            worst[phase] = max(worst[phase], _error(label, mine, ref, where, TOLERANCE[dtype]))
        parts.append(f"{_SHORT[dtype]} fwd {_fmt(worst['fwd'])}" + (f" bwd {_fmt(worst['bwd'])}" if case.grads else ""))
    return "; ".join(parts) + " (max |device - reference| / scale; tolerance fp32 1e-3, bf16 2e-2)"


def _fmt(x: float) -> str:
    return "0" if x == 0 else f"{x:.0e}"


def check_ops(backend, log=None) -> list[Result]:
    """One check per op case, inside the test-only fault block (``shim/selftest_fault.py``)."""
    from ..device.shim import selftest_fault

    with selftest_fault.perturbed_ops():
        return [
            run_check(f"ops/{case.name}", lambda case=case: compare_case(case, backend), FIX, log) for case in CASES
        ]
