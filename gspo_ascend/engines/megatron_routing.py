"""MoE routing replay and routing agreement on the ``megatron`` engine (:mod:`.megatron`): the semantics of
:mod:`.routing` (:class:`~.routing.ReplayBook` says what each forward replays and compares under
``actor.routing_replay`` off / r2 / r3, and keeps the old forward's routes and the agreement counts) on megatron-core's
GPTModel.

Replay is megatron-core's own ``RouterReplay`` (``megatron/core/transformer/moe/router_replay.py``, megatron-core
0.16; ``moe_enable_routing_replay`` gives every ``TopKRouter`` one). Before each micro-batch's forward every router of
the policy is handed its target experts, ``[rows, k]`` int64 in megatron's token order (:func:`row_map`: a padded
micro-batch's ``[S, b]`` activations flattened, row ``s * b + j`` = position s of sample j; a packed THD row's tokens
in order). Megatron's top-k routing then takes those experts and the gate
weights from the *current* logits (Qwen3-MoE, ``moe_router_pre_softmax=False``: the softmax over the k replayed
logits, i.e. re-normalised like HF's ``norm_topk_prob``), so the router still learns. The registry
``RouterReplay.global_router_replay_instances`` mixes the policy's routers with the KL reference's; we never use its
global setters: each router of the policy is driven through its own instance, and the reference routes for itself.

The router's own choice (the agreement metric, and the routes r2 replays) is the top-k of the logits its ``gating``
returns (wrapped per router instance): RouterReplay does not record it while replaying. That is megatron's own choice
for softmax routing without expert bias, group-limited routing, the fused router or token dropping (softmax is
monotonic, so the set is the same before or after it): what mbridge builds for Qwen2 / Qwen3-MoE. Other router
settings are refused for replay (:func:`own_choice_problem`) and not measured with replay off.

Activation recompute (``actor.recompute``) re-runs a router in backward: a forward pre-hook sets ``REPLAY_BACKWARD``
there (RouterReplay pops the targets of the micro-batches in the order they were set, which is the order their
backwards run in every schedule), ``REPLAY_FORWARD`` otherwise; the own-choice wrapper skips those re-runs.

A token without a route (padding, a packed row's padding sequence, the rollout's last sampled token, a dummy pass)
gets filler experts (:func:`filler`): megatron's replay needs a target for every row, and no loss reads those rows'
outputs (padding and a sample's last token come after every position the loss reads, under a causal mask; mbridge's
Qwen-MoE has no capacity limit and no load-balancing loss that would couple tokens). The filler goes round the
EP ranks and their experts (row i's j-th: the (i k + j)-th of the order rank 0's first, rank 1's first, ...), not the
same 0..k-1 for every row: under EP those would all be sent to the rank holding experts 0..k-1 (a padded
micro-batch's padding, CP's among them, is up to half its rows). The agreement counts leave those rows out.

Parallelism. PP: a stage's routers are its layers (the MoE layer ordinal from the router's global layer number);
SP: a router sees its TP rank's contiguous ``1 / tp`` of the rows; CP: this rank's zigzag positions (the micro-batch's
position ids, :mod:`.megatron_cp`). The old forward's own routes are gathered over the ranks that split a sequence
(TP with SP, CP) before they are kept per sample; each pipeline stage keeps only its own layers (the others stay 0:
no stage reads another's).

How we differ from verl's megatron actor (``verl/utils/megatron/router_replay_*``): megatron-core's own
RouterReplay, not a copy patched into ``TopKRouter``; the old forward's routes stay in the engine, found again by
the sample's tokens (:class:`~.routing.ReplayBook`), instead of riding back through the driver; the agreement with
the rollout and within the update is measured in every MoE run.

megatron-core 0.12.1 (the previous NPU line) has no RouterReplay: replay is refused there with one line; the agreement
is still measured (it only needs ``gating``).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from gspo_ascend.device import download, upload
from gspo_ascend.engines import routing
from gspo_ascend.engines.logprobs import response_lengths
from gspo_ascend.errors import ConfigError

_KEY = "config key 'actor.routing_replay'"


# ----------------------------------------------------------------------------------------------- checks


def check_model(mode: str, hf_config: Any) -> None:
    """Replay on a dense model is refused before anything starts."""
    experts = getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None)
    if mode != "off" and not experts:
        kind = getattr(hf_config, "model_type", "this model")
        raise ConfigError(f"{_KEY} ({mode}) needs an MoE model; {kind} has no experts: set it to off")


def check_megatron(mode: str) -> None:
    """After megatron is imported: replay needs megatron-core's RouterReplay (0.16 and later)."""
    if mode == "off":
        return
    try:
        import megatron.core.transformer.moe.router_replay  # noqa: F401
    except ImportError:
        raise ConfigError(
            f"{_KEY} ({mode}) needs megatron-core's RouterReplay (megatron-core 0.16 and later); megatron-core "
            f"{_version('megatron-core')} has none: set it to off, or use the 0.16 line"
        ) from None


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"


