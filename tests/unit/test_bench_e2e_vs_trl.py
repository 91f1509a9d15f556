"""benchmarks/e2e_vs_trl.py (+ e2e_sides.py, e2e_turns.py): the summary arithmetic, the argument checks, the reward
wrapper, the per-side bookkeeping (padding, stages, the recompute probe), and one tiny run of both trainers end to
end (no speed assertion: the ratio only has to be a positive finite number)."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from gspo_ascend.engines.base import SampleBatch
from gspo_ascend.errors import UserError
from tests.conftest import REPO, script_module

SCRIPT = REPO / "benchmarks" / "e2e_vs_trl.py"


@pytest.fixture(scope="module")
def bench():
    with script_module(SCRIPT, "bench_e2e_vs_trl") as module:
        yield module


@pytest.fixture(scope="module")
def sides(bench):
    import e2e_sides

    return e2e_sides


def test_summary_excludes_the_warm_up_step(bench):
    side = bench.SideResult("x", step_s=[10.0, 2.0, 4.0, 3.0], tokens=[100.0, 20.0, 40.0, 30.0])
    side.processed_tokens, side.real_tokens = [50.0, 100.0, 100.0, 200.0], [50.0, 95.0, 90.0, 195.0]
    assert side.steps == 4 and side.ok
    assert side.median_step_s() == 3.0  # median of 2, 4, 3
    assert side.tokens_per_s() == pytest.approx(90.0 / 9.0)
    assert side.padded_share() == pytest.approx(1 - 380.0 / 400.0)
    assert side.computed_per_real() == pytest.approx(400.0 / 380.0)
    side.processed_tokens = [50.0, 80.0, 80.0, 160.0]  # a shared prompt: fewer computed than held, no padding
    assert side.padded_share() == 0.0 and side.computed_per_real() == pytest.approx(320.0 / 380.0)
    assert not bench.SideResult("y", step_s=[1.0, 1.0], error="boom").ok
    side.others_cpu_s = [5.0, 1.0, 2.0, 0.0]  # the others' CPU-s during each step; the warm-up's left out
    assert side.others_cores() == pytest.approx(3.0 / 9.0)


def batch_of(prompt_lengths, response_lengths, width=6) -> SampleBatch:
    mask = (torch.arange(width)[None, :] < torch.tensor(response_lengths)[:, None]).float()
    return SampleBatch([[7] * p for p in prompt_lengths], (mask * 9).long(), mask, advantages=torch.zeros(len(mask)))


def test_padding_of_the_update_passes_by_hand(sides):
    # 8 samples, 4 minibatches of 2, one pass each (micro_batch_size 2); sample tokens = prompt + response
    batch = batch_of([3, 1, 2, 2, 5, 1, 4, 2], [6, 0, 1, 3, 2, 2, 0, 6])  # tokens 9 1 | 3 5 | 7 3 | 4 8
    cfg = SimpleNamespace(
        actor=SimpleNamespace(micro_batch_size=2, max_tokens_per_micro_batch=None, use_remove_padding=True),
        algorithm=SimpleNamespace(minibatches_per_rollout=4),
    )
    assert sides.padding_of_update(batch, cfg) == (40, 40)  # packed: a row holds exactly its samples' tokens
    cfg.actor.use_remove_padding = False  # padded: 2 x the longer of each pair
    assert sides.padding_of_update(batch, cfg) == (2 * (9 + 5 + 7 + 8), 40)
    cfg.actor.micro_batch_size, cfg.actor.max_tokens_per_micro_batch = None, 8  # budget: 9 alone, 1 alone, ...
    assert sides.padding_of_update(batch, cfg) == (9 + 1 + 2 * 5 + 7 + 3 + 8 + 4, 40)
    # shared prefix, packed pairs: only the second pair's two prompts are one ([7, 7]): computed once, 2 fewer
    cfg.actor.micro_batch_size, cfg.actor.max_tokens_per_micro_batch, cfg.actor.use_remove_padding = 2, None, True
    assert sides.padding_of_update(batch, cfg, shared=True) == (40 - 2, 40)


def test_our_step_report_takes_the_probe_out_of_the_step(sides):
    batch = batch_of([3, 1, 2, 2], [6, 0, 1, 3])
    probe = SimpleNamespace(batch=batch, probe_s=0.5, gap_max=1e-6)
    metrics = {
        "time/step_s": 10.0,
        "time/rollout_s": 4.0,
        "time/reward_s": 0.1,
        "time/old_log_prob_s": 0.6,  # the probe's 0.5 s ran inside this stage
        "time/update_s": 5.0,
        "time/sync_s": 0.3,
        "perf/tokens_per_s": 2.5,
        "reward/mean": 0.25,
        "response/length_mean": 2.5,
        "response/length_max": 6.0,
        "prompt/length_mean": 2.0,
    }
    from gspo_ascend.config import load_config

    base = ["actor.micro_batch_size=4", "algorithm.minibatches_per_rollout=1", "trainer.device=cpu"]
    report = sides.our_step_report(metrics, probe, load_config(overrides=[*base, "actor.shared_prefix=off"]))
    assert report["step_s"] == pytest.approx(9.5) and report["tokens"] == pytest.approx(25.0)
    assert report["stages"] == pytest.approx(
        {"generate": 4.0, "reward": 0.1, "old_log_prob": 0.1, "update": 5.0, "sync": 0.3}
    )
    assert (report["processed_tokens"], report["real_tokens"]) == (18, 18)  # 9 + 1 + 3 + 5
    # auto on the CPU: the engine shares the two [7, 7] prompts' forward, and the report counts that row
    report = sides.our_step_report(metrics, probe, load_config(overrides=base))
    assert (report["processed_tokens"], report["real_tokens"]) == (16, 18)
    assert report["recompute_probe_s"] == 0.5 and report["engine_logprob_gap_max"] == 1e-6


def test_trl_stages_split_old_log_probs_from_the_training_forward(sides):
    stages = sides.TrlStages()
    for name, seconds, inside in [
        ("transformers.generate", 3.0, True),
        ("_calculate_rewards", 0.2, True),
        ("_get_per_token_logps_and_entropies", 1.0, True),  # old log-probs: inside _prepare_inputs
        ("_prepare_inputs", 4.5, False),
        ("_get_per_token_logps_and_entropies", 2.0, False),  # the loss forward: part of the update
        ("compute_loss", 2.2, False),
        ("_prepare_inputs", 0.01, False),  # the 3 other optimizer steps only slice the buffer
    ]:
        stages.add(sides._stage_name(f"GRPOTrainer.{name}"), seconds, inside_prepare=inside)
    got = stages.take(10.0)
    assert got == pytest.approx(
        {"generate": 3.0, "reward": 0.2, "old_log_prob": 1.0, "sync": 0.0, "update": 10.0 - 4.51, "other_prepare": 0.31}
    )
    assert stages.take(1.0)["update"] == 1.0  # taken: the next batch starts from zero


def test_headline_is_our_first_side_against_the_fastest_trl_side_that_ran(bench):
    def side(name, steps, error=""):
        return bench.SideResult(name, step_s=steps, tokens=[1.0] * len(steps), error=error)

    results = [
        side("ours-vllm", [9.0, 2.0, 2.0]),
        side("ours-hf", [9.0, 5.0, 5.0]),
        side("trl-hf", [9.0, 8.0, 8.0]),
        side("trl-vllm", [], error="AttributeError: weight_loader"),
        side("trl-vllm-reload", [9.0, 6.0, 6.0]),
    ]
    ours, trl = bench.headline(results)
    # trl-vllm-reload is faster but carries a patch of ours: never the headline; trl-vllm failed
    assert (ours.name, trl.name) == ("ours-vllm", "trl-hf")
    results[2].error = "died"
    assert bench.headline(results)[1] is None  # no unmodified TRL side ran: no headline ratio
    results[0].error = "died"
    assert bench.headline(results)[0].name == "ours-hf"


def test_engine_saving_is_a_share_of_the_training_phase_with_the_recompute(bench):
    r = bench.SideResult("ours-vllm", step_s=[1.0, 1.0], tokens=[1.0, 1.0])
    r.stages_s = {"old_log_prob": 0.0, "update": 3.0}
    assert bench.engine_saving([r]) is None  # no probe: nothing to say
    r.extra = {"recompute_probe_s": 1.0, "engine_logprob_gap_max": 2e-6}
    saved = bench.engine_saving([r])
    assert saved["share"] == pytest.approx(0.25) and saved["training_phase_s"] == pytest.approx(4.0)


def test_clock_keeps_the_turns_out_of_trl_time(bench, monkeypatch):
    now = [0.0]
    monkeypatch.setattr(bench, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    turns = []

    def other_sides_turn():  # 100 s of the other sides between two TRL rollout batches
        turns.append(now[0])
        now[0] += 100.0

    clock = bench.rollout_clock(4, between=other_sides_turn)
    state = SimpleNamespace(global_step=0, num_input_tokens_seen=0)
    clock.on_train_begin(None, state, None)
    for step, (seconds, tokens) in enumerate([(0.2, 25), (0.3, 25), (0.2, 25), (0.3, 25)] + [(0.5, 40)] * 4, 1):
        now[0] += seconds
        state.global_step, state.num_input_tokens_seen = step, state.num_input_tokens_seen + tokens
        clock.on_step_end(None, state, None)
    clock.on_log(None, state, None, logs={"loss": 0.0})  # a log without a reward is not a rollout batch's
    clock.on_log(None, state, None, logs={"reward": 0.25, "completions/mean_length": 9.0})
    assert [round(s, 6) for s, _ in clock.intervals] == [1.0, 2.0]  # the 100 s turns are in neither
    assert [k for _, k in clock.intervals] == [100.0, 160.0]
    assert len(turns) == 2 and clock.logs == [{"reward": 0.25, "completions/mean_length": 9.0}]


@pytest.mark.parametrize(
    "argv, key",
    [
        (["--steps", "1"], "--steps"),
        (["--batch", "6"], "--batch"),
        (["--n", "1"], "--n"),
        (["--max-new-tokens", "0"], "--max-new-tokens"),
        (["--sides", "ours-hf,trl-gpu"], "--sides"),
        (["--sides", "trl-hf"], "--sides"),  # none of ours: nothing measured of ours
    ],
)
def test_bad_arguments_name_the_flag(bench, argv, key):
    with pytest.raises(UserError, match=key):
        bench.parse_args(argv)


def test_shapes_fill_what_the_flags_leave(bench):
    args = bench.parse_args(["--shape", "realistic", "--steps", "3"])
    assert (args.model, args.max_new_tokens, args.steps) == ("small", 512, 3)
    assert args.sides[:4] == ["ours-vllm", "ours-hf", "trl-hf", "trl-vllm"]
    assert bench.parse_args([]).sides == ["ours-hf", "trl-hf"] and bench.parse_args([]).model == "tiny"


def test_sides_start_outside_the_callers_world(bench, monkeypatch):
    # a test session whose in-process engine left RANK / WORLD_SIZE set made TRL's side ask for MASTER_ADDR
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("GSPO_SIDE_ENV_PROBE", "kept")
    env = bench.side_env(bench.SIDES["trl-hf"], None, "")
    assert not {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"} & set(env)
    assert env["GSPO_SIDE_ENV_PROBE"] == "kept" and env["TOKENIZERS_PARALLELISM"] == "false"


def test_config_matches_the_paper_split(bench, tmp_path):
    args = bench.parse_args(["--batch", "8", "--n", "4", "--max-new-tokens", "16"])
    cfg = bench.our_config(args, str(tmp_path))
    assert cfg.algorithm.minibatches_per_rollout == 4
    assert cfg.actor.ppo_mini_batch_size == 2  # prompts per optimizer step: 8 / 4
    assert cfg.actor.micro_batch_size == 8  # samples per optimizer step: 8 x 4 / 4, one forward/backward
    assert (cfg.algorithm.clip_ratio_low, cfg.algorithm.clip_ratio_high, cfg.algorithm.kl_coef) == (3e-4, 4e-4, 0.0)
    assert cfg.data.max_response_length == 16 and cfg.rollout.n == 4 and cfg.trainer.resume == "never"
    fast = bench.our_config(args, str(tmp_path), bench.SIDES["ours-vllm"])
    assert (fast.rollout.engine, fast.algorithm.old_logprobs, fast.actor.use_remove_padding) == ("vllm", "engine", True)


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


def test_waiting_sides_are_stopped_through_a_turn_and_continued_after_it(bench):
    """procstats.paused: a process and its child, both spinning, use no CPU inside the block (stopped), run again
    after it, also when the block raises (a side that fails in its turn must not leave the others stopped)."""
    import psutil
    from procstats import descendants, paused, tree_cpu_s

    spin = "while True: pass"
    code = f"import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', {spin!r}])\n{spin}"
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 30
        while not descendants(parent.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        tree = [parent.pid, *descendants(parent.pid)]
        assert len(tree) == 2
        with pytest.raises(RuntimeError), paused([parent.pid]) as held:
            assert held == tree
            assert {psutil.Process(p).status() for p in tree} == {psutil.STATUS_STOPPED}
            before = tree_cpu_s(parent.pid)
            time.sleep(0.3)
            assert tree_cpu_s(parent.pid) == before
            raise RuntimeError("the side in its turn failed")
        assert psutil.STATUS_STOPPED not in {psutil.Process(p).status() for p in tree}
        deadline = time.monotonic() + 10  # a loaded CI box may give the spinners a small share of its cores
        while tree_cpu_s(parent.pid) <= before + 0.1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tree_cpu_s(parent.pid) > before + 0.1  # they run again
    finally:
        for pid in reversed([parent.pid, *descendants(parent.pid)]):
            psutil.Process(pid).kill()
        parent.wait()


@pytest.mark.slow
def test_tiny_run_of_both_sides(tmp_path):
    out = tmp_path / "bench.json"
    argv = ["--steps", "2", "--batch", "4", "--n", "2", "--max-new-tokens", "4", "--json", str(out)]
    proc = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, cwd=REPO, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    match = re.search(r"step-time ratio ours/TRL: (\S+)", proc.stdout)
    assert match, proc.stdout[-3000:]
    ratio = float(match.group(1))
    assert math.isfinite(ratio) and ratio > 0
    result = json.loads(out.read_text())
    assert set(result["sides"]) == {"ours-hf", "trl-hf"}
    for side in ("ours", "trl"):
        assert result[side]["steps"] == 2 and len(result[side]["step_s"]) == 2 and not result[side]["error"]
        assert all(t > 0 for t in result[side]["step_s"]) and all(k > 0 for k in result[side]["tokens"])
        assert all(0 < length <= 4 for length in result[side]["response_length_mean"])
        assert result[side]["peak_rss_mib"] > 100  # a process holding a model and an optimizer
        assert {"generate", "old_log_prob", "update"} <= set(result[side]["stages_s"])
        # in turns the other side waits meanwhile, stopped: its processes' CPU-s, one per step, all 0
        assert result[side]["others_cpu_s"] == [0.0, 0.0]
    assert result["ours"]["padded_token_share"] == 0.0  # packed rows carry no padding
    # the printed ratio is the ratio of the two medians of the measured (non-warm-up) steps
    assert ratio == pytest.approx(result["ours"]["step_s"][1] / result["trl"]["step_s"][1], rel=1e-3, abs=1e-4)
    # same prompts through the same chat template: synthetic prompts all have one length (single-digit operands)
    assert result["ours"]["prompt_length_mean"] == pytest.approx(result["trl"]["prompt_length_mean"])
