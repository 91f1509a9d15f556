"""``prepare_data``: local gsm8k / MATH-lighteval / DAPO-Math-17k files (or the synthetic task) -> RL parquet.

Output (``train.parquet``, and ``test.parquet`` when the input has a test split), one row per prompt::

    data_source   str                              e.g. "openai/gsm8k"
    prompt        list<struct<role: str, content: str>>   chat messages; the last asks for \\boxed{}
    ability       str                              "math"
    reward_model  struct<style: str, ground_truth: str>   style "rule"
    extra_info    struct<split: str, index: int64> index = row number in the input split
    agent_name    str (kind verl, where the input has it)  verl's agent loop: tool_agent | single_turn_agent

Kind ``verl`` reads rows already in that schema (a verl preprocessor's output, e.g. its tool-agent gsm8k) and keeps
their messages as written, with the tool-use fields: ``agent_name`` and ``extra_info.tools_kwargs`` (what
tools/plan.py gives each row's tools); its ``extra_info`` struct is then inferred from the rows.

How we differ from verl's preprocess scripts: the same columns (a verl parquet loads here and ours in verl),
but inputs are local files (no hub), every prompt asks for the answer in ``\\boxed{}`` (DAPO's "Answer:"
instruction is replaced, so one math-verify scorer fits all three), ground truths are plain strings
(gsm8k's thousands separators removed), rows whose final answer cannot be found (a gsm8k ``####`` with
nothing after it included) or whose question is null or empty are skipped and counted (never turned into an
empty ground truth or the prompt text "None"), and duplicate (question, answer) pairs are dropped: the
published DAPO-Math-17k parquet repeats its ~17k problems many times over (deduplicated community copies exist
for that reason), so one "epoch" of it would silently be many passes over the same problems.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError
from ..rewards.math_answer import INSTRUCTION, extract_boxed
from .sources import find_data_files, read_rows

# Qwen2.5-Math's wording; Qwen models were tuned on it, so it costs nothing in accuracy to standardise on it.
_DAPO_HEAD = "Solve the following math problem step by step."
_DAPO_TAIL = '\n\nRemember to put your answer on its own line after "Answer:"'


@dataclass(frozen=True)
class Kind:
    name: str
    data_source: str
    columns: tuple[str, ...]
    # row -> (question or None when null / empty, ground truth, data_source or None for the default);
    # None = no final answer, skip
    convert: Callable[[dict], tuple[str | None, str, str | None] | None]


def _text(value) -> str | None:
    """A text cell, stripped; None for a null or blank one (``str(None)`` would be the text "None")."""
    text = "" if value is None else str(value).strip()
    return text or None


def _gsm8k(row: dict):
    answer = _text(row["answer"])
    if answer is None or "####" not in answer:
        return None
    truth = answer.rsplit("####", 1)[1].strip().replace(",", "")
    return (_text(row["question"]), truth, None) if truth else None  # "#### " alone: no final answer


def _math_lighteval(row: dict):
    boxed = extract_boxed(_text(row["solution"]) or "")
    return (_text(row["problem"]), boxed, None) if boxed else None


def dapo_question(content: str) -> str:
    """The problem text inside DAPO-Math-17k's user message, without its "Answer:" format instructions."""
    text = content.strip()
    if text.startswith(_DAPO_HEAD) and "\n\n" in text:
        text = text.split("\n\n", 1)[1]
    return text.split(_DAPO_TAIL, 1)[0].strip()


def _dapo_math(row: dict):
    prompt, reward = row["prompt"], row["reward_model"] or {}
    user = [m for m in (prompt or []) if isinstance(m, dict) and m.get("role") == "user"]
    truth = reward.get("ground_truth") if isinstance(reward, dict) else None
    if not user or truth is None or str(truth).strip() == "":
        return None
    content = _text(user[-1].get("content"))
    return _text(dapo_question(content)) if content else None, str(truth).strip(), row.get("data_source") or None


KINDS: dict[str, Kind] = {
    "gsm8k": Kind("gsm8k", "openai/gsm8k", ("question", "answer"), _gsm8k),
    "math_lighteval": Kind(
        "math_lighteval", "DigitalLearningGmbH/MATH-lighteval", ("problem", "solution"), _math_lighteval
    ),
    "dapo_math": Kind(
        "dapo_math", "BytedTsinghua-SIA/DAPO-Math-17k", ("prompt", "reward_model", "data_source"), _dapo_math
    ),
}
SYNTHETIC = "synthetic"
SYNTHETIC_TOOLS = "synthetic-tools"  # two-digit products, the tool-use demo's task (tiny_tools.py)
VERL = "verl"  # rows already in verl's RL schema (e.g. its tool-agent preprocessors'): checked, kept as written
VALID_KINDS = (*KINDS, SYNTHETIC, SYNTHETIC_TOOLS, VERL)
_VERL_OPTIONAL = ("data_source", "ability", "extra_info", "agent_name")


