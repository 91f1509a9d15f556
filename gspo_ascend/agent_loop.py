"""Multi-turn rollout with tool calls: model turns and tool turns until the model answers.

A trajectory starts from the prompt (its chat template rendered with the tools' schemas). Each turn, every
unfinished trajectory is one request to the rollout engine (``generate_requests``: the prompt plus everything so
far, with the budget left), so all trajectories of a turn generate together, on any rollout engine, across the
data-parallel workers. A model turn that ends with EOS and holds ``<tool_call>`` blocks (calls.py) has them run by
the :class:`~gspo_ascend.tools.toolbox.ToolBox` (all calls of the turn at once, in worker processes), and the
answers are appended as the chat template's tool turn, followed by the next assistant header; a turn without a
call, a turn cut by the budget, or the last allowed turn ends the trajectory.

What training sees (:class:`~gspo_ascend.engines.SampleBatch`): ``response_ids`` holds the model's and the tools'
tokens in order, ``response_mask`` all of them (the span the engines pack and attend over), ``loss_mask`` only
the model's: the loss, GSPO's length normalisation (the sequence ratio is the mean over the model's own tokens)
and the behaviour weight read ``loss_mask``. ``rollout_log_probs`` are the engine's at the model's tokens, 0 at
the tools'.

How we differ from verl's ToolAgentLoop: verl runs one asyncio task per trajectory against vLLM's server; here a
turn is one batched call, which works the same on the hf engine (the CPU default) and on vLLM, at the cost of a
turn waiting for its longest trajectory. The tool turn's tokens come from the tokenizer's own chat template, with
the separator after the model's EOS that the template puts there (verl drops it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .engines.base import Request, SampleBatch, SamplingParams, requests_for
from .partial_rollout import round_seed
from .tools.calls import parse_tool_calls


@dataclass
class Trajectory:
    prompt: list[int]
    group: int  # its prompt's position in the step's draw
    tokens: list[int] = field(default_factory=list)  # after the prompt: the model's and the tools'
    model: list[float] = field(default_factory=list)  # 1.0 at the model's tokens, 0.0 at the tools'
    logps: list[float] = field(default_factory=list)  # the engine's at the model's tokens, 0.0 at the tools'
    turns: int = 0  # model turns
    calls: int = 0  # tool calls made
    done: bool = False
    eos: bool = False  # its last model turn ended with EOS


class ToolTurns:
    """The token ids of a tool turn under the tokenizer's own chat template: the separator the template puts
    after an assistant turn's EOS, the tool messages, and the next assistant header (``add_generation_prompt``)."""

    def __init__(self, tokenizer: Any, eos_text: str) -> None:
        self.tokenizer = tokenizer
        base = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
        before = tokenizer.apply_chat_template(base, tokenize=False)
        probe = tokenizer.apply_chat_template(base + [{"role": "tool", "content": "\x00"}], tokenize=False,
                                              add_generation_prompt=True)  # fmt: skip
        if not probe.startswith(before) or eos_text not in before:
            raise ValueError("the chat template does not render a tool turn after an assistant turn as a suffix")
        self.base, self.before = base, before
        self.separator = before[before.rindex(eos_text) + len(eos_text) :]  # e.g. "\n" after <|im_end|>

    @classmethod
    def of(cls, tokenizer: Any) -> ToolTurns:
        """The tool turns of ``tokenizer``'s template, its EOS the one that ends a model turn."""
        return cls(tokenizer, tokenizer.decode(tokenizer.eos_token_id))

    def tokens(self, answers: Sequence[str]) -> list[int]:
        messages = self.base + [{"role": "tool", "content": a} for a in answers]
        after = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tokenizer.encode(self.separator + after[len(self.before) :], add_special_tokens=False)


