"""Validation metrics against hand-derived values and an independent brute force; the validation config refused
with one line; the synthetic held-out split; the chunk seeding that makes eval reproduce a run."""

from __future__ import annotations

import itertools
import random
from collections import Counter
from fractions import Fraction

import pytest

from gspo_ascend import config
from gspo_ascend.errors import ConfigError
from gspo_ascend.schedules.synchronous import Synchronous
from gspo_ascend.validation import (
    PromptResult,
    chunk_seed,
    maj_at_k,
    pass_at_k,
    report_ks,
    select_prompts,
    summarize,
)

# ----------------------------------------------------------------------------------------------- pass@k


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (4, 2, 1, Fraction(1, 2)),  # pass@1 = c / n
        (4, 2, 2, Fraction(5, 6)),  # 1 - C(2,2)/C(4,2) = 1 - 1/6
        (10, 3, 5, Fraction(11, 12)),  # 1 - C(7,5)/C(10,5) = 1 - 21/252
        (10, 3, 8, Fraction(1)),  # only 7 wrong answers: any 8 hold a right one
        (5, 0, 3, Fraction(0)),
        (5, 5, 1, Fraction(1)),
        (1, 1, 1, Fraction(1)),
    ],
)
def test_pass_at_k_hand_derived(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(float(expected), abs=1e-15)


def test_pass_at_k_is_the_probability_over_all_k_subsets():
    """Chen et al.'s estimator equals the fraction of k-subsets holding a right answer (independent count)."""
    for n in range(1, 8):
        for c in range(n + 1):
            outcomes = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(outcomes, k))
                assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets), abs=1e-12)


def test_pass_at_k_refuses_k_above_n():
    with pytest.raises(ValueError, match="k=5, n=4"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="k=0"):
        pass_at_k(4, 1, 0)


# ----------------------------------------------------------------------------------------------- maj@k


def test_maj_at_k_hand_derived():
    # A right (twice), B wrong, one response without an answer
    answers, accs = ["A", "A", "B", None], [1, 1, 0, 0]
    assert maj_at_k(answers, accs, 1) == pytest.approx(1 / 2)  # a single vote is right 2 times in 4
    # 6 pairs: AA 1, AB 0.5 (x2, tie), A- 1 (x2), B- 0  -> 4 / 6
    assert maj_at_k(answers, accs, 2) == pytest.approx(2 / 3)
    # 4 triples: AAB 1, AA- 1, AB- 0.5 (x2) -> 3 / 4
    assert maj_at_k(answers, accs, 3) == pytest.approx(3 / 4)
    assert maj_at_k(answers, accs, 4) == 1.0  # A: 2 votes, B: 1
    # the right answer once, a wrong one twice: 6 pairs AB 0.5 (x2), AC 0.5, BB 0, BC 0 (x2) -> 1.5 / 6
    assert maj_at_k(["A", "B", "B", "C"], [1, 0, 0, 0], 2) == pytest.approx(1 / 4)
    assert maj_at_k(["A", "B", "B", "C"], [1, 0, 0, 0], 4) == 0.0
    assert maj_at_k([None, None], [0, 0], 2) == 0.0  # nobody voted: wrong
    # two spellings of a right answer are two candidates: a three-way tie, 2 of 3 right
    assert maj_at_k(["0.5", "\\frac{1}{2}", "3"], [1, 1, 0], 3) == pytest.approx(2 / 3)


def brute_force_maj(answers, accs, k):
    """Every k-subset, an explicit vote, ties split evenly (written apart from the DP it checks)."""
    total = Fraction(0)
    subsets = list(itertools.combinations(range(len(answers)), k))
    for subset in subsets:
        votes = Counter(answers[i] for i in subset if answers[i] is not None)
        if not votes:
            continue
        top = max(votes.values())
        winners = [a for a, v in votes.items() if v == top]
        right = {answers[i]: accs[i] >= 0.5 for i in subset if answers[i] is not None}
        total += Fraction(sum(right[w] for w in winners), len(winners))
    return float(total / len(subsets))


