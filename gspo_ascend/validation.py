"""Validation on held-out prompts: during training (``trainer.test_freq``, ``trainer.val_before_train``) and in
``gspo-ascend eval``, with one code path for both, so an exported checkpoint reproduces a run's numbers.

Per data source and overall (``val/<source>/...`` and ``val/all/...``), over the ``validation.n`` responses of
each prompt:

* ``mean@n``: the accuracy averaged over all responses (the GSPO paper's avg@32 with n = 32);
* ``pass@k``: the chance that at least one of k responses is right, by the unbiased estimator of Chen et al.
  2021 (arXiv 2107.03374): ``1 - C(n - c, k) / C(n, k)`` for c right answers out of n;
* ``maj@k``: the chance that the majority vote of k responses (over the extracted ``\\boxed{}`` answers, exact
  strings; responses without an answer do not vote) is right, exactly: the expectation over all ``C(n, k)``
  subsets, a tie counted as a uniformly random pick among the tied answers (an empty vote is wrong);
* ``response_length_mean`` (tokens), ``truncated`` (responses cut at ``data.max_response_length`` without an
  end-of-sequence token), ``no_answer`` (responses without a boxed answer), ``score_errors`` (responses whose
  scorer raised or timed out: scored 0, their ``status`` in the responses file says which; each is also a line
  of ``reward_errors.log``, the run's or the eval directory's, with the first traceback of each kind), ``prompts``.

"Right" is the scorer's ``acc`` (math-verify's 0/1, or a user function's ``acc``) >= 0.5; mean@n averages ``acc``
itself. The reward is the task score alone: the DAPO overlong penalty shapes training, it is not what a run is
judged by.

Generation is reproducible by construction: the prompts (after the ``validation.max_prompts`` cap, a fixed
subset) are cut into chunks of ``validation.batch_size``, and chunk j is one ``generate`` call seeded
``f(trainer.seed, j)``. A chunk's samples depend only on the weights, its prompts and its seed, not on which
worker ran it or how many there were, so ``gspo-ascend eval`` on one device and the trainer's Ray workers give the
same responses for the same checkpoint. On vLLM that holds with ``rollout.seed_requests`` on (auto: on the host);
off (auto on a GPU / NPU) a sampled response also depends on the requests beside it, while greedy ones do not.

How we differ from verl (``RayPPOTrainer._validate``, ``process_validation_metrics``): verl estimates best@k
and maj@k by 1000 bootstrap resamples of size k (seeded, with replacement, ties to the first answer seen); here
pass@k is the unbiased estimator and maj@k the exact expectation, both deterministic. verl validates again after
every resume when ``val_before_train`` is set; here a resume keeps the schedule: step 0 was validated by the fresh
run and is kept in ``metrics.jsonl``, and steps that are multiples of ``test_freq`` (and the last) are validated
whichever process runs them. Metrics sit in the training step's line (one line per step), step 0 has its own.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

from .errors import UserError

VAL_DIR = "validation"  # <output_dir>/validation/step_N.jsonl: the responses of validation.log_prompts prompts
OVERALL = "all"
CORRECT_AT = 0.5  # acc >= this counts as a right answer for pass@k and maj@k
PREFIX = "val"
_SELECT_SEED = "gspo-ascend:validation-subset"  # the capped subset: the same for every run and seed


# ----------------------------------------------------------------------------------------------- metrics


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al.'s unbiased pass@k for ``c`` right answers among ``n`` samples: 1 - C(n - c, k) / C(n, k)."""
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n, got c={c}, n={n}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)  # exact integers; int / int rounds once


