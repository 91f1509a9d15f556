"""Which ranks must share a node, and the rank order that keeps them together on Ray's placement.

Ranks are placement-group bundles (:class:`~gspo_ascend.workers.WorkerGroup`). Ray's ``PACK`` strategy packs the
bundles onto as few nodes as it can but promises nothing about which bundle index lands on which node, while every
tensor-like group below is a block of nearby ranks. A group split over two nodes still works, its per-layer
collectives just run over the network (RoCE instead of HCCS / NVLink): silently several times slower. So

* :func:`rank_bundles` numbers the ranks node by node (ranks of one node consecutive, bundle 0 staying rank 0);
* :func:`check_node_local` then takes the node each rank reports and stops with one line naming the first group
  that still spans nodes (a node holding a share of ranks that the group sizes do not divide).

The groups are those the engines really build, with the same rank arithmetic:

* megatron (``actor.engine=megatron``): ``parallel_state.initialize_model_parallel`` with its default order
  ``tp-cp-ep-dp-pp`` (we pass none): the tensor-parallel groups of the decoder ``RankGenerator(tp, ep=1, dp, pp,
  cp)``, and the expert-parallel and expert-tensor-parallel groups of the expert ``RankGenerator(tp=etp, ep,
  dp=world / (etp x ep x pp), pp, cp=1)`` (``get_ranks("tp")`` / ``get_ranks("ep")``); :func:`orthogonal_groups` is
  its ``generate_masked_orthogonal_rank_groups`` (tests/unit/test_placement.py holds it to megatron-core's own);
* fsdp (``actor.engine=fsdp``): the Ulysses sequence-parallel groups, the rows of the ``(dp, sp)`` device mesh
  (``engines/fsdp.py`` ``_sp_group``), that is ``sp`` consecutive ranks;
* vLLM rollout (``rollout.engine=vllm``): ``engines/rollout_shards.py`` :func:`rollout_tp_groups`, ``tp``
  consecutive ranks.

A disaggregated run's two pools share every node (the launch scripts start each node with both pools' devices):
PACK alone would fill the first node with the trainer's bundles (2 x (6 + 2) devices: 8 trainer ranks on one node,
4 + the 4 rollout ranks on the other), not the per-node split the config, the preflight and the planner describe.
So the launcher gives every node its pools' shares as resources of their own (:data:`POOL_RESOURCES`) and each
pool's bundles ask for one (:func:`pool_bundle`); :func:`nominal_split` is the same group check on that layout, for
the preflight, before anything starts.

How we differ from verl: verl also relies on PACK's bundle order for its TP groups and does not check it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

from .config import Config
from .errors import UserError

# A node's share of each pool (scripts/lib/ray.sh gives every node DEVICES_PER_NODE and ROLLOUT_DEVICES_PER_NODE of
# them beside its devices); a pool's bundle asks for one of its own
POOL_RESOURCES = {"trainer": "gspo_trainer_pool", "rollout": "gspo_rollout_pool"}
POOL_KEYS = {"trainer": "trainer.devices_per_node", "rollout": "rollout_pool.devices_per_node"}

ORDER = "tp-cp-ep-dp-pp"  # megatron-core's default `order`, which engines/megatron.py leaves as it is


class Split(NamedTuple):
    """A group that spans nodes: what it is (``what``, the config ``key`` sizing it) and its ranks."""

    what: str
    key: str
    ranks: list[int]


def orthogonal_groups(sizes: Sequence[int], mask: Sequence[bool]) -> list[list[int]]:
    """Megatron-core's ``generate_masked_orthogonal_rank_groups``: a rank is the mixed-radix number of its
    per-dimension indices (first dimension fastest); one group per combination of the unmasked dimensions, holding
    every combination of the masked ones, both enumerated first-dimension-fastest."""
    strides = [1]
    for size in sizes[:-1]:
        strides.append(strides[-1] * size)

    def offsets(dims: list[int]) -> list[int]:
        out = [0]
        for d in dims:  # later dimensions vary slower: they are the outer loop of each extension
            out = [o + i * strides[d] for i in range(sizes[d]) for o in out]
        return out

    inner = offsets([d for d, m in enumerate(mask) if m])
    return [[o + i for i in inner] for o in offsets([d for d, m in enumerate(mask) if not m])]


def megatron_groups(sizes: Mapping[str, int], token: str, order: str = ORDER) -> list[list[int]]:
    """``RankGenerator(**sizes, order=order).get_ranks(token)`` for a single-dimension ``token``."""
    names = order.split("-")
    return orthogonal_groups([sizes[n] for n in names], [n == token for n in names])


def consecutive_groups(world: int, size: int) -> list[list[int]]:
    """Blocks of ``size`` consecutive ranks: the fsdp engine's Ulysses groups (the rows of its (world/SP, SP) device
    mesh) and vLLM's rollout TP groups (engines/rollout_shards.py ``rollout_tp_groups``: TP innermost)."""
    return [list(range(g, g + size)) for g in range(0, world, size)]