def test_maj_at_k_equals_brute_force_on_random_groups():
    rng = random.Random(7)
    for _ in range(150):
        n = rng.randint(1, 9)
        pool = ["1", "2", "3", None][: rng.randint(1, 4)]
        answers = [rng.choice(pool) for _ in range(n)]
        right = rng.choice(["1", "2"])
        accs = [float(a == right) for a in answers]
        for k in range(1, n + 1):
            assert maj_at_k(answers, accs, k) == pytest.approx(brute_force_maj(answers, accs, k), abs=1e-12)


def test_maj_at_k_refuses_k_above_n():
    with pytest.raises(ValueError, match="k=3, n=2"):
        maj_at_k(["1", "2"], [1, 0], 3)


def test_report_ks():
    assert report_ks(1, None) == [1]
    assert report_ks(8, None) == [1, 2, 4, 8]
    assert report_ks(6, None) == [1, 2, 4, 6]
    assert report_ks(16, [8, 1, 8]) == [1, 8]


# ----------------------------------------------------------------------------------------------- summary


def test_summarize_per_source_and_overall():
    a1 = PromptResult("math", [1, 0], ["4", "5"], [10, 20], [False, True])  # one right of 2
    a2 = PromptResult("math", [1, 1], ["7", "7"], [4, 6], [False, False])  # both right
    b1 = PromptResult("gsm8k", [0, 0], [None, "3"], [8, 8], [False, False], 1)  # none right, one unanswered
    m = summarize([a1, a2, b1], n=2, ks=[1, 2])
    # overall: mean@2 = mean of per-prompt means (1/2, 1, 0) = 1/2
    assert m["val/all/mean@2"] == pytest.approx(0.5)
    assert m["val/all/pass@2"] == pytest.approx((1 + 1 + 0) / 3)
    # maj@2 of a1: a tie between 4 (right) and 5 -> 1/2; a2: 1; b1: only "3" votes, wrong -> 0
    assert m["val/all/maj@2"] == pytest.approx((0.5 + 1 + 0) / 3)
    assert m["val/all/maj@1"] == pytest.approx((0.5 + 1 + 0) / 3)
    assert m["val/all/response_length_mean"] == pytest.approx(56 / 6)
    assert (m["val/all/truncated"], m["val/all/no_answer"], m["val/all/prompts"]) == (1, 1, 3)
    assert m["val/math/mean@2"] == pytest.approx(0.75) and m["val/math/prompts"] == 2
    assert m["val/math/response_length_mean"] == pytest.approx(10) and m["val/math/truncated"] == 1
    assert m["val/gsm8k/mean@2"] == 0 and m["val/gsm8k/pass@1"] == 0 and m["val/gsm8k/no_answer"] == 1
    assert (m["val/all/score_errors"], m["val/math/score_errors"], m["val/gsm8k/score_errors"]) == (1, 0, 1)


# ----------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["trainer.test_freq=-1"], "'trainer.test_freq' must be >= 0"),
        (["validation.greedy=false", "validation.n=4", "validation.k=[1,8]"], "k=8"),
        (["validation.k=[2]"], "k=2"),  # greedy: n = 1
        (["validation.n=4"], "set validation.greedy=false to sample"),
        (["validation.top_p=0.9"], "validation.top_p=0.9 do nothing with validation.greedy=true"),
        (["validation.greedy=false", "validation.temperature=0"], "'validation.temperature' must be > 0"),
        (["validation.max_prompts=0"], "'validation.max_prompts' must be > 0 or null"),
        (["validation.batch_size=0"], "'validation.batch_size' must be > 0"),
    ],
)
def test_bad_validation_keys_are_one_line(overrides, fragment):
    with pytest.raises(ConfigError) as err:
        config.load_config(None, overrides)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_validation_keys_load():
    cfg = config.load_config(None, ["validation.greedy=false", "validation.n=8", "validation.k=[1,4,8]"])
    assert (cfg.validation.n, cfg.validation.k, cfg.trainer.test_freq) == (8, [1, 4, 8], 0)


# ----------------------------------------------------------------------------------------------- prompts, seeds


def test_select_prompts_is_a_fixed_subset_in_file_order():
    assert select_prompts(5, None) == [0, 1, 2, 3, 4] and select_prompts(5, 9) == [0, 1, 2, 3, 4]
    chosen = select_prompts(1000, 10)
    assert chosen == sorted(set(chosen)) and len(chosen) == 10 and chosen == select_prompts(1000, 10)
    assert chosen != list(range(10))  # not the head of the file


