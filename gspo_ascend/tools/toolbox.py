"""A run's tools behind one bounded call: :class:`ToolBox`.

Every call runs in a spawned worker process (pebble's ``ProcessPool``: a call past its time limit has its worker
killed and replaced, which a thread or ``concurrent.futures`` cannot do), so a tool that hangs, crashes or leaks
costs one call, never the run. A call's answer to the model is always text: the tool's result, or an ``error:``
line saying what went wrong (a malformed call, an unknown tool, arguments that do not fit the schema, an exception,
the time limit, an output over ``max_output_chars``, a crashed worker). Each fault is counted per tool and kind
(``tools/<name>/<kind>`` in the step's metrics) and said once per tool and kind on stderr, like a failing reward
function (rewards/report.py).
"""

from __future__ import annotations

import collections
import json
import multiprocessing as mp
import sys
from collections.abc import Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from .calls import Malformed, ToolCall
from .errors import ToolFault
from .registry import ToolInfo, check_arguments, describe, load_function


def _run_in_worker(path: str, arguments: dict[str, Any], max_output_chars: int) -> str:
    """In a tool worker: the tool's result as text, or a ToolFault."""
    fn = load_function(path)
    try:
        result = fn(**arguments)
    except ToolFault:
        raise
    except Exception as exc:
        first = str(exc).strip().splitlines()
        raise ToolFault("raised", f"{type(exc).__name__}: {first[0][:500] if first else ''}") from None
    if isinstance(result, str):
        text = result
    else:
        try:
            text = json.dumps(result)
        except (TypeError, ValueError):
            text = str(result)
    if len(text) > max_output_chars:
        raise ToolFault("too_long", f"the result is {len(text)} characters, over the limit of {max_output_chars}")
    return text


@dataclass
class Submitted:
    """Calls under way: the answers known at once (faults found before running), the futures of the rest."""

    answers: list[str | None]
    futures: dict[int, tuple[ToolInfo, Any]]
    step: int | None

    def done(self) -> bool:
        return all(future.done() for _, future in self.futures.values())


