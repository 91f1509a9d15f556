"""``gspo-ascend prepare-data``: argument definitions and the entry point, for gspo_ascend/cli.py to wire."""

from __future__ import annotations

import argparse

from .prepare import VALID_KINDS, prepare_data


def add_prepare_data_args(p: argparse.ArgumentParser) -> None:
    # --kind is validated by prepare_data (a UserError listing the kinds), not argparse's choices, so the
    # message matches the one a Python caller gets.
    p.add_argument("--kind", required=True, help=f"dataset layout: {', '.join(VALID_KINDS)}")
    p.add_argument("--input", help="local .parquet/.jsonl file or directory as published (not for 'synthetic')")
    p.add_argument("--output-dir", required=True, help="writes train.parquet (and test.parquet) here")
    p.add_argument("--no-dedupe", action="store_true", help="keep duplicate (question, answer) rows")
    p.add_argument("--seed", type=int, default=0, help="synthetic only: generator seed")
    p.add_argument("--num-train", type=int, default=2048, help="synthetic only: training prompts")
    p.add_argument("--num-test", type=int, default=256, help="synthetic only: held-out test prompts (at most 39)")


def main_prepare_data(args: argparse.Namespace) -> int:
    summary = prepare_data(
        args.kind,
        args.input,
        args.output_dir,
        dedupe=not args.no_dedupe,
        seed=args.seed,
        num_train=args.num_train,
        num_test=args.num_test,
    )
    for split, info in summary.items():
        extra = f", {info['skipped_no_answer']} without a final answer skipped" if info["skipped_no_answer"] else ""
        extra += f", {info['skipped_no_question']} without a question skipped" if info["skipped_no_question"] else ""
        extra += f", {info['duplicates_dropped']} duplicates dropped" if info["duplicates_dropped"] else ""
        print(f"{split}: {info['rows']} rows -> {info['path']}{extra}")
    return 0
