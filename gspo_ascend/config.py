"""The config schema: nested dataclasses are the single source of truth; YAML files and dotted CLI overrides
(``algorithm.clip_ratio_low=3e-4``) only override them.

Loading is strict, unlike verl's Hydra setup where a stale key fails deep inside Hydra with
``Could not override 'algorithm.filter_groups.enable'``: an unknown key is an error naming the key and the
closest valid one, a wrong type names the key, the expected type and the value. Cross-field rules are
registered with :func:`validator` so later subsystems (batching, parallelism, preflight) add their own.

One file, over 600 lines: the schema and its cross-field rules are read together, and a rule next to its keys is
what keeps them true.

Defaults are the GSPO paper's (arXiv 2507.18071): clip ratios 3e-4 / 4e-4, the rollout batch split into 4
minibatches (``actor.ppo_mini_batch_size = data.train_batch_size / 4``), no KL term, loss aggregation
seq-mean-token-mean. Sizes default to the embedded CPU demo; cluster scripts override them.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

from .errors import ConfigError


@dataclass
class ModelConfig:
    path: str = ""  # local HF directory; "" = the embedded tiny model (built by `gspo-ascend make-tiny-model`)
    tokenizer_path: str | None = None  # None = same as path
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    gradient_checkpointing: bool = False
    # trainer.device=npu: torch_npu fused ops for RMSNorm, rotary, SwiGLU, MoE experts and attention in the fsdp
    # and hf engines (gspo_ascend.patches; docs/npu-patches.md). Ignored on cpu / cuda, where nothing is patched.
    npu_patches: bool = True


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    max_prompt_length: int = 128
    max_response_length: int = 64
    train_batch_size: int = 16  # prompts per rollout batch
    overlong_prompts: Literal["filter", "error"] = "filter"
    shuffle: bool = True


@dataclass
class RolloutConfig:
    engine: Literal["hf", "vllm"] = "hf"
    n: int = 8  # samples per prompt (the GSPO/GRPO group size)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = disabled
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.5
    max_num_batched_tokens: int = 8192
    enforce_eager: bool | None = None  # None = auto: eager on NPU and CPU, graphs on CUDA (gspo_ascend/compile.py)
    # graph rollout (enforce_eager: false) only; null = vLLM's default (gspo_ascend/npu_profile.py has the rules)
    cudagraph_mode: str | None = None  # FULL_DECODE_ONLY | PIECEWISE on NPU (verl's NPU GSPO guide: FULL_DECODE_ONLY)
    cudagraph_capture_sizes: list[int] | None = None  # decode batch sizes captured, each <= one engine's sequences
    max_model_len: int | None = None  # vLLM context limit; None = max_prompt_length + max_response_length
    # vllm engine: on = each request seeded (seed + i x n, child j + j), so a sample does not depend on the requests
    # beside it (a resumed run repeats the uninterrupted one's samples, a rollout pool the colocated run's) at one
    # RNG kernel per sequence per decode step in vLLM's sampler; off = one batched draw per step from vLLM's own
    # seeded stream, a sample depending on its batch; auto = on where vLLM runs on the host, off on GPU / NPU
    seed_requests: Literal["auto", "on", "off"] = "auto"
    # staleness studies (issue #31): the rollout engine generates with the weights of exactly this many updates
    # ago (the first steps with the initial weights), colocated only; 0 = the current weights, as training should.
    # With algorithm.old_logprobs=engine it costs one extra forward a step: the behavior/* drift metrics
    weights_lag: int = 0


@dataclass
class ActorConfig:
    engine: Literal["fsdp", "megatron"] = "fsdp"
    lr: float = 1e-6
    weight_decay: float = 0.0
    warmup_steps: int = 0
    # prompts per optimizer step; null = data.train_batch_size / algorithm.minibatches_per_rollout
    ppo_mini_batch_size: int | None = None
    micro_batch_size: int | None = 4  # samples per forward/backward on one device
    # dynamic batch size by token budget (overrides the above); auto: the largest the planner fits on the device
    max_tokens_per_micro_batch: int | Literal["auto"] | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    context_parallel_size: int = 1
    # Ulysses sequence parallelism (fsdp engine): each packed micro-batch is split over this many ranks by tokens and
    # attention heads are exchanged by all-to-all; data parallel over world / this (docs/engines.md)
    ulysses_sequence_parallel_size: int = 1
    expert_parallel_size: int = 1
    expert_tensor_parallel_size: int = 1
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = True
    grad_clip: float = 1.0
    recompute: Literal["none", "selective", "full"] = "none"
    use_remove_padding: bool = True  # packed (padding-free) forward passes; False = right-padded batches
    offload: bool = False  # params/grads/optimizer to host between phases when colocated with rollout
    use_mc2: bool = False  # Ascend MC2 fused matmul+collective (MindSpeed --use-ascend-mc2): TP 2/4/8 + SP
    # fsdp engine: on = ZeRO-3 (layers re-gathered in backward, gradients reduced per micro-batch); off = layers
    # kept gathered through the minibatch, gradients reduced once; auto = off where the planner says it fits (on
    # the host: one rank only; docs/engines.md)
    fsdp_reshard_after_forward: Literal["auto", "on", "off"] = "auto"
    # fsdp engine: torch.compile of every RMSNorm and gated MLP (engines/compiled_layers.py): on CPU 1.15x a bf16
    # step, 0.95x a float32 one; auto = off on every backend until the GPU proof measures CUDA; never on NPU
    compile_layers: Literal["auto", "on", "off"] = "auto"
    # fsdp engine, packed: samples of one prompt (a group's n) share one forward of it in each micro-batch, the same
    # log-probs and gradients from fewer tokens (engines/logprobs.py shared_prefix_row); needs the packed attention
    # hook (sdpa / eager), a dense model, no SP; auto = on on the CPU backend only (shared_prefix_on)
    shared_prefix: Literal["auto", "on", "off"] = "auto"
    # MoE routing replay (engines/routing.py, docs/engines.md): r2 = the experts the old-log-prob forward chose are
    # replayed in the update's forwards (the GSPO paper's Routing Replay); r3 = the rollout engine's experts are
    # replayed in every trainer forward of the sample; off = each forward routes for itself
    routing_replay: Literal["off", "r2", "r3"] = "off"


@dataclass
class AlgorithmConfig:
    loss: Literal["gspo", "gspo_token", "grpo"] = "gspo"
    clip_ratio_low: float = 3e-4
    clip_ratio_high: float = 4e-4
    clip_ratio_c: float | None = None  # dual-clip bound for negative advantages (all losses; off in the paper)
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = (
        "seq-mean-token-mean"
    )
    old_logprobs: Literal["recompute", "engine"] = "recompute"
    # optimizer steps per rollout batch (paper: 4); null = 4, or whatever actor.ppo_mini_batch_size implies
    minibatches_per_rollout: int | None = None
    norm_adv_by_std: bool = True
    kl_coef: float = 0.0  # the paper uses no KL term
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    # pi_old of samples generated by older weights (partial rollout, rollout_pool.max_staleness>=1): auto = seq_tis
    # with old_logprobs=recompute, none with =engine (the rollout engine's log-probs are the behaviour policy);
    # seq_tis = the capped length-normalised sequence weight (algorithms/behavior.py)
    behavior_correction: Literal["auto", "seq_tis", "none"] = "auto"
    behavior_cap: float = 2.0  # truncation of the behaviour weight


@dataclass
class RewardConfig:
    reward_fn: str | None = None  # None = math-verify on the last \\boxed{}; or "module:function" (verl signature)
    timeout_s: float = 5.0  # per sample; a timeout scores 0 and is counted
    num_workers: int = 1  # scoring processes, >= 1 (scoring inside the driver could hang it; refused)
    # stop the run when more than this fraction of a step's samples failed to score (error or timeout); 1 = never
    max_failure_rate: float = 0.5
    overlong_buffer_length: int = 0  # DAPO overlong penalty; 0 = off
    overlong_penalty_factor: float = 1.0


@dataclass
class TrainerConfig:
    device: Literal["auto", "cpu", "cuda", "npu"] = "auto"
    nnodes: int = 1
    devices_per_node: int = 1
    total_steps: int = 20
    output_dir: str = "runs/gspo"
    save_freq: int = 0  # steps between checkpoints; 0 = only at the end
    keep_last: int | None = None  # committed checkpoints to keep (older ones pruned); null = all
    resume: str = "auto"  # auto | never | <checkpoint path>
    seed: int = 0
    compile: Literal["auto", "on", "off"] = "auto"  # auto = off on NPU (graph mode is not usable for RL there)
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl", "tensorboard"])  # + "wandb"
    project_name: str = "gspo-ascend"  # wandb project
    experiment_name: str = ""  # wandb run name; "" = the output directory's name
    test_freq: int = 0  # steps between validations on data.val_files (and the last step); 0 = off (verl's name)
    val_before_train: bool = False  # validate the initial weights first (logged as step 0; a resume skips it)
    # torch intra-op threads per Ray actor when the devices are the CPU (cpu, or npu on the shim); 0 = the node's
    # CPUs / the run's actors. A reduction split over another number of threads rounds differently, so two runs
    # compared bitwise with different actor counts (colocated against pools) must fix it
    cpu_threads: int = 0


@dataclass
class ValidationConfig:
    """How validation (trainer.test_freq / val_before_train) and `gspo-ascend eval` sample and report; verl's
    rollout.val_kwargs plus the reporting knobs. gspo_ascend/validation.py says what each metric is."""

    n: int = 1  # samples per prompt (mean@n; pass@k and maj@k need k <= n)
    greedy: bool = True  # argmax decoding (verl: do_sample=false); false = sample with the three keys below
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = disabled
    k: list[int] | None = None  # pass@k / maj@k reported; null = 1, 2, 4, ... and n
    max_prompts: int | None = None  # cap: a fixed, seeded subset of this many prompts; null = all
    batch_size: int = 64  # prompts per generate call; each call has its own seed, so results do not depend on workers
    log_prompts: int = 16  # prompts whose responses are written to <output_dir>/validation/step_N.jsonl; 0 = none


@dataclass
class PartialRolloutConfig:
    """Partial rollout (gspo_ascend/partial_rollout.py, docs/partial-rollout.md): generation in rounds of at most
    ``round_tokens`` tokens; unfinished samples continue in the next step's round."""

    round_tokens: int | None = None  # token budget per generate round; null = off (one round, as synchronous)
    max_rounds: int = 2  # a sample is forced to finish in its max_rounds-th round (version lag <= max_rounds - 1)
    extra_groups: int | None = None  # prompt groups in flight beyond data.train_batch_size; null = the most allowed


