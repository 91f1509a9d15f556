"""The weight sync's memory order (issue #25): what is on the device while the train engine exports its weights
into a colocated rollout engine, and the state both are left in.

The rollout side is our VLLMRolloutEngine over a stand-in for ``vllm.LLM`` (a fake, and it says so): it emulates
only vLLM 0.11's sleep bookkeeping, read from the pinned code: ``executor_base.Executor.sleep`` returns with a
warning while any tag sleeps ("Executor is already sleeping"), ``wake_up(tags)`` wakes those tags and leaves the
executor asleep until no tag sleeps, and the allocator maps or unmaps a tag's memory on each (vllm-ascend's
``CaMemAllocator``: sleeping an already unmapped tag would unmap it twice). The train side is the real fsdp
engine, its offload driven by a lossless float32 (device) / float64 (host) round trip, as in
tests/unit/test_fsdp_engine.py, so where each tensor is can be read off its dtype.
"""

from __future__ import annotations

import torch

from gspo_ascend.engines.vllm_rollout import VLLMRolloutEngine
from gspo_ascend.workers import PolicyWorker
from tests.unit.test_fsdp_engine import model_path, parked_engine, rollout  # noqa: F401  (model_path: a fixture)

TAGS = {"weights", "kv_cache"}


class SleepModeLLM:
    """vLLM 0.11's sleep / wake bookkeeping (executor_base.py sleep / wake_up) and the tags it has mapped."""

    def __init__(self) -> None:
        self.sleeping, self.ignored, self.loaded = set(), [], []
        self.during_load: list[set[str]] = []

    @property
    def mapped(self) -> set[str]:
        return TAGS - self.sleeping

    def sleep(self, level: int = 1) -> None:
        if self.sleeping:  # "Executor is already sleeping."
            self.ignored.append("sleep")
            return
        self.sleeping = set(TAGS)

    def wake_up(self, tags: list[str] | None = None) -> None:
        if not self.sleeping or (tags and not set(tags) <= self.sleeping):  # "Executor is not sleeping" / "Tag..."
            self.ignored.append(f"wake_up({tags})")
            return
        self.sleeping -= set(tags or TAGS)

    def reset_prefix_cache(self) -> None:
        pass

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        if method == "gspo_load_weights":
            self.during_load.append(set(self.mapped))
        return [[]]  # gspo_finish_weight_update: no parameter missed


def rollout_side() -> VLLMRolloutEngine:
    engine = object.__new__(VLLMRolloutEngine)  # only the sleep / update paths: no vLLM behind it
    engine.llm, engine.dtype, engine.sleep_supported = SleepModeLLM(), torch.float32, True
    engine.external_launcher = False  # vLLM's own engine process (TP 1): the weights go as bytes
    engine.llm.sleep()
    engine._asleep = ["weights", "kv_cache"]  # as after a rollout
    return engine


def test_the_sync_has_only_the_weights_of_both_sides_on_the_device(model_path):  # noqa: F811
    train = parked_engine(model_path)
    seen = []
    export = train.export_weights

    def watched_export():
        for name, tensor in export():
            params = {p.dtype for p in train.model.parameters()}
            optimizer = {s["exp_avg"].dtype for s in train.optimizer.state.values()}
            seen.append((set(worker.rollout_engine.llm.mapped), (params, optimizer)))
            yield name, tensor

    worker = object.__new__(PolicyWorker)
    worker.rollout_engine, worker.train_engine = rollout_side(), train
    train.export_weights = watched_export
    train.update(rollout(model_path, 8, seed=63), 1.0)  # optimizer state exists (and is parked on the host)
    metrics = worker.sync_weights()
    assert metrics["sync/bytes"] > 0
    # while the train engine exported: the rollout's weights mapped, its KV cache not; the trainer's parameters up
    # (float32), its optimizer state still on the host (float64)
    assert seen and all(mapped == {"weights"} for mapped, _ in seen)
    assert all(where == ({torch.float32}, {torch.float64}) for _, where in seen)
    llm = worker.rollout_engine.llm
    assert llm.during_load and all(tags == {"weights"} for tags in llm.during_load)
    # after: the rollout engine wholly asleep (not left half awake by an ignored sleep), the trainer parked
    assert llm.sleeping == TAGS and llm.ignored == [] and worker.rollout_engine._asleep == ["weights", "kv_cache"]
    assert set(train.resident_bytes().values()) == {0}
