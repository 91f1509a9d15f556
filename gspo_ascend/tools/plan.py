"""Which tools a row may call, and the hidden arguments its calls get: :class:`ToolPlan`.

- ``tools.by_source[data_source]`` lists the tools of a data source's rows (``[]``: single turn); a source not
  listed gets ``tools.names``. The prompt is rendered with exactly its row's schemas.
- verl's ``agent_name`` column: ``tool_agent`` rows get their source's tools, ``single_turn_agent`` rows none (one
  model turn, no schemas in the prompt); a row without it gets its source's tools. Any other agent is refused with
  its file and row: we have no other loop to run it with.
- verl's ``extra_info.tools_kwargs``: ``{tool: {"create_kwargs": {...}, "execute_kwargs": {...}}}``. A tool here
  is a function whose one call creates, runs and releases it, so both sets are keyword arguments of that call,
  filling the tool's keyword-only parameters, which its schema does not show the model (registry.py). A key the
  tool does not take, or a required one a row lacks, is refused at load with the file and row.
  ``calc_reward_kwargs`` and ``release_kwargs`` name stages we do not have (scoring is the reward function's):
  said once, unused; so are the kwargs of a tool the row cannot call.

How we differ from verl: verl gives every row of a run the same tools (its tool config file) and reads only
``create_kwargs`` (``ToolAgentLoop._call_tool``); a tool's per-row state lives in its instance between calls. Our
calls are stateless: what a tool needs per row comes from the row.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import UserError
from .registry import ToolInfo, describe

AGENTS = ("tool_agent", "single_turn_agent")  # verl's agent_name values we run
_CALL_KWARGS = ("create_kwargs", "execute_kwargs")
_UNUSED_KWARGS = ("calc_reward_kwargs", "release_kwargs")


@dataclass(frozen=True)
class RowTools:
    """A row's tools: the names the model calls them by, and each one's hidden keyword arguments."""

    names: tuple[str, ...] = ()
    kwargs: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)


class ToolPlan:
    """A run's tools by row (module docstring); every named tool described at once, so one that cannot be used
    fails before anything starts."""

    def __init__(self, tools: Any, stream: Any = None) -> None:
        specs = list(dict.fromkeys([*tools.names, *(s for v in tools.by_source.values() for s in v)]))
        self.infos: dict[str, ToolInfo] = {spec: describe(spec) for spec in specs}
        by_name: dict[str, str] = {}
        for spec, info in self.infos.items():
            if by_name.setdefault(info.name, spec) != spec:
                raise UserError(
                    f"tools '{by_name[info.name]}' and '{spec}' are both called '{info.name}' by the model; rename one"
                )
        self.specs = specs  # every tool some row may call (the ToolBox's)
        self.default = tuple(self.infos[s].name for s in tools.names)
        self.by_source = {src: tuple(self.infos[s].name for s in v) for src, v in tools.by_source.items()}
        self.by_name = {i.name: i for i in self.infos.values()}
        self.stream = stream
        self.said: set[str] = set()

    def row(self, data_source: str, agent_name: Any, tools_kwargs: Any, where: str) -> RowTools:
        """The tools of the row at ``where`` (file:row, for messages)."""
        if agent_name is not None and agent_name not in AGENTS:
            raise UserError(
                f"{where}: agent_name '{agent_name}' is not one we run; use one of {', '.join(AGENTS)} (or drop the "
                "column: a row without it gets its data source's tools)"
            )
        names = () if agent_name == "single_turn_agent" else self.by_source.get(data_source, self.default)
        return RowTools(names, self._kwargs(names, tools_kwargs or {}, where))

    def schemas(self, row: RowTools) -> list[dict[str, Any]] | None:
        """For the row's ``apply_chat_template(tools=...)``; None for a single-turn row."""
        return [self.by_name[n].schema for n in row.names] or None

    def _kwargs(self, names: tuple[str, ...], given: Any, where: str) -> dict[str, dict[str, Any]]:
        if not isinstance(given, Mapping):
            raise UserError(f"{where}: extra_info.tools_kwargs must map tool names to their kwargs, got {given!r}")
        out = {}
        for name in names:
            stages = given.get(name) or {}
            merged: dict[str, Any] = {}
            for stage in _CALL_KWARGS:
                # None: what a parquet struct holds for a key another row has and this one lacks
                merged |= {k: v for k, v in (stages.get(stage) or {}).items() if v is not None}
            for stage in _UNUSED_KWARGS:
                if stages.get(stage):
                    why = "a tool call here has no reward or release stage; scoring is reward.reward_fn's"
                    self._say(stage, f"extra_info.tools_kwargs.<tool>.{stage} (from {where}) is not used: {why}")
            info = self.by_name[name]
            if unknown := sorted(set(merged) - info.hidden):
                raise UserError(
                    f"{where}: extra_info.tools_kwargs.{name} gives {unknown}, which tool '{name}' does not take as "
                    f"keyword-only parameters (it takes {sorted(info.hidden) or 'none'}); declare them after '*'"
                )
            if missing := sorted(info.hidden_required - set(merged)):
                raise UserError(
                    f"{where}: tool '{name}' needs {missing} from the row (extra_info.tools_kwargs.{name}."
                    "create_kwargs); add them or give the parameters defaults"
                )
            if merged:
                out[name] = merged
        for name in sorted(set(given) - set(names)) if names else ():  # a single-turn row calls nothing anyway
            why = f"rows like {where} do not call it (tools.names / tools.by_source); its kwargs are unused"
            self._say(f"unused:{name}", f"extra_info.tools_kwargs names tool '{name}': {why}")
        return out

    def _say(self, key: str, message: str) -> None:
        if key not in self.said:
            self.said.add(key)
            print(f"note: {message} (said once)", file=self.stream or sys.stderr, flush=True)
