"""`gspo-ascend selftest` (issue #15), the fast parts: the op checks on the emulated NPU and on the CPU path, the
test-only fault injection (each injected op fault fails exactly the checks that call that op, naming the op and the
size of the difference), the comparison and judging helpers against hand-computed cases, and bad input.
The full runs through the CLI are in tests/e2e/test_selftest_e2e.py."""

from __future__ import annotations

import json
import re
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch

from gspo_ascend.device import CPU, NPU_SHIM, shim
from gspo_ascend.device.detect import cuda_available
from gspo_ascend.device.shim import selftest_fault
from gspo_ascend.selftest import mindspeed_build, ops, report, training
from gspo_ascend.selftest.report import CheckFailed, CheckSkipped

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

CHECKED_OPS = sorted({op for case in ops.CASES for op in case.ops})
NPU_ONLY = {c.name for c in ops.CASES if c.torch_path is None}


@pytest.fixture(scope="module")
def npu():
    """The emulated NPU: torch_npu is the shim's stand-in (uninstalled again unless someone else installed it)."""
    was_installed = shim.is_installed("npu")
    shim.install(npu=True)
    yield NPU_SHIM
    if not was_installed:
        shim.uninstall()


def by_name(results):
    return {r.name: r for r in results}


def test_every_op_check_passes_on_the_emulated_npu(npu, monkeypatch):
    monkeypatch.delenv(selftest_fault.ENV, raising=False)
    results = ops.check_ops(npu)
    assert [r.name for r in results] == [f"ops/{c.name}" for c in ops.CASES]
    for r in results:
        assert r.status == "pass", r
        # the device is the shim itself here: forward and backward agree exactly, in every dtype checked (a case with
        # its own reference, not the shim's, is another computation: only its bound)
        errors = re.findall(r"(?:fwd|bwd) ([^\s;]+)", r.detail)
        case = next(c for c in ops.CASES if f"ops/{c.name}" == r.name)
        assert errors and (set(errors) == {"0"} or case.reference is not None), r.detail


def test_on_cpu_the_op_checks_run_transformers_path_and_skip_the_npu_only_ops(monkeypatch):
    monkeypatch.delenv(selftest_fault.ENV, raising=False)
    results = by_name(ops.check_ops(CPU))
    for case in ops.CASES:
        r = results[f"ops/{case.name}"]
        if case.name in NPU_ONLY:
            assert (
                r.status == "skip" and r.detail.startswith("not on the cpu path: ") and case.no_torch_path in r.detail
            )
            continue
        assert r.status == "pass", r
        # another implementation really ran: bf16 rounds differently from the fp32-then-round reference ...
        assert re.search(r"bf16 fwd [1-9]", r.detail) or case.reference is not None, r.detail
        # ... and stays inside the documented bound
        assert all(float(x) <= 2e-2 for x in re.findall(r"bf16 fwd ([^\s;]+)", r.detail))


@pytest.mark.parametrize("fault", CHECKED_OPS)
def test_an_injected_op_fault_fails_exactly_the_checks_that_call_it(npu, monkeypatch, fault):
    monkeypatch.setenv(selftest_fault.ENV, fault)
    torch_npu = sys.modules["torch_npu"]
    before = {name: getattr(torch_npu, name) for name in dir(torch_npu) if name.startswith("npu_")}
    results = ops.check_ops(npu)
    expected = {f"ops/{c.name}" for c in ops.CASES if fault in c.ops}
    assert expected and {r.name for r in results if r.status == "fail"} == expected
    assert all(r.status == "pass" for r in results if r.name not in expected)
    for r in results:
        if r.name in expected:
            assert fault.removeprefix("mindspeed.") in r.detail and r.fix  # names the op, says what to do
            # the size of the difference: the fault scales outputs by 1.1, i.e. 1e-1 of their scale
            relative = float(re.search(r"max \|device - reference\| = \S+, (\S+) of its scale", r.detail)[1])
            assert relative == pytest.approx(selftest_fault.SCALE - 1, rel=0.05)
    assert {name: getattr(torch_npu, name) for name in before} == before  # the stand-in is restored after the block