@dataclass
class DynamicSamplingConfig:
    """Drop groups whose n rewards are all equal and draw replacements (verl's DAPO ``filter_groups``)."""

    enabled: bool = False
    max_draws: int = 10  # rollout batches of prompts drawn per step at most, the first included (max_num_gen_batches)


@dataclass
class RolloutPoolConfig:
    """Disaggregated rollout (pools.py, schedules/pool.py, docs/disaggregated.md): the rollout engines on devices of
    their own, the trainer's weights sent to them over a sync group. max_staleness=1 (one-step-off): the next batch
    is generated while this one trains; eta > 1: the next eta batches, from one weights version (schedules/pool.py)."""

    devices_per_node: int = 0  # 0 = colocated: the trainer's devices generate (every other key here is then inert)
    nnodes: int = 1
    # weight versions a trained sample may lag: 0 = synchronous semantics, 1 = one-step-off, eta > 1 = a sync every
    # eta steps, the pool eta batches ahead (batch j of a group j versions old)
    max_staleness: int = 1
    sync_bucket_mb: int = 256  # weights travel in flat buckets of this size (a larger tensor: a bucket of its own)


@dataclass
class ToolsConfig:
    """Multi-turn rollout with tool calls (agent_loop.py, tools/, docs/agent.md): trajectories of model turns and
    tool turns; the loss trains the model's tokens only. Off while no row may call a tool (``names`` and
    ``by_source`` empty: single-turn rollout). A row's tools are its data source's (``by_source``, else ``names``);
    a verl row whose ``agent_name`` is ``single_turn_agent`` gets none (tools/plan.py)."""

    @property
    def enabled(self) -> bool:
        return bool(self.names) or any(self.by_source.values())

    names: list[str] = field(default_factory=list)  # "calculator", "python", or package.module:function
    # data_source -> the tools its rows may call ([]: single turn); a source not listed gets ``names``
    by_source: dict[str, list[str]] = field(default_factory=dict)
    max_turns: int = 4  # model turns per trajectory at most (the last one's calls are not run)
    max_calls_per_turn: int = 4  # calls one model turn may make; more are one malformed call
    timeout_s: float = 10.0  # per call, in the tool's worker process (killed and replaced past it)
    max_output_chars: int = 2048  # a longer result is an error the model is told
    num_workers: int = 2  # tool worker processes (spawned at the first call)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    partial_rollout: PartialRolloutConfig = field(default_factory=PartialRolloutConfig)
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    rollout_pool: RolloutPoolConfig = field(default_factory=RolloutPoolConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)


