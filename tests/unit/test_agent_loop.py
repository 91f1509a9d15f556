"""Multi-turn rollout (agent_loop.py, issue #45) on the real hf rollout engine and the real tools.

The tiny model has never seen a tool call, so it never writes one: a parser stand-in (test-only, below) reads one
calculator call into every model turn that ends with EOS. Everything else is real: the engine generates each turn
from the prompt plus the trajectory so far, the calculator runs in a ToolBox worker, the tool turn's tokens come
from the tokenizer's chat template. Expected values: the tool turn's text written out by hand from the template,
the engine's log-probs at the model's tokens against one unpadded full forward of the whole trajectory (the
reference of tests/unit/test_hf_rollout.py, same bound), the masks and turn counts from the trajectory's layout.
"""

from __future__ import annotations

import pytest
import torch

from gspo_ascend.agent_loop import AgentLoop, ToolTurns, Trajectory, _append_tool_turn
from gspo_ascend.device import get_backend
from gspo_ascend.engines.base import SamplingParams
from gspo_ascend.tools import ToolCall
from tests.unit.test_hf_rollout import QUESTIONS, ref_log_probs

pytestmark = pytest.mark.usefixtures("one_thread")
TOOL_TURN = "\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n"  # the tiny template, by hand


@pytest.fixture(scope="module")
def engine():
    from gspo_ascend.engines.hf_rollout import HFRolloutEngine
    from gspo_ascend.tiny import ensure_tiny_model

    return HFRolloutEngine(str(ensure_tiny_model()), backend=get_backend("cpu"))


@pytest.fixture(scope="module")
def toolbox():
    from gspo_ascend.tools.toolbox import ToolBox

    box = ToolBox(["calculator"], timeout_s=30.0, max_output_chars=100, num_workers=1)
    yield box
    box.close()


def one_call_per_turn(text: str, max_calls: int) -> list[ToolCall]:
    """Test-only stand-in for parse_tool_calls: every model turn "calls" the calculator once."""
    return [ToolCall("calculator", {"expression": "12*34"})]


def prompts_of(tokenizer) -> list[list[int]]:
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in QUESTIONS
    ]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def test_the_tool_turn_is_the_templates_own_text(engine):
    turns = ToolTurns(engine.tokenizer, "<|im_end|>")
    assert turns.separator == "\n"
    assert engine.tokenizer.decode(turns.tokens(["408"])) == TOOL_TURN


def test_trajectories_alternate_model_and_tool_turns_and_the_engine_scores_the_models_tokens(engine, toolbox):
    from transformers import AutoModelForCausalLM

    tok = engine.tokenizer
    turns = ToolTurns(tok, "<|im_end|>")
    tool_ids = turns.tokens(["408"])
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=160, seed=5)
    loop = AgentLoop(toolbox, turns, max_turns=3, max_calls_per_turn=2, pad_id=engine.pad_token_id,
                     parse=one_call_per_turn)  # fmt: skip
    batch, metrics = loop.turn_by_turn(prompts_of(tok), params, engine.generate_requests, step=1)
    assert batch.group_index.tolist() == [0, 0, 1, 1, 2, 2]
    full_three_turns = 0
    for i in range(len(batch)):
        n = int(batch.response_mask[i].sum())
        ids, model = batch.response_ids[i, :n].tolist(), batch.loss_mask[i, :n].tolist()
        tool_spans = _spans(model, 0.0)
        for start, end in tool_spans:  # every tool turn is the template's text with the calculator's answer
            assert ids[start:end] == tool_ids[: end - start]
            assert end - start == len(tool_ids) or end == n  # whole, or cut by the budget at the end
        model_spans = _spans(model, 1.0)
        for _start, end in model_spans[:-1]:  # every model turn but the last ended with EOS and called the tool
            assert tok.decode(ids[end - 1]) == "<|im_end|>"
        full_three_turns += len(model_spans) == 3 and len(tool_spans) == 2
        assert batch.rollout_log_probs[i, :n][batch.loss_mask[i, :n] == 0].eq(0).all()
    assert full_three_turns >= 4  # the budget leaves room for three turns in most trajectories
    assert metrics["agent/tool_call_rate"] == 1.0 and metrics["agent/turns_mean"] > 2.5

    # the engine's log-probs of the model's tokens, each turn generated after the tool turns before it, equal one
    # full forward over the whole trajectory: what the trainer recomputes as pi_old
    reference = AutoModelForCausalLM.from_pretrained(engine.model.name_or_path, attn_implementation="eager").eval()
    expected = ref_log_probs(reference, batch, 1.0) * batch.loss_mask
    torch.testing.assert_close(batch.rollout_log_probs, expected, atol=2e-5, rtol=0)


