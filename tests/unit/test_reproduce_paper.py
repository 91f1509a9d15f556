"""benchmarks/reproduce_paper.py: the per-run and over-seed statistics against hand-derived values, the cell
formats, the run configs (paper presets, identical shared settings), the argument checks, and one minimal
sweep end to end (2 steps, 1 seed, both models) whose table is checked against numbers the test recomputes
from the raw metrics, followed by a --replot that must rebuild the same report."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from gspo_ascend.errors import UserError
from tests.conftest import REPO, script_module

SCRIPT = REPO / "benchmarks" / "reproduce_paper.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def rp():
    with script_module(SCRIPT, "reproduce_paper") as module:
        yield module


def stat(mean: float, sd: float, n: int, per_seed=None) -> dict:
    return {"mean": mean, "sd": sd, "n": n, "per_seed": per_seed if per_seed is not None else [mean] * n}


# ----------------------------------------------------------------------------------------------- statistics


def test_window_is_a_fifth_of_the_run(rp):
    assert [rp.window(s) for s in (1, 2, 3, 10, 60)] == [1, 1, 1, 2, 12]


def test_run_summary_hand_derived(rp):
    records = [
        {"step": 1, "reward/mean": 0.1, "actor/clipfrac_token": 0.5, "actor/grad_norm": 1.0},
        {"step": 2, "reward/mean": 0.2, "actor/clipfrac_token": None, "actor/grad_norm": None},  # non-finite
        {"step": 3, "reward/mean": 0.3, "actor/clipfrac_token": 0.1, "actor/grad_norm": 3.0},
        {"step": 4, "reward/mean": 0.4, "actor/nan_steps_skipped": 1.0, "actor/grad_norm": 2.0},
        {"step": 5, "reward/mean": 0.5, "actor/nan_steps_skipped": 2.0},
    ]
    s = rp.run_summary(records, 2)
    assert s["reward_first"] == pytest.approx(0.15)  # steps 1-2
    assert s["reward_last"] == pytest.approx(0.45)  # steps 4-5
    assert s["reward_all"] == pytest.approx(0.3)
    assert s["clipfrac_token"] == pytest.approx(0.3)  # the null is skipped, not counted as 0
    assert s["grad_norm"] == pytest.approx(2.0) and s["grad_norm_max"] == 3.0
    assert s["nan_steps"] == 3.0
    assert math.isnan(s["kl_k3_token"])  # never logged


def test_reward_fall_finds_the_collapse_and_the_recovery(rp):
    rewards = [0.5, 0.5, 0.5, 0.8, 0.8, 0.8, 0.2, 0.2, 0.2, 0.9, 0.9, 0.9]
    # 3-step means at steps 3..12: .5 .6 .7 .8 .6 .4 .2 .433 .667 .9 -> best .8 (step 6), low .2 (step 9)
    fall = rp.reward_fall(rewards, 3)
    assert fall["drop"] == pytest.approx(0.6)
    assert (fall["peak"], fall["bottom"], fall["recovered"]) == (6, 9, 12)
    never = rp.reward_fall([0.9, 0.9, 0.9, 0.1, 0.1, 0.1], 3)
    assert never["drop"] == pytest.approx(0.8) and (never["peak"], never["bottom"], never["recovered"]) == (3, 6, None)
    assert rp.reward_fall([0.1, 0.2, 0.3, 0.4], 3)["drop"] == 0.0  # rising: no fall
    assert rp.reward_fall([0.5, 0.1], 3)["drop"] == 0.0  # shorter than the window


def test_verdicts_follow_the_data(rp):
    def runs(rewards_per_seed, clip):
        return [
            [{"step": i + 1, "reward/mean": r, "actor/clipfrac_token": clip} for i, r in enumerate(rs)]
            for rs in rewards_per_seed
        ]

    steady = [[0.3, 0.4, 0.5, 0.6, 0.7, 0.8]] * 3
    crash = [[0.3, 0.8, 0.8, 0.8, 0.1, 0.1, 0.1, 0.1]] + [[0.3, 0.4, 0.5, 0.6, 0.7, 0.8]] * 2
    results = {("moe", "gspo"): runs(steady, 0.2), ("moe", "grpo"): runs(crash, 0.002)}
    clip, _, stable = rp.verdicts(rp.summarize(results, 1), "moe")
    assert clip == "100x (2.0 orders)"
    assert stable == "seen (collapsed seeds: GSPO 0/3, GRPO 1/3)"
    results[("moe", "gspo")] = runs(crash, 0.2)
    assert rp.verdicts(rp.summarize(results, 1), "moe")[2].startswith("both unstable")


def test_summarize_over_seeds(rp):
    runs = [[{"step": 1, "reward/mean": r}] for r in (0.2, 0.4, 0.6)]
    s = rp.summarize({("moe", "gspo"): runs}, 1)[("moe", "gspo")]["reward_last"]
    assert s["mean"] == pytest.approx(0.4) and s["n"] == 3
    assert s["sd"] == pytest.approx(0.2)  # sample sd: sqrt((0.04 + 0 + 0.04) / 2)
    one = rp.summarize({("moe", "gspo"): runs[:1]}, 1)[("moe", "gspo")]["reward_last"]
    assert math.isnan(one["sd"])


def test_band_per_step_over_seeds(rp):
    runs = [
        [{"step": 1, "k": 1.0}, {"step": 2, "k": 3.0}],
        [{"step": 1, "k": 3.0}, {"step": 2, "k": None}, {"step": 3, "k": 5.0}],
    ]
    steps, mean, sd = rp.band(runs, "k")
    assert steps == [1, 2, 3] and mean == [2.0, 3.0, 5.0]
    assert sd == [pytest.approx(math.sqrt(2)), 0.0, 0.0]


def test_cells_and_table(rp):
    assert rp.cell(stat(0.4531, 0.012, 3), "pct") == "45.3% ± 1.2%"
    assert rp.cell(stat(0.5, 0.0414, 3)) == "0.500 ± 0.041"
    assert rp.cell(stat(2.5e-4, 1e-5, 3), "sci") == "2.50e-04 ± 1.0e-05"
    assert rp.cell(stat(0.5, math.nan, 1)) == "0.500"  # one seed: no spread shown
    summary = rp.summarize({("dense", "grpo"): [[{"step": 1, "reward/mean": 0.25, "actor/clipfrac_token": 0.002}]]}, 1)
    table = rp.render_table(summary, ["dense"], 1).splitlines()
    assert table[0].startswith("| model | algorithm | reward, first 1 steps | reward, last 1 steps |")
    assert table[2].startswith("| dense | GRPO | 0.250 | 0.250 | 0.250 | 0.2% | n/a |")


def test_distinguishable_uses_twice_the_standard_error(rp):
    # se = sqrt(0.1^2 / 4 + 0.1^2 / 4) = 0.0707; 2 se = 0.141
    assert rp.distinguishable(stat(0.50, 0.1, 4), stat(0.35, 0.1, 4)) is True
    assert rp.distinguishable(stat(0.50, 0.1, 4), stat(0.37, 0.1, 4)) is False
    assert rp.distinguishable(stat(0.5, math.nan, 1), stat(0.1, 0.1, 4)) is None


def test_clipping_observation_follows_the_data(rp):
    def summary(g: float, r: float) -> dict:
        return {
            ("moe", "gspo"): {"clipfrac_token": stat(g, 0.0, 2), "clipfrac_seq": stat(g, 0.0, 2)},
            ("moe", "grpo"): {"clipfrac_token": stat(r, 0.0, 2), "clipfrac_seq": stat(r, 0.0, 2)},
        }

    text = rp.observe_clipping(summary(0.3, 0.003), "moe")
    assert "100x (2.0 orders of magnitude)" in text and "roughly its size" in text and "in every seed" in text
    assert "less than its two orders" in rp.observe_clipping(summary(0.03, 0.003), "moe")
    assert "opposite of the paper" in rp.observe_clipping(summary(0.001, 0.003), "moe")


# ----------------------------------------------------------------------------------------------- configs, args


def test_run_configs_differ_only_in_the_algorithm(rp, tmp_path):
    from gspo_ascend.config import to_dict

    kw = {"steps": 7, "lr": 2e-4, "grpo_agg": "token-mean", "out_dir": str(tmp_path)}
    gspo, grpo = rp.run_config("moe", "gspo", 3, **kw), rp.run_config("moe", "grpo", 3, **kw)
    a, b = gspo.algorithm, grpo.algorithm
    assert (a.loss, a.clip_ratio_low, a.clip_ratio_high, a.loss_agg_mode) == ("gspo", 3e-4, 4e-4, "seq-mean-token-mean")
    assert (b.loss, b.clip_ratio_low, b.clip_ratio_high, b.loss_agg_mode) == ("grpo", 0.2, 0.27, "token-mean")
    assert a.minibatches_per_rollout == b.minibatches_per_rollout == 4 and a.kl_coef == b.kl_coef == 0.0
    assert gspo.actor.ppo_mini_batch_size == 4  # 16 prompts / 4 minibatches
    assert (gspo.data.train_batch_size, gspo.rollout.n, gspo.actor.lr) == (16, 8, 2e-4)
    assert (gspo.trainer.seed, gspo.trainer.total_steps, gspo.trainer.loggers) == (3, 7, ["jsonl"])
    config = json.loads((Path(gspo.model.path) / "config.json").read_text())
    assert config.get("num_experts") == 4  # the MoE model
    rest_a, rest_b = to_dict(gspo), to_dict(grpo)
    for d in (rest_a, rest_b):
        d.pop("algorithm")
        d["trainer"].pop("experiment_name")
    assert rest_a == rest_b  # same model, data, seed, batch, lr, steps
    replayed, plain = to_dict(rp.run_config("moe", "grpo_r2", 3, **kw)), to_dict(grpo)  # one key apart
    assert replayed["actor"].pop("routing_replay") == "r2" and plain["actor"].pop("routing_replay") == "off"
    for d in (replayed, plain):
        d["trainer"].pop("experiment_name")
    assert replayed == plain
    assert rp.algos_of("dense") == ["gspo", "grpo"] and rp.algos_of("moe") == ["gspo", "grpo", "grpo_r2"]
    dense = rp.run_config("dense", "grpo", 0, **(kw | {"grpo_agg": "seq-mean-token-mean"}))
    assert dense.algorithm.loss_agg_mode == "seq-mean-token-mean" and dense.model.path != gspo.model.path


@pytest.mark.parametrize(
    "argv, flag",
    [(["--models", "moe,foo"], "--models"), (["--steps", "0"], "--steps"), (["--seeds", "0"], "--seeds")]
    + [(["--threads", "0"], "--threads"), (["--lr", "0"], "--lr")],
)
def test_bad_arguments_name_the_flag(rp, argv, flag):
    with pytest.raises(UserError, match=flag):
        rp.parse_args(argv)


def test_quick_is_two_steps_one_seed(rp):
    args = rp.parse_args(["--quick", "--models", "dense"])
    assert (args.steps, args.seeds, args.models) == (2, 1, ["dense"])
    assert rp.parse_args([]).models == ["moe", "dense"]


def test_replot_without_results_is_one_line(rp, tmp_path, capsys):
    assert rp.main(["--replot", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "runs.json" in err and len(err.strip().splitlines()) == 1


# ----------------------------------------------------------------------------------------------- end to end


def read_raw(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def table_row(report: str, model: str, algo: str) -> list[str]:
    rows = [line for line in report.splitlines() if line.startswith(f"| {model} | {algo} |")]
    assert len(rows) == 1, rows
    return [c.strip() for c in rows[0].strip("|").split("|")]


@pytest.mark.slow
def test_quick_sweep_writes_the_report_and_replots_it(tmp_path):
    out, work = tmp_path / "results", tmp_path / "work"
    work.mkdir()
    cmd = [sys.executable, str(SCRIPT), "--quick", "--out", str(out), "--work-dir", str(work)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list(work.iterdir()) == []  # throwaway run directories are removed
    manifest = json.loads((out / "runs.json").read_text())
    assert [(r["model"], r["algo"], r["seed"], r["steps"]) for r in manifest["runs"]] == [
        ("moe", "gspo", 0, 2),
        ("moe", "grpo", 0, 2),
        ("moe", "grpo_r2", 0, 2),
        ("dense", "gspo", 0, 2),
        ("dense", "grpo", 0, 2),
    ]
    report = (out / "results.md").read_text()
    for model in ("moe", "dense"):
        raw = {a: read_raw(out / "raw" / f"{model}-{a}-seed0.jsonl") for a in ("gspo", "grpo")}
        assert [r["step"] for r in raw["gspo"]] == [1, 2]
        # same seed -> same prompts, same initial weights, same sampling seed: identical first rollouts
        for key in ("reward/mean", "response/length_mean"):
            assert raw["gspo"][0][key] == raw["grpo"][0][key]
        for algo in ("gspo", "grpo"):
            row, rec = table_row(report, model, algo.upper()), raw[algo]
            assert row[2] == f"{rec[0]['reward/mean']:.3f}" and row[3] == f"{rec[1]['reward/mean']:.3f}"
            clip = sum(r["actor/clipfrac_token"] for r in rec) / 2
            assert row[5] == f"{100 * clip:.3g}%"
    # every MoE run measures how many experts moved within a step; GRPO + R2 is its own row
    for algo, label in (("gspo", "GSPO"), ("grpo_r2", "GRPO + R2")):
        rec = read_raw(out / "raw" / f"moe-{algo}-seed0.jsonl")
        kept = sum(r["routing/update_agreement_mean"] for r in rec) / 2
        assert 0 < kept <= 1 and table_row(report, "moe", label)[-1] == f"{100 * kept:.3g}%"
    assert table_row(report, "dense", "GSPO")[-1] == "n/a"  # no routing on the dense control
    assert "**Routing Replay, moe.**" in report
    names = ("reward", "reward_seeds", "clipfrac_token", "clipfrac_seq", "kl_k3_token", "grad_norm", "response_length")
    for name in names:
        assert (out / f"{name}.png").read_bytes()[:8] == PNG_MAGIC
        (out / f"{name}.png").unlink()
    (out / "results.md").unlink()
    proc = subprocess.run([*cmd, "--replot"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "results.md").read_text() == report  # the report is a function of the stored files alone
    assert (out / "reward.png").read_bytes()[:8] == PNG_MAGIC