def test_the_fault_never_touches_a_real_torch_npu(monkeypatch):
    real = types.ModuleType("torch_npu")  # no _gspo_shim attribute: what an Atlas host imports
    real.npu_rms_norm = original = object()
    monkeypatch.setitem(sys.modules, "torch_npu", real)
    monkeypatch.setenv(selftest_fault.ENV, "npu_rms_norm")
    with selftest_fault.perturbed_ops() as perturbed:
        assert perturbed == () and real.npu_rms_norm is original


def test_fault_names_are_checked(monkeypatch):
    monkeypatch.setenv(selftest_fault.ENV, "npu_nonsense")
    with pytest.raises(ValueError, match="npu_nonsense.*valid: .*npu_rms_norm.*rollout_weight_update"):
        selftest_fault.requested()
    monkeypatch.setenv(selftest_fault.ENV, "")
    assert selftest_fault.requested() == ()
    monkeypatch.setenv(selftest_fault.ENV, "npu_swiglu, rollout_weight_update,npu_swiglu")  # a list, each once
    assert selftest_fault.requested() == ("npu_swiglu", "rollout_weight_update")
    monkeypatch.setenv(selftest_fault.ENV, "npu_swiglu,npu_nonsense")
    with pytest.raises(ValueError, match="'npu_nonsense' names no fault"):
        selftest_fault.requested()


# ----------------------------------------------------------------------------------------------- comparisons


def test_error_is_max_difference_over_the_reference_scale():
    ours, ref = torch.tensor([1.0, 2.05, -4.0]), torch.tensor([1.0, 2.0, -4.0])
    assert ops._error("out", ours, ref, "op fp32", 1e-1) == pytest.approx(0.05 / 4)
    with pytest.raises(CheckFailed, match=r"op fp32 out: max \|device - reference\| = 5.00e-02, 1.2e-02 of its scale"):
        ops._error("out", ours, ref, "op fp32", 1e-3)


def test_error_catches_moved_infinities_nan_integers_and_shapes():
    inf = float("-inf")
    with pytest.raises(CheckFailed, match="non-finite"):
        ops._error("x", torch.tensor([inf, 1.0]), torch.tensor([1.0, inf]), "op", 1.0)
    with pytest.raises(CheckFailed, match="non-finite"):
        ops._error("x", torch.tensor([float("nan"), 1.0]), torch.tensor([0.0, 1.0]), "op", 1.0)
    assert ops._error("x", torch.tensor([inf, 2.0]), torch.tensor([inf, 2.0]), "op", 0.0) == 0.0
    with pytest.raises(CheckFailed, match="2 of 4 entries differ"):
        ops._error("idx", torch.tensor([0, 1, 3, 2]), torch.tensor([0, 1, 2, 3]), "op", 1.0)
    with pytest.raises(CheckFailed, match=r"device gives \(2,\)"):
        ops._error("x", torch.zeros(2), torch.zeros(3), "op", 1.0)


def test_top_k_top_p_inputs_put_the_cut_between_entries():
    """Hand check of the top-p cut: with it midway between two cumulative sums, exactly min(k, 3) entries survive."""
    t = ops._top_k_top_p_inputs(torch.float32, torch.Generator().manual_seed(0))
    from gspo_ascend.device.shim import npu_ops

    kept = torch.isfinite(npu_ops.npu_top_k_top_p(t["logits"], t["p"], t["k"])).sum(-1)
    assert kept.tolist() == [min(k, 3) for k in t["k"].tolist()]


def test_run_check_turns_outcomes_into_records(tmp_path):
    def boom() -> str:
        raise RuntimeError("kaput\nsecond line")

    def skipped() -> str:
        raise CheckSkipped("not here")

    def failed() -> str:
        raise CheckFailed("wrong by 3", "do this")

    log = tmp_path / "x.log"
    r = report.run_check("a/b", boom, "the fix", log)
    assert (r.status, r.fix) == ("fail", "the fix") and r.detail.startswith("raised RuntimeError: kaput (traceback in")
    assert "second line" in log.read_text()
    assert report.run_check("a/b", skipped, "fix").as_dict() == {
        "name": "a/b", "status": "skip", "seconds": 0.0, "detail": "not here", "fix": ""}  # fmt: skip
    assert (report.run_check("a/b", failed, "fix").fix, report.run_check("a/b", lambda: "ok", "fix").status) == (
        "do this",
        "pass",
    )
    assert report.exit_code([report.Result("a", "skip", 0, "")]) == 0
    assert report.exit_code([report.Result("a", "pass", 0, ""), report.Result("b", "fail", 0, "")]) == 1