# ----------------------------------------------------------------------------------------------- schema walk


def valid_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every dotted leaf key of the schema, e.g. ``algorithm.clip_ratio_low``."""
    keys = []
    for f in dataclasses.fields(cls):
        tp = _hints(cls)[f.name]
        name = f"{prefix}{f.name}"
        keys.extend(valid_keys(tp, name + ".") if dataclasses.is_dataclass(tp) else [name])
    return keys


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _suggest(key: str, prefix: str, names: Iterable[str]) -> str:
    candidates = [f"{prefix}{n}" for n in names] + valid_keys()
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.5)
    if not close:  # compare the last component only: `algorithm.clip_low` -> clip_ratio_low
        leaf = key.rsplit(".", 1)[-1]
        by_leaf = {k.rsplit(".", 1)[-1]: k for k in candidates}
        close = [by_leaf[m] for m in difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.5)]
    return f"; did you mean '{close[0]}'?" if close else f"; valid keys under '{prefix or '.'}': {sorted(names)}"


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if typing.get_origin(tp) is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if typing.get_origin(tp) is dict:
        return f"a mapping of {_type_name(typing.get_args(tp)[0])} to {_type_name(typing.get_args(tp)[1])}"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp``; return it (ints widen to float, a scalar to a list)."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                continue
    elif origin is Literal:
        choices = typing.get_args(tp)
        word = ("on" if value else "off") if isinstance(value, bool) else None
        if word in choices:  # YAML reads a bare on / off as a boolean
            return word
        if value in choices:
            return value
    elif origin is list:
        items = value if isinstance(value, (list, tuple)) else [value] if isinstance(value, str) else None
        if items is not None:
            return [_coerce(v, typing.get_args(tp)[0], key) for v in items]
    elif origin is dict:
        key_type, value_type = typing.get_args(tp)
        if isinstance(value, dict):
            return {_coerce(k, key_type, key): _coerce(v, value_type, f"{key}.{k}") for k, v in value.items()}
    elif tp is type(None):
        if value is None:
            return None
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is int or tp is bool:
        if type(value) is tp:
            return value
    elif tp is str:
        if isinstance(value, str):
            return value
    raise ConfigError(f"config key '{key}' must be {_type_name(tp)}, got {value!r}")


def from_dict(data: dict, cls: type = Config, prefix: str = "") -> Any:
    """Build the dataclass ``cls`` from a nested dict, strictly (see the module docstring)."""
    if not isinstance(data, dict):
        raise ConfigError(f"config key '{prefix.rstrip('.') or '<root>'}' must be a mapping, got {data!r}")
    hints = _hints(cls)
    kwargs = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in hints:
            while isinstance(value, dict) and len(value) == 1:  # name the full key the user wrote: rolout.n
                key, value = next(iter(value.items()))
                dotted = f"{dotted}.{key}"
            raise ConfigError(f"unknown config key '{dotted}'{_suggest(dotted, prefix, hints)}")
        tp = hints[key]
        kwargs[key] = from_dict(value, tp, dotted + ".") if dataclasses.is_dataclass(tp) else _coerce(value, tp, dotted)
    return cls(**kwargs)


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


# ----------------------------------------------------------------------------------------------- loading


def _parse_overrides(overrides: Iterable[str]) -> dict:
    from omegaconf import OmegaConf  # YAML-typed values: 3e-4 -> float, [a,b] -> list, null -> None

    items = list(overrides)
    for item in items:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override '{item}' is not of the form key=value (e.g. algorithm.clip_ratio_low=3e-4)")
    try:
        return OmegaConf.to_container(OmegaConf.from_dotlist(items))
    except Exception as exc:  # omegaconf raises its own grammar errors; keep the one line
        raise ConfigError(f"cannot parse overrides {items}: {str(exc).splitlines()[0]}") from None


def _read_yaml(path: Path) -> dict:
    from omegaconf import OmegaConf

    if not path.is_file():
        raise ConfigError(f"config file '{path}' does not exist; pass an existing YAML file to --config")
    try:
        data = OmegaConf.to_container(OmegaConf.load(path))
    except Exception as exc:
        raise ConfigError(f"config file '{path}' is not valid YAML: {str(exc).splitlines()[0]}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{path}' must hold a mapping of sections (model:, data:, ...)")
    return data


def _deep_merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for key, value in top.items():
        out[key] = _deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def load_config(path: str | Path | None = None, overrides: Iterable[str] = (), *, validate: bool = True) -> Config:
    """Defaults <- YAML file <- dotted overrides, then the schema check and the cross-field validators.

    Error messages name the file or the override that introduced a bad key, so the user knows where to fix it.
    """
    merged: dict = {}
    if path is not None:
        source = str(path)
        merged = _read_yaml(Path(path))
        _check_source(merged, source)
    over = _parse_overrides(overrides)
    _check_source(over, "command-line override")
    cfg = from_dict(_deep_merge(merged, over))
    _resolve_minibatches(cfg)
    if validate:
        check(cfg)
    return cfg


def _check_source(data: dict, source: str) -> None:
    try:
        from_dict(data)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def _resolve_minibatches(cfg: Config) -> None:
    """Fill in whichever of actor.ppo_mini_batch_size / algorithm.minibatches_per_rollout was left null.

    Both describe the same thing (verl users think in mini-batch sizes, the paper in "4 minibatches per
    rollout batch"); when both are set they must agree: we refuse rather than pick one silently.
    """
    tbs, mbs, k = cfg.data.train_batch_size, cfg.actor.ppo_mini_batch_size, cfg.algorithm.minibatches_per_rollout
    if mbs is None:
        k = 4 if k is None else k
        if k <= 0 or tbs % k:
            raise ConfigError(
                f"config key 'algorithm.minibatches_per_rollout' ({k}) must be > 0 and divide "
                f"'data.train_batch_size' ({tbs}); or set 'actor.ppo_mini_batch_size' instead"
            )
        cfg.actor.ppo_mini_batch_size, cfg.algorithm.minibatches_per_rollout = tbs // k, k
    elif k is None:
        cfg.algorithm.minibatches_per_rollout = tbs // mbs if mbs > 0 and tbs % mbs == 0 else None
    elif mbs * k != tbs:
        raise ConfigError(
            f"config keys 'actor.ppo_mini_batch_size' ({mbs}) and 'algorithm.minibatches_per_rollout' ({k}) "
            f"disagree: their product must be 'data.train_batch_size' ({tbs}); set only one of them"
        )


# ----------------------------------------------------------------------------------------------- validation

Validator = Callable[[Config], Iterable[str]]
_VALIDATORS: list[Validator] = []


def validator(fn: Validator) -> Validator:
    """Register a cross-field rule: ``fn(cfg)`` yields one-line problems (key, what is wrong, the fix)."""
    _VALIDATORS.append(fn)
    return fn


def problems(cfg: Config) -> list[str]:
    return [p for fn in _VALIDATORS for p in fn(cfg)]


def check(cfg: Config) -> None:
    found = problems(cfg)
    if found:
        more = f" (and {len(found) - 1} more: {'; '.join(found[1:])})" if len(found) > 1 else ""
        raise ConfigError(found[0] + more)


_POSITIVE = [
    "data.max_prompt_length",
    "data.max_response_length",
    "data.train_batch_size",
    "rollout.n",
    "rollout.tensor_parallel_size",
    "actor.ppo_mini_batch_size",
    "actor.tensor_parallel_size",
    "actor.pipeline_parallel_size",
    "actor.context_parallel_size",
    "actor.ulysses_sequence_parallel_size",
    "actor.expert_parallel_size",
    "actor.expert_tensor_parallel_size",
    "trainer.nnodes",
    "trainer.devices_per_node",
    "trainer.total_steps",
]


def get(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


@validator
def _positive_sizes(cfg: Config) -> Iterable[str]:
    for key in _POSITIVE:
        if get(cfg, key) <= 0:
            yield f"config key '{key}' must be > 0, got {get(cfg, key)}"
    for key in ("actor.micro_batch_size", "actor.max_tokens_per_micro_batch", "trainer.keep_last"):
        if isinstance(get(cfg, key), int) and get(cfg, key) <= 0:
            auto = ", auto" if key == "actor.max_tokens_per_micro_batch" else ""
            yield f"config key '{key}' must be > 0{auto} or null, got {get(cfg, key)}"
    a = cfg.actor
    padded = not a.use_remove_padding or (a.engine == "megatron" and a.context_parallel_size > 1)
    if a.max_tokens_per_micro_batch == "auto" and padded:
        # a padded micro-batch computes samples x its longest sample, which the budget does not bound
        yield (
            "config key 'actor.max_tokens_per_micro_batch' (auto) sizes packed micro-batches; these are padded "
            "(actor.use_remove_padding=false, or megatron with context_parallel_size > 1): set a number"
        )
    if cfg.trainer.cpu_threads < 0:
        yield f"config key 'trainer.cpu_threads' must be >= 0 (0 = CPUs / actors), got {cfg.trainer.cpu_threads}"
    if cfg.trainer.save_freq < 0:
        yield f"config key 'trainer.save_freq' must be >= 0 (0 = save at the end only), got {cfg.trainer.save_freq}"


@validator
def _clip_and_sampling(cfg: Config) -> Iterable[str]:
    a = cfg.algorithm
    if a.clip_ratio_low < 0 or a.clip_ratio_high < 0:
        yield "config keys 'algorithm.clip_ratio_low/high' must be >= 0 (GSPO paper: 3e-4 / 4e-4)"
    if a.clip_ratio_low >= 1:
        yield f"config key 'algorithm.clip_ratio_low' must be < 1 (floor = 1 - it), got {a.clip_ratio_low}"
    if a.clip_ratio_c is not None and a.clip_ratio_c <= 1:
        yield f"config key 'algorithm.clip_ratio_c' must be > 1 (dual-clip bound) or null, got {a.clip_ratio_c}"
    if not 0 < cfg.rollout.top_p <= 1:
        yield f"config key 'rollout.top_p' must be in (0, 1], got {cfg.rollout.top_p}"
    if cfg.rollout.temperature < 0:
        yield f"config key 'rollout.temperature' must be >= 0, got {cfg.rollout.temperature}"
    if not 0 < cfg.rollout.gpu_memory_utilization <= 1:
        yield f"config key 'rollout.gpu_memory_utilization' must be in (0, 1], got {cfg.rollout.gpu_memory_utilization}"


@validator
def _minibatches(cfg: Config) -> Iterable[str]:
    tbs, mbs = cfg.data.train_batch_size, cfg.actor.ppo_mini_batch_size
    if tbs > 0 and mbs > 0 and tbs % mbs:
        yield (
            f"config key 'actor.ppo_mini_batch_size' ({mbs}) must divide 'data.train_batch_size' ({tbs}); "
            f"the GSPO paper uses train_batch_size / 4 = {tbs / 4:g}"
        )
    if cfg.actor.micro_batch_size is None and cfg.actor.max_tokens_per_micro_batch is None:
        yield "set 'actor.micro_batch_size' or 'actor.max_tokens_per_micro_batch' (one of them decides micro-batches)"


@validator
def _ulysses_layout(cfg: Config) -> Iterable[str]:
    """Ulysses SP (engines/ulysses.py) splits packed rows over ranks: fsdp only, packed only, a divisor of the world.
    The model's head counts are checked where the model is known (runtime.prepare, the preflight, the engine)."""
    a, key = cfg.actor, "actor.ulysses_sequence_parallel_size"
    sp, world = a.ulysses_sequence_parallel_size, cfg.trainer.nnodes * cfg.trainer.devices_per_node
    if sp <= 1:
        return
    if a.engine != "fsdp":
        yield f"config key '{key}' ({sp}) needs actor.engine=fsdp; with megatron use actor.context_parallel_size"
    elif not a.use_remove_padding:
        yield f"config key '{key}' ({sp}) splits packed rows: set actor.use_remove_padding=true"
    elif world > 0 and world % sp:
        yield (
            f"config key '{key}' ({sp}) must divide the number of devices ({world} = trainer.nnodes x "
            "trainer.devices_per_node)"
        )


def seeded_requests(cfg: Config, on_host: bool) -> bool:
    """``rollout.seed_requests`` with auto resolved: on where vLLM runs on the host (CPU, the emulated NPU), where
    this project's bitwise replays run and the per-sequence draws cost nothing measurable; off on a GPU or NPU."""
    mode = cfg.rollout.seed_requests
    return on_host if mode == "auto" else mode == "on"


@validator
def _seed_requests(cfg: Config) -> Iterable[str]:
    mode = cfg.rollout.seed_requests
    if mode != "auto" and cfg.rollout.engine != "vllm":
        yield (
            f"config key 'rollout.seed_requests' ({mode}) is the vllm engine's: the hf engine seeds each chunk of "
            "requests from its first request's seed; leave it auto with rollout.engine=hf"
        )


@validator
def _fsdp_reshard(cfg: Config) -> Iterable[str]:
    """The FSDP2 resharding choice exists in the fsdp engine only (megatron shards by its distributed optimizer)."""
    mode = cfg.actor.fsdp_reshard_after_forward
    if mode != "auto" and cfg.actor.engine != "fsdp":
        yield (
            f"config key 'actor.fsdp_reshard_after_forward' ({mode}) is the fsdp engine's: leave it auto with megatron"
        )


@validator
def _compile_layers(cfg: Config) -> Iterable[str]:
    """Compiled norms and MLPs exist in the fsdp engine only (megatron's layers are its layer spec's)."""
    mode = cfg.actor.compile_layers
    if mode != "auto" and cfg.actor.engine != "fsdp":
        yield f"config key 'actor.compile_layers' ({mode}) is the fsdp engine's: leave it auto with megatron"


def shared_prefix_blocks(cfg: Config) -> str | None:
    """Why ``actor.shared_prefix`` cannot run with this config (None: it can): it needs the fsdp engine's packed
    attention hook (engines/packed_attention.py), which sdpa / eager without SP run, and one token layout per sample,
    which routing replay's per-token routes assume."""
    a = cfg.actor
    if a.engine != "fsdp":
        return "it is the fsdp engine's"
    if not a.use_remove_padding:
        return "it needs packed micro-batches (actor.use_remove_padding=true)"
    if a.ulysses_sequence_parallel_size > 1:
        return "Ulysses SP splits each sequence's tokens (actor.ulysses_sequence_parallel_size=1)"
    if a.routing_replay != "off":
        return "routing replay keeps its routes per token of each sample's own sequence (actor.routing_replay=off)"
    if cfg.model.attn_implementation == "flash_attention_2":
        return "flash_attention_2 reads the row's blocks as separate sequences (model.attn_implementation=sdpa)"
    if cfg.trainer.device == "npu":
        return "the NPU's fused attention (TND) reads the row's blocks as separate sequences"
    return None


def shared_prefix_on(cfg: Config, on_cpu: bool) -> bool:
    """``actor.shared_prefix`` resolved: on = on (the validator refused what cannot run it); auto = on where the
    engine runs on the CPU backend (not the emulated NPU: that is the NPU's path) and nothing in the config blocks
    it (:func:`shared_prefix_blocks`): 1.30x a float32 CPU update (docs/results/shared-prefix). Off on a GPU, where
    the plain row takes one varlen_attn call and a shared row would run per block (engines/packed_attention.py);
    the engine also resolves auto off for a model the hook does not take or an MoE model (engines/fsdp.py)."""
    mode = cfg.actor.shared_prefix
    if mode == "auto":
        return on_cpu and shared_prefix_blocks(cfg) is None
    return mode == "on"


@validator
def _shared_prefix(cfg: Config) -> Iterable[str]:
    why = shared_prefix_blocks(cfg) if cfg.actor.shared_prefix == "on" else None
    if why:
        yield f"config key 'actor.shared_prefix' (on): {why}; set it to auto or off"


@validator
def _routing_replay(cfg: Config) -> Iterable[str]:
    """What replay needs that the config alone shows; a dense model and an engine that cannot record routes are
    refused where the model and engine are known (runtime.prepare, engines)."""
    mode, key = cfg.actor.routing_replay, "config key 'actor.routing_replay'"
    if mode == "r2" and cfg.algorithm.old_logprobs != "recompute":
        yield (
            f"{key} (r2) replays the routes of the old-log-prob forward, which algorithm.old_logprobs=engine skips: "
            "set algorithm.old_logprobs=recompute, or use r3 (the rollout engine's routes)"
        )
    if mode != "off" and cfg.actor.ulysses_sequence_parallel_size > 1:
        yield (
            f"{key} ({mode}) is not wired through Ulysses sequence parallelism yet: set "
            "actor.ulysses_sequence_parallel_size=1, or routing_replay=off"
        )


@validator
def _validation(cfg: Config) -> Iterable[str]:
    """The validation keys; which files it reads is checked when they are loaded (gspo_ascend/validation.py)."""
    v, freq = cfg.validation, cfg.trainer.test_freq
    if freq < 0:
        yield f"config key 'trainer.test_freq' must be >= 0 (steps between validations; 0 = off), got {freq}"
    for key in ("validation.n", "validation.batch_size"):
        if get(cfg, key) <= 0:
            yield f"config key '{key}' must be > 0, got {get(cfg, key)}"
    if v.max_prompts is not None and v.max_prompts <= 0:
        yield f"config key 'validation.max_prompts' must be > 0 or null (all prompts), got {v.max_prompts}"
    if v.log_prompts < 0:
        yield f"config key 'validation.log_prompts' must be >= 0 (0 = write no responses), got {v.log_prompts}"
    for k in v.k or []:
        if not 1 <= k <= max(v.n, 1):
            yield (
                f"config key 'validation.k' has k={k}: pass@k and maj@k need 1 <= k <= validation.n (samples per "
                f"prompt, {v.n}); raise validation.n or drop k={k}"
            )
    yield from _validation_sampling(v)


def _validation_sampling(v: ValidationConfig) -> Iterable[str]:
    if v.greedy:
        if v.n > 1:
            yield (
                f"config key 'validation.n' ({v.n}) with validation.greedy=true would score one answer {v.n} times; "
                "set validation.greedy=false to sample, or validation.n=1"
            )
        defaults = {"temperature": 1.0, "top_p": 1.0, "top_k": -1}
        changed = [f"validation.{k}={getattr(v, k)}" for k, d in defaults.items() if getattr(v, k) != d]
        if changed:
            yield (
                f"config key(s) {', '.join(changed)} do nothing with validation.greedy=true (argmax decoding); "
                "set validation.greedy=false to sample with them"
            )
        return
    if v.temperature <= 0:
        yield (
            f"config key 'validation.temperature' must be > 0 when sampling, got {v.temperature}; "
            "for argmax decoding set validation.greedy=true"
        )
    if not 0 < v.top_p <= 1:
        yield f"config key 'validation.top_p' must be in (0, 1], got {v.top_p}"
    if v.top_k != -1 and v.top_k <= 0:
        yield f"config key 'validation.top_k' must be -1 (disabled) or > 0, got {v.top_k}"


@validator
def _reward(cfg: Config) -> Iterable[str]:
    r = cfg.reward
    if r.num_workers < 1:
        yield (
            f"config key 'reward.num_workers' must be >= 1, got {r.num_workers}: scoring inside the driver (0) was "
            "removed, because a reward function stuck in C code could neither be timed out nor interrupted there"
        )
    if not 0 <= r.max_failure_rate <= 1:
        yield f"config key 'reward.max_failure_rate' must be in [0, 1] (1 = never stop), got {r.max_failure_rate}"
    if r.timeout_s is not None and r.timeout_s < 0:
        yield f"config key 'reward.timeout_s' must be >= 0 (0 = no limit), got {r.timeout_s}"


@validator
def _tools(cfg: Config) -> Iterable[str]:
    t = cfg.tools
    if not t.enabled:
        yield from _inert("tools", t, ("by_source", "max_turns", "max_calls_per_turn", "timeout_s",
                                       "max_output_chars", "num_workers"),
                          "'tools.names' or 'tools.by_source' giving some rows a tool")  # fmt: skip
        return
    for key in ("max_turns", "max_calls_per_turn", "max_output_chars", "num_workers"):
        if getattr(t, key) < 1:
            yield f"config key 'tools.{key}' must be >= 1, got {getattr(t, key)}"
    if t.timeout_s <= 0:
        yield f"config key 'tools.timeout_s' must be > 0, got {t.timeout_s}"
    # not wired with multi-turn trajectories yet (issue #45): refused, not silently single-turn
    elsewhere = {
        "partial_rollout.round_tokens": cfg.partial_rollout.round_tokens is not None,
        "dynamic_sampling.enabled": cfg.dynamic_sampling.enabled,
        "rollout_pool.devices_per_node": cfg.rollout_pool.devices_per_node > 0,
        "rollout.weights_lag": cfg.rollout.weights_lag > 0,
    }
    for key, on in elsewhere.items():
        if on:
            yield (
                f"config key '{key}' does not work with tool calls yet (tools.names / tools.by_source): "
                "multi-turn rollout runs colocated and synchronous; unset it or give no row a tool"
            )


def data_parallel_size(cfg: Config) -> int:
    """Ranks that each train on a different shard of the batch: all of them for fsdp; for megatron, the
    world divided by the model-parallel product (expert parallelism folds into it, see the doctor)."""
    world = cfg.trainer.nnodes * cfg.trainer.devices_per_node
    if cfg.actor.engine == "megatron":
        a = cfg.actor
        return max(1, world // (a.tensor_parallel_size * a.pipeline_parallel_size * a.context_parallel_size))
    return world


@validator
def _data_parallel_split(cfg: Config) -> Iterable[str]:
    """Every rank must get the same number of whole prompts and of samples per minibatch."""
    dp, k = data_parallel_size(cfg), cfg.algorithm.minibatches_per_rollout
    tbs, n = cfg.data.train_batch_size, cfg.rollout.n
    if min(dp, tbs, n) <= 0 or not k or k <= 0:
        return
    if tbs % dp:
        yield (
            f"config key 'data.train_batch_size' ({tbs}) must be a multiple of the data-parallel size ({dp} = "
            "trainer.nnodes x trainer.devices_per_node / model parallelism); change one of them"
        )
    elif (tbs * n) % (k * dp):
        yield (
            f"'data.train_batch_size' x 'rollout.n' ({tbs} x {n} = {tbs * n} samples) must divide into "
            f"algorithm.minibatches_per_rollout ({k}) x data-parallel size ({dp}) equal parts; change one of them"
        )


@validator
def _rollout_tensor_parallel(cfg: Config) -> Iterable[str]:
    """vLLM's rollout TP groups are consecutive ranks of the generating world (external launcher)."""
    world, tp = rollout_world(cfg), cfg.rollout.tensor_parallel_size
    where = (
        "rollout_pool.nnodes x rollout_pool.devices_per_node"
        if cfg.rollout_pool.devices_per_node
        else ("trainer.nnodes x trainer.devices_per_node")
    )
    if cfg.rollout.engine == "vllm" and tp > 0 and world > 0 and world % tp:
        yield f"config key 'rollout.tensor_parallel_size' ({tp}) must divide the number of devices ({world} = {where})"
    elif cfg.rollout.engine == "vllm" and tp > 0 and world % tp == 0 and cfg.data.train_batch_size % (world // tp):
        yield (
            f"config key 'data.train_batch_size' ({cfg.data.train_batch_size}) must be a multiple of the number of "
            f"rollout groups ({world // tp} = devices / rollout.tensor_parallel_size)"
        )


def _inert(section: str, value: Any, keys: Iterable[str], needs: str) -> Iterable[str]:
    """The ``keys`` of ``section`` set away from their defaults while what makes them act is off: an accepted key
    that does nothing is refused."""
    default = type(value)()
    for key in keys:
        if getattr(value, key) != getattr(default, key):
            yield f"config key '{section}.{key}' has no effect without {needs}"


@validator
def _partial_rollout(cfg: Config) -> Iterable[str]:
    p, d = cfg.partial_rollout, cfg.dynamic_sampling
    if p.round_tokens is None:  # off: the other keys would do nothing
        keys = ("max_rounds", "extra_groups")
        yield from _inert("partial_rollout", p, keys, "'partial_rollout.round_tokens'; set it")
    else:
        yield from _partial_rollout_values(cfg)
    if not d.enabled:
        yield from _inert("dynamic_sampling", d, ("max_draws",), "'dynamic_sampling.enabled=true'")
    if d.max_draws < 1:
        yield f"config key 'dynamic_sampling.max_draws' must be >= 1 (the first batch counts), got {d.max_draws}"


def _partial_rollout_values(cfg: Config) -> Iterable[str]:
    p = cfg.partial_rollout
    if p.round_tokens < 1:
        yield f"config key 'partial_rollout.round_tokens' must be >= 1 or null (off), got {p.round_tokens}"
        return
    if p.max_rounds < 1:
        yield f"config key 'partial_rollout.max_rounds' must be >= 1, got {p.max_rounds}"
        return
    most = max_extra_groups(cfg)
    if p.extra_groups is not None and not 0 <= p.extra_groups <= most:
        yield (
            f"config key 'partial_rollout.extra_groups' must be in [0, {most}] ((rounds - 1) x data.train_batch_size: "
            f"more groups in flight would train samples more than max_rounds - 1 versions old), got {p.extra_groups}"
        )


def max_extra_groups(cfg: Config) -> int:
    """(rounds a sample can take - 1) x data.train_batch_size: the groups in flight beyond a batch that keep every
    trained token within max_rounds - 1 versions (partial_rollout.py)."""
    p, width = cfg.partial_rollout, cfg.data.max_response_length
    return (effective_rounds(p.round_tokens or width, p.max_rounds, width) - 1) * cfg.data.train_batch_size


def effective_rounds(round_tokens: int, max_rounds: int, width: int) -> int:
    """Rounds a sample can really take: no more than ``ceil(width / round_tokens)`` (each non-final round adds a
    full budget), so a budget of at least the response length means one round."""
    return max(1, min(max_rounds, -(-width // max(round_tokens, 1))))


def behavior_correction(cfg: Config) -> str:
    """``algorithm.behavior_correction`` with auto resolved (see the key's comment)."""
    mode = cfg.algorithm.behavior_correction
    if mode != "auto":
        return mode
    return "seq_tis" if cfg.algorithm.old_logprobs == "recompute" else "none"


def stale_samples_possible(cfg: Config) -> bool:
    """Whether a trained sample can come from older weights: partial rollout, or a rollout pool one step off."""
    pool = cfg.rollout_pool
    return (
        cfg.partial_rollout.round_tokens is not None
        or (pool.devices_per_node > 0 and pool.max_staleness > 0)
        or cfg.rollout.weights_lag > 0
    )


@validator
def _behavior_correction(cfg: Config) -> Iterable[str]:
    a = cfg.algorithm
    if not stale_samples_possible(cfg):  # every sample comes from the current weights
        stale = "samples from older weights ('partial_rollout.round_tokens', a rollout pool one step off, or "
        yield from _inert("algorithm", a, ("behavior_correction", "behavior_cap"), stale + "'rollout.weights_lag')")
        return
    if a.behavior_correction == "seq_tis" and a.old_logprobs == "engine":
        yield (
            "config key 'algorithm.behavior_correction=seq_tis' needs 'algorithm.old_logprobs=recompute' (with "
            "=engine the engine's log-probs are pi_old and there is nothing to correct); use auto or none"
        )
    if a.behavior_cap < 1:
        yield f"config key 'algorithm.behavior_cap' must be >= 1, got {a.behavior_cap}"


def rollout_world(cfg: Config) -> int:
    """Devices that generate: the rollout pool's, else (colocated) the trainer's."""
    pool, t = cfg.rollout_pool, cfg.trainer
    return pool.nnodes * pool.devices_per_node if pool.devices_per_node > 0 else t.nnodes * t.devices_per_node


@validator
def _weights_lag(cfg: Config) -> Iterable[str]:
    lag, elsewhere = cfg.rollout.weights_lag, (cfg.rollout_pool.devices_per_node, cfg.partial_rollout.round_tokens)
    if lag < 0:
        yield f"config key 'rollout.weights_lag' must be >= 0, got {lag}"
    elif lag and (any(elsewhere) or cfg.dynamic_sampling.enabled):
        yield (
            "config key 'rollout.weights_lag' (a staleness study's fixed lag) runs colocated and synchronous only: "
            "leave rollout_pool, partial_rollout and dynamic_sampling off, or set it to 0"
        )


@validator
def _rollout_pool(cfg: Config) -> Iterable[str]:
    pool = cfg.rollout_pool
    if pool.devices_per_node == 0:
        keys = ("nnodes", "max_staleness", "sync_bucket_mb")
        yield from _inert("rollout_pool", pool, keys, "'rollout_pool.devices_per_node'; set it")
        return
    if pool.devices_per_node < 0 or pool.nnodes < 1:
        yield "config keys 'rollout_pool.devices_per_node' (>= 0) and 'rollout_pool.nnodes' (>= 1) are out of range"
    if pool.max_staleness < 0:
        yield f"config key 'rollout_pool.max_staleness' must be >= 0 (1 = one-step-off), got {pool.max_staleness}"
    if pool.sync_bucket_mb < 1:
        yield f"config key 'rollout_pool.sync_bucket_mb' must be >= 1, got {pool.sync_bucket_mb}"
    for key, on in (("partial_rollout.round_tokens", cfg.partial_rollout.round_tokens is not None),
                    ("dynamic_sampling.enabled", cfg.dynamic_sampling.enabled)):  # fmt: skip
        if on and pool.max_staleness > 1:  # rounds one step ahead (schedules/rounds_ahead.py), or in step (0)
            yield (
                f"config key '{key}' runs with 'rollout_pool.max_staleness' 0 (rounds between the updates) or 1 "
                f"(rounds one step ahead), got {pool.max_staleness}: set rollout_pool.max_staleness=1"
            )


@validator
def _graph_rollout(cfg: Config) -> Iterable[str]:
    from .npu_profile import graph_problems  # torch-free; the NPU profile's rules live with its table

    yield from graph_problems(cfg, rollout_world(cfg))
