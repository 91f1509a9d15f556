"""Every pin of requirements-{npu,gpu,cpu}.txt has a wheel for every Python the project supports, on each file's
platforms (issue #25: blake3 1.0.11 has no cp310 wheels, so ``pip install -r requirements-npu.txt`` on Python 3.10
built it from source with Rust and failed on an Atlas node without a toolchain).

The pure logic runs on recorded index entries; the check of the real files asks PyPI (CI has it) through
scripts/check_wheels.py and skips, saying why, where PyPI cannot be reached.
"""

from __future__ import annotations

import re
import sys

import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))
import check_wheels as cw  # noqa: E402

REQUIREMENTS = ("requirements-npu.txt", "requirements-gpu.txt", "requirements-cpu.txt")


def dist(filename: str, requires_python: str | None = None, yanked: bool = False):
    return cw._dist({"filename": filename, "requires-python": requires_python, "yanked": yanked}, cw.PYPI)


@pytest.fixture(scope="module")
def indexes():
    """One cache of index pages for the module: each project is fetched once however many files pin it."""
    found = cw.Indexes()
    down = cw.pypi_reachable(found)
    if down:
        pytest.skip(f"PyPI is not reachable ({down}); the wheel check needs the index (CI has it)")
    return found


# ----------------------------------------------------------------------------------------------- offline logic


@pytest.mark.parametrize(
    ("filename", "python", "arch", "fits"),
    [
        ("blake3-1.0.11-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl", (3, 10), "x86_64", False),
        ("blake3-1.0.11-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl", (3, 11), "x86_64", True),
        ("blake3-1.0.10-cp310-cp310-manylinux_2_17_aarch64.manylinux2014_aarch64.whl", (3, 10), "x86_64", False),
        ("blake3-1.0.10-cp310-cp310-manylinux_2_17_aarch64.manylinux2014_aarch64.whl", (3, 10), "aarch64", True),
        ("blake3-1.0.10-cp310-cp310-musllinux_1_1_x86_64.whl", (3, 10), "x86_64", False),  # glibc hosts
        ("vllm-0.11.0-cp38-abi3-manylinux1_x86_64.whl", (3, 10), "x86_64", True),  # abi3: 3.8 and newer
        ("safetensors-0.8.0-cp311-abi3-manylinux2014_x86_64.whl", (3, 10), "x86_64", False),
        ("interegular-0.3.3-py37-none-any.whl", (3, 10), "aarch64", True),  # py37: 3.7 and newer
        ("mbridge-0.13.1-py3-none-any.whl", (3, 11), "aarch64", True),
        ("torch-2.7.1+cpu-cp310-cp310-linux_x86_64.whl", (3, 10), "x86_64", True),  # PyTorch's index spelling
    ],
)
def test_wheel_tags_are_judged_like_pip(filename, python, arch, fits):
    assert cw.wheel_fits(filename, python, arch) is fits


def test_a_release_without_a_wheel_for_the_python_is_missing():
    # PyPI's simple index for blake3 (requires-python as it lists it): 1.0.11 is cp311+ only, 1.0.10 has cp310
    old = [
        dist("blake3-1.0.11-cp311-cp311-manylinux_2_17_aarch64.manylinux2014_aarch64.whl", ">=3.11"),
        dist("blake3-1.0.11.tar.gz", ">=3.11"),
    ]
    new = [dist("blake3-1.0.10-cp310-cp310-manylinux_2_17_aarch64.manylinux2014_aarch64.whl", ">=3.9")]
    pin = cw.Pin("blake3", "==1.0.11", 1)
    status, why = cw.judge(pin, old, (3, 10), "aarch64")
    assert status == "missing" and "requires-python" in why
    assert cw.judge(pin, old, (3, 11), "aarch64")[0] == "ok"
    assert cw.judge(cw.Pin("blake3", "==1.0.10", 1), new, (3, 10), "aarch64")[0] == "ok"
    # an sdist alone is a build on the user's machine, not a wheel
    sdist_only = [dist("foo-1.0.tar.gz"), dist("foo-1.0-cp311-cp311-manylinux2014_x86_64.whl")]
    status, why = cw.judge(cw.Pin("foo", "==1.0", 1), sdist_only, (3, 10), "x86_64")
    assert status == "missing" and "sdist only" in why