# ----------------------------------------------------------------------------------------------- training judges


def _update(delta: float, initial: torch.Tensor, loss: float = 0.5) -> tuple[dict, dict]:
    return {"actor/pg_loss": loss, "actor/micro_batches": 3.0}, {"w": initial + delta}


def test_update_comparison_catches_sign_missing_and_metric_errors():
    w0 = {"w": torch.zeros(4)}
    good = _update(1e-5, w0["w"])
    assert "weights within 0.0e+00" in training._compare_updates("x", good, _update(1e-5, w0["w"]), w0, 1e-5)
    within = _update(1.05e-5, w0["w"])  # rounding-size difference: 1/20 of the update
    training._compare_updates("x", within, good, w0, 1e-5)
    for wrong in (_update(-1e-5, w0["w"]), _update(0.0, w0["w"]), _update(2e-5, w0["w"])):  # sign, missing, doubled
        with pytest.raises(CheckFailed, match="weights differ"):
            training._compare_updates("x", wrong, good, w0, 1e-5)
    with pytest.raises(CheckFailed, match="actor/pg_loss: 0.51 vs 0.5"):
        training._compare_updates("x", _update(1e-5, w0["w"], loss=0.51), good, w0, 1e-5)
    # micro-batch counts differ between engines by design (fsdp counts per rank, megatron passes)
    other_count = ({"actor/pg_loss": 0.5, "actor/micro_batches": 8.0}, good[1])
    training._compare_updates("x", other_count, good, w0, 1e-5)


@pytest.mark.parametrize(("devices", "tp"), [(1, 1), (2, 2), (8, 2)])
def test_training_check_names_carry_the_tp_the_device_count_gives(devices, tp, tmp_path):
    results = training.check_training(CPU, devices, tmp_path, quick=True)
    assert [r.name for r in results] == [
        f"training/megatron_tp{tp}",
        "training/fsdp_vs_megatron",
        "training/checkpoint",
        "training/moe_megatron_tp1",  # the MoE model: TP=1 on one rank at any device count
        "training/moe_fsdp_vs_megatron",
    ]
    assert all(r.status == "skip" and r.detail == "--quick" for r in results)
    assert not any(tmp_path.iterdir())  # --quick starts no rank


@pytest.mark.slow
@pytest.mark.skipif(training.megatron_blocker(CPU) is not None, reason="megatron-core / mbridge not installed")
def test_on_one_device_the_training_checks_run_at_tp1_on_one_rank(tmp_path, monkeypatch):
    """--devices 1 (a one-GPU machine): the three training checks run on one rank, megatron at TP=1, instead of
    being skipped (old code: 'needs 2 devices'). ~20 s on the 2-core host."""
    monkeypatch.delenv(selftest_fault.ENV, raising=False)
    out = tmp_path / "training"
    results = training.check_training(CPU, 1, out, quick=False)
    assert [r.name for r in results] == [
        "training/megatron_tp1",
        "training/fsdp_vs_megatron",
        "training/checkpoint",
        "training/moe_megatron_tp1",
        "training/moe_fsdp_vs_megatron",
    ]
    assert all(r.status == "pass" for r in results), results
    logprobs, update, checkpoint, moe_logprobs, moe_update = (r.detail for r in results)
    # the MoE model (megatron's SequentialMLP here; MindSpeedGmmExperts under MindSpeed): same bounds as the dense
    moe = re.search(
        r"megatron TP=1 .*, experts: SequentialMLP: max \|megatron - HF\| = (\S+) \(bound 1e-05\)", moe_logprobs
    )
    assert moe and 0 < float(moe[1]) <= 1e-5, moe_logprobs
    gap, moved = map(float, re.search(r"weights within (\S+) after an update of (\S+)$", moe_update).groups())
    assert moe_update.startswith("one GSPO step, fsdp DP=1 == megatron TP=1, experts: SequentialMLP: loss ")
    assert 0 < moved and gap <= 0.1 * moved
    assert sorted(p.name for p in (out / "moe").glob("training.*.rank*.pt")) == [
        "training.fsdp.rank0.pt",
        "training.megatron.rank0.pt",  # no checkpoint round trip for the MoE model
    ]
    # megatron TP=1 vs HF: fp32 CPU kernels summing in another order, so a rounding-size difference, never 0
    assert 0 < float(re.search(r"megatron TP=1 .*max \|megatron - HF\| = (\S+) \(bound 1e-05\)", logprobs)[1]) <= 1e-5
    assert update.startswith("one GSPO step, fsdp DP=1 == megatron TP=1: loss ")
    gap, moved = map(float, re.search(r"weights within (\S+) after an update of (\S+)$", update).groups())
    assert 0 < moved and gap <= 0.1 * moved  # the engines moved the weights, by the same update
    assert checkpoint.startswith("megatron: save -> fresh engine -> load -> update bitwise equal")
    ranks = sorted(path.name for path in out.glob("training.*.rank*.pt"))
    assert ranks == ["training.checkpoint.rank0.pt", "training.fsdp.rank0.pt", "training.megatron.rank0.pt"]


