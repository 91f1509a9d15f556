"""The ``hf`` rollout engine: sampling with transformers' own ``model.generate`` (KV cache, left-padded batch).

It is the reference rollout engine: slow next to vLLM, but it runs wherever transformers runs (CPU CI, the
embedded demo, an NPU without vllm-ascend) and its log-probs are easy to trust. Log-probs follow the contract of
:mod:`.base`: ``log_softmax(raw_logits / T)`` at the sampled token, taken from ``output_logits=True`` (the logits
*before* any logits processor), so top-k / top-p truncation changes which tokens are drawn but not how they are
scored; greedy decoding (``temperature == 0``) is scored at ``T = 1``.

How we differ from verl's HF rollout (``HFRollout``): verl reads ``output_scores`` (the *processed* scores, so
its log-probs include the top-k/top-p renormalisation) and inherits whatever sampling defaults the checkpoint's
``generation_config.json`` carries (Qwen3 ships ``temperature=0.6, top_k=20``). Here the checkpoint's sampling
defaults are dropped at load time and every sampling knob comes from :class:`SamplingParams` (``top_k=-1``
really means no top-k, not transformers' global default of 50). Generation is a pure function of (weights,
prompts, params, ``max_batch_size``): each chunk runs under ``torch.random.fork_rng`` with its own seed, so the
caller's RNG streams are untouched. Weight updates copy in place, and also accept checkpoint-layout per-expert
MoE names (``mlp.experts.3.up_proj.weight``, what vLLM and mbridge speak) for models that transformers 5 loads
with fused expert tensors (``mlp.experts.gate_up_proj``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..errors import ConfigError, UserError
from . import routing
from .base import Request, SampleBatch, SamplingParams, check_prompt_tokens, requests_for
from .hf_load import load_causal_lm

if TYPE_CHECKING:
    from ..config import Config
    from ..device import Backend

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Checkpoint-layout expert weights (one Linear per expert) -> transformers 5's fused [E, ...] expert tensors:
# gate_up_proj[e] = cat([gate_proj_e, up_proj_e], 0) and down_proj[e] = down_proj_e (the qwen2_moe family's
# conversion in transformers.conversion_mapping, which covers Qwen2-MoE and Qwen3-MoE).
_EXPERT_NAME = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


class HFRolloutEngine:
    """RolloutEngine over a Hugging Face causal LM on ``backend.device()``; see the module docstring.

    ``max_batch_size`` caps the rows (prompts x n) of one ``generate`` call. It matters beyond the KV cache:
    ``output_logits`` keeps one fp32 ``[rows, V]`` tensor per step until the call returns, i.e.
    rows x R x V x 4 bytes (128 rows x 1024 steps x Qwen's 152k vocabulary = 80 GB), so set it for real models.
    """

    def __init__(
        self,
        model_path: str,
        *,
        backend: Backend,
        dtype: str = "float32",
        attn_implementation: str = "sdpa",
        tokenizer_path: str | None = None,
        max_batch_size: int | None = None,
        npu_patches: bool = True,
    ):
        if dtype not in DTYPES:
            raise ConfigError(f"config key 'model.dtype' must be one of {sorted(DTYPES)}, got '{dtype}'")
        if dtype == "bfloat16" and not backend.is_bf16_supported():
            raise ConfigError(f"model.dtype=bfloat16 is not supported on device '{backend.name}'; use float16/float32")
        if max_batch_size is not None and max_batch_size <= 0:
            raise ValueError(f"max_batch_size must be > 0 or None, got {max_batch_size}")
        self.backend, self.max_batch_size = backend, max_batch_size
        self.device = backend.device()
        backend.avoid_per_shape_attention_plans()  # decode shapes change every step (device/__init__.py)
        self.model = _load_model(model_path, DTYPES[dtype], attn_implementation, backend, npu_patches).to(self.device)
        self.model.eval().requires_grad_(False)
        self.tokenizer = _load_tokenizer(tokenizer_path or model_path)
        self.eos_token_ids, self.pad_token_id = _special_ids(self.model.generation_config, self.tokenizer)
        self.vocab_size = self.model.get_output_embeddings().weight.shape[0]
        self._clean_generation_defaults()
        self._targets = _named_targets(self.model)
        # an MoE model's routes are recorded with every sample (SampleBatch.routed_experts): the trainer's routing
        # agreement and routing replay r3 read them (engines/routing.py)
        shape = routing.moe_shape(self.model)
        self.route_dtype = None if shape is None else routing.route_dtype(shape[2])

    # ------------------------------------------------------------------------------------------- generate

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> SampleBatch:
        return self.generate_requests(requests_for(prompts, params), params)

    def generate_requests(self, requests: Sequence[Request], params: SamplingParams) -> SampleBatch:
        """All requests in one ``model.generate`` call per chunk of ``max_batch_size`` rows; a row whose request has
        a smaller budget than the chunk's largest stops at it (a per-row stopping criterion). Chunk k draws with
        one seed, ``_chunk_seed`` of the first request's seed and k (transformers samples a batch from one RNG
        stream), so, unlike on vLLM with seeded requests, a sample depends on the requests batched with it: a
        result is a pure function of the whole request list, and ``generate`` (one budget, first seed
        ``params.seed``) draws exactly as before requests existed."""
        _check_params(params)
        self._check_prompts([list(q.prompt_ids) for q in requests])
        r = params.max_new_tokens
        rows = [j for j, q in enumerate(requests) for _ in range(q.n)]  # a request's n samples adjacent
        budgets = torch.tensor([requests[j].max_new_tokens for j in rows], dtype=torch.long)
        if bool(((budgets < 1) | (budgets > r)).any()):
            raise ConfigError(f"a request's max_new_tokens must be in [1, {r}] (the batch width)")
        ids = torch.full((len(rows), r), self.pad_token_id, dtype=torch.long)
        logps = torch.zeros(ids.shape, dtype=torch.float32)
        routes: list[torch.Tensor] = []
        chunk = self.max_batch_size or max(len(rows), 1)
        for k, start in enumerate(range(0, len(rows), chunk)):
            part = slice(start, start + chunk)
            top = int(budgets[part].max())
            prompts = [list(requests[j].prompt_ids) for j in rows[part]]
            sub = dataclasses.replace(params, max_new_tokens=top)
            got = self._generate_chunk(prompts, sub, _chunk_seed(requests[0].seed, k), budgets[part])
            ids[part, :top], logps[part, :top] = got[:2]
            routes += got[2]
        within = torch.arange(r)[None, :] < budgets[:, None]  # a row's own budget
        ids, logps = ids.masked_fill(~within, self.pad_token_id), logps * within
        # EOS within the sample's own budget (the columns after it hold the pad id, which may itself be an EOS id)
        finished = (torch.isin(ids, torch.tensor(list(self.eos_token_ids), dtype=ids.dtype)) & within).any(-1)
        ids, mask, logps = _finish(ids, logps, self.eos_token_ids, self.pad_token_id)
        mask = mask * within  # a pad id that is an EOS id must not count as the EOS of a sample cut at its budget
        fed = [len(requests[j].prompt_ids) + n - 1 for j, n in zip(rows, mask.sum(-1).long().tolist(), strict=True)]
        return SampleBatch(
            routed_experts=[r[:n] for r, n in zip(routes, fed, strict=True)] if self.route_dtype else None,
            prompt_ids=[list(requests[j].prompt_ids) for j in rows],
            response_ids=ids,
            response_mask=mask,
            rollout_log_probs=logps,
            group_index=torch.tensor(rows, dtype=torch.long),
            finished=finished,
        )

    def _generate_chunk(
        self, prompts: list[list[int]], params: SamplingParams, seed: int, budgets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """One ``model.generate`` call: ([b, R] int64 ids, [b, R] float32 log-probs, on the host, unmasked; per row
        the routes of every token fed, [prompt + steps - 1, layers, k], on an MoE model). With ``budgets`` ([b])
        below ``params.max_new_tokens``, row i stops after ``budgets[i]`` tokens."""
        input_ids, attention_mask = _left_pad(prompts, self.pad_token_id, self.device)
        greedy = params.temperature == 0
        config = self._generation_config(params)
        extra = {}
        if budgets is not None and bool((budgets < params.max_new_tokens).any()):
            from transformers import StoppingCriteriaList

            extra["stopping_criteria"] = StoppingCriteriaList([_RowBudgets(budgets, input_ids.shape[1])])
        recording = routing.routed(self.model, record=True) if self.route_dtype else contextlib.nullcontext()
        with torch.no_grad(), self._forked_rng(), recording as log:
            self.backend.manual_seed(seed)
            out = self.model.generate(
                input_ids=input_ids, attention_mask=attention_mask, generation_config=config, **extra
            )
        steps = len(out.logits)  # < R when every row hit EOS early
        tokens = out.sequences[:, input_ids.shape[1] :][:, :steps]  # [b, steps], on the device
        temperature = 1.0 if greedy else params.temperature
        # out.logits holds one raw [b, V] fp32 tensor per step; scoring step by step makes no [b, steps, V] copy
        per_step = [
            torch.log_softmax(step.float() / temperature, -1).gather(-1, tokens[:, t, None])[:, 0]
            for t, step in enumerate(out.logits)
        ]
        ids = torch.full((len(prompts), params.max_new_tokens), self.pad_token_id, dtype=torch.long)
        logps = torch.zeros(ids.shape, dtype=torch.float32)
        if steps:  # one device-to-host copy each, not one per step
            ids[:, :steps], logps[:, :steps] = tokens.cpu(), torch.stack(per_step, 1).cpu()
        return ids, logps, self._row_routes(log, prompts) if self.route_dtype else []

    def _row_routes(self, log: routing.RouteLog, prompts: list[list[int]]) -> list[torch.Tensor]:
        """Per row, its routes in input order: the prefill call (left-padded [b, width] flattened) from the row's
        first prompt token, then one row per decode call (the token sampled one step before)."""
        b, width = len(prompts), max(len(p) for p in prompts)
        calls = len(log.own[0])
        steps = [torch.stack([per_layer[c] for per_layer in log.own], 1) for c in range(calls)]  # on the device
        prefill = steps[0].reshape(b, width, *steps[0].shape[1:]).to("cpu", self.route_dtype)
        # [b, calls - 1, layers, k]: one device-to-host copy for every decode step, not one per step
        decode = torch.stack(steps[1:], 1).to("cpu", self.route_dtype) if calls > 1 else prefill[:, :0]
        return [torch.cat([prefill[i, width - len(p) :], decode[i]], 0) for i, p in enumerate(prompts)]

    def _generation_config(self, params: SamplingParams) -> Any:
        """Every sampling knob set explicitly: unset fields would fall back to transformers' defaults (top_k=50)."""
        from transformers import GenerationConfig

        greedy = params.temperature == 0
        sampling = (
            {}
            if greedy
            else {
                "temperature": float(params.temperature),
                "top_p": float(params.top_p),
                "top_k": 0 if params.top_k == -1 else int(params.top_k),  # 0 = no TopKLogitsWarper
            }
        )
        return GenerationConfig(
            do_sample=not greedy,
            **sampling,
            max_new_tokens=params.max_new_tokens,
            min_new_tokens=0,
            num_beams=1,
            num_return_sequences=1,  # rows are already repeated n times: one code path for chunked requests
            eos_token_id=list(self.eos_token_ids),
            pad_token_id=self.pad_token_id,
            use_cache=True,
            return_dict_in_generate=True,
            output_logits=True,
        )

    def _clean_generation_defaults(self) -> None:
        """Drop the checkpoint's sampling defaults (e.g. Qwen3's temperature 0.6 / top_k 20): generate() fills every
        field we leave unset from ``model.generation_config``, and the RL config alone must decide sampling."""
        from transformers import GenerationConfig

        self.model.generation_config = GenerationConfig(
            eos_token_id=list(self.eos_token_ids), pad_token_id=self.pad_token_id
        )

    @contextlib.contextmanager
    def _forked_rng(self) -> Iterator[None]:
        # manual_seed reseeds every accelerator, so every one is forked (one per worker in practice)
        on_host = self.backend.torch_device_type == "cpu"
        devices = [] if on_host else list(range(self.backend.device_count()))
        with torch.random.fork_rng(devices=devices, device_type=self.backend.torch_device_type):
            yield

    def _check_prompts(self, prompts: list[list[int]]) -> None:
        check_prompt_tokens(prompts, self.vocab_size)

    # ------------------------------------------------------------------------------------------- weights

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy HF-named full tensors into the live parameters/buffers (same storage, so nothing is re-allocated
        and tied weights stay tied); returns the bytes received. Unknown names and shape mismatches raise."""
        total = 0
        for name, tensor in named_tensors:
            target = self._target(name)
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"update_weights: '{name}' has shape {tuple(tensor.shape)}, the model expects {tuple(target.shape)}"
                )
            target.copy_(tensor)
            total += tensor.numel() * tensor.element_size()
        return total

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights this engine generates with, by HF name (what :meth:`update_weights` loads into)."""
        yield from self._targets.items()

    def _target(self, name: str) -> torch.Tensor:
        """The model tensor (or the view into a fused expert tensor) that HF name ``name`` loads into."""
        if name in self._targets:
            return self._targets[name]
        match = _EXPERT_NAME.match(name)
        if match is not None:
            prefix, e, proj = match["prefix"], int(match["expert"]), match["proj"]
            fused = self._targets.get(f"{prefix}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}")
            if fused is not None and fused.dim() == 3 and e < fused.shape[0]:
                if proj == "down_proj":
                    return fused[e]
                half = fused.shape[1] // 2
                return fused[e, :half] if proj == "gate_proj" else fused[e, half:]
        raise ValueError(f"update_weights: the model has no parameter or buffer named '{name}'")

    def sleep(self) -> None:
        """No-op: the KV cache lives only inside one generate() call, so between rollouts there is nothing but
        the weights on the device, and those stay (offloading them is the vllm engine's job when colocated)."""

    def wake_up(self) -> None:
        """No-op; see :meth:`sleep`."""


