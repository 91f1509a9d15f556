"""benchmarks/verl_side: verl 0.9.1 as a side of the realistic benchmark. Without verl: each shim on what it patches
(P2's backend string, P4 on our own vLLM), the import hook, the turn gate's protocol end to end on stand-in verl
modules, the overrides against our side's config, the step report and padded-pass counts by hand, and the reward
against our trainer's. With ``.venv-verl`` built (benchmarks/verl_side/setup.sh; not in CI): two steps of verl's
trainer on the tiny model, in turns with ours."""

from __future__ import annotations

import importlib
import itertools
import json
import os
import re
import subprocess
import sys
import threading
import types
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import REPO, script_module

VERL_SIDE = REPO / "benchmarks" / "verl_side"
sys.path.insert(0, str(VERL_SIDE / "shims"))
import verl_cpu_shims as shims  # noqa: E402

sys.path.pop(0)


@pytest.fixture(scope="module")
def side():
    with script_module(VERL_SIDE / "side.py", "verl_side_side") as module:
        yield module


@pytest.fixture(scope="module")
def bench():
    with script_module(REPO / "benchmarks" / "e2e_vs_trl.py", "bench_e2e_vs_verl") as module:
        yield module


def test_after_import_runs_the_hook_once_after_the_module_ran(tmp_path, monkeypatch):
    (tmp_path / "gspo_hooked_mod.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    shims.after_import("gspo_hooked_mod", lambda m: seen.append(m.VALUE))
    module = importlib.import_module("gspo_hooked_mod")
    importlib.reload(module)  # a hook is for the first import only
    assert seen == [1]
    shims.after_import("gspo_hooked_mod", lambda m: seen.append("now"))  # already imported: runs at once
    assert seen == [1, "now"]
    sys.modules.pop("gspo_hooked_mod")


def test_p2_rewrites_only_the_duplicate_gloo_backend(monkeypatch):
    import torch.distributed as dist

    calls = []
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: calls.append((a, k)))
    shims.dedupe_gloo(None)
    shims.dedupe_gloo(None)  # idempotent: wrapped once
    dist.init_process_group(backend="cpu:gloo,cpu:gloo", rank=0)
    dist.init_process_group("cpu:gloo,cpu:gloo")
    dist.init_process_group(backend="cpu:gloo,cuda:nccl")
    assert calls == [
        ((), {"backend": "cpu:gloo", "rank": 0}),
        (("cpu:gloo",), {}),
        ((), {"backend": "cpu:gloo,cuda:nccl"}),
    ]


@pytest.mark.parametrize("on_path, expected", [(True, "False"), (False, "True")])
def test_p4_on_our_side_turns_vllms_onednn_linears_off(on_path, expected):
    """ours-vllm-noonednn: the sitecustomize on its PYTHONPATH reaches vLLM in a fresh interpreter (as in Ray's
    worker and vLLM's engine core); without it vLLM's CPU build packs its linears into oneDNN."""
    pytest.importorskip("vllm")
    path = [str(VERL_SIDE / "onednn_off")] if on_path else []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*path, str(REPO)]))
    code = "import vllm._custom_ops as ops; print(ops._supports_onednn)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.stdout.strip().splitlines()[-1] == expected, out.stderr[-2000:]


def _stand_in_verl(monkeypatch):
    """The two verl modules the gate patches, with only what it touches (PPOTrainer's hooks, Tracking.log)."""
    logged = []

    class PPOTrainer:
        global_steps = 0

        def on_train_begin(self):
            logged.append("begin")

        def _compute_metrics(self, batch, metrics, timing_raw, global_steps, epoch):
            logged.append(("metrics", global_steps))

    class Tracking:
        def log(self, data, step, backend=None):
            logged.append(("log", step))

    class Nested:  # what TransferQueue hands back: a nested tensor, read through its offsets
        def __init__(self, lengths):
            self.lengths = lengths

        def offsets(self):
            import torch

            return torch.tensor([0, *itertools.accumulate(self.lengths)])

    tq = SimpleNamespace(kv_batch_get=lambda **k: {"prompts": Nested([3, 4]), "responses": Nested([10, 1])})
    trainer_base = types.ModuleType("verl.trainer.ppo.v1.trainer_base")
    trainer_base.PPOTrainer, trainer_base.tq = PPOTrainer, tq
    tracking = types.ModuleType("verl.utils.tracking")
    tracking.Tracking = Tracking
    monkeypatch.setitem(sys.modules, trainer_base.__name__, trainer_base)
    monkeypatch.setitem(sys.modules, tracking.__name__, tracking)
    return PPOTrainer, Tracking, logged


