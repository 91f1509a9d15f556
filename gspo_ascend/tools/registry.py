"""Tools by name: the shipped ones, and user tools named by import path like ``reward.reward_fn``.

``tools.names`` in the config lists what a run's model may call: ``calculator`` and ``python`` are shipped
(calculator.py, python_runner.py); anything else is ``package.module:function`` or ``path/to/file.py:function``.
A tool's JSON schema, what the chat template shows the model, is read from its signature and Google-style
docstring by transformers' ``get_json_schema`` (the same call ``apply_chat_template(tools=[fn])`` makes), so a
user tool is a plain typed, documented function; one that transformers cannot describe is refused at start in one
line. Arguments are checked against that schema (jsonschema) before the tool runs.

A tool's keyword-only parameters (after ``*``) are hidden from the model: documented like the others, left out of
the schema, and filled per row from verl's ``extra_info.tools_kwargs`` (plan.py), e.g. a ground truth a checking
tool compares with.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

from ..errors import UserError

SHIPPED = {
    "calculator": "gspo_ascend.tools.calculator:calculator",
    "python": "gspo_ascend.tools.python_runner:python",
}


@dataclass(frozen=True)
class ToolInfo:
    name: str  # what the model calls it: the function's name
    path: str  # where a worker process finds it
    schema: dict[str, Any]  # {"type": "function", "function": {"name", "description", "parameters"}}
    hidden: frozenset[str] = frozenset()  # keyword-only parameters: per-row values, not the model's
    hidden_required: frozenset[str] = frozenset()  # those without a default


@cache
def load_function(path: str) -> Callable[..., Any]:
    from ..rewards.user_fn import load_reward_fn

    try:
        return load_reward_fn(path)
    except UserError as exc:  # the reward loader's message names a "reward function": say tool
        raise UserError(str(exc).replace("reward function", "tool", 1)) from None


def describe(spec: str) -> ToolInfo:
    """A tool named in ``tools.names``: a shipped name or an import path; UserError when it cannot be used."""
    from transformers.utils import get_json_schema

    path = SHIPPED.get(spec, spec)
    fn = load_function(path)
    try:
        schema = get_json_schema(fn)
    except Exception as exc:  # transformers' TypeHintParsingException / DocstringParsingException
        raise UserError(
            f"tool '{spec}': transformers cannot describe it to the model ({type(exc).__name__}: {exc}); give it "
            "type hints and a Google-style docstring with an Args: section"
        ) from None
    hidden = {p.name: p for p in inspect.signature(fn).parameters.values() if p.kind is p.KEYWORD_ONLY}
    parameters = schema["function"].get("parameters")
    if hidden and parameters:
        parameters["properties"] = {k: v for k, v in parameters.get("properties", {}).items() if k not in hidden}
        if "required" in parameters:
            parameters["required"] = [k for k in parameters["required"] if k not in hidden]
    required = frozenset(k for k, p in hidden.items() if p.default is p.empty)
    return ToolInfo(schema["function"]["name"], path, schema, frozenset(hidden), required)


def check_arguments(info: ToolInfo, arguments: dict[str, Any]) -> str | None:
    """What is wrong with ``arguments`` for ``info`` (None when they fit its schema)."""
    import jsonschema

    parameters = dict(info.schema["function"].get("parameters", {"type": "object", "properties": {}}))
    parameters.setdefault("additionalProperties", False)
    try:
        jsonschema.validate(arguments, parameters)
    except jsonschema.ValidationError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        return f"bad arguments for {info.name}: {exc.message}" + (f" (at {where})" if where else "")
    return None