def output_schema():
    import pyarrow as pa

    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    return pa.schema(
        [
            ("data_source", pa.string()),
            ("prompt", pa.list_(message)),
            ("ability", pa.string()),
            ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
            ("extra_info", pa.struct([("split", pa.string()), ("index", pa.int64())])),
        ]
    )


def make_row(data_source: str, messages: list[dict], ground_truth: str, split: str, index: int) -> dict:
    return {
        "data_source": data_source,
        "prompt": messages,
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": split, "index": index},
    }


def _convert_split(kind: Kind, files: list[Path], split: str, dedupe: bool) -> tuple[list[dict], dict]:
    rows, seen, skipped, no_question, duplicates, index = [], set(), 0, 0, 0, 0
    for path in files:
        for raw in read_rows(path, list(kind.columns)):
            converted = kind.convert(raw)
            index += 1
            if converted is None:
                skipped += 1
                continue
            question, truth, source = converted
            if question is None:
                no_question += 1
                continue
            if dedupe and (question, truth) in seen:
                duplicates += 1
                continue
            seen.add((question, truth))
            messages = [{"role": "user", "content": f"{question}\n{INSTRUCTION}"}]
            rows.append(make_row(source or kind.data_source, messages, truth, split, index - 1))
    return rows, {
        "rows": len(rows),
        "skipped_no_answer": skipped,
        "skipped_no_question": no_question,
        "duplicates_dropped": duplicates,
    }


def _convert_verl_split(files: list[Path], split: str, dedupe: bool) -> tuple[list[dict], dict]:
    """verl-schema rows (kind ``verl``): the prompt messages kept as written (no answer instruction added: the
    preprocessor that wrote them chose it), the ground truth as text, and the tool-use fields verl's agent loop
    reads kept: ``agent_name`` and ``extra_info.tools_kwargs`` / ``need_tools_kwargs`` (tools/plan.py reads them).
    A row without messages or a ground truth is skipped and counted, like the other kinds."""
    from .sources import columns_of

    rows, seen, skipped, no_question, duplicates, index = [], set(), 0, 0, 0, 0
    for path in files:
        optional = [c for c in _VERL_OPTIONAL if c in columns_of(path)]
        for raw in read_rows(path, ["prompt", "reward_model", *optional]):
            index += 1
            reward = raw["reward_model"] if isinstance(raw["reward_model"], dict) else {}
            truth = _text(reward.get("ground_truth"))
            prompt = raw["prompt"]
            if isinstance(prompt, str):
                prompt = [{"role": "user", "content": prompt}]
            messages = [m for m in prompt or [] if isinstance(m, dict) and _text(m.get("content"))]
            if truth is None:
                skipped += 1
                continue
            if not messages or len(messages) != len(prompt):
                no_question += 1
                continue
            key = (repr(messages), truth)
            if dedupe and key in seen:
                duplicates += 1
                continue
            seen.add(key)
            messages = [{"role": str(m.get("role", "user")), "content": str(m["content"])} for m in messages]
            row = make_row(raw.get("data_source") or "unknown", messages, truth, split, index - 1)
            row["ability"] = raw.get("ability") or row["ability"]
            extra = raw.get("extra_info") if isinstance(raw.get("extra_info"), dict) else {}
            row["extra_info"] |= {k: extra[k] for k in ("tools_kwargs", "need_tools_kwargs") if extra.get(k)}
            if raw.get("agent_name"):
                row["agent_name"] = str(raw["agent_name"])
            rows.append(row)
    return rows, {"rows": len(rows), "skipped_no_answer": skipped, "skipped_no_question": no_question,
                  "duplicates_dropped": duplicates}  # fmt: skip


