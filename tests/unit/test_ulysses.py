"""Ulysses sequence parallelism in the fsdp engine (issue #17; gspo_ascend/engines/ulysses.py).

The backbone is equivalence on 2 and 4 gloo ranks: an engine at SP=2 (and SP=4, SP=2 x DP=2) against the same engine
at SP=1 in one process on the same batch: log-probs in float32 (<= 1e-5), and one GSPO update (loss, gradient norm,
updated weights) in float64 master weights, where two correct computations agree to ~1e-15, so a wrong token slice,
a lost KV head or a cross-sequence leak (all O(0.1)) cannot hide; float32 updates are held to 1e-5 too. Models: the
embedded tiny Qwen3 (2 heads, 1 KV head: KV repeated at SP 2) and a random tiny Qwen2 (4 heads, 2 KV heads, q/k/v
bias: SP 4 repeats KV), with sdpa, eager, and the NPU patches' fused attention under the CPU shim.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gspo_ascend.config import load_config
from gspo_ascend.device import get_backend
from gspo_ascend.engines import ulysses
from gspo_ascend.engines.base import SampleBatch
from gspo_ascend.engines.logprobs import forward_log_probs
from gspo_ascend.engines.microbatch import dp_shard, plan_micro_batches
from gspo_ascend.errors import ConfigError
from tests.conftest import REPO
from tests.unit.fsdp_worker import batch_to_dict, make_batch, reference_log_probs, with_old_log_probs

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
R = 6  # response width of the test batches
SP_KEY = "actor.ulysses_sequence_parallel_size"


@pytest.fixture(scope="module")
def qwen3() -> str:
    from gspo_ascend.tiny import ensure_tiny_model

    return str(ensure_tiny_model())


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory) -> str:
    """A random tiny Qwen2: 4 heads, 2 KV heads, q/k/v bias; init scale 0.1 so attention is far from uniform (a
    leak across packed sequences or a wrong KV head then moves log-probs by O(0.1))."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = tmp_path_factory.mktemp("tiny-qwen2")
    config = Qwen2Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.1,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(path)
    return str(path)


def plain_model(path: str, attn: str = "sdpa"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn).eval()


def rollout_batch(path: str, n: int, seed: int, noise: float = 2e-4):
    """old_log_probs = the initial policy's (an independent per-sample forward) + noise: some ratios clip."""
    batch = make_batch(n, R, seed)
    with torch.no_grad():
        current = reference_log_probs(plain_model(path), batch, 1.0)
    return with_old_log_probs(batch, current, noise, seed)


# ----------------------------------------------------------------------------------------------- layout


def test_layout_rules_by_hand():
    assert ulysses.layout_problem(1, 3, 1) is None  # no SP: anything goes
    assert ulysses.layout_problem(2, 2, 1) is None and ulysses.kv_repeats(2, 1) == 2  # tiny Qwen3
    assert ulysses.layout_problem(4, 16, 2) is None and ulysses.kv_repeats(4, 2) == 2  # Qwen2.5-3B at the field SP
    assert ulysses.layout_problem(4, 32, 8) is None and ulysses.kv_repeats(4, 8) == 1  # 2 KV heads per rank
    heads = ulysses.layout_problem(3, 16, 2)
    assert heads.startswith(f"config key '{SP_KEY}' (3) must divide the model's num_attention_heads (16)")
    assert "1, 2, 4, 8, 16" in heads
    kv = ulysses.layout_problem(2, 12, 3)  # 3 KV heads neither split over 2 ranks nor repeat evenly to 2
    assert kv.startswith(f"config key '{SP_KEY}' (2) and the model's num_key_value_heads (3) must divide one another")


