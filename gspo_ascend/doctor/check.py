"""The record every doctor / preflight / planner finding is reported as."""

from __future__ import annotations

from dataclasses import asdict, dataclass

STATUSES = ("ok", "warn", "fail")


@dataclass
class Check:
    name: str
    status: str  # ok | warn | fail
    finding: str  # one line: what was found
    fix: str = ""  # one line: what to do (empty when ok)

    def as_dict(self) -> dict:
        return asdict(self)
