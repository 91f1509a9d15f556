"""The compatibility matrix is data: docs/version-matrix.md is rendered from it, and the version ordering
it relies on handles wheel, CANN and driver version strings."""

from __future__ import annotations

import pytest

from gspo_ascend.doctor import matrix
from gspo_ascend.doctor.ascend import cann_for_torch_npu
from gspo_ascend.doctor.versions import compare, key, matches, normalize_name, release
from tests.conftest import REPO


def test_docs_version_matrix_matches_the_data():
    doc = (REPO / "docs/version-matrix.md").read_text()
    assert doc == matrix.render_markdown(), "regenerate: python -m gspo_ascend.doctor.matrix > docs/version-matrix.md"


def test_matrix_holds_the_npu_stack_and_its_previous_line():
    # current: verl's vLLM route (CANN 9.1.0, torch_npu 2.10.0.post4, vllm-ascend 0.23.0, MindSpeed core_r0.16.0)
    # with the vllm-ascend 0.23.0 wheel's transformers==5.5.4; previous: the 0.11 line, kept for compatibility
    current, previous = [s for s in matrix.STACKS if s.platform == "npu"]
    pins = dict(current.pins)
    assert pins["cann"] == "==9.1.0" and pins["torch-npu"] == "==2.10.0.post4" and pins["vllm-ascend"] == "==0.23.0"
    assert pins["torch"] == "==2.10.0" and pins["triton-ascend"] == "==3.2.2" and pins["vllm"] == "==0.23.0"
    assert pins["transformers"] == "==5.5.4" and pins["mindspeed"] == "==0.16.0" and pins["megatron-core"] == "==0.16.0"
    assert not current.previous and not current.field
    old = dict(previous.pins)
    assert old["cann"] == "==8.3.RC1" and old["torch-npu"] == "==2.7.1" and old["vllm-ascend"] == "==0.11.0"
    assert old["transformers"] == "==4.57.1" and old["mindspeed"] == "==26.1.0" and old["megatron-core"] == "==0.12.1"
    assert previous.field[0][:2] == ("mindspeed", "==2.2.0")
    assert "supported for compatibility" in previous.previous and "2026-12-30" in previous.previous
    assert cann_for_torch_npu("2.7.1") == "8.3.RC1" and cann_for_torch_npu("2.8.0.post2") == "8.5.0"
    # vllm-ascend's versioning policy: v0.20 - v0.22 on 9.0.0 / 2.10.0, v0.23.0rc1 on 9.0.1 / 2.10.0.post2,
    # v0.23.0 and v0.23.0.post1 on 9.1.0 / 2.10.0.post4
    assert cann_for_torch_npu("2.10.0") == "9.0.0" and cann_for_torch_npu("2.10.0.post2") == "9.0.1"
    assert cann_for_torch_npu("2.10.0.post4") == "9.1.0"
    assert {b.package: b.versions for b in matrix.KNOWN_BAD}["transformers"] == ("4.53.0", "4.55.3")
    # PyPI's torch 2.10.0 and 2.11.0 wheels: cp310 - cp314
    assert matrix.TORCH_PYTHON["2.10"] == matrix.TORCH_PYTHON["2.11"] == ("3.10", "3.14")


def test_every_mindspeed_row_names_its_branch():
    branches = {r.mindspeed: r.branch for r in matrix.MINDSPEED if r.megatron_core}
    assert branches == {
        "2.2.0": "2.2.0_core_r0.12.1",
        "26.1.0": "26.1.0_core_r0.12.1",
        "0.16.0": "core_r0.16.0",
    }


@pytest.mark.parametrize(
    "older, newer",
    [
        ("8.3.RC1", "8.3.RC2"),
        ("8.3.RC2", "8.3.0"),
        ("8.2.RC1", "8.3.RC1"),
        ("8.3.RC1", "8.5.0"),
        ("2.7.1", "2.7.1.post2"),
        ("2.7.1.dev20250724", "2.7.1"),
        ("0.11.0rc0", "0.11.0rc1"),
        ("0.11.0rc1", "0.11.0"),
        ("24.1.rc1.b030", "24.1.0"),
        ("4.9.0", "4.57.6"),
    ],
)
def test_version_order(older, newer):
    assert compare(older, newer) == -1 and compare(newer, older) == 1


def test_version_order_agrees_with_packaging_on_the_wheel_versions():
    # every torch_npu / vllm-ascend version the matrix names is a PEP 440 version: our parser (which must also read
    # CANN and driver strings packaging rejects) orders them as packaging does
    from packaging.version import Version

    names = {v for row in matrix.CANN_TORCH_NPU for v in row.torch_npu}
    names |= {v for row in matrix.VLLM_ASCEND for v in (*row.vllm_ascend, row.torch_npu)}
    names |= {"2.7.1.post6", "2.7.1.post11", "0.11.0rc2", "0.11.0rc3", "2.10.0.post6", "0.23.0rc2"}
    assert sorted(names, key=Version) == sorted(names, key=key)
    assert len(names) > 20


def test_version_specs():
    assert matches("2.13.0+cpu", "==2.13.0") and not matches("2.13.0+cpu", "==2.13.0+cu126")
    assert matches("4.57.6", "==4.57.*") and not matches("4.58.0", "==4.57.*")
    assert matches("5.19.0", ">=5.16,<5.20") and not matches("5.20.0", ">=5.16,<5.20")
    assert matches("anything", "*") and release("2.7.1.post2") == (2, 7, 1) and release("8.3.RC1") == (8, 3, 0)
    assert normalize_name("Torch_NPU") == "torch-npu" and normalize_name("megatron.core") == "megatron-core"
