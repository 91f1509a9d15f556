"""``npu-profile``: which settings of the NPU performance profile (gspo_ascend/npu_profile.py SETTINGS) are in
effect in the environment doctor runs in, which are missing and why, and the profile's couplings with a config
(the same findings ``train`` refuses with)."""

from __future__ import annotations

from .. import npu_profile
from .check import Check

# the settings env/npu/mc2_env.yaml places, with the value that counts as in effect
_RUNTIME_ENV = tuple((s.name, s.value) for s in npu_profile.SETTINGS if s.where == "env/npu/mc2_env.yaml")
_OPT_IN = tuple(s.name for s in npu_profile.SETTINGS if s.where == "opt-in")
HELD_VLLM_ASCEND = "0.23.0"  # the release the opt-in switches are held to (conformance suite)


def _jemalloc(ctx) -> tuple[str | None, str | None]:
    """(in effect, missing): jemalloc preloaded, or why not."""
    preload = ctx.env.get("LD_PRELOAD", "")
    loaded = next((p for p in preload.split(":") if "libjemalloc" in p), None)
    if loaded:
        return f"jemalloc ({loaded})", None
    found = npu_profile.jemalloc_path(lambda p: ctx.path(p).is_file())
    if found:
        return None, f"jemalloc at {found} is not preloaded (source env/npu/atlas_800t_a2.sh)"
    return None, "jemalloc not found (apt install libjemalloc2 or yum install jemalloc)"


def _rollout(cfg) -> str:
    if cfg is None:
        return "rollout mode: unknown (pass --config)"
    r = cfg.rollout
    if r.engine != "vllm" or r.enforce_eager is not False:
        return "rollout: eager (opt-in ACL graphs: rollout.enforce_eager=false)"
    mode = r.cudagraph_mode or "vLLM's default mode"
    sizes = r.cudagraph_capture_sizes or "vLLM's default sizes"
    return f"rollout: ACL graphs ({mode}, capture sizes {sizes})"


def profile_checks(ctx) -> list[Check]:
    if ctx.platform != "npu":
        return []
    env = ctx.env
    on = [f"{name}={env[name]}" for name, value in _RUNTIME_ENV if env.get(name) == value]
    missing = [
        f"{name}={env.get(name, 'unset')} (profile: {value})" for name, value in _RUNTIME_ENV if env.get(name) != value
    ]
    loaded, lacking = _jemalloc(ctx)
    on += [loaded] if loaded else []
    missing += [lacking] if lacking else []
    opted = [f"{name}={env[name]}" for name in _OPT_IN if env.get(name, "0") not in ("", "0")]
    va = ctx.versions.get("vllm-ascend")
    if opted and va and va != HELD_VLLM_ASCEND:
        opted.append(f"(held to vllm-ascend {HELD_VLLM_ASCEND}; found {va})")
    parts = [f"in effect: {', '.join(on) or 'none'}", _rollout(ctx.config)]
    parts += [f"opt-in on: {' '.join(opted)}"] if opted else []
    checks = []
    if missing:
        found = "; ".join(parts) + f"; missing: {', '.join(missing)}"
        fix = "submit with env/npu/mc2_env.yaml and source env/npu/atlas_800t_a2.sh (docs/install-npu.md)"
        checks.append(Check("npu-profile", "warn", found, fix))
    else:
        checks.append(Check("npu-profile", "ok", "; ".join(parts)))
    if ctx.config is not None:
        for problem in npu_profile.environment_problems(ctx.config, "npu", env):
            checks.append(Check("npu-profile:coupling", "fail", problem, "fix what the line names"))
    return checks
