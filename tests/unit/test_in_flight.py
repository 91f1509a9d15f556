"""Trajectories in flight (AgentLoop.in_flight, issue #45 item 1): a trajectory whose tools are slow does not
hold the others back, and the trajectories are those of the turn-by-turn loop.

The engine here is a test-only scripted Stepper (the real one, vLLM's engine, is held to the turn-by-turn loop in
tests/integration/test_vllm_rollout.py::TestDense::test_trajectories_in_flight_are_the_turn_by_turn_ones): a request
finishes one step after it is added and "writes" a fixed text naming its trajectory. The tool is a real user tool in
a ToolBox worker that sleeps for what the call asks; the tokenizer and its template are the tiny model's.
"""

from __future__ import annotations

import pytest
import torch

from gspo_ascend.agent_loop import AgentLoop, ToolTurns
from gspo_ascend.engines.base import SampleBatch, SamplingParams
from gspo_ascend.tools import ToolCall

NAP = '''
import time

def nap(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "awake"
'''


@pytest.fixture(scope="module")
def tokenizer():
    from gspo_ascend.engines.hf_rollout import _load_tokenizer
    from gspo_ascend.tiny import ensure_tiny_model

    return _load_tokenizer(str(ensure_tiny_model()))


SLOW_SEED = 5  # trajectory 0's first turn (turn 0 draws with seed + index)


def model_turn(tokenizer, seed: int) -> tuple[list[int], list[float]]:
    """What the script writes for a request drawn with ``seed``: "slow" for trajectory 0's first turn, else
    "fast", then EOS; the log-probs a function of the seed, so a wrong seed shows."""
    ids = tokenizer.encode("slow" if seed == SLOW_SEED else "fast", add_special_tokens=False)
    ids.append(tokenizer.eos_token_id)
    return ids, [-((seed % 97) + 1) / 100.0] * len(ids)


class Script:
    """Test-only Stepper: every request added finishes at the next step."""

    def __init__(self, tokenizer):
        self.tokenizer, self.queue = tokenizer, []

    def add(self, key, prompt, max_new_tokens, seed):
        self.queue.append((key, seed))

    def busy(self):
        return bool(self.queue)

    def step(self):
        done, self.queue = self.queue, []
        return [(key, *model_turn(self.tokenizer, seed), True) for key, seed in done]


def parse(text: str, max_calls: int) -> list[ToolCall]:
    """Test-only parser: the slow turn naps 2 s, the others not at all."""
    return [ToolCall("nap", {"seconds": 2.0 if "slow" in text else 0.0})]


def scripted_generate(tokenizer, width: int):
    """turn_by_turn's ``generate`` over the same script (child j of a request draws with its seed + j, as vLLM)."""

    def generate(requests, params):
        rows = [(q, *model_turn(tokenizer, q.seed + j)) for q in requests for j in range(q.n)]
        ids = torch.full((len(rows), width), tokenizer.pad_token_id)
        logps, mask = torch.zeros(len(rows), width), torch.zeros(len(rows), width)
        for i, (_, tokens, lp) in enumerate(rows):
            n = len(tokens)
            ids[i, :n], logps[i, :n], mask[i, :n] = torch.tensor(tokens), torch.tensor(lp), 1.0
        return SampleBatch([list(q.prompt_ids) for q, _, _ in rows], ids, mask, logps,
                           torch.arange(len(rows)), finished=torch.ones(len(rows), dtype=torch.bool))  # fmt: skip

    return generate


def test_a_slow_tool_holds_back_only_its_own_trajectory_and_the_samples_are_the_turn_by_turn_ones(tmp_path, tokenizer):
    from gspo_ascend.tools.toolbox import ToolBox

    (tmp_path / "nap.py").write_text(NAP)
    box = ToolBox([f"{tmp_path}/nap.py:nap"], timeout_s=30.0, max_output_chars=100, num_workers=2)
    turns = ToolTurns.of(tokenizer)
    prompts = [tokenizer.encode("<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n")] * 2
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=96, seed=SLOW_SEED)
    loop = AgentLoop(box, turns, max_turns=3, max_calls_per_turn=1, pad_id=tokenizer.pad_token_id, parse=parse)
    events: list = []
    try:
        flying, metrics = loop.in_flight(prompts, params, Script(tokenizer), events=events)
        batched, _ = loop.turn_by_turn(prompts, params, scripted_generate(tokenizer, 96))
    finally:
        box.close()
    # while trajectory 0 naps after its first turn, the other three finish all three turns
    slow_answer = events.index(("tool", 0, 1))
    for key in (1, 2, 3):
        assert events.index(("turn", key, 3)) < slow_answer
    assert events[-1] == ("turn", 0, 3) and metrics["agent/turns_mean"] == 3
    assert torch.equal(flying.response_ids, batched.response_ids)
    assert torch.equal(flying.rollout_log_probs, batched.rollout_log_probs)  # the same seeds, turn by turn
    assert torch.equal(flying.loss_mask, batched.loss_mask)
