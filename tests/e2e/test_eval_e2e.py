"""`gspo-ascend eval` end to end on CPU: the same responses and metrics in this process on one device and through
Ray on two workers (validation chunks seeded by their index, not by the worker that ran them), sampled with n > 1
so pass@k and maj@k are exercised; the metrics are those of the written responses, recomputed here."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow

SAMPLED = ["validation.greedy=false", "validation.n=4", "validation.k=[1,2,4]", "validation.batch_size=16"]


def run_eval(out: Path, *args: str) -> tuple[dict, list[dict], subprocess.CompletedProcess]:
    from gspo_ascend.runtime import embedded_data_dir
    from gspo_ascend.tiny import ensure_tiny_model

    cmd = [sys.executable, "-m", "gspo_ascend.cli", "eval", "--model", str(ensure_tiny_model())]
    cmd += ["--data", str(embedded_data_dir() / "test.parquet"), "--output", str(out), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()]
    return json.loads((out / "eval.json").read_text()), rows, proc


def test_eval_in_process_equals_ray_workers_and_its_responses(tmp_path):
    local, rows, proc = run_eval(tmp_path / "local", *SAMPLED)
    ray, ray_rows, _ = run_eval(tmp_path / "ray", "--ray", "trainer.devices_per_node=2", *SAMPLED)
    assert [r["response"] for r in ray_rows] == [r["response"] for r in rows]
    assert ray["metrics"] == local["metrics"] and ray["ray_workers"] == 2 and local["ray_workers"] == 0

    # progress per chunk (39 prompts in chunks of 16: 3 generate calls) and the table
    assert [line for line in proc.stderr.splitlines() if " batches, " in line][-1].startswith(
        "eval: 3/3 batches, 39/39 prompts"
    )
    assert proc.stdout.splitlines()[0].startswith("| data source | prompts | mean@4 | pass@1 | maj@1 | pass@2 |")
    assert (tmp_path / "local" / "eval.md").read_text().splitlines()[2].startswith("| all | 39 | ")

    # the metrics, recomputed from the responses written (4 per prompt, adjacent)
    m = local["metrics"]
    assert len(rows) == 39 * 4 and m["val/all/prompts"] == 39
    groups = [rows[i : i + 4] for i in range(0, len(rows), 4)]
    assert m["val/all/mean@4"] == pytest.approx(sum(r["acc"] for r in rows) / len(rows))
    assert m["val/all/pass@4"] == pytest.approx(sum(any(r["acc"] for r in g) for g in groups) / 39)
    assert m["val/all/pass@1"] == pytest.approx(m["val/all/mean@4"])
    assert m["val/all/maj@4"] == pytest.approx(sum(_majority_of_all(g) for g in groups) / 39)
    assert m["val/all/response_length_mean"] == pytest.approx(sum(r["length"] for r in rows) / len(rows))
    assert m["val/all/no_answer"] == sum(r["answer"] is None for r in rows)
    assert local["sampling"] == {
        "n": 4,
        "greedy": False,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "max_new_tokens": 64,
        "seed": 0,
        "batch_size": 16,
        "k": [1, 2, 4],
    }


def _majority_of_all(group: list[dict]) -> float:
    """maj@n: the vote of all n responses, a tie split evenly among the tied answers."""
    votes = Counter(r["answer"] for r in group if r["answer"] is not None)
    if not votes:
        return 0.0
    top = max(votes.values())
    winners = [a for a, c in votes.items() if c == top]
    right = {r["answer"]: r["acc"] >= 0.5 for r in group if r["answer"] is not None}
    return sum(right[w] for w in winners) / len(winners)


def test_eval_with_the_vllm_engine_answers_like_the_hf_engine(tmp_path):
    """Greedy decoding of the same checkpoint by vLLM's CPU build and by transformers: the same answers (fp32;
    the rollout log-probs of the two agree to ~1e-5, far from an argmax tie on this task)."""
    hf, hf_rows, _ = run_eval(tmp_path / "hf")
    vllm, vllm_rows, _ = run_eval(tmp_path / "vllm", "rollout.engine=vllm")
    assert vllm["engine"] == "vllm" and hf["engine"] == "hf"
    assert [r["response"] for r in vllm_rows] == [r["response"] for r in hf_rows]
    assert vllm["metrics"] == hf["metrics"]
