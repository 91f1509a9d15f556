"""A rollout engine sleeps only where a train engine needs its room (audit 3 finding 8, issue #41).

:class:`~gspo_ascend.workers.PolicyWorker` in-process with a test-only recording rollout engine (it stands in for
vLLM's sleep mode: it records ``wake_up`` / ``sleep`` / ``update_weights``; what they do to device memory is the
real engine's, tests/integration/test_vllm_sleep*). Expected by hand: colocated (a train engine beside it), every
rollout phase ends asleep; on a rollout pool (no train engine) the engine is never put to sleep (wake_up on an
awake engine is a no-op in the real one).
"""

from __future__ import annotations

from gspo_ascend.config import load_config, to_dict
from gspo_ascend.engines.base import Request, SamplingParams
from gspo_ascend.workers import PolicyWorker


class Recording:
    """Test-only rollout engine: records the calls."""

    def __init__(self):
        self.calls = []

    def wake_up(self):
        self.calls.append("wake_up")

    def sleep(self):
        self.calls.append("sleep")

    def generate(self, prompts, params):
        self.calls.append("generate")

    def generate_requests(self, requests, params):
        self.calls.append("generate_requests")


def worker(train: bool) -> tuple[PolicyWorker, Recording]:
    w = PolicyWorker(to_dict(load_config(None, [])), "unused", rank=0, world_size=1, threads=1)
    w.rollout_engine, w.train_engine = Recording(), (object() if train else None)
    return w, w.rollout_engine


def phases(w: PolicyWorker) -> None:
    params = SamplingParams(n=1, max_new_tokens=4)
    w.generate([[1, 2]], params)
    w.generate_requests([Request((1, 2), 1, 4, 0)], params)
    w.generate([[1, 2]], params)


def test_colocated_the_engine_sleeps_after_every_rollout_phase():
    w, engine = worker(train=True)
    phases(w)
    assert engine.calls == ["wake_up", "generate", "sleep", "wake_up", "generate_requests", "sleep"] + [
        "wake_up", "generate", "sleep"]  # fmt: skip


def test_on_a_rollout_pool_the_engine_never_sleeps():
    w, engine = worker(train=False)
    phases(w)
    assert "sleep" not in engine.calls and engine.calls.count("generate") == 2
