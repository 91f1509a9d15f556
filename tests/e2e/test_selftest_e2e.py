"""`gspo-ascend selftest` through the CLI, as a user runs it (issue #15):

- the full run on the CPU with the NPU emulated by the shim (trainer.device=npu) runs every check and passes;
- on plain CPU the quick run passes, skipping only the NPU-only op checks (each with its reason) and what --quick
  leaves out: the full run's vLLM, training and Ray checks are the emulated NPU run's above, through the same check
  code (only the device differs), and run on plain CPU in the integration and e2e tiers (a full plain-CPU run here
  cost ~145 s of CI for them again; `gspo-ascend selftest --device cpu` still runs them, docs/selftest.md);
- a fault injected into one shim op fails exactly that op's check (naming the op and the size of the difference)
  and one in the rollout weight update fails exactly the rollout check; the other checks still run (both faults in
  one run: they touch different layers, so one run shows both, issue #40);
- --json is one record per check (name, status, seconds, detail, fix).

Each run prints its wall time (pytest -s); docs/selftest.md quotes them.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time

import pytest

from gspo_ascend.selftest import ops
from tests.conftest import REPO

pytestmark = pytest.mark.slow

SETUP = ["setup/device", "setup/tiny_model", "setup/mindspeed_ops"]
OPS = [f"ops/{case.name}" for case in ops.CASES]
LATER = ["collectives", "collectives/mc2", "collectives/weight_sync", "rollout/hf", "rollout/vllm", "rollout/vllm_moe",
         "training/megatron_tp2", "training/fsdp_vs_megatron", "training/checkpoint", "training/moe_megatron_tp1",
         "training/moe_fsdp_vs_megatron", "e2e/ray_gspo"]  # fmt: skip
ALL = SETUP + OPS + LATER
QUICK_SKIPS = {"rollout/vllm", "rollout/vllm_moe", "training/megatron_tp2", "training/fsdp_vs_megatron",
               "training/checkpoint", "training/moe_megatron_tp1", "training/moe_fsdp_vs_megatron",
               "e2e/ray_gspo"}  # fmt: skip
FIELDS = {"name", "status", "seconds", "detail", "fix"}


def selftest(*args: str, env: dict | None = None, timeout: int = 1800) -> tuple[subprocess.CompletedProcess, float]:
    import os

    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "gspo_ascend.cli", "selftest", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    seconds = time.perf_counter() - start
    print(
        f"\n[selftest {' '.join(args)} {env or ''}] {seconds:.0f} s\n{proc.stderr if '--json' in args else proc.stdout}"
    )
    return proc, seconds


def records(proc: subprocess.CompletedProcess) -> dict[str, dict]:
    found = json.loads(proc.stdout)  # stdout holds nothing but the JSON list
    assert isinstance(found, list) and all(set(r) == FIELDS for r in found)
    assert all(r["status"] in ("pass", "fail", "skip") and r["seconds"] >= 0 for r in found)
    assert all(bool(r["fix"]) == (r["status"] == "fail") for r in found)  # a fix line for failures only
    names = [r["name"] for r in found]
    assert len(names) == len(set(names))
    return {r["name"]: r for r in found}


def test_full_run_on_the_emulated_npu_runs_every_check_and_passes():
    proc, _ = selftest("--device", "npu", "--json", env={"GSPO_DEVICE_SHIM": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = records(proc)
    assert list(found) == ALL
    assert {name: r["status"] for name, r in found.items() if r["status"] != "pass"} == {}
    assert "npu emulated on the CPU shim" in found["setup/device"]["detail"]
    assert "over gloo; bus bandwidth at 8 MiB: all_reduce" in found["collectives"]["detail"]
    assert "npu_mm_reduce_scatter_base exact on 2 ranks" in found["collectives/mc2"]["detail"]
    assert "without MindSpeed (not installed" in found["training/megatron_tp2"]["detail"]
    assert "fsdp + hf" in found["e2e/ray_gspo"]["detail"]
    assert "nothing built; the shim's CPU stand-ins serve" in found["setup/mindspeed_ops"]["detail"]
    assert "experts: SequentialMLP" in found["training/moe_megatron_tp1"]["detail"]
    assert "bitwise equal after send / Receiver on 2 ranks over gloo" in found["collectives/weight_sync"]["detail"]
    assert re.search(rf"summary: {len(ALL)} pass, 0 fail, 0 skip in \S+ s\n", proc.stderr)


def test_quick_run_on_plain_cpu_passes_and_skips_only_npu_only_ops_and_the_quick_skips():
    proc, _ = selftest("--device", "cpu", "--quick")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = {m[2]: (m[1], m[3]) for m in re.finditer(r"^\[(pass|fail|skip)\] +\S+s (\S+): (.*)$", proc.stdout, re.M)}
    assert list(lines) == ALL
    skipped = {name for name, (status, _) in lines.items() if status == "skip"}
    npu_only = {"collectives/mc2", "setup/mindspeed_ops"}
    assert skipped == {f"ops/{c.name}" for c in ops.CASES if c.torch_path is None} | npu_only | QUICK_SKIPS
    assert all(lines[name][1].startswith("not on the cpu path: ") for name in skipped - npu_only - QUICK_SKIPS)
    assert all("--quick" in lines[name][1] for name in QUICK_SKIPS)
    assert lines["collectives/mc2"][1] == "MC2 is torch_npu's (Ascend); this is a cpu node"
    assert lines["setup/mindspeed_ops"][1] == "MindSpeed's JIT-built ops are NPU-only (this is cpu)"
    assert all(status == "pass" for name, (status, _) in lines.items() if name not in skipped)
    assert "MoE model not needed (--quick)" in lines["setup/tiny_model"][1]
    work = re.search(r"work dir (\S+)", proc.stdout)[1]
    assert not (REPO / work).exists()  # removed: nothing failed


def test_injected_faults_fail_exactly_their_checks_and_the_run_goes_on():
    """Two faults in one --quick run (GSPO_SELFTEST_FAULT takes a list): the op fault fails exactly that op's check,
    the one in the rollout weight update fails exactly the rollout check, and every other check still runs."""
    env = {"GSPO_DEVICE_SHIM": "1", "GSPO_SELFTEST_FAULT": "npu_swiglu,rollout_weight_update"}
    proc, _ = selftest("--device", "npu", "--quick", "--json", env=env)
    assert proc.returncode == 1
    found = records(proc)
    assert list(found) == ALL
    assert [n for n, r in found.items() if r["status"] == "fail"] == ["ops/npu_swiglu", "rollout/hf"]
    detail = found["ops/npu_swiglu"]["detail"]
    assert re.match(r"npu_swiglu fp32 output 0: max \|device - reference\| = \S+, 1\.0e-01 of its scale", detail)
    assert {n for n, r in found.items() if r["status"] == "skip"} == QUICK_SKIPS  # --quick, said so
    assert all("--quick" in found[n]["detail"] for n in QUICK_SKIPS)
    for fault in ("npu_swiglu", "rollout_weight_update"):
        assert f"TEST-ONLY fault injected: GSPO_SELFTEST_FAULT={fault}" in proc.stderr
    detail = found["rollout/hf"]["detail"]
    diff = float(re.search(r"with the same weights by (\S+) \(bound 0.0001", detail)[1])
    assert diff > 1e-3  # one query projection left at its old value moves log-probs far beyond the bound
    passed = [*SETUP, *(o for o in OPS if o != "ops/npu_swiglu"), "collectives", "collectives/mc2"]
    assert all(found[n]["status"] == "pass" for n in passed)  # neither fault reaches another layer's check
    kept = REPO / re.search(r"logs kept in (\S+)", proc.stderr)[1]
    assert (kept / "ops.log").is_file()
    shutil.rmtree(kept)
