"""Install / doctor drift against the real NPU wheels (issue #14, items 6 and 7): one test per defect.

Expected values are the upstream facts, read from the released files and written out here by hand:
vllm_ascend-0.23.0-cp311-cp311-manylinux_2_34_x86_64.whl ``METADATA`` (the current line),
vllm-ascend's ``docs/source/community/versioning_policy.md`` (0.23.0.post1 sdist, lines 26-31),
vllm_ascend-0.11.0rc1 … 0.11.0 ``*.dist-info/METADATA`` (Requires-Dist, "CANN >= 8.3.rc1"; the previous line),
MindSpeed branch 2.2.0_core_r0.12.1 ``setup.py`` (``__version__ = '0.12.1'``), the strings of
``torch_npu/lib/libtorch_npu.so`` in the torch-npu 2.7.1 … 2.7.1.post11 wheels, and verl 0.9.0 / 0.9.1
``verl/trainer/ppo/core_algos.py``.
"""

from __future__ import annotations

import re

from packaging.specifiers import SpecifierSet

from gspo_ascend.algorithms import policy_loss
from gspo_ascend.doctor import matrix, packages
from gspo_ascend.doctor.ascend import cann_for_torch_npu
from gspo_ascend.doctor.envrules import env_checks
from tests.conftest import REPO
from tests.fixtures.doctor.fakehost import context

REQUIREMENTS_NPU = (REPO / "requirements-npu.txt").read_text()
INSTALL_NPU = (REPO / "docs/install-npu.md").read_text()

# Requires-Dist of vllm_ascend-0.23.0-cp311-cp311-manylinux_2_34_x86_64.whl (METADATA) that constrain our pins;
# it declares numpy without a bound. triton-ascend==3.2.2 is there too: not on PyPI, an `# @system` line.
VLLM_ASCEND_0_23_0_REQUIRES = {
    "torch": "==2.10.0",
    "torch-npu": "==2.10.0.post4",
    "torchvision": "==0.25.0",
    "torchaudio": "==2.10.0",
    "transformers": "==5.5.4",
}

# Requires-Dist of vllm_ascend-0.11.0-cp311-cp311-manylinux_2_24_{x86_64,aarch64}.whl (METADATA), the ones that
# constrained the previous line's pins.
VLLM_ASCEND_0_11_0_REQUIRES = {
    "torch": "==2.7.1",
    "torch-npu": "==2.7.1",
    "transformers": "<=4.57.1",
    "numpy": "<2.0.0",
}


def installable_pins(text: str) -> dict[str, str]:
    """name -> version of the `name==version` lines pip installs (comments and `# @source` notes excluded)."""
    pins = {}
    for line in text.splitlines():
        match = re.match(r"^([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?==(\S+)", line)
        if match:
            pins[match[1].lower().replace("_", "-")] = match[2]
    return pins


def env_finding(tmp_path, torch_npu: str, env: dict[str, str], rule: str):
    ctx = context(tmp_path, env=env, planned={"torch": "2.7.1", "torch_npu": torch_npu})
    (check,) = [c for c in env_checks(ctx) if c.name == f"env:{rule}"]
    return check


# 1. vllm-ascend 0.23.0 has prebuilt wheels on PyPI (0.23.0.post1 is a source distribution only): it is a pip
#    requirement, vLLM alone is built from source.
def test_vllm_ascend_is_pip_installed_and_vllm_built_from_source():
    assert installable_pins(REQUIREMENTS_NPU)["vllm-ascend"] == "0.23.0"
    assert not re.search(r"@source\s+vllm-ascend", REQUIREMENTS_NPU)
    assert re.search(r"@source\s+vllm==0\.23\.0\s.*VLLM_TARGET_DEVICE=empty", REQUIREMENTS_NPU)
    (row,) = [line for line in INSTALL_NPU.splitlines() if line.startswith("| vllm-ascend |")]
    assert "0.23.0" in row and "requirements-npu.txt" in row and "from source" not in row
    assert "vllm-ascend.git" not in INSTALL_NPU and "VLLM_TARGET_DEVICE=empty pip install -e vllm" in INSTALL_NPU