def test_turn_gate_waits_outside_verls_step_and_hands_over_its_metrics(tmp_path, monkeypatch):
    PPOTrainer, Tracking, logged = _stand_in_verl(monkeypatch)
    shims.install_turn_gate(tmp_path)
    trainer, tracker = PPOTrainer(), Tracking()
    batch = SimpleNamespace(keys=["a", "b"], partition_id="train")

    def verl_loop():  # fit(): validation before training, begin, then per step: metrics, log
        tracker.log({"val-core/x/acc/mean@1": 0.25}, step=0)
        trainer.on_train_begin()
        for step in (1, 2):
            trainer._compute_metrics(batch, {}, {}, step, 0)
            tracker.log({"timing_s/step": 1.5 * step, "text": "not a number"}, step=step)

    loop = threading.Thread(target=verl_loop, daemon=True)
    loop.start()
    wait = shims._wait_for
    assert wait(tmp_path, ("ready.json",)) == "ready.json"
    assert json.loads((tmp_path / "val-0.json").read_text()) == {"val-core/x/acc/mean@1": 0.25}
    loop.join(0.3)
    assert logged == [("log", 0), "begin"]  # held before step 1 until go-1
    (tmp_path / "go-1").touch()
    wait(tmp_path, ("step-1.json",))
    step1 = json.loads((tmp_path / "step-1.json").read_text())
    assert step1 == {"timing_s/step": 1.5, "gspo/sample_lengths": [13, 5]}  # prompt + response per sample
    loop.join(0.3)
    assert logged[-1] == ("log", 1) and loop.is_alive()  # held after step 1's log until go-2
    (tmp_path / "go-2").touch()
    wait(tmp_path, ("step-2.json",))
    (tmp_path / "stop").touch()  # the last step: released, verl ends its loop by itself
    loop.join(10)
    assert not loop.is_alive() and logged[-1] == ("log", 2)


def _overrides(side, **shape):
    spec = side.VerlSpec("/m", ("/d/train.parquet",), ("/d/test.parquet",), **shape)
    pairs = (o.lstrip("+").split("=", 1) for o in side.verl_overrides(spec, bypass=False, work=Path("/w")))
    return dict(pairs)


def test_overrides_carry_our_sides_shape(side, bench, tmp_path):
    """The same batch, group, lengths, lr, clip window, loss aggregation and minibatching as our side's config."""
    args = bench.parse_args(["--shape", "realistic", "--sides", "ours-vllm,verl", "--steps", "3"])
    cfg = bench.our_config(args, str(tmp_path), bench.SIDES["ours-vllm"], "/m", ["/d/train.parquet"])
    o = _overrides(side, batch=args.batch, n=args.n, max_new_tokens=args.max_new_tokens, lr=args.lr, steps=3,
                   minibatches=bench.MINIBATCHES)  # fmt: skip
    a, r = "actor_rollout_ref.actor", "actor_rollout_ref.rollout"
    assert int(o["data.train_batch_size"]) == cfg.data.train_batch_size == 16
    assert int(o[f"{r}.n"]) == cfg.rollout.n == 8
    assert int(o["data.max_response_length"]) == cfg.data.max_response_length == 512
    assert int(o["data.max_prompt_length"]) == cfg.data.max_prompt_length
    assert float(o[f"{a}.optim.lr"]) == cfg.actor.lr
    assert float(o[f"{a}.clip_ratio_low"]) == cfg.algorithm.clip_ratio_low
    assert float(o[f"{a}.clip_ratio_high"]) == cfg.algorithm.clip_ratio_high
    assert o[f"{a}.loss_agg_mode"] == cfg.algorithm.loss_agg_mode and o[f"{a}.policy_loss.loss_mode"] == "gspo"
    # verl's mini-batch counts prompts, its micro-batch samples: 4 optimizer steps of 32 samples, one pass each
    assert int(o[f"{a}.ppo_mini_batch_size"]) * cfg.rollout.n == cfg.actor.micro_batch_size == 32
    assert int(o[f"{a}.ppo_micro_batch_size_per_gpu"]) == cfg.actor.micro_batch_size
    assert float(o[f"{r}.temperature"]) == cfg.rollout.temperature and int(o[f"{r}.top_k"]) == cfg.rollout.top_k
    assert o[f"{a}.fsdp_config.dtype"] == o[f"{r}.dtype"] == cfg.model.dtype == "float32"
    # held-out accuracy before and after, on the same prompts on both sides
    assert cfg.trainer.val_before_train and cfg.trainer.test_freq == 3 and o["trainer.test_freq"] == "3"
    assert json.loads(o["data.val_files"]) == ["/d/test.parquet"] and cfg.data.val_files[0].endswith("test.parquet")
    assert not cfg.validation.greedy and cfg.validation.n == int(o[f"{r}.val_kwargs.n"]) == side.HELDOUT_N
    assert o[f"{r}.val_kwargs.do_sample"] == "True" and float(o[f"{r}.val_kwargs.temperature"]) == 1.0
    assert o["algorithm.rollout_correction.bypass_mode"] == "False"