def test_chunk_seeds_depend_on_seed_and_chunk_only():
    seeds = [chunk_seed(0, j) for j in range(100)]
    assert len(set(seeds)) == 100 and seeds == [chunk_seed(0, j) for j in range(100)]
    assert chunk_seed(1, 0) != chunk_seed(0, 0)


def test_synthetic_train_and_test_splits_are_disjoint_problems():
    from gspo_ascend.tiny import held_out_problems, problem_space, synthetic_arithmetic

    space, held_out = problem_space(), held_out_problems()
    assert len(space) == 155 and len(set(space)) == 155 and len(held_out) == 39  # 100 sums, 55 differences
    key = lambda r: (r["a"], r["op"], r["b"])  # noqa: E731
    train = {key(r) for r in synthetic_arithmetic(4000, seed=0, split="train")}
    test = synthetic_arithmetic(256, seed=0, split="test", distinct=True)
    assert len(test) == 39 and {key(r) for r in test} == held_out  # every held-out problem once
    assert train == set(space) - held_out  # train draws every other problem, never a held-out one
    assert {key(r) for r in synthetic_arithmetic(500, seed=0, split="sft")} & held_out  # the warm start saw them


def test_end_of_run_summary_gives_the_eval_command_that_reproduces_the_last_validation(tmp_path):
    from gspo_ascend.trainer import run_summary

    run = tmp_path.resolve() / "my run"
    (run / "hf").mkdir(parents=True)
    lines = run_summary(run, ["console"], val_files=["/data/test set.parquet"])
    assert lines[-1] == (
        f"  gspo-ascend eval --model '{run}/hf' --config '{run}/config.json' --data '/data/test set.parquet'"
    )
    assert not any("eval" in line for line in run_summary(run, ["console"]))  # the run did not validate


def test_evaluate_scores_decodes_and_counts_cut_responses():
    """evaluate() over a stand-in engine whose responses are known token by token: the written rows, the extracted
    answers, and 'truncated' = reached the length limit without an end-of-sequence token."""
    import torch

    from gspo_ascend.data import PromptRecord
    from gspo_ascend.engines import SampleBatch
    from gspo_ascend.tiny import build_tokenizer
    from gspo_ascend.validation import ValSet, evaluate

    tok = build_tokenizer()
    eos, pad = tok.eos_token_id, tok.pad_token_id
    texts = ["2 + 2 = 4. \\boxed{4}", "\\boxed{5}", "no box here, " * 20]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    limit = len(ids[0]) + 1
    cfg = config.load_config(None, [f"data.max_response_length={limit}", "validation.batch_size=2"])
    ids[0] = ids[0] + [eos]  # exactly at the limit, ended by EOS: not cut
    ids[1] = ids[1] + [eos]  # short
    ids[2] = ids[2][:limit]  # at the limit, no EOS: cut
    assert [len(x) for x in ids] == [limit, len(ids[1]), limit]
    records = [
        PromptRecord([1, 2], [{"role": "user", "content": f"q{i}"}], truth, "src", {}, f"f:{i}")
        for i, truth in enumerate(["4", "6", "1"])
    ]
    val_set = ValSet(records, ["f"], 0, 3, frozenset({eos}))
    calls = []

    def generate_each(requests, on_done=None):
        calls.extend((len(p), params.seed, params.temperature) for p, params in requests)
        out, start = [], 0
        for prompts, _ in requests:
            rows = ids[start : start + len(prompts)]
            start += len(prompts)
            response = torch.full((len(rows), limit), pad)
            mask = torch.zeros(len(rows), limit)
            for r, row in enumerate(rows):
                response[r, : len(row)], mask[r, : len(row)] = torch.tensor(row), 1
            out.append(SampleBatch(prompts, response, mask))
        return out

    result = evaluate(val_set, generate_each, cfg, tok)
    assert calls == [(2, chunk_seed(0, 0), 0.0), (1, chunk_seed(0, 1), 0.0)]  # chunks of 2, greedy, own seeds
    assert [r["truncated"] for r in result.rows] == [False, False, True]
    assert [r["answer"] for r in result.rows] == ["4", "5", None]
    assert [r["acc"] for r in result.rows] == [1.0, 0.0, 0.0] and result.rows[0]["response"].startswith("2 + 2")
    assert result.rows[1]["prompt"] == "q1" and result.rows[1]["ground_truth"] == "6"
    m = result.metrics
    assert m["val/all/mean@1"] == pytest.approx(1 / 3) and m["val/src/mean@1"] == pytest.approx(1 / 3)
    assert (m["val/all/truncated"], m["val/all/no_answer"], m["val/all/prompts"]) == (1, 1, 3)


