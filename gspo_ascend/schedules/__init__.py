"""Rollout schedules: one object per way of producing a step's batch, behind one interface (base.Schedule).

The trainer asks a schedule for the next batch and its provenance (:class:`~.base.Produced`: the samples, their
rewards, each token's weights version), tells it when an update is done (:meth:`~.base.Schedule.hand_on`: the
schedule decides when the rollout side gets the weights), and lets it save and resume what it has in flight. It
never asks which schedule it has. One file per way:

- synchronous.py  B prompts x n responses by the current weights, every step: Algorithm 1 (the default)
- rounds.py       partial rollout / dynamic sampling: rounds until the B oldest groups in flight are finished
                  (``partial_rollout.round_tokens``, ``dynamic_sampling.enabled``), colocated or on a rollout pool
                  in step
- pool.py         batches from a rollout pool, up to eta steps ahead (``rollout_pool.max_staleness``)
- rounds_ahead.py partial rollout / dynamic sampling rounds one step ahead on a rollout pool
- agent.py        trajectories of model turns and tool turns, the loss on the model's tokens (``tools.names``)
- lagged.py       a wrapper around another: every sample from the weights of L updates ago, the staleness study
                  (``rollout.weights_lag``)

How we differ from verl: verl has one trainer class per asynchronous mode (``RayPPOTrainer``, the one-step-off and
fully-async recipes each with their own ``fit``); here one trainer and one step, and the mode is the schedule it
is given.
"""

from __future__ import annotations

from typing import Any

from .base import Produced, Schedule

__all__ = ["Produced", "Schedule", "build_schedule"]


def build_schedule(run: Any) -> Schedule:
    """The schedule ``run.cfg`` asks for (the config's validators have refused the combinations none makes)."""
    from .agent import AgentTurns
    from .lagged import Lagged
    from .pool import PoolAhead
    from .rounds import Rounds
    from .rounds_ahead import RoundsAhead
    from .synchronous import Synchronous

    cfg = run.cfg
    pool = cfg.rollout_pool
    rounds = cfg.partial_rollout.round_tokens is not None or cfg.dynamic_sampling.enabled
    if cfg.tools.enabled:  # multi-turn rollout with tool calls: colocated and synchronous (config._tools)
        return AgentTurns(run)
    if pool.devices_per_node > 0 and not rounds:
        schedule: Schedule = PoolAhead(run, pool.max_staleness)
    elif pool.devices_per_node > 0 and pool.max_staleness >= 1:
        schedule = RoundsAhead(run)
    elif rounds:  # colocated, or on a rollout pool in step (max_staleness=0)
        schedule = Rounds(run)
    else:
        schedule = Synchronous(run)
    return Lagged(schedule, cfg.rollout.weights_lag) if cfg.rollout.weights_lag else schedule
