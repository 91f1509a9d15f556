"""rollout.seed_requests (issue #41, audit 3 finding 6): per-request seeds where a sample must not depend on its
batch, one batched draw where it need not, and vLLM's own sampling stream for the unseeded case in-process.

The real vLLM runs are elsewhere: tests/integration/test_vllm_rollout.py (TP 1: unseeded samples depend on the
batch, seeded ones do not) and tests/integration/test_vllm_rollout_tp.py (TP 2 in-process: the two ranks agree
without seeds while the trainers' streams differ, and an unseeded call made again after another is the same
batch). Here: the choice, the refusal, the note, and SamplerStream on torch's generators with a stand-in for vLLM's
draw (``q.exponential_()`` on the default generator, as vLLM 0.23's ``random_sample`` and vllm-ascend 0.23's do for
requests without a seed).
"""

from __future__ import annotations

import pytest
import torch

from gspo_ascend import config
from gspo_ascend.config import seeded_requests
from gspo_ascend.device import get_backend
from gspo_ascend.engines.base import SamplingParams
from gspo_ascend.engines.rollout_shards import split_rollout_prompts
from gspo_ascend.engines.vllm_rollout import SamplerStream, sampling_seed
from gspo_ascend.errors import ConfigError
from gspo_ascend.trainer import unseeded_note


def _cfg(*overrides: str):
    return config.load_config(None, list(overrides))


@pytest.mark.parametrize(
    "mode, on_host, seeded",
    [("auto", True, True), ("auto", False, False), ("on", False, True), ("off", True, False)],
)
def test_auto_seeds_on_the_host_only(mode, on_host, seeded):
    cfg = _cfg("rollout.engine=vllm", f"rollout.seed_requests={mode}", "rollout.enforce_eager=true")
    assert seeded_requests(cfg, on_host) is seeded


def test_the_key_is_refused_for_the_hf_engine():
    with pytest.raises(ConfigError, match=r"'rollout.seed_requests' \(off\) is the vllm engine's"):
        _cfg("rollout.seed_requests=off")
    assert _cfg("rollout.seed_requests=auto").rollout.seed_requests == "auto"


def test_unseeded_requests_are_said_once_where_they_are(capsys):
    vllm = ("rollout.engine=vllm", "rollout.enforce_eager=true")
    unseeded_note(_cfg(*vllm), on_host=False)
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("note: vLLM's requests are unseeded (rollout.seed_requests auto off the host)")
    assert "rollout.seed_requests=on" in line
    for cfg, on_host in ((_cfg(*vllm), True), (_cfg(*vllm, "rollout.seed_requests=on"), False), (_cfg(), False)):
        unseeded_note(cfg, on_host)
    assert capsys.readouterr().err == ""


def _vllm_draw() -> torch.Tensor:
    """What vLLM's sampler does for a batch without seeds: exponential noise from the default generator."""
    return torch.empty(6).exponential_()


def test_the_sampler_stream_is_the_same_on_every_rank_and_leaves_the_trainers_alone():
    """Two "ranks" whose trainer streams differ draw the same noise under their streams (seeded alike), call after
    call (not the same noise twice); each trainer stream continues as if nothing had drawn from it."""
    draws, after = [], []
    for rank in (0, 1):
        stream = SamplerStream(get_backend("cpu"), seed=7)
        torch.manual_seed(100 + rank)
        with stream():
            first = _vllm_draw()
        torch.rand(3)  # the trainer draws between two generate calls
        with stream():
            second = _vllm_draw()
        draws.append((first, second))
        after.append(torch.rand(4))
    (a1, a2), (b1, b2) = draws
    assert torch.equal(a1, b1) and torch.equal(a2, b2) and not torch.equal(a1, a2)
    expected = torch.Generator().manual_seed(7)
    assert torch.equal(a1, torch.empty(6).exponential_(generator=expected))
    assert torch.equal(a2, torch.empty(6).exponential_(generator=expected))  # the stream went on from the first
    for rank in (0, 1):
        own = torch.Generator().manual_seed(100 + rank)
        torch.rand(3, generator=own)
        assert torch.equal(after[rank], torch.rand(4, generator=own))