def _swap_experts(path: str, out: Path) -> str:
    """A copy of the MoE model whose layer-0 experts 0 and 1 trade weights: tokens reach the wrong expert, as with a
    grouped GEMM that mis-reads its group list."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(path, out)
    state = load_file(out / "model.safetensors")
    for proj in ("gate_proj", "up_proj", "down_proj"):
        a, b = (f"model.layers.0.mlp.experts.{i}.{proj}.weight" for i in (0, 1))
        state[a], state[b] = state[b], state[a]
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    return str(out)


@pytest.mark.slow
@pytest.mark.skipif(training.megatron_blocker(CPU) is not None, reason="megatron-core / mbridge not installed")
def test_the_moe_training_check_fails_when_the_engine_runs_the_wrong_experts(tmp_path, monkeypatch):
    """The ranks get the MoE model with two experts swapped, the HF reference the original: the log-prob check
    fails, naming the size of the difference. ~15 s on the 2-core host."""
    monkeypatch.delenv(selftest_fault.ENV, raising=False)
    prepare = training._prepare

    def swapped(out, spec):
        path, inputs, reference = prepare(out, spec)
        return _swap_experts(path, out / "swapped"), inputs, reference

    monkeypatch.setattr(training, "_prepare", swapped)
    logprobs, _ = training.check_model(training.MOE, CPU, 1, tmp_path, quick=False)
    assert logprobs.name == "training/moe_megatron_tp1" and logprobs.status == "fail"
    diff = float(
        re.search(r"experts: SequentialMLP log-probs differ from HF's \(fp32, CPU\) by (\S+) ", logprobs.detail)[1]
    )
    assert diff > 1e-3  # far beyond the bound (1e-5)


def test_the_moe_check_requires_mindspeeds_grouped_gemm_experts_where_mindspeed_is_on(monkeypatch):
    from gspo_ascend.engines import mindspeed_setup

    state = {"spec": training.MOE, "ranks": {"megatron": {0: {"experts": ["SequentialMLP"]}}}}
    assert training._experts_note(state, CPU) == ", experts: SequentialMLP"
    monkeypatch.setattr(mindspeed_setup, "enabled", lambda backend: True)
    with pytest.raises(CheckFailed, match="MindSpeed is on but the experts ran as SequentialMLP"):
        training._experts_note(state, CPU)
    state["ranks"]["megatron"][0]["experts"] = ["MindSpeedGmmExperts"]
    assert training._experts_note(state, CPU) == ", experts: MindSpeedGmmExperts (npu_gmm)"
    assert training._experts_note({**state, "spec": training.DENSE}, CPU) == ""


# ----------------------------------------------------------------------------------------------- rollout, MoE


def test_the_rollout_fault_drops_an_expert_tensor_on_the_moe_model(monkeypatch):
    from gspo_ascend.selftest import rollout

    monkeypatch.setenv(selftest_fault.ENV, selftest_fault.ROLLOUT_WEIGHT_UPDATE)
    new, old = torch.ones(2), torch.zeros(2)
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.experts.gate_up_proj", "lm_head.weight"]
    stream = dict(rollout._update_stream(dict.fromkeys(names, new), dict.fromkeys(names, old)))
    assert [n for n, t in stream.items() if torch.equal(t, old)] == [names[1]]  # the MoE loader's tensor
    dense = dict(rollout._update_stream(dict.fromkeys(names[::2], new), dict.fromkeys(names[::2], old)))
    assert [n for n, t in dense.items() if torch.equal(t, old)] == [names[0]]


def test_the_vllm_moe_check_is_skipped_with_quick_before_the_moe_model_is_built():
    from gspo_ascend.selftest import rollout

    def never() -> str:
        raise AssertionError("the MoE model must not be built for a skipped check")

    result = report.run_check("rollout/vllm_moe", lambda: rollout._vllm_moe(CPU, never, None, quick=True), "")
    assert (result.status, result.detail.split(" ")[0]) == ("skip", "--quick")


def test_the_moe_rollout_check_holds_the_returned_routes_to_the_hf_routers():
    """rollout/vllm_moe's route step (issue #42), fed by the hf engine, which records its routers' choice: its
    routes are the HF model's own on every token-layer; the same routes one token late (a misaligned capture) are
    refused with the share they reach; a device build that returned none fails, a CPU build that cannot says so;
    a dense model has no step."""
    from gspo_ascend.engines.base import SamplingParams
    from gspo_ascend.engines.hf_rollout import HFRolloutEngine
    from gspo_ascend.selftest import rollout
    from gspo_ascend.tiny import ensure_tiny_model

    path = str(ensure_tiny_model(moe=True))
    engine, reference = HFRolloutEngine(path, backend=CPU), rollout._Reference(CPU, path)
    batch = engine.generate(rollout._prompts(path), SamplingParams(**rollout.PARAMS))
    fed = sum(r.shape[0] for r in batch.routed_experts) * 2  # 2 MoE layers
    note = rollout._routes(engine, batch, reference, reference.original)
    assert note == f"; routes: the HF routers' own on 100.00% of {fed} token-layers"
    late = batch.replace(routed_experts=[torch.cat([r[:1], r[:-1]]) for r in batch.routed_experts])
    with pytest.raises(CheckFailed, match=r"choice on \d+\.\d% of \d+ token-layers \(bound 95%\)"):
        rollout._routes(engine, late, reference, reference.original)
    none = batch.replace(routed_experts=None)
    engine.host_build = False  # a vLLM engine on a GPU / NPU
    with pytest.raises(CheckFailed, match="no MoE routes on this device"):
        rollout._routes(engine, none, reference, reference.original)
    engine.host_build = True
    assert rollout._routes(engine, none, reference, reference.original).startswith("; routes: none from this CPU")
    dense = rollout._Reference(CPU, str(ensure_tiny_model()))
    assert rollout._routes(engine, none, dense, dense.original) == ""


# ----------------------------------------------------------------------------------------------- MindSpeed JIT ops


def test_mindspeed_ops_step_skips_off_npu_and_names_the_shim_stand_ins_when_emulated(npu, monkeypatch):
    from gspo_ascend.device.shim import mindspeed_ops

    assert mindspeed_build.check_mindspeed_ops(npu).startswith("emulated NPU: nothing built; the shim's CPU stand-")
    with pytest.raises(CheckSkipped, match="NPU-only \\(this is cpu\\)"):
        mindspeed_build.check_mindspeed_ops(CPU)
    monkeypatch.delitem(mindspeed_ops.OP_MODULES, "grouped_matmul")
    with pytest.raises(CheckFailed, match="no stand-in for MindSpeed's grouped_matmul"):
        mindspeed_build.check_mindspeed_ops(npu)


def test_the_prebuilt_builders_are_those_the_op_checks_and_our_features_load():
    checked = {case.mindspeed_builder for case in ops.CASES if case.mindspeed_builder}
    assert {(cls, name) for cls, name, _ in mindspeed_build.BUILDERS} == checked
    from gspo_ascend.config import load_config
    from gspo_ascend.engines import mindspeed_setup

    on = mindspeed_setup.mindspeed_args(load_config(None, []), moe=True)
    assert all(on[feature] for _, _, feature in mindspeed_build.BUILDERS)


@pytest.fixture
def fake_mindspeed(tmp_path, monkeypatch):
    """A real NPU with MindSpeed, as far as the prebuild can tell: builders whose load() writes the extension
    where torch's JIT build would (``$TORCH_EXTENSIONS_DIR/<name>/<name>.so``); counts constructions."""
    from torch.utils.cpp_extension import _get_build_directory

    from gspo_ascend.engines import mindspeed_setup

    made = []

    def builder_class(class_name: str, op_name: str) -> type:
        def load(self):
            (Path(_get_build_directory(op_name, False)) / f"{op_name}.so").touch()
            return types.SimpleNamespace()

        return type(class_name, (), {"__init__": lambda self: made.append(class_name), "load": load})

    module = types.ModuleType("mindspeed.op_builder")
    for class_name, op_name, _ in mindspeed_build.BUILDERS:
        setattr(module, class_name, builder_class(class_name, op_name))
    monkeypatch.setitem(sys.modules, "mindspeed.op_builder", module)
    monkeypatch.setattr(mindspeed_build, "_instances", {})
    monkeypatch.setattr(mindspeed_setup, "installed", lambda: True)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setenv("ASCEND_HOME_PATH", str(tmp_path))
    return types.SimpleNamespace(backend=types.SimpleNamespace(name="npu", emulated=False), made=made,
                                 module=module, root=tmp_path / "ext")  # fmt: skip


