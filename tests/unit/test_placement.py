"""Placement checked (issue 25, item 4): tensor-like groups lie within one node whatever bundle order Ray's PACK
gives (gspo_ascend/placement.py, WorkerGroup.__init__). The group arithmetic is held to megatron-core's own
RankGenerator and to the rollout engine's rollout_tp_groups; the 2-node Ray run is tests/e2e/test_multinode.py."""

from __future__ import annotations

import inspect
import itertools
import sys
import types
from types import SimpleNamespace

import pytest

from gspo_ascend.config import load_config
from gspo_ascend.errors import UserError
from gspo_ascend.placement import (
    ORDER,
    check_node_local,
    find_split,
    node_local_groups,
    nominal_split,
    orthogonal_groups,
    pool_bundle,
    rank_bundles,
)
from tests.conftest import REPO
from tests.unit.fake_ray import ray_modules

A, B = "a" * 56, "b" * 56
NODES = {A: (A, "10.0.0.1"), B: (B, "10.0.0.2")}
LAYOUT_30B = REPO / "configs/qwen3_30b_a3b_gspo.yaml"


def _cfg(**overrides):
    return load_config(overrides=[f"{k}={v}" for k, v in overrides.items()])


def _megatron(tp=1, pp=1, cp=1, ep=1, etp=1, nnodes=2, per_node=8):
    return _cfg(
        **{
            "actor.engine": "megatron",
            "actor.tensor_parallel_size": tp,
            "actor.pipeline_parallel_size": pp,
            "actor.context_parallel_size": cp,
            "actor.expert_parallel_size": ep,
            "actor.expert_tensor_parallel_size": etp,
            "trainer.nnodes": nnodes,
            "trainer.devices_per_node": per_node,
        }
    )


# ------------------------------------------------------------------------------------ held to megatron-core


def test_orthogonal_groups_are_megatron_cores():
    ps = pytest.importorskip("megatron.core.parallel_state")
    for sizes in ([2, 1, 4, 2, 2], [4, 2, 1, 1, 2], [1, 3, 2, 1, 4], [2, 2, 2, 2, 1]):
        world = 1
        for s in sizes:
            world *= s
        for mask in itertools.product([False, True], repeat=len(sizes)):
            expected = ps.generate_masked_orthogonal_rank_groups(world, list(sizes), list(mask))
            assert orthogonal_groups(sizes, mask) == expected, (sizes, mask)


LAYOUTS = [  # (tp, pp, cp, ep, etp, world)
    (4, 2, 1, 8, 1, 16),  # the shipped 30B layout
    (2, 1, 1, 1, 1, 8),
    (2, 2, 2, 1, 1, 16),
    (1, 2, 1, 4, 2, 16),
    (2, 2, 1, 2, 2, 16),
    (8, 1, 1, 2, 4, 32),
    (4, 4, 1, 8, 1, 32),
    (2, 1, 4, 4, 1, 16),
]


