"""Doctor tells MindSpeed's two held branches apart although pip shows both as 0.12.1 (issue #26).

The expected branch of each case comes from the archive's own name (../shared/upstream/mindspeed-<branch>_core_*),
not from the marker table under test; the installed layout is rebuilt from the archive's member list.
"""

from __future__ import annotations

import re
import sys
import tarfile

import pytest

from gspo_ascend.doctor import packages
from tests.conftest import REPO
from tests.fixtures.doctor.fakehost import SOURCED, context, make_sysroot, recorded

from .test_doctor_pins import INSTALLED, site

UPSTREAM = REPO.parent / "shared" / "upstream"
ARCHIVES = sorted(UPSTREAM.glob("mindspeed-*_core_r0.12.1-*.tar.gz"))


def _installed_tree(archive, dest):
    """The archive's mindspeed/ package as pip would install it: every member's path, files empty."""
    with tarfile.open(archive) as tar:
        names = tar.getnames()
        setup = next(m for m in tar.getmembers() if re.fullmatch(r"[^/]+/setup\.py", m.name))
        declared = re.search(r"__version__ = '([^']+)'", tar.extractfile(setup).read().decode())[1]
    package = dest / "mindspeed"
    for name in names:
        rel = name.split("/", 1)[1] if "/" in name else ""
        if rel.startswith("mindspeed/") and rel.endswith(".py"):
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            (dest / rel).touch()
    return package, declared


@pytest.mark.skipif(len(ARCHIVES) < 2, reason="needs both MindSpeed archives in ../shared/upstream")
@pytest.mark.parametrize("archive", ARCHIVES, ids=lambda p: p.name.split("_core")[0])
def test_each_archive_is_recognised_as_its_own_branch(archive, tmp_path, monkeypatch):
    branch = re.match(r"mindspeed-([0-9.]+)_core_", archive.name)[1]
    package, declared = _installed_tree(archive, tmp_path)
    assert declared == "0.12.1"  # why version numbers cannot tell them apart
    assert packages.mindspeed_branch(package)[0] == branch
    monkeypatch.syspath_prepend(str(tmp_path))  # found without importing it (find_spec of the package)
    assert packages.mindspeed_package_dir() == package


def test_placeholder_and_unknown_sources(tmp_path, monkeypatch):
    placeholder = tmp_path / "placeholder" / "mindspeed"
    placeholder.mkdir(parents=True)
    (placeholder / "__init__.py").touch()  # PyPI's `mindspeed`: no megatron_adaptor.py
    monkeypatch.syspath_prepend(str(placeholder.parent))
    assert packages.mindspeed_package_dir() is None and packages.mindspeed_branch(None) is None
    other = tmp_path / "master" / "mindspeed"
    other.mkdir(parents=True)
    (other / "megatron_adaptor.py").touch()
    assert packages.mindspeed_branch(other)[0] == packages.UNKNOWN_BRANCH


def test_compat_and_stack_say_which_branch_was_found():
    base = {"mindspeed": "0.12.1", "megatron-core": "0.12.1", "cann": "8.3.RC1"}
    evidence = "has mindspeed/core/dist_checkpointing/checkpoint_adaptor.py"
    (new,) = packages.check_mindspeed({**base, "mindspeed-branch": "26.1.0", "mindspeed-evidence": evidence})
    assert new.status == "ok"
    assert (
        new.finding
        == f"MindSpeed 26.1.0 (branch 26.1.0_core_r0.12.1: {evidence}; pip: 0.12.1) with megatron-core 0.12.1"
    )
    (old,) = packages.check_mindspeed({**base, "mindspeed-branch": "2.2.0", "mindspeed-evidence": "x"})
    assert old.status == "ok" and old.finding.startswith("MindSpeed 2.2.0 (branch 2.2.0_core_r0.12.1")
    (unknown,) = packages.check_mindspeed({**base, "mindspeed-branch": "unknown", "mindspeed-evidence": "none"})
    assert unknown.status == "warn" and "neither branch we test" in unknown.finding
    # 26.1.0's floor is CANN 8.3.RC1 (its release notes' compatibility table), not the 9.1.0 it was released with
    (old_cann,) = packages.check_mindspeed({**base, "cann": "8.2.RC1", "mindspeed-branch": "26.1.0"})
    assert old_cann.status == "fail" and "needs CANN 8.3.RC1" in old_cann.finding
    from gspo_ascend.doctor import matrix

    (npu,) = [s for s in matrix.STACKS if s.platform == "npu"]
    pins = {p: s.lstrip("=") for p, s in npu.pins}
    for branch in ("26.1.0", "2.2.0"):  # the maintained and the field MindSpeed both match the tested stack
        seen = {**pins, "mindspeed": "0.12.1", "mindspeed-branch": branch}
        assert [c.status for c in packages.check_stack(seen, "npu")] == ["ok"], branch
    (other,) = packages.check_stack({**pins, "mindspeed": "2.3.0"}, "npu")
    assert other.status == "warn" and "mindspeed 2.3.0 (tested 26.1.0)" in other.finding


@pytest.mark.skipif(not ARCHIVES, reason="needs a MindSpeed archive in ../shared/upstream")
def test_doctor_run_reports_the_installed_branch(tmp_path, monkeypatch):
    archive = ARCHIVES[-1]
    branch = re.match(r"mindspeed-([0-9.]+)_core_", archive.name)[1]
    root = site(tmp_path, {**INSTALLED, "numpy": "1.26.4", "mindspeed": "0.12.1"}, {})
    _installed_tree(archive, root)
    ctx = context(
        tmp_path, sysroot=make_sysroot(tmp_path / "root"), env=SOURCED, runner=recorded("npu-smi-info-8x910B3.txt")
    )
    monkeypatch.setattr(sys, "path", [str(root)])
    checks = {c.name: c for c in packages.package_checks(ctx)}
    check = checks["compat-mindspeed"]
    assert check.status == "ok" and check.finding.startswith(f"MindSpeed {branch} (branch {branch}_core_r0.12.1: has ")
    assert f"mindspeed 0.12.1 (branch {branch})" in checks["packages"].finding
