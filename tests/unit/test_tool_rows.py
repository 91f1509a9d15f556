"""Tools by row (tools/plan.py, issue #45 item 4): verl's tool-use rows through prepare-data and the loader, tools per
data source, verl's ``agent_name`` and ``extra_info.tools_kwargs`` (a tool's keyword-only parameters, hidden from the
model), and the agent loop giving each trajectory its row's tools.

The verl rows are written here in the shape verl's tool-agent preprocessor writes (examples/data_preprocess/
gsm8k_tool_agent_loop.py: a system and a user message, ``agent_name: tool_agent``, ``extra_info.tools_kwargs.<tool>.
create_kwargs.ground_truth``). The turns run on the real hf engine and the real tool workers; as in
test_agent_loop.py, a parser stand-in (test-only) reads one call into every model turn, because the tiny model
writes none. Expected values are by hand: which prompt shows which schema, which call gets which answer.
"""

from __future__ import annotations

import io

import pytest

from gspo_ascend.errors import UserError

CHECKER = '''
def check_answer(answer: str, *, ground_truth: str) -> str:
    """Says whether an answer is right.

    Args:
        answer: The answer to check.
        ground_truth: The row's answer (hidden from the model).
    """
    return "correct" if answer.strip() == ground_truth else "wrong"
'''


def verl_rows(n: int = 4) -> list[dict]:
    """verl's tool-agent gsm8k layout; odd rows are single-turn (agent_name single_turn_agent)."""
    rows = []
    for i in range(n):
        truth = str(10 + i)
        rows.append(
            {
                "data_source": "openai/gsm8k",
                "agent_name": "tool_agent" if i % 2 == 0 else "single_turn_agent",
                "prompt": [
                    {"role": "system", "content": "You may check your answer with the tool."},
                    {"role": "user", "content": f"What is 5 + {5 + i}?"},
                ],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": truth},
                "extra_info": {
                    "split": "train",
                    "index": i,
                    "need_tools_kwargs": True,
                    "tools_kwargs": {"check_answer": {"create_kwargs": {"ground_truth": truth}}},
                },
            }
        )
    return rows


@pytest.fixture
def checker(tmp_path):
    (tmp_path / "checker.py").write_text(CHECKER)
    return f"{tmp_path}/checker.py:check_answer"


def tools_cfg(names=(), by_source=None):
    from gspo_ascend.config import ToolsConfig

    return ToolsConfig(names=list(names), by_source=dict(by_source or {}))


