"""`gspo-ascend train` and `eval` with tools (issue #45), as a user runs the shipped demo
(configs/tiny_gspo_tools.yaml): the tool-use tiny model (built on first use, ~2 min, cached), the products task,
the tool schemas in the prompts, the agent schedule, real calculator calls in the tool workers, the loss mask
through Ray's data-parallel dispatch and the engine, validation over trajectories, the tool box's lifecycle; then
`eval` of the export with the run's config reproduces the last validation, response for response.

Expected values come from the warm start's design (tiny_tools.py): about 30% of its samples call the calculator,
and a call is answered by a second model turn; greedy decoding answers directly, which a 2-layer model gets wrong
(docs/results/agent-tools.md measured the held-out accuracy at step 0: 0.00 on every seed).
"""

from __future__ import annotations

import json
import math
import subprocess

import pytest

from tests.conftest import REPO
from tests.e2e.test_train_e2e import eval_export, read_metrics, train_cmd

pytestmark = pytest.mark.slow


def test_the_tool_demo_calls_the_calculator_trains_validates_and_its_export_evaluates_alike(tmp_path):
    from gspo_ascend.runtime import embedded_data_dir

    out = tmp_path / "tools"
    config = ["--config", str(REPO / "configs" / "tiny_gspo_tools.yaml")]
    command = [*train_cmd(out, "trainer.total_steps=2", "trainer.test_freq=2"), *config]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = read_metrics(out)
    assert [r["step"] for r in lines] == [0, 1, 2]
    assert lines[0]["val/all/prompts"] == 64 and "val/all/mean@1" in lines[2]
    for r in lines[1:]:
        calls = r["tools/calculator/calls"] + r.get("tools/_call/malformed", 0)  # a malformed call is a call too
        assert 0.1 < r["agent/tool_call_rate"] < 0.9 and calls >= r["agent/tool_call_rate"] * 128  # 16 x 8 samples
        assert r["agent/turns_mean"] == pytest.approx(1 + r["agent/tool_call_rate"], abs=0.05)  # a call, an answer
        assert 0 < r["agent/tool_tokens_mean"] and r["agent/model_tokens_mean"] < r["response/length_mean"]
        assert r["reward/mean"] > 0.1  # the calls' answers are right: the calculator ran
        assert math.isfinite(r["actor/grad_norm"]) and r["actor/grad_norm"] > 0

    evaluated = tmp_path / "eval"
    proc = eval_export(out, embedded_data_dir(tools=True) / "test.parquet", evaluated)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((evaluated / "eval.json").read_text())
    assert report["metrics"] == {k: v for k, v in lines[2].items() if k.startswith("val/") and "/tools/" not in k}
    generated = [json.loads(x) for x in (evaluated / "generations.jsonl").read_text().splitlines()]
    answers = [json.loads(x) for x in (out / "validation" / "step_00000002.jsonl").read_text().splitlines()]
    assert [g["response"] for g in generated[: len(answers)]] == [a["response"] for a in answers]


def test_the_tool_demo_on_vllm_runs_its_trajectories_in_flight_on_each_rank(tmp_path):
    """The demo on the vLLM engine at rollout TP 1 over two workers: each rank's engine runs its share of the
    trajectories in flight (AgentLoop.in_flight over vLLM's own engine), with its own tool workers; the driver
    gathers them. One step, 8 prompts x 4 samples. Expected: the loop that ran (``agent/in_flight``), real calls
    (about 30% by the warm start), a call answered by a second model turn, the counts gathered from both ranks."""
    out = tmp_path / "tools-vllm"
    config = ["--config", str(REPO / "configs" / "tiny_gspo_tools.yaml")]
    overrides = ("rollout.engine=vllm", "trainer.devices_per_node=2", "trainer.total_steps=1", "trainer.test_freq=0",
                 "trainer.val_before_train=false", "data.train_batch_size=8", "rollout.n=4")  # fmt: skip
    proc = subprocess.run([*train_cmd(out, *overrides), *config], capture_output=True, text=True, cwd=REPO,
                          timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (r,) = read_metrics(out)
    assert r["agent/in_flight"] == 1.0
    calls = r["tools/calculator/calls"] + r.get("tools/_call/malformed", 0)
    assert 0.05 < r["agent/tool_call_rate"] < 0.9 and calls == pytest.approx(r["agent/tool_calls_mean"] * 32)
    assert r["agent/turns_mean"] == pytest.approx(1 + r["agent/tool_call_rate"], abs=0.05)
    assert r["reward/mean"] > 0.05 and math.isfinite(r["actor/grad_norm"])