def maj_at_k(answers: Sequence[str | None], accs: Sequence[float], k: int) -> float:
    """Expected correctness of the majority vote of a uniformly random k-subset of the responses (module doc).

    For answer a with c_a responses, P(a wins) = sum_x C(c_a, x) * W_a(x) / C(n, k): x of its responses drawn and
    W_a(x) the ways to draw the other k - x with no other answer drawn more than x times, each weighted 1/(1 + t)
    for t other answers drawn exactly x times (the random tie-break). Only answers with a non-zero acc are summed.
    """
    n = len(answers)
    if len(accs) != n:
        raise ValueError(f"{n} answers but {len(accs)} accuracies")
    if not 1 <= k <= n:
        raise ValueError(f"maj@k needs 1 <= k <= n, got k={k}, n={n}")
    clusters: dict[str, list[float]] = {}
    for answer, acc in zip(answers, accs, strict=True):
        if answer is not None:
            clusters.setdefault(answer, []).append(float(acc >= CORRECT_AT))
    unanswered = n - sum(len(v) for v in clusters.values())
    counts = [len(v) for v in clusters.values()]
    right = [sum(v) / len(v) for v in clusters.values()]  # 0 or 1 unless a scorer timed out on some copies
    expected = Fraction(0)
    for a, (count, value) in enumerate(zip(counts, right, strict=True)):
        if not value:
            continue
        others = counts[:a] + counts[a + 1 :]
        for x in range(1, min(count, k) + 1):
            expected += Fraction(value) * math.comb(count, x) * _tie_weighted_ways(others, unanswered, k - x, x)
    return float(expected / math.comb(n, k))


def _tie_weighted_ways(others: list[int], unanswered: int, total: int, x: int) -> Fraction:
    """Ways to draw ``total`` responses from ``others`` (answer clusters, each drawn at most ``x`` times) and the
    unanswered ones, each way weighted 1 / (1 + number of clusters drawn exactly ``x`` times)."""
    # ways[t][s]: draws of s responses so far with t clusters at exactly x; the unanswered draw freely
    ways = [[math.comb(unanswered, s) for s in range(total + 1)]]
    for count in others:
        grown = [[0] * (total + 1) for _ in range(len(ways) + 1)]
        for t, row in enumerate(ways):
            for s, w in enumerate(row):
                if w:
                    for y in range(min(count, x, total - s) + 1):
                        grown[t + (y == x)][s + y] += w * math.comb(count, y)
        ways = grown if any(grown[-1]) else grown[:-1]
    return sum((Fraction(row[total], t + 1) for t, row in enumerate(ways)), Fraction(0))


def report_ks(n: int, ks: Sequence[int] | None) -> list[int]:
    """The k of pass@k / maj@k: ``validation.k``, or 1, 2, 4, ... below n, and n."""
    if ks:
        return sorted(set(ks))
    return sorted({2**i for i in range(n.bit_length()) if 2**i < n} | {n})


@dataclass
class PromptResult:
    """The n responses to one validation prompt, scored."""

    data_source: str
    accs: list[float]
    answers: list[str | None]
    lengths: list[int]
    truncated: list[bool]
    score_errors: int = 0  # responses whose scorer raised or timed out (scored 0, never fatal here)


def _per_prompt(result: PromptResult, n: int, ks: Sequence[int]) -> dict[str, float]:
    right = sum(acc >= CORRECT_AT for acc in result.accs)
    values = {f"mean@{n}": sum(result.accs) / n}
    for k in ks:
        values[f"pass@{k}"] = pass_at_k(n, right, k)
        values[f"maj@{k}"] = maj_at_k(result.answers, result.accs, k)
    return values


