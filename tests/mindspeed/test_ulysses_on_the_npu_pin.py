"""Ulysses SP in the fsdp engine on the NPU pin's stack (torch 2.7.1, transformers 4.57.6) over gloo: SP 2 on two
ranks equals SP 1, with sdpa and with the NPU patches (their v4 layout) under the CPU shim.

The float64 case also pins ``FSDPEngine._dp_reduce_averages`` on torch 2.7: its FSDP2 asks the collective for AVG
only for fp32 / bf16 gradients and divides float64 ones itself, so the float32 probe (gloo sums for AVG) made the
engine leave float64 gradients averaged: the SP 2 gradient norm was half the SP 1 one (33.44 against 66.87, before
the fix). Tolerances and helpers are tests/unit/test_ulysses.py's.
"""

from __future__ import annotations

import pytest

from tests.unit.test_ulysses import SP_KEY, assert_equivalent, case, npu_shim, reference, rollout_batch, run_ranks


@pytest.fixture(scope="module")
def qwen3() -> str:
    from gspo_ascend.tiny import ensure_tiny_model

    return str(ensure_tiny_model())


def test_sp2_equals_sp1_on_torch_2_7(tmp_path, qwen3):
    sp2 = [f"{SP_KEY}=2", "trainer.devices_per_node=2"]
    cases = [
        case("q3", qwen3, *sp2, "actor.lr=1e-4", "actor.micro_batch_size=3"),
        case(
            "q3_f64",
            qwen3,
            *sp2,
            "actor.lr=1e-3",
            "actor.max_tokens_per_micro_batch=12",
            "model.gradient_checkpointing=true",
            dtype="float64",
            ops=("update",),
        ),  # fmt: skip
        case("npu_q3", qwen3, *sp2, "actor.lr=1e-4", "actor.micro_batch_size=3", "trainer.device=npu", device="npu"),
    ]
    batches = {c["name"]: rollout_batch(c["model"], 8, seed=i) for i, c in enumerate(cases)}
    got = run_ranks(2, cases, batches, tmp_path)
    want = {c["name"]: reference(c, batches[c["name"]]) for c in cases if c["device"] == "cpu"}
    with npu_shim() as backend:
        want |= {c["name"]: reference(c, batches[c["name"]], backend) for c in cases if c["device"] == "npu"}
    assert got["npu_q3"][0]["attn"] == "ulysses_npu_fusion" and want["npu_q3"]["attn"] == "npu_fusion"
    for c in cases:
        # fp32: Adam moves weights whose gradient is ~0 by up to lr in either sign, so summation-order noise in
        # such a gradient shows at lr scale (1e-4 here); measured 4e-6 to 1.04e-5
        tol = 1e-10 if c["master_dtype"] == "float64" else 3e-5
        assert_equivalent(
            c["name"], got[c["name"]], want[c["name"]], batches[c["name"]], 2, lp_tol=1e-5, update_tol=tol
        )
