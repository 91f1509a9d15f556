"""The driver's view of its Ray workers: where each rank runs, and one line when a node or a worker is lost.

``ray.get`` on a list of the workers' results waits for all of them. When one training worker dies (its node
lost, an OOM kill) the others are usually blocked in a collective with it, so that ``ray.get`` either waits for
the collective's own timeout (gloo: 30 minutes) or raises ``ActorDiedError``, which printed two chained
tracebacks and a multi-line Ray message. :meth:`ClusterWatch.get` instead

* returns as soon as any result is an actor failure, and turns it into one :class:`~gspo_ascend.errors.ClusterError`
  line: the rank, its node (id and address), why (Ray's first sentence), what to do and from which checkpoint
  the same command resumes. A survivor's own failure often comes first (gloo: "Connection reset by peer"), so
  after any failure the other ranks and their nodes are watched for up to ``PEER_GRACE_S`` for the lost one;
* asks the GCS every ``NODE_CHECK_S`` seconds, while it waits, whether the nodes holding our ranks are alive. A
  node whose raylet stopped answering is declared dead by the GCS after its health checks fail (Ray's defaults:
  about 30 s; ``RAY_health_check_*`` on the head tune it), and the driver stops then, naming the node.

After either, :meth:`~gspo_ascend.workers.WorkerGroup.shutdown` kills the actors instead of queueing a graceful
shutdown behind a call that will never return.

How we differ from verl: verl's driver ``ray.get``\\ s the worker group's futures and shows Ray's exception as is;
a lost node leaves the surviving ranks in the collective until its timeout.
"""

from __future__ import annotations

import time
from pathlib import Path

from .errors import ClusterError

NODE_CHECK_S = 5.0  # while waiting on workers: how often the driver asks the GCS whether their nodes are alive
# after a rank's call failed: how long to look for a lost peer behind it (Ray declares a dead node after its health
# checks fail, ~15-30 s with the defaults) before the failure is reported as itself
PEER_GRACE_S = 60.0


def this_node() -> tuple[str, str]:
    """(Ray node id, node address) of the calling worker process: the address the node registered with (its
    ``--node-ip-address``), which is how the cluster knows it."""
    import ray

    node = ray.get_runtime_context().get_node_id()
    ips = [n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node]
    return node, ips[0] if ips else ray.util.get_node_ip_address()


def placement_line(nodes: list[tuple[str, str]]) -> str:
    """``workers: 2 rank(s) on 2 node(s): rank 0 on node 1a2b3c4d (10.0.0.1), rank 1 on node 5e6f7a8b (10.0.0.2)``"""
    ranks = ", ".join(f"rank {r} on node {node[:8]} ({ip})" for r, (node, ip) in enumerate(nodes))
    return f"workers: {len(nodes)} rank(s) on {len({n for n, _ in nodes})} node(s): {ranks}"


