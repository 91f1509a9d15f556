"""Reading local dataset files (parquet / JSON lines) as downloaded from a dataset hub, without the hub.

How we differ from verl: verl's preprocess scripts call ``datasets.load_dataset(<hub name>)``, which needs
network access (or a pre-populated HF cache). We only read files the user already has, in each dataset's
public column layout, and fail with one line naming the path and what was expected. Text must be UTF-8: a file
that is not is named with the line (JSON lines) or the row and column (parquet), not a bare UnicodeDecodeError.
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


def _not_utf8(path: Path, where: str, exc: UnicodeDecodeError, chunk: bytes) -> UserError:
    byte = chunk[exc.start : exc.start + 1].hex()
    return UserError(
        f"dataset file '{path}' {where} is not UTF-8 text (byte 0x{byte}); re-encode the file as UTF-8, e.g. "
        f"`iconv -f latin1 -t utf-8 {path.name} > fixed{path.suffix}`"
    )


def _iter_json_lines(path: Path):
    # bytes, decoded line by line: a UnicodeDecodeError from a text-mode file names neither the file nor the line
    with path.open("rb") as fh:
        first = fh.read(1)
        fh.seek(0)
        if first == b"[":  # a .json file holding one array of records
            data = fh.read()
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as exc:
                lineno = data[: exc.start].count(b"\n") + 1
                raise _not_utf8(path, f"line {lineno}", exc, data) from None
            try:
                yield from json.loads(text)
            except json.JSONDecodeError as exc:
                raise UserError(f"dataset file '{path}' is not valid JSON: {exc}") from None
            return
        for lineno, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise _not_utf8(path, f"line {lineno}", exc, raw) from None
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(f"dataset file '{path}' line {lineno} is not valid JSON: {exc.msg}") from None


def _parquet_rows(path: Path, columns: list[str]) -> list[dict]:
    import pyarrow.parquet as pq

    table = pq.read_table(path, columns=columns)
    try:
        return table.to_pylist()
    except UnicodeDecodeError as exc:  # a string column holding bytes that are not UTF-8: find the cell
        for name in columns:
            column = table.column(name)
            for i in range(len(column)):
                try:
                    column[i].as_py()
                except UnicodeDecodeError as cell:
                    raise _not_utf8(path, f"row {i} (column '{name}')", cell, cell.object) from None
        raise _not_utf8(path, "(a string column)", exc, exc.object) from None


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
        return _parquet_rows(path, columns)
    rows = []
    for i, row in enumerate(_iter_json_lines(path)):
        absent = [c for c in columns if c not in row]
        if absent:
            raise UserError(f"dataset file '{path}' row {i} has no key '{absent[0]}' (keys: {sorted(row)})")
        rows.append({c: row[c] for c in columns})
    return rows