def test_row_slices_by_hand():
    # a row of 7 tokens at SP 2 is padded to 8: rank 0 holds tokens 0-3, rank 1 tokens 4-7 (one padding token)
    assert ulysses._slice(7, ulysses.SPGroup(None, 2, 0)) == (0, 4, 1)
    assert ulysses._slice(7, ulysses.SPGroup(None, 2, 1)) == (4, 8, 1)
    assert ulysses._slice(12, ulysses.SPGroup(None, 4, 3)) == (9, 12, 0)


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        ([f"{SP_KEY}=2", "actor.use_remove_padding=false"], "splits packed rows: set actor.use_remove_padding=true"),
        ([f"{SP_KEY}=3", "trainer.devices_per_node=4"], "(3) must divide the number of devices (4 = "),
        ([f"{SP_KEY}=2", "actor.engine=megatron"], "needs actor.engine=fsdp; with megatron use actor.context_parallel"),
        ([f"{SP_KEY}=0"], f"config key '{SP_KEY}' must be > 0, got 0"),
    ],
)
def test_bad_layouts_are_refused_naming_the_key(overrides, fragment):
    with pytest.raises(ConfigError, match=SP_KEY) as err:
        load_config(overrides=["actor.use_remove_padding=true", "trainer.devices_per_node=2", *overrides])
    assert fragment in str(err.value)


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        # the tiny model has 2 heads: found from its config.json before Ray starts
        (["trainer.devices_per_node=4", f"{SP_KEY}=4"], f"error: config key '{SP_KEY}' (4) must divide the model's"),
        (
            ["trainer.devices_per_node=2", f"{SP_KEY}=2", "actor.use_remove_padding=false"],
            "error: config key 'actor.ulysses_sequence_parallel_size' (2) splits packed",
        ),
        (["trainer.devices_per_node=3", f"{SP_KEY}=2"], f"error: config key '{SP_KEY}' (2) must divide the number"),
    ],
)
def test_train_cli_refuses_bad_layouts_in_one_line(cli, qwen3, overrides, fragment, tmp_path):
    proc = cli("train", f"trainer.output_dir={tmp_path}", "actor.use_remove_padding=true", *overrides)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(fragment), lines


def test_preflight_and_planner_know_sp():
    from gspo_ascend.doctor.hardware import profile
    from gspo_ascend.doctor.modelspec import load_spec
    from gspo_ascend.doctor.planner import plan
    from gspo_ascend.doctor.preflight import preflight, rule_ulysses

    model = f"model.path={REPO / 'tests/fixtures/models/qwen2.5-3b'}"  # 16 heads, 2 KV heads, h 2048, 36 layers
    base = [model, "trainer.devices_per_node=8", "data.max_prompt_length=2048", "data.max_response_length=8192"]
    base += ["data.train_batch_size=64", "rollout.n=16", "model.dtype=bfloat16", "model.gradient_checkpointing=true"]

    def checks(*overrides):
        return {c.name.split(":")[1]: c for c in preflight(load_config(overrides=[*base, *overrides], validate=False))}

    sp4 = checks(f"{SP_KEY}=4", "actor.max_tokens_per_micro_batch=4096")
    assert (
        sp4["ulysses"].status == "ok"
        and sp4["ulysses"].finding == "16 heads / 2 KV heads over SP 4 (KV heads repeated x2)"
    )
    assert sp4["world"].finding == "world 8 = TP 1 x PP 1 x CP 1 x SP 4 x DP 2"
    # 4096 per device holds no 10240-token sequence alone, but the SP group's 4 x 4096 does
    assert sp4["micro-batch"].status == "ok" and "4096 x SP 4 = 16384 per SP group" in sp4["micro-batch"].finding
    assert checks("actor.max_tokens_per_micro_batch=4096")["micro-batch"].status == "fail"
    sp8 = checks(f"{SP_KEY}=8")  # 16 heads over 8 ranks, 2 KV heads repeated x4: fine
    assert sp8["ulysses"].status == "ok" and sp8["world"].finding.endswith("x SP 8 x DP 1")
    assert checks(f"{SP_KEY}=3")["world"].status == "fail"  # 8 devices do not split into groups of 3
    spec12 = dataclasses.replace(load_spec(model.split("=", 1)[1]), heads=12)  # a model 8 does not divide
    (check,) = rule_ulysses(load_config(overrides=[*base, f"{SP_KEY}=8"], validate=False), spec12)
    assert check.status == "fail" and "num_attention_heads (12)" in check.finding
    assert check.fix.endswith("(1, 2, 3, 4, 6, 12)")

    # planner: per device, micro_batch_size samples are split over the group; KV heads count as repeated to SP
    cfg = load_config(overrides=[*base, f"{SP_KEY}=4", "actor.micro_batch_size=1", "trainer.device=npu"])
    p = plan(cfg, load_spec(model.split("=", 1)[1]), profile("atlas-800t-a2"))
    # 10240 / 4 = 2560 tokens per device: 36 layer inputs x 2h B x 2560 = 377,487,360 + one layer's working set
    # 2 B x (4h + hd 128 x (2 x 16 q + 2 x 4 KV, repeated from 2) + 3 x 11008) = 92,672 B x 2560 = 237,240,320
    assert p.train.parts["activations"] == 377_487_360 + 237_240_320
    # the fused head's one chunk of 1024 rows (engines/fused_logprob.py), not the device's 2560: bf16 + 3 fp32 blocks;
    # over 3 chunks the head's weight gradient in an fp32 accumulator beside a bf16 product
    assert p.train.parts["logits"] == 1024 * 151936 * (2 + 12) + (4 + 2) * 151936 * 2048
    assert "SP 4 x DP 2" in p.layout


