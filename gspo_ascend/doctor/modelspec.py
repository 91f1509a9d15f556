"""A model's shape from its local HF ``config.json`` and its parameter counts per device under tensor /
expert parallelism. Used by the preflight (head / layer / expert divisibility) and the memory planner.

Without a local ``config.json`` (a laptop checking a cluster run, the weights elsewhere) ``model.path`` may name a
model with a built-in spec: the published config.json fields of the models our configs and scripts use, shipped
as data in ``model_specs.json``. A path matches by its exact hub id (``Qwen/Qwen3-30B-A3B``) or by its last
component (``/models/Qwen3-30B-A3B``), case-insensitively; the spec then says which entry it used and how.

Counts follow the HF module layout of the supported families (Qwen2, Qwen3, Qwen3-MoE, Qwen2-MoE, Llama,
Mistral): q/k/v/o projections (+ q/k/v bias on Qwen2), per-head q/k RMSNorm on Qwen3, SwiGLU MLPs
(3 matrices), per-layer router on MoE layers, two RMSNorms per layer, a final norm, the embedding and an
untied lm_head. Megatron shards q/k/v/o, the MLPs and the vocabulary over TP; norms and routers stay whole.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import UserError

# model_type -> (q/k/v bias when config.json has no attention_bias, per-head q/k norm)
ARCHS = {
    "qwen2": (True, False),
    "qwen2_moe": (True, False),
    "qwen3": (False, True),
    "qwen3_moe": (False, True),
    "llama": (False, False),
    "mistral": (False, False),
}
REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "max_position_embeddings")
BUILTIN_FILE = "model_specs.json"  # package data next to this module (pyproject: [tool.setuptools.package-data])


@dataclass(frozen=True)
class ModelSpec:
    source: str
    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool
    max_positions: int
    rope_factor: float = 1.0  # rope_scaling factor (yarn / linear / dynamic) extends the usable length
    experts: int = 0
    top_k: int = 0
    moe_intermediate: int = 0
    shared_intermediate: int = 0
    moe_layer_flags: tuple[bool, ...] = ()
    builtin: str = ""  # the hub id of the built-in spec used instead of a local config.json; "" = config.json
    note: str = ""  # one line saying which built-in spec was used and why (printed by preflight, plan)

    # -- structure ----------------------------------------------------------------------------------------

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    def is_moe_layer(self, i: int) -> bool:
        return bool(self.moe_layer_flags) and self.moe_layer_flags[i]

    @property
    def max_length(self) -> int:
        return int(self.max_positions * self.rope_factor)

    # -- parameters per device (tp = tensor parallel size; 1 = the whole model) ---------------------------

    def heads_per_rank(self, tp: int) -> tuple[int, int]:
        """(query heads, key/value heads) on one TP rank; KV heads are replicated when tp > kv_heads."""
        return self.heads // tp, max(self.kv_heads // tp, 1)

    def attention_params(self, tp: int = 1) -> int:
        q, kv = self.heads_per_rank(tp)
        weights = self.hidden * self.head_dim * (2 * q + 2 * kv)  # q and o: q heads; k and v: kv heads
        bias = self.head_dim * (q + 2 * kv) if self.qkv_bias else 0
        return weights + bias

    def replicated_params(self, i: int) -> int:
        """Not sharded by TP: two RMSNorms, the q/k norms, the router and the shared-expert gate."""
        n = 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)
        if self.is_moe_layer(i):
            n += self.hidden * self.experts + (self.hidden if self.shared_intermediate else 0)
        return n

    def mlp_params(self, i: int, tp: int = 1) -> int:
        """The TP-sharded MLP: the dense SwiGLU MLP, or a MoE layer's shared expert."""
        width = self.shared_intermediate if self.is_moe_layer(i) else self.intermediate
        return 3 * self.hidden * width // tp

    def expert_params(self, i: int) -> int:
        """All routed experts of layer ``i`` (sharded by EP x ETP in Megatron, by TP in vLLM)."""
        return self.experts * 3 * self.hidden * self.moe_intermediate if self.is_moe_layer(i) else 0

    def layer_params(self, i: int) -> int:
        return self.attention_params() + self.replicated_params(i) + self.mlp_params(i) + self.expert_params(i)

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def total_params(self) -> int:
        head = 0 if self.tied else self.embedding_params
        return sum(self.layer_params(i) for i in range(self.layers)) + self.embedding_params + head + self.hidden

    @property
    def active_params(self) -> int:
        """Parameters one token touches: only top_k of the routed experts."""
        inactive = sum(
            self.expert_params(i) * (self.experts - self.top_k) // self.experts
            for i in range(self.layers)
            if self.is_moe_layer(i)
        )
        return self.total_params - inactive