# 2. `pip install -r requirements-npu.txt` must satisfy what the vllm-ascend wheel declares (pip refuses verl's
#    transformers 5.10.4 next to 0.23.0, as it refused 4.57.6 next to 0.11.0); the doctor knows both, and neither
#    transformers is in the flash_attention_2 regression.
def test_requirements_npu_satisfy_the_vllm_ascend_wheel():
    from gspo_ascend.patches.npu_attention import fa2_needs_flash_attn_package  # imports torch: only here

    pins = installable_pins(REQUIREMENTS_NPU)
    for name, spec in VLLM_ASCEND_0_23_0_REQUIRES.items():
        assert name in pins and pins[name] in SpecifierSet(spec), (name, pins.get(name), spec)
    assert re.search(r"^#\s+@system triton-ascend==3\.2\.2\s", REQUIREMENTS_NPU, re.M)
    planned = {"vllm-ascend": "0.23.0", "torch": "2.10.0+cpu", "torch-npu": "2.10.0.post4", "triton-ascend": "3.2.2"}
    assert packages.check_requirements({**planned, "transformers": "5.5.4", "numpy": "2.3.5"}, "npu") == []
    (verl,) = packages.check_requirements({**planned, "transformers": "5.10.4"}, "npu")
    assert verl.name == "requires-transformers" and verl.status == "fail" and "==5.5.4" in verl.finding
    (no_triton,) = packages.check_requirements({**planned, "triton-ascend": "3.2.0", "transformers": "5.5.4"}, "npu")
    assert no_triton.name == "requires-triton-ascend" and no_triton.fix == "pip install 'triton-ascend==3.2.2'"
    # the previous line's pins meet the vllm-ascend 0.11.0 wheel's bounds, and doctor agrees
    previous = {"torch": "2.7.1", "torch-npu": "2.7.1", "transformers": "4.57.1", "numpy": "1.26.4"}
    for name, spec in VLLM_ASCEND_0_11_0_REQUIRES.items():
        assert previous[name] in SpecifierSet(spec), name
    assert packages.check_requirements({**previous, "vllm-ascend": "0.11.0"}, "npu") == []
    (conflict,) = packages.check_requirements(
        {"vllm-ascend": "0.11.0", "transformers": "4.57.6", "numpy": "1.26.4"}, "npu"
    )
    assert conflict.name == "requires-transformers" and conflict.status == "fail" and "<=4.57.1" in conflict.finding
    rc1 = {"vllm-ascend": "0.11.0rc1", "transformers": "4.57.6", "numpy": "1.26.4"}
    assert packages.check_requirements(rc1, "npu") == []
    for transformers in (pins["transformers"], "4.57.1"):
        assert packages.check_known_bad({"transformers": transformers}, "npu") == []
        assert not fa2_needs_flash_attn_package(transformers)


# 3. MindSpeed's branch 2.2.0_core_r0.12.1 installs as `mindspeed 0.12.1`: the doctor maps it to MindSpeed 2.2.0, so
#    its megatron-core and CANN checks run; it is accepted on the previous line.
def test_mindspeed_branch_version_is_mindspeed_2_2_0():
    seen = {"mindspeed": "0.12.1", "megatron-core": "0.12.1", "cann": "8.3.RC1"}
    (ok,) = packages.check_mindspeed(seen)
    assert ok.status == "ok" and ok.finding == "MindSpeed 2.2.0 (pip: 0.12.1) with megatron-core 0.12.1"
    (old_cann,) = packages.check_mindspeed({**seen, "cann": "8.2.RC1"})
    assert old_cann.status == "fail" and "needs CANN 8.3.RC1, found 8.2.RC1" in old_cann.finding
    (wrong_core,) = packages.check_mindspeed({**seen, "megatron-core": "0.13.0"})
    assert wrong_core.status == "fail" and "branch 2.2.0_core_r0.12.1" in wrong_core.fix
    _, previous = [s for s in matrix.STACKS if s.platform == "npu"]
    as_pip_lists_it = {**{p: spec.lstrip("=") for p, spec in previous.pins}, "mindspeed": "0.12.1"}
    (stack,) = packages.check_stack(as_pip_lists_it, "npu")
    assert stack.status == "ok" and stack.finding.startswith("matches the gspo-ascend Ascend stack, previous line (")


