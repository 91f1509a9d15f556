"""Hugging Face checkpoint <-> megatron-core GPTModel for the ``megatron`` engine, through mbridge 0.15.

mbridge maps the HF config to a ``TransformerConfig``, builds the GPTModel, scatters HF safetensors into TP / EP
shards (``load_weights``) and gathers them back as HF checkpoint tensors (``export_weights``). It assumes a GPU
with Transformer Engine; this module adapts it from our side, never by editing site-packages:

- **Layer spec.** mbridge always asks for the TE layer spec. Without Transformer Engine (CPU, NPU) we give it
  megatron's local spec (a subclass overriding ``_get_transformer_layer_spec``).
- **Parameter names.** mbridge's name tables use the TE spec's names: the input norm fused into the QKV
  projection (``self_attention.linear_qkv.layer_norm_weight``), the MLP norm fused into fc1 (dense models), and
  grouped experts ``mlp.experts.linear_fc1.weight<e>``. The local spec has ``input_layernorm``,
  ``pre_mlp_layernorm`` and ``mlp.experts.local_experts.<e>.linear_fc1``. :class:`TENamedView` shows mbridge a
  module under TE names (same Parameter objects), so its TP / ETP / EP scatter and gather logic runs unchanged,
  including the expert-tensor-parallel group for experts.
- **Config.** mbridge turns sequence parallelism on whenever TP > 1 and enables TE-only fusions and grouped GEMM;
  :func:`make_bridge` overrides them with ``set_extra_args``. transformers 5 moved ``rope_theta`` into
  ``rope_parameters``; :func:`load_hf_config` puts it back where mbridge reads it.
- **HF layout.** mbridge exports checkpoint names (one tensor per expert: ``experts.3.up_proj.weight``), but
  transformers 5 models hold fused experts (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj``
  [E, H, I]) in their ``state_dict``. :class:`HFLayout` reads the exact ``state_dict`` names and shapes from
  the HF model built on the meta device and fuses expert tensors to match; tied aliases are emitted too.

How we differ from verl's mbridge use: verl runs the TE spec only (GPU, or MindSpeed's TE stand-ins on NPU) and
streams mbridge's checkpoint names to vLLM; we also run the local spec (CPU CI, NPU) and emit exactly the HF
``state_dict`` (what the fsdp engine emits), checked name-for-name and shape-for-shape.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from gspo_ascend.errors import UserError

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "qwen3_moe")

# local spec name -> TE spec name (suffix rewrites; the layer prefix is kept)
_INPUT_NORM = (".input_layernorm.weight", ".self_attention.linear_qkv.layer_norm_weight")
_DENSE_MLP_NORM = (".pre_mlp_layernorm.weight", ".mlp.linear_fc1.layer_norm_weight")
_LOCAL_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")
_HF_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def prime_device_context() -> None:
    """Make ``with torch.device("meta")`` work after the shim's CUDA redirection is installed.

    torch's device context recognises factory functions by identity, in a set it builds (and caches) on first
    use; built after the redirection it holds the shim's wrappers, not the functions it is later called with,
    and factories silently ignore the context (transformers then builds HF models with garbage RoPE buffers).
    Building the set before the redirection keeps the originals in it."""
    from torch.utils._device import _device_constructors

    _device_constructors()


def transformer_engine_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def load_hf_config(model_path: str) -> Any:
    """The HF config, checked for what the bridge supports, with ``rope_theta`` where mbridge reads it."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_path)
    except (OSError, ValueError) as exc:
        raise UserError(f"model.path '{model_path}' is not a Hugging Face model directory ({exc})") from None
    kind = config.model_type
    if kind not in SUPPORTED_MODEL_TYPES:
        raise UserError(
            f"model.path '{model_path}' is a '{kind}' model; actor.engine=megatron supports "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} (use actor.engine=fsdp for other families)"
        )
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default":
        raise UserError(
            f"model.path '{model_path}': RoPE scaling '{rope['rope_type']}' is not mapped to Megatron by mbridge; "
            "use actor.engine=fsdp or a checkpoint without rope_scaling"
        )
    if getattr(config, "rope_theta", None) is None:  # transformers 5 keeps it in rope_parameters only
        config.rope_theta = rope.get("rope_theta", 10000.0)
    if getattr(config, "use_sliding_window", False):
        raise UserError(f"model.path '{model_path}' uses sliding-window attention, which the bridge does not map")
    if kind == "qwen3_moe" and (getattr(config, "mlp_only_layers", None) or config.decoder_sparse_step != 1):
        raise UserError(f"model.path '{model_path}': dense layers inside a Qwen3-MoE model are not mapped by mbridge")
    return config


