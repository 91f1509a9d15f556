"""House rules on the shape of the code (DEVELOPERS.md, Standards): functions stay under ~80 lines, and a file over
~600 lines says in its module docstring why it is one file.

"~80" is held here at 90 lines a function (decorators and docstring included), "~600" at 620 lines a file; a file
past that names its reason in a sentence of its docstring that says "one file" (the form used is "Why one file over
600 lines: ..."). The rules cover every Python tree we ship and the tests; a test cannot check that the reason is a
good one, only that it was written where a reader looks.
"""

from __future__ import annotations

import ast
import re

from tests.conftest import REPO

SCANNED = ["gspo_ascend", "patches", "scripts", "benchmarks", "env", "tests"]
MAX_FUNCTION_LINES = 90
MAX_FILE_LINES = 620
REASON = re.compile(r"\bone file\b", re.IGNORECASE)


def shape_faults(source: str, filename: str) -> list[str]:
    tree = ast.parse(source, filename)
    faults = []
    lines = source.count("\n")
    if lines > MAX_FILE_LINES and not REASON.search(ast.get_docstring(tree) or ""):
        faults.append(f"{filename}: {lines} lines and its docstring does not say why it is one file")
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            length = node.end_lineno - first + 1
            if length > MAX_FUNCTION_LINES:
                faults.append(f"{filename}:{node.lineno}: {node.name} is {length} lines")
    return faults


def function_of(lines: int) -> str:
    return "def f():\n" + "".join(f"    x{i} = {i}\n" for i in range(lines - 1))


def test_the_checker_finds_a_long_function_and_an_unexplained_long_file():
    assert shape_faults(function_of(MAX_FUNCTION_LINES + 1), "f.py") == [f"f.py:1: f is {MAX_FUNCTION_LINES + 1} lines"]
    assert shape_faults("@decorated\n" + function_of(MAX_FUNCTION_LINES), "f.py") == [
        f"f.py:2: f is {MAX_FUNCTION_LINES + 1} lines"
    ]
    assert shape_faults(function_of(MAX_FUNCTION_LINES), "ok.py") == []
    filler = "".join(f"y{i} = {i}\n" for i in range(MAX_FILE_LINES))
    assert shape_faults(f'"""A module."""\n{filler}', "m.py") == [
        f"m.py: {MAX_FILE_LINES + 1} lines and its docstring does not say why it is one file"
    ]
    assert shape_faults(f'"""A module.\n\nWhy one file over 600 lines: a reason."""\n{filler}', "m.py") == []
    assert shape_faults(f'"""A module."""\n{filler[: filler.rindex("y")]}', "short.py") == []


def test_functions_and_files_keep_the_house_sizes():
    faults = []
    for top in SCANNED:
        for path in sorted((REPO / top).rglob("*.py")):
            if any(part.startswith(".") for part in path.relative_to(REPO).parts):
                continue  # venvs and caches inside the tree are not ours
            faults += shape_faults(path.read_text(), str(path.relative_to(REPO)))
    assert faults == [], "\n".join(faults)