def test_mindspeed_ops_are_built_once_per_process_with_seconds_per_builder(fake_mindspeed, monkeypatch):
    first = mindspeed_build.check_mindspeed_ops(fake_mindspeed.backend)
    built = r"\S+ s \(compiled\)"
    expected = (
        rf"in {re.escape(str(fake_mindspeed.root))}: npu_rotary_position_embedding {built}, grouped_matmul {built}"
    )
    assert re.fullmatch(expected, first), first
    again = mindspeed_build.check_mindspeed_ops(fake_mindspeed.backend)
    assert again.count("(already built)") == 2
    assert fake_mindspeed.made == ["RotaryPositionEmbeddingOpBuilder", "GMMOpBuilder"]  # one instance per class
    monkeypatch.delenv("ASCEND_HOME_PATH")
    with pytest.raises(CheckFailed, match="ASCEND_HOME_PATH is not set"):
        mindspeed_build.check_mindspeed_ops(fake_mindspeed.backend)


@pytest.mark.parametrize("lock", ["grouped_matmul/lock", "stale.lock"])
def test_a_lock_file_that_would_hang_or_wipe_the_build_fails_the_prebuild(fake_mindspeed, lock):
    path = fake_mindspeed.root / lock
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    with pytest.raises(CheckFailed, match=f"lock file\\(s\\) from an interrupted build: {re.escape(str(path))}"):
        mindspeed_build.check_mindspeed_ops(fake_mindspeed.backend)
    assert fake_mindspeed.made == []  # nothing was loaded


