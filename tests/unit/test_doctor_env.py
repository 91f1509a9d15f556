"""Ascend environment-variable rules (one test per rule: violated and satisfied) and the Ray cluster probe."""

from __future__ import annotations

import pytest

from gspo_ascend import config
from gspo_ascend.doctor import run_checks
from gspo_ascend.doctor.envrules import ENV_RULES, env_checks
from gspo_ascend.doctor.raycheck import ray_checks
from tests.fixtures.doctor.fakehost import SOURCED, VERL_STACK, context, make_sysroot, recorded

MULTI_NODE_VLLM = ["trainer.nnodes=2", "trainer.devices_per_node=8", "rollout.engine=vllm"]


def env_findings(tmp_path, env: dict, overrides=MULTI_NODE_VLLM) -> dict:
    cfg = config.load_config(None, overrides, validate=False)
    root = make_sysroot(tmp_path / "root")
    ctx = context(tmp_path, sysroot=root, env={**SOURCED, **env}, planned=VERL_STACK, config=cfg)
    return {c.name.removeprefix("env:"): c for c in env_checks(ctx)}


# (rule, env that violates it, expected status, fragment, env that satisfies it, extra overrides)
CASES = [
    ("TASK_QUEUE_ENABLE", {"TASK_QUEUE_ENABLE": "1"}, "warn", "eager mode wants 2", {"TASK_QUEUE_ENABLE": "2"}, []),
    (
        "TASK_QUEUE_ENABLE",
        {"TASK_QUEUE_ENABLE": "2"},
        "warn",
        "vLLM ACL graph mode wants 1",
        {"TASK_QUEUE_ENABLE": "1"},
        ["rollout.enforce_eager=false"],
    ),
    (
        "HCCL_CONNECT_TIMEOUT",
        {"HCCL_CONNECT_TIMEOUT": "600"},
        "warn",
        "600 s is short",
        {"HCCL_CONNECT_TIMEOUT": "1800"},
        [],
    ),
    (
        "HCCL_OP_EXPANSION_MODE",
        {"HCCL_OP_EXPANSION_MODE": "AIV", "HCCL_EXEC_TIMEOUT": "3600"},
        "warn",
        "HCCL_EXEC_TIMEOUT=3600 is capped at 1091 s in AIV mode",
        {"HCCL_OP_EXPANSION_MODE": "HOST", "HCCL_EXEC_TIMEOUT": "3600"},
        [],
    ),
    (
        "HCCL_SOCKET_IFNAME",
        {"GLOO_SOCKET_IFNAME": "eth0"},
        "warn",
        "without HCCL_SOCKET_IFNAME/HCCL_IF_IP",
        {"HCCL_IF_IP": "10.0.0.2", "GLOO_SOCKET_IFNAME": "eth0"},
        [],
    ),
    (
        "VLLM_ASCEND_ENABLE_NZ",
        {"VLLM_ASCEND_ENABLE_NZ": "1"},
        "fail",
        "NZ weight layout",
        {"VLLM_ASCEND_ENABLE_NZ": "0"},
        [],
    ),
    (
        "PYTORCH_ALLOC_CONF",
        {"PYTORCH_ALLOC_CONF": "max_split_size_mb:2048"},
        "warn",
        "ignored on NPU",
        {"PYTORCH_NPU_ALLOC_CONF": "max_split_size_mb:2048"},
        [],
    ),
    (  # VERL_STACK has torch_npu 2.7.1, which reads only the old name
        "HCCL_ASYNC_ERROR_HANDLING",
        {"TORCH_HCCL_ASYNC_ERROR_HANDLING": "0"},
        "warn",
        "not read by torch_npu 2.7.1",
        {"HCCL_ASYNC_ERROR_HANDLING": "0"},
        [],
    ),
    ("HCCL_INTRA_ROCE_ENABLE", {"HCCL_INTRA_ROCE_ENABLE": "1"}, "warn", "does not apply to the 800T A2", {}, []),
]


@pytest.mark.parametrize(
    "rule, bad, status, fragment, good, extra", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)]
)
def test_env_rule(tmp_path, rule, bad, status, fragment, good, extra):
    found = env_findings(tmp_path / "bad", bad, MULTI_NODE_VLLM + extra)[rule]
    assert found.status == status and fragment in found.finding and found.fix
    assert env_findings(tmp_path / "good", good, MULTI_NODE_VLLM + extra)[rule].status == "ok"