def test_a_tool_turn_past_the_budget_cuts_the_trajectory():
    t = Trajectory(prompt=[1], group=0, tokens=[5, 6, 7], model=[1.0] * 3, logps=[-0.5] * 3, turns=1, eos=True)
    _append_tool_turn(t, [9, 9, 9, 9], calls=1, width=5)  # room for 2 of its 4 tokens, none for an answer
    assert t.tokens == [5, 6, 7, 9, 9] and t.model == [1.0, 1.0, 1.0, 0.0, 0.0] and t.logps[3:] == [0.0, 0.0]
    assert t.done and not t.eos and t.calls == 1
    t = Trajectory(prompt=[1], group=0, tokens=[5], model=[1.0], logps=[-0.5], turns=1, eos=True)
    _append_tool_turn(t, [9, 9], calls=2, width=5)  # fits, with room left for the model's next turn
    assert t.tokens == [5, 9, 9] and not t.done and t.calls == 2


def _spans(mask: list[float], value: float) -> list[tuple[int, int]]:
    spans, start = [], None
    for i, m in enumerate([*mask, None]):
        if m == value and start is None:
            start = i
        elif m != value and start is not None:
            spans.append((start, i))
            start = None
    return spans


def test_a_trajectorys_routes_are_those_of_one_forward_over_it(toolbox):
    """On the tiny MoE every token fed, the tool turns' included (first fed by the next model turn's prefill), keeps
    the experts the engine routed it to; under frozen weights they are one full forward's over the trajectory."""
    from transformers import AutoModelForCausalLM

    from gspo_ascend.engines import routing
    from gspo_ascend.engines.hf_rollout import HFRolloutEngine
    from gspo_ascend.tiny import ensure_tiny_model

    engine = HFRolloutEngine(str(ensure_tiny_model(moe=True)), backend=get_backend("cpu"))
    turns = ToolTurns(engine.tokenizer, "<|im_end|>")
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=96, seed=5)
    loop = AgentLoop(toolbox, turns, max_turns=3, max_calls_per_turn=2, pad_id=engine.pad_token_id,
                     parse=one_call_per_turn)  # fmt: skip
    batch, _ = loop.turn_by_turn(prompts_of(engine.tokenizer), params, engine.generate_requests, step=1)
    model = AutoModelForCausalLM.from_pretrained(engine.model.name_or_path).eval()
    multi_turn = 0
    for i, routes in enumerate(batch.routed_experts):
        n = int(batch.response_mask[i].sum())
        seq = batch.prompt_ids[i] + batch.response_ids[i, :n].tolist()
        cut_in_tool_turn = batch.loss_mask[i, n - 1] == 0  # no model turn fed its last tool tokens
        assert routes.shape[0] == len(seq) - 1 or (cut_in_tool_turn and routes.shape[0] < len(seq) - 1)
        with torch.no_grad(), routing.routed(model, record=True) as log:
            model(input_ids=torch.tensor([seq]))
        own = log.stacked()[: routes.shape[0]]
        assert (routes.long().sort(-1).values == own.sort(-1).values).all(), i
        multi_turn += bool((batch.loss_mask[i, :n] == 0).any())
    assert multi_turn >= 3
