"""The tests that tell MindSpeed's branches apart, read from docs/mindspeed-branches.md (issue #40).

The doc's table "What differs between them for us" names, per difference, the test that holds it (its last
column). That column is the one list: ``scripts/check_mindspeed.sh --branch 2.2.0`` (the branch kept for
compatibility) runs these tests and not the whole of tests/mindspeed/, which the maintained 26.1.0 runs.

    python -m tests.mindspeed.branch_tests     prints them, one pytest path or node id per line

In the column, each backticked ``tests/...`` path or bare ``test_*.py`` file (meaning tests/mindspeed/) starts a
test, optionally with ``::name``; a backticked ``::name`` that follows is another test of the same file. Other
backticked words (case names such as ``ms_dense_cp2``) are comments. Paths outside tests/mindspeed/ (tests/unit/)
run in the main suite and are left out here. tests/unit/test_mindspeed_branch_tests.py checks that each names a
real test. Plain Python, no torch: the script runs it before its venv exists.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "mindspeed-branches.md"
HEADING = "## What differs between them for us"
HERE = "tests/mindspeed/"


def table_rows(text: str) -> list[dict[str, str]]:
    """The rows of the first table after HEADING, as {column header: cell}."""
    lines = text[text.index(HEADING) :].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    table = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        table.append([cell.strip() for cell in line.strip().strip("|").split(" | ")])
    header, rows = table[0], table[2:]  # table[1] is the |---| line
    assert all(len(row) == len(header) for row in rows), f"a row of {HEADING!r} has another number of cells"
    return [dict(zip(header, row, strict=True)) for row in rows]


def cell_tests(cell: str) -> list[str]:
    """The tests a cell names, as pytest paths or node ids relative to the repository."""
    tests: list[str] = []
    current = None  # the file a following "::name" belongs to
    for word in re.findall(r"`([^`]+)`", cell):
        if word.startswith("::"):
            if current is None:
                raise ValueError(f"{word!r} follows no test file in {cell!r}")
            tests.append(current + word)
            continue
        path, _, name = word.partition("::")
        if path.startswith("tests/") or re.fullmatch(r"test_\w+\.py", path):
            current = path if path.startswith("tests/") else HERE + path
            tests.append(current + (f"::{name}" if name else ""))
    return tests


def distinguishing_tests(text: str | None = None) -> list[str]:
    """Every tests/mindspeed/ test the table names, in table order, each once; a whole file absorbs its node ids."""
    rows = table_rows(DOC.read_text() if text is None else text)
    named = [t for row in rows for t in cell_tests(row["test"]) if t.startswith(HERE)]
    files = {t for t in named if "::" not in t}
    seen: list[str] = []
    for test in named:
        if test not in seen and test.split("::")[0] not in (files - {test}):
            seen.append(test)
    return seen


if __name__ == "__main__":
    sys.stdout.write("".join(f"{test}\n" for test in distinguishing_tests()))