class ToolBox:
    def __init__(
        self, names: Sequence[str], *, timeout_s: float, max_output_chars: int, num_workers: int, stream: Any = None
    ) -> None:
        infos = [describe(n) for n in names]
        self.tools: dict[str, ToolInfo] = {i.name: i for i in infos}
        self.timeout_s, self.max_output_chars, self.num_workers = timeout_s, max_output_chars, num_workers
        self.counts: collections.Counter[str] = collections.Counter()  # "tools/<name>/<kind>" and ".../calls"
        self.said: set[tuple[str, str]] = set()
        self.stream = stream
        self._pool: Any = None

    @classmethod
    def from_config(cls, tools: Any, stream: Any = None) -> ToolBox:
        """The box of a config's ``tools`` section: every tool some row may call (plan.py), and the bounds."""
        from .plan import ToolPlan

        return cls(ToolPlan(tools).specs, timeout_s=tools.timeout_s, max_output_chars=tools.max_output_chars,
                   num_workers=tools.num_workers, stream=stream)  # fmt: skip

    @property
    def schemas(self) -> list[dict[str, Any]]:
        """For ``apply_chat_template(tools=...)``."""
        return [i.schema for i in self.tools.values()]

    def call(
        self, calls: Sequence[ToolCall | Malformed], step: int | None = None, rows: Sequence[Any] | None = None
    ) -> list[str]:
        """Every call at once (the worker processes run them in parallel); what each tells the model, in order.
        ``rows``: each call's row's tools (plan.py's RowTools: the tools it may call, their hidden arguments);
        None: every tool, none hidden."""
        return self.collect(self.submit(calls, step, rows))

    def submit(
        self, calls: Sequence[ToolCall | Malformed], step: int | None = None, rows: Sequence[Any] | None = None
    ) -> Submitted:
        """:meth:`call` started, not waited for (trajectories in flight: AgentLoop.in_flight)."""
        answers: list[str | None] = [None] * len(calls)
        futures = {}
        for i, call in enumerate(calls):
            row = rows[i] if rows is not None else None
            try:
                info = self._check(call, row)
            except ToolFault as fault:
                answers[i] = self._fault(getattr(call, "name", "?"), fault, step)
                continue
            arguments = {**call.arguments, **(row.kwargs.get(info.name, {}) if row is not None else {})}
            futures[i] = (info, self._workers().schedule(
                _run_in_worker, args=(info.path, arguments, self.max_output_chars), timeout=self.timeout_s
            ))  # fmt: skip
        return Submitted(answers, futures, step)

    def collect(self, submitted: Submitted) -> list[str]:
        """The answers of :meth:`submit`'s calls, in order (waits for those still running)."""
        answers = submitted.answers
        for i, (info, future) in submitted.futures.items():
            answers[i] = self._answer(info, future, submitted.step)
        return [a if a is not None else "" for a in answers]

    def _check(self, call: ToolCall | Malformed, row: Any) -> ToolInfo:
        if isinstance(call, Malformed):
            raise ToolFault("malformed", call.reason)
        allowed = sorted(self.tools) if row is None else sorted(row.names)
        info = self.tools.get(call.name) if call.name in allowed else None
        if info is None:
            raise ToolFault("unknown_tool", f"there is no tool named {call.name!r}; the tools are {allowed}")
        self.counts[f"tools/{info.name}/calls"] += 1
        problem = check_arguments(info, call.arguments)
        if problem is not None:
            raise ToolFault("bad_arguments", problem)
        return info

    def _answer(self, info: ToolInfo, future: Any, step: int | None) -> str:
        from concurrent.futures.process import BrokenProcessPool

        from pebble import ProcessExpired

        try:
            return future.result()
        except ToolFault as fault:
            return self._fault(info.name, fault, step)
        except FutureTimeout:
            return self._fault(info.name, ToolFault("timeout", f"no result within {self.timeout_s:g} s"), step)
        except ProcessExpired as exc:
            return self._fault(info.name, ToolFault("crashed", f"the tool's process died ({exc})"), step)
        except BrokenProcessPool as exc:  # the workers cannot start or all died: fresh ones for the next call
            self.close()
            return self._fault(info.name, ToolFault("crashed", f"the tool worker processes died ({exc})"), step)

    def _fault(self, name: str, fault: ToolFault, step: int | None) -> str:
        # malformed calls and calls of a tool the row does not have belong to no tool
        who = name if name in self.tools and fault.kind != "unknown_tool" else "_call"
        self.counts[f"tools/{who}/{fault.kind}"] += 1
        at = f" at step {step}" if step is not None else ""
        counted = f"counted in tools/{who}/{fault.kind}; said once per tool and fault"
        self.say_once((who, fault.kind), f"warning: tool call {fault.kind}{at} ({who}): {fault.message} (the model "
                                         f"is told; {counted})")  # fmt: skip
        return f"error: {fault.message}"

    def say_once(self, key: tuple[str, str], line: str) -> None:
        """A fault's line, the first time its (tool, kind) is seen: on ``stream`` (stderr), or kept for
        :meth:`take_lines` when ``stream`` is a list (a Ray worker's box: the driver says it, once for the run)."""
        if key in self.said:
            return
        self.said.add(key)
        if isinstance(self.stream, list):
            self.stream.append((key, line))
        else:
            print(line, file=self.stream or sys.stderr, flush=True)

    def take_lines(self) -> list[tuple[tuple[str, str], str]]:
        """The lines kept since the last call (``stream`` a list)."""
        lines = list(self.stream) if isinstance(self.stream, list) else []
        if lines:
            self.stream.clear()
        return lines

    def metrics(self) -> dict[str, float]:
        """The counts since the last call (a step's)."""
        out = {k: float(v) for k, v in sorted(self.counts.items())}
        self.counts.clear()
        return out

    def _workers(self) -> Any:
        from pebble import ProcessPool

        if self._pool is None:  # spawned: the trainer holds torch and Ray threads that fork would copy
            self._pool = ProcessPool(max_workers=self.num_workers, context=mp.get_context("spawn"))
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.stop()
            self._pool.join()
            self._pool = None
