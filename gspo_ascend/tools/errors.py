"""A tool call that did not give a result: what the model is told, and the kind it is counted as."""

from __future__ import annotations

KINDS = ("malformed", "unknown_tool", "bad_arguments", "raised", "timeout", "too_long", "crashed")


class ToolFault(Exception):
    def __init__(self, kind: str, message: str) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown tool fault kind {kind!r}")
        super().__init__(message)
        self.kind, self.message = kind, message

    def __reduce__(self):  # crosses from a tool worker process to the trainer
        return (ToolFault, (self.kind, self.message))