def test_every_rule_has_a_case():
    assert {r.name for r in ENV_RULES} == {c[0] for c in CASES}


def test_multi_node_and_vllm_rules_need_their_situation(tmp_path):
    single = env_findings(tmp_path, {}, ["trainer.nnodes=1", "rollout.engine=hf"])
    assert "HCCL_CONNECT_TIMEOUT" not in single and "VLLM_ASCEND_ENABLE_NZ" not in single
    assert "TASK_QUEUE_ENABLE" in single


def test_env_rules_skip_non_ascend_platforms(tmp_path):
    ctx = context(tmp_path, env={"PYTORCH_NPU_ALLOC_CONF": "x", "PYTORCH_ALLOC_CONF": "y"})
    assert env_checks(ctx) == []


# ----------------------------------------------------------------------------------------------- Ray


RESOURCES = {"total": {"NPU": 16.0, "CPU": 384.0}, "available": {"NPU": 12.0, "CPU": 380.0}, "nodes": 2}


def test_ray_is_not_probed_without_a_cluster(tmp_path):
    runner = recorded(ray=RESOURCES)
    ctx = context(tmp_path, runner=runner)
    (check,) = ray_checks(ctx)
    assert check.status == "ok" and "skipped" in check.finding
    assert runner.calls == []  # never started, never connected


def test_ray_cluster_resources_against_the_config(tmp_path):
    cfg = config.load_config(None, ["trainer.nnodes=2", "trainer.devices_per_node=8"], validate=False)
    root = make_sysroot(tmp_path / "root")
    ctx = context(
        tmp_path,
        sysroot=root,
        env={**SOURCED, "RAY_ADDRESS": "10.0.0.1:6379"},
        planned=VERL_STACK,
        config=cfg,
        runner=recorded("npu-smi-info-8x910B3.txt", ray=RESOURCES),
    )
    (check,) = ray_checks(ctx)
    assert check.status == "ok" and check.finding == "2 node(s), NPU 12 free of 16"
    (probe,) = [call for call in ctx.runner.calls if "-c" in call]
    assert "address='auto'" in probe[-1]  # connects to the running cluster, never ray.init() a new one
    cfg.trainer.nnodes = 4
    (check,) = ray_checks(
        context(
            tmp_path,
            sysroot=root,
            env={"RAY_ADDRESS": "x"},
            planned=VERL_STACK,
            config=cfg,
            runner=recorded("npu-smi-info-8x910B3.txt", ray=RESOURCES),
        )
    )
    assert check.status == "fail" and "the config needs 32" in check.finding


def test_stale_ray_marker_warns(tmp_path):
    marker = tmp_path / "ray_current_cluster"
    marker.write_text("10.0.0.9:6379")
    ctx = context(tmp_path, runner=recorded(ray="ConnectionError: Could not find any running Ray instance."))
    ctx.ray_cluster_file = marker
    (check,) = ray_checks(ctx)
    assert check.status == "warn" and "Could not find any running Ray instance" in check.finding


def test_whole_doctor_run_with_ray_up(tmp_path):
    ctx = context(
        tmp_path,
        env={"RAY_ADDRESS": "auto"},
        runner=recorded(ray={"total": {"CPU": 16.0}, "available": {"CPU": 16.0}, "nodes": 1}),
    )
    names = {c.name: c for c in run_checks(ctx)}
    assert names["ray-cluster"].finding == "1 node(s), CPU 16 free of 16"


def test_ray_driver_in_this_process_is_asked_directly(tmp_path, monkeypatch):
    import sys
    import types

    fake = types.SimpleNamespace(
        is_initialized=lambda: True,
        nodes=lambda: [{"Alive": True}, {"Alive": False}],
        cluster_resources=lambda: {"CPU": 8.0},
        available_resources=lambda: {"CPU": 6.0},
    )
    monkeypatch.setitem(sys.modules, "ray", fake)
    runner = recorded()
    (check,) = ray_checks(context(tmp_path, runner=runner))
    assert check.finding == "1 node(s), CPU 6 free of 8" and not [c for c in runner.calls if "-c" in c]