def node_local_groups(
    cfg: Config, world: int, train: bool = True, rollout: bool = True
) -> list[tuple[str, str, list[list[int]]]]:
    """(what, config key, groups) for every group of more than one rank that must lie within one node. A layout
    the sizes do not divide is left out: the engine building it names that problem itself."""
    a, out = cfg.actor, []
    if train and a.engine == "megatron":
        tp, pp, cp, ep, etp = (
            a.tensor_parallel_size,
            a.pipeline_parallel_size,
            a.context_parallel_size,
            a.expert_parallel_size,
            a.expert_tensor_parallel_size,
        )
        if world % (tp * pp * cp) == 0:
            dense = {"tp": tp, "cp": cp, "ep": 1, "dp": world // (tp * pp * cp), "pp": pp}
            out.append(("megatron tensor-parallel", "actor.tensor_parallel_size", megatron_groups(dense, "tp")))
        if world % (etp * ep * pp) == 0:
            expert = {"tp": etp, "cp": 1, "ep": ep, "dp": world // (etp * ep * pp), "pp": pp}
            out.append(("megatron expert-parallel", "actor.expert_parallel_size", megatron_groups(expert, "ep")))
            key = "actor.expert_tensor_parallel_size"
            out.append(("megatron expert-tensor-parallel", key, megatron_groups(expert, "tp")))
    sp = a.ulysses_sequence_parallel_size
    if train and a.engine == "fsdp" and world % sp == 0:
        key = "actor.ulysses_sequence_parallel_size"
        out.append(("Ulysses sequence-parallel", key, consecutive_groups(world, sp)))
    rollout_tp = cfg.rollout.tensor_parallel_size
    if rollout and cfg.rollout.engine == "vllm" and world % rollout_tp == 0:
        key = "rollout.tensor_parallel_size"
        out.append(("vLLM rollout tensor-parallel", key, consecutive_groups(world, rollout_tp)))
    return [(what, key, groups) for what, key, groups in out if groups and len(groups[0]) > 1]


def find_split(cfg: Config, nodes: Sequence[str], train: bool = True, rollout: bool = True) -> Split | None:
    """The first group (of :func:`node_local_groups`) whose ranks are on more than one node, or None.
    ``nodes[r]`` is the node of rank r."""
    if len(set(nodes)) <= 1:
        return None
    for what, key, groups in node_local_groups(cfg, len(nodes), train, rollout):
        for ranks in groups:
            if len({nodes[r] for r in ranks}) > 1:
                return Split(what, key, ranks)
    return None


def rank_bundles(bundle_nodes: Mapping[int, str], world: int) -> list[int]:
    """The placement bundle of each rank: bundles grouped by node, nodes in the order of their lowest bundle, and
    bundle order within a node. A placement whose nodes already hold consecutive bundles keeps rank = bundle.
    Bundles Ray did not report a node for keep their index order, after the others."""
    first: dict[str, int] = {}
    for b in sorted(bundle_nodes):
        first.setdefault(bundle_nodes[b], b)
    known = sorted((b for b in range(world) if b in bundle_nodes), key=lambda b: (first[bundle_nodes[b]], b))
    return known + [b for b in range(world) if b not in bundle_nodes]


def check_node_local(cfg: Config, nodes: Sequence[tuple[str, str]], train: bool = True, rollout: bool = True) -> None:
    """Raise one :class:`UserError` line when a group of :func:`node_local_groups` spans nodes; ``nodes[r]`` is
    rank r's (node id, address), as :func:`~gspo_ascend.cluster.this_node` reports it."""
    split = find_split(cfg, [node for node, _ in nodes], train, rollout)
    if split is None:
        return
    where: dict[tuple[str, str], list[int]] = {}
    for r in split.ranks:
        where.setdefault(nodes[r], []).append(r)
    parts = "; ".join(f"rank(s) {', '.join(map(str, rs))} on node {n[:8]} ({ip})" for (n, ip), rs in where.items())
    held = ", ".join(f"{n[:8]}: {sum(1 for m, _ in nodes if m == n)}" for n, _ in where)
    t = cfg.trainer
    raise UserError(
        f"placement: the {split.what} group of ranks {split.ranks} spans {len(where)} nodes ({parts}), so its "
        f"collectives would cross the network (this job's ranks per node: {held}). Give "
        f"every node exactly trainer.devices_per_node ({t.devices_per_node}) free devices for this job (no other job "
        f"holding some, each node's Ray resources matching) with {split.key} ({len(split.ranks)}) dividing it, or "
        f"lower {split.key}"
    )


def pool_bundle(
    bundle: Mapping[str, float], pool: str, cluster: Mapping[str, float], world: int, nodes: int
) -> tuple[dict[str, float], str | None]:
    """The placement bundle of one rank of ``pool`` ("trainer" or "rollout", a disaggregated run's) on a cluster
    with resources ``cluster`` and ``nodes`` alive nodes, and a line to say (None: nothing to say). Where the nodes
    give the pool's resource, each bundle asks for one, so a node holds exactly its share of the pool; a cluster
    started by hand without it keeps PACK's placement, said once where it has several nodes."""
    name, key = POOL_RESOURCES[pool], POOL_KEYS[pool]
    have = cluster.get(name)
    if have is None:
        if nodes <= 1:
            return dict(bundle), None
        shares = " / ".join(f"'{r}'" for r in POOL_RESOURCES.values())
        return dict(bundle), (  # the same line for both pools: said once (workers.py)
            f"note: this cluster's nodes give no {shares} resources (the launch scripts give each node its "
            f"{' and '.join(POOL_KEYS.values())} of them), so Ray's PACK decides how many of each pool's ranks a "
            "node holds, not the config; a group that spans nodes is still refused"
        )
    if have < world:
        raise UserError(
            f"the cluster's nodes give {have:g} '{name}' in all and the {pool} pool needs {world}: start every node "
            f"with the same launch script and DEVICES_PER_NODE / ROLLOUT_DEVICES_PER_NODE (a node's share, {key})"
        )
    return {**bundle, name: 1}, None


def nominal_split(cfg: Config) -> Split | None:
    """The first training group that the config's own layout splits over nodes, or None: the trainer's ranks
    numbered node by node, ``trainer.devices_per_node`` to a node (as :func:`pool_bundle` places a trainer pool,
    and a colocated run's nodes hold them). vLLM's groups are the preflight's ``rollout-tp`` rule."""
    t = cfg.trainer
    if t.nnodes <= 1 or t.devices_per_node <= 0:
        return None
    return find_split(cfg, [str(r // t.devices_per_node) for r in range(t.nnodes * t.devices_per_node)], rollout=False)
