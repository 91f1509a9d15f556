"""Doctor on an installed NPU stack whose numpy MindSpeed moved (issue #25, audit finding 7).

``pip install -e MindSpeed`` with dependencies applies MindSpeed's requirements.txt (its setup.py declares it as
install_requires), whose ``numpy<=1.26.0`` turns the pinned numpy 1.26.4 into 1.26.0. Doctor reads installed
versions and MindSpeed's declared requirements through importlib.metadata; here both come from a temporary
directory of ``.dist-info`` folders put in place of sys.path, so nothing of this machine's environment is seen.
"""

from __future__ import annotations

import re
import sys

from gspo_ascend.doctor import packages
from tests.conftest import REPO
from tests.fixtures.doctor.fakehost import SOURCED_CANN_91, context, make_sysroot, recorded

# Requires-Dist of MindSpeed branch core_r0.16.0 (setup.py: install_requires = requirements.txt, read from the
# archive ../shared/upstream/mindspeed-core_r0.16.0-e477249.tar.gz); pip lists the branch as 0.16.0. Branch
# 2.2.0_core_r0.12.1's requirements.txt is the same without pydantic.
MINDSPEED_REQUIRES = (
    "pybind11 ninja wheel numpy<=1.26.0 six regex decorator attrs psutil pyyaml protobuf einops scipy sentencepiece "
    "pytest pytest-mock transformers>=4.43.2 gpytorch pandas scikit-learn SQLAlchemy pydantic"
).split()

# requirements-npu.txt as installed (the x86_64 torch is PyTorch's CPU build), except numpy and MindSpeed
INSTALLED = {
    "torch": "2.10.0+cpu",
    "torch_npu": "2.10.0.post4",
    "triton_ascend": "3.2.2",
    "vllm": "0.23.0",
    "vllm_ascend": "0.23.0",
    "megatron_core": "0.16.0",
    "transformers": "5.5.4",
    "mbridge": "0.15.1",
    "einops": "0.8.1",
    "ray": "2.60.0",
}

# the previous line's requirements-npu.txt as installed, except numpy and MindSpeed (branches 26.1.0 / 2.2.0 show as
# 0.12.1)
INSTALLED_PREVIOUS = {
    "torch": "2.7.1+cpu",
    "torch_npu": "2.7.1",
    "vllm": "0.11.0",
    "vllm_ascend": "0.11.0",
    "megatron_core": "0.12.1",
    "transformers": "4.57.1",
    "mbridge": "0.13.1",
    "einops": "0.8.1",
    "ray": "2.60.0",
}


def site(tmp_path, versions: dict[str, str], requires: dict[str, list[str]]):
    """A site-packages of bare .dist-info folders: what importlib.metadata reads of an installed distribution."""
    root = tmp_path / "site-packages"
    for name, version in versions.items():
        info = root / f"{name}-{version}.dist-info"
        info.mkdir(parents=True)
        lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
        lines += [f"Requires-Dist: {r}" for r in requires.get(name, [])]
        (info / "METADATA").write_text("\n".join(lines) + "\n")
    return root


def stack_check(tmp_path, monkeypatch, numpy: str, mindspeed: bool = True):
    versions = {**INSTALLED, "numpy": numpy, **({"mindspeed": "0.16.0"} if mindspeed else {})}
    root = site(tmp_path, versions, {"mindspeed": MINDSPEED_REQUIRES})
    ctx = context(
        tmp_path,
        sysroot=make_sysroot(tmp_path / "root", cann="9.1.0", layout="cann-8.5"),
        env=SOURCED_CANN_91,
        runner=recorded("npu-smi-info-8x910B3.txt"),
    )
    monkeypatch.setattr(sys, "path", [str(root)])  # importlib.metadata searches sys.path: only the fake site
    assert ctx.platform == "npu" and ctx.versions["numpy"] == numpy
    (check,) = [c for c in packages.package_checks(ctx) if c.name == "stack"]
    return check


def test_numpy_moved_by_mindspeed_names_the_cause_and_the_fix(tmp_path, monkeypatch):
    check = stack_check(tmp_path, monkeypatch, "1.26.0")
    assert check.status == "warn" and "\n" not in check.finding
    assert check.finding == (
        "differs from the gspo-ascend Ascend stack: numpy 1.26.0 (tested 1.26.4; mindspeed 0.16.0 declares "
        "numpy<=1.26.0, which pip applies when mindspeed is installed with its dependencies)"
    )
    assert check.fix.startswith("pip install numpy==1.26.4; install mindspeed with pip install --no-deps")


def test_the_pinned_numpy_matches(tmp_path, monkeypatch):
    check = stack_check(tmp_path, monkeypatch, "1.26.4")
    assert (check.status, check.finding) == ("ok", "matches the gspo-ascend Ascend stack")


def test_a_numpy_mindspeed_does_not_explain_has_no_cause(tmp_path, monkeypatch):
    # 1.26.3 is outside MindSpeed's numpy<=1.26.0: MindSpeed did not put it there, so no cause is named
    check = stack_check(tmp_path, monkeypatch, "1.26.3")
    assert "numpy 1.26.3 (tested 1.26.4)" in check.finding and "declares" not in check.finding
    assert check.fix.startswith("pin the tested versions (requirements-npu.txt")


def test_without_mindspeed_installed_no_cause_is_invented(tmp_path, monkeypatch):
    check = stack_check(tmp_path, monkeypatch, "1.26.0", mindspeed=False)
    assert "numpy 1.26.0 (tested 1.26.4)" in check.finding and "declares" not in check.finding


def test_requires_dist_lines_are_read_like_pip_writes_them():
    assert packages._requirement("numpy<=1.26.0") == ("numpy", "<=1.26.0")
    assert packages._requirement("numpy (<=1.26.0)") == ("numpy", "<=1.26.0")  # old metadata spelling
    assert packages._requirement("Torch_NPU==2.10.0.post4; python_version >= '3.9'") == ("torch-npu", "==2.10.0.post4")
    assert packages._requirement("pytest-mock") is None  # no version: nothing to explain
    assert packages._requirement("numpy<2; extra == 'test'") is None  # an extra is not installed by default
    assert packages._requirement("numpy~=1.26") is None  # an operator versions.matches does not read


def test_the_docs_install_mindspeed_without_its_requirements_and_pin_what_it_needs():
    """MindSpeed goes in with --no-deps (else numpy<=1.26.0 and the rest of its requirements.txt); what it imports at
    run time that nothing else of the NPU stack brings is pinned in requirements-npu.txt."""
    install = (REPO / "docs/install-npu.md").read_text()
    assert "pip install --no-deps -e MindSpeed" in install
    assert not re.search(r"pip install -e MindSpeed", install)
    pins = re.findall(r"^([A-Za-z0-9_.\-]+)==(\S+)", (REPO / "requirements-npu.txt").read_text(), re.M)
    assert {"psutil", "ninja", "numpy"} <= {name for name, _ in pins}
    assert ("numpy", "1.26.4") in pins and "numpy<=1.26.0" in MINDSPEED_REQUIRES
