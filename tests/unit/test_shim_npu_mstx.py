"""The CPU shim's torch_npu.npu.mstx (gspo_ascend/device/shim/npu_mstx.py), held to torch-npu 2.10.0.post4's
torch_npu/npu/mstx.py: MindSpeed core_r0.16.0 patches torch.cuda.nvtx.range_push / range_pop with its
range_start / range_end. Expected values are the real module's: its checks' fallback values, and its
decorator that turns any exception into a logged failure."""

from __future__ import annotations

import logging

import pytest

from gspo_ascend.device import shim


@pytest.fixture
def mstx():
    shim.install()
    try:
        import torch_npu

        yield torch_npu.npu.mstx
    finally:
        shim.uninstall()


def test_it_is_torch_npus_class_of_markers(mstx):
    import torch

    assert isinstance(mstx, type) and torch.npu.mstx is mstx
    for name in ("mark", "range_push", "range_pop", "range_start", "range_end", "mstx_range"):
        assert callable(getattr(mstx, name)), name


def test_ranges_get_ids_and_bad_arguments_get_the_real_fallbacks(mstx):
    first, second = mstx.range_start("fwd"), mstx.range_start("bwd", domain="train")
    assert first > 0 and second > first and mstx.range_end(first) is None
    with pytest.warns(UserWarning):
        assert mstx.range_start("") == 0  # the real one: "Invalid message ...", 0
    with pytest.warns(UserWarning):
        assert mstx.range_push("x", domain="") == -1
    pushed = mstx.range_push("step")
    assert mstx.range_pop() == pushed and mstx.range_pop() == -1  # nothing left open in the default domain


def test_a_marker_never_raises_into_the_caller(mstx, caplog):
    """MindSpeed maps torch.cuda.nvtx.range_pop() (no argument) to range_end(range_id): the real decorator catches
    the TypeError and logs it; the caller goes on."""
    with caplog.at_level(logging.ERROR):
        assert mstx.range_end() is None
    assert "Call range_end failed" in caplog.text


def test_mstx_range_wraps_a_function(mstx):
    @mstx.mstx_range("work")
    def work(x):
        return x + 1

    assert work(1) == 2


def test_a_stream_must_be_torch_npus(mstx):
    import torch

    assert mstx.range_start("on a stream", stream=torch.npu.current_stream()) > 0
    with pytest.warns(UserWarning):
        assert mstx.range_start("on a string", stream="not a stream") == 0
