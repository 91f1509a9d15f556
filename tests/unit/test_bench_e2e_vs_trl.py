"""benchmarks/e2e_vs_trl.py: the summary arithmetic, the argument checks, the reward wrapper, and one tiny run
of both trainers end to end (no speed assertion: the ratio only has to be a positive finite number)."""

from __future__ import annotations

import importlib.util
import json
import math
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

from gspo_ascend.errors import UserError
from tests.conftest import REPO

SCRIPT = REPO / "benchmarks" / "e2e_vs_trl.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_e2e_vs_trl", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_summary_excludes_the_warm_up_step(bench):
    side = bench.SideResult("x", step_s=[10.0, 2.0, 4.0, 3.0], tokens=[100.0, 20.0, 40.0, 30.0])
    assert side.steps == 4
    assert side.median_step_s() == 3.0  # median of 2, 4, 3
    assert side.tokens_per_s() == pytest.approx(90.0 / 9.0)


def test_our_history_becomes_per_step_times_and_tokens(bench):
    def step(seconds, tokens_per_s, rollout):
        return {
            "time/step_s": seconds,
            "perf/tokens_per_s": tokens_per_s,
            "time/rollout_s": rollout,
            "reward/mean": 0.5,
            "response/length_mean": 10.0,
            "prompt/length_mean": 31.0,
        }

    side = bench.ours_result([step(9.0, 10.0, 5.0), step(2.0, 50.0, 1.0), step(4.0, 25.0, 3.0)])
    assert side.step_s == [9.0, 2.0, 4.0] and side.tokens == [90.0, 100.0, 100.0]
    assert side.stages_s == {"rollout": 2.0}  # mean over the measured steps: (1 + 3) / 2
    assert side.tokens_per_s() == pytest.approx(200.0 / 6.0)


def test_clock_keeps_our_turn_out_of_trl_time(bench, monkeypatch):
    now = [0.0]
    monkeypatch.setattr(bench, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    turns = []

    def our_turn():  # 100 s of our trainer between two TRL rollout batches
        turns.append(now[0])
        now[0] += 100.0

    clock = bench.rollout_clock(4, between=our_turn)
    state = SimpleNamespace(global_step=0, num_input_tokens_seen=0)
    clock.on_train_begin(None, state, None)
    for step, (seconds, tokens) in enumerate([(0.2, 25), (0.3, 25), (0.2, 25), (0.3, 25)] + [(0.5, 40)] * 4, 1):
        now[0] += seconds
        state.global_step, state.num_input_tokens_seen = step, state.num_input_tokens_seen + tokens
        clock.on_step_end(None, state, None)
    clock.on_log(None, state, None, logs={"loss": 0.0})  # a log without a reward is not a rollout batch's
    clock.on_log(None, state, None, logs={"reward": 0.25, "completions/mean_length": 9.0})
    assert [round(s, 6) for s, _ in clock.intervals] == [1.0, 2.0]  # our 100 s turns are in neither
    assert [k for _, k in clock.intervals] == [100.0, 160.0]
    assert len(turns) == 2 and clock.logs == [{"reward": 0.25, "completions/mean_length": 9.0}]


@pytest.mark.parametrize(
    "argv, key",
    [
        (["--steps", "1"], "--steps"),
        (["--batch", "6"], "--batch"),
        (["--n", "1"], "--n"),
        (["--max-new-tokens", "0"], "--max-new-tokens"),
    ],
)
def test_bad_arguments_name_the_flag(bench, argv, key):
    with pytest.raises(UserError, match=key):
        bench.parse_args(argv)


def test_config_matches_the_paper_split(bench, tmp_path):
    cfg = bench.our_config(bench.parse_args(["--batch", "8", "--n", "4", "--max-new-tokens", "16"]), str(tmp_path))
    assert cfg.algorithm.minibatches_per_rollout == 4
    assert cfg.actor.ppo_mini_batch_size == 2  # prompts per optimizer step: 8 / 4
    assert cfg.actor.micro_batch_size == 8  # samples per optimizer step: 8 x 4 / 4, one forward/backward
    assert (cfg.algorithm.clip_ratio_low, cfg.algorithm.clip_ratio_high, cfg.algorithm.kl_coef) == (3e-4, 4e-4, 0.0)
    assert cfg.data.max_response_length == 16 and cfg.rollout.n == 4 and cfg.trainer.resume == "never"


def test_reward_wrapper_scores_like_our_trainer(bench, tmp_path):
    cfg = bench.our_config(bench.parse_args([]), str(tmp_path))
    cfg.reward.num_workers = 0  # score in this process: no worker spawn in a unit test
    reward = bench.trl_reward_function(cfg)
    completions = [
        [{"role": "assistant", "content": "7 + 5 = 12. \\boxed{12}"}],
        [{"role": "assistant", "content": "7 + 5 = 13. \\boxed{13}"}],
        [{"role": "assistant", "content": "7 + 5 = 12."}],  # no box: no answer
    ]
    scores = reward(
        prompts=[None] * 3,
        completions=completions,
        completion_ids=[[1] * 10] * 3,
        ground_truth=["12"] * 3,
        data_source=["gspo_ascend/synthetic_arithmetic"] * 3,
    )
    assert scores == [1.0, 0.0, 0.0]


@pytest.mark.slow
def test_tiny_run_of_both_sides(tmp_path):
    out = tmp_path / "bench.json"
    argv = ["--steps", "2", "--batch", "4", "--n", "2", "--max-new-tokens", "4", "--json", str(out)]
    proc = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    match = re.search(r"step-time ratio ours/TRL: (\S+)", proc.stdout)
    assert match, proc.stdout[-3000:]
    ratio = float(match.group(1))
    assert math.isfinite(ratio) and ratio > 0
    result = json.loads(out.read_text())
    for side in ("ours", "trl"):
        assert result[side]["steps"] == 2 and len(result[side]["step_s"]) == 2
        assert all(t > 0 for t in result[side]["step_s"]) and all(k > 0 for k in result[side]["tokens"])
        assert all(0 < length <= 4 for length in result[side]["response_length_mean"])
    # the printed ratio is the ratio of the two medians of the measured (non-warm-up) steps
    assert ratio == pytest.approx(result["ours"]["step_s"][1] / result["trl"]["step_s"][1], rel=1e-3, abs=1e-4)
    # same prompts through the same chat template: synthetic prompts all have one length (single-digit operands)
    assert result["ours"]["prompt_length_mean"] == pytest.approx(result["trl"]["prompt_length_mean"])
