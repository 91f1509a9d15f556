"""benchmarks/staleness_study.py (issue #31): the grid, the run configs (each cell differs from its eta-0 baseline
only in the staleness keys and from the other losses only in the algorithm), the lag check and the per-run figures
against hand-derived values, the arguments, and one small study end to end whose forced staleness is read back
from the raw metrics, then the report rebuilt from the stored files alone."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gspo_ascend.errors import UserError
from tests.conftest import REPO, script_module

SCRIPT = REPO / "benchmarks" / "staleness_study.py"


@pytest.fixture(scope="module")
def st():
    with script_module(SCRIPT, "staleness_study") as module:
        yield module


def test_the_grid_runs_eta_zero_once_and_whole_seeds_first(st):
    cells = st.grid(["moe", "dense"], ["gspo", "gspo_token", "grpo"], [0, 1, 2, 4], 3, token_seeds=3)
    assert len(cells) == 2 * 3 * (1 + 3 * 2) * 3 == 126 == len(set(cells))
    assert {c[3] for c in cells if c[2] == 0} == {"recompute"}
    assert {c[4] for c in cells[:42]} == {0} and {c[4] for c in cells[42:84]} == {1}  # seed-major
    default = st.grid(["moe", "dense"], ["gspo", "gspo_token", "grpo"], [0, 1, 2, 4], 3)
    assert len(default) == 2 * 7 * (2 * 3 + 1) == 98
    assert {c[4] for c in default if c[1] == "gspo_token"} == {0}
    assert st.run_name("moe", "grpo", 4, "engine", 2) == "moe-grpo-eta4-engine-seed2"


def test_run_configs_differ_only_where_the_cell_does(st, tmp_path):
    from gspo_ascend.config import to_dict

    kw = {"steps": 7, "val_every": 3, "out": str(tmp_path)}
    base = st.run_config("moe", "gspo", 0, "recompute", 1, **kw)
    stale = st.run_config("moe", "gspo", 2, "recompute", 1, **kw)
    naive = st.run_config("moe", "gspo", 2, "engine", 1, **kw)
    token = st.run_config("moe", "gspo_token", 2, "engine", 1, **kw)
    grpo = st.run_config("moe", "grpo", 2, "engine", 1, **kw)
    assert (base.rollout.weights_lag, stale.rollout.weights_lag) == (0, 2)
    assert (stale.algorithm.old_logprobs, stale.algorithm.behavior_correction) == ("recompute", "seq_tis")
    assert (naive.algorithm.old_logprobs, naive.algorithm.behavior_correction) == ("engine", "none")
    assert (token.algorithm.loss, token.algorithm.clip_ratio_low, token.algorithm.clip_ratio_high) == (
        "gspo_token",
        3e-4,
        4e-4,
    )
    assert (grpo.algorithm.loss, grpo.algorithm.clip_ratio_high, grpo.algorithm.loss_agg_mode) == (
        "grpo",
        0.27,
        "token-mean",
    )
    assert (base.trainer.test_freq, base.trainer.val_before_train, base.trainer.total_steps) == (3, True, 7)
    assert base.data.val_files and base.data.val_files[0].endswith("test.parquet")

    def rest(cfg, drop):
        d = to_dict(cfg)
        d["trainer"].pop("experiment_name")
        for section, key in drop:
            d[section].pop(key)
        return d

    staleness = [("rollout", "weights_lag"), ("algorithm", "old_logprobs"), ("algorithm", "behavior_correction")]
    assert rest(base, staleness) == rest(stale, staleness) == rest(naive, staleness)
    losses = [("algorithm", k) for k in ("loss", "clip_ratio_low", "clip_ratio_high", "loss_agg_mode")]
    assert rest(naive, losses) == rest(token, losses) == rest(grpo, losses)


def rec(step: int, lag: float, **kw) -> dict:
    return {"step": step, "reward/mean": kw.pop("reward", 0.5), "async/staleness": lag} | kw


def test_lag_violations_want_min_of_step_minus_one_and_eta(st):
    exact = [{"step": 0, "val/all/mean@1": 0.1}, rec(1, 0), rec(2, 1), rec(3, 2), rec(4, 2)]
    assert st.lag_violations(exact, 2) == []
    assert st.lag_violations(exact, 1) == [3, 4]
    assert st.lag_violations([rec(1, 0), {"step": 2, "reward/mean": 0.5}], 1) == [2]  # no staleness logged
    assert st.lag_violations([rec(1, 0), rec(2, 0)], 0) == []


def test_run_summary_hand_derived(st):
    rows = [{"step": 0, "val/all/mean@1": 0.25}]
    for k, (reward, length, clip, kl) in enumerate(
        [(0.2, 10.0, 0.9, 0.0), (0.4, 12.0, 0.5, 0.01), (0.6, 14.0, 0.3, 0.03), (0.3, 16.0, 0.1, 0.05)], 1
    ):
        extra = {"response/length_mean": length, "actor/clipfrac_seq": clip, "actor/clipfrac_token": clip / 2}
        extra |= {"behavior/kl_k3": kl, "behavior/ess": 1 - kl, "behavior/weight_max": 1 + kl}
        extra |= {"behavior/weight_mean": 1.0, "behavior/capped_frac": 0.0}
        rows.append(rec(k, min(k - 1, 1), reward=reward, **extra))
    rows[-1]["val/all/mean@1"] = 0.75
    s = st.run_summary(rows, eta=1, steps=4)  # window = round(4 / 5) -> 1 step; steady = steps 2..4
    assert s["val_final"] == 0.75 and s["val_gain"] == 0.5 and s["val_late"] == 0.5  # validations 0.25, 0.75
    assert s["reward_last"] == 0.3
    assert s["clipfrac_seq"] == pytest.approx((0.5 + 0.3 + 0.1) / 3)
    assert s["clipfrac_token"] == pytest.approx((0.25 + 0.15 + 0.05) / 3)
    assert s["kl_behavior"] == pytest.approx(0.03) and s["ess"] == pytest.approx(0.97)
    assert s["weight_max"] == pytest.approx(1.05)
    assert s["length_drift"] == 6.0
    # 3-step means 0.4, 0.4333: no fall below the best
    assert s["reward_fall"] == 0.0 and s["lag_violations"] == 0.0


def test_tolerance_reads_the_first_distinguishable_fall(st):
    def cell(mean, sd=0.01, n=3):
        return {"val_late": {"mean": mean, "sd": sd, "n": n, "per_seed": [mean] * n}}

    summary = {
        ("moe", "gspo", 0, "recompute"): cell(0.80),
        ("moe", "gspo", 1, "engine"): cell(0.79),  # within 2 SE (0.016)
        ("moe", "gspo", 2, "engine"): cell(0.60),  # distinguishably worse
        ("moe", "gspo", 4, "engine"): cell(0.81),  # recovered, but it already fell at 2
        ("moe", "gspo", 1, "recompute"): cell(0.85),
        ("moe", "gspo", 2, "recompute"): cell(0.82),
    }
    assert st.tolerance(summary, "moe", "gspo", "engine") == (1, 2)
    assert st.tolerance(summary, "moe", "gspo", "recompute") == (2, None)
    assert st.tolerance(summary, "dense", "gspo", "engine") == (None, None)
    summary[("moe", "grpo", 0, "recompute")] = cell(0.8, n=1)
    summary[("moe", "grpo", 1, "engine")] = cell(0.1, n=1)
    assert st.tolerance(summary, "moe", "grpo", "engine") == (None, None)  # one seed: no claim


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--models", "moe,foo"], "--models"),
        (["--losses", "ppo"], "--losses"),
        (["--etas", "1,x"], "--etas"),
        (["--etas", "-1"], "--etas"),
        (["--steps", "0"], "--steps"),
        (["--val-every", "0"], "--val-every"),
        (["--shard", "3/2"], "--shard"),
        (["--shard", "1"], "--shard"),
        (["--token-seeds", "0"], "--token-seeds"),
    ],
)
def test_bad_arguments_name_the_flag(st, argv, flag):
    with pytest.raises(UserError, match=flag):
        st.parse_args(argv)


def test_report_without_runs_is_one_line(st, tmp_path, capsys):
    assert st.main(["--report-only", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no finished run" in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_a_small_study_forces_exact_staleness_and_rebuilds_its_report(st, tmp_path):
    out, work = tmp_path / "study", tmp_path / "work"
    work.mkdir()
    cmd = [sys.executable, str(SCRIPT), "--out", str(out), "--work-dir", str(work), "--steps", "4", "--seeds", "1"]
    cmd += ["--val-every", "2", "--models", "moe", "--losses", "gspo", "--etas", "0,2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list(work.iterdir()) == []
    names = ["moe-gspo-eta0-recompute-seed0", "moe-gspo-eta2-engine-seed0", "moe-gspo-eta2-recompute-seed0"]
    raw = {n: json_lines(out / "raw" / f"{n}.jsonl") for n in names}
    for name, rows in raw.items():
        trained = [r for r in rows if r["step"] >= 1 and "reward/mean" in r]
        eta = 2 if "eta2" in name else 0
        lags = [r.get("async/staleness", 0.0) for r in trained]  # eta 0 is the plain trainer: no lag logged
        assert lags == [min(k - 1, eta) for k in (1, 2, 3, 4)] and ("async/staleness" in trained[0]) == (eta > 0)
        assert [r["step"] for r in rows if "val/all/mean@1" in r] == [0, 2, 4]
    # the stale steps (3, 4) under `engine` carry the drift the uncorrected update trains across, measured
    stale = [r for r in raw[names[1]] if r["step"] >= 3 and "reward/mean" in r]
    assert all(r["behavior/kl_k3"] > 0 and "time/diagnostics_s" in r for r in stale)
    assert all("time/diagnostics_s" not in r for r in raw[names[2]])  # recompute: pi_prox is the update's own
    # same seed, same initial weights: until an update reaches the rollout engine, the runs sample alike
    first = [rows[1] for rows in raw.values()]
    assert len({(r["reward/mean"], r["response/length_mean"]) for r in first}) == 1
    report = (out / "results.md").read_text()
    assert "all exact." in report
    row = next(line for line in report.splitlines() if line.startswith("| moe | GSPO | engine | 2 |"))
    final_val = raw[names[1]][-1]["val/all/mean@1"]
    assert row.split("|")[5].strip() == f"{final_val:.3f}"
    kl = sum(r["behavior/kl_k3"] for r in stale) / 2
    assert row.split("|")[15].strip() == f"{kl:.2e}"
    for png in out.glob("*.png"):
        png.unlink()
    (out / "results.md").unlink()
    again = subprocess.run([*cmd, "--report-only"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (out / "results.md").read_text() == report
    assert (out / "final_accuracy_vs_eta.png").read_bytes()[:4] == b"\x89PNG"
    # a second full invocation runs nothing: every run is finished
    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert "3 runs in the grid, 3 in this shard, 0 to run" in rerun.stdout


def json_lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
