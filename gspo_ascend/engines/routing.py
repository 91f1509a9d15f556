"""MoE routing replay and routing agreement on Hugging Face MoE models (the fsdp train engine, the hf rollout engine).

A route is the top-k expert set a token's router chose in one MoE layer; a sample's routes are an integer tensor
``[tokens, layers, k]`` over the tokens fed to the model, in input order (prompt, then response). The rollout engine
feeds every token but the last sampled one, so its routes cover ``len(prompt) + len(response) - 1`` tokens; a
trainer forward feeds all of them, and a token without a route (the last one, padding) keeps the router's own
choice. Nothing the loss reads depends on the last token's routing (causal attention: it only feeds its own
logits, which predict nothing).

Replay (the GSPO paper's Routing Replay, R2; the rollout engine's routes, R3): the experts are the given ones, the
gate weights are the *current* router's softmax probabilities at those experts, re-normalised over them where the
model normalises its top-k (``norm_topk_prob``), so the router still gets a gradient and learns. Replaying a
router's own choice reproduces its output exactly (tested), which is what makes "replay is exact" checkable.

How we differ from verl / Megatron's ``RouterReplay``: the same semantics, applied by swapping each router module's
``forward`` for the duration of one forward (like engines/fused_logprob.py swaps the LM head), not a model patch
installed at start-up; the swap also records the router's own choice *before* replay overrides it, which gives the
agreement metric (share of tokens whose own top-k set equals the target's) under replay too.

Supported: transformers' ``TopKRouter`` modules of the families in :data:`MODEL_TYPES` (softmax, top-k, optional
re-normalisation; transformers 5.5's returns the probabilities as its first output, 5.19's the logits, so the
replayed weights are recomputed from the router's weight, one [tokens, experts] matmul, instead of read from it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from gspo_ascend.device import download, upload

# families whose router is a transformers TopKRouter computing softmax -> top-k -> (re-normalise): checked in
# tests/test_routing.py against the installed transformers' source
MODEL_TYPES = ("qwen3_moe", "qwen2_moe")


def held_dtype(num_experts: int) -> torch.dtype:
    """Expert ids while they wait on the device (a generate call's steps, a megatron micro-batch): one byte up to 256
    experts, else int32 (gloo gathers no int16)."""
    return torch.uint8 if num_experts <= 256 else torch.int32


def route_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer type for expert ids: one byte per (token, layer, k) up to 256 experts (Qwen3-30B-A3B has
    128), two beyond."""
    return torch.uint8 if num_experts <= 256 else torch.int16


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's router modules in layer order (empty for a dense model or an unsupported family)."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in MODEL_TYPES:
        return []
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


def moe_shape(model: torch.nn.Module) -> tuple[int, int, int] | None:
    """(MoE layers, k, experts) of a supported MoE model, else None."""
    found = routers(model)
    if not found:
        return None
    return len(found), int(found[0].top_k), int(found[0].num_experts)


@dataclass
class Agreement:
    """Per MoE layer: tokens compared and tokens whose own top-k set equals the target's (order ignored). The counts
    may be device tensors: they are summed where they are and read once, by :meth:`numbers` (no host sync per layer
    and micro-batch in the forward)."""

    matches: list = field(default_factory=list)
    tokens: list = field(default_factory=list)

    def numbers(self) -> list[float]:
        """matches, then tokens, per layer, on the host."""
        return [float(x) for x in self.matches + self.tokens]

    def add(self, layer: int, matched, counted) -> None:
        while len(self.tokens) <= layer:
            self.matches.append(0)
            self.tokens.append(0)
        self.matches[layer] += matched
        self.tokens[layer] += counted

    def merge(self, other: Agreement) -> None:
        for layer, (m, t) in enumerate(zip(other.matches, other.tokens, strict=True)):
            self.add(layer, m, t)

    def metrics(self, prefix: str) -> dict[str, float]:
        """``<prefix>_mean`` (over layers) and ``<prefix>_min_layer``; nothing when no token was compared."""
        shares = [float(m) / float(t) for m, t in zip(self.matches, self.tokens, strict=True) if t]
        if not shares:
            return {}
        return {f"{prefix}_mean": sum(shares) / len(shares), f"{prefix}_min_layer": min(shares)}


class RouteLog:
    """What one :func:`routed` block saw: per router call and layer, the router's own choice ``[tokens, k]``
    (before any replay) and, where a target was given, the agreement with it."""

    def __init__(self, layers: int) -> None:
        self.own: list[list[torch.Tensor]] = [[] for _ in range(layers)]
        self.agreement = Agreement()

    def stacked(self, call: int = 0) -> torch.Tensor:
        """``[tokens, layers, k]`` int64 of router call ``call`` (a forward calls every router once)."""
        return torch.stack([calls[call] for calls in self.own], 1).long()


def _rows(routes: torch.Tensor, layer: int, own: torch.Tensor) -> torch.Tensor:
    if routes.shape[0] != own.shape[0]:
        raise RuntimeError(f"routing replay: routes for {routes.shape[0]} tokens, the router sees {own.shape[0]}")
    return routes[:, layer]


def same_set(own: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per row: the same expert set, order ignored."""
    return (own.sort(-1).values == target.sort(-1).values).all(-1)


def _replayed_scores(router, hidden: torch.Tensor, indices: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The gate weights of ``indices`` exactly as the router computes them for its own top-k: softmax in fp32 over
    every expert, the chosen probabilities, re-normalised where the model does."""
    logits = torch.nn.functional.linear(hidden.reshape(-1, router.hidden_dim), router.weight)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    scores = probs.gather(-1, indices)
    if router.norm_topk_prob:
        scores = scores / scores.sum(dim=-1, keepdim=True)
    return scores.to(dtype)


@contextlib.contextmanager
def routed(
    model: torch.nn.Module,
    *,
    replay: torch.Tensor | None = None,
    compare: torch.Tensor | None = None,
    record: bool = False,
) -> Iterator[RouteLog]:
    """Within the block every router of ``model`` uses ``replay`` ([tokens, layers, k] int64 on the model's device,
    in the flattened input order; a row of -1 = the router's own choice) and, with ``record``, logs its own choice.
    The agreement of its own choice with ``compare`` (same layout) is counted over the rows that have a route."""
    found = routers(model)
    log = RouteLog(len(found))
    originals = [r.forward for r in found]

    def make(layer: int, router, original):
        def forward(hidden_states):
            first, scores, own = original(hidden_states)
            if record:  # one byte an expert while it waits (a generate call keeps every step's)
                log.own[layer].append(own.detach().to(held_dtype(router.num_experts)))
            if compare is not None:
                with torch.no_grad():
                    theirs = _rows(compare, layer, own)
                    given = theirs[:, 0] >= 0
                    log.agreement.add(layer, (same_set(own, theirs) & given).sum(), given.sum())
            if replay is None:
                return first, scores, own
            target = _rows(replay, layer, own)
            indices = torch.where((target[:, :1] >= 0), target, own)
            return first, _replayed_scores(router, hidden_states, indices, scores.dtype), indices

        return forward

    swapped = [r.__dict__.get("forward") for r in found]  # an enclosing block's swap (nested blocks stack)
    try:
        for layer, (router, original) in enumerate(zip(found, originals, strict=True)):
            router.forward = make(layer, router, original)
        yield log
    finally:
        for router, before in zip(found, swapped, strict=True):
            if before is None:
                del router.forward  # back to the class's forward
            else:
                router.forward = before


def flatten(
    routes: Sequence[torch.Tensor | None], starts: Sequence[int], lengths: Sequence[int], total: int, device
) -> torch.Tensor | None:
    """Per-sample routes placed at their samples' token offsets in a flattened forward of ``total`` tokens
    (sample i's ``lengths[i]`` tokens start at ``starts[i]``); -1 where no route is given. None when no sample has
    one. Routes for more tokens than the sample feeds are refused: they belong to another sample or response."""
    given = [(s, n, r) for s, n, r in zip(starts, lengths, routes, strict=True) if r is not None and r.numel()]
    if not given:
        return None
    layers, k = given[0][2].shape[1:]
    flat = torch.full((total, layers, k), -1, dtype=torch.long)
    for start, n, r in given:
        if r.shape[0] > n or tuple(r.shape[1:]) != (layers, k):
            raise ValueError(f"routes of shape {tuple(r.shape)} for a sample of {n} tokens, {layers} x {k} routes")
        flat[start : start + r.shape[0]] = r.long()
    return upload(flat, device)


def split(flat: torch.Tensor, starts: Sequence[int], lengths: Sequence[int], dtype: torch.dtype) -> list[torch.Tensor]:
    """The inverse of :func:`flatten`: sample i's ``lengths[i]`` rows from ``starts[i]``, on the host, in ``dtype``."""
    host = flat.to("cpu", dtype)
    return [host[s : s + n].clone() for s, n in zip(starts, lengths, strict=True)]


def merge_segments(earlier: torch.Tensor | None, later: torch.Tensor | None) -> torch.Tensor | None:
    """A partial sample's routes after one more segment: the earlier segments' routes for the tokens they fed, the
    continuation's for the tokens after (its prompt re-fed the earlier tokens under newer weights; those tokens' log-
    probs, and so the routes that produced them, are the earlier segment's)."""
    if earlier is None or later is None:
        return later if earlier is None else earlier
    return torch.cat([earlier, later[earlier.shape[0] :]], 0)


def sample_key(prompt: Sequence[int], response: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return tuple(prompt), tuple(response)


def sample_keys(batch) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    lengths = batch.response_mask.sum(-1).long().tolist()
    rows = batch.response_ids.tolist()
    return [sample_key(p, row[:n]) for p, row, n in zip(batch.prompt_ids, rows, lengths, strict=True)]


class ReplayBook:
    """What a train engine keeps about routing between its calls (``actor.routing_replay``; one per MoE engine).

    Two kinds of forward: ``old`` (the no-grad forward of the old log-probs) and ``update`` (the loss forwards).
    - replay: r3 replays the rollout's routes (``batch.routed_experts``) in both; r2 replays in ``update`` the routes
      the ``old`` forward chose, found by the sample's tokens (the driver may drop or reorder samples in between);
    - agreement, measured on the router's own choice before replay overrides it: ``old`` against the rollout's routes
      (the train-inference routing gap at the same weights), ``update`` against the ``old`` forward's (how far the
      optimizer steps of this rollout batch moved the routing: the paper's expert volatility).
    The ``old`` forward's routes stay on the host until the next one: ``layers x k`` bytes a token (one byte up to
    256 experts), the planner's ``routes`` term.
    """

    def __init__(self, mode: str, layers: int, k: int, num_experts: int) -> None:
        self.mode, self.layers, self.k = mode, layers, k
        self.dtype = route_dtype(num_experts)
        self._old_routes: dict = {}
        self._unread: list[Callable[[], Iterable]] = []  # old forwards' routes on their way to the host (:meth:`later`)
        self.wait: Callable[[], None] | None = None  # the engine's device synchronisation, before reading them
        self.rollout, self.update = Agreement(), Agreement()

    def forget(self) -> None:
        """Drop the last old forward's routes: the next one replaces them."""
        self._old_routes, self._unread = {}, []

    @property
    def old_routes(self) -> dict:
        """The last old forward's routes by sample (:func:`sample_key`), on the host; the copies :meth:`later` was
        handed are waited for here, once (one device synchronisation, not one per micro-batch)."""
        if self._unread and self.wait is not None:
            self.wait()
        for finish in self._unread:
            self._old_routes.update(finish())
        self._unread = []
        return self._old_routes

    def later(self, finish: Callable[[], Iterable]) -> None:
        """Routes whose host copies are still on their way (:func:`~gspo_ascend.device.download`): ``finish`` turns
        them into ``(sample key, routes)`` pairs once :attr:`old_routes` has waited for the device."""
        self._unread.append(finish)

    def targets(self, batch, phase: str) -> tuple[list | None, list | None]:
        """(replay, compare) per-sample routes for a forward of ``phase`` over ``batch``."""
        rollout = batch.routed_experts
        if self.mode == "r3" and rollout is None:  # the rollout engines refuse r3 where they record none
            raise RuntimeError("actor.routing_replay=r3: this batch carries no routes from the rollout engine")
        if phase == "old":
            return (rollout if self.mode == "r3" else None), rollout
        old = self._old(batch)
        if self.mode == "r3":
            return rollout, old
        return (old if self.mode == "r2" else None), old

    def _old(self, batch) -> list | None:
        found = [self.old_routes.get(key) for key in sample_keys(batch)] if self.old_routes else []
        if self.mode == "r2" and (not found or any(r is None for r in found)):
            raise RuntimeError(
                "actor.routing_replay=r2: a sample of the update was not in this rank's last old-log-prob forward "
                "(the workers score each rank's update shard: workers.WorkerGroup.compute_log_probs)"
            )
        return found if found and all(r is not None for r in found) else None

    def remember_flat(self, batch, flat: torch.Tensor, starts, lengths) -> None:
        """:meth:`remember` for routes as the forward left them (:func:`flatten`'s layout, on the device): cast to the
        held dtype (one byte a route up to 256 experts) and copied to pinned host memory without waiting, so neither
        the device keeps a micro-batch's routes nor the host waits per micro-batch for them (issue #43); read when the
        update first asks (:attr:`old_routes`)."""
        keys, host = sample_keys(batch), download(flat.to(self.dtype))
        self.later(lambda: zip(keys, split(host, starts, lengths, self.dtype), strict=True))

    def remember(self, batch, routes: list[torch.Tensor]) -> None:
        self.old_routes.update(zip(sample_keys(batch), routes, strict=True))

    def metrics(self, all_reduce) -> dict[str, float]:
        """``routing/{rollout,update}_agreement_{mean,min_layer}`` over every rank (``all_reduce``: a list of
        floats -> their sums over ranks; a collective, so every rank calls it), then reset."""
        books = (self.rollout, self.update)
        local = []
        for book in books:
            book.add(self.layers - 1, 0, 0)  # every rank sends one value per layer
            local += book.numbers()
        summed = all_reduce(local).tolist()
        out: dict[str, float] = {}
        for i, name in enumerate(("rollout", "update")):
            part = summed[2 * i * self.layers : 2 * (i + 1) * self.layers]
            total = Agreement([int(v) for v in part[: self.layers]], [int(v) for v in part[self.layers :]])
            out.update(total.metrics(f"routing/{name}_agreement"))
        self.rollout, self.update = Agreement(), Agreement()
        return out
