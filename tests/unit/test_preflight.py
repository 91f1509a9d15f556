"""Config preflight: one test per rule, each with a config that fails it and one that passes; every shipped
config passes; `train --dry-run` exits 2 listing every finding."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gspo_ascend import config
from gspo_ascend.doctor.hardware import HardwareInfo, parse_npu_smi
from gspo_ascend.doctor.preflight import preflight, preflight_file
from gspo_ascend.tiny import ensure_tiny_model
from tests.conftest import REPO

MODELS = REPO / "tests/fixtures/models"
QWEN3_MOE = str(MODELS / "qwen3-30b-a3b")
QWEN25_3B = str(MODELS / "qwen2.5-3b")

# Qwen3-30B-A3B on 2 x 8 Atlas A2 with a layout that folds: TP4 x PP2 = 8, EP4 x ETP1 x PP2 = 8 | 16.
MOE_2X8 = [
    f"model.path={QWEN3_MOE}",
    "model.dtype=bfloat16",
    "trainer.device=npu",
    "trainer.nnodes=2",
    "trainer.devices_per_node=8",
    "actor.engine=megatron",
    "actor.tensor_parallel_size=4",
    "actor.pipeline_parallel_size=2",
    "actor.expert_parallel_size=4",
    "actor.sequence_parallel=true",
    "actor.micro_batch_size=1",
    "actor.ppo_mini_batch_size=32",
    "data.train_batch_size=128",
    "data.max_prompt_length=2048",
    "data.max_response_length=6144",
    "rollout.n=8",
    "rollout.tensor_parallel_size=4",
]
# Qwen2.5-3B dense on one 8-device node with Megatron TP2.
DENSE_1X8 = [
    f"model.path={QWEN25_3B}",
    "model.dtype=bfloat16",
    "trainer.device=npu",
    "trainer.devices_per_node=8",
    "actor.engine=megatron",
    "actor.tensor_parallel_size=2",
    "actor.sequence_parallel=true",
    "actor.micro_batch_size=2",
    "actor.ppo_mini_batch_size=16",
    "data.train_batch_size=64",
    "data.max_prompt_length=2048",
    "data.max_response_length=8192",
    "rollout.n=16",
    "rollout.tensor_parallel_size=2",
]


def run(base, *overrides, hardware=None):
    cfg = config.load_config(None, [*base, *overrides], validate=False)
    return preflight(cfg, hardware)


def finding(checks, rule):
    (found,) = [c for c in checks if c.name == f"preflight:{rule}"]
    return found


def fails(checks):
    return [c for c in checks if c.status == "fail"]


@pytest.mark.parametrize("base", [MOE_2X8, DENSE_1X8], ids=["qwen3-30b-a3b-2x8", "qwen2.5-3b-1x8"])
def test_reference_layouts_pass(base):
    checks = run(base)
    assert fails(checks) == [] and [c for c in checks if c.status == "warn"] == []


def test_rule_world_divisible_by_tp_pp_cp():
    bad = finding(run(MOE_2X8, "actor.pipeline_parallel_size=3"), "world")
    assert bad.status == "fail" and "world 16" in bad.finding and "4x3x1 = 12" in bad.finding
    assert finding(run(MOE_2X8), "world").finding == "world 16 = TP 4 x PP 2 x CP 1 x DP 2"


@pytest.fixture
def megatron_core(monkeypatch):
    """Set the megatron-core version the preflight reads (None: not installed)."""
    from gspo_ascend import megatron_settings

    def installed(version):
        monkeypatch.setattr(megatron_settings, "megatron_core_version", lambda: version)

    return installed


def test_rule_heads_field_failure_tp8_on_4_kv_heads_under_megatron_core_0_12(megatron_core):
    megatron_core("0.12.1")  # the previous NPU line: TransformerConfig's ValueError
    bad = finding(run(MOE_2X8, "actor.tensor_parallel_size=8", "actor.pipeline_parallel_size=1"), "heads")
    assert bad.status == "fail"
    assert "num_query_groups (4) must be a multiple of tensor_model_parallel_size (8)" in bad.finding
    assert "megatron-core 0.12.1 cannot replicate KV heads" in bad.finding and "1, 2, 4" in bad.fix
    bad = finding(run(MOE_2X8, "actor.tensor_parallel_size=3", "trainer.devices_per_node=6"), "heads")
    assert bad.status == "fail" and "num_attention_heads (32)" in bad.finding
    assert finding(run(MOE_2X8), "heads").status == "ok"


@pytest.mark.parametrize("version", ["0.16.0", "0.16.1", None])
@pytest.mark.parametrize("device", ["npu", "cuda", "cpu"])
def test_rule_heads_kv_replication_is_a_warning_where_megatron_core_replicates(megatron_core, version, device):
    # megatron-core 0.16 replicates KV heads (CPU: tests/integration dense_tp2_kv1; NPU under MindSpeed
    # core_r0.16.0: tests/mindspeed ms_dense_tp2_kv1); not installed here: said as the rule, the cluster decides
    megatron_core(version)
    warn = finding(
        run(MOE_2X8, "actor.tensor_parallel_size=8", "actor.pipeline_parallel_size=1", f"trainer.device={device}"),
        "heads",
    )
    assert warn.status == "warn"
    assert warn.finding.startswith("4 KV heads replicated over TP 8: ") and "each is on 2 ranks" in warn.finding
    assert "before 0.16 (the previous NPU line's 0.12.1) refuses" in warn.fix


def test_rule_layers_divisible_by_pp():
    bad = finding(
        run(MOE_2X8, "actor.pipeline_parallel_size=5", "trainer.nnodes=5", "trainer.devices_per_node=4"), "layers"
    )
    assert (
        bad.status == "fail"
        and "num_hidden_layers (48) is not divisible by actor.pipeline_parallel_size (5)" in bad.finding
    )
    assert finding(run(MOE_2X8), "layers").finding == "48 layers = 24 per pipeline stage"


def test_rule_experts_divisible_by_ep():
    bad = finding(run(MOE_2X8, "actor.expert_parallel_size=3", "trainer.nnodes=3"), "experts")
    assert bad.status == "fail" and "num_experts (128)" in bad.finding
    dense = finding(run(DENSE_1X8, "actor.expert_parallel_size=2"), "experts")
    assert dense.status == "fail" and "dense model" in dense.finding
    assert finding(run(MOE_2X8), "experts").finding == "128 experts = 32 per EP rank"


def test_rule_moe_folding_field_failure_tp4_pp4_ep8_on_16():
    checks = run(MOE_2X8, "actor.pipeline_parallel_size=4", "actor.expert_parallel_size=8")
    bad = finding(checks, "moe-folding")
    # the message megatron/core/parallel_state.py raises in initialize_model_parallel
    assert bad.status == "fail"
    assert "world_size (16) is not divisible by expert_tensor_model_pipeline_parallel size (32)" in bad.finding
    assert "4 ranks per pipeline stage" in bad.finding
    ok = finding(run(MOE_2X8, "actor.pipeline_parallel_size=4", "actor.expert_parallel_size=4"), "moe-folding")
    assert ok.status == "ok" and "expert DP 1" in ok.finding


def test_rule_moe_needs_sequence_parallel_with_tp():
    warn = finding(run(MOE_2X8, "actor.sequence_parallel=false"), "moe-sp")
    assert warn.status == "warn" and "actor.sequence_parallel=true" in warn.fix
    assert not [c for c in run(MOE_2X8) if c.name == "preflight:moe-sp"]


def test_rule_rollout_tp_fits_a_node_and_the_heads():
    assert finding(run(MOE_2X8, "rollout.tensor_parallel_size=16"), "rollout-tp").status == "fail"
    bad = finding(run(MOE_2X8, "rollout.tensor_parallel_size=3", "trainer.devices_per_node=6"), "rollout-tp")
    assert bad.status == "fail" and "num_attention_heads (32)" in bad.finding
    ok = finding(run(DENSE_1X8, "rollout.tensor_parallel_size=4"), "rollout-tp")  # 4 > 2 KV heads: vLLM replicates
    assert ok.status == "ok" and ok.finding == "rollout TP 4: 2 engine(s)"


def test_rule_batch_minibatch_over_dp_and_micro_batches():
    # TP1 PP1 on 16 devices = DP 16; a minibatch of 1 prompt x 8 samples cannot split over 16 ranks
    one_prompt = ["actor.ppo_mini_batch_size=1", "data.train_batch_size=4", "rollout.n=8"]
    bad = finding(run(DENSE_1X8, "trainer.nnodes=2", "actor.tensor_parallel_size=1", *one_prompt), "batch")
    assert bad.status == "fail" and "1x8 = 8 samples does not split over DP 16" in bad.finding
    # Megatron's num_microbatches_calculator assertion
    bad = finding(run(MOE_2X8, "actor.micro_batch_size=3"), "batch")
    assert bad.status == "fail"
    assert (
        "global batch size (256) is not divisible by micro batch size (3) times data parallel size (2)" in bad.finding
    )
    ok = finding(run(MOE_2X8), "batch")
    assert ok.status == "ok" and ok.finding == "4 minibatches of 256 samples = 128 per DP rank (DP 2)"


def test_rule_micro_batch_or_token_budget_is_set():
    # field failure #4, "Please set micro_batch_size or set use_flash_attn=True": caught by the schema's rule
    bad = fails(run(MOE_2X8, "actor.micro_batch_size=null"))
    assert any("actor.micro_batch_size" in c.finding and "max_tokens_per_micro_batch" in c.finding for c in bad)
    short = finding(run(MOE_2X8, "actor.max_tokens_per_micro_batch=4096"), "micro-batch")
    assert short.status == "fail" and "below one full sequence" in short.finding and "8192" in short.fix
    assert finding(run(MOE_2X8, "actor.max_tokens_per_micro_batch=16384"), "micro-batch").status == "ok"


def test_rule_seq_len_within_model_and_vllm_limits():
    bad = finding(run(MOE_2X8, "data.max_response_length=40000"), "seq-len")
    assert bad.status == "fail" and "exceeds the model's 40960 positions" in bad.finding
    bad = finding(run(MOE_2X8, "rollout.max_model_len=4096"), "seq-len")
    assert bad.status == "fail" and "exceeds rollout.max_model_len (4096)" in bad.finding
    bad = finding(run(MOE_2X8, "rollout.max_model_len=65536"), "seq-len")
    assert bad.status == "fail" and "vLLM refuses it" in bad.finding
    assert finding(run(MOE_2X8, "rollout.max_model_len=16384"), "seq-len").status == "ok"


def test_rule_mc2_legal_on_a2():
    # MindSpeed 2.2.0's --use-ascend-mc2 replaces the TP linears of MoE models too (the old rule refused MoE,
    # citing a --moe-alltoall-mc2 flag this MindSpeed does not have); MOE_2X8 runs TP 4 with sequence parallel
    assert finding(run(MOE_2X8, "actor.use_mc2=true"), "mc2").status == "ok"
    no_sp = finding(run(DENSE_1X8, "actor.use_mc2=true", "actor.sequence_parallel=false"), "mc2")
    assert no_sp.status == "fail" and "actor.sequence_parallel must be true" in no_sp.finding
    tp1 = finding(run(DENSE_1X8, "actor.use_mc2=true", "actor.tensor_parallel_size=1"), "mc2")
    assert "one of (2, 4, 8)" in tp1.finding
    assert finding(run(DENSE_1X8, "actor.use_mc2=true"), "mc2").status == "ok"


def test_rule_mc2_holds_the_kernels_limits():
    """torch_npu 2.7.1's MC2 kernels (op docs of npu_all_gather_base_mm / npu_mm_reduce_scatter_base): fp16 / bf16
    inputs only, matmul k in [256, 65535). Qwen2.5-3B at TP 8: attention 16 x 128 / 8 = 256 (legal), FFN
    11008 / 8 = 1376; the tiny Qwen3 (hidden 128): every k is too small."""
    fp32 = finding(run(DENSE_1X8, "actor.use_mc2=true", "model.dtype=float32"), "mc2")
    assert fp32.status == "fail" and "model.dtype must be bfloat16 or float16" in fp32.finding
    assert finding(run(DENSE_1X8, "actor.use_mc2=true", "actor.tensor_parallel_size=8"), "mc2").status == "ok"
    tiny = finding(run(DENSE_1X8, "actor.use_mc2=true", f"model.path={ensure_tiny_model()}"), "mc2")
    assert tiny.status == "fail" and "hidden size = 128 is outside [256, 65535)" in tiny.finding


def test_rule_devices_per_node_against_the_host():
    eight = parse_npu_smi((REPO / "tests/fixtures/doctor/npu-smi-info-8x910B3.txt").read_text())
    bad = finding(run(MOE_2X8, "trainer.devices_per_node=16", "trainer.nnodes=1", hardware=eight), "devices")
    assert bad.status == "fail" and "this host has 8 NPUs" in bad.finding
    assert finding(run(MOE_2X8, hardware=eight), "devices").status == "ok"
    assert not [c for c in run(MOE_2X8, hardware=HardwareInfo("cpu")) if c.name == "preflight:devices"]


# The disaggregated 30B layout (configs/qwen3_30b_a3b_gspo_disagg.yaml): trainer 2 x 6 (TP 2 x PP 6, EP 2) and a
# rollout pool of 2 x 2 (vLLM TP 2) sharing both nodes: 6 + 2 devices on each.
POOLS_2X8 = [
    *MOE_2X8,
    "trainer.devices_per_node=6",
    "actor.tensor_parallel_size=2",
    "actor.pipeline_parallel_size=6",
    "actor.expert_parallel_size=2",
    "rollout.tensor_parallel_size=2",
    "rollout_pool.nnodes=2",
    "rollout_pool.devices_per_node=2",
]


def test_rule_rollout_tp_fits_a_node_of_the_rollout_pool():
    """With a rollout pool the engines sit in its nodes: TP 4 does not divide its 2 devices per node (the config
    validator passes it: 4 divides the pool's 4 devices), while the trainer's 6 no longer matter."""
    assert fails(run(POOLS_2X8)) == []
    assert finding(run(POOLS_2X8), "rollout-tp").finding == "rollout TP 2: 2 engine(s)"
    bad = finding(run(POOLS_2X8, "rollout.tensor_parallel_size=4"), "rollout-tp")
    assert bad.status == "fail" and "does not divide rollout_pool.devices_per_node (2)" in bad.finding
    assert bad.fix.startswith("set rollout.tensor_parallel_size to a divisor of 2")


def test_rule_world_applies_to_the_trainer_pool_only():
    tp4_pp2 = ("actor.tensor_parallel_size=4", "actor.pipeline_parallel_size=2")  # 12 trainer ranks, TP x PP = 8
    bad = finding(run(POOLS_2X8, *tp4_pp2), "world")
    assert bad.status == "fail" and "world 12 (trainer.nnodes x trainer.devices_per_node)" in bad.finding


def test_rule_node_local_groups_fit_the_configs_nodes():
    """Audit 3, finding 2: the disaggregated config's old layout, TP 4 x PP 3 (EP 4) on 2 x 6 trainer devices,
    numbers ranks 0-5 on the first node and 6-11 on the second, so its TP group [4, 5, 6, 7] spans both. It passed
    the preflight and started only because Ray's PACK put 8 trainer ranks on one node. TP 2 x PP 6 x EP 2 keeps
    every group in one node; TP 2 x PP 3 x EP 4, the planner's other fit, splits stage 1's expert group."""
    old = ("actor.tensor_parallel_size=4", "actor.pipeline_parallel_size=3", "actor.expert_parallel_size=4")
    bad = finding(run(POOLS_2X8, *old), "node-local")
    assert bad.status == "fail"
    assert bad.finding.startswith("the megatron tensor-parallel group of ranks [4, 5, 6, 7] would span 2 nodes")
    assert "trainer.nnodes 2 x trainer.devices_per_node 6" in bad.finding
    assert bad.fix.startswith("choose actor.tensor_parallel_size (now 4) so that its groups fit in")
    assert finding(run(POOLS_2X8), "node-local").status == "ok"
    ep = finding(run(POOLS_2X8, "actor.pipeline_parallel_size=3", "actor.expert_parallel_size=4"), "node-local")
    assert ep.status == "fail" and "megatron expert-parallel group of ranks [4, 5, 6, 7]" in ep.finding
    # a colocated layout: 2 x 8 with TP 4 and EP 4 folds into nodes; Ulysses SP 4 over 2 x 6 does not (ranks 4-7)
    assert finding(run(MOE_2X8), "node-local").status == "ok"
    sp = ("actor.engine=fsdp", "actor.ulysses_sequence_parallel_size=4", "trainer.devices_per_node=6")
    uly = finding(run(MOE_2X8, *sp, "actor.tensor_parallel_size=1", "rollout.tensor_parallel_size=2"), "node-local")
    assert uly.status == "fail" and "Ulysses sequence-parallel group of ranks [4, 5, 6, 7]" in uly.finding


def test_rule_pools_fit_the_node():
    """Pools on the same nodes (nnodes equal) add up per node; pools on nodes of their own must each fit one.
    The node's size comes from the host (doctor) or the target's profile (plan), never from the config."""
    from gspo_ascend.doctor.preflight import pools_check

    cfg = config.load_config(None, POOLS_2X8, validate=False)
    (ok,) = pools_check(cfg, 8, "atlas-800t-a2")
    assert ok.status == "ok" and ok.finding == "trainer 6 + rollout 2 of 8 devices per node"
    (bad,) = pools_check(config.load_config(None, [*POOLS_2X8, "rollout_pool.devices_per_node=4"]), 8, "h20")
    assert bad.status == "fail" and bad.name == "preflight:pools"
    assert bad.finding == (
        "trainer.devices_per_node (6) + rollout_pool.devices_per_node (4) = 10 exceeds the 8 devices of a node "
        "(h20); with trainer.nnodes = rollout_pool.nnodes (2) both pools share every node"
    )
    assert bad.fix == "lower trainer.devices_per_node or rollout_pool.devices_per_node to a sum <= 8"
    apart = [*POOLS_2X8, "rollout_pool.nnodes=1", "rollout_pool.devices_per_node=16", "rollout.tensor_parallel_size=1"]
    (bad,) = pools_check(config.load_config(None, apart, validate=False), 8, "h20")
    assert bad.finding == "rollout_pool.devices_per_node (16) exceeds the 8 devices of a node (h20)"
    assert bad.fix == "set rollout_pool.devices_per_node to <= 8"
    assert pools_check(config.load_config(None, MOE_2X8, validate=False), 8, "h20") == []  # colocated: no pools
    eight = parse_npu_smi((REPO / "tests/fixtures/doctor/npu-smi-info-8x910B3.txt").read_text())
    host = finding(run(POOLS_2X8, "rollout_pool.devices_per_node=3", hardware=eight), "pools")
    assert host.status == "fail" and "(this host's NPUs)" in host.finding


def test_plan_refuses_pools_over_the_target_node_in_one_line():
    """The launch scripts' check (`gspo-ascend plan --hardware`): exit 2, one `error:` line with the key and the fix."""
    disagg = str(REPO / "configs/qwen3_30b_a3b_gspo_disagg.yaml")
    cmd = [sys.executable, "-m", "gspo_ascend.cli", "plan", "--config", disagg, f"model.path={QWEN3_MOE}"]
    proc = subprocess.run(
        [*cmd, "rollout_pool.devices_per_node=4", "--hardware", "atlas-800t-a2"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("error: preflight:pools: trainer.devices_per_node (6) + rollout_pool.devices_per_node")
    assert lines[0].endswith("; fix: lower trainer.devices_per_node or rollout_pool.devices_per_node to a sum <= 8")


def test_rule_model_path():
    bad = finding(run(MOE_2X8, "model.path=/nonexistent/model"), "model")
    assert bad.status == "fail" and "'/nonexistent/model' has no config.json" in bad.finding
    assert "Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B" in bad.finding  # the ids that would have worked
    assert "model checks skipped" in finding(run([], "model.path=''"), "model").finding
    assert "qwen3_moe (MoE 128 experts top-8, 30.53B params)" in finding(run(MOE_2X8), "model").finding


def test_rule_model_path_without_weights_uses_the_builtin_spec():
    # a laptop checking the cluster config: /models/Qwen3-30B-A3B is not here; every rule still runs
    checks = run(MOE_2X8, "model.path=/models/Qwen3-30B-A3B")
    model = finding(checks, "model")
    assert model.status == "warn"
    assert model.finding.startswith(
        "model.path '/models/Qwen3-30B-A3B' has no config.json: using the built-in spec of Qwen/Qwen3-30B-A3B "
        "(matched by its last path component 'Qwen3-30B-A3B'"
    )
    assert "a real run needs the weights of Qwen/Qwen3-30B-A3B" in model.fix
    assert [c for c in checks if c.status != "ok"] == [model]
    assert finding(checks, "experts").finding == "128 experts = 32 per EP rank"  # facts from the built-in spec
    tp8 = finding(run(MOE_2X8, "model.path=Qwen/Qwen3-30B-A3B", "actor.tensor_parallel_size=8"), "heads")
    assert "built-in spec Qwen/Qwen3-30B-A3B has num_key_value_heads=4" in tp8.finding


def test_unknown_key_is_a_finding_with_the_closest_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("algorithm:\n  clip_ratio_lo: 0.1\n")
    cfg, checks = preflight_file(str(path))
    assert cfg is None and checks[0].status == "fail"
    assert "unknown config key 'algorithm.clip_ratio_lo'; did you mean 'algorithm.clip_ratio_low'?" in checks[0].finding


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_passes(path):
    # as shipped: cluster configs name /models/<model>, absent here, so their built-in specs stand in
    _, checks = preflight_file(str(path))
    assert fails(checks) == [], [c.finding for c in fails(checks)]
    model = finding(checks, "model")
    assert model.status == "ok" or "using the built-in spec of Qwen/" in model.finding


def test_train_dry_run_lists_every_problem(cli):
    proc = cli(
        "train",
        "--dry-run",
        *MOE_2X8,
        "trainer.device=cpu",
        "actor.pipeline_parallel_size=4",
        "actor.expert_parallel_size=8",
        "actor.micro_batch_size=3",
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "[fail] preflight:moe-folding" in proc.stdout and "[fail] preflight:batch" in proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0] == "error: preflight found 2 problem(s) in the config (listed above on stdout)"


# ----------------------------------------------------------------------------------------------- train --dry-run

NPU_30B = [str(REPO / "configs/qwen3_30b_a3b_gspo.yaml"), "trainer.device=npu", "model.path=Qwen/Qwen3-30B-A3B"]


def dry_run_without_shim(*args: str) -> subprocess.CompletedProcess:
    """`gspo-ascend train --dry-run` as on a laptop: no NPU stack and no GSPO_DEVICE_SHIM in the environment."""
    env = {k: v for k, v in os.environ.items() if k not in ("GSPO_DEVICE_SHIM", "GSPO_DEVICE")}
    return subprocess.run(
        [sys.executable, "-m", "gspo_ascend.cli", "train", "--dry-run", "--config", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
    )


@pytest.mark.parametrize(
    "override, rule, fragment",
    [
        (
            "actor.pipeline_parallel_size=4",  # TP 4 x PP 4 x EP 8 on 2 x 8 ranks
            "moe-folding",
            "world_size (16) is not divisible by expert_tensor_model_pipeline_parallel size (32)",
        ),
        ("data.max_response_length=40000", "seq-len", "42048 exceeds the model's 40960 positions"),
    ],
)
def test_dry_run_reports_layout_findings_before_the_missing_npu(override, rule, fragment):
    proc = dry_run_without_shim(*NPU_30B, override)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    shown = [line for line in proc.stdout.splitlines() if line.startswith("[")]
    assert shown[0].startswith("[warn] preflight:model: model.path 'Qwen/Qwen3-30B-A3B' has no config.json")
    assert shown[1].startswith(f"[fail] preflight:{rule}: ") and fragment in shown[1]
    assert shown[-1].startswith("[fail] device: trainer.device=npu but no usable NPU") and len(shown) == 3
    assert proc.stderr.strip().splitlines() == [
        "error: preflight found 1 problem(s) in the config and 1 with the device (listed above on stdout)"
    ]


def test_dry_run_with_only_the_device_missing_says_that_in_one_line():
    proc = dry_run_without_shim(*NPU_30B)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: trainer.device=npu but no usable NPU")
    assert "GSPO_DEVICE_SHIM=1" in lines[0] and "[fail]" not in proc.stdout
    assert "[warn] preflight:model:" in proc.stdout  # the built-in spec is said to have been used


def test_dry_run_with_an_unknown_hub_id_lists_the_builtin_ids():
    proc = dry_run_without_shim(str(REPO / "configs/qwen3_30b_a3b_gspo.yaml"), "model.path=Qwen/Qwen9-1B")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (model,) = [line for line in proc.stdout.splitlines() if line.startswith("[fail] preflight:model:")]
    assert "'Qwen/Qwen9-1B' has no config.json and names no model with a built-in spec" in model
    assert "use one of: Qwen/Qwen3-0.6B, " in model and model.endswith("Qwen/Qwen2.5-32B")
