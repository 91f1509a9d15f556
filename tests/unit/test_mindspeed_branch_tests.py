"""The compatibility branch's tests are the doc's (issue #40): the table in docs/mindspeed-branches.md names them,
tests/mindspeed/branch_tests.py reads them, scripts/check_mindspeed.sh --branch 2.2.0 runs them. Here: every test
the table names exists (file, and function when a node id), every row names one, and the reader follows the
column's conventions on a table written here."""

from __future__ import annotations

import ast
import subprocess
import sys

from tests.conftest import REPO
from tests.mindspeed import branch_tests

TABLE = """\
## What differs between them for us

Text.

| what | 2.2.0 | 26.1.0 | what we do | test |
|---|---|---|---|---|
| a | x | y | z | `tests/mindspeed/test_a.py` (the `ms_dense_cp2` case), `tests/unit/test_u.py` |
| b | x | y | z | `test_b.py::test_one`, `::test_two`, the whole suite on 26.1.0 |
| c | x | y | z | `test_a.py::test_inside_a`, `test_b.py::test_one` |

After the table: `tests/mindspeed/test_not_in_the_table.py`.
"""


def test_reader_follows_the_columns_conventions():
    assert branch_tests.cell_tests("`tests/unit/test_u.py`, `test_c.py::t`, `::u`, `ms_x`") == [
        "tests/unit/test_u.py",
        "tests/mindspeed/test_c.py::t",
        "tests/mindspeed/test_c.py::u",
    ]
    # tests/unit/ left out, a node id of a whole file listed absorbed, a repeated one listed once
    assert branch_tests.distinguishing_tests(TABLE) == [
        "tests/mindspeed/test_a.py",
        "tests/mindspeed/test_b.py::test_one",
        "tests/mindspeed/test_b.py::test_two",
    ]


def _defined(path, name: str) -> bool:
    tree = ast.parse(path.read_text())
    return any(isinstance(node, ast.FunctionDef) and node.name == name for node in tree.body)


def test_every_test_the_doc_names_exists_and_every_row_has_one():
    rows = branch_tests.table_rows(branch_tests.DOC.read_text())
    assert len(rows) >= 10
    for row in rows:
        named = branch_tests.cell_tests(row["test"])
        assert named, f"the row {row['what']!r} names no test"
        for test in named:
            path, _, name = test.partition("::")
            assert (REPO / path).is_file(), test
            assert not name or _defined(REPO / path, name), test


def test_the_script_reads_the_list_from_the_doc():
    listed = subprocess.run(
        [sys.executable, "-m", "tests.mindspeed.branch_tests"], capture_output=True, text=True, cwd=REPO, check=True
    ).stdout.splitlines()
    assert listed == branch_tests.distinguishing_tests()
    assert "tests/mindspeed/test_mindspeed_engine.py" in listed  # the engine's cases differ (CP, MoE permute, MC2)
    assert all(t.startswith("tests/mindspeed/") for t in listed)
    assert '"$PY" -m tests.mindspeed.branch_tests' in (REPO / "scripts/check_mindspeed.sh").read_text()
