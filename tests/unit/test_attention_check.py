"""benchmarks/attention_check.py (issue #43's prepared device check) on the CPU at tiny sizes: the command line's JSON
and summary line, varlen said unavailable on a CPU, bad input in one line with exit 2, and the varlen path's wiring
(K / V heads repeated as SDPA's GQA groups them, causal, the comparison with the per-sequence path) through a CPU
stand-in for torch's flash kernel, which has no CPU implementation."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import REPO, script_module

SCRIPT = REPO / "benchmarks" / "attention_check.py"
TINY = ["--device", "cpu", "--dtype", "float32", "--sequences", "2", "--max-extra", "16", "--iters", "1"]
TINY += ["--layers", "2"]


@pytest.fixture(scope="module")
def check():
    with script_module(SCRIPT, "bench_attention_check") as module:
        yield module


def test_a_tiny_cpu_run_reports_every_field_and_varlen_unavailable(tmp_path):
    out = tmp_path / "attention.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), *TINY, "--json", str(out)], capture_output=True, text=True,
                          cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = proc.stdout.strip().splitlines()
    assert len(summary) == 1 and summary[0].startswith("attention_check: cpu float32, 2 sequences x 2 layers")
    r = json.loads(out.read_text())
    assert (r["device"], r["dtype"], r["heads"], r["kv_heads"], r["head_dim"]) == ("cpu", "float32", 16, 8, 128)
    assert (r["sequences"], r["layers"], r["iters"], r["max_extra"], r["base_length"]) == (2, 2, 1, 16, 256)
    assert len(r["iteration_lengths"]) == 1 and all(256 <= n <= 272 for n in r["iteration_lengths"][0])
    assert r["iteration_tokens"] == [sum(r["iteration_lengths"][0])]
    assert r["first_lengths"] != r["iteration_lengths"][0]  # the warm-up's row is another one
    assert r["calls_per_iteration"] == {"per_sequence": 4, "varlen": 2}
    assert set(r["runs"]) == {"per_sequence_cpu", "varlen"}  # no cuDNN on a CPU: one per-sequence run
    run = r["runs"]["per_sequence_cpu"]
    assert run["available"] and run["first_s"] > 0 and len(run["seconds"]) == len(run["forward_seconds"]) == 1
    assert run["median_s"] == run["mean_s"] == run["seconds"][0] > run["forward_seconds"][0] > 0
    assert r["runs"]["varlen"] == {"available": False, "reason": "varlen_attn: no CPU kernel (CUDA only)"}
    assert r["varlen_vs_per_sequence"] is None and r["ratios"] == {}
    assert "varlen_attn: no CPU kernel" in summary[0]


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--iters", "0"], "--iters"),
        (["--layers", "x"], "--layers"),
        (["--device", "npu"], "--device"),
        (["--max-extra", "-1"], "--max-extra"),
        (["--dtype", "float16"], "--dtype"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(check, capsys, argv, names):
    with pytest.raises(SystemExit) as exit_:
        check.main(["--device", "cpu", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and names in err and "Traceback" not in err


def stand_in_varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size=(-1, -1)):
    """torch's varlen_attn contract on [T, H, D] rows, computed per sequence with the math kernel (no CPU flash)."""
    assert window_size == (-1, 0) and q.shape[1] == k.shape[1] == v.shape[1]  # causal, heads already repeated
    assert cu_q.dtype == torch.int32 and torch.equal(cu_q, cu_k) and max_q == max_k
    bounds = cu_q.tolist()
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        a, b, c = (t[start:end].transpose(0, 1) for t in (q, k, v))
        causal = torch.ones(end - start, end - start, dtype=torch.bool).tril()
        outs.append(F.scaled_dot_product_attention(a, b, c, attn_mask=causal).transpose(0, 1))
    return torch.cat(outs)


def tiny_args(check, monkeypatch) -> argparse.Namespace:
    monkeypatch.setattr(check, "BASE_LENGTH", 24)  # in-process: rows of ~50 tokens, not ~530
    return check.parse_args(TINY)


def test_varlen_wiring_matches_the_per_sequence_path(check, monkeypatch):
    """With a CPU stand-in for the kernel, the varlen run times like the others and its output and q / k / v
    gradients equal the per-sequence path's (fp32): the K / V repetition is SDPA's GQA grouping, the window causal."""
    monkeypatch.setattr("torch.nn.attention.varlen.varlen_attn", stand_in_varlen_attn)
    monkeypatch.setattr(check, "varlen_unavailable", lambda args: None)
    report = check.measure(tiny_args(check, monkeypatch), lambda report: None)
    run = report["runs"]["varlen"]
    assert run["available"] and len(run["seconds"]) == 1 and run["first_s"] > 0
    diff = report["varlen_vs_per_sequence"]
    assert set(diff["max_abs_diff"]) == {"out", "dq", "dk", "dv"}
    assert max(diff["max_abs_diff"].values()) < 1e-5 and min(diff["reference_max_abs"].values()) > 0.1
    assert report["ratios"]["per_sequence_over_varlen"] > 0


def test_a_kernel_that_refuses_is_a_result_not_a_crash(check, monkeypatch):
    monkeypatch.setattr(check, "varlen_unavailable", lambda args: None)  # the real kernel: none for the CPU
    report = check.measure(tiny_args(check, monkeypatch), lambda report: None)
    assert report["runs"]["per_sequence_cpu"]["available"]
    varlen = report["runs"]["varlen"]
    assert not varlen["available"] and varlen["reason"].startswith("varlen_attn failed: NotImplementedError")
    assert check.summary_line(report).count("\n") == 0