def test_without_the_sp_keyword_the_hook_is_the_inner_implementation(qwen3):
    # a forward outside the SP path (no `ulysses` keyword) must be the wrapped implementation exactly, masks included
    batch = make_batch(5, R, seed=1)
    model = plain_model(qwen3)
    with torch.no_grad():
        before = [forward_log_probs(model, batch, 0.8, packed) for packed in (True, False)]
        assert ulysses.enable(model, 2) == "sdpa" and model.config._attn_implementation == "ulysses_sdpa"
        after = [forward_log_probs(model, batch, 0.8, packed) for packed in (True, False)]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_enable_refuses_what_the_hook_cannot_run(qwen3):
    with pytest.raises(ConfigError, match=rf"config key '{SP_KEY}' \(4\) must divide the model's num_attention_heads"):
        ulysses.enable(plain_model(qwen3), 4)
    model = plain_model(qwen3)
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ConfigError, match="needs one of sdpa, eager, flash_attention_2, npu_fusion attention"):
        ulysses.enable(model, 2)
    model = plain_model(qwen3)
    model.config.layer_types = ["sliding_attention"] * 2
    with pytest.raises(ConfigError, match="sliding-window attention"):
        ulysses.enable(model, 2)


# ----------------------------------------------------------------------------------------------- multi-rank


COMMON = ["data.train_batch_size=8", "algorithm.minibatches_per_rollout=2", "actor.use_remove_padding=true"]


def case(name, model, *overrides, device="cpu", dtype="float32", ops=("log_probs", "update"), temperature=1.0):
    return {
        "name": name,
        "model": model,
        "overrides": [*COMMON, *overrides],
        "device": device,
        "master_dtype": dtype,
        "ops": list(ops),
        "batch": name,
        "temperature": temperature,
    }


