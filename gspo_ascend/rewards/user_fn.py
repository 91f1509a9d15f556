"""User reward functions named by a dotted path: ``package.module:function`` or ``path/to/file.py:function``.

The function is called with keywords, the same signature verl's ``custom_reward_function`` uses, so a verl
scorer works unchanged::

    def my_reward(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None) -> float | dict

A dict return must hold ``score``; an optional ``acc`` is reported as accuracy. How we differ from verl: a bad
path is a one-line :class:`~gspo_ascend.errors.UserError` naming the path and what is missing (verl raises
from deep inside the reward-manager construction), and we check it when the config is loaded, not at step 1.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

from ..errors import UserError

RewardFn = Callable[..., "float | dict"]


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _import_module(module_part: str, spec: str):
    if module_part.endswith(".py"):
        path = Path(module_part).expanduser()
        if not path.is_file():
            raise UserError(f"reward function '{spec}': file '{path}' does not exist")
        name = "_gspo_user_reward_" + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
        file_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(file_spec)
        sys.modules[name] = module  # dataclasses / pickling inside the user file need the module registered
        try:
            file_spec.loader.exec_module(module)
        except Exception as exc:
            sys.modules.pop(name, None)
            raise UserError(f"reward function '{spec}': importing '{path}' failed: {_one_line(exc)}") from None
        return module
    try:
        return importlib.import_module(module_part)
    except ModuleNotFoundError as exc:
        if exc.name and module_part.startswith(exc.name):  # the named module itself (or a parent) is missing
            raise UserError(
                f"reward function '{spec}': module '{module_part}' not found; "
                "check the spelling and that it is importable (on PYTHONPATH) on every node"
            ) from None
        raise UserError(f"reward function '{spec}': importing '{module_part}' failed: {_one_line(exc)}") from None
    except Exception as exc:
        raise UserError(f"reward function '{spec}': importing '{module_part}' failed: {_one_line(exc)}") from None


@lru_cache(maxsize=32)
def load_reward_fn(spec: str) -> RewardFn:
    """Resolve ``module:function`` (or ``file.py:function``) to a callable; UserError when it cannot."""
    module_part, sep, attr = spec.rpartition(":")
    if not sep or not module_part or not attr:
        raise UserError(
            f"reward function '{spec}' must be of the form 'package.module:function' or 'path/to/file.py:function'"
        )
    module = _import_module(module_part, spec)
    fn = getattr(module, attr, None)
    if fn is None:
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))[:10]
        raise UserError(f"reward function '{spec}': '{module_part}' has no function '{attr}' (it has: {public})")
    if not callable(fn):
        raise UserError(f"reward function '{spec}': '{attr}' is a {type(fn).__name__}, not a function")
    return fn