def test_a_floor_is_judged_at_the_release_pip_picks():
    # pandas>=2.1 on 3.10: pandas 3 requires 3.11, so pip takes 2.3.3, which has the wheel
    dists = [
        dist("pandas-3.1.1-cp311-cp311-manylinux_2_28_x86_64.whl", ">=3.11"),
        dist("pandas-2.3.3-cp310-cp310-manylinux_2_28_x86_64.whl", ">=3.9"),
    ]
    status, wheel = cw.judge(cw.Pin("pandas", ">=2.1", 1), dists, (3, 10), "x86_64")
    assert status == "ok" and wheel.startswith("pandas-2.3.3-cp310")


def test_requirement_files_state_their_pythons_and_pyproject_agrees(tmp_path):
    pyproject = (REPO / "pyproject.toml").read_text()
    floor = re.search(r'^requires-python = ">=(\d+)\.(\d+)"', pyproject, re.M)
    assert floor and (int(floor[1]), int(floor[2])) == cw.PYTHONS[0]
    # check_mindspeed.sh installs pins of the NPU and GPU files on the Pythons it names: they must cover them
    stated = re.search(r"PYTHON \(default python3, ([0-9. or]+)\)", (REPO / "scripts/check_mindspeed.sh").read_text())
    named = tuple(tuple(int(n) for n in v.split(".")) for v in re.findall(r"\d+\.\d+", stated[1]))
    assert named == cw.PYTHONS
    for name in REQUIREMENTS:
        pins, _, pythons = cw.read_requirements(REPO / name)
        assert re.search(r"^# Python: ", (REPO / name).read_text(), re.M), f"{name} does not say its Pythons"
        assert pins and set(pythons) <= set(cw.PYTHONS), (name, pythons)
        if name != "requirements-cpu.txt":
            assert pythons == cw.PYTHONS, name
    # the header line is what narrows a file; without it every supported Python applies
    (tmp_path / "r.txt").write_text("# Python: 3.11 (why)\nfoo==1\n")
    assert cw.read_requirements(tmp_path / "r.txt")[2] == ((3, 11),)
    (tmp_path / "r.txt").write_text("foo==1  # a comment\n    # Python: 3.11 in a comment is no statement\n")
    assert cw.read_requirements(tmp_path / "r.txt")[2] == cw.PYTHONS


# ----------------------------------------------------------------------------------------------- PyPI


@pytest.mark.parametrize("name", REQUIREMENTS)
def test_every_pin_has_a_wheel_for_every_supported_python(indexes, name):
    results = cw.check_file(REPO / name, indexes)
    missing = [
        f"{r.pin.name}{r.pin.spec} cp{r.python[0]}{r.python[1]} {r.platform}: {r.detail}"
        for r in results
        if r.status == "missing"
    ]
    assert missing == []
    # "unchecked" only for a pin that an index we could not reach serves alone (torch==2.13.0+cpu, PyTorch's index)
    assert all(r.status != "unchecked" or indexes.unreachable for r in results)


def test_blake3_1_0_11_lacks_cp310_and_1_0_10_has_it(indexes, tmp_path):
    """The defect, on PyPI's real files: the old pin fails the check on both NPU platforms, the new one passes."""
    old = tmp_path / "requirements-npu.txt"
    old.write_text("# Python: 3.10, 3.11\nblake3==1.0.11\n")
    bad = {(r.python, r.platform) for r in cw.check_file(old, indexes) if r.status == "missing"}
    assert bad == {((3, 10), "x86_64"), ((3, 10), "aarch64")}
    old.write_text("# Python: 3.10, 3.11\nblake3==1.0.10\n")
    assert {r.status for r in cw.check_file(old, indexes)} == {"ok"}
