"""The NPU performance profile's couplings (gspo_ascend/npu_profile.py, issue #26): one-line refusals with exit 2,
what vLLM is given, the jemalloc preload of the host profile, and doctor's ``npu-profile`` line."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from gspo_ascend import npu_profile
from gspo_ascend.config import load_config
from gspo_ascend.doctor.profile import profile_checks
from gspo_ascend.errors import ConfigError
from tests.conftest import REPO
from tests.fixtures.doctor.fakehost import SOURCED, context, make_sysroot, recorded

GRAPH = ["rollout.engine=vllm", "rollout.enforce_eager=false"]


def _load(*overrides: str):
    return load_config(overrides=list(overrides))


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (["rollout.cudagraph_mode=FULL_DECODE_ONLY"], "'rollout.cudagraph_mode' applies only to ACL / CUDA graph"),
        (["rollout.engine=vllm", "rollout.cudagraph_capture_sizes=[8]"], "'rollout.cudagraph_capture_sizes' applies"),
        # vllm-ascend 0.23.0 runs every mode but NONE on NPU (platform.py:593-640)
        (
            [*GRAPH, "trainer.device=npu", "rollout.cudagraph_mode=NONE"],
            "use one of PIECEWISE, FULL, FULL_DECODE_ONLY, FULL_AND_PIECEWISE (vllm-ascend 0.23.0 runs NONE eager)",
        ),
        ([*GRAPH, "rollout.cudagraph_mode=SOMETIMES"], "use one of NONE, PIECEWISE, FULL"),
        ([*GRAPH, "rollout.cudagraph_capture_sizes=[]"], "non-empty list of sizes > 0"),
        ([*GRAPH, "rollout.cudagraph_capture_sizes=[0, 8]"], "non-empty list of sizes > 0"),
        # 16 prompts x n 8 on one device: 128 sequences decode at once
        ([*GRAPH, "rollout.cudagraph_capture_sizes=[8, 129]"], "has 129 > 128"),
        # 4 devices, rollout TP 2: 2 engines of 64 sequences each
        (
            [
                *GRAPH,
                "trainer.devices_per_node=4",
                "rollout.tensor_parallel_size=2",
                "rollout.cudagraph_capture_sizes=[65]",
            ],
            "has 65 > 64",
        ),  # fmt: skip
    ],
)
def test_graph_keys_refused_in_one_line(overrides, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)) as info:
        _load(*overrides)
    assert "\n" not in str(info.value)


DISAGG = ["--config", "configs/qwen3_30b_a3b_gspo_disagg.yaml"]


def test_capture_sizes_are_checked_on_the_rollout_pools_engines_and_vllms_own_batch_limit():
    """Audit 3 finding 7: the disaggregated config's 2 engines (a pool of 2 nodes x 2 devices at TP 2) each decode
    128 x 8 / 2 = 512 sequences; the old check divided by the trainer's 12 devices (170) and refused 256. On a 64 GB
    NPU vLLM 0.23 decodes at most min(256, max_num_batched_tokens) at once (arg_utils.py), so 384 is refused."""
    from gspo_ascend.config import load_config as load

    base = [*GRAPH, "trainer.device=npu", "rollout.cudagraph_mode=FULL_DECODE_ONLY"]
    cfg = load(str(REPO / DISAGG[1]), [*base, "rollout.cudagraph_capture_sizes=[8,64,128,256]"])
    from gspo_ascend.config import rollout_world

    devices = rollout_world(cfg)  # the pool's 2 x 2
    assert devices == 4 and npu_profile.decode_batch(cfg, devices) == 512
    assert npu_profile.engine_seqs(cfg, devices)[0] == 256
    with pytest.raises(ConfigError, match=re.escape("has 384 > 256, vLLM's max_num_seqs on a 64 GB NPU")):
        load(str(REPO / DISAGG[1]), [*base, "rollout.cudagraph_capture_sizes=[8,384]"])


def test_graph_keys_accepted_and_passed_to_vllm():
    cfg = _load(*GRAPH, "trainer.device=npu", "rollout.cudagraph_mode=FULL_DECODE_ONLY",
                "rollout.cudagraph_capture_sizes=[64, 8, 128, 8]")  # fmt: skip
    assert npu_profile.compilation_config(cfg, eager=False) == {
        "cudagraph_mode": "FULL_DECODE_ONLY",
        "cudagraph_capture_sizes": [8, 64, 128],
    }
    assert npu_profile.compilation_config(cfg, eager=True) == {}
    assert npu_profile.compilation_config(_load(*GRAPH), eager=False) == {}  # vLLM's own defaults


def test_vllm_engine_hands_the_graph_keys_to_vllm(monkeypatch):
    """The engine's vllm.LLM(**kwargs) gets compilation_config from the keys (a stand-in LLM records the call)."""
    pytest.importorskip("vllm")
    import vllm

    from gspo_ascend.device import get_backend
    from gspo_ascend.engines import vllm_rollout

    seen = {}

    class Recorder:
        def __init__(self, **kwargs):
            seen.update(kwargs)

    monkeypatch.setattr(vllm, "LLM", Recorder)
    cfg = _load(*GRAPH, "rollout.cudagraph_mode=PIECEWISE", "rollout.cudagraph_capture_sizes=[4]")
    engine = vllm_rollout.VLLMRolloutEngine.__new__(vllm_rollout.VLLMRolloutEngine)
    engine.cfg, engine.backend, engine.host_build, engine.external_launcher = cfg, get_backend("cpu"), True, False
    engine.max_model_len, engine.route_dtype = 256, None  # a dense model: no routes asked for
    engine.sampling_seed = 0  # __init__'s (rollout.seed_requests)
    vllm_rollout.VLLMRolloutEngine._build_llm.__wrapped__(engine, "unused")
    assert seen["enforce_eager"] is False
    assert seen["compilation_config"] == {"cudagraph_mode": "PIECEWISE", "cudagraph_capture_sizes": [4]}


