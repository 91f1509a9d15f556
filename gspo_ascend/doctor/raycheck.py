"""Resources of an already running Ray cluster. Doctor never starts one: it asks the in-process driver when
``ray.is_initialized()``, otherwise it connects only when RAY_ADDRESS is set or Ray's own
``/tmp/ray/ray_current_cluster`` marker exists, and then from a child process with a timeout, so a stale
marker or a hung head node costs seconds, not the doctor run.
"""

from __future__ import annotations

import json
import sys

from .check import Check

PROBE = (
    "import json, ray\n"
    "ray.init(address='auto', log_to_driver=False, logging_level='ERROR')\n"
    "alive = sum(1 for n in ray.nodes() if n.get('Alive'))\n"
    "print(json.dumps({'total': ray.cluster_resources(), 'available': ray.available_resources(), 'nodes': alive}))\n"
)
PROBE_TIMEOUT_S = 30.0


def _resource_name(platform: str) -> str:
    from ..device import CPU, CUDA, NPU

    backend = {"npu": NPU, "cuda": CUDA, "cpu": CPU}[platform]
    return backend.ray_resource or "CPU"  # Ray schedules CPU ranks on the CPU resource


def _in_process() -> dict | None:
    """When this process is already a Ray driver (doctor called from the trainer), ask it directly."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    alive = sum(1 for n in ray.nodes() if n.get("Alive"))
    return {"total": ray.cluster_resources(), "available": ray.available_resources(), "nodes": alive}


def _probe(ctx) -> tuple[dict | None, str]:
    result = ctx.runner.run([sys.executable, "-c", PROBE], timeout=PROBE_TIMEOUT_S)
    if result is None or result.returncode != 0:
        text = (result.stderr or result.stdout).strip().splitlines() if result else ["python not runnable"]
        return None, text[-1] if text else "no output"
    for line in reversed(result.stdout.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line), ""
            except json.JSONDecodeError:
                break
    return None, "the probe printed no resources"


def ray_checks(ctx) -> list[Check]:
    address, state = ctx.env.get("RAY_ADDRESS"), _in_process()
    if state is None and not address and not ctx.ray_cluster_file.exists():
        return [Check("ray-cluster", "ok", "no running Ray cluster (RAY_ADDRESS unset, no marker file); skipped")]
    state, error = (state, "") if state is not None else _probe(ctx)
    where = f"RAY_ADDRESS={address}" if address else str(ctx.ray_cluster_file)
    if state is None:
        return [
            Check(
                "ray-cluster",
                "warn",
                f"a Ray cluster is advertised ({where}) but connecting failed: {error}",
                "`ray status` on the head node; remove a stale /tmp/ray/ray_current_cluster or fix RAY_ADDRESS",
            )
        ]
    resource = _resource_name(ctx.platform)
    total, free = state["total"].get(resource, 0), state["available"].get(resource, 0)
    finding = f"{state['nodes']} node(s), {resource} {free:g} free of {total:g}"
    if ctx.config is not None:
        need = ctx.config.trainer.nnodes * ctx.config.trainer.devices_per_node
        if total < need:
            return [
                Check(
                    "ray-cluster",
                    "fail",
                    f"{finding}; the config needs {need} (trainer.nnodes x trainer.devices_per_node)",
                    "join the missing nodes (`ray start --address=<head>`) or lower trainer.nnodes",
                )
            ]
    return [Check("ray-cluster", "ok", finding)]