def test_a_failing_builder_fails_the_prebuild_naming_it(fake_mindspeed):
    def broken(self):
        raise OSError("ninja: not found")

    fake_mindspeed.module.GMMOpBuilder.load = broken
    with pytest.raises(CheckFailed, match=r"MindSpeed's GMMOpBuilder \(grouped_matmul\) did not build: OSError: ninja"):
        mindspeed_build.check_mindspeed_ops(fake_mindspeed.backend)


def test_build_ops_runs_only_that_step(cli):
    cpu = cli("selftest", "--device", "cpu", "--build-ops")
    # the one line, its time whatever a loaded box makes of it (0.1 s seen under a parallel build)
    (line,) = cpu.stdout.splitlines()
    assert cpu.returncode == 0 and re.fullmatch(
        r"\[skip\] +\d+\.\ds setup/mindspeed_ops: MindSpeed's JIT-built ops are NPU-only \(this is cpu\)", line
    ), line
    emulated = cli("selftest", "--device", "npu", "--build-ops", "--json", env={"GSPO_DEVICE_SHIM": "1"})
    assert emulated.returncode == 0
    (record,) = json.loads(emulated.stdout)
    assert (record["name"], record["status"]) == ("setup/mindspeed_ops", "pass")


# ----------------------------------------------------------------------------------------------- bad input, ranks