def make_bridge(hf_config: Any, dtype: torch.dtype, overrides: dict[str, Any], use_te: bool) -> Any:
    """mbridge's bridge for ``hf_config`` with our TransformerConfig ``overrides``; local spec without TE."""
    from mbridge import AutoBridge

    if _accepts(AutoBridge.from_config, "dtype"):
        bridge = AutoBridge.from_config(hf_config, dtype=dtype)
    else:  # mbridge 0.13: no options; the dtype is the attribute set_extra_args (below) rebuilds the config from
        bridge = AutoBridge.from_config(hf_config)
        bridge.dtype = dtype
    if not use_te:
        bridge.__class__ = _local_spec_class(type(bridge))
    bridge.set_extra_args(**overrides)
    return bridge


def _accepts(fn: Any, name: str) -> bool:
    """Whether ``fn`` takes keyword ``name`` (directly or through ``**kwargs``)."""
    params = inspect.signature(fn).parameters.values()
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


@functools.cache
def _local_spec_class(base: type) -> type:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    def _get_transformer_layer_spec(self, vp_stage=None):
        # megatron-core 0.12 has no vp_stage; mbridge's provider reads has_vp_stage, which its own spec getter sets
        self.has_vp_stage = _accepts(get_gpt_decoder_block_spec, "vp_stage")
        extra = {"vp_stage": vp_stage} if self.has_vp_stage else {}
        return get_gpt_decoder_block_spec(self.config, use_transformer_engine=False, **extra)

    # a subclass rather than an instance attribute: mbridge calls it through self inside its provider
    return type(f"LocalSpec{base.__name__}", (base,), {"_get_transformer_layer_spec": _get_transformer_layer_spec})


def te_name(name: str, moe: bool) -> str:
    """A local-spec parameter name as the TE spec (and so mbridge) names it."""
    if name.endswith(_INPUT_NORM[0]):
        return name[: -len(_INPUT_NORM[0])] + _INPUT_NORM[1]
    if not moe and name.endswith(_DENSE_MLP_NORM[0]):
        return name[: -len(_DENSE_MLP_NORM[0])] + _DENSE_MLP_NORM[1]
    match = _LOCAL_EXPERT.search(name)
    if match:
        return f"{name[: match.start()]}.mlp.experts.{match.group(2)}.weight{match.group(1)}"
    return name


_GROUPED_EXPERTS = re.compile(r"^(?P<experts>.*\.mlp\.experts)\.weight(?P<which>[12])$")