class _RowBudgets:
    """A stopping criterion: row i is done once it has ``budgets[i]`` new tokens. transformers then pads the row and
    still draws its random numbers with the batch, so the other rows sample as without it."""

    def __init__(self, budgets: torch.Tensor, prompt_width: int) -> None:
        self.budgets, self.prompt_width = budgets, prompt_width

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        done = self.budgets.to(input_ids.device) <= input_ids.shape[1] - self.prompt_width
        return done


def build_hf_rollout(cfg: Config, backend: Backend, model_path: str) -> HFRolloutEngine:
    """The engine for ``rollout.engine=hf``; ``model_path`` is ``model.path`` resolved (the tiny model for "")."""
    engine = HFRolloutEngine(
        model_path,
        backend=backend,
        dtype=cfg.model.dtype,
        attn_implementation=cfg.model.attn_implementation,
        tokenizer_path=cfg.model.tokenizer_path,
        npu_patches=cfg.model.npu_patches,
    )
    if cfg.actor.routing_replay == "r3" and engine.route_dtype is None:
        raise ConfigError(
            "config key 'actor.routing_replay' (r3) replays the rollout's routes, and the hf rollout records them "
            f"only for {', '.join(routing.MODEL_TYPES)} on transformers 5 (their router modules): use r2 or off"
        )
    return engine