@pytest.mark.parametrize("tp,pp,cp,ep,etp,world", LAYOUTS)
def test_groups_are_those_initialize_model_parallel_builds(tp, pp, cp, ep, etp, world):
    """Built as initialize_model_parallel builds its two generators (megatron-core 0.16.1, parallel_state.py:775-807):
    TENSOR_MODEL_PARALLEL_GROUP = decoder get_ranks('tp') (:1019), EXPERT_MODEL_PARALLEL_GROUP = expert
    get_ranks('ep') (:1189), EXPERT_TENSOR_PARALLEL_GROUP = expert get_ranks('tp') (:1205)."""
    ps = pytest.importorskip("megatron.core.parallel_state")
    assert inspect.signature(ps.initialize_model_parallel).parameters["order"].default == ORDER
    dense = ps.RankGenerator(tp=tp, ep=1, dp=world // (tp * pp * cp), pp=pp, cp=cp, order=ORDER)
    expert = ps.RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order=ORDER)
    expected = {
        "actor.tensor_parallel_size": dense.get_ranks("tp"),
        "actor.expert_parallel_size": expert.get_ranks("ep"),
        "actor.expert_tensor_parallel_size": expert.get_ranks("tp"),
    }
    cfg = _megatron(tp, pp, cp, ep, etp, nnodes=world // 8, per_node=8)
    got = {key: groups for _, key, groups in node_local_groups(cfg, world)}
    assert got == {key: groups for key, groups in expected.items() if len(groups[0]) > 1}


def test_the_megatron_engine_keeps_the_default_order():
    """The order above is megatron-core's default only if our engine passes none."""
    pytest.importorskip("megatron.core")
    from gspo_ascend.engines.megatron import MegatronEngine

    source = inspect.getsource(MegatronEngine._init_parallel_state)
    assert "initialize_model_parallel(" in source and "order" not in source


def test_rollout_and_ulysses_groups_are_the_engines():
    from gspo_ascend.engines.vllm_rollout import rollout_tp_groups

    cfg = _cfg(**{"rollout.engine": "vllm", "rollout.tensor_parallel_size": 4, "trainer.devices_per_node": 8})
    assert node_local_groups(cfg, 8) == [
        ("vLLM rollout tensor-parallel", "rollout.tensor_parallel_size", rollout_tp_groups(8, 4))
    ]
    cfg = _cfg(**{"actor.ulysses_sequence_parallel_size": 2, "trainer.devices_per_node": 4})
    assert node_local_groups(cfg, 4) == [
        ("Ulysses sequence-parallel", "actor.ulysses_sequence_parallel_size", [[0, 1], [2, 3]])
    ]
    assert node_local_groups(cfg, 4, train=False) == []  # `gspo-ascend eval`: no train engine, no SP groups
    # a trainer pool (disaggregated rollout, pools.py) builds no rollout engine: its ranks form no rollout TP group
    cfg = _cfg(**{"rollout.engine": "vllm", "rollout.tensor_parallel_size": 2, "trainer.devices_per_node": 2})
    across = [NODES[A], NODES[B]]
    assert find_split(cfg, [A, B]) == ("vLLM rollout tensor-parallel", "rollout.tensor_parallel_size", [0, 1])
    check_node_local(cfg, across, rollout=False)  # no error: rank 0 and rank 1 share no group here
    with pytest.raises(UserError, match="vLLM rollout tensor-parallel group of ranks"):
        check_node_local(cfg, across)


# --------------------------------------------------------------------------------------- ordering, checking


def test_interleaved_pack_is_ordered_node_by_node():
    """PACK gave bundles A, B, A, B, ...: as bundle = rank (the old WorkerGroup) every TP 2 group spans both nodes;
    numbered node by node, none does."""
    cfg = _megatron(tp=2, nnodes=2, per_node=4)
    bundle_nodes = {b: (A, B)[b % 2] for b in range(8)}
    as_placed = [bundle_nodes[b] for b in range(8)]
    assert find_split(cfg, as_placed) == ("megatron tensor-parallel", "actor.tensor_parallel_size", [0, 1])
    order = rank_bundles(bundle_nodes, 8)
    assert order == [0, 2, 4, 6, 1, 3, 5, 7]
    assert find_split(cfg, [bundle_nodes[b] for b in order]) is None


def test_ordering_keeps_a_good_placement_and_unknown_bundles():
    assert rank_bundles({b: (A, B)[b >= 4] for b in range(8)}, 8) == list(range(8))
    assert rank_bundles({0: B, 1: A, 2: B, 3: A}, 4) == [0, 2, 1, 3]  # bundle 0 stays rank 0
    assert rank_bundles({0: A, 2: A}, 4) == [0, 2, 1, 3]
    assert rank_bundles({}, 3) == [0, 1, 2]


def test_split_group_is_one_line_naming_group_ranks_nodes_and_fix():
    cfg = _megatron(tp=2, nnodes=2, per_node=4)
    with pytest.raises(UserError) as info:
        check_node_local(cfg, [NODES[(A, B)[r % 2]] for r in range(8)])
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("placement: the megatron tensor-parallel group of ranks [0, 1] spans 2 nodes")
    assert "rank(s) 0 on node aaaaaaaa (10.0.0.1); rank(s) 1 on node bbbbbbbb (10.0.0.2)" in message
    assert "trainer.devices_per_node (4)" in message and "actor.tensor_parallel_size (2)" in message


def test_shipped_30b_layout():
    """TP 4 x PP 2 x EP 8, rollout TP 4 on 2 x 8: node by node passes; one swapped rank pair, or two swapped TP
    blocks (TP and rollout TP still within a node), does not."""
    cfg = load_config(LAYOUT_30B)
    assert (cfg.trainer.nnodes, cfg.trainer.devices_per_node) == (2, 8)
    good = [NODES[A]] * 8 + [NODES[B]] * 8
    check_node_local(cfg, good)
    swapped = list(good)
    swapped[3], swapped[8] = swapped[8], swapped[3]
    assert find_split(cfg, [n for n, _ in swapped]) == (
        "megatron tensor-parallel",
        "actor.tensor_parallel_size",
        [0, 1, 2, 3],
    )
    with pytest.raises(UserError, match=r"tensor-parallel group of ranks \[0, 1, 2, 3\] spans 2 nodes"):
        check_node_local(cfg, swapped)
    blocks = [NODES[A]] * 4 + [NODES[B]] * 4 + [NODES[A]] * 4 + [NODES[B]] * 4
    split = find_split(cfg, [n for n, _ in blocks])
    assert split == ("megatron expert-parallel", "actor.expert_parallel_size", list(range(8)))
    # rollout only (`gspo-ascend eval`): the megatron groups do not exist, rollout TP 4 blocks are within nodes
    assert find_split(cfg, [n for n, _ in blocks], train=False) is None


def test_one_node_needs_no_check():
    assert find_split(_megatron(tp=8, nnodes=1, per_node=8), [A] * 8) is None


def test_a_pools_bundle_asks_for_its_node_share_where_the_nodes_give_it():
    """A disaggregated run's pools on nodes the launcher started (scripts/lib/ray.sh: 2 x {"NPU": 8,
    "gspo_trainer_pool": 6, "gspo_rollout_pool": 2}): each bundle asks for one of its pool's, so Ray can put at most
    6 trainer ranks on a node (PACK alone put 8 there and 4 + 4 rollout on the other)."""
    npu = {"CPU": 1, "NPU": 1}
    cluster = {"CPU": 384.0, "NPU": 16.0, "gspo_trainer_pool": 12.0, "gspo_rollout_pool": 4.0}
    assert pool_bundle(npu, "trainer", cluster, 12, 2) == ({"CPU": 1, "NPU": 1, "gspo_trainer_pool": 1}, None)
    assert pool_bundle(npu, "rollout", cluster, 4, 2) == ({"CPU": 1, "NPU": 1, "gspo_rollout_pool": 1}, None)
    # nodes started without the shares: placement as before, said once where there are several nodes
    bare = {"CPU": 384.0, "NPU": 16.0}
    bundle, note = pool_bundle(npu, "trainer", bare, 12, 2)
    assert bundle == npu and note.startswith("note: this cluster's nodes give no 'gspo_trainer_pool' / ")
    assert "trainer.devices_per_node and rollout_pool.devices_per_node" in note and "PACK decides" in note
    assert pool_bundle(npu, "rollout", bare, 4, 2) == (npu, note)  # one line for both pools (printed once)
    assert pool_bundle(npu, "rollout", bare, 4, 1) == (npu, None)  # one node: its split is the config's
    # too few shares (a node started with other DEVICES_PER_NODE): one line now, not Ray's 120 s wait
    with pytest.raises(UserError, match=r"give 8 'gspo_trainer_pool' in all and the trainer pool needs 12"):
        pool_bundle(npu, "trainer", {**cluster, "gspo_trainer_pool": 8.0}, 12, 2)


def test_the_nominal_layout_is_the_one_pool_bundle_places():
    """Ranks r // devices_per_node: TP 4 on 2 x 6 splits [4, 5, 6, 7]; TP 2 x PP 6 x EP 2 does not; one node never."""
    assert nominal_split(_megatron(tp=4, pp=3, ep=4, per_node=6)) == (
        "megatron tensor-parallel",
        "actor.tensor_parallel_size",
        [4, 5, 6, 7],
    )
    assert nominal_split(_megatron(tp=2, pp=6, ep=2, per_node=6)) is None
    assert nominal_split(_megatron(tp=8, nnodes=1, per_node=8)) is None


# ------------------------------------------------------------------------------------- WorkerGroup itself


class _Ref:
    def __init__(self, value):
        self.value = value


def _fake_ray(bundle_nodes: dict[int, str], scheduled: list[int]) -> dict[str, types.ModuleType]:
    """The Ray calls WorkerGroup.__init__ makes; each actor reports the node of the bundle it was scheduled in."""

    def actor(node_ip):
        return SimpleNamespace(
            node=SimpleNamespace(remote=lambda: _Ref(node_ip)),
            address=SimpleNamespace(remote=lambda: _Ref(("127.0.0.1", 1))),
            setup=SimpleNamespace(remote=lambda *a: _Ref(None)),
        )

    def options(scheduling_strategy, **_):
        scheduled.append(scheduling_strategy)
        return SimpleNamespace(remote=lambda *a: actor(NODES[bundle_nodes[scheduling_strategy]]))

    ray = types.ModuleType("ray")
    ray.is_initialized = lambda: True
    ray.cluster_resources = lambda: {"CPU": 8.0}
    ray.wait = lambda refs, timeout, num_returns=1: (refs, [])
    ray.get = lambda ref: [r.value for r in ref] if isinstance(ref, list) else ref.value
    ray.remote = lambda cls: SimpleNamespace(options=options)
    ray.kill = lambda actor: None
    return ray_modules(
        ray,
        bundle_nodes=bundle_nodes,
        strategy=lambda group, placement_group_bundle_index: placement_group_bundle_index,
        removed=lambda group: scheduled.append("removed"),
    )


def _worker_group(monkeypatch, tmp_path, bundle_nodes, **overrides):
    from gspo_ascend.device import CPU
    from gspo_ascend.workers import WorkerGroup

    scheduled: list = []
    for name, module in _fake_ray(bundle_nodes, scheduled).items():
        monkeypatch.setitem(sys.modules, name, module)
    cfg = _cfg(**{"trainer.output_dir": str(tmp_path), **overrides})
    try:
        return WorkerGroup(cfg, CPU, str(tmp_path)), scheduled
    except UserError as exc:
        return exc, scheduled


@pytest.mark.parametrize("pool", ["rollout", None])
def test_a_pool_asks_for_its_share_and_eval_asks_for_none(monkeypatch, tmp_path, pool):
    """On nodes the disaggregated launcher started (both shares on each), a rollout pool's bundles ask for one
    'gspo_rollout_pool' each; `gspo-ascend eval --ray` (WorkerGroup(train=False), no pool) asks for none: the
    first version of this change took every train=False group for the rollout pool, so eval on 2 x 8 devices
    stopped with "the rollout pool needs 16"."""
    from gspo_ascend.device import CPU
    from gspo_ascend.workers import WorkerGroup

    scheduled: list = []
    modules = _fake_ray({b: (A, B)[b // 2] for b in range(4)}, scheduled)
    modules["ray"].cluster_resources = lambda: {"CPU": 8.0, "gspo_trainer_pool": 2.0, "gspo_rollout_pool": 2.0}
    modules["ray"].nodes = lambda: [{"Alive": True}, {"Alive": True}]
    asked: list = []
    ready = SimpleNamespace(ready=lambda: "ready")
    modules["ray.util.placement_group"].placement_group = lambda bundles, strategy: asked.append(bundles) or ready
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    world = 2 if pool else 4  # eval: every device of the cluster
    cfg = _cfg(**{"trainer.output_dir": str(tmp_path), "trainer.nnodes": 2, "trainer.devices_per_node": world // 2})
    WorkerGroup(cfg, CPU, str(tmp_path), train=False, pool=pool)
    share = {"gspo_rollout_pool": 1} if pool else {}
    assert asked == [[{"CPU": 8 // world, **share}] * world]  # the fake cluster's 8 CPUs over the actors


def test_worker_group_numbers_ranks_node_by_node(monkeypatch, tmp_path, capsys):
    """Interleaved bundles, megatron TP 2 on 2 x 4: rank r runs in a bundle of node A for r < 4 (on the old main,
    rank r ran in bundle r and its TP groups spanned both nodes)."""
    layout = {"actor.engine": "megatron", "actor.tensor_parallel_size": 2}
    layout.update({"trainer.nnodes": 2, "trainer.devices_per_node": 4})
    group, scheduled = _worker_group(monkeypatch, tmp_path, {b: (A, B)[b % 2] for b in range(8)}, **layout)
    assert scheduled == [0, 2, 4, 6, 1, 3, 5, 7]
    assert [n for n, _ in group.watch.nodes] == [A] * 4 + [B] * 4
    assert "rank 3 on node aaaaaaaa" in capsys.readouterr().err


def test_worker_group_stops_on_a_group_ordering_cannot_save(monkeypatch, tmp_path):
    """Node A holds 3 of the 8 ranks (another job holds its fourth device): rollout TP 2 group [2, 3] spans nodes."""
    layout = {"rollout.engine": "vllm", "rollout.tensor_parallel_size": 2, "rollout.enforce_eager": "null"}
    layout.update({"trainer.nnodes": 2, "trainer.devices_per_node": 4})
    bundle_nodes = {b: A if b < 3 else B for b in range(8)}
    error, scheduled = _worker_group(monkeypatch, tmp_path, bundle_nodes, **layout)
    assert isinstance(error, UserError), error
    assert "vLLM rollout tensor-parallel group of ranks [2, 3] spans 2 nodes" in str(error)
    assert scheduled[-1] == "removed"  # the actors' bundles are given back before the error is raised


@pytest.mark.parametrize("threads, expected", [(0, 4), (1, 1)])  # the fake cluster: 8 CPUs, 2 actors
def test_cpu_threads_per_actor(monkeypatch, tmp_path, threads, expected):
    from gspo_ascend.device import CPU
    from gspo_ascend.workers import WorkerGroup

    started: list = []
    modules = _fake_ray({0: A, 1: A}, [])
    options = modules["ray"].remote(None).options
    wrapped = lambda **kw: SimpleNamespace(remote=lambda *a: started.append(a[-1]) or options(**kw).remote(*a))  # noqa: E731
    monkeypatch.setattr(modules["ray"], "remote", lambda cls: SimpleNamespace(options=wrapped))
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    cfg = _cfg(**{"trainer.output_dir": str(tmp_path), "trainer.devices_per_node": 2, "trainer.cpu_threads": threads})
    WorkerGroup(cfg, CPU, str(tmp_path))
    assert started == [expected, expected]  # each actor's torch.set_num_threads


def test_cpu_threads_is_refused_off_the_cpu(monkeypatch, tmp_path):
    from gspo_ascend.device import CUDA
    from gspo_ascend.workers import WorkerGroup

    for name, module in _fake_ray({0: A}, []).items():
        monkeypatch.setitem(sys.modules, name, module)
    cfg = _cfg(**{"trainer.output_dir": str(tmp_path), "trainer.cpu_threads": 2})
    with pytest.raises(UserError, match="'trainer.cpu_threads' sets CPU threads for CPU devices; this run is on cuda"):
        WorkerGroup(cfg, CUDA, str(tmp_path))
    with pytest.raises(Exception, match="'trainer.cpu_threads' must be >= 0"):
        load_config(None, ["trainer.cpu_threads=-1"])