def summarize(results: Sequence[PromptResult], n: int, ks: Sequence[int]) -> dict[str, float]:
    """``val/<source>/<metric>`` for every data source and ``val/all/<metric>`` over all prompts (module doc)."""
    if not results:
        raise ValueError("no validation prompts to summarize")
    per_prompt = [_per_prompt(r, n, ks) for r in results]
    groups: dict[str, list[int]] = {OVERALL: list(range(len(results)))}
    for i, r in enumerate(results):
        groups.setdefault(r.data_source, []).append(i)  # a source named "all" merges into the overall figures
    out: dict[str, float] = {}
    for name, members in groups.items():
        prefix = f"{PREFIX}/{name}"
        out[f"{prefix}/prompts"] = float(len(members))
        for key in per_prompt[0]:
            out[f"{prefix}/{key}"] = sum(per_prompt[i][key] for i in members) / len(members)
        lengths = [length for i in members for length in results[i].lengths]
        out[f"{prefix}/response_length_mean"] = sum(lengths) / len(lengths)
        out[f"{prefix}/truncated"] = float(sum(sum(results[i].truncated) for i in members))
        out[f"{prefix}/no_answer"] = float(sum(a is None for i in members for a in results[i].answers))
        out[f"{prefix}/score_errors"] = float(sum(results[i].score_errors for i in members))
    return out


# ----------------------------------------------------------------------------------------------- the prompts


@dataclass
class ValSet:
    records: list[Any]  # data.PromptRecord, after the cap
    files: list[str]
    num_filtered: int  # over-long prompts dropped (data.overlong_prompts=filter)
    num_before_cap: int
    eos_ids: frozenset[int] = field(default_factory=frozenset)


def validation_wanted(cfg: Any) -> bool:
    return cfg.trainer.test_freq > 0 or cfg.trainer.val_before_train


def resolve_val_files(cfg: Any) -> list[str]:
    """``data.val_files``; for the embedded default (no model.path, no train files) the synthetic held-out split."""
    if cfg.data.val_files:
        return list(cfg.data.val_files)
    if not cfg.model.path and not cfg.data.train_files:
        from .data.prepare import embedded_data_dir

        return [str(embedded_data_dir(tools=cfg.tools.enabled) / "test.parquet")]
    return []


def select_prompts(count: int, cap: int | None) -> list[int]:
    """Indices of the prompts validated: all, or a fixed seeded subset of ``cap`` of them in file order (a plain
    head would keep only the first data source of a file that lists sources one after another)."""
    if cap is None or cap >= count:
        return list(range(count))
    return sorted(random.Random(_SELECT_SEED).sample(range(count), cap))


def prepare_val_set(cfg: Any, tokenizer: Any, model_path: str) -> ValSet | None:
    """The trainer's validation set (before any worker starts), or None when validation is off."""
    if validation_wanted(cfg):
        return load_val_set(cfg, tokenizer, model_path)
    if cfg.data.val_files:
        print(
            "note: data.val_files is not read: validation is off (trainer.test_freq=0, trainer.val_before_train="
            "false); set trainer.test_freq to validate every that many steps",
            flush=True,
        )
    return None


def load_val_set(cfg: Any, tokenizer: Any, model_path: str, files: list[str] | None = None) -> ValSet:
    """The validation prompts of ``files`` (default: :func:`resolve_val_files`), tokenized like training prompts;
    one line (exit 2) for a missing, unreadable or empty file, or when there is none."""
    from .data import load_prompts, report_filtered
    from .tools.plan import ToolPlan

    files = resolve_val_files(cfg) if files is None else files
    if not files:
        raise UserError(
            f"validation is on (trainer.test_freq={cfg.trainer.test_freq}, trainer.val_before_train="
            f"{str(cfg.trainer.val_before_train).lower()}) but data.val_files is empty; set data.val_files (e.g. "
            "the test.parquet of `gspo-ascend prepare-data`), or trainer.test_freq=0 trainer.val_before_train=false"
        )
    d = cfg.data
    try:
        data = load_prompts(
            files, d.prompt_key, tokenizer, d.max_prompt_length, d.overlong_prompts, answer_key=d.answer_key,
            tools=ToolPlan(cfg.tools) if cfg.tools.enabled else None,
        )  # fmt: skip
    except UserError as exc:
        raise UserError(f"data.val_files: {exc}") from None
    keep = select_prompts(len(data), cfg.validation.max_prompts)
    report_filtered(data, d.max_prompt_length, of=" of validation")
    records = [data[i] for i in keep]
    return ValSet(
        records, list(data.files), data.num_filtered, len(data), frozenset(eos_token_ids(model_path, tokenizer))
    )