# ----------------------------------------------------------------------------------------------- helpers


def _load_model(path: str, dtype: torch.dtype, attn_implementation: str, backend: Backend, npu_patches: bool) -> Any:
    try:
        return load_causal_lm(
            path, dtype=dtype, attn_implementation=attn_implementation, backend=backend, npu_patches=npu_patches
        )
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(
            f"cannot load the rollout model from '{path}' (model.path, model.attn_implementation="
            f"{attn_implementation}): {first}"
        ) from None
    except ImportError as exc:  # e.g. flash_attention_2 without the flash-attn package
        raise ConfigError(
            f"model.attn_implementation={attn_implementation} needs a package that is missing ({exc}); "
            "use model.attn_implementation=sdpa"
        ) from None


def _load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(
            f"cannot load the tokenizer from '{path}' (model.tokenizer_path / model.path): {first}"
        ) from None


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _special_ids(generation_config: Any, tokenizer: Any) -> tuple[tuple[int, ...], int]:
    """EOS ids = generation_config's plus the tokenizer's (vLLM stops on both too); pad = tokenizer's pad, the
    generation config's, or else the first EOS (base Qwen checkpoints pad with <|endoftext|>, itself an EOS)."""
    eos = _as_list(getattr(generation_config, "eos_token_id", None)) + _as_list(tokenizer.eos_token_id)
    eos = tuple(dict.fromkeys(eos))
    if not eos:
        raise UserError("the model has no EOS token: set eos_token_id in its generation_config.json or tokenizer")
    pad = tokenizer.pad_token_id
    if pad is None:
        pad = getattr(generation_config, "pad_token_id", None)
    pad = _as_list(pad)
    return eos, pad[0] if pad else eos[0]