class TENamedView:
    """A GPTModel as mbridge expects to see it: the same parameters (and tensors) under TE-spec names.

    mbridge reads ``decoder`` (layer numbers), ``named_parameters()`` and ``state_dict()`` (whose tensors share
    storage with the parameters, so its in-place ``copy_`` loads into the model); that is all it touches.

    Grouped experts (the local spec's ``GroupedMLP`` with ``moe_grouped_gemm``, which MindSpeed replaces by its
    ``MindSpeedGmmExperts``) hold all local experts in two tensors: ``weight1`` [H, E * X1] and ``weight2``
    [E * X2, H], read by the grouped matmul as ``weight1.view(E, H, X1)`` / ``weight2.view(E, X2, H)``. The view
    shows them as TE's per-expert ``linear_fc1.weight<e>`` [X1, H] = ``weight1.view(E, H, X1)[e].T`` and
    ``linear_fc2.weight<e>`` [H, X2] = ``weight2.view(E, X2, H)[e].T``. Those are transposed (non-contiguous)
    views, which gloo cannot scatter into, so ``state_dict`` hands mbridge contiguous staging copies and
    :meth:`flush` writes them back after a load; ``named_parameters`` (export) yields contiguous copies carrying
    the per-expert TE layout's tensor-parallel attributes (fc1 column-, fc2 row-parallel)."""

    def __init__(self, module: torch.nn.Module, moe: bool, rename: bool) -> None:
        self.module, self.moe, self.rename = module, moe, rename
        self.decoder = getattr(module, "decoder", None)
        self._state: dict[str, Any] | None = None
        self._staged: list[tuple[torch.Tensor, torch.Tensor]] = []  # (staging copy, view into the grouped weight)

    def _name(self, name: str) -> str:
        return te_name(name, self.moe) if self.rename else name

    def _grouped(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
        """[(TE name of expert e, transposed view of its slice of ``tensor``)] for a grouped expert weight."""
        match = _GROUPED_EXPERTS.match(name) if self.rename else None
        if match is None:
            return None
        experts = self.module.get_submodule(match["experts"])
        count, hidden = experts.num_local_experts, experts.config.hidden_size
        fc = "linear_fc1" if match["which"] == "1" else "linear_fc2"
        blocks = tensor.view(count, hidden, -1) if fc == "linear_fc1" else tensor.view(count, -1, hidden)
        return [(f"{match['experts']}.{fc}.weight{e}", blocks[e].t()) for e in range(count)]

    def named_parameters(self, *args, **kwargs) -> Iterator[tuple[str, torch.nn.Parameter]]:
        for name, param in self.module.named_parameters(*args, **kwargs):
            grouped = self._grouped(name, param.detach())
            if grouped is None:
                yield self._name(name), param
                continue
            for te, view in grouped:
                copy = view.contiguous()
                copy.tensor_model_parallel = getattr(param, "tensor_model_parallel", False)
                copy.partition_dim = 0 if ".linear_fc1." in te else 1
                yield te, copy

    def state_dict(self) -> dict[str, Any]:
        # cached: mbridge looks up one tensor per call, and a fresh state_dict per lookup is quadratic in the
        # parameter count; a view lives for one load or export, while the parameters' storage cannot change
        if self._state is None:
            self._state = {}
            for name, tensor in self.module.state_dict().items():
                grouped = self._grouped(name, tensor)
                if grouped is None:
                    self._state[self._name(name)] = tensor
                    continue
                for te, view in grouped:
                    staging = view.contiguous()
                    self._staged.append((staging, view))
                    self._state[te] = staging
        return self._state

    def flush(self) -> None:
        """Write what mbridge loaded into the staging copies back into the grouped expert weights."""
        with torch.no_grad():
            for staging, view in self._staged:
                view.copy_(staging)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside megatron's DDP / Float16Module wrappers."""
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module
    return model


class HFLayout:
    """The exact ``state_dict`` names, shapes and tied aliases of the HF model for ``hf_config`` (built on the
    meta device: no memory), and the conversion of mbridge's checkpoint-format stream into it."""

    def __init__(self, hf_config: Any) -> None:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)
        self.shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        self.meta_state = model.state_dict()
        first: dict[int, str] = {}
        self.aliases: dict[str, list[str]] = {}  # first name of a tied parameter -> the other names
        for name, param in model.named_parameters(remove_duplicate=False):
            if id(param) in first:
                self.aliases.setdefault(first[id(param)], []).append(name)
            else:
                first[id(param)] = name
        self.tied = {alias for names in self.aliases.values() for alias in names}

    def convert(self, stream: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """mbridge's (HF checkpoint name, tensor) stream -> the HF ``state_dict``: fused experts, tied aliases,
        each name once. Raises if a name is unknown or one is missing at the end (a mapping bug)."""
        done: set[str] = set()
        experts: dict[str, dict[tuple[str, int], torch.Tensor]] = {}
        for name, tensor in stream:
            if name in self.shapes:
                if name not in done:  # a tied weight arrives from the first and the last pipeline stage
                    yield from self._emit(name, tensor, done)
                continue
            match = _HF_EXPERT.match(name)
            if match is None or not self._fused(match["prefix"]):
                raise ValueError(f"export: mbridge produced '{name}', which the HF model does not have")
            prefix = match["prefix"]
            parts = experts.setdefault(prefix, {})
            parts[(match["proj"], int(match["expert"]))] = tensor
            num_experts = self.shapes[f"{prefix}.down_proj"][0]
            if len(parts) == 3 * num_experts:
                yield from self._fuse(prefix, experts.pop(prefix), num_experts, done)
        missing = [n for n in self.shapes if n not in done]
        if missing or experts:
            raise ValueError(f"export: the stream left out {missing[:5] or list(experts)} (of {len(self.shapes)})")

    def _fused(self, prefix: str) -> bool:
        return f"{prefix}.gate_up_proj" in self.shapes and f"{prefix}.down_proj" in self.shapes

    def _emit(self, name: str, tensor: torch.Tensor, done: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
        for out in (name, *self.aliases.get(name, ())):
            if tuple(tensor.shape) != self.shapes[out]:
                raise ValueError(f"export: '{out}' has shape {tuple(tensor.shape)}, the HF model {self.shapes[out]}")
            done.add(out)
            yield out, tensor

    def _fuse(self, prefix: str, parts: dict, num_experts: int, done: set[str]):
        # transformers 5 fused layout: gate_up_proj[e] = cat([gate_proj_e, up_proj_e], 0), down_proj[e] = down_e
        gate_up = torch.stack([torch.cat([parts["gate_proj", e], parts["up_proj", e]], 0) for e in range(num_experts)])
        yield from self._emit(f"{prefix}.gate_up_proj", gate_up, done)
        down = torch.stack([parts["down_proj", e] for e in range(num_experts)])
        yield from self._emit(f"{prefix}.down_proj", down, done)