def test_bad_fault_and_device_count_are_one_line_errors(cli):
    bad = cli("selftest", "--device", "cpu", env={selftest_fault.ENV: "npu_nonsense"})
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.startswith("error: env GSPO_SELFTEST_FAULT='npu_nonsense' names no fault; valid: ")
    unchecked = cli("selftest", "--device", "cpu", env={selftest_fault.ENV: "npu_moe_init_routing"})
    assert unchecked.returncode == 2 and "no selftest check calls" in unchecked.stderr
    zero = cli("selftest", "--device", "cpu", "--devices", "0")
    assert zero.returncode == 2 and "--devices 0" in zero.stderr and "Traceback" not in zero.stderr


@pytest.mark.skipif(cuda_available(), reason="needs a host without CUDA (the ranks ask for a CUDA device)")
def test_a_failing_rank_is_reported_in_one_line_without_waiting_for_the_time_limit(tmp_path):
    """Rank processes that cannot get their device: the launch returns quickly with the rank's own error line."""
    from gspo_ascend.selftest.launch import launch_ranks

    run = launch_ranks(2, "collectives", ["--device", "cuda", "--bytes", "1024"], tmp_path, {}, timeout_s=120)
    assert not run.ok and run.codes[0] not in (0, None)
    assert "trainer.device=cuda but torch sees no CUDA device" in run.failure() and str(run.logs[0]) in run.failure()


# ----------------------------------------------------------------------------------------------- MC2


def test_mc2_is_exact_on_the_emulated_npu_and_each_injected_op_fault_fails_it(npu, monkeypatch, tmp_path):
    """collectives/mc2: torch_npu's two MC2 ops against the unfused collectives, one rank process per device, as
    MindSpeed addresses the group (its HCCL communicator name). Old code (7a954f9): no check called them, so a node
    whose MC2 kernels fail passed the selftest; GSPO_SELFTEST_FAULT=<MC2 op> was refused as 'no selftest check calls'.
    """
    from gspo_ascend.selftest import mc2

    monkeypatch.delenv(selftest_fault.ENV, raising=False)
    detail = mc2.check_mc2(npu, 2, tmp_path / "ok")
    assert detail.startswith("npu_all_gather_base_mm and npu_mm_reduce_scatter_base exact on 2 ranks"), detail
    for op in mc2.OPS:
        monkeypatch.setenv(selftest_fault.ENV, op)  # the rank processes inherit it and perturb that op alone
        with pytest.raises(CheckFailed) as failed:
            mc2.check_mc2(npu, 2, tmp_path / op)
        # both ranks see the fault; the 1.1x scale of integer-valued outputs leaves every element wrong
        assert re.search(rf"wrong result\(s\), first: {op}\b.* on rank 0: \d+ elements differ", str(failed.value))
        assert "HCCL_BUFFSIZE" in failed.value.fix


def test_mc2_operands_keep_every_sum_exact_in_bf16_and_differ_per_rank():
    """The check's exactness rests on its inputs: 0 / 1 entries, 32 ones per row, so a row of x @ w is at most 32
    and a sum over 8 ranks at most 256, an integer bf16 represents exactly; and it sees a misrouted block only
    because every rank's inputs differ."""
    from gspo_ascend.selftest import mc2

    xs, ys, w = mc2._operands(8)
    assert xs.dtype == ys.dtype == w.dtype == torch.bfloat16 and w.shape == (mc2.K, mc2.N)
    assert xs.shape == (8, mc2.M, mc2.K) and ys.shape == (8, 8 * mc2.M, mc2.K)
    for t in (xs, ys, w):
        assert set(t.unique().tolist()) == {0.0, 1.0}
    assert set(xs.float().sum(-1).unique().tolist()) == set(ys.float().sum(-1).unique().tolist()) == {32.0}
    assert 8 * mc2.ONES_PER_ROW <= 256
    assert all(not torch.equal(xs[0], xs[r]) and not torch.equal(ys[0], ys[r]) for r in range(1, 8))
    blocks = [ys[:, r * mc2.M : (r + 1) * mc2.M].float().sum(0) @ w.float() for r in range(8)]
    assert max(float(b.max()) for b in blocks) <= 256 and not torch.equal(blocks[0], blocks[1])