def _named_targets(model: Any) -> dict[str, torch.Tensor]:
    """Every parameter and buffer under every name it has (``remove_duplicate=False``: a tied lm_head.weight is
    listed next to embed_tokens.weight, both pointing at the same storage)."""
    targets = dict(model.named_buffers(remove_duplicate=False))
    targets.update(model.named_parameters(remove_duplicate=False))
    return targets


def _left_pad(prompts: list[list[int]], pad_id: int, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    return ids.to(device), mask.to(device)


def _finish(
    ids: torch.Tensor, logps: torch.Tensor, eos_ids: Sequence[int], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mask = 1 up to and including the first EOS of each row; ids after it = pad, log-probs there = 0.

    Computed from the first EOS rather than from ``ids != pad`` because the pad id may itself be an EOS id or a
    token the model really sampled."""
    is_eos = torch.isin(ids, torch.tensor(list(eos_ids), dtype=ids.dtype))  # [B, R]
    after_eos = (is_eos.long().cumsum(-1) - is_eos.long()) > 0  # strictly after the first EOS
    mask = (~after_eos).float()
    return ids.masked_fill(after_eos, pad_id), mask, logps.float().masked_fill(after_eos, 0.0)


def _check_params(params: SamplingParams) -> None:
    checks = [
        ("n", params.n >= 1, "must be >= 1"),
        ("temperature", params.temperature >= 0, "must be >= 0 (0 = greedy)"),
        ("top_p", 0 < params.top_p <= 1, "must be in (0, 1]"),
        ("top_k", params.top_k == -1 or params.top_k > 0, "must be -1 (disabled) or > 0"),
        ("max_new_tokens", params.max_new_tokens >= 1, "must be >= 1 (data.max_response_length)"),
    ]
    for key, ok, rule in checks:
        if not ok:
            raise ConfigError(f"sampling parameter '{key}' (rollout.{key}) {rule}, got {getattr(params, key)}")


def _chunk_seed(seed: int, chunk: int) -> int:
    """Chunk 0 uses ``seed`` itself; later chunks a hash of (seed, chunk), so no two (seed, chunk) pairs collide
    the way ``seed + chunk`` would."""
    if chunk == 0:
        return seed
    digest = hashlib.sha256(f"{seed}:{chunk}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


__all__ = ["HFRolloutEngine", "build_hf_rollout"]