def run_turns(
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    generate: Callable[[list[Request], SamplingParams], SampleBatch],
    toolbox: Any,
    turns: ToolTurns,
    *,
    max_turns: int,
    max_calls_per_turn: int,
    pad_id: int,
    step: int | None = None,
    parse: Callable[[str, int], list] = parse_tool_calls,
) -> tuple[SampleBatch, dict[str, float]]:
    """``params.n`` trajectories per prompt, the n of a prompt adjacent (as ``generate``); ``params.max_new_tokens``
    bounds each trajectory's tokens after its prompt, the model's and the tools' together. ``parse``: a model
    turn's text -> its calls (Qwen3's format). Returns the batch and the ``agent/*`` metrics."""
    width = params.max_new_tokens
    trajectories = [Trajectory(list(p), g) for g, p in enumerate(prompts) for _ in range(params.n)]
    for turn in range(max_turns):
        active = [t for t in trajectories if not t.done]
        if not active:
            break
        if turn == 0:  # the single-turn requests: a first turn is exactly generate(prompts, params)
            requests = requests_for(prompts, params)
        else:
            base = round_seed(params.seed, turn)
            requests = [
                Request((*t.prompt, *t.tokens), 1, width - len(t.tokens), base + i) for i, t in enumerate(active)
            ]
        got = generate(requests, params)
        pending = _take_turn(active, got, turns.tokenizer, parse, max_calls_per_turn, turn + 1 == max_turns, width)
        answers = iter(toolbox.call([c for _, calls in pending for c in calls], step))
        for t, calls in pending:
            _append_tool_turn(t, turns.tokens([next(answers) for _ in calls]), len(calls), width)
    return _batch(trajectories, width, pad_id), _metrics(trajectories)


def trajectories_each(generate: Callable, toolbox: Any, turns: ToolTurns, tools: Any, pad_id: int) -> Callable:
    """A ``generate_each`` (validation.py's Generate) whose batches are trajectories: validation and
    `gspo-ascend eval` with tools, each request (prompts, params) one :func:`run_turns` over ``generate``."""

    def generate_each(reqs: list, on_done: Any = None) -> list[SampleBatch]:
        out = []
        for prompts, params in reqs:
            batch, _ = run_turns(
                prompts, params, generate, toolbox, turns,
                max_turns=tools.max_turns, max_calls_per_turn=tools.max_calls_per_turn, pad_id=pad_id,
            )  # fmt: skip
            out.append(batch)
            if on_done is not None:
                on_done(len(out))
        return out

    return generate_each


def _take_turn(
    active: list[Trajectory], got: SampleBatch, tokenizer: Any, parse: Any, max_calls: int, last: bool, width: int
) -> list[tuple[Trajectory, list]]:
    """Each active trajectory's new model turn appended; returns those whose turn called tools, with the calls."""
    pending = []
    lengths = got.response_lengths.tolist()
    for t, ids, logps, n, eos in zip(active, got.response_ids, got.rollout_log_probs, lengths, got.finished.tolist(),
                                     strict=True):  # fmt: skip
        new = ids[:n].tolist()
        t.tokens += new
        t.model += [1.0] * n
        t.logps += logps[:n].tolist()
        t.turns, t.eos = t.turns + 1, bool(eos)
        calls = parse(tokenizer.decode(new, skip_special_tokens=False), max_calls) if eos else []
        if not calls or last or len(t.tokens) >= width:
            t.done = True
        else:
            pending.append((t, calls))
    return pending


def _append_tool_turn(t: Trajectory, tool_tokens: list[int], calls: int, width: int) -> None:
    room = width - len(t.tokens)
    t.calls += calls
    if len(tool_tokens) >= room:  # no room left for the model to answer after it: the trajectory is cut here
        tool_tokens, t.done, t.eos = tool_tokens[:room], True, False
    t.tokens += tool_tokens
    t.model += [0.0] * len(tool_tokens)
    t.logps += [0.0] * len(tool_tokens)


def _batch(trajectories: list[Trajectory], width: int, pad_id: int) -> SampleBatch:
    b = len(trajectories)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    span, loss, logps = torch.zeros(b, width), torch.zeros(b, width), torch.zeros(b, width)
    for i, t in enumerate(trajectories):
        n = len(t.tokens)
        ids[i, :n] = torch.tensor(t.tokens, dtype=torch.long)
        span[i, :n] = 1.0
        loss[i, :n] = torch.tensor(t.model)
        logps[i, :n] = torch.tensor(t.logps)
    return SampleBatch(
        prompt_ids=[t.prompt for t in trajectories],
        response_ids=ids,
        response_mask=span,
        loss_mask=loss,
        rollout_log_probs=logps,
        group_index=torch.tensor([t.group for t in trajectories], dtype=torch.long),
        finished=torch.tensor([t.eos for t in trajectories], dtype=torch.bool),
    )


def _metrics(trajectories: list[Trajectory]) -> dict[str, float]:
    n = max(len(trajectories), 1)
    model = sum(sum(t.model) for t in trajectories)
    return {
        "agent/turns_mean": sum(t.turns for t in trajectories) / n,
        "agent/tool_calls_mean": sum(t.calls for t in trajectories) / n,
        "agent/tool_call_rate": sum(1 for t in trajectories if t.calls) / n,
        "agent/model_tokens_mean": model / n,
        "agent/tool_tokens_mean": (sum(len(t.tokens) for t in trajectories) - model) / n,
    }