def write_parquet(rows: list[dict], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".parquet.tmp")
    # tool-use rows (kind verl): their tools_kwargs differ per tool, so pyarrow infers the structs (the keys of
    # all rows, null where a row lacks one), as verl's own writer (datasets) does
    tooled = any("agent_name" in r or set(r["extra_info"]) - {"split", "index"} for r in rows)
    if tooled:
        for r in rows:
            r.setdefault("agent_name", None)
    pq.write_table(pa.Table.from_pylist(rows, schema=None if tooled else output_schema()), tmp)
    tmp.replace(path)  # readers never see a half-written file


def _synthetic_rows(seed: int, num_train: int, num_test: int, tools: bool = False) -> dict[str, list[dict]]:
    from ..tiny import SYNTHETIC_DATA_SOURCE, synthetic_arithmetic

    if tools:
        from ..tiny_tools import PRODUCTS_DATA_SOURCE, synthetic_products

        return {
            split: [
                make_row(PRODUCTS_DATA_SOURCE, r["prompt"], r["answer"], split, i)
                for i, r in enumerate(synthetic_products(n, seed=seed, split=split, distinct=split == "test"))
            ]
            for split, n in (("train", num_train), ("test", num_test))
        }
    out = {}
    for split, n in (("train", num_train), ("test", num_test)):
        # test: each held-out problem once (39 of them), train: draws, so the sampler sees the task's distribution
        records = synthetic_arithmetic(n, seed=seed, split=split, distinct=split == "test")
        out[split] = [
            make_row(SYNTHETIC_DATA_SOURCE, r["prompt"], r["answer"], split, i) for i, r in enumerate(records)
        ]
    return out


def prepare_data(
    kind: str,
    input_path: str | Path | None,
    output_dir: str | Path,
    *,
    dedupe: bool = True,
    seed: int = 0,
    num_train: int = 2048,
    num_test: int = 256,
) -> dict[str, dict]:
    """Convert a local dataset to ``output_dir/{train,test}.parquet``; returns per-split counts and paths.

    ``kind``: gsm8k | math_lighteval | dapo_math | verl (read ``input_path``: one file or a directory) or synthetic
    (the tiny arithmetic task of :mod:`gspo_ascend.tiny`; ``seed``, ``num_train``, ``num_test`` apply; its test
    split holds each of the 39 held-out problems at most once, so ``num_test`` above 39 gives 39).
    """
    if kind not in VALID_KINDS:
        raise UserError(f"unknown dataset kind '{kind}'; valid kinds: {', '.join(VALID_KINDS)}")
    out_dir = Path(output_dir).expanduser()
    if kind in (SYNTHETIC, SYNTHETIC_TOOLS):
        by_split = _synthetic_rows(seed, num_train, num_test, tools=kind == SYNTHETIC_TOOLS)
        zero = {"skipped_no_answer": 0, "skipped_no_question": 0, "duplicates_dropped": 0}
        summary = {s: {"rows": len(r), **zero} for s, r in by_split.items()}
    else:
        if input_path is None:
            raise UserError(f"dataset kind '{kind}' needs an input path (a local .parquet/.jsonl file or directory)")
        by_split, summary = {}, {}
        for split, files in sorted(find_data_files(input_path).items()):
            if kind == VERL:
                by_split[split], summary[split] = _convert_verl_split(files, split, dedupe)
            else:
                by_split[split], summary[split] = _convert_split(KINDS[kind], files, split, dedupe)
    for split, rows in by_split.items():
        if not rows:
            skipped = summary[split]["skipped_no_answer"] + summary[split]["skipped_no_question"]
            why = f"all {skipped} rows had no question or no final answer; is this the right --kind?"
            why = why if skipped else "it is empty"
            raise UserError(f"dataset kind '{kind}': the {split} split of '{input_path}' gave no rows: {why}")
        path = out_dir / f"{split}.parquet"
        write_parquet(rows, path)
        summary[split]["path"] = str(path)
    return summary


def embedded_data_dir(tools: bool = False) -> Path:
    """The synthetic task's ``train.parquet`` and held-out ``test.parquet``, built on first use; ``tools``: the
    tool-use demo's products (64 held-out problems in test). The directory is named after the task's version, so a
    cache written by an older release (no held-out split) is never read."""
    from ..tiny import SYNTHETIC_VERSION, gspo_home

    name = "synthetic-tools-v1" if tools else f"synthetic-v{SYNTHETIC_VERSION}"
    out = gspo_home() / "data" / name
    if not all((out / f"{split}.parquet").is_file() for split in ("train", "test")):
        prepare_data(SYNTHETIC_TOOLS if tools else SYNTHETIC, None, out, seed=0, num_test=64 if tools else 256)
    return out
