"""Config preflight: the parallel layout, batch arithmetic and sequence lengths checked against the model's
config.json before anything is launched. Run by ``gspo-ascend doctor --config``, ``train --dry-run`` and
(later) the trainer's start.

Each rule restates the check the framework would make minutes into a job (often after Ray, vLLM and
Megatron have started on every node) and cites that framework's own message: Megatron's
``num_query_groups (4) must be a multiple of tensor_model_parallel_size (8)``, the MoE folding assertion
in ``parallel_state.initialize_model_parallel``, the micro-batch assertion of
``num_microbatches_calculator``. verl and MindSpeed-RL discover these at run time; nothing in the peers
checks them up front against the model's own config.json.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .. import megatron_settings
from ..errors import UserError
from .check import Check
from .modelspec import ModelSpec, load_spec

MC2_TP_A2 = (2, 4, 8)  # torch_npu MC2 all_gather_matmul on Atlas A2; A3 allows up to 32


@dataclass(frozen=True)
class Layout:
    world: int
    tp: int
    pp: int
    cp: int
    ep: int
    etp: int
    sp: int = 1  # Ulysses sequence parallel (fsdp engine): SP ranks share samples like TP / CP ranks

    @property
    def dense_parallel(self) -> int:
        return self.tp * self.pp * self.cp * self.sp

    @property
    def sp_text(self) -> str:
        return f" x SP {self.sp}" if self.sp > 1 else ""

    @property
    def dp(self) -> int:
        return max(self.world // self.dense_parallel, 1)

    @property
    def edp(self) -> int:
        """Expert data parallel: the ranks that hold the same experts (shard the experts' optimizer)."""
        return max(self.world // (self.etp * self.ep * self.pp), 1)


def layout(cfg) -> Layout:
    a = cfg.actor
    world = cfg.trainer.nnodes * cfg.trainer.devices_per_node
    return Layout(
        world,
        a.tensor_parallel_size,
        a.pipeline_parallel_size,
        a.context_parallel_size,
        a.expert_parallel_size,
        a.expert_tensor_parallel_size,
        a.ulysses_sequence_parallel_size,
    )


def divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _check(name: str, problem: str | None, ok: str, fix: str, status: str = "fail") -> Check:
    if problem:
        return Check(f"preflight:{name}", status, problem, fix)
    return Check(f"preflight:{name}", "ok", ok)


# ----------------------------------------------------------------------------------------------- rules


def rule_world(cfg, spec: ModelSpec | None) -> Iterable[Check]:
    lay = layout(cfg)
    bad = lay.world % lay.dense_parallel
    yield _check(
        "world",
        f"world {lay.world} (trainer.nnodes x trainer.devices_per_node) is not divisible by actor TP x PP x CP"
        f"{' x SP' if lay.sp > 1 else ''} = {lay.tp}x{lay.pp}x{lay.cp}{f'x{lay.sp}' if lay.sp > 1 else ''} = "
        f"{lay.dense_parallel}"
        if bad
        else None,
        f"world {lay.world} = TP {lay.tp} x PP {lay.pp} x CP {lay.cp}{lay.sp_text} x DP {lay.dp}",
        "choose actor.tensor/pipeline/context_parallel_size"
        + (" and actor.ulysses_sequence_parallel_size" if lay.sp > 1 else "")
        + f" whose product divides {lay.world}",
    )


_INSTALLED = object()  # rule_heads: the megatron-core installed here, unless doctor --versions plans another


def rule_heads(cfg, spec: ModelSpec | None, megatron_core: str | None | object = _INSTALLED) -> Iterable[Check]:
    """Megatron (ValueError in TransformerConfig): heads split evenly over TP, and so do the KV heads, or TP over
    them where megatron-core replicates them (0.16 on: megatron_settings.replicates_kv_heads). ``megatron_core``:
    the version to judge by (None: not known), by default the installed one's."""
    tp = cfg.actor.tensor_parallel_size
    if spec is None or cfg.actor.engine != "megatron" or tp == 1:
        return
    if spec.heads % tp:
        yield _check(
            "heads",
            f"num_attention_heads ({spec.heads}) must be a multiple of tensor_model_parallel_size ({tp}) "
            f"({spec.source}, actor.tensor_parallel_size)",
            "",
            f"set actor.tensor_parallel_size to a divisor of {spec.heads}",
        )
        return
    kv = spec.kv_heads
    # megatron-core >= 0.16 replicates KV heads over a TP that is a multiple of them (CPU, CUDA and, under MindSpeed
    # core_r0.16.0, the NPU: tests/mindspeed ms_dense_tp2_kv1); the installed (or planned) release decides, and
    # where none is known the rule is said as a warning: the cluster's release decides
    version = megatron_settings.megatron_core_version() if megatron_core is _INSTALLED else megatron_core
    layout = megatron_settings.kv_heads_layout(kv, tp, version)
    if layout == "split":
        yield _check("heads", None, f"{spec.heads} heads / {kv} KV heads split over TP {tp}", "")
        return
    field_error = (
        f"num_query_groups ({kv}) must be a multiple of tensor_model_parallel_size ({tp}): {spec.source} has "
        f"num_key_value_heads={kv} (actor.tensor_parallel_size={tp})"
    )
    fix = f"set actor.tensor_parallel_size to a divisor of {kv} ({divisors(kv)})"
    if layout == "mismatch":
        yield _check("heads", field_error, "", fix)
        return
    if layout == "refused" and version is not None:
        yield _check("heads", f"{field_error}; megatron-core {version} cannot replicate KV heads", "", fix)
        return
    yield _check(
        "heads",
        f"{kv} KV heads replicated over TP {tp}: {spec.source} has num_key_value_heads={kv}, so each is on "
        f"{tp // kv} ranks; megatron-core 0.16 all-gathers every layer's QKV projection over TP to do it",
        "",
        f"{fix}: no all-gather; megatron-core before 0.16 (the previous NPU line's 0.12.1) refuses this layout",
        "warn",
    )


def rule_ulysses(cfg, spec: ModelSpec | None) -> Iterable[Check]:
    """The fsdp engine's Ulysses SP (engines/ulysses.py): the all-to-all splits heads; KV heads repeat up to SP."""
    sp = cfg.actor.ulysses_sequence_parallel_size
    if sp <= 1 or spec is None:
        return
    from ..engines.ulysses import kv_repeats, layout_problem  # imports torch: only for SP configs

    repeat = kv_repeats(sp, spec.kv_heads)
    yield _check(
        "ulysses",
        layout_problem(sp, spec.heads, spec.kv_heads),
        f"{spec.heads} heads / {spec.kv_heads} KV heads over SP {sp}"
        + (f" (KV heads repeated x{repeat})" if repeat > 1 else ""),
        f"set actor.ulysses_sequence_parallel_size to a divisor of {spec.heads} ({divisors(spec.heads)})",
    )


def rule_layers(cfg, spec: ModelSpec | None) -> Iterable[Check]:
    pp = cfg.actor.pipeline_parallel_size
    if spec is None or cfg.actor.engine != "megatron" or pp == 1:
        return
    yield _check(
        "layers",
        f"num_hidden_layers ({spec.layers}) is not divisible by actor.pipeline_parallel_size ({pp}) "
        "(Megatron: num_layers should be divisible by pipeline_model_parallel_size)"
        if spec.layers % pp
        else None,
        f"{spec.layers} layers = {spec.layers // pp} per pipeline stage",
        f"set actor.pipeline_parallel_size to a divisor of {spec.layers} ({divisors(spec.layers)})",
    )


def rule_experts(cfg, spec: ModelSpec | None) -> Iterable[Check]:
    ep, etp = cfg.actor.expert_parallel_size, cfg.actor.expert_tensor_parallel_size
    if spec is None or (ep == 1 and etp == 1):
        return
    if not spec.is_moe:
        yield _check(
            "experts",
            f"actor.expert_parallel_size={ep} / expert_tensor_parallel_size={etp} but {spec.source} is a dense model",
            "",
            "set actor.expert_parallel_size=1 and actor.expert_tensor_parallel_size=1",
        )
        return
    problem = None
    if spec.experts % ep:
        problem = f"num_experts ({spec.experts}) is not divisible by actor.expert_parallel_size ({ep})"
    elif spec.moe_intermediate % etp:
        problem = (
            f"moe_intermediate_size ({spec.moe_intermediate}) is not divisible by expert_tensor_parallel_size ({etp})"
        )
    yield _check(
        "experts",
        problem,
        f"{spec.experts} experts = {spec.experts // ep} per EP rank",
        f"set actor.expert_parallel_size to a divisor of {spec.experts}",
    )


def rule_moe_folding(cfg, spec: ModelSpec | None) -> Iterable[Check]:
    """megatron/core/parallel_state.py (0.16, initialize_model_parallel) raises RuntimeError unless
    world_size % (expert_tensor_parallel_size * expert_model_parallel_size * pipeline_model_parallel_size)
    == 0: the expert layers are folded onto the same ranks as attention, EP x ETP inside world / PP."""
    lay = layout(cfg)
    if lay.ep * lay.etp == 1 or lay.world % lay.pp:
        return
    per_stage, fold = lay.world // lay.pp, lay.etp * lay.ep * lay.pp
    yield _check(
        "moe-folding",
        f"world_size ({lay.world}) is not divisible by expert_tensor_model_pipeline_parallel size ({fold}) "
        f"(ETP {lay.etp} x EP {lay.ep} x PP {lay.pp}): EP x ETP must fold into the {per_stage} ranks per pipeline stage"
        if lay.world % fold
        else None,
        f"ETP {lay.etp} x EP {lay.ep} folds into {per_stage} ranks per stage (expert DP {lay.edp})",
        f"choose actor.expert_parallel_size x expert_tensor_parallel_size among {divisors(per_stage)}, or add nodes",
    )


def rule_moe_sp(cfg, spec: ModelSpec | None) -> Iterable[Check]:
    a = cfg.actor
    if spec is None or not spec.is_moe or a.engine != "megatron" or a.tensor_parallel_size == 1 or a.sequence_parallel:
        return
    yield Check(
        "preflight:moe-sp",
        "warn",
        "MoE with actor.tensor_parallel_size > 1 but actor.sequence_parallel=false (Megatron-LM asserts sequence "
        "parallelism for MoE + TP; every TP rank would route all tokens)",
        "set actor.sequence_parallel=true",
    )


def rule_rollout_tp(cfg, spec: ModelSpec | None) -> Iterable[Check]:
    """A vLLM engine's TP group within one node of the devices that generate: the rollout pool's when there is one
    (its TP dividing the pool's size is the config validator's rule), else the trainer's."""
    from ..config import rollout_world

    rt, pool = cfg.rollout.tensor_parallel_size, cfg.rollout_pool
    key = "rollout_pool.devices_per_node" if pool.devices_per_node > 0 else "trainer.devices_per_node"
    per_node = pool.devices_per_node if pool.devices_per_node > 0 else cfg.trainer.devices_per_node
    problem = (
        f"rollout.tensor_parallel_size ({rt}) does not divide {key} ({per_node}): a vLLM engine must sit inside one "
        "node"
        if rt > 0 and per_node % rt
        else None
    )
    if spec is not None and not problem and spec.heads % rt:
        problem = f"num_attention_heads ({spec.heads}) is not divisible by rollout.tensor_parallel_size ({rt}) (vLLM)"
    elif spec is not None and not problem and spec.kv_heads % rt and rt % spec.kv_heads:
        problem = (
            f"num_key_value_heads ({spec.kv_heads}) and rollout.tensor_parallel_size ({rt}) must divide one "
            "another (vLLM)"
        )
    yield _check(
        "rollout-tp",
        problem,
        f"rollout TP {rt}: {rollout_world(cfg) // max(rt, 1)} engine(s)",
        f"set rollout.tensor_parallel_size to a divisor of {per_node}"
        + (f" and of {spec.heads} heads" if spec is not None else ""),
    )


def rule_node_local(cfg, spec: ModelSpec | None) -> Iterable[Check]:
    """Every training group that must lie within a node (placement.py: megatron's TP / EP / ETP, fsdp's Ulysses)
    inside one node of the config's own layout, ``trainer.devices_per_node`` ranks to a node: the start refuses a
    group that spans nodes where the ranks really run (placement.check_node_local); this says it before launch."""
    from ..placement import nominal_split

    split = nominal_split(cfg)
    t = cfg.trainer
    problem = None
    if split is not None:
        spans = len({r // t.devices_per_node for r in split.ranks})
        problem = (
            f"the {split.what} group of ranks {split.ranks} would span {spans} nodes (trainer.nnodes {t.nnodes} x "
            f"trainer.devices_per_node {t.devices_per_node}, ranks numbered node by node), so its collectives "
            "would cross the network"
        )
    fix = (
        f"choose {split.key} (now {len(split.ranks)}) so that its groups fit in trainer.devices_per_node "
        f"({t.devices_per_node}) ranks, or change trainer.devices_per_node"
        if split
        else ""
    )
    yield _check("node-local", problem, f"every training group within one node of {t.devices_per_node} ranks", fix)


def rule_batch(cfg, spec: ModelSpec | None) -> Iterable[Check]:
    """Each minibatch (ppo_mini_batch_size prompts x rollout.n samples) splits over the data-parallel ranks,
    and Megatron asserts 'global batch size (X) is not divisible by micro batch size (Y) times data
    parallel size (Z)' (num_microbatches_calculator)."""
    lay = layout(cfg)
    if lay.world % lay.dense_parallel:
        return  # rule_world reports it; DP is not defined
    mini, n, mbs = cfg.actor.ppo_mini_batch_size, cfg.rollout.n, cfg.actor.micro_batch_size
    samples, dp = mini * n, lay.dp
    minibatches = cfg.data.train_batch_size // mini if mini else 0
    problem, status = None, "fail"
    if samples % dp:
        problem = (
            f"a minibatch of actor.ppo_mini_batch_size x rollout.n = {mini}x{n} = {samples} samples does not split "
            f"over DP {dp} (data.train_batch_size x n = {cfg.data.train_batch_size * n} in {minibatches} minibatches)"
        )
    elif mbs and cfg.actor.max_tokens_per_micro_batch is None and (samples // dp) % mbs:
        problem = (
            f"global batch size ({samples}) is not divisible by micro batch size ({mbs}) times data parallel size "
            f"({dp}) (actor.micro_batch_size)"
        )
        status = "fail" if cfg.actor.engine == "megatron" else "warn"
    yield _check(
        "batch",
        problem,
        f"{minibatches} minibatches of {samples} samples = {samples // dp} per DP rank (DP {dp})",
        f"make ppo_mini_batch_size x n a multiple of DP x micro_batch_size = {dp * (mbs or 1)}",
        status,
    )


def rule_micro_batch(cfg, spec: ModelSpec | None) -> Iterable[Check]:
    """A token budget below one full-length sequence cannot place that sequence in any micro-batch. The budget is
    per device; with Ulysses SP a micro-batch of the SP group holds SP x as many tokens."""
    budget, seq = cfg.actor.max_tokens_per_micro_batch, cfg.data.max_prompt_length + cfg.data.max_response_length
    sp = cfg.actor.ulysses_sequence_parallel_size if cfg.actor.engine == "fsdp" else 1
    if budget is None:
        if cfg.actor.micro_batch_size is not None:
            yield _check("micro-batch", None, f"actor.micro_batch_size={cfg.actor.micro_batch_size} samples", "")
        return  # neither set: the config validator reports it (field failure "Please set micro_batch_size")
    if budget == "auto":  # sized by the planner at start, never below one full sequence a device
        yield _check("micro-batch", None, "token budget auto: the planner sizes it for the device at start", "")
        return
    group = f" x SP {sp} = {budget * sp} per SP group" if sp > 1 else ""
    yield _check(
        "micro-batch",
        f"actor.max_tokens_per_micro_batch ({budget}{group}) is below one full sequence "
        f"(data.max_prompt_length + max_response_length = {seq})"
        if budget * sp < seq
        else None,
        f"token budget {budget}{group} per micro-batch (>= {budget * sp // seq} full sequences)",
        f"set actor.max_tokens_per_micro_batch >= {-(-seq // sp)}",
    )


def rule_seq_len(cfg, spec: ModelSpec | None) -> Iterable[Check]:
    seq, limit = cfg.data.max_prompt_length + cfg.data.max_response_length, cfg.rollout.max_model_len
    problem = None
    if limit is not None and seq > limit:
        problem = f"max_prompt_length + max_response_length = {seq} exceeds rollout.max_model_len ({limit})"
    elif spec is not None and seq > spec.max_length:
        problem = (
            f"max_prompt_length + max_response_length = {seq} exceeds the model's {spec.max_length} positions "
            f"({spec.source})"
        )
    elif spec is not None and limit is not None and limit > spec.max_length:
        problem = f"rollout.max_model_len ({limit}) exceeds the model's {spec.max_length} positions (vLLM refuses it)"
    yield _check(
        "seq-len",
        problem,
        f"sequences up to {seq} tokens" + (f" within {spec.max_length} positions" if spec else ""),
        "shorten data.max_response_length / max_prompt_length or raise rollout.max_model_len within the model limit",
    )


def _mc2_problem(cfg, spec: ModelSpec | None) -> str | None:
    """MindSpeed 2.2.0's MC2 is ``--use-ascend-mc2`` (``features_manager/tensor_parallel/mc2.py``): it replaces
    Megatron's column / row-parallel linears, in dense and MoE models alike (the experts keep their own path), and
    registers nothing, with only a warning, unless TP > 1 with sequence parallelism; we refuse that silent no-op.
    (``--moe-bmm-mc2`` exists only in MindSpeed's legacy argument list and nothing the adaptor installs reads it.)
    """
    a = cfg.actor
    problems = {
        "actor.engine must be megatron (MindSpeed --use-ascend-mc2)": a.engine != "megatron",
        f"actor.tensor_parallel_size must be one of {MC2_TP_A2} on Atlas A2, got {a.tensor_parallel_size}": (
            a.tensor_parallel_size not in MC2_TP_A2
        ),
        "actor.sequence_parallel must be true (MindSpeed skips MC2 without it)": not a.sequence_parallel,
        f"MC2 is an Ascend feature; trainer.device={cfg.trainer.device}": cfg.trainer.device == "cuda",
        "model.dtype must be bfloat16 or float16 (torch_npu's MC2 kernels take no float32)": (
            cfg.model.dtype == "float32"
        ),
    }
    tp = max(a.tensor_parallel_size, 1)
    if spec is not None:  # the kernels' matmul k: hidden (column), attention / FFN width per TP rank (row)
        ks = {"hidden size": spec.hidden, "attention width / TP": spec.heads * spec.head_dim // tp}
        if not spec.experts or not all(spec.moe_layer_flags):  # some layer has a dense MLP
            ks["FFN width / TP"] = spec.intermediate // tp
        for name, k in ks.items():
            problems[f"{name} = {k} is outside [256, 65535), torch_npu's MC2 matmul k range"] = not 256 <= k < 65535
    failed = [text for text, bad in problems.items() if bad]
    return "actor.use_mc2=true: " + "; ".join(failed) if failed else None


def rule_mc2(cfg, spec: ModelSpec | None) -> Iterable[Check]:
    if not cfg.actor.use_mc2:
        return
    yield _check(
        "mc2",
        _mc2_problem(cfg, spec),
        f"MC2 with TP {cfg.actor.tensor_parallel_size} and sequence parallel",
        "fix the listed settings or set actor.use_mc2=false",
    )


Rule = Callable[[object, ModelSpec | None], Iterable[Check]]
RULES: tuple[Rule, ...] = (
    rule_world,
    rule_heads,
    rule_ulysses,
    rule_layers,
    rule_experts,
    rule_moe_folding,
    rule_moe_sp,
    rule_rollout_tp,
    rule_node_local,
    rule_batch,
    rule_micro_batch,
    rule_seq_len,
    rule_mc2,
)


# ----------------------------------------------------------------------------------------------- entry points


def model_check(cfg) -> tuple[ModelSpec | None, Check]:
    if not cfg.model.path:
        return None, Check("preflight:model", "ok", "model.path is '' (embedded tiny model): model checks skipped")
    try:
        spec = load_spec(cfg.model.path)
    except UserError as exc:
        return None, Check("preflight:model", "fail", str(exc), "fix model.path")
    kind = f"MoE {spec.experts} experts top-{spec.top_k}" if spec.is_moe else "dense"
    params = f"{spec.total_params / 1e9:.2f}B params"
    if spec.builtin:
        # a warning, not ok: every check below holds for the real model, but a run from here would find no weights
        return spec, Check(
            "preflight:model",
            "warn",
            f"{spec.note}: {spec.model_type} ({kind}, {params})",
            f"a real run needs the weights of {spec.builtin} at model.path; the built-in spec serves the checks only",
        )
    return spec, Check("preflight:model", "ok", f"{spec.model_type} ({kind}, {params}) from {spec.source}")


def devices_check(cfg, hardware) -> list[Check]:
    """The config's devices per node against what npu-smi / nvidia-smi report on this host."""
    if hardware is None or hardware.kind == "cpu" or not hardware.devices:
        return []
    have, want = len(hardware.devices), cfg.trainer.devices_per_node
    return [
        _check(
            "devices",
            f"trainer.devices_per_node={want} but this host has {have} {hardware.kind.upper()}s"
            if want > have
            else None,
            f"{want} of {have} devices per node used",
            f"set trainer.devices_per_node <= {have}",
        )
    ] + pools_check(cfg, have, f"this host's {hardware.kind.upper()}s")


def pools_check(cfg, node_devices: int, where: str) -> list[Check]:
    """A rollout pool's layout against a node's devices (this host's, or the target hardware's): the config alone
    cannot say how many devices a node has. Equal ``nnodes`` mean the pools share every node (what the launch
    scripts start: each node gives Ray both pools' devices), so their devices per node add up; otherwise each pool
    must fit a node by itself. Without this the run stops minutes in, after the trainer pool has started, when Ray
    cannot place the rollout pool's placement group (workers.py)."""
    t, pool = cfg.trainer, cfg.rollout_pool
    if pool.devices_per_node <= 0 or node_devices <= 0:
        return []
    pools = (("trainer.devices_per_node", t.devices_per_node), ("rollout_pool.devices_per_node", pool.devices_per_node))
    if pool.nnodes == t.nnodes:
        need = t.devices_per_node + pool.devices_per_node
        problem = None
        if need > node_devices:
            problem = (
                f"trainer.devices_per_node ({t.devices_per_node}) + rollout_pool.devices_per_node "
                f"({pool.devices_per_node}) = {need} exceeds the {node_devices} devices of a node ({where}); with "
                f"trainer.nnodes = rollout_pool.nnodes ({t.nnodes}) both pools share every node"
            )
        fix = f"lower trainer.devices_per_node or rollout_pool.devices_per_node to a sum <= {node_devices}"
        ok = f"trainer {t.devices_per_node} + rollout {pool.devices_per_node} of {node_devices} devices per node"
    else:
        over = [key for key, n in pools if n > node_devices]
        problem = None
        if over:
            have = " and ".join(f"{key} ({n})" for key, n in pools if key in over)
            problem = f"{have} exceeds the {node_devices} devices of a node ({where})"
        fix = f"set {' and '.join(over) or 'each pool'} to <= {node_devices}"
        ok = f"trainer {t.devices_per_node}, rollout {pool.devices_per_node} devices per node (<= {node_devices} each)"
    return [_check("pools", problem, ok, fix)]


def preflight(cfg, hardware=None, versions: dict[str, str] | None = None) -> list[Check]:
    """All findings for a loaded (not yet validated) config: the schema's cross-field rules, then ours.
    ``versions``: a planned stack (doctor --versions), judged instead of what is installed here."""
    from .. import config as config_mod

    checks = [
        Check("preflight:config", "fail", p, "fix the key named in the message") for p in config_mod.problems(cfg)
    ]
    spec, model = model_check(cfg)
    checks.append(model)
    planned = {} if versions is None else {"megatron_core": versions.get("megatron-core")}
    for rule in RULES:
        checks.extend(rule_heads(cfg, spec, **planned) if rule is rule_heads else rule(cfg, spec))
    return checks + devices_check(cfg, hardware)


def preflight_file(
    path: str | None, overrides=(), hardware=None, versions: dict[str, str] | None = None
) -> tuple[object | None, list[Check]]:
    """Load a config without raising on its content: a bad key becomes a fail finding, not a crash."""
    from .. import config as config_mod
    from ..errors import ConfigError

    try:
        cfg = config_mod.load_config(path, overrides, validate=False)
    except ConfigError as exc:
        if path is not None and "does not exist" in str(exc):
            raise
        return None, [Check("preflight:config", "fail", str(exc), "fix or remove the key named in the message")]
    return cfg, preflight(cfg, hardware, versions)


def failures(checks: list[Check]) -> list[Check]:
    return [c for c in checks if c.status == "fail"]