def test_padded_passes_by_hand(side):
    # 8 samples, 4 minibatches of 2 in order, each padded to its longer sample
    assert side.padded_passes([9, 1, 3, 5, 7, 3, 4, 8], 4) == (2 * 9 + 2 * 5 + 2 * 7 + 2 * 8, 40)


def test_step_report_maps_verls_timers(side):
    m = {"timing_s/step": 10.0, "timing_s/gen": 4.0, "timing_s/old_log_prob": 1.0, "timing_s/adv": 0.5,
         "timing_s/update_actor": 3.0, "timing_s/update_weights": 0.25, "perf/total_num_tokens": 900.0,
         "critic/score/mean": 0.5, "response_length/mean": 50.0, "response_length/max": 80.0,
         "prompt_length/mean": 30.0, "val-core/s/acc/mean@1": 0.75, "gspo/sample_lengths": [10, 20]}  # fmt: skip
    r = side.step_report(m, 1)
    assert r["stages"] == {"generate": 4.0, "reward": 0.0, "old_log_prob": 1.0, "adv": 0.5, "update": 3.0,
                           "sync": 0.25, "other": 1.25}  # fmt: skip
    assert (r["processed_tokens"], r["real_tokens"]) == (40, 30)
    assert r["step_s"] == 10.0 and r["tokens"] == 900.0 and r["validation"] == {"val-core/s/acc/mean@1": 0.75}


def test_verl_headline_is_our_first_side_against_the_fastest_verl_side(bench):
    def ran(name, steps):
        return bench.SideResult(name, step_s=steps, tokens=[1.0] * len(steps))

    results = [ran("ours-vllm-noonednn", [9, 4, 4]), ran("ours-vllm", [9, 3, 3]), ran("verl", [50, 20, 20]),
               ran("verl-bypass", [50, 10, 10])]  # fmt: skip
    out = bench.verl_ratios(results, bench.SIDES)
    assert out["headline"] == {"ours": "ours-vllm-noonednn", "verl": "verl-bypass", "ratio": 0.4}
    assert out["pairs"]["ours-vllm/verl"] == pytest.approx(0.15)
    assert re.search(r"step-time ratio ours/verl: 0\.4000 .*goal <= 0\.5: met", out["lines"][-1])


def test_reward_is_our_trainers_math_score():
    from gspo_ascend.rewards import math_score

    with script_module(VERL_SIDE / "reward.py", "verl_side_reward") as reward:
        for text, truth in [("so \\boxed{12}", "12"), ("\\boxed{3} then \\boxed{4}", "3"), ("no box", "1")]:
            assert reward.compute_score("gspo_ascend/synthetic_arithmetic", text, truth, extra_info={}) == math_score(
                text, truth
            )


VERL_VENV = Path(os.environ.get("GSPO_VERL_VENV", REPO / ".venv-verl"))


@pytest.mark.slow
@pytest.mark.skipif(not (VERL_VENV / "bin" / "python").is_file(), reason="no verl venv (benchmarks/verl_side/setup.sh)")
def test_verl_side_runs_in_turns_with_ours(tmp_path):
    out = tmp_path / "run.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "e2e_vs_trl.py"), "--shape", "tiny", "--max-new-tokens", "32",
           "--steps", "2", "--sides", "ours-hf,verl-bypass", "--json", str(out)]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(REPO), GSPO_VERL_VENV=str(VERL_VENV))
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1500)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    verl = json.loads(out.read_text())["sides"]["verl-bypass"]
    assert verl["steps"] == 2 and not verl["error"] and all(s > 0 for s in verl["step_s"])
    assert verl["stages_s"]["old_log_prob"] == pytest.approx(0.0, abs=0.05)  # bypass: pi_old is vLLM's
    assert 0.0 <= verl["extra"]["heldout_after"] <= 1.0
