"""`gspo-ascend train` and `eval` with tools (issue #45): the config, the tool schemas in the prompts, the agent
schedule, the loss mask through Ray's data-parallel dispatch and the engine, validation over trajectories, the tool
box's lifecycle, in one short run and one eval of its export.

The shipped tiny model has never seen a tool call and makes none (the embedded tool-use demo is not built yet), so
every trajectory is one model turn: the run must say so in its agent metrics, train, validate and stop cleanly, and
`eval` with the same config must reproduce the last validation. The turn loop with real tool turns is tested on
the engines (tests/unit/test_agent_loop.py, tests/integration/test_vllm_rollout.py).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.e2e.test_train_e2e import read_metrics, train_cmd

pytestmark = pytest.mark.slow


def test_a_run_with_tools_trains_validates_and_its_export_evaluates_alike(tmp_path):
    from gspo_ascend.runtime import embedded_data_dir

    out = tmp_path / "tools"
    tools = ["tools.names=[calculator,python]", "tools.max_turns=3"]
    common = ["trainer.total_steps=2", "data.train_batch_size=4", "rollout.n=4", *tools]
    proc = subprocess.run(train_cmd(out, *common), capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = read_metrics(out)
    assert [r["step"] for r in lines] == [0, 1, 2]  # the default config validates before training and at the end
    for r in lines[1:]:
        assert r["agent/turns_mean"] == 1.0 and r["agent/tool_call_rate"] == 0.0 and r["agent/tool_tokens_mean"] == 0
        assert r["agent/model_tokens_mean"] == r["response/length_mean"]  # every response token is the model's
        assert math.isfinite(r["actor/grad_norm"]) and r["actor/grad_norm"] > 0  # trained
    assert not [k for r in lines for k in r if "tools/" in k]  # no call, no fault
    assert lines[0]["val/all/prompts"] == 39 and "val/all/mean@1" in lines[2]

    evaluated = tmp_path / "eval"
    test_file = embedded_data_dir() / "test.parquet"
    proc = subprocess.run(
        [sys.executable, "-m", "gspo_ascend.cli", "eval", "--model", str(out / "hf"), "--data", str(test_file)]
        + ["--config", str(out / "config.json"), "--output", str(evaluated)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((evaluated / "eval.json").read_text())
    assert report["metrics"] == {k: v for k, v in lines[2].items() if k.startswith("val/")}