def test_mc2_is_skipped_off_ascend_and_below_two_devices(npu, tmp_path):
    from gspo_ascend.selftest import mc2

    with pytest.raises(CheckSkipped, match="MC2 is torch_npu's \\(Ascend\\); this is a cpu node"):
        mc2.check_mc2(CPU, 2, tmp_path)
    with pytest.raises(CheckSkipped, match="needs at least 2 devices \\(--devices 1\\)"):
        mc2.check_mc2(npu, 1, tmp_path)


def test_mc2_runs_on_the_largest_world_the_kernels_take(npu, monkeypatch, tmp_path):
    """torch-npu 2.7.1 documents MC2 for 2, 4 or 8 ranks: 3 devices run it on 2, and say so."""
    from gspo_ascend.selftest import mc2

    monkeypatch.delenv(selftest_fault.ENV, raising=False)
    detail = mc2.check_mc2(npu, 3, tmp_path)
    assert "exact on 2 of 3 devices (MC2 takes 2, 4 or 8 ranks)" in detail
    assert sorted(p.name for p in tmp_path.glob("mc2.rank*.json")) == ["mc2.rank0.json", "mc2.rank1.json"]


@pytest.mark.parametrize("devices, prompts", [(1, 4), (2, 4), (3, 12), (8, 8)])
def test_the_end_to_end_run_is_a_valid_config_on_any_device_count(devices, prompts, tmp_path):
    """The first GPU run (docs/results/gpu/) found `selftest --devices 1`'s end-to-end run refused by the config
    (2 prompts per step for 4 minibatches): each device count must give a config `gspo-ascend train` accepts."""
    from gspo_ascend.config import load_config
    from gspo_ascend.selftest import e2e

    argv = e2e.command(CPU, devices, tmp_path / "run")
    overrides = argv[argv.index("train") + 1 :]
    cfg = load_config(None, overrides)  # raises ConfigError on a batch the minibatches / ranks do not divide
    assert cfg.data.train_batch_size == prompts and cfg.trainer.devices_per_node == devices


# ----------------------------------------------------------------------------------------------- weight sync


@pytest.mark.parametrize("device", ["cpu", "npu"])
def test_weight_sync_check_is_bitwise_over_the_sync_group(device, npu, tmp_path):
    """collectives/weight_sync: two rank processes, a stateless sync group on the comm backend (gloo here, and
    under the NPU shim), the run's send / Receiver; every dtype of the set arrives bitwise, in several buckets."""
    from gspo_ascend.selftest import weight_sync

    backend = npu if device == "npu" else CPU
    detail = weight_sync.check_weight_sync(backend, 2, tmp_path)
    assert detail.startswith("12 tensors (bfloat16, bool, float16, float32, float64, int64, uint8) bitwise equal")
    assert re.search(r"over gloo: 2\.2 MiB in 4 buckets of <= 1 MiB, [\d.]+ GB/s$", detail), detail
    with pytest.raises(CheckSkipped, match="needs at least 2 devices \\(--devices 1\\): one sends, one receives"):
        weight_sync.check_weight_sync(backend, 1, tmp_path)


def test_weight_sync_comparison_sees_one_flipped_bit_a_signed_zero_and_the_version():
    from gspo_ascend.selftest import weight_sync
    from gspo_ascend.weight_sync import raw_bytes

    sent = weight_sync.tensors()
    assert weight_sync._compare(sent, [(n, t.clone()) for n, t in sent], weight_sync.VERSION, raw_bytes) == []
    got = [(n, t.clone()) for n, t in sent]
    raw_bytes(got[1][1])[0] ^= 1  # the lowest bit of one bf16 element
    got[4][1][1] = 0.0  # -0.0 -> 0.0: equal as numbers, not as bits
    errors = weight_sync._compare(sent, got, 3, raw_bytes)
    assert errors == [
        "the stream carried weights version 3, sent 7",
        "model.layers.0.self_attn.q_proj.weight (torch.bfloat16): 1 of 131072 bytes differ",
        "model.layers.0.special (torch.float32): 1 of 64 bytes differ",
    ]