def eos_token_ids(model_path: str, tokenizer: Any) -> set[int]:
    """The ids that end a response: the tokenizer's EOS and the model's generation_config.json ones (what the
    rollout engines stop on), so a response that ends exactly at the length limit is not counted as cut."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    try:
        from transformers import GenerationConfig

        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except (OSError, ValueError):  # no generation_config.json: the tokenizer's EOS is all there is
        return ids
    return ids | set(eos if isinstance(eos, list) else [] if eos is None else [eos])


# ----------------------------------------------------------------------------------------------- generation

Generate = Callable[..., list]  # (requests, on_done) -> one SampleBatch per request


def sampling_params(cfg: Any, seed: int = 0) -> Any:
    from .engines import SamplingParams

    v = cfg.validation
    return SamplingParams(
        n=v.n,
        temperature=0.0 if v.greedy else v.temperature,
        top_p=1.0 if v.greedy else v.top_p,
        top_k=-1 if v.greedy else v.top_k,
        max_new_tokens=cfg.data.max_response_length,
        seed=seed,
    )


def chunk_seed(seed: int, chunk: int) -> int:
    """Chunk j's sampling seed: a function of (trainer.seed, j) only, apart from the training rollouts' seeds."""
    return (seed * 1_000_003 + 7_777_777 + chunk * 7919) % (2**31)


def requests(val_set: ValSet, cfg: Any) -> list[tuple[list[list[int]], Any]]:
    size = cfg.validation.batch_size
    records = val_set.records
    return [
        (
            [list(r.prompt_ids) for r in records[start : start + size]],
            sampling_params(cfg, chunk_seed(cfg.trainer.seed, j)),
        )
        for j, start in enumerate(range(0, len(records), size))
    ]


@dataclass
class Evaluation:
    metrics: dict[str, float]
    rows: list[dict]  # one per response, prompts in order, the n responses of a prompt adjacent
    scored: list = field(default_factory=list)  # the scorer's SampleResult of each row (failures: status, trace)


def evaluate(val_set: ValSet, generate_each: Generate, cfg: Any, tokenizer: Any, on_done=None) -> Evaluation:
    """Generate, score and summarize ``val_set`` (``generate_each``: :meth:`WorkerGroup.generate_each`, or
    :func:`sequential` over one engine)."""
    batches = generate_each(requests(val_set, cfg), on_done)
    results, rows, scored = _score(val_set, batches, cfg, tokenizer)
    n = cfg.validation.n
    return Evaluation(summarize(results, n, report_ks(n, cfg.validation.k)), rows, scored)


def sequential(engine: Any) -> Generate:
    """``generate_each`` over one in-process rollout engine: the requests one after another."""

    def generate_each(reqs, on_done=None):
        out = []
        for prompts, params in reqs:
            out.append(engine.generate(prompts, params))
            if on_done is not None:
                on_done(len(out))
        return out

    return generate_each


def _score(val_set: ValSet, batches: list, cfg: Any, tokenizer: Any) -> tuple[list[PromptResult], list[dict], list]:
    from .rewards import extract_boxed, score_responses

    n, limit = cfg.validation.n, cfg.data.max_response_length
    ids = [row for b in batches for row in b.response_ids]
    lengths = [int(x) for b in batches for x in b.response_lengths]
    texts = tokenizer.batch_decode(
        [r[:m].tolist() for r, m in zip(ids, lengths, strict=True)], skip_special_tokens=True
    )
    records = [r for r in val_set.records for _ in range(n)]
    if len(texts) != len(records):
        raise RuntimeError(f"validation got {len(texts)} responses for {len(val_set.records)} prompts x n={n}")
    rc = cfg.reward
    scored = score_responses(
        texts,
        [r.ground_truth for r in records],
        [r.data_source for r in records],
        reward_fn=rc.reward_fn,
        extra_infos=[r.extra_info for r in records],
        timeout_s=rc.timeout_s,
        num_workers=rc.num_workers,
    )
    answers = [(extract_boxed(t) or "").strip() or None for t in texts]
    cut = [m >= limit and int(r[m - 1]) not in val_set.eos_ids for r, m in zip(ids, lengths, strict=True)]
    results, rows = [], []
    for i, rec in enumerate(val_set.records):
        span = range(i * n, (i + 1) * n)
        results.append(
            PromptResult(
                rec.data_source,
                [scored[j].acc for j in span],
                [answers[j] for j in span],
                [lengths[j] for j in span],
                [cut[j] for j in span],
                sum(scored[j].status in ("timeout", "error") for j in span),
            )
        )
        prompt = next((m["content"] for m in reversed(rec.messages) if m["role"] == "user"), "")
        rows.extend(
            {
                "index": i,
                "source": rec.source,
                "data_source": rec.data_source,
                "prompt": prompt,
                "sample": j - i * n,
                "response": texts[j],
                "answer": answers[j],
                "ground_truth": rec.ground_truth,
                "reward": scored[j].score,
                "acc": scored[j].acc,
                "status": scored[j].status,
                "length": lengths[j],
                "truncated": cut[j],
            }
            for j in span
        )
    return results, rows, scored


def write_generations(path: Path, rows: list[dict], prompts: int, n: int) -> Path | None:
    """The responses of the first ``prompts`` prompts as JSON lines (atomically: a reader never sees half)."""
    if prompts <= 0:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows[: prompts * n])
    os.replace(tmp, path)
    return path


# ----------------------------------------------------------------------------------------------- trainer hooks


def before_training(run: Any) -> None:
    """``trainer.val_before_train``: the initial weights, logged as step 0; a resumed run has that line already."""
    if run.val_set is not None and run.cfg.trainer.val_before_train and run.start_step == 0:
        run.logger.log(0, validate(run, 0))


def due(run: Any, step: int) -> dict[str, float]:
    """The validation metrics of ``step`` when it is a multiple of ``trainer.test_freq`` or the last step, else {}.
    A function of the step alone, so a resumed run validates the steps the uninterrupted one would have."""
    return validate(run, step) if is_due(run, step) else {}


def is_due(run: Any, step: int) -> bool:
    t = run.cfg.trainer
    return run.val_set is not None and t.test_freq > 0 and (step % t.test_freq == 0 or step == t.total_steps)


def validate(run: Any, step: int) -> dict[str, float]:
    start = time.perf_counter()
    result = evaluate(run.val_set, run.schedule.validation_generate(), run.cfg, run.tokenizer)
    v = run.cfg.validation
    write_generations(run.output_dir / VAL_DIR / f"step_{step:08d}.jsonl", result.rows, v.log_prompts, v.n)
    log_failures(run.reward_log, result, step)
    return result.metrics | run.schedule.validation_metrics() | {"time/validation_s": time.perf_counter() - start}


def log_failures(log: Any, result: Evaluation, step: int | None = None, phase: str = "validation") -> None:
    """Scorer failures on held-out prompts go where the training ones go: a ``reward_errors.log`` (a
    :class:`~.rewards.report.RewardErrorLog`; lines marked with ``phase``) and one console warning. They never stop
    a run or an eval: the metrics count them (``val/*/score_errors``)."""
    rows = result.rows
    responses = [r["response"] for r in rows]
    truths, sources = [r["ground_truth"] for r in rows], [r["data_source"] for r in rows]
    log.record(step, result.scored, responses, truths, sources, phase=phase)
    log.warn_once(step, result.scored, phase=phase)
