"""Tools a model calls during multi-turn rollout (agent_loop.py, docs/agent.md): the shipped ``calculator`` and
``python`` (a sandboxed runner), user tools by import path, Qwen3's tool-call format, and :class:`ToolBox`, which
runs calls in worker processes with every fault told to the model, counted and bounded.

Importing this package imports neither torch nor transformers (the tool workers start quickly).
"""

from .calls import Malformed, ToolCall, parse_tool_calls
from .errors import ToolFault

__all__ = ["Malformed", "ToolCall", "ToolFault", "parse_tool_calls"]