def test_validation_scorer_failures_go_to_the_run_reward_log_with_one_warning(tmp_path, capsys):
    """Old code (7a954f9): a scorer that raised on held-out prompts was counted in val/*/score_errors and nowhere
    else: no reward_errors.log line, no traceback, no warning. Now its failures are logged like training ones,
    marked 'validation', with the one warning of the run; gspo-ascend eval writes its own log."""
    from types import SimpleNamespace

    import torch

    from gspo_ascend.data import PromptRecord
    from gspo_ascend.engines import SampleBatch
    from gspo_ascend.rewards.report import REWARD_ERRORS_NAME, RewardErrorLog
    from gspo_ascend.tiny import build_tokenizer
    from gspo_ascend.validation import ValSet, evaluate, log_failures, validate

    scorer = tmp_path / "scorer.py"
    scorer.write_text(
        "def f(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if ground_truth == '6':\n"
        "        raise KeyError('no table for 6')\n"
        "    return float(ground_truth in solution_str)\n"
    )
    tok = build_tokenizer()
    cfg = config.load_config(None, ["data.max_response_length=8", f"reward.reward_fn={scorer}:f"])
    records = [
        PromptRecord([1, 2], [{"role": "user", "content": f"q{i}"}], truth, "src", {}, f"f:{i}")
        for i, truth in enumerate(["4", "6", "5"])
    ]
    val_set = ValSet(records, ["f"], 0, 3, frozenset({tok.eos_token_id}))
    answer = tok("4", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]

    def generate_each(requests, on_done=None):
        rows = sum(len(p) for p, _ in requests)
        response = torch.full((rows, 8), tok.pad_token_id)
        response[:, : len(answer)] = torch.tensor(answer)
        mask = torch.zeros(rows, 8)
        mask[:, : len(answer)] = 1
        return [SampleBatch([p for p, _ in requests for p in p], response, mask)]

    run = SimpleNamespace(
        val_set=val_set,
        cfg=cfg,
        tokenizer=tok,
        output_dir=tmp_path / "run",
        reward_log=RewardErrorLog(tmp_path / "run"),  # what runtime.Run makes
        workers=SimpleNamespace(generate_each=generate_each),
    )
    run.schedule = Synchronous(run)  # validation generates as the run's schedule says: single-turn chunks here
    metrics = validate(run, 4)
    assert metrics["val/all/score_errors"] == 1 and metrics["val/all/mean@1"] == pytest.approx(1 / 3)
    log = (tmp_path / "run" / REWARD_ERRORS_NAME).read_text()
    assert "validation at step 4: 1 of 3 scored samples failed (1 errors, 0 timeouts)" in log
    assert "validation at step 4 sample 1 [src] error:" in log and "KeyError: 'no table for 6'" in log
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "failed on 1 of 3 samples in validation at step 4" in warnings[0]
    validate(run, 8)  # validation's one warning is spent; the log keeps every failure
    assert not [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert "validation at step 8: 1 of 3" in (tmp_path / "run" / REWARD_ERRORS_NAME).read_text()

    result = evaluate(val_set, generate_each, cfg, tok)
    run.reward_log.warn_once(9, result.scored)  # training's failures keep a warning of their own
    assert "failed on 1 of 3 samples at step 9 (1 errors" in capsys.readouterr().err
    log_failures(RewardErrorLog(tmp_path / "eval"), result, phase="eval")
    assert "eval: 1 of 3 scored samples failed" in (tmp_path / "eval" / REWARD_ERRORS_NAME).read_text()
    assert "1 of 3 samples in eval (1 errors" in capsys.readouterr().err
