"""The modules of a fake Ray for tests that drive ``WorkerGroup.__init__`` without starting Ray (a fake, as its
users say): the placement-group and scheduling-strategy calls it makes, around a ``ray`` module the test builds."""

from __future__ import annotations

import types
from collections.abc import Callable
from types import SimpleNamespace


def ray_modules(
    ray: types.ModuleType, *, bundle_nodes: dict[int, str], strategy: Callable, removed: Callable = lambda group: None
) -> dict[str, types.ModuleType]:
    """``sys.modules`` entries: ``ray`` as given (its RayActorError added), a placement group that is ready at once
    and reports ``bundle_nodes`` (bundle index -> node id; {} = none known), ``strategy`` as the scheduling strategy."""
    exceptions = types.ModuleType("ray.exceptions")
    exceptions.RayActorError = type("RayActorError", (Exception,), {})
    pg = types.ModuleType("ray.util.placement_group")
    pg.placement_group = lambda bundles, strategy: SimpleNamespace(ready=lambda: "ready")
    pg.placement_group_table = lambda group: {"bundles_to_node_id": dict(bundle_nodes)}
    pg.remove_placement_group = removed
    strategies = types.ModuleType("ray.util.scheduling_strategies")
    strategies.PlacementGroupSchedulingStrategy = strategy
    return {
        "ray": ray,
        "ray.exceptions": exceptions,
        "ray.util": types.ModuleType("ray.util"),
        "ray.util.placement_group": pg,
        "ray.util.scheduling_strategies": strategies,
    }
