"""The tools of multi-turn rollout (issue #45): the calculator, the sandboxed Python runner, Qwen3 tool-call parsing,
the tool turn's tokens, and the ToolBox's bounds: every fault is told to the model, counted, said once, and the
next call works. Expected values are hand-derived."""

from __future__ import annotations

import io
import textwrap

import pytest

from gspo_ascend.tools.calculator import CalculatorError, calculator
from gspo_ascend.tools.calls import Malformed, ToolCall, parse_tool_calls
from gspo_ascend.tools.errors import ToolFault
from gspo_ascend.tools.python_runner import run_program

# ----------------------------------------------------------------------------------------------- calculator


@pytest.mark.parametrize(
    ("expression", "want"),
    [
        ("12*34", "408"),
        ("(12 + 3) * 45", "675"),
        ("987654321 * 123456789", "121932631112635269"),  # exact, past float's 2**53
        ("7/2", "3.5"),
        ("1/3", "0.333333333333"),
        ("2**10 - -3", "1027"),
        ("10 // 3 + 10 % 3", "4"),
        ("2**-2", "0.25"),
        ("0.1 + 0.2", "0.3"),  # exact fractions, not float's 0.30000000000000004
    ],
)
def test_the_calculator_is_exact(expression, want):
    assert calculator(expression) == want


@pytest.mark.parametrize(
    ("expression", "says"),
    [
        ('__import__("os").system("true")', "not Call"),
        ("x + 1", "not Name"),
        ("(1).real", "not Attribute"),
        ('"a" * 3', "not Constant"),
        ("[1, 2]", "not List"),
        ("1 / 0", "division by zero"),
        ("9 ** 99999", "over the limit of 64"),
        ("99999999999 ** 60", "too large"),
        ("1e999", "too large"),
        ("1" * 201, "over the limit of 200"),
        ("1 +", "not an arithmetic expression"),
        ("2 ** 0.5", "whole-number exponents"),
    ],
)
def test_the_calculator_refuses_what_is_not_bounded_arithmetic(expression, says):
    with pytest.raises(CalculatorError, match=says.replace("(", r"\(").replace("*", r"\*")):
        calculator(expression)


# ----------------------------------------------------------------------------------------------- calls


def test_qwen3_tool_calls_parse_in_order_and_leave_the_text_alone():
    text = (
        "I will compute it.\n<tool_call>\n"
        '{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>\n'
        '<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call><|im_end|>'
    )
    assert parse_tool_calls(text, max_calls=4) == [
        ToolCall("calculator", {"expression": "12*34"}),
        ToolCall("python", {"code": "print(1)"}),
    ]
    assert parse_tool_calls("The answer is \\boxed{408}.", max_calls=4) == []


@pytest.mark.parametrize(
    ("block", "says"),
    [
        ('<tool_call>{"name": "calculator", "arguments": {"expression": }</tool_call>', "not valid JSON"),
        ('<tool_call>["calculator"]</tool_call>', "one JSON object"),
        ('<tool_call>{"arguments": {}}</tool_call>', 'no "name"'),
        ('<tool_call>{"name": "calculator", "arguments": "12*34"}</tool_call>', "must be a JSON object"),
        ('<tool_call>{"name": "calculator", "arguments": {}, "id": 3}</tool_call>', "other than name and arguments"),
        ('<tool_call>{"name": "calculator", "arguments": {}}', "not closed"),
    ],
)
def test_a_malformed_call_is_one_malformed_entry_with_its_reason(block, says):
    (got,) = parse_tool_calls(block, max_calls=4)
    assert isinstance(got, Malformed) and says in got.reason


def test_calls_over_the_turn_limit_are_one_malformed_entry():
    one = '<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}</tool_call>'
    got = parse_tool_calls(one * 5, max_calls=2)
    assert got[:2] == [ToolCall("calculator", {"expression": "1"})] * 2
    assert len(got) == 3 and isinstance(got[2], Malformed) and "3 calls over the limit of 2" in got[2].reason


# ----------------------------------------------------------------------------------------------- python runner


def test_the_python_tool_returns_what_the_program_prints():
    assert run_program("print(6 * 7)\nimport math\nprint(math.factorial(20))") == "42\n2432902008176640000\n"


def test_a_program_that_raises_is_an_answer_with_its_traceback_and_status():
    out = run_program("x = 1\nraise ValueError('no such thing')")
    assert "ValueError: no such thing" in out and out.endswith("[exit status 1]")