def run_ranks(world: int, cases: list[dict], batches: dict, tmp: Path) -> dict:
    for name, batch in batches.items():
        torch.save(batch_to_dict(batch), tmp / f"{name}.pt")
    (tmp / "cases.json").write_text(json.dumps(cases))
    proc = subprocess.run(
        [sys.executable, "-m", "tests.unit.ulysses_worker", str(world), str(tmp)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {
        c["name"]: [torch.load(tmp / f"{c['name']}.rank{r}.pt", weights_only=True) for r in range(world)] for c in cases
    }


@contextlib.contextmanager
def npu_shim():
    """The CPU shim with the NPU patches, for in-process references; the patches are process-wide: removed after."""
    from gspo_ascend.patches import remove_npu_patches

    from gspo_ascend.device import NPU_SHIM, shim
    from gspo_ascend.engines import hf_load

    was_installed = shim.is_installed("npu")
    shim.install(npu=True)
    printed, hf_load._summary_printed = hf_load._summary_printed, True  # the patch summary is not under test here
    try:
        yield NPU_SHIM
    finally:
        hf_load._summary_printed = printed
        remove_npu_patches()
        if not was_installed:
            shim.uninstall()


def reference(c: dict, batch, backend=None) -> dict:
    """The same case at SP=1 in this process (world 1): log-probs of the whole batch, one update, weights."""
    from gspo_ascend.engines.fsdp import FSDPEngine

    overrides = [o for o in c["overrides"] if not o.startswith((SP_KEY, "trainer.devices_per_node"))]
    dtype = {"float32": torch.float32, "float64": torch.float64}[c["master_dtype"]]
    engine = FSDPEngine(load_config(overrides=overrides), backend or get_backend("cpu"), c["model"], master_dtype=dtype)
    out = {"attn": engine.model.config._attn_implementation}
    out["log_probs"] = engine.compute_log_probs(batch, c["temperature"])
    if "grads" in c["ops"]:
        engine.backward_minibatch(batch, 1.0)
        out["grads"] = {
            n: p.grad.full_tensor().clone() for n, p in engine.model.named_parameters() if p.grad is not None
        }
        engine.optimizer.zero_grad(set_to_none=True)
    if "update" in c["ops"]:
        out["metrics"] = engine.update(batch, 1.0)
        out["weights"] = {name: t.clone() for name, t in engine.export_weights()}
    return out


def max_diff(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    return max((got[k] - want[k]).abs().max().item() for k in want)


def assert_equivalent(name, ranks, want, batch, world, *, lp_tol, update_tol):
    """Every rank's rows of the log-probs, its update's metrics and the exported weights against the SP=1 run."""
    k = 2  # COMMON's minibatches
    for r, got in enumerate(ranks):
        if "log_probs" in got:
            rows = dp_shard(batch.replace(old_log_probs=want["log_probs"]), r, world, k).old_log_probs
            assert (got["log_probs"] - rows).abs().max().item() <= lp_tol, name
        if "weights" in want:
            assert max_diff(got["weights"], want["weights"]) <= update_tol, name
            for key in ("actor/pg_loss", "actor/grad_norm", "actor/seq_ratio_mean", "actor/entropy_token"):
                assert got["metrics"][key] == pytest.approx(want["metrics"][key], rel=update_tol, abs=update_tol), key
            for key in ("actor/num_tokens", "actor/num_seqs", "actor/clipfrac_seq"):
                assert got["metrics"].get(key) == pytest.approx(want["metrics"].get(key), abs=1e-12), key
        if "grads" in want:
            assert max_diff(got["grads"], want["grads"]) <= update_tol, name


@pytest.mark.slow
def test_sp2_on_two_ranks_equals_sp1(tmp_path, qwen3, qwen2):
    sp2 = [f"{SP_KEY}=2", "trainer.devices_per_node=2"]
    cases = [
        case("q3", qwen3, *sp2, "actor.lr=1e-4", "actor.micro_batch_size=3", temperature=0.7),
        # float64 exactness: gradients with recomputation (checkpointing), token budgets, the KL reference through SP
        case(
            "q3_f64",
            qwen3,
            *sp2,
            "actor.lr=1e-3",
            "actor.max_tokens_per_micro_batch=12",
            "model.gradient_checkpointing=true",
            "algorithm.kl_coef=0.5",
            dtype="float64",
            ops=("grads", "update"),
        ),  # fmt: skip
        case(
            "q3_eager", qwen3, *sp2, "model.attn_implementation=eager", "actor.micro_batch_size=4", ops=("log_probs",)
        ),
        case("q2", qwen2, *sp2, "actor.lr=1e-4", "actor.micro_batch_size=3"),
        case("q2_f64", qwen2, *sp2, "actor.lr=1e-3", "actor.micro_batch_size=8", dtype="float64", ops=("update",)),
        # the NPU patches under the shim: the hook wraps npu_fusion attention (TND)
        case("npu_q3", qwen3, *sp2, "actor.lr=1e-4", "actor.micro_batch_size=3", "trainer.device=npu", device="npu"),
        case("npu_q2", qwen2, *sp2, "actor.micro_batch_size=8", "trainer.device=npu", device="npu", ops=("log_probs",)),
    ]
    batches = {c["name"]: rollout_batch(c["model"], 8, seed=i) for i, c in enumerate(cases)}
    got = run_ranks(2, cases, batches, tmp_path)
    npu_cases = [c for c in cases if c["device"] == "npu"]
    want = {c["name"]: reference(c, batches[c["name"]]) for c in cases if c["device"] == "cpu"}
    with npu_shim() as backend:  # after every unpatched reference: the patches swap class methods process-wide
        want |= {c["name"]: reference(c, batches[c["name"]], backend) for c in npu_cases}
    assert got["npu_q3"][0]["attn"] == got["npu_q2"][1]["attn"] == "ulysses_npu_fusion"
    assert want["npu_q3"]["attn"] == want["npu_q2"]["attn"] == "npu_fusion"
    assert got["q3_eager"][1]["attn"] == "ulysses_eager" and got["q2"][0]["attn"] == "ulysses_sdpa"
    for c in cases:
        tol = 1e-10 if c["master_dtype"] == "float64" else 1e-5
        assert_equivalent(
            c["name"], got[c["name"]], want[c["name"]], batches[c["name"]], 2, lp_tol=1e-5, update_tol=tol
        )
    # and against an independent per-sample forward (no packing, no SP), the patched runs too
    by_name = {c["name"]: c for c in cases}
    for name, attn in (("q3", "sdpa"), ("q3_eager", "eager"), ("q2", "sdpa"), ("npu_q3", "sdpa"), ("npu_q2", "sdpa")):
        c, batch = by_name[name], batches[name]
        with torch.no_grad():
            independent = reference_log_probs(plain_model(c["model"], attn), batch, c["temperature"])
        for r in range(2):
            rows = dp_shard(batch.replace(old_log_probs=independent), r, 2, 2).old_log_probs
            assert (got[name][r]["log_probs"] - rows).abs().max().item() <= 1e-5, name
    # the update moved the weights (so equal weights are not equal initial weights)
    assert (
        max_diff(want["q3_f64"]["weights"], {n: p.double() for n, p in plain_model(qwen3).state_dict().items()}) > 1e-4
    )


@pytest.mark.slow
def test_sp_on_four_ranks_equals_sp1(tmp_path, qwen3, qwen2):
    dp2 = [f"{SP_KEY}=2", "trainer.devices_per_node=4", "actor.max_tokens_per_micro_batch=8"]
    sp4 = [f"{SP_KEY}=4", "trainer.devices_per_node=4"]
    cases = [
        # SP 2 x DP 2: two groups, each training on its two ranks' shards; a budget of 8 tokens per device = 16 per
        # group gives the groups different micro-batch counts, so the zero-weight dummy passes run through SP too
        case("dp2", qwen3, *dp2, "actor.lr=1e-4"),
        case("dp2_f64", qwen3, *dp2, "actor.lr=1e-3", dtype="float64", ops=("update",)),
        # SP 4 with 2 KV heads: each repeated twice before the all-to-all
        case("q2_sp4", qwen2, *sp4, "actor.lr=1e-4", "actor.micro_batch_size=3"),
        case("q2_sp4_f64", qwen2, *sp4, "actor.lr=1e-3", "actor.micro_batch_size=8", dtype="float64", ops=("update",)),
        case(
            "npu_q2_sp4",
            qwen2,
            *sp4,
            "actor.micro_batch_size=8",
            "trainer.device=npu",
            device="npu",
            ops=("log_probs",),
        ),
    ]
    batches = {c["name"]: rollout_batch(c["model"], 16, seed=10 + i) for i, c in enumerate(cases)}
    counts = []  # micro-batches of each group's minibatch j, planned by hand from the ranks' shards
    for group in range(2):
        shards = [dp_shard(batches["dp2"], r, 4, 2) for r in (2 * group, 2 * group + 1)]
        mbs = [SampleBatch.concat([s.split(2)[j] for s in shards]) for j in range(2)]
        counts.append([len(plan_micro_batches(mb, max_tokens=16)) for mb in mbs])
    assert counts[0] != counts[1]  # so one group runs zero-weight dummy passes
    got = run_ranks(4, cases, batches, tmp_path)
    want = {c["name"]: reference(c, batches[c["name"]]) for c in cases if c["device"] == "cpu"}
    with npu_shim() as backend:
        want |= {c["name"]: reference(c, batches[c["name"]], backend) for c in cases if c["device"] == "npu"}
    assert {got["npu_q2_sp4"][r]["attn"] for r in range(4)} == {"ulysses_npu_fusion"}
    for c in cases:
        tol = 1e-10 if c["master_dtype"] == "float64" else 1e-5
        assert_equivalent(
            c["name"], got[c["name"]], want[c["name"]], batches[c["name"]], 4, lp_tol=1e-5, update_tol=tol
        )
    assert {got["dp2"][r]["metrics"]["actor/micro_batches"] for r in range(4)} == {
        got["dp2"][0]["metrics"]["actor/micro_batches"]
    }


@pytest.mark.parametrize("hardware, device", [("atlas-800t-a2", "npu"), ("h20", "cuda")])
def test_the_3b_configs_comment_states_the_planners_verdict(hardware, device):
    from gspo_ascend.doctor.hardware import profile
    from gspo_ascend.doctor.modelspec import load_spec
    from gspo_ascend.doctor.planner import GIB, plan

    path = REPO / "configs/qwen25_3b_gspo.yaml"
    cfg = load_config(path, ["model.path=Qwen/Qwen2.5-3B", f"trainer.device={device}"])  # the built-in spec
    assert cfg.actor.ulysses_sequence_parallel_size == 4 and cfg.trainer.devices_per_node == 8  # the field layout
    p = plan(cfg, load_spec(cfg.model.path), profile(hardware))
    stated = f"{hardware} (trainer.device={device}): {p.verdict}; training {p.train.total / GIB:.2f} GiB, rollout"
    assert stated in path.read_text() and p.verdict == "fits"
    assert f"rollout {p.rollout.total / GIB:.2f} GiB of {p.usable_bytes / GIB:.1f} GiB usable" in path.read_text()