def write(rows, path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


# Test-only: the tiny models' template leaves tools out (tiny.py), so the test's tokenizer gets one that renders
# them as Qwen3's does: each schema as JSON inside <tools></tools> in a system turn before the conversation.
TOOLS_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n<tools>' }}{%- for tool in tools %}{{- tool | tojson }}{%- endfor %}"
    "{{- '</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    from gspo_ascend.engines.hf_rollout import _load_tokenizer
    from gspo_ascend.tiny import ensure_tiny_model

    tok = _load_tokenizer(str(ensure_tiny_model()))
    tok.chat_template = TOOLS_TEMPLATE
    return tok


def test_a_keyword_only_parameter_is_hidden_from_the_models_schema(checker):
    from gspo_ascend.tools.registry import describe

    info = describe(checker)
    params = info.schema["function"]["parameters"]
    assert list(params["properties"]) == ["answer"] and params["required"] == ["answer"]
    assert info.hidden == info.hidden_required == {"ground_truth"}


def test_verl_tool_rows_survive_prepare_data_and_each_prompt_shows_its_rows_tools(tmp_path, checker, tokenizer):
    from gspo_ascend.data import load_prompts
    from gspo_ascend.data.prepare import prepare_data
    from gspo_ascend.tools.plan import ToolPlan

    (tmp_path / "in").mkdir()
    write(verl_rows(), tmp_path / "in" / "train.parquet")
    summary = prepare_data("verl", tmp_path / "in", tmp_path / "out")
    assert summary["train"]["rows"] == 4
    data = load_prompts(tmp_path / "out" / "train.parquet", "prompt", tokenizer, 512,
                        answer_key="reward_model.ground_truth", tools=ToolPlan(tools_cfg([checker])))  # fmt: skip
    texts = [tokenizer.decode(r.prompt_ids) for r in data.records]
    assert ["check_answer" in t for t in texts] == [True, False, True, False]
    assert all("ground_truth" not in t for t in texts)  # the hidden parameter is not in the schema shown
    assert all("You may check your answer" in t for t in texts)  # kind verl keeps the messages as written
    assert [r.tools.names for r in data.records] == [("check_answer",), (), ("check_answer",), ()]
    assert data.records[2].tools.kwargs == {"check_answer": {"ground_truth": "12"}}
    assert data.records[1].tools.kwargs == {}  # a single-turn row calls nothing


def test_tools_follow_the_data_source_and_names_is_the_default(checker):
    from gspo_ascend.tools.plan import ToolPlan

    plan = ToolPlan(tools_cfg(["calculator"], {"gsm8k": [checker], "plain": []}))
    kw = {"check_answer": {"create_kwargs": {"ground_truth": "3"}}}
    assert plan.row("gsm8k", None, kw, "f:0").names == ("check_answer",)
    assert plan.row("plain", None, None, "f:1").names == ()
    assert plan.row("other", None, None, "f:2").names == ("calculator",)
    assert plan.specs == ["calculator", checker]


@pytest.mark.parametrize(
    "agent, kwargs, says",
    [
        ("react_agent", None, "agent_name 'react_agent' is not one we run"),
        ("tool_agent", {"check_answer": {"create_kwargs": {"truth": "1"}}}, "gives ['truth'], which tool"),
        ("tool_agent", {"check_answer": {"create_kwargs": {}}}, "needs ['ground_truth'] from the row"),
        ("tool_agent", ["not", "a", "mapping"], "extra_info.tools_kwargs must map tool names"),
    ],
)
def test_a_row_the_plan_cannot_run_is_one_line_naming_it(checker, agent, kwargs, says):
    from gspo_ascend.tools.plan import ToolPlan

    with pytest.raises(UserError) as err:
        ToolPlan(tools_cfg([checker])).row("src", agent, kwargs, "'data.parquet' row 7")
    assert says in str(err.value) and "'data.parquet' row 7" in str(err.value) and "\n" not in str(err.value)


def test_stages_we_do_not_have_and_kwargs_of_tools_a_row_lacks_are_said_once(checker):
    from gspo_ascend.tools.plan import ToolPlan

    stream = io.StringIO()
    plan = ToolPlan(tools_cfg([checker]), stream=stream)
    kw = {"check_answer": {"create_kwargs": {"ground_truth": "1"}, "calc_reward_kwargs": {"x": 1}},
          "search": {"create_kwargs": {"q": "a"}}}  # fmt: skip
    for i in range(3):
        plan.row("src", None, kw, f"f:{i}")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2 and all(line.endswith("(said once)") for line in lines)
    assert "calc_reward_kwargs" in lines[0] and "'search'" in lines[1]


def test_each_trajectory_calls_with_its_rows_tools_and_hidden_arguments(checker, tokenizer):
    """Three prompts: a checker row (truth 12), a single-turn row, a row whose tools lack the checker. The parser
    stand-in has every model turn call check_answer('12')."""
    from gspo_ascend.agent_loop import AgentLoop, ToolTurns
    from gspo_ascend.device import get_backend
    from gspo_ascend.engines.base import SamplingParams
    from gspo_ascend.engines.hf_rollout import HFRolloutEngine
    from gspo_ascend.tiny import ensure_tiny_model
    from gspo_ascend.tools import ToolCall
    from gspo_ascend.tools.plan import RowTools
    from gspo_ascend.tools.toolbox import ToolBox

    engine = HFRolloutEngine(str(ensure_tiny_model()), backend=get_backend("cpu"))
    box = ToolBox(["calculator", checker], timeout_s=30.0, max_output_chars=100, num_workers=1)
    checked = RowTools(("check_answer",), {"check_answer": {"ground_truth": "12"}})
    rows = [checked, RowTools(), RowTools(("calculator",))]
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": f"{a}+1="}], add_generation_prompt=True,
                                           tokenize=False) for a in (11, 12, 13)]  # fmt: skip
    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    seen = []

    def answer_12(text, max_calls):
        return [ToolCall("check_answer", {"answer": "12"})]

    class Recording:
        def call(self, calls, step=None, rows=None):
            answers = box.call(calls, step, rows)
            seen.extend(answers)
            return answers

    try:
        loop = AgentLoop(Recording(), ToolTurns.of(tokenizer), max_turns=2, max_calls_per_turn=1,
                         pad_id=engine.pad_token_id, parse=answer_12)  # fmt: skip
        params = SamplingParams(n=1, temperature=1.0, max_new_tokens=96, seed=3)
        batch, metrics = loop.turn_by_turn(prompts, params, engine.generate_requests, rows=rows)
        counts = box.metrics()
    finally:
        box.close()
    # a trajectory that called has a tool turn: tokens in its span the loss does not train
    calls = [int((batch.response_mask[i] - batch.loss_mask[i]).sum() > 0) for i in range(3)]
    assert calls[1] == 0 and calls[0] + calls[2] >= 1  # the tiny model ends these answers with EOS: not vacuous
    assert sum(1 for t in seen if t == "correct") == calls[0]
    refused = "there is no tool named 'check_answer'; the tools are ['calculator']"
    assert sum(1 for t in seen if refused in t) == calls[2]
    assert len(seen) == calls[0] + calls[2]
    assert counts.get("tools/check_answer/calls", 0) == calls[0]
    assert counts.get("tools/_call/unknown_tool", 0) == calls[2]
    assert metrics["agent/tool_calls_mean"] == sum(calls) / 3


def test_the_model_cannot_set_a_hidden_argument(checker):
    from gspo_ascend.tools import ToolCall
    from gspo_ascend.tools.plan import RowTools
    from gspo_ascend.tools.toolbox import ToolBox

    box = ToolBox([checker], timeout_s=30.0, max_output_chars=100, num_workers=1, stream=io.StringIO())
    row = RowTools(("check_answer",), {"check_answer": {"ground_truth": "7"}})
    try:
        got = box.call([ToolCall("check_answer", {"answer": "7", "ground_truth": "1"}),
                         ToolCall("check_answer", {"answer": "7"})], rows=[row, row])  # fmt: skip
    finally:
        box.close()
    assert got[0].startswith("error: bad arguments for check_answer") and got[1] == "correct"


def test_by_source_alone_turns_tools_on_and_an_empty_one_is_refused():
    from gspo_ascend.config import ConfigError, load_config

    cfg = load_config(None, ["tools.by_source={gsm8k: [calculator]}"])
    assert cfg.tools.enabled and cfg.tools.by_source == {"gsm8k": ["calculator"]}
    with pytest.raises(ConfigError, match="'tools.by_source' has no effect"):
        load_config(None, ["tools.by_source={gsm8k: []}"])
    with pytest.raises(ConfigError, match=r"'tools.by_source.gsm8k' must be list of str"):
        load_config(None, ["tools.by_source={gsm8k: 3}"])