def _moe_flags(raw: dict, layers: int, experts: int) -> tuple[bool, ...]:
    if not experts:
        return ()
    step = raw.get("decoder_sparse_step", 1) or 1
    dense = set(raw.get("mlp_only_layers", []) or [])
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))


def _rope_factor(raw: dict) -> float:
    scaling = raw.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    return float(scaling.get("factor", 1.0)) if kind in ("yarn", "linear", "dynamic") else 1.0


def spec_from_dict(raw: dict, source: str = "config.json") -> ModelSpec:
    model_type = raw.get("model_type", "")
    if model_type not in ARCHS:
        raise UserError(
            f"model config '{source}': model_type '{model_type}' is not supported by the planner/preflight; "
            f"supported: {', '.join(sorted(ARCHS))}"
        )
    missing = [k for k in REQUIRED if k not in raw]
    if missing:
        raise UserError(f"model config '{source}': missing key '{missing[0]}' (is this a HF config.json?)")
    bias_default, qk_norm = ARCHS[model_type]
    hidden, heads, layers = raw["hidden_size"], raw["num_attention_heads"], raw["num_hidden_layers"]
    experts = raw.get("num_experts", raw.get("num_local_experts", 0)) or 0
    return ModelSpec(
        source=source,
        model_type=model_type,
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or hidden // heads,
        intermediate=raw.get("intermediate_size", 4 * hidden),
        vocab=raw["vocab_size"],
        tied=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=bool(raw.get("attention_bias", bias_default)),
        qk_norm=qk_norm,
        max_positions=raw["max_position_embeddings"],
        rope_factor=_rope_factor(raw),
        experts=experts,
        top_k=raw.get("num_experts_per_tok", 0) if experts else 0,
        moe_intermediate=raw.get("moe_intermediate_size", 0) if experts else 0,
        shared_intermediate=raw.get("shared_expert_intermediate_size", 0) if experts else 0,
        moe_layer_flags=_moe_flags(raw, layers, experts),
    )


@functools.lru_cache(maxsize=1)
def builtin_specs() -> dict[str, dict]:
    """hub id -> {"source": URL of the published config.json, "config": its fields} from ``model_specs.json``."""
    from importlib.resources import files

    return json.loads((files(__package__) / BUILTIN_FILE).read_text(encoding="utf-8"))["models"]


def builtin_ids() -> list[str]:
    return list(builtin_specs())


def builtin_match(model_path: str) -> tuple[str, str] | None:
    """(hub id, how it matched) for a ``model.path`` naming a model with a built-in spec, else None.

    The exact hub id first; then the last path component against the ids' names, because cluster configs point
    at a download directory named after the model (``/models/Qwen3-30B-A3B``). Case-insensitive: download tools
    and people lower-case these names (``qwen3-30b-a3b``)."""
    text = str(model_path).strip().rstrip("/")
    ids = {hub_id.lower(): hub_id for hub_id in builtin_specs()}
    if text.lower() in ids:
        return ids[text.lower()], "the hub id"
    names = {hub_id.split("/")[-1].lower(): hub_id for hub_id in builtin_specs()}
    last = Path(text).name
    if last.lower() in names:
        return names[last.lower()], f"its last path component '{last}'"
    return None


def builtin_spec(hub_id: str, model_path: str, how: str) -> ModelSpec:
    entry = builtin_specs()[hub_id]
    spec = spec_from_dict(entry["config"], f"built-in spec {hub_id}")
    note = (
        f"model.path '{model_path}' has no config.json: using the built-in spec of {hub_id} (matched by {how}; "
        f"fields of {entry['source']})"
    )
    return replace(spec, builtin=hub_id, note=note)


def load_spec(model_path: str) -> ModelSpec:
    """``<model.path>/config.json`` (or a path to the JSON itself) as a :class:`ModelSpec`; without one, the
    built-in spec that ``model.path`` names (:func:`builtin_match`)."""
    path = Path(model_path).expanduser()
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        match = builtin_match(model_path)
        if match is None:
            raise UserError(
                f"model.path '{model_path}' has no config.json and names no model with a built-in spec; point "
                f"model.path at a local HF model directory or use one of: {', '.join(builtin_ids())}"
            )
        return builtin_spec(match[0], model_path, match[1])
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"model config '{path}' cannot be read as JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise UserError(f"model config '{path}' must be a JSON object")
    return spec_from_dict(raw, str(path))
