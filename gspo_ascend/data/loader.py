"""Loading RL prompts: parquet/JSON-lines rows -> chat-templated, tokenized prompts with their ground truths.

How we differ from verl's ``RLHFDataset``: no torch ``Dataset``/``DataLoader`` (the trainer asks for one batch
of prompts per step; the sampler in :mod:`.sampler` is the resumable part), prompts are tokenized once at load
time, and an over-long prompt is either filtered (counted, and reported once by :func:`report_filtered`) or a
one-line error naming the file, the row and ``data.max_prompt_length`` (verl's truncation error names neither
the file nor the row). A message whose content is null is refused with its file and row (``str(None)`` would
have trained on the prompt text "None").

The ground truth is read from the dotted ``answer_key`` (e.g. ``answer`` or ``reward_model.ground_truth``);
when that key is absent but the row has verl's ``reward_model.ground_truth``, that is used.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UserError
from .sources import DATA_SUFFIXES, columns_of, read_rows

VERL_ANSWER_KEY = "reward_model.ground_truth"


@dataclass
class PromptRecord:
    prompt_ids: list[int]  # chat template applied, generation prompt added
    messages: list[dict]
    ground_truth: str
    data_source: str
    extra_info: dict = field(default_factory=dict)
    source: str = ""  # "file:row", for messages
    tools: Any = None  # tools/plan.py's RowTools: what this row's model may call (None: a run without tools)


@dataclass
class PromptDataset:
    records: list[PromptRecord]
    num_filtered: int  # over-long prompts dropped (overlong="filter")
    files: list[str]

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> PromptRecord:
        return self.records[i]


def _lookup(row: dict, dotted: str) -> Any:
    value: Any = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def _messages(value: Any, where: str, prompt_key: str) -> list[dict]:
    if isinstance(value, str):  # a plain-text prompt column: one user turn
        return [{"role": "user", "content": value}]
    if isinstance(value, Sequence) and value and all(isinstance(m, dict) and "content" in m for m in value):
        if any(m["content"] is None for m in value):
            raise UserError(
                f"{where}: a message in column '{prompt_key}' (data.prompt_key) has no content (null); fix or drop "
                "the row (`gspo-ascend prepare-data` skips rows without a question)"
            )
        return [{"role": str(m.get("role", "user")), "content": str(m["content"])} for m in value]
    raise UserError(
        f"{where}: column '{prompt_key}' (data.prompt_key) must be a string or a list of "
        f"{{role, content}} messages, got {type(value).__name__}"
    )


def _file_rows(path: Path, prompt_key: str, answer_key: str) -> list[dict]:
    if not path.is_file():
        raise UserError(f"dataset file '{path}' does not exist; check data.train_files / data.val_files")
    if path.suffix not in DATA_SUFFIXES:
        raise UserError(f"dataset file '{path}' is not a {'/'.join(DATA_SUFFIXES)} file")
    present = columns_of(path)
    if not present:  # a JSON-lines file without a single record
        raise UserError(f"dataset file '{path}' is empty (no rows)")
    if prompt_key not in present:
        raise UserError(
            f"dataset file '{path}' has no prompt column '{prompt_key}' (columns present: {present}); "
            "set data.prompt_key to the column holding the prompts"
        )
    answer_col = answer_key.split(".")[0]
    if answer_col not in present:
        answer_col = VERL_ANSWER_KEY.split(".")[0]
        if answer_col not in present:
            raise UserError(
                f"dataset file '{path}' has no answer column '{answer_key}' (data.answer_key) nor "
                f"'{VERL_ANSWER_KEY}' (columns present: {present})"
            )
    wanted = [prompt_key, answer_col] + [c for c in ("data_source", "extra_info", "agent_name") if c in present]
    return read_rows(path, list(dict.fromkeys(wanted)))


def _template(tokenizer, messages: list[dict], where: str, tools: list[dict] | None = None) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(f"the tokenizer has no chat template, needed to render the prompt at {where}")
    return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)


def load_prompts(
    files: str | Path | Sequence[str | Path],
    prompt_key: str,
    tokenizer,
    max_prompt_length: int,
    overlong: str = "filter",
    *,
    answer_key: str = "answer",
    tools: Any = None,
) -> PromptDataset:
    """Read, chat-template and tokenize every prompt of ``files``; ``overlong``: "filter" or "error"; ``tools``: a
    run's :class:`~gspo_ascend.tools.plan.ToolPlan` (multi-turn rollout with tool calls): each row's tools, whose
    JSON schemas its template puts before the conversation."""
    if overlong not in ("filter", "error"):
        raise UserError(f"data.overlong_prompts must be 'filter' or 'error', got '{overlong}'")
    paths = [Path(files)] if isinstance(files, (str, Path)) else [Path(f) for f in files]
    if not paths:
        raise UserError("no dataset files given; set data.train_files (e.g. data.train_files=[data/train.parquet])")
    records, filtered = [], 0
    for path in paths:
        rows = _file_rows(path.expanduser(), prompt_key, answer_key)
        wheres = [f"'{path}' row {i}" for i in range(len(rows))]
        messages = [_messages(row[prompt_key], where, prompt_key) for row, where in zip(rows, wheres, strict=True)]
        row_tools = [_row_tools(tools, row, where) for row, where in zip(rows, wheres, strict=True)]
        texts = [
            _template(tokenizer, m, where, tools.schemas(t) if tools else None)
            for m, where, t in zip(messages, wheres, row_tools, strict=True)
        ]
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        for i, row in enumerate(rows):
            if len(ids[i]) > max_prompt_length:
                if overlong == "error":
                    raise UserError(
                        f"prompt at {wheres[i]} is {len(ids[i])} tokens, longer than data.max_prompt_length="
                        f"{max_prompt_length}; raise data.max_prompt_length or set data.overlong_prompts=filter"
                    )
                filtered += 1
                continue
            truth = _lookup(row, answer_key)
            truth = _lookup(row, VERL_ANSWER_KEY) if truth is None else truth
            if truth is None:
                raise UserError(f"{wheres[i]} has no ground truth under '{answer_key}' (data.answer_key)")
            extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
            source = str(row.get("data_source") or "unknown")
            records.append(PromptRecord(ids[i], messages[i], str(truth), source, extra, f"{path}:{i}", row_tools[i]))
    _check_not_empty(records, filtered, paths, max_prompt_length)
    return PromptDataset(records, filtered, [str(p) for p in paths])


def _row_tools(plan: Any, row: dict, where: str) -> Any:
    if plan is None:
        return None
    extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
    return plan.row(str(row.get("data_source") or "unknown"), row.get("agent_name"), extra.get("tools_kwargs"), where)


def report_filtered(dataset: PromptDataset, max_prompt_length: int, of: str = "") -> None:
    """One line on stderr when ``overlong="filter"`` left prompts out (nothing when none were); ``of``: out of what
    ("" for training, " of validation")."""
    if dataset.num_filtered:
        total = dataset.num_filtered + len(dataset)
        print(
            f"warning: {dataset.num_filtered} of {total} prompts in {', '.join(dataset.files)} are longer than "
            f"data.max_prompt_length={max_prompt_length} tokens and were left out{of} (data.overlong_prompts=filter; "
            "=error stops instead); raise data.max_prompt_length to keep them",
            file=sys.stderr,
            flush=True,
        )


def _check_not_empty(records: list, filtered: int, paths: list[Path], max_prompt_length: int) -> None:
    if records:
        return
    names = ", ".join(f"'{p}'" for p in paths)
    if filtered:
        raise UserError(
            f"all {filtered} prompts in {names} are longer than data.max_prompt_length={max_prompt_length} tokens; "
            "raise data.max_prompt_length"
        )
    raise UserError(f"dataset file {names} is empty (no rows)" if len(paths) == 1 else f"datasets {names} are empty")