# 4. torch_npu post builds the CANN table does not list take the row of the nearest listed build of their base
#    below them (rows: 8.5.0 lists 2.7.1.post2, 9.0.0 starts at 2.7.1.post4, 9.1.0 at 2.7.1.post8; vllm-ascend's
#    versioning policy: 2.10.0 on 9.0.0, 2.10.0.post2 on 9.0.1, 2.10.0.post4 on 9.1.0).
def test_unlisted_torch_npu_post_builds_find_their_cann():
    assert cann_for_torch_npu("2.7.1.post6") == "9.0.0"
    assert cann_for_torch_npu("2.7.1.post11") == "9.1.0"
    assert cann_for_torch_npu("2.7.1.post4") == "9.0.0" and cann_for_torch_npu("2.7.1") == "8.3.RC1"
    assert cann_for_torch_npu("2.10.0") == "9.0.0" and cann_for_torch_npu("2.10.0.post2") == "9.0.1"
    assert cann_for_torch_npu("2.10.0.post4") == "9.1.0" and cann_for_torch_npu("2.10.0.post6") == "9.1.0"
    # no 2.11 build listed: unknown (the 9.1.0 range row spans it, but names no build)
    assert cann_for_torch_npu("2.11.0") is None
    assert cann_for_torch_npu("2.7.1.dev20250724") is None and cann_for_torch_npu("2.13.0") is None
    checks = packages.check_torch_npu_pair({"torch-npu": "2.7.1.post11", "torch": "2.7.1", "cann": "9.1.0"})
    assert [(c.name, c.status) for c in checks] == [("compat-cann", "ok")]
    (too_old,) = packages.check_torch_npu_pair({"torch-npu": "2.7.1.post6", "cann": "8.5.0"})
    assert too_old.status == "fail" and "built for CANN 9.0.0" in too_old.finding
    pinned = packages.check_torch_npu_pair({"torch-npu": "2.10.0.post4", "torch": "2.10.0+cpu", "cann": "9.1.0"})
    assert [(c.name, c.status) for c in pinned] == [("compat-cann", "ok")]
    (rc_cann,) = packages.check_torch_npu_pair({"torch-npu": "2.10.0.post4", "cann": "9.0.1"})
    assert rc_cann.status == "fail" and "built for CANN 9.1.0" in rc_cann.finding


# 5. vllm-ascend 0.11.0rc2 and rc3 exist on PyPI and pin torch-npu==2.7.1 with CANN >= 8.3.rc1, like rc1 and 0.11.0.
def test_vllm_ascend_0_11_0_release_candidates_are_in_the_table():
    for version in ("0.11.0rc1", "0.11.0rc2", "0.11.0rc3", "0.11.0"):
        seen = {"vllm-ascend": version, "vllm": "0.11.0", "cann": "8.3.RC1", "torch-npu": "2.7.1"}
        (check,) = packages.check_vllm_ascend(seen)
        assert check.status == "ok", (version, check.finding)
        (old,) = packages.check_vllm_ascend({**seen, "cann": "8.2.RC1"})
        assert old.status == "fail" and "needs CANN >= 8.3.RC1" in old.finding, version


# 5b. vllm-ascend 0.23.0rc1 pairs with CANN 9.0.1 / torch_npu 2.10.0.post2; 0.23.0 and 0.23.0.post1 with CANN 9.1.0 /
#     2.10.0.post4 (versioning policy, lines 26-28).
def test_vllm_ascend_0_23_releases_are_in_the_table():
    for version, cann, torch_npu in (
        ("0.23.0rc1", "9.0.1", "2.10.0.post2"),
        ("0.23.0", "9.1.0", "2.10.0.post4"),
        ("0.23.0.post1", "9.1.0", "2.10.0.post4"),
    ):
        seen = {"vllm-ascend": version, "vllm": "0.23.0", "cann": cann, "torch-npu": torch_npu}
        (check,) = packages.check_vllm_ascend(seen)
        assert check.status == "ok", (version, check.finding)
    (old_cann,) = packages.check_vllm_ascend({**seen, "vllm-ascend": "0.23.0", "cann": "9.0.1"})
    assert old_cann.status == "fail" and "needs CANN >= 9.1.0, found 9.0.1" in old_cann.finding
    (old_vllm,) = packages.check_vllm_ascend({**seen, "vllm": "0.11.0"})
    assert old_vllm.status == "fail" and "needs vllm 0.23.0, found 0.11.0" in old_vllm.finding


