"""Multi-turn rollout with tool calls: model turns and tool turns until the model answers (:class:`AgentLoop`).

A trajectory starts from the prompt (its chat template rendered with its row's tools' schemas). A model turn that
ends with EOS and holds ``<tool_call>`` blocks (calls.py) has them run by the
:class:`~gspo_ascend.tools.toolbox.ToolBox` (in worker processes), and the answers are appended as the chat
template's tool turn, followed by the next assistant header; a turn without a call, a turn cut by the budget, or
the last allowed turn ends the trajectory. Two ways to run a step's trajectories, with the same seeds
(:func:`turn_seed`) and so the same samples:

- turn by turn (any engine, across the data-parallel workers): each turn, every unfinished trajectory is one
  request of one ``generate_requests`` call (the prompt plus everything so far, with the budget left), the
  turn's tools run together after it, so a turn waits for its longest trajectory;
- in flight (an engine that takes requests while others run: vLLM's own engine loop, vllm_rollout.EngineSteps):
  a trajectory's next turn joins the running batch when its tools answer; none waits for another.

What training sees (:class:`~gspo_ascend.engines.SampleBatch`): ``response_ids`` holds the model's and the tools'
tokens in order, ``response_mask`` all of them (the span the engines pack and attend over), ``loss_mask`` only
the model's: the loss, GSPO's length normalisation (the sequence ratio is the mean over the model's own tokens)
and the behaviour weight read ``loss_mask``. ``rollout_log_probs`` are the engine's at the model's tokens, 0 at
the tools'.

How we differ from verl's ToolAgentLoop: verl runs one asyncio task per trajectory against vLLM's server; in
flight here drives the sync ``LLM``'s own engine in process (the same continuous batching, no HTTP or asyncio),
and the hf engine (the CPU default) runs turn by turn. The tool turn's tokens come from the tokenizer's own chat
template, with the separator after the model's EOS that the template puts there (verl drops it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .engines.base import Request, SampleBatch, SamplingParams
from .engines.routing import merge_segments
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
    tools: Any = None  # its row's tools (tools/plan.py's RowTools; None: every tool of the box)
    index: int = 0  # its place among the step's trajectories (prompt g's sample j: g * n + j): its seeds
    # an MoE model's routes of every token fed so far, each from the turn that first fed it (a tool turn's tokens
    # are fed by the next model turn's prefill; engines/routing.py); None: the engine returns none
    routes: Any = None


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


@dataclass(frozen=True)
class AgentLoop:
    """What every trajectory runs with: the tool box, the tool turns' tokens, the bounds and the call parser (a
    model turn's text -> its calls; Qwen3's format). Two ways to run a step's trajectories, the same samples:
    :meth:`turn_by_turn` (any engine) and :meth:`in_flight` (an engine that takes requests while others run)."""

    toolbox: Any
    turns: ToolTurns
    max_turns: int
    max_calls_per_turn: int
    pad_id: int
    parse: Callable[[str, int], list] = parse_tool_calls

    @classmethod
    def of(cls, toolbox: Any, tokenizer: Any, tools: Any) -> AgentLoop:
        """The loop of a config's ``tools`` section, the tool turns of ``tokenizer``'s template."""
        return cls(toolbox, ToolTurns.of(tokenizer), tools.max_turns, tools.max_calls_per_turn, tokenizer.pad_token_id)

    def turn_by_turn(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        generate: Callable[[list[Request], SamplingParams], SampleBatch],
        *,
        step: int | None = None,
        rows: Sequence[Any] | None = None,
        first: int = 0,
    ) -> tuple[SampleBatch, dict[str, float]]:
        """``params.n`` trajectories per prompt, the n of a prompt adjacent (as ``generate``);
        ``params.max_new_tokens`` bounds each trajectory's tokens after its prompt, the model's and the tools'
        together. ``rows``: each prompt's tools (RowTools; a row with none is one model turn); None: every tool for
        every prompt. ``first``: the first prompt's place in the step's draw (a worker's slice). Each turn is one
        ``generate`` call of every unfinished trajectory, seeded by :func:`turn_seed`; a turn's tools run together
        after it. Returns the batch and the ``agent/*`` metrics."""
        width, n = params.max_new_tokens, params.n
        trajectories = _start(prompts, params, rows, first)
        for turn in range(self.max_turns):
            active = [t for t in trajectories if not t.done]
            if not active:
                break
            if turn == 0:  # generate's requests: a prompt's n samples in one, so a first turn is exactly generate
                requests = [Request(tuple(p), n, width, params.seed + (first + g) * n) for g, p in enumerate(prompts)]
            else:
                requests = [
                    Request((*t.prompt, *t.tokens), 1, width - len(t.tokens), turn_seed(params.seed, t.index, turn))
                    for t in active
                ]
            got = generate(requests, params)
            routes = got.routed_experts or [None] * len(active)
            pending = []
            for t, ids, logps, length, eos, r in zip(active, got.response_ids, got.rollout_log_probs,
                                                     got.response_lengths.tolist(), got.finished.tolist(), routes,
                                                     strict=True):  # fmt: skip
                calls = self._model_turn(t, ids[:length].tolist(), logps[:length].tolist(), bool(eos), width, r)
                if calls:
                    pending.append((t, calls))
            answers = iter(self.toolbox.call([c for _, calls in pending for c in calls], step,
                                             [t.tools for t, calls in pending for _ in calls]))  # fmt: skip
            for t, calls in pending:
                _append_tool_turn(t, self.turns.tokens([next(answers) for _ in calls]), len(calls), width)
        return _batch(trajectories, width, self.pad_id), _metrics(trajectories)

    def in_flight(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        stepper: Stepper,
        *,
        step: int | None = None,
        rows: Sequence[Any] | None = None,
        first: int = 0,
        events: list | None = None,
    ) -> tuple[SampleBatch, dict[str, float]]:
        """:meth:`turn_by_turn` with every trajectory in flight on its own: a model turn that calls tools has them
        run while the engine goes on with the others, and its next turn joins the engine's running batch when the
        answers are in; no trajectory waits for another's turn or tools. The seeds are :func:`turn_seed`'s, so the
        samples are the same. ``events`` (tests, traces): ("turn", trajectory, turns so far) when a model turn ends
        and ("tool", trajectory, turns so far) when its answers are appended, in order."""
        from concurrent.futures import FIRST_COMPLETED, wait

        width = params.max_new_tokens
        trajectories = _start(prompts, params, rows, first)
        by_key = {t.index: t for t in trajectories}
        for t in trajectories:
            stepper.add(t.index, t.prompt, width, turn_seed(params.seed, t.index, 0))
        waiting: dict[int, tuple[Any, int]] = {}
        while stepper.busy() or waiting:
            for key, new, logps, eos, *routes in stepper.step() if stepper.busy() else []:
                t = by_key[key]
                calls = self._model_turn(t, new, logps, eos, width, routes[0] if routes else None)
                _note(events, "turn", key, t.turns)
                if calls:
                    waiting[key] = (self.toolbox.submit(calls, step, [t.tools] * len(calls)), len(calls))
            if waiting and not stepper.busy() and not any(s.done() for s, _ in waiting.values()):
                wait([f for s, _ in waiting.values() for _, f in s.futures.values()], return_when=FIRST_COMPLETED)
            for key in [k for k, (s, _) in waiting.items() if s.done()]:
                submitted, count = waiting.pop(key)
                t = by_key[key]
                _append_tool_turn(t, self.turns.tokens(self.toolbox.collect(submitted)), count, width)
                _note(events, "tool", key, t.turns)
                if not t.done:
                    seed = turn_seed(params.seed, t.index, t.turns)
                    stepper.add(key, (*t.prompt, *t.tokens), width - len(t.tokens), seed)
        return _batch(trajectories, width, self.pad_id), _metrics(trajectories) | {"agent/in_flight": 1.0}

    def each(self, generate: Callable, rows: Any = None) -> Callable:
        """A ``generate_each`` (validation.py's Generate) whose batches are trajectories: validation and
        `gspo-ascend eval` with tools, each request (prompts, params) one :meth:`turn_by_turn` over ``generate``.
        ``rows``: :func:`rows_by_prompt` of the prompts' records (None: every tool for every prompt)."""

        def generate_each(reqs: list, on_done: Any = None) -> list[SampleBatch]:
            out = []
            for prompts, params in reqs:
                picked = [rows[tuple(p)] for p in prompts] if rows is not None else None
                out.append(self.turn_by_turn(prompts, params, generate, rows=picked)[0])
                if on_done is not None:
                    on_done(len(out))
            return out

        return generate_each

    def _model_turn(
        self, t: Trajectory, new: list[int], logps: list[float], eos: bool, width: int, routes=None
    ) -> list:
        """A model turn appended to ``t`` (``routes``: the turn's, over its whole prompt and its tokens); returns its
        calls when the trajectory goes on with a tool turn (else marks it done: no call, the last allowed turn, or
        the budget spent)."""
        if routes is not None:
            t.routes = merge_segments(t.routes, routes)
        t.tokens += new
        t.model += [1.0] * len(new)
        t.logps += logps
        t.turns, t.eos = t.turns + 1, eos
        offered = t.tools is None or bool(t.tools.names)  # a single-turn row's text is not read for calls
        text = self.turns.tokenizer.decode(new, skip_special_tokens=False)
        calls = self.parse(text, self.max_calls_per_turn) if eos and offered else []
        if not calls or t.turns >= self.max_turns or len(t.tokens) >= width:
            t.done = True
            return []
        return calls


class Stepper(Protocol):
    """An engine that takes requests while others run (vLLM's own engine loop: vllm_rollout.EngineSteps)."""

    def add(self, key: int, prompt: Sequence[int], max_new_tokens: int, seed: int) -> None: ...

    def busy(self) -> bool: ...

    def step(self) -> list[tuple]:
        """The requests that finished in this step: (key, tokens, their log-probs, ended with EOS[, routes]); the
        routes (an MoE model's, over the request's prompt and tokens) where the engine returns them."""
        ...


def turn_seed(seed: int, index: int, turn: int) -> int:
    """The seed of trajectory ``index``'s model turn ``turn``: turn 0 is ``generate``'s seeding (prompt g's sample
    j draws with seed + g * n + j), later turns a hash of (seed, turn) plus the index. A function of the trajectory
    alone: the same whichever trajectories share a batch or a worker, batched or in flight."""
    return round_seed(seed, turn) + index


def _start(prompts: Sequence[Sequence[int]], params: SamplingParams, rows: Any, first: int) -> list[Trajectory]:
    """The trajectories of ``prompts`` (the n of a prompt adjacent); ``first``: the first prompt's place in the
    step's draw, when a worker runs a slice of it (the seeds follow the place)."""
    tools = rows if rows is not None else [None] * len(prompts)
    n = params.n
    return [
        Trajectory(list(p), g, tools=tools[g], index=(first + g) * n + j)
        for g, p in enumerate(prompts)
        for j in range(n)
    ]


def _note(events: list | None, what: str, key: int, turns: int) -> None:
    if events is not None:
        events.append((what, key, turns))


def rows_by_prompt(records: Sequence[Any]) -> dict[tuple[int, ...], Any]:
    """Each prompt's tools (``PromptRecord.tools``) by its token ids, for callers that pass prompts as ids
    (validation's requests); UserError when two rows with the same prompt give their tools different kwargs."""
    from .errors import UserError

    out: dict[tuple[int, ...], Any] = {}
    for r in records:
        if out.setdefault(tuple(r.prompt_ids), r.tools) != r.tools:
            raise UserError(
                f"{r.source}: the same prompt as an earlier row with other extra_info.tools_kwargs; a row's hidden "
                "tool arguments must follow from its prompt: drop one of the rows"
            )
    return out


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
    routes = [t.routes for t in trajectories]
    return SampleBatch(
        routed_experts=routes if routes and all(r is not None for r in routes) else None,
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
