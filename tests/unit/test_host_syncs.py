"""No host sync inside the micro-batch loop (issue #43): on CUDA and NPU, every read of a device value by the host
(``.item()``, ``.tolist()``, ``bool()``, ``.cpu()``) and every blocking upload (``torch.tensor(..., device=)``,
``.to(device)`` from pageable memory) waits for all the kernels queued before it; one per micro-batch keeps the host
from queueing the next micro-batch while the device runs this one.

There is no device here, so the test follows data instead of timing it: a ``TorchFunctionMode`` marks as "device"
the model's parameters, what ``gspo_ascend.device.upload`` returns (the one sanctioned, non-blocking way onto the
device) and everything computed from either; it records each host read of a marked tensor and each upload that
bypasses ``upload``. Syncs that stay once per minibatch (the step's grad-norm check, the settled metrics) are
allowed; the count must not grow with the number of micro-batches. On main before this change it grew, per
micro-batch, by 11 in the update (inputs and index tensors built on the device from lists, the three per-sample
tensors moved with ``.to``, the loss normaliser made a device tensor, the metrics read back) and by 7 in the
old-log-prob pass (the same inputs, and each micro-batch's log-probs read back).

On a device, ``benchmarks/train_throughput.py`` counts the real synchronisations of one update instead (the runtime's
sync debug mode: ``host_syncs_per_update``). Blind spots: the model here is dense (the MoE routes' path is not
watched), and a read written ``.to("cpu")`` cannot be told from a same-device ``.to`` when the device is the CPU.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import traceback
import weakref

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from gspo_ascend.device import get_backend
from tests.unit.fsdp_worker import engine_config, make_batch, reference_log_probs, with_old_log_probs

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

OURS_NOT = ("/torch/", "cuda_redirect.py")  # a sync is charged to the caller of torch (and of the CUDA->CPU shim)
READS = {"tolist", "item", "cpu", "numpy", "nonzero", "__bool__", "__float__", "__int__", "__index__"}
FACTORIES = {"tensor", "as_tensor"}


class SyncWatch(TorchFunctionMode):
    """Marks device tensors (see the module docstring) and counts host syncs by (kind, file:line of our caller)."""

    def __init__(self) -> None:
        super().__init__()
        self.device: dict[int, weakref.ref] = {}  # by id: tensors compare elementwise, so no WeakSet
        self.events: collections.Counter = collections.Counter()
        self.paused = False

    def mark(self, tree) -> None:
        for leaf in pytree.tree_leaves(tree):
            if isinstance(leaf, torch.Tensor):
                self.device[id(leaf)] = weakref.ref(leaf)

    def _on_device(self, tree) -> bool:
        leaves = pytree.tree_leaves(tree)
        return any(
            isinstance(x, torch.Tensor) and (r := self.device.get(id(x))) is not None and r() is x for x in leaves
        )

    def _record(self, kind: str) -> None:
        ours = [f for f in traceback.extract_stack()[:-2] if not any(part in f.filename for part in OURS_NOT)]
        where = ours[-1]
        self.events[(kind, f"{where.filename.rsplit('/', 2)[-1]}:{where.lineno}")] += 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        on_device = self._on_device((args, kwargs))
        if self.paused:
            pass
        elif name in READS and on_device:
            self._record(f"read {name}")
        elif name in FACTORIES and kwargs.get("device") is not None:
            self._record(f"upload {name}(device=)")
        elif name == "to" and not on_device and not kwargs.get("non_blocking") and _names_a_device(args, kwargs):
            self._record("upload .to(device)")
        out = func(*args, **kwargs)
        if on_device:
            self.mark(out)
        return out


def _names_a_device(args, kwargs) -> bool:
    return any(isinstance(a, (torch.device, str)) for a in (*args[1:], kwargs.get("device")))


def _watched(monkeypatch, models, modules=()) -> SyncWatch:
    """A watch over ``models``' tensors, with ``upload`` in the engine modules that use it (and ``modules``)
    marking what it returns."""
    import gspo_ascend.engines.logprobs as logprobs
    import gspo_ascend.engines.routing as routing

    watch = SyncWatch()
    watch.mark([t for m in models for t in (*m.parameters(), *torch.nn.Module.buffers(m))])  # megatron DDP: .buffers
    for module in (logprobs, routing, *modules):
        real = getattr(module, "upload", None)  # main before #43 had none
        if real is None:
            continue

        def upload(tensor, device, real=real):
            watch.paused = True  # the sanctioned path's own copy is not a bypass
            try:
                out = real(tensor, device)
            finally:
                watch.paused = False
            out = out.clone() if out is tensor else out  # on the host upload returns the tensor; a device has a copy
            watch.mark(out)
            return out

        monkeypatch.setattr(module, "upload", upload)
    return watch


@pytest.fixture(scope="module")
def model_path() -> str:
    from gspo_ascend.tiny import ensure_tiny_model

    return str(ensure_tiny_model())


@pytest.fixture(scope="module")
def batch(model_path):
    from transformers import AutoModelForCausalLM

    batch = make_batch(8, 6, seed=5, min_response=2)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    with torch.no_grad():
        return with_old_log_probs(batch, reference_log_probs(model, batch, 1.0), 1e-4, 5)


def _events(monkeypatch, model_path, batch, budget: int, *extra: str):
    from gspo_ascend.engines.fsdp import FSDPEngine

    overrides = ["data.train_batch_size=8", "algorithm.minibatches_per_rollout=1", "actor.lr=1e-3", *extra]
    overrides.append(f"actor.max_tokens_per_micro_batch={budget}")
    engine = FSDPEngine(engine_config(*overrides), get_backend("cpu"), model_path)
    engine.update(batch, 1.0)  # first-call work (optimizer state, lazy inits) is not the loop's
    watch = _watched(monkeypatch, [engine.model])
    with watch:
        micros = len(engine._micro_batches(batch)[0])
        engine.compute_log_probs(batch, 1.0)
        engine.update(batch, 1.0)
    return micros, watch.events


@pytest.mark.parametrize(
    ("extra", "theirs"),
    [
        pytest.param((), (), id="packed"),
        # transformers' sdpa mask builder reads a padded batch's padding mask (``fast_all``) in every forward: the
        # padded layout's own cost, one more reason the packed one is the default (actor.use_remove_padding)
        pytest.param(("actor.use_remove_padding=false",), ("masking_utils.py",), id="padded"),
        pytest.param(("actor.fsdp_reshard_after_forward=off",), (), id="kept-gathered"),
    ],
)
def test_host_syncs_do_not_grow_with_micro_batches(monkeypatch, model_path, batch, extra, theirs):
    one_micro, few = _events(monkeypatch, model_path, batch, 10_000, *extra)
    many_micros, many = _events(monkeypatch, model_path, batch, 20, *extra)
    assert one_micro == 1 and many_micros >= 4  # the budget really splits the minibatch
    grown = {key: many[key] - few.get(key, 0) for key in many if many[key] > few.get(key, 0)}
    ours = {key: n for key, n in grown.items() if not key[1].startswith(theirs or ("\0",))}
    assert not ours, f"host syncs per micro-batch ({many_micros} micro-batches vs 1): {ours}"


def test_the_watch_sees_a_sync_in_the_loop(monkeypatch, model_path, batch):
    """The test above can fail: a host read of the loss per micro-batch is counted once per micro-batch."""
    from gspo_ascend.engines.fsdp import FSDPEngine

    inner = FSDPEngine._micro_loss

    def reading(self, *args, **kwargs):
        loss, metrics = inner(self, *args, **kwargs)
        float(loss)  # what a logging line in the loop would do
        return loss, metrics

    monkeypatch.setattr(FSDPEngine, "_micro_loss", reading)
    micros, events = _events(monkeypatch, model_path, batch, 20)
    ours = sum(n for (kind, where), n in events.items() if kind == "read __float__" and where.startswith("test_host"))
    assert ours == micros


# ----------------------------------------------------------------------------------------------- megatron

MEGATRON = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None or importlib.util.find_spec("mbridge") is None,
    reason="megatron-core / mbridge are not installed",
)


def megatron_events(micro_batch_size: int) -> tuple[int, dict]:
    """In the worker: the megatron engine on the tiny Qwen3-MoE with r2 routing replay (so the routers' targets,
    their agreement counts and the old forward's routes are all on the watched path), one old-log-prob pass and one
    update; (micro-batches, events)."""
    from gspo_ascend.config import load_config
    from gspo_ascend.engines import megatron_routing, megatron_train
    from gspo_ascend.engines.megatron import MegatronEngine
    from gspo_ascend.tiny import ensure_tiny_model

    overrides = ["actor.engine=megatron", "actor.routing_replay=r2", "data.train_batch_size=8", "actor.lr=1e-3"]
    overrides += ["algorithm.minibatches_per_rollout=1", f"actor.micro_batch_size={micro_batch_size}"]
    engine = MegatronEngine(load_config(None, overrides), get_backend("cpu"), str(ensure_tiny_model(moe=True)))
    batch = make_batch(8, 6, seed=5, min_response=2)
    engine.update(batch.replace(old_log_probs=engine.compute_log_probs(batch, 1.0)), 1.0)  # first-call work
    micros = len(engine._micros(batch))
    with pytest.MonkeyPatch.context() as monkeypatch:
        watch = _watched(monkeypatch, engine.models, (megatron_routing, megatron_train))
        with watch:
            old = engine.compute_log_probs(batch, 1.0)
            engine.update(batch.replace(old_log_probs=old), 1.0)
    engine.close()
    return micros, dict(watch.events)


# megatron-core's dropless MoE reads each layer's tokens per expert in every forward, its design and not ours: the
# split sizes of its unfused permutation (moe_utils.py ``sort_chunks_by_idxs``) and its experts' GEMMs
# (experts.py: SequentialMLP and TEGroupedMLP alike), 14 reads per micro-batch on the tiny MoE
MEGATRON_MOE = ("moe_utils.py:", "experts.py:")


@pytest.mark.slow
@MEGATRON
def test_megatron_host_syncs_do_not_grow_with_micro_batches(tmp_path):
    """The megatron engine in a worker process (it installs the CUDA->CPU shim, which this process must not get).
    On main before this test it grew per micro-batch by 3 in the old forward (the routers' positions read back,
    their targets uploaded with ``.to``, the routes kept read back) and 2 in the update, and the log-probs' read."""
    from tests.integration.launch import launch_ranks

    launch_ranks(1, [__file__, "--out", str(tmp_path)], "host_syncs", tmp_path, 300)
    found = json.loads((tmp_path / "events.json").read_text())
    (one_micro, few), (many_micros, many) = ((n, {tuple(k): v for k, v in e}) for n, e in found)
    assert one_micro == 1 and many_micros == 8
    grown = {key: many[key] - few.get(key, 0) for key in many if many[key] > few.get(key, 0)}
    ours = {key: n for key, n in grown.items() if not key[1].startswith(MEGATRON_MOE)}
    assert not ours, f"host syncs per micro-batch ({many_micros} micro-batches vs 1): {ours}"
    assert grown, "megatron-core's own MoE reads were not seen: the watch missed the experts"


if __name__ == "__main__":
    import argparse
    from pathlib import Path

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    out = parser.parse_args().out
    torch.set_num_threads(1)
    runs = [megatron_events(size) for size in (8, 1)]
    (out / "events.json").write_text(json.dumps([(n, [(list(k), v) for k, v in e.items()]) for n, e in runs]))