@pytest.mark.parametrize(
    ("overrides", "env", "fragment"),
    [
        (GRAPH, {"TASK_QUEUE_ENABLE": "2"}, "needs TASK_QUEUE_ENABLE=1; the environment has 2"),
        (["rollout.engine=vllm"], {"VLLM_ASCEND_ENABLE_FLASHCOMM1": "1"}, "needs rollout.tensor_parallel_size > 1"),
        # trainer.device=auto (the validator allowed NONE) that resolved to the NPU
        ([*GRAPH, "rollout.cudagraph_mode=NONE"], {"TASK_QUEUE_ENABLE": "1"}, "on NPU use one of PIECEWISE, FULL,"),
    ],
)
def test_environment_couplings_refused_at_train_start(overrides, env, fragment):
    cfg = _load(*overrides)
    with pytest.raises(ConfigError, match=re.escape(fragment)) as info:
        npu_profile.check_environment(cfg, "npu", env)
    assert "\n" not in str(info.value)
    npu_profile.check_environment(cfg, "cpu", env)  # only an NPU vLLM rollout has these couplings


def test_environment_couplings_hold_when_met():
    cfg = _load(*GRAPH)
    npu_profile.check_environment(cfg, "npu", {"TASK_QUEUE_ENABLE": "1"})
    for mode in ("PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"):  # all run on NPU (vllm-ascend 0.23.0)
        npu_profile.check_environment(
            _load(*GRAPH, f"rollout.cudagraph_mode={mode}"), "npu", {"TASK_QUEUE_ENABLE": "1"}
        )
        _load(*GRAPH, "trainer.device=npu", f"rollout.cudagraph_mode={mode}")  # the validator accepts it too
    # gone from vllm-ascend 0.23.0: setting them is no coupling of ours
    npu_profile.check_environment(_load("rollout.engine=vllm"), "npu", {"VLLM_ASCEND_ENABLE_PREFETCH_MLP": "1"})
    npu_profile.check_environment(cfg, "npu", {})  # unset: the engine sets 1 for graph mode itself
    npu_profile.check_environment(_load("rollout.engine=vllm"), "npu", {"TASK_QUEUE_ENABLE": "2"})  # eager


