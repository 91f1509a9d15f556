"""Reading local dataset files (parquet / JSON lines) as downloaded from a dataset hub, without the hub.

How we differ from verl: verl's preprocess scripts call ``datasets.load_dataset(<hub name>)``, which needs
network access (or a pre-populated HF cache). We only read files the user already has, in each dataset's
public column layout, and fail with one line naming the path and what was expected.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ..errors import UserError

DATA_SUFFIXES = (".parquet", ".jsonl", ".json")
# Directory scans skip .json: dataset snapshots carry metadata files such as dataset_info.json.
SCANNED_SUFFIXES = (".parquet", ".jsonl")
_TEST_WORDS = {"test", "validation", "valid", "val", "dev", "eval"}


def split_of(path: Path) -> str:
    """``test`` when a word of the file name says so (test, validation, val, dev, eval), else ``train``."""
    words = set(re.split(r"[^a-z]+", path.name.lower()))
    return "test" if words & _TEST_WORDS else "train"


def find_data_files(input_path: str | Path) -> dict[str, list[Path]]:
    """Data files under ``input_path`` (one file or a directory, searched recursively) grouped by split.

    A directory holding data in several sub-folders (gsm8k ships ``main/`` and ``socratic/``) is ambiguous:
    we refuse it and name the folders rather than mix two variants of a dataset.
    """
    path = Path(input_path).expanduser()
    if not path.exists():
        raise UserError(f"dataset path '{path}' does not exist; pass a local .parquet/.jsonl file or a directory")
    if path.is_file():
        if path.suffix not in DATA_SUFFIXES:
            raise UserError(f"dataset file '{path}' is not a {'/'.join(DATA_SUFFIXES)} file")
        return {split_of(path): [path]}
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SCANNED_SUFFIXES)
    if not files:
        raise UserError(f"no {'/'.join(SCANNED_SUFFIXES)} files under '{path}'")
    folders = sorted({str(p.parent.relative_to(path)) for p in files})
    if len(folders) > 1:
        raise UserError(
            f"'{path}' holds data files in several folders ({', '.join(folders)}); pass one of them, "
            f"e.g. '{path / folders[-1]}'"
        )
    splits: dict[str, list[Path]] = {}
    for p in files:
        splits.setdefault(split_of(p), []).append(p)
    return splits


def columns_of(path: Path) -> list[str]:
    """Column names of a parquet file (from its footer) or of the first record of a JSON-lines file."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return list(pq.read_schema(path).names)
        except Exception as exc:
            raise UserError(f"dataset file '{path}' is not readable parquet: {str(exc).splitlines()[0]}") from None
    for row in _iter_json_lines(path):
        return list(row)
    return []


def _iter_json_lines(path: Path):
    with path.open(encoding="utf-8") as fh:
        first = fh.read(1)
        fh.seek(0)
        if first == "[":  # a .json file holding one array of records
            try:
                yield from json.load(fh)
            except json.JSONDecodeError as exc:
                raise UserError(f"dataset file '{path}' is not valid JSON: {exc}") from None
            return
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(f"dataset file '{path}' line {lineno} is not valid JSON: {exc.msg}") from None


def read_rows(path: Path, columns: list[str]) -> list[dict]:
    """Rows of one file as dicts (nested parquet structs/lists become dicts/lists); checks ``columns`` exist."""
    present = columns_of(path)
    if not present:  # a JSON-lines file without a single record
        raise UserError(f"dataset file '{path}' is empty (no rows)")
    missing = [c for c in columns if c not in present]
    if missing:
        raise UserError(
            f"dataset file '{path}' has no column '{missing[0]}' (columns present: {present}); "
            "is this the right --kind for the file?"
        )
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path, columns=columns).to_pylist()
    rows = []
    for i, row in enumerate(_iter_json_lines(path)):
        absent = [c for c in columns if c not in row]
        if absent:
            raise UserError(f"dataset file '{path}' row {i} has no key '{absent[0]}' (keys: {sorted(row)})")
        rows.append({c: row[c] for c in columns})
    return rows
