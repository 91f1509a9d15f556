"""Per-device memory plan for one GSPO step: the training phase (Megatron or FSDP) and the rollout phase
(vLLM colocated on the same devices), against the device's memory, with a fits / tight / OOM verdict and
the three config changes that help most. Formulas and assumptions: docs/memory-planner.md.

One file because it is one closed-form model: every phase reads the same layout, element sizes and per-token
terms, and the knobs and the ``auto`` settings re-run it whole.

Peers size memory by trial and error (verl's and MindSpeed-RL's Ascend recipes lower batch sizes and
gpu_memory_utilization after OOMs, as the field reports describe); Megatron's own estimator covers only
its training side and knows nothing about a colocated vLLM. This planner is closed-form, so its numbers
can be checked by hand (tests/unit/test_planner.py does).
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field

from ..megatron_settings import grad_bytes_per_param
from .hardware import Profile
from .modelspec import ModelSpec
from .preflight import RULES, layout

GIB = 2**30
ELEMENT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
FITS_FRACTION = 0.9  # keep 10% of usable memory for fragmentation and communicator buffers
MIN_CONCURRENT_SEQUENCES = 32  # below this many full-length sequences in the KV cache, rollout crawls


@dataclass
class Phase:
    name: str  # training | rollout
    where: str  # which device: "last pipeline stage", "every device"
    parts: dict[str, int]  # component -> bytes
    notes: dict[str, str] = field(default_factory=dict)  # component -> how it was computed

    @property
    def total(self) -> int:
        return sum(self.parts.values())


@dataclass
class Knob:
    key: str
    old: object
    new: object
    score: float  # the plan's pressure after the change (<= 1 fits)
    pressure_sum: float  # training + rollout + KV pressures: orders knobs that reach the same score
    train_gib: float
    rollout_gib: float


@dataclass
class Plan:
    model: str
    hardware: str
    usable_bytes: int
    layout: str
    train: Phase
    rollout: Phase
    sync: Phase
    kv_tokens: int
    kv_sequences: float
    train_verdict: str
    rollout_verdict: str
    sync_verdict: str
    verdict: str
    score: float
    variants: dict[str, dict[str, int]]
    knobs: list[Knob] = field(default_factory=list)
    spec_note: str = ""  # set when the model came from a built-in spec (no local config.json)
    routes_host_bytes: int = 0  # an MoE rollout batch's routes on the host (routes_host_bytes)

    def as_dict(self) -> dict:
        out = asdict(self)
        for phase in ("train", "rollout", "sync"):
            out[phase]["total"] = getattr(self, phase).total
        return out


# ----------------------------------------------------------------------------------------------- training


def seq_len(cfg) -> int:
    return cfg.data.max_prompt_length + cfg.data.max_response_length


def ulysses_size(cfg) -> int:
    return cfg.actor.ulysses_sequence_parallel_size if cfg.actor.engine == "fsdp" else 1


def micro_tokens(cfg) -> int:
    """Tokens one device holds per micro-batch: padded samples, or the token budget; split by CP. With the fsdp
    engine's Ulysses SP the budget is already per device; micro_batch_size samples are split over the SP group."""
    a = cfg.actor
    if a.max_tokens_per_micro_batch:
        return a.max_tokens_per_micro_batch // a.context_parallel_size
    return (a.micro_batch_size or 1) * seq_len(cfg) // (a.context_parallel_size * ulysses_size(cfg))


def recompute_mode(cfg) -> str:
    """actor.recompute; the FSDP engine recomputes whole layers when model.gradient_checkpointing is on."""
    if cfg.actor.engine == "fsdp" and cfg.model.gradient_checkpointing:
        return "full"
    return cfg.actor.recompute


def layer_activation(cfg, spec: ModelSpec, i: int, tp: int) -> int:
    """Bytes kept for backward per token of the micro-batch by layer ``i`` (no recompute).

    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models") counted per
    element: norm inputs/outputs (h each, sharded only by sequence parallel), Q/K/V and the attention
    output (sharded by heads), the SwiGLU fc1 output [gate, up] and their product (sharded by TP). Routed
    experts keep, per token slot (top_k of them), the permuted input, fc1 output, product and output.
    No dropout masks (RL runs without dropout); flash attention keeps no s x s scores; eager attention adds
    the paper's 5 bytes per score (a s^2 b term) unless selective recompute drops it."""
    e, h = ELEMENT_BYTES[cfg.model.dtype], spec.hidden
    d = tp if cfg.actor.sequence_parallel and tp > 1 else 1
    q, kv = spec.heads_per_rank(tp)
    kv = max(kv, ulysses_size(cfg))  # Ulysses SP repeats KV heads up to SP before its all-to-all
    qkv = q + 2 * kv
    if cfg.actor.engine == "megatron" and tp > spec.kv_heads:
        # replicated KV heads: megatron-core 0.16 all-gathers the whole QKV projection over TP and slices this
        # rank's heads out of it as views, which the q / k norms and the core attention save, so all of it is kept
        # (measured on CPU, tiny Qwen3 at TP 2 over 1 KV head: one (heads + 2 KV) x head_dim storage per token)
        qkv = spec.heads + 2 * spec.kv_heads
    elements = 4 * h / d + spec.head_dim * (q + qkv)
    if spec.is_moe_layer(i):
        etp = cfg.actor.expert_tensor_parallel_size
        elements += spec.top_k * (2 * h + 3 * spec.moe_intermediate / etp) / d + 3 * spec.shared_intermediate / tp
    else:
        elements += 3 * spec.intermediate / tp
    scores = (
        5 * q * seq_len(cfg) if cfg.model.attn_implementation == "eager" and recompute_mode(cfg) != "selective" else 0
    )
    return int(e * elements) + scores