def test_train_refuses_graph_mode_with_task_queue_2_in_one_line(tmp_path):
    """The CLI path: exit 2, `error: <one line>`, no traceback, before anything starts."""
    code = (
        "import sys; from gspo_ascend.cli import main; "
        f"sys.exit(main(['train', 'rollout.engine=vllm', 'rollout.enforce_eager=false', 'trainer.device=npu', "
        f"'trainer.output_dir={tmp_path}/run']))"
    )
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "GSPO_DEVICE_SHIM": "1", "TASK_QUEUE_ENABLE": "2"}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "needs TASK_QUEUE_ENABLE=1" in lines[0] and "Traceback" not in proc.stderr


# ----------------------------------------------------------------------------------------------- host profile


def _sourced(tmp_path, **extra):
    from tests.unit.test_env_profiles import BASE, PROFILES, fake_ascend_root, parse_env, source

    proc = source(PROFILES["npu"], {**BASE, "ASCEND_ROOT": str(fake_ascend_root(tmp_path)), "NIC": "lo", **extra})
    assert proc.returncode == 0, proc.stderr.decode()
    return parse_env(proc.stdout), proc.stderr.decode()


def test_host_profile_searches_the_jemalloc_paths_the_doctor_knows():
    script = (REPO / "env/npu/atlas_800t_a2.sh").read_text()
    loop = re.search(r"for candidate in (.*?); do", script, re.S)[1].replace("\\\n", " ")
    assert tuple(loop.split()) == npu_profile.JEMALLOC_PATHS


def test_host_profile_preloads_jemalloc_once_and_can_be_told_not_to(tmp_path):
    lib = tmp_path / "libjemalloc.so.2"
    lib.write_bytes(b"")
    env, _ = _sourced(tmp_path, JEMALLOC=str(lib), LD_PRELOAD="/opt/other.so")
    assert env["LD_PRELOAD"] == f"{lib}:/opt/other.so"
    again, _ = _sourced(tmp_path, JEMALLOC=str(lib), LD_PRELOAD=f"{lib}")
    assert again["LD_PRELOAD"] == str(lib)  # sourcing twice adds it once
    none, _ = _sourced(tmp_path, JEMALLOC="")
    assert "LD_PRELOAD" not in none


def test_host_profile_notes_a_missing_jemalloc(tmp_path):
    if npu_profile.jemalloc_path():
        pytest.skip("this machine has jemalloc at one of the searched paths")
    env, err = _sourced(tmp_path)
    assert "LD_PRELOAD" not in env and "note: jemalloc not found" in err


# ----------------------------------------------------------------------------------------------- doctor


def _doctor(tmp_path, env, config=None, jemalloc=False):
    root = make_sysroot(tmp_path / "root")
    if jemalloc:
        lib = root / npu_profile.JEMALLOC_PATHS[1].lstrip("/")
        lib.parent.mkdir(parents=True, exist_ok=True)
        lib.write_bytes(b"")
    ctx = context(tmp_path, sysroot=root, env=env, runner=recorded("npu-smi-info-8x910B3.txt"), config=config)
    return {c.name: c for c in profile_checks(ctx)}