def _reason(exc: BaseException) -> str:
    """Ray's first sentence on why the actor died (its message is a dozen lines of ids and hints)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    causes = [
        line
        for line in lines[1:]
        if not line.startswith(("class_name:", "actor_id:", "pid:", "name:", "namespace:", "ip:"))
    ]
    text = causes[0] if causes else (lines[0] if lines else type(exc).__name__)
    first = text.split(". ")[0].rstrip(".")
    return first[:200]


class ClusterWatch:
    """Fail-fast gathering of the ``workers``' results (rank r = ``workers[r]``, on ``nodes[r]``)."""

    def __init__(self, workers: list, nodes: list[tuple[str, str]], output_dir: str | Path):
        self.workers, self.nodes, self.output_dir = workers, nodes, Path(output_dir)
        self.broken = False  # a worker or node was lost: shut down by killing, nothing graceful is answered

    def get(self, refs: list) -> list:
        """``ray.get(refs)``, but the first actor failure, or a dead node of ours, raises :class:`ClusterError`."""
        import ray
        from ray.exceptions import RayActorError

        index = {ref: i for i, ref in enumerate(refs)}
        values: list = [None] * len(refs)
        pending, checked = list(refs), time.monotonic()
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=NODE_CHECK_S)
            for n, ref in enumerate(ready):
                try:
                    values[index[ref]] = ray.get(ref)
                except RayActorError as exc:
                    self.broken = True
                    raise self._lost(exc) from None
                except Exception:
                    # e.g. gloo's "Connection reset by peer" on a survivor: the cause may be a peer that died, whose
                    # own failure arrives later. The others may be stuck in a collective: no graceful shutdown.
                    self.broken = True
                    lost = self._find_lost(ready[n + 1 :] + pending)
                    if lost is not None:
                        raise lost from None
                    raise
            if pending and time.monotonic() - checked >= NODE_CHECK_S:
                self.check_nodes()
                checked = time.monotonic()
        return values

    def _find_lost(self, refs: list) -> ClusterError | None:
        """After one rank failed: a lost rank or node among the others (within ``PEER_GRACE_S``), or None."""
        import ray
        from ray.exceptions import RayActorError

        pending, deadline = list(refs), time.monotonic() + PEER_GRACE_S
        while time.monotonic() < deadline:
            dead = self._dead_nodes()
            if dead:
                return ClusterError(self._node_lost(dead[0]))
            if not pending:
                return None  # every other rank answered: the failure is the failure
            ready, pending = ray.wait(pending, num_returns=1, timeout=1.0)
            for ref in ready:
                try:
                    ray.get(ref)
                except RayActorError as exc:
                    return self._lost(exc)
                except Exception:
                    continue
        return None

    def check_nodes(self) -> None:
        dead = self._dead_nodes()
        if dead:
            self.broken = True
            raise ClusterError(self._node_lost(dead[0]))

    def _dead_nodes(self) -> list[str]:
        import ray

        alive = {n["NodeID"]: n["Alive"] for n in ray.nodes()}
        return [node for node, _ in self.nodes if not alive.get(node, False)]

    def _lost(self, exc: BaseException) -> ClusterError:
        from ray.exceptions import ActorUnavailableError

        ids = {w._actor_id.hex(): rank for rank, w in enumerate(self.workers)}
        rank = ids.get(getattr(exc, "actor_id", None) or "")
        reason = _reason(exc)
        if rank is None or rank >= len(self.nodes):  # not one of ours, or lost before its node was known
            return ClusterError(f"a training worker was lost ({reason}); the run stopped; {self._resume_hint()}")
        node, ip = self.nodes[rank]
        if "node has died" in str(exc) or self._node_declared_dead(node, ActorUnavailableError, exc):
            return ClusterError(self._node_lost(node))
        what = "stopped answering" if isinstance(exc, ActorUnavailableError) else "died mid-run"
        return ClusterError(
            f"training worker rank {rank} on Ray node {node[:8]} ({ip}) {what}: {reason}; the run stopped. Its "
            f"log (logs/worker-*.err in the Ray session directory of {ip}) says why, out of memory being the usual "
            f"cause; then {self._resume_hint()}"
        )

    def _node_declared_dead(self, node: str, unavailable: type, exc: BaseException) -> bool:
        """Whether the GCS declares ``node`` dead: now, or for an actor that is only unreachable (its raylet gone,
        the GCS not told yet), within ``PEER_GRACE_S``."""
        deadline = time.monotonic() + (PEER_GRACE_S if isinstance(exc, unavailable) else 0.0)
        while True:
            if node in self._dead_nodes():
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(1.0)

    def _node_lost(self, node: str) -> str:
        ranks = [r for r, (n, _) in enumerate(self.nodes) if n == node]
        ip = next(i for n, i in self.nodes if n == node)
        return (
            f"Ray node {node[:8]} ({ip}), which ran training worker rank(s) {', '.join(map(str, ranks))}, was lost "
            f"mid-run (the Ray head no longer hears from it); the run stopped. Bring the node back into the cluster "
            f"(or lower trainer.nnodes), then {self._resume_hint()}"
        )

    def _resume_hint(self) -> str:
        from .checkpoint import find_latest

        latest = find_latest(self.output_dir)
        where = f"from {latest}" if latest is not None else "from step 1 (no checkpoint was saved yet)"
        return f"run the same command again: it resumes {where}"
