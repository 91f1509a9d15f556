"""Tool calls in the model's own text: Qwen3's (Hermes') format, parsed strictly.

A Qwen3 turn that calls tools holds one or more blocks ::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12 * 34"}}
    </tool_call>

(Qwen3's chat template renders them so; ``apply_chat_template(tools=...)`` puts the schemas in the system turn and
tells the model this format). A block must hold one JSON object with a string ``name`` and an object
``arguments``; anything else (an unclosed block, bad JSON, a list, a missing field) is a :class:`Malformed` call:
the model gets an error message back instead of a result, and the call is counted. Text outside the blocks is the
model's own and left alone. How we differ from verl's ``HermesToolParser``: verl drops a block it cannot decode
and logs it; here the model is told, so it can learn the format from the error.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class Malformed:
    """A block that is not a call; ``reason`` is what the model is told."""

    reason: str


def parse_tool_calls(text: str, max_calls: int) -> list[ToolCall | Malformed]:
    """The calls of one model turn, in order; at most ``max_calls`` (the rest are one :class:`Malformed`)."""
    found: list[ToolCall | Malformed] = [_parse_block(m.group(1)) for m in _BLOCK.finditer(text)]
    tail = _BLOCK.sub("", text)
    if OPEN in tail or CLOSE in tail:
        found.append(Malformed(f"a {OPEN} block is not closed by {CLOSE} (or a {CLOSE} has no {OPEN})"))
    if len(found) > max_calls:
        found = [*found[:max_calls], Malformed(f"{len(found) - max_calls} calls over the limit of {max_calls} a turn")]
    return found


def _parse_block(body: str) -> ToolCall | Malformed:
    try:
        value = json.loads(body)
    except json.JSONDecodeError as exc:
        return Malformed(f"the {OPEN} block is not valid JSON ({exc.msg} at character {exc.pos})")
    if not isinstance(value, dict):
        return Malformed(f'the {OPEN} block must hold one JSON object {{"name": ..., "arguments": {{...}}}}')
    name, arguments = value.get("name"), value.get("arguments", {})
    if not isinstance(name, str) or not name:
        return Malformed('the call has no "name" string')
    if not isinstance(arguments, dict):
        return Malformed(f'the "arguments" of {name} must be a JSON object')
    extra = sorted(set(value) - {"name", "arguments"})
    if extra:
        return Malformed(f"the call holds keys other than name and arguments: {extra}")
    return ToolCall(name, arguments)