def test_doctor_reports_the_profile_in_effect_and_what_is_missing(tmp_path):
    profile = {"CPU_AFFINITY_CONF": "1", "LD_PRELOAD": "/usr/lib64/libjemalloc.so.2"}
    bare_env = {k: v for k, v in SOURCED.items() if k not in profile}
    graphs = _load(*GRAPH, "rollout.cudagraph_mode=FULL_DECODE_ONLY")
    ok = _doctor(tmp_path / "a", {**bare_env, **profile, "TASK_QUEUE_ENABLE": "1"}, config=graphs)
    assert set(ok) == {"npu-profile"} and ok["npu-profile"].status == "ok"
    assert ok["npu-profile"].finding == (
        "in effect: CPU_AFFINITY_CONF=1, jemalloc (/usr/lib64/libjemalloc.so.2); "
        "rollout: ACL graphs (FULL_DECODE_ONLY, capture sizes vLLM's default sizes)"
    )
    eager_queue = _doctor(tmp_path / "q", {**bare_env, **profile}, config=graphs)  # SOURCED has TASK_QUEUE_ENABLE=2
    assert eager_queue["npu-profile:coupling"].status == "fail"
    assert "needs TASK_QUEUE_ENABLE=1" in eager_queue["npu-profile:coupling"].finding
    bare = _doctor(tmp_path / "b", bare_env)["npu-profile"]
    assert bare.status == "warn" and "jemalloc not found" in bare.finding
    assert "CPU_AFFINITY_CONF=unset (profile: 1)" in bare.finding and "rollout mode: unknown" in bare.finding
    present = _doctor(tmp_path / "c", bare_env, jemalloc=True)["npu-profile"]
    assert f"jemalloc at {npu_profile.JEMALLOC_PATHS[1]} is not preloaded" in present.finding
    opted = _doctor(tmp_path / "d", {**bare_env, "VLLM_ASCEND_ENABLE_FLASHCOMM1": "1"})["npu-profile"]
    assert "opt-in on: VLLM_ASCEND_ENABLE_FLASHCOMM1=1" in opted.finding


def test_doctor_says_nothing_of_the_profile_off_npu(tmp_path):
    ctx = context(tmp_path, env={}, planned={"torch": "2.13.0"})
    assert profile_checks(ctx) == []


def test_install_guide_holds_the_profile_table():
    doc = (REPO / "docs/install-npu.md").read_text()
    assert npu_profile.render_table() in doc, "copy gspo_ascend.npu_profile.render_table() into docs/install-npu.md"


@pytest.mark.parametrize(
    ("conf", "ids", "npus", "cores", "want"),
    [
        # 192 cores, 8 NPUs: block 24 (torch_npu's default range of device 3 when all 8 are visible)
        ("1", ["3"], 8, 192, "1,npu0:72-95"),
        ("mode:1", ["0"], 8, 192, "1,npu0:0-23"),
        ("1", ["7"], 8, 190, "1,npu0:161-183"),  # 190 // 8 = 23: the last cores stay unbound, as in torch_npu
        ("1,npu0:0-3", ["3"], 8, 192, None),  # the user's own ranges
        ("2", ["3"], 8, 192, None),  # fine mode: torch_npu's per-thread map
        (None, ["3"], 8, 192, None),  # off
        ("1", ["2", "3"], 8, 192, None),  # an actor of several NPUs: torch_npu's own ranges apply
    ],
)
def test_each_actor_binds_to_its_npus_share_of_the_cores(conf, ids, npus, cores, want):
    assert npu_profile.actor_cpu_affinity(conf, ids, npus, cores) == want


def test_an_npu_actor_sets_its_range_before_torch_npu_starts(monkeypatch):
    """workers.bind_cpu_cores with Ray's runtime context standing in (test-only: the actor holds physical NPU 5 of a
    node of 8 with 64 cores): CPU_AFFINITY_CONF=1 becomes 1,npu0:40-47. On the old main it stayed 1."""
    import types

    import ray

    from gspo_ascend import workers

    ctx = types.SimpleNamespace(get_node_id=lambda: "n1", get_accelerator_ids=lambda: {"NPU": ["5"]})
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: ctx)
    monkeypatch.setattr(ray, "nodes", lambda: [{"NodeID": "n0", "Resources": {"NPU": 4.0}},
                                               {"NodeID": "n1", "Resources": {"NPU": 8.0}}])  # fmt: skip
    monkeypatch.setattr(workers.os, "sysconf", lambda name: 64)
    monkeypatch.setenv("CPU_AFFINITY_CONF", "1")
    workers.bind_cpu_cores()
    assert workers.os.environ["CPU_AFFINITY_CONF"] == "1,npu0:40-47"