def test_the_trainers_stream_comes_back_when_the_call_fails():
    stream = SamplerStream(get_backend("cpu"), seed=7)
    torch.manual_seed(5)
    expected = torch.Generator().manual_seed(5)
    with pytest.raises(RuntimeError), stream():
        _vllm_draw()
        raise RuntimeError("vLLM failed mid-step")
    assert torch.equal(torch.rand(2), torch.rand(2, generator=expected))


def test_a_reseeded_stream_starts_again_and_goes_on_within_the_call():
    """reseed(seed): the next use starts at ``seed`` whatever the stream drew before (each generate call and each
    in-flight session reseeds it with its own seed); within one call's uses (an in-flight session's engine steps)
    it goes on."""
    stream = SamplerStream(get_backend("cpu"), seed=7)
    with stream():
        _vllm_draw()  # an earlier call
    stream.reseed(11)
    with stream():
        first = _vllm_draw()
    with stream():
        second = _vllm_draw()
    expected = torch.Generator().manual_seed(11)
    assert torch.equal(first, torch.empty(6).exponential_(generator=expected))
    assert torch.equal(second, torch.empty(6).exponential_(generator=expected))


def _bare_engine(stream: SamplerStream | None, group: int = 0):
    from gspo_ascend.engines.vllm_rollout import VLLMRolloutEngine

    engine = object.__new__(VLLMRolloutEngine)  # no vLLM: what reseed_sampler reads
    engine._stream, engine.tp_group = stream, group
    return engine


def test_a_call_reseeds_the_in_process_stream_by_its_requests_and_rollout_group():
    """Unseeded in-process (rollout TP > 1) the engine's stream restarts at the call's seed, a function of the
    requests and the rollout group: the same call twice restarts it alike; another round's or turn's requests
    (other seeds), or another group given the same requests (WorkerGroup.generate_requests hands every group the
    same), start elsewhere. At TP 1 (no stream: vLLM's engine core draws in its own process, by arrival timing)
    nothing is touched."""
    from gspo_ascend.engines.base import Request

    calls = [Request((1, 2), 4, 8, 1000), Request((3,), 4, 8, 1004)]
    later_round = [Request((1, 2, 5), 1, 4, 2000), Request((3, 6), 1, 4, 2001)]
    seeds = []
    for group, requests in ((0, calls), (0, calls), (1, calls), (0, later_round)):
        stream = SamplerStream(get_backend("cpu"), seed=7)
        with stream():
            _vllm_draw()  # an earlier call
        _bare_engine(stream, group).reseed_sampler(requests)
        assert stream.states is None  # the next use starts again
        seeds.append(stream.seed)
    assert seeds[0] == seeds[1] and len(set(seeds[1:])) == 3
    _bare_engine(None).reseed_sampler(calls)  # nothing to reseed, nothing raised


def test_each_rollout_group_samples_from_a_stream_of_its_own_when_unseeded():
    """Unseeded, every engine seeded alike would give the k-th row of every rollout group the same noise, coupling
    their samples: group g's stream starts where the dispatch puts group g's seeds (seed + 7919 g). Seeded, the
    engine keeps trainer.seed (its stream then feeds no sample: seeded runs are as before, bitwise)."""
    shares = split_rollout_prompts([[1], [2], [3], [4]], SamplingParams(n=1, seed=0), world_size=4, tp=2)
    dispatched = [params.seed for _, params in shares[::2]]  # group 0 (ranks 0, 1), group 1 (ranks 2, 3)
    assert [sampling_seed(0, False, g) for g in (0, 1)] == dispatched == [0, 7919]
    assert {sampling_seed(5, True, g) for g in range(4)} == {5}
    streams = [SamplerStream(get_backend("cpu"), sampling_seed(5, False, g)) for g in (0, 1)]
    noise = []
    for stream in streams:
        with stream():
            noise.append(_vllm_draw())
    assert not torch.equal(*noise)


def test_the_selftests_vllm_check_seeds_its_requests_on_every_device():
    """The selftest regenerates a seeded request after sleep / wake_up and wants the same samples: off the host
    auto would leave it unseeded, and the check would fail on every GPU / NPU (found by the review)."""
    from gspo_ascend.selftest.rollout import _VLLM_OVERRIDES

    cfg = config.load_config(None, _VLLM_OVERRIDES)  # as the check loads it (validated: an hf config would refuse)
    assert seeded_requests(cfg, on_host=False) and seeded_requests(cfg, on_host=True)
