"""Doctor tells MindSpeed's held branches apart although pip shows both 0.12.1 branches as 0.12.1 (issue #26), and
recognises core_r0.16.0, the current line's branch, by its files too.

The expected branch of each case comes from the archive's own name (../shared/upstream/mindspeed-<branch>-<commit>),
not from the marker table under test; the installed layout is rebuilt from the archive's member list.
"""

from __future__ import annotations

import re
import sys
import tarfile

import pytest

from gspo_ascend.doctor import packages
from tests.conftest import REPO
from tests.fixtures.doctor.fakehost import SOURCED, SOURCED_CANN_91, context, make_sysroot, recorded

from .test_doctor_pins import INSTALLED, INSTALLED_PREVIOUS, site

UPSTREAM = REPO.parent / "shared" / "upstream"
ARCHIVES = sorted(UPSTREAM.glob("mindspeed-*core_r*-*.tar.gz"))


def branch_of(archive) -> tuple[str, str, str]:
    """(git branch, the release doctor names it by, the Megatron core it patches) from the archive's name:
    mindspeed-26.1.0_core_r0.12.1-57a3305 -> 26.1.0; mindspeed-core_r0.16.0-e477249 (no release prefix) -> 0.16.0."""
    branch = re.fullmatch(r"mindspeed-(.+)-[0-9a-f]+\.tar\.gz", archive.name)[1]
    prefix, core = re.fullmatch(r"(?:([0-9.]+)_)?core_r([0-9.]+)", branch).groups()
    return branch, prefix or core, core


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


@pytest.mark.skipif(len(ARCHIVES) < 3, reason="needs the three MindSpeed archives in ../shared/upstream")
@pytest.mark.parametrize("archive", ARCHIVES, ids=lambda p: p.name.rsplit("-", 1)[0])
def test_each_archive_is_recognised_as_its_own_branch(archive, tmp_path, monkeypatch):
    branch, release, core = branch_of(archive)
    package, declared = _installed_tree(archive, tmp_path)
    assert declared == core  # each setup.py declares the Megatron core it patches: 0.12.1 names no branch
    assert packages.mindspeed_branch(package)[0] == release
    assert packages.mindspeed_row(release).branch == branch
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
    assert unknown.status == "warn" and "none of the branches we test" in unknown.finding
    assert "core_r0.16.0 (current line)" in unknown.fix and "26.1.0_core_r0.12.1 (previous line)" in unknown.fix
    # 26.1.0's floor is CANN 8.3.RC1 (its release notes' compatibility table), not the 9.1.0 it was released with
    (old_cann,) = packages.check_mindspeed({**base, "cann": "8.2.RC1", "mindspeed-branch": "26.1.0"})
    assert old_cann.status == "fail" and "needs CANN 8.3.RC1" in old_cann.finding
    from gspo_ascend.doctor import matrix

    current, previous = [s for s in matrix.STACKS if s.platform == "npu"]
    pins = {p: s.lstrip("=") for p, s in previous.pins}
    for branch in ("26.1.0", "2.2.0"):  # the maintained and verl's former MindSpeed both match the previous line
        seen = {**pins, "mindspeed": "0.12.1", "mindspeed-branch": branch}
        (check,) = packages.check_stack(seen, "npu")
        assert check.status == "ok" and check.finding.startswith("matches the gspo-ascend Ascend stack, previous line")
    (other,) = packages.check_stack({**pins, "mindspeed": "2.3.0"}, "npu")
    assert other.status == "warn" and "mindspeed 2.3.0 (tested 26.1.0)" in other.finding
    # core_r0.16.0 as pip shows it (0.16.0) with its files: the current line
    new = {p: s.lstrip("=") for p, s in current.pins}
    (ok,) = packages.check_stack({**new, "mindspeed-branch": "0.16.0"}, "npu")
    assert (ok.status, ok.finding) == ("ok", "matches the gspo-ascend Ascend stack")
    evidence = "has mindspeed/core/transformer/experimental_attention_variant/dsa_module_spec.py"
    seen = {"mindspeed": "0.16.0", "megatron-core": "0.16.0", "cann": "9.1.0", "mindspeed-evidence": evidence}
    (found,) = packages.check_mindspeed({**seen, "mindspeed-branch": "0.16.0"})
    assert found.status == "ok"
    assert found.finding == f"MindSpeed 0.16.0 (branch core_r0.16.0: {evidence}; pip: 0.16.0) with megatron-core 0.16.0"
    (wrong_core,) = packages.check_mindspeed({**seen, "megatron-core": "0.12.1", "mindspeed-branch": "0.16.0"})
    assert (
        wrong_core.status == "fail"
        and wrong_core.fix == "pip install megatron-core==0.16.0 (MindSpeed branch core_r0.16.0)"
    )


@pytest.mark.skipif(not ARCHIVES, reason="needs a MindSpeed archive in ../shared/upstream")
@pytest.mark.parametrize("archive", ARCHIVES, ids=lambda p: p.name.rsplit("-", 1)[0])
def test_doctor_run_reports_the_installed_branch(archive, tmp_path, monkeypatch):
    branch, release, core = branch_of(archive)
    current = INSTALLED["megatron_core"] == core  # the line of that Megatron core: CANN 9.1.0, else 8.3.RC1
    stack = INSTALLED if current else INSTALLED_PREVIOUS
    root = site(tmp_path, {**stack, "numpy": "1.26.4", "mindspeed": core}, {})
    _installed_tree(archive, root)
    sysroot = make_sysroot(tmp_path / "root", **({"cann": "9.1.0", "layout": "cann-8.5"} if current else {}))
    env = SOURCED_CANN_91 if current else SOURCED
    ctx = context(tmp_path, sysroot=sysroot, env=env, runner=recorded("npu-smi-info-8x910B3.txt"))
    monkeypatch.setattr(sys, "path", [str(root)])
    checks = {c.name: c for c in packages.package_checks(ctx)}
    check = checks["compat-mindspeed"]
    assert check.status == "ok" and check.finding.startswith(f"MindSpeed {release} (branch {branch}: has ")
    assert f"mindspeed {core} (branch {branch})" in checks["packages"].finding