@pytest.mark.parametrize(
    ("code", "denied"),
    [
        ("import socket\nsocket.socket()", "socket.__new__"),
        ("import subprocess\nsubprocess.run(['true'])", "subprocess.Popen"),
        ("import os\nos.system('true')", "os.system"),
        ("import ctypes\nctypes.CDLL(None)", "ctypes.dlopen"),
    ],
)
def test_the_sandbox_refuses_sockets_processes_and_ctypes(code, denied):
    out = run_program(code)
    assert f"PermissionError: {denied} is not allowed in this sandbox" in out and out.endswith("[exit status 1]")


def test_the_sandbox_has_no_environment_and_its_own_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("GSPO_SECRET", "x")
    out = run_program("import os\nprint(sorted(os.environ), os.getcwd().startswith('/tmp/gspo-tool-python-'))")
    # PATH alone is passed; Python's C-locale coercion (PEP 538) may set LC_CTYPE in the child itself
    assert out.strip() in ("['PATH'] True", "['LC_CTYPE', 'PATH'] True")


def test_a_program_past_its_limits_is_a_fault_not_a_hang():
    with pytest.raises(ToolFault) as e:
        run_program("while True: pass", timeout_s=1.0)
    assert e.value.kind == "timeout"
    with pytest.raises(ToolFault) as e:
        run_program("print('x' * 100_000)", max_output_chars=1000)
    assert e.value.kind == "too_long"
    out = run_program("b = bytearray(2 << 30)", memory_bytes=256 << 20)  # 2 GiB against a 256 MiB limit
    assert "MemoryError" in out and out.endswith("[exit status 1]")


# ----------------------------------------------------------------------------------------------- the tool box

USER_TOOLS = '''
import time

def ok(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b

def boom(x: str) -> str:
    """Always fails.

    Args:
        x: Anything.
    """
    raise RuntimeError("the tool broke")

def hang(x: str) -> str:
    """Never returns.

    Args:
        x: Anything.
    """
    time.sleep(600)
    return x

def huge(x: str) -> str:
    """Returns a lot.

    Args:
        x: Anything.
    """
    return "y" * 100_000
'''


@pytest.fixture
def toolbox(tmp_path):
    from gspo_ascend.tools.toolbox import ToolBox

    (tmp_path / "user_tools.py").write_text(USER_TOOLS)
    names = ["calculator", *(f"{tmp_path}/user_tools.py:{n}" for n in ("ok", "boom", "hang", "huge"))]
    stream = io.StringIO()
    box = ToolBox(names, timeout_s=3.0, max_output_chars=1000, num_workers=2, stream=stream)
    yield box, stream
    box.close()


def test_every_tool_fault_is_told_counted_said_once_and_the_next_call_works(toolbox):
    box, stream = toolbox
    calls = [
        ToolCall("ok", {"a": 2, "b": 3}),
        ToolCall("boom", {"x": "1"}),
        ToolCall("hang", {"x": "1"}),
        ToolCall("huge", {"x": "1"}),
        ToolCall("ok", {"a": "2", "b": 3}),  # a string for an integer
        ToolCall("ok", {"a": 2}),  # b missing
        ToolCall("ok", {"a": 2, "b": 3, "c": 4}),  # an argument the tool does not take
        ToolCall("nope", {}),
        Malformed("the <tool_call> block is not valid JSON (Expecting value at character 12)"),
        ToolCall("calculator", {"expression": "1/0"}),
        ToolCall("boom", {"x": "2"}),  # the same fault again: counted, not said again
    ]
    answers = box.call(calls, step=7)
    assert answers[0] == "5"
    assert answers[1] == answers[10] == "error: RuntimeError: the tool broke"
    assert answers[2] == "error: no result within 3 s"
    assert answers[3] == "error: the result is 100000 characters, over the limit of 1000"
    assert answers[4].startswith("error: bad arguments for ok: '2' is not of type 'integer'")
    assert answers[5] == "error: bad arguments for ok: 'b' is a required property"
    assert answers[6].startswith("error: bad arguments for ok: Additional properties are not allowed ('c'")
    assert answers[7].startswith("error: there is no tool named 'nope'")
    assert answers[8] == "error: the <tool_call> block is not valid JSON (Expecting value at character 12)"
    assert answers[9] == "error: CalculatorError: division by zero"
    assert box.metrics() == {
        "tools/_call/malformed": 1.0,
        "tools/_call/unknown_tool": 1.0,
        "tools/boom/calls": 2.0,
        "tools/boom/raised": 2.0,
        "tools/calculator/calls": 1.0,
        "tools/calculator/raised": 1.0,
        "tools/hang/calls": 1.0,
        "tools/hang/timeout": 1.0,
        "tools/huge/calls": 1.0,
        "tools/huge/too_long": 1.0,
        "tools/ok/bad_arguments": 3.0,
        "tools/ok/calls": 4.0,
    }
    said = stream.getvalue().splitlines()
    assert len(said) == 7 and all(line.startswith("warning: tool call ") and " at step 7 " in line for line in said)
    assert sum("(boom)" in line for line in said) == 1
    # the worker the hang took was replaced: the next calls run
    assert box.call([ToolCall("ok", {"a": 1, "b": 1})]) == ["2"]
    assert box.metrics() == {"tools/ok/calls": 1.0}