def own_choice_problem(tconfig: Any) -> str | None:
    """Why top-k of the router's logits would not be megatron's own choice (or replay would bypass RouterReplay)
    under this TransformerConfig, else None."""

    def get(name: str, default: Any = None) -> Any:
        return getattr(tconfig, name, default)  # fields megatron-core 0.12.1 lacks read as their default

    rules = [
        (get("moe_router_score_function", "softmax") == "softmax", "a score function other than softmax"),
        (get("moe_router_load_balancing_type") != "sinkhorn", "sinkhorn routing"),
        (not get("moe_router_enable_expert_bias"), "an expert bias"),
        (not get("moe_router_num_groups"), "group-limited routing"),
        (not get("moe_router_fusion"), "the fused router (moe_router_fusion)"),
        (get("moe_expert_capacity_factor") is None, "token dropping (moe_expert_capacity_factor)"),
        (not get("moe_router_force_load_balancing"), "forced load balancing"),
    ]
    return next((problem for ok, problem in rules if not ok), None)


def moe_layer_numbers(tconfig: Any) -> list[int]:
    """The global (1-based) layer numbers of the MoE layers, in order: megatron's ``moe_layer_freq`` pattern."""
    freq = tconfig.moe_layer_freq
    pattern = [int(i % freq == 0) for i in range(tconfig.num_layers)] if isinstance(freq, int) else list(freq)
    return [i + 1 for i, moe in enumerate(pattern) if moe]


# ----------------------------------------------------------------------------------------------- layout