def activations(cfg, spec: ModelSpec, layers: range, tp: int, inflight: int) -> int:
    """1F1B keeps ``inflight`` micro-batches per stage; full recompute keeps only each layer's input plus one
    layer's working set during its recomputation."""
    tokens, e = micro_tokens(cfg), ELEMENT_BYTES[cfg.model.dtype]
    d = tp if cfg.actor.sequence_parallel and tp > 1 else 1
    if recompute_mode(cfg) == "full":
        kept = len(layers) * e * spec.hidden // d
        return inflight * kept * tokens + max(layer_activation(cfg, spec, i, tp) for i in layers) * tokens
    return inflight * sum(layer_activation(cfg, spec, i, tp) for i in layers) * tokens


def logits_bytes(cfg, spec: ModelSpec, tp: int) -> int:
    """Logits for the log-probs: model-dtype logits plus fp32 log-softmax, vocabulary sharded by TP. The fsdp
    engine takes its log-probs from the LM head's input in chunks of FUSED_CHUNK_ROWS rows
    (engines/fused_logprob.py): at most one chunk's logits in the model dtype and three fp32 [chunk, V] blocks
    (logits, softmax, a temporary) live, in backward; a model whose head is not a bias-free linear map (none of the
    planner's families) would take the full-logits path."""
    e, tokens = ELEMENT_BYTES[cfg.model.dtype], micro_tokens(cfg)
    if cfg.actor.engine == "fsdp":
        # over several chunks the head's weight gradient is summed in an fp32 [V, h] accumulator beside each chunk's
        # [V, h] product in the model dtype
        accumulate = (4 + e) * spec.vocab * spec.hidden if tokens > FUSED_CHUNK_ROWS else 0
        return min(tokens, FUSED_CHUNK_ROWS) * spec.vocab * (e + 12) + accumulate
    return tokens * (spec.vocab // tp) * (e + 4)


def routes_device_bytes(cfg, spec: ModelSpec, layers) -> int:
    """An MoE trainer's routing tensors for one micro-batch (engines/routing.py): the replayed and the compared
    routes, int64 [tokens, MoE layers, k] each (megatron: one [tokens, k] per router of the stage). Measured every MoE
    run (the agreement metrics), replay on or off."""
    moe = sum(spec.is_moe_layer(i) for i in layers)
    return 2 * 8 * micro_tokens(cfg) * moe * spec.top_k


def routes_host_bytes(cfg, spec: ModelSpec) -> int:
    """A rollout batch's routes on the hosts at full length, the whole job: the driver's batch (one byte a route up
    to 256 experts, two beyond: engines/routing.py route_dtype) and the trainer ranks' copies of the old forward's
    routes of their shards, which megatron keeps whole on every rank of a model-parallel group (TP x PP x CP)."""
    moe = sum(spec.is_moe_layer(i) for i in range(spec.layers))
    tokens = cfg.data.train_batch_size * cfg.rollout.n * seq_len(cfg)
    lay = layout(cfg)
    copies = lay.tp * lay.pp * lay.cp if cfg.actor.engine == "megatron" else 1
    return (1 + copies) * tokens * moe * spec.top_k * (1 if spec.experts <= 256 else 2)


# engines/fused_logprob.py's CHUNK_ROWS (the doctor imports no engine: a test holds the two equal)
FUSED_CHUNK_ROWS = 1024


def _optimizer_bytes_per_param(cfg) -> int:
    # bf16/fp16 training keeps an fp32 master copy (4) + Adam m, v (8); fp32 weights are their own master
    return 12 if ELEMENT_BYTES[cfg.model.dtype] == 2 else 8


# megatron-core's local spec kept unfused [S, S] attention scores without Transformer Engine: measured 2.45x this plan
# on an H100 (docs/results/gpu/README.md); the engine now runs SDPA there (engines/megatron_attention.py). Said on the
# line a user reads, not only in the docs.
FUSED_ATTENTION_NOTE = "fused attention assumed (TE or SDPA on GPU, flash on NPU: docs/memory-planner.md)"


def megatron_stage(cfg, spec: ModelSpec, stage: int) -> Phase:
    lay, e = layout(cfg), ELEMENT_BYTES[cfg.model.dtype]
    per_stage = -(-spec.layers // lay.pp)
    layers = range(stage * per_stage, min((stage + 1) * per_stage, spec.layers))
    first, last = stage == 0, stage == lay.pp - 1
    dense = sum(spec.attention_params(lay.tp) + spec.replicated_params(i) + spec.mlp_params(i, lay.tp) for i in layers)
    embed = spec.embedding_params // lay.tp
    dense += (embed if first else 0) + ((spec.hidden + (embed if not spec.tied or lay.pp > 1 else 0)) if last else 0)
    experts = sum(spec.expert_params(i) for i in layers) // (lay.ep * lay.etp)
    opt, grad = _optimizer_bytes_per_param(cfg), grad_bytes_per_param(e)
    distributed = cfg.actor.use_distributed_optimizer
    optimizer = (
        opt * (-(-dense // (lay.dp * lay.cp)) + -(-experts // lay.edp)) if distributed else opt * (dense + experts)
    )
    samples = cfg.actor.ppo_mini_batch_size * cfg.rollout.n // lay.dp
    n_micro = samples // (cfg.actor.micro_batch_size or 1) if cfg.actor.max_tokens_per_micro_batch is None else lay.pp
    inflight = max(min(lay.pp - stage, n_micro), 1)
    parts = {
        "weights": e * (dense + experts),
        "gradients": grad * (dense + experts),
        "optimizer": optimizer,
        "activations": activations(cfg, spec, layers, lay.tp, inflight),
        "logits": logits_bytes(cfg, spec, lay.tp) if last else 0,
        **({"routes": routes_device_bytes(cfg, spec, layers)} if spec.is_moe else {}),
    }
    shard = f"/ DP x CP {lay.dp * lay.cp} (experts / expert-DP {lay.edp})" if distributed else "not sharded"
    notes = {
        "weights": f"{dense:,} dense + {experts:,} expert params on this device",
        "gradients": f"{grad} B/param ({'fp32' if grad == 4 else 'model dtype'}: the engine's DDP setting)",
        "optimizer": f"{opt} B/param {shard}",
        "activations": f"{len(layers)} layers x {inflight} micro-batch(es) of {micro_tokens(cfg)} tokens, "
        f"recompute {recompute_mode(cfg)}, {FUSED_ATTENTION_NOTE}",
    }
    where = "only pipeline stage" if lay.pp == 1 else ("first" if first else "last") + " pipeline stage"
    return Phase("training", where, parts, notes)


# actor.fsdp_reshard_after_forward=auto keeps the layers gathered when the plan with them gathered (and their fp32
# gradients unsharded) stays within this share of the device: the rest is the margin the plan does not see
# (allocator fragmentation, the communicators on GPU)
KEEP_GATHERED_SHARE = 0.8


def fsdp_train(cfg, spec: ModelSpec, usable: int | None = None, world: int | None = None) -> Phase:
    """FSDP2: fp32 params, fp32 grads and Adam sharded over every rank (16 B/param / world); the working set is,
    resharding after forward (ZeRO-3), the gathered root (embeddings, final norm, lm_head) plus two layers (current +
    prefetch), or, keeping the layers gathered (:func:`fsdp_keeps_gathered`), every parameter in the compute dtype
    and the minibatch's gradients accumulated unsharded in fp32 until its last micro-batch."""
    lay, e, p = layout(cfg), ELEMENT_BYTES[cfg.model.dtype], spec.total_params
    world = world or lay.world
    sp_note = f" (Ulysses SP {lay.sp}: this device's 1/{lay.sp} of the group's row)" if lay.sp > 1 else ""
    kept = fsdp_keeps_gathered(cfg, spec, usable, world)
    root = spec.embedding_params * (1 if spec.tied else 2) + spec.hidden
    layers = spec.layers if kept else 2
    # kept gathered: the unsharded fp32 gradients too (transient: freed by the minibatch's reduce-scatter)
    gathered = e * (root + layers * max(spec.layer_params(i) for i in range(spec.layers))) + (4 * p if kept else 0)
    parts = {
        "weights": -(-4 * p // world),
        "gradients": -(-4 * p // world),
        "optimizer": -(-8 * p // world),
        "gathered": gathered,
        "activations": activations(cfg, spec, range(spec.layers), 1, 1),
        "logits": logits_bytes(cfg, spec, 1),
        **({"routes": routes_device_bytes(cfg, spec, range(spec.layers))} if spec.is_moe else {}),
    }
    notes = {
        "weights": f"fp32 shards of {p:,} params over {world} ranks",
        "gathered": (
            "every layer, kept gathered, + the fp32 gradients the micro-batches accumulate unsharded"
            if kept
            else "root (embeddings, lm_head) + 2 layers in the compute dtype"
        )
        + f" (actor.fsdp_reshard_after_forward={cfg.actor.fsdp_reshard_after_forward})",
        "activations": f"{spec.layers} layers x 1 micro-batch of {micro_tokens(cfg)} tokens, "
        f"recompute {recompute_mode(cfg)}{sp_note}",
    }
    return Phase("training", "every device", parts, notes)


def fsdp_keeps_gathered(cfg, spec: ModelSpec, usable: int | None, world: int) -> bool:
    """``actor.fsdp_reshard_after_forward`` resolved: ``off`` keeps every layer gathered from its forward through
    the minibatch's last backward (no re-gather per micro-batch, one gradient reduce-scatter per minibatch);
    ``on`` reshards (ZeRO-3). ``auto``: gathered wherever the plan with the layers gathered fits in
    KEEP_GATHERED_SHARE of the device's memory (``usable``: its total bytes, what the engine reads at run time, so
    plan and engine decide alike); where that is unknown (the host), gathered on one rank only."""
    mode = cfg.actor.fsdp_reshard_after_forward
    if mode != "auto":
        return mode == "off"
    if usable is None:  # no device memory to plan by (the host): keep them where sharding saves nothing
        return world == 1
    kept = with_value(cfg, "actor.fsdp_reshard_after_forward", "off")
    return fsdp_train(kept, spec, usable, world).total <= KEEP_GATHERED_SHARE * usable


# actor.max_tokens_per_micro_batch=auto: the largest budget, a multiple of TOKEN_BUDGET_STEP tokens, whose training
# phase (with the training communicators' buffers on NPU) stays within TOKEN_BUDGET_SHARE of the device; never below
# one full sequence a device, never above a DP rank's whole minibatch (megatron: a 1 / PP of it). The share is below
# KEEP_GATHERED_SHARE because the budget fills it: the last lent GPU measured fsdp's peak at 1.25x this plan (4k
# budget, docs/results/gpu), and 0.7 x 1.25 leaves 12.5% for fragmentation and the communicators. Without device
# memory (the host) HOST_TOKEN_BUDGET.
TOKEN_BUDGET_KEY = "actor.max_tokens_per_micro_batch"
TOKEN_BUDGET_STEP = 1024
TOKEN_BUDGET_SHARE = 0.7
HOST_TOKEN_BUDGET = 8192
RESHARD_KEY = "actor.fsdp_reshard_after_forward"


def token_budget(cfg, spec: ModelSpec, total: int | None, npu: bool) -> tuple[int, str | None, str]:
    """``actor.max_tokens_per_micro_batch=auto`` resolved for a device of ``total`` bytes: (tokens, fsdp's layout,
    how). With ``actor.fsdp_reshard_after_forward: auto`` too the budget decides it: the layout that allows the
    largest budget, layers kept gathered on a tie (``off``; ``on`` = ZeRO-3); None for megatron or a layout the
    config fixes. The plan and the engines call this alike (the engine with what its runtime reports)."""
    step, lay = TOKEN_BUDGET_STEP, layout(cfg)
    per_device = -(-seq_len(cfg) // ulysses_size(cfg))  # the budget is per device; Ulysses splits a sequence over SP
    floor = -(-per_device // step) * step
    fsdp_auto = cfg.actor.engine == "fsdp" and cfg.actor.fsdp_reshard_after_forward == "auto"
    layouts = ["off", "on"] if fsdp_auto else [None]
    if total is None:
        return max(floor, HOST_TOKEN_BUDGET), None, "no device memory to size it by (the host)"
    samples = max(cfg.actor.ppo_mini_batch_size * cfg.rollout.n // lay.dp, 1)
    # megatron's pipeline overlaps stages only across micro-batches: at most 1 / PP of the minibatch each
    stages = lay.pp if cfg.actor.engine == "megatron" else 1
    ceiling = max(-(-samples * per_device // (stages * step)) * step, floor)
    extra = communicator_bytes(training_communicators(cfg, spec)) if npu else 0
    limit = TOKEN_BUDGET_SHARE * total

    def peak(budget: int, mode: str | None) -> int:
        fixed = with_value(cfg, RESHARD_KEY, mode) if mode else cfg
        return train_phase(with_value(fixed, TOKEN_BUDGET_KEY, budget), spec, total).total + extra

    best: tuple[int, str | None] | None = None
    for mode in layouts:  # within one layout the peak grows with the budget: the largest that fits, by bisection
        low, high = floor // step - 1, ceiling // step  # low - 1: nothing fits
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if peak(mid * step, mode) <= limit else (low, mid - 1)
        if low * step >= floor and (best is None or low * step > best[0]):
            best = (low * step, mode)
    if best is None:
        need = min(peak(floor, mode) for mode in layouts) / GIB
        return floor, layouts[-1], f"one full sequence a micro-batch; the training phase needs {need:.1f} GiB even so"
    budget, mode = best
    kept = {"off": ", layers kept gathered", "on": ", ZeRO-3"}.get(mode or "", "")
    return budget, mode, f"training {peak(budget, mode) / GIB:.1f} GiB of the device's {total / GIB:.1f} GiB{kept}"


def resolved_budget(cfg, spec: ModelSpec, total: int | None, npu: bool):
    """``cfg`` with an ``auto`` token budget replaced by :func:`token_budget`'s, and fsdp's ``auto`` layout by the
    one it chose (the same config otherwise)."""
    if cfg.actor.max_tokens_per_micro_batch != "auto":
        return cfg
    budget, mode, _ = token_budget(cfg, spec, total, npu)
    out = with_value(cfg, TOKEN_BUDGET_KEY, budget)
    return with_value(out, RESHARD_KEY, mode) if mode else out


def train_phase(cfg, spec: ModelSpec, usable: int | None = None) -> Phase:
    if cfg.actor.engine == "fsdp":
        return fsdp_train(cfg, spec, usable)
    stages = {0, layout(cfg).pp - 1}
    return max((megatron_stage(cfg, spec, s) for s in sorted(stages)), key=lambda ph: ph.total)


def static_bytes(phase: Phase) -> int:
    return phase.parts["weights"] + phase.parts["gradients"] + phase.parts["optimizer"]


# ----------------------------------------------------------------------------------------------- rollout


def rollout_weights(cfg, spec: ModelSpec) -> int:
    """vLLM shards attention, MLPs, experts (TP or EP = TP) and the vocabulary over rollout TP."""
    rt, e = cfg.rollout.tensor_parallel_size, ELEMENT_BYTES[cfg.model.dtype]
    params = sum(
        spec.attention_params(rt) + spec.replicated_params(i) + spec.mlp_params(i, rt) + spec.expert_params(i) // rt
        for i in range(spec.layers)
    )
    params += spec.embedding_params // rt * (1 if spec.tied else 2) + spec.hidden
    return e * params


def rollout_workspace(cfg, spec: ModelSpec) -> int:
    """vLLM's profiled activation peak, approximated: per batched token the residual, hidden and norm
    buffers (4h) and the MLP's fc1 output + product (3 x the active intermediate width / TP)."""
    rt, e = cfg.rollout.tensor_parallel_size, ELEMENT_BYTES[cfg.model.dtype]
    dense = spec.intermediate if not all(spec.moe_layer_flags or [False]) else 0
    moe = spec.top_k * spec.moe_intermediate + spec.shared_intermediate if spec.is_moe else 0
    width = max(dense, moe)
    return cfg.rollout.max_num_batched_tokens * e * int(4 * spec.hidden + 3 * width / rt)


def kv_bytes_per_token(cfg, spec: ModelSpec) -> int:
    _, kv = spec.heads_per_rank(cfg.rollout.tensor_parallel_size)
    return 2 * spec.layers * kv * spec.head_dim * ELEMENT_BYTES[cfg.model.dtype]


# HCCL's default HCCL_BUFFSIZE (MB; env/npu does not set it); each communicator holds 2 x this on every member
# (../shared/reference/npu_api.md). HCCL creates a communicator on a group's first collective.
HCCL_BUFFSIZE_MB = 200


def vllm_charged_hccl(cfg, hw: Profile) -> int:
    """The HCCL buffers vllm-ascend 0.23 charges to its KV budget. Its ``determine_available_memory``
    (worker/worker.py:527-598) runs vLLM's ``memory_profiling`` from the snapshot taken at start (``init_snapshot``,
    worker.py:466-469, before ``_init_worker_distributed_environment`` at 497): non-KV memory = weights + the torch
    peak of the profiling run + the non-torch memory that *grew* since that snapshot, out of
    ``gpu_memory_utilization x total``. What was on the device before the snapshot (the runtime's reservation, the
    trainer's communicators made so far) is not charged: it sits outside the budget (the phase counts training's
    communicators on top: :func:`_add_communicators`). What grows after it is: vLLM's TP group's communicator, made
    in its distributed set-up. vllm-ascend 0.11 charged every non-torch byte (its worker_v1.py), the runtime's
    reservation and the world group included. vLLM on CUDA charges what grows since its snapshot too, but NCCL's
    buffers are not planned (docs/memory-planner.md): 0."""
    if hw.platform != "npu":
        return 0
    return (cfg.rollout.tensor_parallel_size > 1) * 2 * HCCL_BUFFSIZE_MB * 2**20


def training_communicators(cfg, spec: ModelSpec) -> list[str]:
    """The process groups of more than one rank a trainer device runs collectives in during a step. HCCL makes a
    communicator for a group on its first collective and keeps it: 2 x HCCL_BUFFSIZE on every member, never
    released (../shared/reference/upstream-audit-3.md section 3). megatron-core's parallel_state.py creates dp and
    dp-cp as separate groups even at CP 1, and tp, pp, mp (grad norm, our shard gathers), ep and the expert-dp of
    the distributed optimizer; the world group carries our barriers, and colocated, vLLM's TP group is in the same
    process. FSDP: its world mesh and Ulysses' SP group."""
    lay = layout(cfg)
    if cfg.actor.engine == "fsdp":
        groups = {"world": lay.world, "ulysses sp": lay.sp}
    else:
        groups = {"world": lay.world, "tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "dp-cp": lay.dp * lay.cp,
                  "mp": lay.tp * lay.pp}  # fmt: skip
        if spec.is_moe:
            groups |= {"ep": lay.ep, "expert dp": lay.edp}
    if not disaggregated(cfg):
        groups["vllm tp"] = cfg.rollout.tensor_parallel_size
    return [name for name, size in groups.items() if size > 1]


def communicator_bytes(groups: list[str]) -> int:
    return len(groups) * 2 * HCCL_BUFFSIZE_MB * 2**20


def disaggregated(cfg) -> bool:
    """A rollout pool (pools.py): its devices hold no actor state, the trainer's no KV cache."""
    return cfg.rollout_pool.devices_per_node > 0


def rollout_phase(cfg, spec: ModelSpec, hw: Profile, train: Phase) -> tuple[Phase, int]:
    budget = int(cfg.rollout.gpu_memory_utilization * hw.hbm_mib * 2**20)
    weights, workspace = rollout_weights(cfg, spec), rollout_workspace(cfg, spec)
    residue = 0 if cfg.actor.offload or disaggregated(cfg) else static_bytes(train)
    comms = vllm_charged_hccl(cfg, hw)
    kv_cache = budget - weights - workspace - comms
    parts = {"actor state": residue, "weights": weights, "workspace": workspace, "kv cache": kv_cache}
    kept = "offloaded to host (actor.offload=true)" if cfg.actor.offload else "weights + grads + optimizer stay"
    if disaggregated(cfg):
        kept = "none: a rollout pool's devices hold no actor (rollout_pool.devices_per_node)"
    notes = {
        "actor state": kept,
        "kv cache": f"gpu_memory_utilization {cfg.rollout.gpu_memory_utilization} x HBM - weights - workspace",
    }
    if comms:  # the runtime's reservation is outside usable memory already, and outside vLLM's 0.23 budget
        parts = {**parts, "hccl buffers": comms}
        notes["kv cache"] += " - vLLM TP's HCCL buffers (vllm-ascend charges non-torch memory grown since its start)"
        notes["hccl buffers"] = f"vLLM TP communicator x 2 x {HCCL_BUFFSIZE_MB} MB"
    where = "every rollout-pool device" if disaggregated(cfg) else "every device"
    phase = Phase("rollout", f"{where}, vLLM TP {cfg.rollout.tensor_parallel_size}", parts, notes)
    return phase, max(kv_cache, 0) // kv_bytes_per_token(cfg, spec)


def export_bytes(cfg, spec: ModelSpec) -> int:
    """The export's largest transient on the device, an upper bound. megatron: mbridge gathers one tensor at a time
    (TP / EP shards); our HFLayout fuses a layer's experts into transformers' [E, ...] tensors, so a layer's experts
    are there twice (gathered and fused), or the full embedding. fsdp: one full tensor, gathered (fp32) and cast."""
    e = ELEMENT_BYTES[cfg.model.dtype]
    experts = max(spec.expert_params(i) for i in range(spec.layers))
    if cfg.actor.engine == "fsdp":
        return (4 + e) * max(spec.embedding_params, experts)
    return e * max(2 * experts, spec.embedding_params)


def sync_phase(cfg, spec: ModelSpec, train: Phase, comms: int = 0) -> Phase:
    """The weight sync (workers.PolicyWorker.sync_weights): the rollout engine's weights woken, its KV cache still
    asleep; the train engine's parameters brought up for the export (with actor.offload; without it, its whole
    state stays), and the export's transient. With a rollout pool the two sides are different devices: the larger
    of the trainer's (its state, the export, one bucket) and the rollout's (its weights, one bucket). ``comms``:
    the trainer's communicator buffers (NPU)."""
    kept = train.parts["weights"] if cfg.actor.offload else static_bytes(train)
    if disaggregated(cfg):
        return _pool_sync_phase(cfg, spec, kept, comms)
    parts = {"actor state": kept, "export": export_bytes(cfg, spec), "rollout": rollout_weights(cfg, spec)}
    parts |= {"hccl buffers": comms} if comms else {}  # training's communicators: kept
    notes = {
        "actor state": "parameters only (actor.offload=true)" if cfg.actor.offload else "weights + grads + optimizer",
        "export": "a layer's experts gathered + fused, or the full embedding"
        if cfg.actor.engine == "megatron"
        else "one full tensor, fp32 + cast",
        "rollout": "the rollout engine's weights, woken; its KV cache stays asleep until the sync is done",
        "hccl buffers": "training's communicators, kept",
    }
    return Phase("sync", "every device", parts, notes)


def _pool_sync_phase(cfg, spec: ModelSpec, kept: int, comms: int) -> Phase:
    # weight_sync.py: one flat bucket at a time, on the device; a tensor larger than a bucket travels alone, packed
    # by a copy (torch.cat): the largest HF tensor, the embedding (or lm_head), bounds it
    largest = ELEMENT_BYTES[cfg.model.dtype] * spec.embedding_params
    bucket = max(cfg.rollout_pool.sync_bucket_mb << 20, largest)
    state = "parameters only (actor.offload=true)" if cfg.actor.offload else "weights + grads + optimizer"
    trainer = Phase(
        "sync",
        "trainer rank 0 (disaggregated)",
        {"actor state": kept, "export": export_bytes(cfg, spec), "bucket": bucket}
        | ({"hccl buffers": comms} if comms else {}),
        {
            "actor state": state,
            "export": "the export's transient",
            "bucket": "rollout_pool.sync_bucket_mb, or the embedding packed alone when larger",
        },
    )
    rollout = Phase(
        "sync",
        "every rollout-pool device (disaggregated)",
        {"rollout": rollout_weights(cfg, spec), "bucket": bucket},
        {"rollout": "the rollout engine's weights; its KV cache asleep", "bucket": "the bucket being received"},
    )
    return max(trainer, rollout, key=lambda ph: ph.total)


# ----------------------------------------------------------------------------------------------- verdicts


def _verdict(pressure: float) -> str:
    return "fits" if pressure <= 1 else "tight" if pressure <= 1 / FITS_FRACTION else "OOM"


def _pressures(cfg, train: Phase, rollout: Phase, sync: Phase, kv_tokens: int, usable: int) -> tuple[float, ...]:
    """Training, rollout, KV and sync pressures, each 1.0 at the edge of 'fits'; the KV term needs room for
    min(sequences per engine, 32) sequences."""
    from ..config import rollout_world

    engines = max(rollout_world(cfg) // cfg.rollout.tensor_parallel_size, 1)
    wanted = min(cfg.data.train_batch_size * cfg.rollout.n / engines, MIN_CONCURRENT_SEQUENCES)
    kv_need = wanted * seq_len(cfg) / max(kv_tokens, 1)
    if kv_tokens < seq_len(cfg):  # vLLM refuses to start: max_model_len does not fit the KV cache
        kv_need = max(kv_need, 1 / FITS_FRACTION + 1)
    fits = FITS_FRACTION * usable
    return train.total / fits, rollout.total / fits, kv_need, sync.total / fits


def _add_communicators(cfg, spec: ModelSpec, train: Phase, rollout: Phase) -> int:
    """The training communicators' HCCL buffers (training_communicators) on a trainer device's training and rollout
    phases; returns their bytes, for the sync. Made on each group's first collective and kept. vllm-ascend 0.23
    charges its KV budget only what grew since its start snapshot (vllm_charged_hccl), so on a colocated device
    every training communicator but vLLM's own TP group (in its "hccl buffers") comes on top of the rollout
    phase's budget, made before vLLM started or after it sized its KV cache. A rollout pool's devices hold none."""
    groups = training_communicators(cfg, spec)
    comms = communicator_bytes(groups)
    train.parts["hccl buffers"] = comms
    train.notes["hccl buffers"] = f"{len(groups)} communicators ({', '.join(groups)}) x 2 x {HCCL_BUFFSIZE_MB} MB"
    outside = [g for g in groups if g != "vllm tp"]
    if outside and not disaggregated(cfg):
        rollout.parts["train hccl"] = communicator_bytes(outside)
        rollout.notes["train hccl"] = f"{', '.join(outside)}: training's, outside vLLM's budget"
    return comms


def evaluate(cfg, spec: ModelSpec, hw: Profile) -> Plan:
    usable = (hw.hbm_mib - hw.reserved_mib) * 2**20
    auto = cfg.actor.max_tokens_per_micro_batch == "auto"
    cfg = resolved_budget(cfg, spec, hw.hbm_mib * 2**20, hw.platform == "npu")  # as the engine sizes it
    train = train_phase(cfg, spec, hw.hbm_mib * 2**20)  # fsdp_keeps_gathered: the device's total, as the engine
    rollout, kv_tokens = rollout_phase(cfg, spec, hw, train)
    comms = _add_communicators(cfg, spec, train, rollout) if hw.platform == "npu" else 0
    if auto:
        train.notes["activations"] += f" ({TOKEN_BUDGET_KEY}=auto)"
    sync = sync_phase(cfg, spec, train, comms)
    p_train, p_roll, p_kv, p_sync = _pressures(cfg, train, rollout, sync, kv_tokens, usable)
    lay = layout(cfg)
    kind = f"MoE, {spec.active_params / 1e9:.2f}B active" if spec.is_moe else "dense"
    desc = (
        f"world {lay.world} = TP {lay.tp} x PP {lay.pp} x CP {lay.cp}{lay.sp_text} x DP {lay.dp}; "
        f"EP {lay.ep} x ETP {lay.etp} (expert DP {lay.edp}); rollout TP {cfg.rollout.tensor_parallel_size}; "
        f"engine {cfg.actor.engine}"
    )
    if disaggregated(cfg):
        pool = cfg.rollout_pool
        desc += f"; rollout pool {pool.nnodes} x {pool.devices_per_node} (its own devices)"
    return Plan(
        model=f"{spec.model_type} ({spec.total_params / 1e9:.2f}B params, {kind}) from {spec.source}",
        hardware=f"{hw.title}: {hw.hbm_mib} MiB per device, {usable / GIB:.1f} GiB usable",
        usable_bytes=usable,
        layout=desc,
        train=train,
        rollout=rollout,
        sync=sync,
        kv_tokens=kv_tokens,
        kv_sequences=kv_tokens / seq_len(cfg),
        train_verdict=_verdict(p_train),
        rollout_verdict=_verdict(max(p_roll, p_kv)),
        sync_verdict=_verdict(p_sync),
        verdict=_verdict(max(p_train, p_roll, p_kv, p_sync)),
        score=max(p_train, p_roll, p_kv, p_sync),
        variants={},
        spec_note=spec.note,
        routes_host_bytes=routes_host_bytes(cfg, spec) if spec.is_moe else 0,
    )


# ----------------------------------------------------------------------------------------------- knobs

# (key, proposal) pairs: each proposes a new value for the key or None when it does not apply.
KNOBS = (
    ("actor.recompute", lambda c: "full" if c.actor.engine == "megatron" and c.actor.recompute != "full" else None),
    (
        "model.gradient_checkpointing",
        lambda c: True if recompute_mode(c) != "full" and c.actor.engine == "fsdp" else None,
    ),
    ("actor.micro_batch_size", lambda c: c.actor.micro_batch_size // 2 if _micro_mode(c) else None),
    ("actor.max_tokens_per_micro_batch", lambda c: _halved(c.actor.max_tokens_per_micro_batch)),
    ("actor.use_distributed_optimizer", lambda c: True if not c.actor.use_distributed_optimizer else None),
    (
        "actor.sequence_parallel",
        lambda c: True if c.actor.tensor_parallel_size > 1 and not c.actor.sequence_parallel else None,
    ),
    ("actor.offload", lambda c: True if not c.actor.offload else None),
    ("actor.tensor_parallel_size", lambda c: _megatron(c, c.actor.tensor_parallel_size * 2)),
    ("actor.pipeline_parallel_size", lambda c: _megatron(c, c.actor.pipeline_parallel_size * 2)),
    ("actor.expert_parallel_size", lambda c: _megatron(c, c.actor.expert_parallel_size * 2)),
    ("actor.context_parallel_size", lambda c: _megatron(c, c.actor.context_parallel_size * 2)),
    ("actor.ulysses_sequence_parallel_size", lambda c: _ulysses(c, c.actor.ulysses_sequence_parallel_size * 2)),
    ("rollout.gpu_memory_utilization", lambda c: _util(c, -0.1)),
    ("rollout.gpu_memory_utilization", lambda c: _util(c, +0.1)),
    ("rollout.tensor_parallel_size", lambda c: c.rollout.tensor_parallel_size * 2),
)


def _halved(budget) -> int | None:
    return (budget // 2 or None) if isinstance(budget, int) else None  # auto sizes itself


def _micro_mode(cfg) -> bool:
    return cfg.actor.max_tokens_per_micro_batch is None and (cfg.actor.micro_batch_size or 0) > 1


def _megatron(cfg, value: int) -> int | None:
    return value if cfg.actor.engine == "megatron" else None


def _ulysses(cfg, value: int) -> int | None:
    return value if cfg.actor.engine == "fsdp" and cfg.actor.use_remove_padding else None


def _util(cfg, delta: float) -> float | None:
    value = round(cfg.rollout.gpu_memory_utilization + delta, 2)
    return value if 0.1 <= value <= 0.95 else None


def with_value(cfg, dotted: str, value):
    out = copy.deepcopy(cfg)
    section, name = dotted.split(".")
    setattr(getattr(out, section), name, value)
    return out


def _objections(cfg, spec: ModelSpec) -> set[tuple[str, str]]:
    return {(c.name, c.status) for rule in RULES for c in rule(cfg, spec) if c.status != "ok"}


def _legal(candidate, spec: ModelSpec, base: set[tuple[str, str]]) -> bool:
    """A knob must not break a preflight rule nor add a warning the config did not already have."""
    return _objections(candidate, spec) <= base


def best_knobs(cfg, spec: ModelSpec, hw: Profile, base: Plan, count: int = 3) -> list[Knob]:
    found, objections = [], _objections(cfg, spec)
    for dotted, propose in KNOBS:
        value = propose(cfg)
        if value is None:
            continue
        candidate = with_value(cfg, dotted, value)
        if not _legal(candidate, spec, objections):
            continue
        after = evaluate(candidate, spec, hw)
        if after.score < base.score - 1e-9:
            section, name = dotted.split(".")
            old = getattr(getattr(cfg, section), name)
            total = sum(
                _pressures(candidate, after.train, after.rollout, after.sync, after.kv_tokens, after.usable_bytes)
            )
            found.append(
                Knob(dotted, old, value, after.score, total, after.train.total / GIB, after.rollout.total / GIB)
            )
    return sorted(found, key=lambda k: (k.score, k.pressure_sum))[:count]


def plan(cfg, spec: ModelSpec, hw: Profile) -> Plan:
    result = evaluate(cfg, spec, hw)
    flip_opt = with_value(cfg, "actor.use_distributed_optimizer", not cfg.actor.use_distributed_optimizer)
    flip_off = with_value(cfg, "actor.offload", not cfg.actor.offload)
    opt_other, off_other = evaluate(flip_opt, spec, hw), evaluate(flip_off, spec, hw)
    result.variants = {
        "rollout total by actor.offload": {
            _show(cfg.actor.offload): result.rollout.total,
            _show(not cfg.actor.offload): off_other.rollout.total,
        },
    }
    if cfg.actor.engine == "megatron":  # FSDP always shards the optimizer
        result.variants["training peak by actor.use_distributed_optimizer"] = {
            _show(cfg.actor.use_distributed_optimizer): result.train.total,
            _show(not cfg.actor.use_distributed_optimizer): opt_other.train.total,
        }
    result.knobs = best_knobs(cfg, spec, hw, result)
    return result


# ----------------------------------------------------------------------------------------------- text


def _show(value) -> str:
    """A value as a YAML / dotted override spells it."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def _gib(n: int) -> str:
    return f"{n / GIB:8.2f}"


def render_text(p: Plan) -> str:
    lines = [f"gspo-ascend plan: {p.model}"]
    lines += [f"note: {p.spec_note}"] if p.spec_note else []
    lines += [f"hardware: {p.hardware}", f"layout: {p.layout}", ""]
    for phase, verdict in ((p.train, p.train_verdict), (p.rollout, p.rollout_verdict), (p.sync, p.sync_verdict)):
        lines.append(f"{phase.name} ({phase.where}), GiB per device:")
        for name, value in phase.parts.items():
            note = phase.notes.get(name, "")
            lines.append(f"  {name:<12}{_gib(value)}" + (f"   {note}" if note else ""))
        share = 100 * phase.total / p.usable_bytes
        lines.append(f"  {'total':<12}{_gib(phase.total)}   {verdict} ({share:.0f}% of usable)")
        if phase is p.rollout:
            lines.append(f"  KV cache holds {p.kv_tokens:,} tokens = {p.kv_sequences:.1f} full-length sequences")
    for what, values in p.variants.items():
        lines.append(f"  {what}: " + ", ".join(f"{k} -> {v / GIB:.2f} GiB" for k, v in values.items()))
    if p.routes_host_bytes:
        lines.append(
            f"  MoE routes on the hosts, the whole job, per rollout batch at full length: "
            f"{p.routes_host_bytes / GIB:.2f} GiB (the batch and the trainer ranks' copies; docs/memory-planner.md)"
        )
    lines += ["", f"verdict: {p.verdict}"]
    if p.knobs:
        lines.append("knobs that help most (as overrides):")
        for k in p.knobs:
            lines.append(
                f"  {k.key}={_show(k.new)}  (was {_show(k.old)}; training {k.train_gib:.2f} GiB, "
                f"rollout {k.rollout_gib:.2f} GiB, verdict {_verdict(k.score)})"
            )
    return "\n".join(lines)


def plan_from_config(path: str | None, overrides=(), hardware: str = "auto") -> Plan:
    """``gspo-ascend plan``: load and validate the config, refuse layouts the preflight rejects (their
    numbers would be meaningless), then plan."""
    from .. import config as config_mod
    from ..errors import UserError
    from .hardware import resolve_profile
    from .modelspec import load_spec
    from .preflight import failures, pools_check, preflight

    cfg = config_mod.load_config(path, overrides)
    if not cfg.model.path:
        raise UserError(
            "plan needs model.path: a local HF model directory with config.json, or a model with a built-in spec "
            "(docs/memory-planner.md lists them; the embedded tiny model is '')"
        )
    spec = load_spec(cfg.model.path)
    hw = resolve_profile(hardware, cfg)
    # the target's devices per node are known here (a named profile), not in the config: the pools must fit them
    pools = pools_check(cfg, hw.devices_per_node, hw.key) if hw.key != "cpu" else []
    bad = failures(preflight(cfg) + pools)
    if bad:
        more = f" (and {len(bad) - 1} more; see `gspo-ascend doctor --config`)" if len(bad) > 1 else ""
        fix = f"; fix: {bad[0].fix}" if bad[0].fix else ""
        raise UserError(f"{bad[0].name}: {bad[0].finding}{fix}{more}")
    return plan(cfg, spec, hw)