def test_the_schemas_are_what_transformers_gives_the_chat_template(toolbox):
    box, _ = toolbox
    (calc,) = [s for s in box.schemas if s["function"]["name"] == "calculator"]
    assert calc["function"]["parameters"]["required"] == ["expression"]
    assert calc["function"]["parameters"]["properties"]["expression"]["type"] == "string"


def test_a_tool_transformers_cannot_describe_is_refused_in_one_line(tmp_path):
    from gspo_ascend.errors import UserError
    from gspo_ascend.tools.registry import describe

    (tmp_path / "t.py").write_text(
        textwrap.dedent("""
        def undocumented(x):
            return x
    """)
    )
    with pytest.raises(UserError, match="Google-style docstring"):
        describe(f"{tmp_path}/t.py:undocumented")
    with pytest.raises(UserError, match="tool 'missing.module:fn': module 'missing.module' not found"):
        describe("missing.module:fn")


# ----------------------------------------------------------------------------------------------- config

CALC = "tools.names=[calculator]"


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["tools.max_turns=3"], "tools.max_turns"),  # no tools: an inert key is refused
        (["tools.timeout_s=1"], "tools.timeout_s"),
        ([CALC, "tools.max_turns=0"], "tools.max_turns"),
        ([CALC, "tools.timeout_s=0"], "tools.timeout_s"),
        ([CALC, "partial_rollout.round_tokens=16"], "partial_rollout.round_tokens"),
        ([CALC, "dynamic_sampling.enabled=true"], "dynamic_sampling.enabled"),
        ([CALC, "rollout_pool.devices_per_node=1"], "rollout_pool.devices_per_node"),
        ([CALC, "rollout.weights_lag=1"], "rollout.weights_lag"),
    ],
)
def test_the_config_refuses_tool_keys_that_would_do_nothing_and_what_tools_do_not_run_with_yet(overrides, key):
    from gspo_ascend.config import ConfigError, load_config

    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert f"'{key}'" in str(err.value) and "\n" not in str(err.value)


def test_tools_make_the_agent_schedule_and_the_prompts_carry_the_schemas():
    from types import SimpleNamespace

    from gspo_ascend.config import load_config
    from gspo_ascend.engines.hf_rollout import _load_tokenizer
    from gspo_ascend.schedules import build_schedule
    from gspo_ascend.schedules.agent import AgentTurns
    from gspo_ascend.schedules.synchronous import Synchronous
    from gspo_ascend.tiny import ensure_tiny_model
    from gspo_ascend.tools.plan import ToolPlan

    tokenizer = _load_tokenizer(str(ensure_tiny_model()))
    cfg = load_config(None, [CALC])
    schedule = build_schedule(SimpleNamespace(cfg=cfg, tokenizer=tokenizer, resume_from=None, val_set=None))
    assert isinstance(schedule, AgentTurns) and schedule.loop.turns.separator == "\n"
    schedule.close()
    plain = load_config(None, [])
    assert isinstance(build_schedule(SimpleNamespace(cfg=plain, resume_from=None)), Synchronous)
    assert not plain.tools.enabled
    plan = ToolPlan(cfg.tools)
    (schema,) = plan.schemas(plan.row("any/source", None, None, "here"))
    assert schema["function"]["name"] == "calculator"