def row_map(micro: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(sample, position) of every row megatron's routers see in ``micro``, in their order, on the host (before the
    SP cut): a padded ``[b, S]`` block is ``[S, b]`` flattened, row ``s * b + j`` = position ``host_positions[s]``
    (with CP this rank's zigzag part) of sample j; a packed ``[1, T]`` row (THD) is its tokens in order, row t = the
    sequence holding t at its position there. Rows of no sample (the packed row's padding) have sample -1."""
    if micro.cu_seqlens is None:
        b = micro.tokens.shape[0]
        return torch.arange(b).repeat(len(micro.host_positions)), micro.host_positions.repeat_interleave(b)
    lengths = torch.tensor(micro.cu_seqlens).diff()
    samples = torch.arange(len(lengths)).repeat_interleave(lengths)
    samples[samples >= micro.shape[0]] = -1
    return samples, micro.host_positions


def local_rows(rows: torch.Tensor, tp: int, tp_rank: int, sp: bool) -> torch.Tensor:
    """This TP rank's part of a micro-batch's rows (:func:`row_map`): under sequence parallelism megatron scatters
    the ``[S, b, H]`` activations along S, so each rank's routers see a contiguous ``1 / tp`` of the rows."""
    if sp and tp > 1:
        part = rows.shape[0] // tp
        rows = rows[tp_rank * part : (tp_rank + 1) * part]
    return rows


def filler(rows: int, k: int, experts: int, ep: int) -> torch.Tensor:
    """``[rows, k]`` int64 targets for rows without a route (module docstring): slot t = i k + j takes EP rank
    ``t mod ep``'s ``(t // ep) mod (experts / ep)``-th expert (megatron gives each EP rank a contiguous
    ``experts / ep``). k distinct experts a row (k <= experts: a bijection of t mod experts), and every expert, so
    every EP rank, the same number of slots within one."""
    t = torch.arange(rows).unsqueeze(1) * k + torch.arange(k)
    local = experts // ep
    return (t % ep) * local + (t // ep) % local


def place(
    routes: Sequence[torch.Tensor | None] | None,
    samples: torch.Tensor,
    positions: torch.Tensor,
    layers: Sequence[int],
    k: int,
    experts: int,
    ep: int = 1,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Per MoE layer in ``layers`` the ``[rows, k]`` int64 targets of a micro-batch's rows (row i: position
    ``positions[i]`` of sample ``samples[i]``; ``routes[j]`` is sample j's ``[tokens, all layers, k]``), and which
    rows have a route. Rows without one get :func:`filler`'s (module docstring)."""
    block = filler(len(samples), k, experts, ep).unsqueeze(1).expand(len(samples), len(layers), k).clone()
    given = torch.zeros(len(samples), dtype=torch.bool)
    for j, r in enumerate(routes or []):
        if r is None:
            continue
        here = (samples == j) & (positions < r.shape[0])
        block[here] = r[positions[here]][:, list(layers)].long()
        given |= here
    return [block[:, i] for i in range(len(layers))], given


def assemble(
    own: torch.Tensor,
    samples: torch.Tensor,
    positions: torch.Tensor,
    lengths: Sequence[int],
    layers: Sequence[int],
    total: int,
    dtype,
) -> list[torch.Tensor]:
    """The inverse of :func:`place`: rows ``own`` ``[rows, len(layers), k]`` (every rank's part of the sequences,
    gathered) -> per sample j its first ``lengths[j]`` positions' routes ``[n, total, k]`` in ``dtype``; layers
    outside ``layers`` (another pipeline stage's) stay 0."""
    out = []
    index = torch.as_tensor(list(layers), dtype=torch.long)
    for j, n in enumerate(lengths):
        here = (samples == j) & (positions < n)
        routes = torch.zeros(n, total, own.shape[-1], dtype=dtype)
        routes[positions[here].unsqueeze(1), index] = own[here].to(dtype)
        out.append(routes)
    return out


def _gather_rows(own: torch.Tensor, where: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's rows of the same sequences (the ranks of ``group`` split them), their ``[rows, 2]`` (sample,
    position) alongside (the group's order does not matter), on their way to the host:
    :func:`~gspo_ascend.device.download`, read only after the device has been waited for (issue #43: a ``.cpu()``
    here waited for every micro-batch's forward)."""
    if group is None or dist.get_world_size(group) == 1:
        return download(own), where
    size = dist.get_world_size(group)
    rows = [torch.empty_like(own) for _ in range(size)]
    dist.all_gather(rows, own.contiguous(), group=group)
    moved = upload(where, own.device)
    wheres = [torch.empty_like(moved) for _ in range(size)]
    dist.all_gather(wheres, moved, group=group)
    return download(torch.cat(rows)), download(torch.cat(wheres))


def sequence_group(sp: bool, tp: int, cp: int):
    """The process group whose ranks split one sequence's positions (None: this rank sees them all)."""
    from megatron.core import parallel_state as ps

    if cp > 1:
        return ps.get_tensor_and_context_parallel_group() if sp and tp > 1 else ps.get_context_parallel_group()
    return ps.get_tensor_model_parallel_group() if sp and tp > 1 else None


# ----------------------------------------------------------------------------------------------- the routers


class MegatronRouting:
    """The policy's routers under one :class:`~.routing.ReplayBook`; see the module docstring."""

    def __init__(self, models: Sequence[torch.nn.Module], book: routing.ReplayBook, tconfig: Any, parallel) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        ordinal = {number: i for i, number in enumerate(moe_layer_numbers(tconfig))}
        self.book, self.k, self.experts = book, int(tconfig.moe_router_topk), int(tconfig.num_moe_experts)
        self.ep = int(tconfig.expert_model_parallel_size)  # the filler's spread (filler)
        self.routers = [m for model in models for m in model.modules() if isinstance(m, TopKRouter)]
        self.layers = [ordinal[r.layer_number] for r in self.routers]  # this stage's MoE layers
        self.tp, self.tp_rank, self.cp = parallel
        self.sp = bool(tconfig.sequence_parallel)
        self.group = sequence_group(self.sp, self.tp, self.cp)
        self._phase: str | None = None
        self._replaying = False
        self._reset()
        for i, router in enumerate(self.routers):
            router.gating = self._recording(i, router.gating)  # an instance attribute over the class's method
            if getattr(router, "router_replay", None) is not None:
                router.register_forward_pre_hook(self._set_action)

    def _reset(self) -> None:
        """Per schedule: agreement counts per router on the device (matched, compared: read once, at its end), and
        the micro-batch whose forward runs now with its comparison routes and, in an ``old`` forward, its routers'
        own choices (one byte an expert, on the device until the next micro-batch starts)."""
        self._counts: torch.Tensor | None = None
        self._micro: Any = None
        self._compare: tuple[list[torch.Tensor], torch.Tensor] | None = None
        self._own: list[torch.Tensor | None] = [None] * len(self.routers)

    def _recording(self, i: int, gating: Callable) -> Callable:
        def gating_and_own_choice(input):
            logits = gating(input)
            # a re-run in backward (activation recompute) is not a new forward: its choice is the forward's
            if self._phase is not None and self._micro is not None and torch._C._current_graph_task_id() == -1:
                with torch.no_grad():
                    self._see(i, logits.detach().reshape(-1, self.experts).topk(self.k, -1).indices)
            return logits

        return gating_and_own_choice

    def _see(self, i: int, own: torch.Tensor) -> None:
        """Router ``i``'s own choice for the micro-batch now running: counted against its comparison routes on the
        device (no host sync in the loop), and kept for the book after an ``old`` forward."""
        if self._compare is not None:
            targets, given = self._compare
            if self._counts is None:
                self._counts = torch.zeros(len(self.routers), 2, dtype=torch.long, device=own.device)
            same = routing.same_set(own, targets[i]) & given
            self._counts[i, 0] += same.sum()
            self._counts[i, 1] += given.sum()
        if self._phase == "old":
            self._own[i] = own.to(routing.held_dtype(self.experts))

    def _set_action(self, router: torch.nn.Module, _args) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction as Action

        if not self._replaying:
            router.router_replay.clear_router_replay_action()
            return
        backward = torch._C._current_graph_task_id() != -1  # activation recompute inside autograd's backward
        router.router_replay.set_router_replay_action(Action.REPLAY_BACKWARD if backward else Action.REPLAY_FORWARD)

    def _where(self, micro) -> torch.Tensor:
        """``[rows, 2]``: (sample, position) of the rows this rank's routers see (:func:`row_map`, SP-cut)."""
        return local_rows(torch.stack(row_map(micro), 1), self.tp, self.tp_rank, self.sp)

    def _rows(self, micro, routes, device) -> tuple[list[torch.Tensor], torch.Tensor]:
        """:func:`place`'s targets and mask, built on the host and uploaded without a wait (issue #43)."""
        where = self._where(micro)
        targets, given = place(routes, where[:, 0], where[:, 1], self.layers, self.k, self.experts, self.ep)
        return [upload(t, device) for t in targets], upload(given, device)

    @contextlib.contextmanager
    def running(self, phase: str, micros: Sequence[Any], device) -> Iterator[Callable[[Any], None]]:
        """One schedule of the policy over ``micros`` in ``phase`` (``old`` / ``update``). Yields the callback the
        schedule's forward step calls with each micro-batch just before the model; afterwards the agreement is
        counted and, after an ``old`` forward, its routes are in the book."""
        plans = {id(m): self.book.targets(m.sample, phase) for m in micros if m.sample is not None}
        self._replaying = any(replay is not None for replay, _ in plans.values())
        if self._replaying and not all(getattr(r, "router_replay", None) for r in self.routers):
            raise RuntimeError("routing replay: megatron's routers have no RouterReplay (moe_enable_routing_replay)")
        for router in self.routers:
            if self._replaying:
                router.router_replay.clear_indices()  # set_target_indices appends to its backward list

        def before_forward(micro) -> None:
            self._finish_micro()
            replay, compare = plans.get(id(micro), (None, None))
            if self._replaying:
                for router, target in zip(self.routers, self._rows(micro, replay, device)[0], strict=True):
                    router.router_replay.set_target_indices(target)
            self._micro = micro if micro.sample is not None else None
            if self._micro is not None and compare is not None:
                self._compare = self._rows(micro, compare, device)

        self._phase = phase
        try:
            yield before_forward
            self._finish_micro()
            self._account(phase)
        finally:
            self._phase, self._replaying = None, False
            self._reset()
            for router in self.routers:
                if getattr(router, "router_replay", None) is not None:
                    router.router_replay.clear_router_replay_action()
                    router.router_replay.clear_indices()

    def _finish_micro(self) -> None:
        """The micro-batch that ran last: after an ``old`` forward its own routes, per sample, into the book."""
        micro, own = self._micro, self._own
        self._micro, self._compare, self._own = None, None, [None] * len(self.routers)
        if micro is None or self._phase != "old" or not self.routers:
            return
        if any(o is None for o in own):
            raise RuntimeError("routing: a router of this stage did not run in the micro-batch's forward")
        self._remember(micro, own)

    def _account(self, phase: str) -> None:
        """The schedule's agreement counts, read from the device once, into the book per MoE layer."""
        if self._counts is None:
            return
        agreement = self.book.rollout if phase == "old" else self.book.update
        for layer, (matched, compared) in zip(self.layers, self._counts.tolist(), strict=True):
            agreement.add(layer, matched, compared)

    def _remember(self, micro, own: list[torch.Tensor]) -> None:
        """The micro-batch's own routes into the book, assembled per sample once the host copies have arrived (the
        book waits for the device once, when the update first reads them)."""
        rows, where = _gather_rows(torch.stack(own, 1), self._where(micro), self.group)  # [rows, layers, k]
        sample, book = micro.sample, self.book
        fed = [len(p) + n for p, n in zip(sample.prompt_ids, response_lengths(sample), strict=True)]
        keys = routing.sample_keys(sample)

        def finish():
            found = assemble(rows, where[:, 0], where[:, 1], fed, self.layers, book.layers, book.dtype)
            return zip(keys, found, strict=True)

        book.later(finish)


def attach(mode: str, models: Sequence[torch.nn.Module], tconfig: Any, parallel: tuple[int, int, int], verbose: bool):
    """The policy's :class:`MegatronRouting`, or None for a dense model (replay refused there before) or a router
    whose own choice we cannot read (replay refused; with replay off, no agreement metrics, said once).
    ``parallel``: (TP size, TP rank, CP size)."""
    if not getattr(tconfig, "num_moe_experts", None):
        return None
    problem = own_choice_problem(tconfig)
    if problem is not None:
        if mode != "off":
            raise ConfigError(f"{_KEY} ({mode}) supports softmax top-k routers only; this model's has {problem}")
        if verbose:
            print(f"note: routing agreement is not measured: the router has {problem}", flush=True)
        return None
    layers = len(moe_layer_numbers(tconfig))
    book = routing.ReplayBook(mode, layers, int(tconfig.moe_router_topk), int(tconfig.num_moe_experts))
    return MegatronRouting(models, book, tconfig, parallel)


def release(models: Sequence[torch.nn.Module]) -> None:
    """Drop these models' RouterReplay instances from megatron's process-wide registry (it only ever grows)."""
    try:
        from megatron.core.transformer.moe.router_replay import RouterReplay
    except ImportError:
        return
    mine = {id(m.router_replay) for model in models for m in model.modules() if getattr(m, "router_replay", None)}
    registry = RouterReplay.global_router_replay_instances
    registry[:] = [r for r in registry if id(r) not in mine]
