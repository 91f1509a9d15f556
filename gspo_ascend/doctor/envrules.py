"""Ascend runtime environment variables as a rule table (CANN envref and torch_npu docs, npu_api.md §3/§5).

Each rule names when it applies (always on NPU, multi-node only, vLLM rollout only), a predicate that
returns a problem sentence or None, the status for a violation and the fix. Rules only run on an Ascend
platform; "multi-node" rules need ``--config`` (trainer.nnodes) and are skipped without it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from .check import Check
from .versions import matches

Env = Mapping[str, str]


@dataclass(frozen=True)
class Situation:
    multi_node: bool | None  # None = unknown (no config)
    vllm: bool
    graph_mode: bool  # vLLM ACL graph (rollout.enforce_eager=false); eager everywhere else
    torch_npu: str | None = None  # the checked torch_npu version (None = unknown); env_checks fills it in


@dataclass(frozen=True)
class EnvRule:
    name: str
    applies: str  # npu | multi-node | vllm
    problem: Callable[[Env, Situation], str | None]
    status: str
    fix: Callable[[Env, Situation], str]
    shows: tuple[str, ...]  # variables printed in the ok line


def _int(env: Env, name: str, default: int) -> int:
    try:
        return int(env.get(name, default))
    except ValueError:
        return default


def _task_queue(env: Env, s: Situation) -> str | None:
    want = "1" if s.graph_mode else "2"
    have = env.get("TASK_QUEUE_ENABLE", "1")  # torch_npu's default is 1
    if have != want:
        mode = "vLLM ACL graph mode" if s.graph_mode else "eager mode"
        return f"TASK_QUEUE_ENABLE={env.get('TASK_QUEUE_ENABLE', 'unset (=1)')}; {mode} wants {want}"
    return None


def _aiv(env: Env, s: Situation) -> str | None:
    if env.get("HCCL_OP_EXPANSION_MODE", "").upper() != "AIV":
        return None
    timeout = _int(env, "HCCL_EXEC_TIMEOUT", 1836)
    shown = env.get("HCCL_EXEC_TIMEOUT", f"unset (={timeout})")
    capped = f"HCCL_EXEC_TIMEOUT={shown} is capped at 1091 s in AIV mode; " if timeout > 1091 else ""
    return capped + "AIV expansion on A2 is documented for inference only (set it for rollout workers only)"


def _nic(env: Env, s: Situation) -> str | None:
    missing = [] if env.get("HCCL_SOCKET_IFNAME") or env.get("HCCL_IF_IP") else ["HCCL_SOCKET_IFNAME/HCCL_IF_IP"]
    missing += [] if env.get("GLOO_SOCKET_IFNAME") else ["GLOO_SOCKET_IFNAME"]
    return f"multi-node run without {' and '.join(missing)}: ranks may pick a docker or lo NIC" if missing else None


# The name torch_npu's HCCL watchdog switch is read under, from the strings of torch_npu/lib/libtorch_npu.so in the
# PyPI wheels (cp311 x86_64): 2.7.1, 2.7.1.post2 … post10, 2.8.0, 2.8.0.post2, 2.9.0, 2.10.0 and 2.10.0.post4 (the
# current NPU line's; it also rejects values outside 0 - 3: "HCCL_ASYNC_ERROR_HANDLING should be 0,1,2,3.") contain only
# HCCL_ASYNC_ERROR_HANDLING ("Enabling HCCL_ASYNC_ERROR_HANDLING."); 2.7.1.post11 reads
# TORCH_HCCL_ASYNC_ERROR_HANDLING and warns "HCCL_ASYNC_ERROR_HANDLING is deprecated, please use
# TORCH_HCCL_ASYNC_ERROR_HANDLING instead.". Builds outside these specs were not read: for them the rule only
# reports the two names disagreeing.
ASYNC_ERROR_OLD, ASYNC_ERROR_NEW = "HCCL_ASYNC_ERROR_HANDLING", "TORCH_HCCL_ASYNC_ERROR_HANDLING"
ASYNC_ERROR_NAMES = (
    (">=2.7.1,<2.7.1.post11", ASYNC_ERROR_OLD),
    ("==2.7.1.post11", ASYNC_ERROR_NEW),
    (">=2.8.0,<=2.8.0.post2", ASYNC_ERROR_OLD),
    ("==2.9.0", ASYNC_ERROR_OLD),
    ("==2.10.0", ASYNC_ERROR_OLD),
    ("==2.10.0.post4", ASYNC_ERROR_OLD),
)


def async_error_name(torch_npu: str | None) -> str | None:
    """The watchdog variable a torch_npu build reads, where its wheel was read (see ASYNC_ERROR_NAMES)."""
    if not torch_npu:
        return None
    return next((name for spec, name in ASYNC_ERROR_NAMES if matches(torch_npu, spec)), None)


def _async_error(env: Env, s: Situation) -> str | None:
    old, new = env.get(ASYNC_ERROR_OLD), env.get(ASYNC_ERROR_NEW)
    if old is not None and new is not None and old != new:
        return f"{ASYNC_ERROR_OLD}={old} and {ASYNC_ERROR_NEW}={new} disagree; which one wins depends on the build"
    reads = async_error_name(s.torch_npu)
    other = ASYNC_ERROR_NEW if reads == ASYNC_ERROR_OLD else ASYNC_ERROR_OLD
    if reads is None or env.get(reads) is not None or env.get(other) is None:
        return None
    if reads == ASYNC_ERROR_NEW:
        return f"{other}={env[other]} is deprecated in torch_npu {s.torch_npu}, which reads {reads}"
    return f"{other}={env[other]} is not read by torch_npu {s.torch_npu} (only {reads}): the setting has no effect"


def _async_error_fix(env: Env, s: Situation) -> str:
    reads = async_error_name(s.torch_npu)
    old, new = env.get(ASYNC_ERROR_OLD), env.get(ASYNC_ERROR_NEW)
    if old is not None and new is not None:
        return "give both the same value" + (f" (torch_npu {s.torch_npu} reads {reads})" if reads else "")
    return f"export {reads}={old if new is None else new}"


# torch_npu's caching allocator reads PYTORCH_NPU_ALLOC_CONF; no torch_npu wheel read (2.7.1 … 2.7.1.post11, 2.8.0,
# 2.8.0.post2, 2.9.0, 2.10.0: libtorch_npu.so and the Python sources) contains the string PYTORCH_ALLOC_CONF.
def _alloc_conf(env: Env, s: Situation) -> str | None:
    if "PYTORCH_ALLOC_CONF" not in env:
        return None
    npu = env.get("PYTORCH_NPU_ALLOC_CONF")
    counts = f"PYTORCH_NPU_ALLOC_CONF={npu} is what applies" if npu else "PYTORCH_NPU_ALLOC_CONF is unset"
    return f"PYTORCH_ALLOC_CONF={env['PYTORCH_ALLOC_CONF']} is ignored on NPU (torch_npu never reads it); {counts}"


def _nz(env: Env, s: Situation) -> str | None:
    value = env.get("VLLM_ASCEND_ENABLE_NZ")
    if value == "0":
        return None
    return f"VLLM_ASCEND_ENABLE_NZ={value or 'unset (=1)'}: NZ weight layout breaks weight sync into vLLM for RL"


ENV_RULES = (
    EnvRule(
        "TASK_QUEUE_ENABLE",
        "npu",
        _task_queue,
        "warn",
        lambda e, s: f"export TASK_QUEUE_ENABLE={'1' if s.graph_mode else '2'}",
        ("TASK_QUEUE_ENABLE",),
    ),
    EnvRule(
        "HCCL_CONNECT_TIMEOUT",
        "multi-node",
        lambda e, s: (
            None
            if _int(e, "HCCL_CONNECT_TIMEOUT", 120) >= 1800
            else f"HCCL_CONNECT_TIMEOUT={e.get('HCCL_CONNECT_TIMEOUT', 'unset (=120)')} s is short for multi-node "
            "start-up (EI0006 Getting socket times out)"
        ),
        "warn",
        lambda e, s: "export HCCL_CONNECT_TIMEOUT=1800 (range 120-7200)",
        ("HCCL_CONNECT_TIMEOUT",),
    ),
    EnvRule(
        "HCCL_OP_EXPANSION_MODE",
        "npu",
        _aiv,
        "warn",
        lambda e, s: (
            "unset HCCL_OP_EXPANSION_MODE for training (A2 default HOST); set AIV in the rollout "
            "runtime_env only, with HCCL_EXEC_TIMEOUT <= 1091"
        ),
        ("HCCL_OP_EXPANSION_MODE", "HCCL_EXEC_TIMEOUT"),
    ),
    EnvRule(
        "HCCL_SOCKET_IFNAME",
        "multi-node",
        _nic,
        "warn",
        lambda e, s: "export HCCL_SOCKET_IFNAME=<nic> (or HCCL_IF_IP=<ip>) and GLOO_SOCKET_IFNAME=<nic>",
        ("HCCL_SOCKET_IFNAME", "HCCL_IF_IP", "GLOO_SOCKET_IFNAME"),
    ),
    EnvRule(
        "VLLM_ASCEND_ENABLE_NZ",
        "vllm",
        _nz,
        "fail",
        lambda e, s: "export VLLM_ASCEND_ENABLE_NZ=0 (verl requires it for RL rollout)",
        ("VLLM_ASCEND_ENABLE_NZ",),
    ),
    EnvRule(
        "PYTORCH_ALLOC_CONF",
        "npu",
        _alloc_conf,
        "warn",
        lambda e, s: "put the allocator options in PYTORCH_NPU_ALLOC_CONF and unset PYTORCH_ALLOC_CONF",
        ("PYTORCH_NPU_ALLOC_CONF", "PYTORCH_ALLOC_CONF"),
    ),
    EnvRule(
        "HCCL_ASYNC_ERROR_HANDLING",
        "npu",
        _async_error,
        "warn",
        _async_error_fix,
        (ASYNC_ERROR_OLD, ASYNC_ERROR_NEW),
    ),
    EnvRule(
        "HCCL_INTRA_ROCE_ENABLE",
        "npu",
        lambda e, s: (
            f"HCCL_INTRA_ROCE_ENABLE={e['HCCL_INTRA_ROCE_ENABLE']} does not apply to the 800T A2 "
            "(only 200T A2 Box16 / 300T Pro)"
            if e.get("HCCL_INTRA_ROCE_ENABLE")
            else None
        ),
        "warn",
        lambda e, s: "unset HCCL_INTRA_ROCE_ENABLE",
        ("HCCL_INTRA_ROCE_ENABLE",),
    ),
)


def situation(ctx) -> Situation:
    cfg = ctx.config
    if cfg is None:
        return Situation(None, ctx.uses_vllm, graph_mode=False)
    graph = cfg.rollout.engine == "vllm" and cfg.rollout.enforce_eager is False
    return Situation(cfg.trainer.nnodes > 1, cfg.rollout.engine == "vllm", graph)


def _applies(rule: EnvRule, s: Situation) -> bool:
    return {"npu": True, "multi-node": bool(s.multi_node), "vllm": s.vllm}[rule.applies]


def env_checks(ctx) -> list[Check]:
    if ctx.platform != "npu":
        return []
    # situation() reads only the config (the env profiles' tests call it with nothing else); the version is ours
    env, s = ctx.env, replace(situation(ctx), torch_npu=ctx.versions.get("torch-npu"))
    checks = []
    for rule in ENV_RULES:
        if not _applies(rule, s):
            continue
        problem = rule.problem(env, s)
        if problem:
            checks.append(Check(f"env:{rule.name}", rule.status, problem, rule.fix(env, s)))
        else:
            shown = ", ".join(f"{v}={env[v]}" for v in rule.shows if v in env) or "unset (default)"
            checks.append(Check(f"env:{rule.name}", "ok", shown))
    return checks