# 6. torch_npu 2.7.1 … post10 read HCCL_ASYNC_ERROR_HANDLING only; 2.7.1.post11 reads TORCH_HCCL_ASYNC_ERROR_HANDLING
#    and deprecates the old name.
def test_hccl_watchdog_variable_follows_the_installed_torch_npu(tmp_path):
    old, new = "HCCL_ASYNC_ERROR_HANDLING", "TORCH_HCCL_ASYNC_ERROR_HANDLING"
    ignored = env_finding(tmp_path, "2.7.1", {new: "0"}, old)
    assert ignored.status == "warn" and "not read by torch_npu 2.7.1" in ignored.finding
    assert ignored.fix == "export HCCL_ASYNC_ERROR_HANDLING=0"
    assert env_finding(tmp_path, "2.7.1.post10", {new: "0"}, old).status == "warn"
    # the current line's torch_npu 2.10.0.post4: its libtorch_npu.so has only the old name
    assert "not read by torch_npu 2.10.0.post4" in env_finding(tmp_path, "2.10.0.post4", {new: "0"}, old).finding
    deprecated = env_finding(tmp_path, "2.7.1.post11", {old: "0"}, old)
    assert deprecated.status == "warn" and "deprecated in torch_npu 2.7.1.post11" in deprecated.finding
    assert deprecated.fix == "export TORCH_HCCL_ASYNC_ERROR_HANDLING=0"
    assert env_finding(tmp_path, "2.7.1", {old: "0"}, old).status == "ok"
    assert env_finding(tmp_path, "2.7.1.post11", {new: "0"}, old).status == "ok"
    assert env_finding(tmp_path, "2.7.1.post11", {old: "0", new: "0"}, old).status == "ok"
    clash = env_finding(tmp_path, "2.7.1", {old: "0", new: "1"}, old)
    assert clash.status == "warn" and "disagree" in clash.finding and "reads HCCL_ASYNC_ERROR_HANDLING" in clash.fix


# 7. torch_npu never reads PYTORCH_ALLOC_CONF: setting it is a no-op on NPU (a warning), not a rejected combination.
def test_pytorch_alloc_conf_is_reported_as_ignored(tmp_path):
    alone = env_finding(tmp_path, "2.7.1", {"PYTORCH_ALLOC_CONF": "max_split_size_mb:2048"}, "PYTORCH_ALLOC_CONF")
    assert alone.status == "warn" and "ignored on NPU" in alone.finding
    assert "PYTORCH_NPU_ALLOC_CONF is unset" in alone.finding and "PYTORCH_NPU_ALLOC_CONF" in alone.fix
    both = {"PYTORCH_ALLOC_CONF": "x", "PYTORCH_NPU_ALLOC_CONF": "max_split_size_mb:2048"}
    paired = env_finding(tmp_path, "2.7.1", both, "PYTORCH_ALLOC_CONF")
    assert paired.status == "warn" and "PYTORCH_NPU_ALLOC_CONF=max_split_size_mb:2048 is what applies" in paired.finding
    assert "reject" not in paired.finding
    npu_only = {"PYTORCH_NPU_ALLOC_CONF": "max_split_size_mb:2048"}
    assert env_finding(tmp_path, "2.7.1", npu_only, "PYTORCH_ALLOC_CONF").status == "ok"


# 8. verl honours loss_agg_mode for GSPO from 0.9.1 (0.6.1 - 0.9.0 hard-code seq-mean-token-mean): every statement
#    that verl ignores the mode / always uses seq-mean-token-mean must be bounded to those releases.
def test_verl_aggregation_claims_name_the_releases():
    sources = {"docs/gspo.md": (REPO / "docs/gspo.md").read_text(), "policy_loss": policy_loss.__doc__}
    for name, text in sources.items():
        flat = " ".join(text.split())
        units = re.split(r"(?<=[.;|])\s", flat)  # sentences, clauses and table cells
        claims = [
            u
            for u in units
            if re.search(r"ignor|always|hard-code|whatever", u) and re.search(r"seq-mean-token-mean|\bmode\b", u)
        ]
        assert claims, name  # the comparison with verl is still made
        for claim in claims:
            assert "0.9.0" in claim, f"{name}: claim not bounded to verl <= 0.9.0: {claim}"
        assert re.search(r"0\.9\.1 honours|loss_agg_mode` since verl 0\.9\.1", flat), name


# vllm-ascend 0.11.0rc0 … 0.11.0 declare numpy<2.0.0 (every wheel's METADATA); numpy 2 beside it is a failure.
def test_vllm_ascend_needs_numpy_1():
    (numpy2,) = packages.check_requirements({"vllm-ascend": "0.11.0rc1", "numpy": "2.3.5"}, "npu")
    assert numpy2.status == "fail" and "numpy <2" in numpy2.finding
    assert (
        packages.check_requirements({"vllm-ascend": "0.11.0", "numpy": "1.26.4", "transformers": "4.57.1"}, "npu") == []
    )
