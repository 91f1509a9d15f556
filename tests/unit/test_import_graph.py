"""No import circle anywhere in the tree (issue #44): the package, patches/, benchmarks/, scripts/ and tests/.

Every import statement counts, wherever it is: at module level, inside a function (the lazy imports that keep the
package importable on a bare box) and under ``TYPE_CHECKING``. A lazy import does not fail at run time the way a
module-level circle does, but it still ties two modules into one unit that can only be read, tested and changed
together; the two the issue named (``benchmarks/e2e_sides.py`` <-> ``benchmarks/verl_side/side.py``,
``engines/megatron.py`` <-> ``engines/megatron_offload.py``) were of that kind. ``from pkg import name`` is an
edge to ``pkg.name`` when that is a module of the tree, else to ``pkg`` itself. The benchmarks run with
``benchmarks/`` on ``sys.path`` (``from procstats import ...``), so a bare name there also resolves inside it.
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

from tests.conftest import REPO

ROOTS = ("gspo_ascend", "patches", "benchmarks", "scripts", "tests")


def module_names(root: Path, tops: tuple[str, ...]) -> dict[str, Path]:
    names = {}
    for top in tops:
        for path in (root / top).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            if any(p.startswith(".") for p in parts):
                continue
            names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imported(module: str, path: Path, node: ast.Import | ast.ImportFrom, modules: dict[str, Path]) -> set[str]:
    """The modules of the tree that ``node`` (in ``module``, at ``path``) imports."""
    if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
    else:
        if node.level:
            package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
            base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        subs = [f"{base}.{a.name}" for a in node.names]
        targets = [s for s in subs if s in modules or f"benchmarks.{s}" in modules]
        if len(targets) < len(subs):  # a name defined in base itself
            targets.append(base)
    found = set()
    for target in targets:
        for candidate in (target, f"benchmarks.{target}"):
            if candidate in modules and candidate != module:
                found.add(candidate)
    return found


def import_graph(root: Path, tops: tuple[str, ...] = ROOTS) -> dict[str, set[str]]:
    modules = module_names(root, tops)
    graph = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        nodes = [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]
        graph[module] = set().union(*(imported(module, path, n, modules) for n in nodes))
    return graph


def circle(graph: dict[str, set[str]]) -> list[str] | None:
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        return exc.args[1]
    return None


def test_the_tree_has_no_import_circle():
    graph = import_graph(REPO)
    assert len(graph) > 250  # every module of the five roots
    assert circle(graph) is None, " -> ".join(circle(graph))


@pytest.mark.parametrize(
    "files",
    [
        {"pkg/__init__.py": "", "pkg/a.py": "from . import b\n", "pkg/b.py": "def f():\n    from .a import x\n"},
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n",
            "pkg/b.py": "import pkg.a\n",
        },
        {"benchmarks/one.py": "def f():\n    from two import g\n", "benchmarks/two.py": "import one\n"},
    ],
    ids=["lazy-relative", "type-checking", "benchmarks-path"],
)
def test_the_check_finds_a_circle_of_each_kind(tmp_path, files):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    tops = tuple(sorted({name.split("/")[0] for name in files}))
    found = circle(import_graph(tmp_path, tops))
    assert found is not None and len(set(found)) == 2, found
