"""Our NPU path held to the real torch-npu 2.10.0.post4 wheel (issue #14, re-pinned by issue #41 from 2.7.1):
schemas, meta registrations, op docs.

1. Signatures: every op the shim emulates has exactly the Python signature torchgen derives from the op's
   schema in the pinned wheel (names, order, keyword-only, defaults). A mismatch names both places.
2. Calls: every torch_npu call our NPU patches make, on tiny Qwen2 / Qwen3 / Qwen3-MoE models in fp32 and bf16
   (padded, full and packed batches, cached decoding, forward and backward), is recorded under the shim and
   replayed through the pinned wheel's schema (argument names and types) and its real meta function (its
   checks and output shapes), and the shim's outputs must have the meta's shapes and dtypes.
3. Refusals: the cases issue #14 found the shim accepting are refused by the real wheel too (schema or meta),
   so tests/unit/test_shim_torch_npu_limits.py holds the shim to facts of the wheel, not to our reading; what
   2.10 accepts and the shim does not emulate (its new ``sink`` / ``dropout_mask`` / ``rotate`` arguments, the
   K-split grouped matmul) the shim refuses with a message saying so.
4. The device module: every ``torch.npu`` function the shim provides exists in the pinned ``torch_npu.npu``.
"""

from __future__ import annotations

import ast
import inspect
import sys
from typing import Any

import pytest
import torch

from gspo_ascend.device import shim
from gspo_ascend.device.shim import npu_module, npu_ops

from . import torch_npu_real as real
from .upstream import PINS, upstream_file

SHIM_OPS = tuple(npu_ops.__all__)
PINNED = PINS["torch-npu"]


def _where(op: str) -> str:
    return f"shim: gspo_ascend/device/shim/npu_ops.py::{op}; torch-npu {PINNED}: {real._YAML} ({op})"


@pytest.mark.parametrize("op", SHIM_OPS)
def test_shim_signature_is_the_pinned_schema(op):
    want = real.python_params(real.schema(op))
    got = [
        (p.name, p.kind == inspect.Parameter.KEYWORD_ONLY, p.default)
        for p in inspect.signature(getattr(npu_ops, op)).parameters.values()
    ]
    assert got == want, f"signature mismatch ({_where(op)}):\n  shim:  {got}\n  {PINNED}: {want}"


@pytest.mark.parametrize("op", SHIM_OPS)
def test_shim_dtype_arguments_are_the_schemas(op):
    """Names and defaults do not show a changed type: 2.10 made npu_grouped_matmul's ``output_dtype`` an ``int?``
    (torch_npu's dtype enum) where 2.7.1 had ``ScalarType?``. A shim argument annotated ``torch.dtype`` must be a
    ``ScalarType`` in the schema, and a schema ``ScalarType`` a ``torch.dtype`` in the shim."""
    params = inspect.signature(getattr(npu_ops, op)).parameters
    declared = real.declared_types(op)
    for spelled, (name, _, _) in zip(declared, real.python_params(real.schema(op)), strict=True):
        schema_dtype = "ScalarType" in spelled
        shim_dtype = "torch.dtype" in str(params[name].annotation)
        assert schema_dtype == shim_dtype, f"{op}({name}): schema type {spelled}, shim {params[name].annotation}"


# ---------------------------------------------------------------------------------------------------------
# Replaying our calls through the real schema and meta functions
# ---------------------------------------------------------------------------------------------------------


def _type_ok(type_str: str, value: Any) -> bool:
    """Whether a Python value is what a schema type accepts (torch's spelling: ``Optional[List[int]]``)."""
    if type_str.startswith("Optional["):
        return value is None or _type_ok(type_str[len("Optional[") : -1], value)
    if type_str.startswith("List["):
        inner = type_str[len("List[") : -1]
        return isinstance(value, (list, tuple)) and all(_type_ok(inner, v) for v in value)
    checks = {
        "Tensor": lambda v: isinstance(v, torch.Tensor),
        "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "SymInt": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "bool": lambda v: isinstance(v, bool),
        "str": lambda v: isinstance(v, str),
        "ScalarType": lambda v: isinstance(v, torch.dtype),
    }
    return checks[type_str](value)


def _signature(op: str) -> inspect.Signature:
    kinds = {True: inspect.Parameter.KEYWORD_ONLY, False: inspect.Parameter.POSITIONAL_OR_KEYWORD}
    params = real.python_params(real.schema(op))
    return inspect.Signature([inspect.Parameter(name, kinds[kw], default=d) for name, kw, d in params])


def _bind(op: str, args: tuple, kwargs: dict) -> tuple[list, dict]:
    """Bind a call to the pinned schema the way the dispatcher does: positional args, then keyword-only ones."""
    schema = real.schema(op)
    bound = _signature(op).bind(*args, **kwargs)  # TypeError names an unknown / missing argument
    bound.apply_defaults()
    for spelled, (name, _, _) in zip(real.declared_types(op), real.python_params(schema), strict=True):
        value = bound.arguments[name]
        assert _type_ok(spelled, value), f"{op}: {name}={value!r} is not a {spelled} ({_where(op)})"
    positional = [bound.arguments[n] for n, kw_only, _ in real.python_params(schema) if not kw_only]
    keywords = {n: bound.arguments[n] for n, kw_only, _ in real.python_params(schema) if kw_only}
    return positional, keywords


def _to_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    if isinstance(value, (list, tuple)):
        return type(value)(_to_meta(v) for v in value)
    return value


def _flat(result: Any) -> list[Any]:
    return list(result) if isinstance(result, (list, tuple)) else [result]


def _compare(op: str, shim_out: Any, meta_out: Any) -> None:
    got, want = _flat(shim_out), _flat(meta_out)
    assert len(got) == len(want), f"{op}: shim returns {len(got)} outputs, the {PINNED} meta {len(want)}"
    # npu_fusion_attention's meta builds softmax_max / softmax_sum as [B, N, query.size(2), 8] for every layout
    # (for BSND / TND that is not S); our code reads only the attention output, so only it is compared.
    compared = got[:1] if op == "npu_fusion_attention" else got
    for i, (g, w) in enumerate(zip(compared, want, strict=False)):
        assert type(g) is type(w) or (isinstance(g, torch.Tensor) and isinstance(w, torch.Tensor)), (op, i)
        if isinstance(g, torch.Tensor):
            assert (tuple(g.shape), g.dtype) == (tuple(w.shape), w.dtype), (
                f"{op} output {i}: shim {tuple(g.shape)} {g.dtype}, {PINNED} meta {tuple(w.shape)} {w.dtype}"
            )


@pytest.fixture(scope="module")
def recorded_calls():
    """Every torch_npu op call the NPU patches make on the tiny models, with the shim's outputs."""
    from gspo_ascend.patches import apply_npu_patches, remove_npu_patches

    from tests.unit import test_patches_npu as tp

    was_installed = shim.is_installed("npu")
    shim.install(npu=True)
    module = sys.modules["torch_npu"]
    calls: list[tuple[str, tuple, dict, Any]] = []
    originals = {op: getattr(module, op) for op in SHIM_OPS}

    def recorder(op):
        def call(*args, **kwargs):
            out = originals[op](*args, **kwargs)
            calls.append((op, args, kwargs, out))
            return out

        return call

    for op in SHIM_OPS:
        setattr(module, op, recorder(op))
    try:
        for family, dtype in (("qwen2", torch.float32), ("qwen3", torch.float32), ("qwen3", torch.bfloat16),
                              ("qwen3_moe", torch.float32), ("qwen3_moe", torch.bfloat16)):  # fmt: skip
            _run_patched_model(tp, apply_npu_patches, family, dtype)
            remove_npu_patches()
    finally:
        for op, fn in originals.items():
            setattr(module, op, fn)
        remove_npu_patches()
        if not was_installed:
            shim.uninstall()
    return calls


def _run_patched_model(tp, apply_npu_patches, family: str, dtype: torch.dtype) -> None:
    model = tp.tiny_model(family).to(dtype)
    apply_npu_patches(model)
    for side in ("left", "full"):  # TND (padded), BSND with the compressed causal mask
        logits = model(**tp.padded_batch(side)).logits
        logits.float().sum().backward()
    packed = torch.cat([tp.tokens(n, seed=i) for i, n in enumerate(tp.LENGTHS)])[None]
    positions = torch.cat([torch.arange(n) for n in tp.LENGTHS])[None]
    model(input_ids=packed, position_ids=positions, use_cache=False).logits.float().sum().backward()
    model.eval()
    with torch.no_grad():  # cached decoding with left padding: BSND with an explicit mask
        batch = tp.padded_batch("left")
        batch.pop("use_cache")
        out = model(**batch, use_cache=True)
        step = {"input_ids": batch["input_ids"][:, -1:], "past_key_values": out.past_key_values}
        mask = torch.cat([batch["attention_mask"], torch.ones_like(batch["attention_mask"][:, :1])], dim=1)
        model(**step, attention_mask=mask, position_ids=batch["position_ids"][:, -1:] + 1)


def test_every_op_our_patches_use_was_exercised(recorded_calls):
    used = {op for op, *_ in recorded_calls}
    assert used == {"npu_fusion_attention", "npu_rms_norm", "npu_rotary_mul", "npu_swiglu", "npu_grouped_matmul",
                    "npu_moe_token_permute", "npu_moe_token_unpermute"}  # fmt: skip
    layouts = {args[4] if len(args) > 4 else kwargs["input_layout"] for op, args, kwargs, _ in recorded_calls
               if op == "npu_fusion_attention"}  # fmt: skip
    assert layouts == {"TND", "BSND"}


def test_every_call_passes_the_real_schema_and_meta(recorded_calls):
    metas = real.meta_functions()
    seen = set()
    for op, args, kwargs, out in recorded_calls:
        signature = (op, tuple(sorted(kwargs)), tuple(type(a).__name__ for a in args))
        positional, keywords = _bind(op, args, kwargs)
        meta_out = metas[op](*_to_meta(positional), **_to_meta(keywords))
        _compare(op, out, meta_out)
        seen.add(signature)
    assert len(seen) >= 7  # distinct call shapes replayed


# ---------------------------------------------------------------------------------------------------------
# The refusals of issue #14 item 2 are facts of the wheel
# ---------------------------------------------------------------------------------------------------------


# The arguments 2.10 added to the ops we emulate (its yaml; 2.7.1 had none of them) that change the result: the shim
# refuses them loudly rather than computing without them.
NOT_EMULATED = [("npu_fusion_attention", "sink"), ("npu_fusion_attention", "dropout_mask"),
                ("npu_fusion_attention_grad", "sink"), ("npu_rotary_mul", "rotate")]  # fmt: skip


@pytest.mark.parametrize(("op", "argument"), NOT_EMULATED)
def test_new_arguments_are_in_the_pin_and_the_shim_refuses_them(op, argument):
    params = {name: default for name, _, default in real.python_params(real.schema(op))}
    assert argument in params and params[argument] is None, f"torch-npu {PINNED}'s {op} has no {argument}=None"
    assert argument in inspect.signature(getattr(npu_ops, op)).parameters  # accepted by name, as the NPU does
    args = _tiny_call(op)
    with pytest.raises(ValueError, match=f"{argument}.*not emulated"):
        getattr(npu_ops, op)(*args, **{argument: torch.zeros(1)})


def _tiny_call(op: str) -> tuple:
    """Positional arguments of a small call each op accepts (BNSD attention, one head)."""
    q = torch.randn(1, 1, 4, 8)
    if op == "npu_fusion_attention":
        return q, q, q, 1, "BNSD"
    if op == "npu_fusion_attention_grad":
        return q, q, q, q, 1, "BNSD"
    return q, torch.ones(1, 1, 4, 8), torch.zeros(1, 1, 4, 8)  # npu_rotary_mul: x, r1 (cos), r2 (sin)


def test_dropout_rng_arguments_change_nothing_without_dropout():
    """2.10's ``seed`` / ``offset`` seed the dropout RNG (its yaml: ``int seed=0, int offset=0``); with dropout off
    (keep_prob=1, the only value emulated) the real kernel draws nothing, so the shim accepts and ignores them."""
    params = {name: default for name, _, default in real.python_params(real.schema("npu_fusion_attention"))}
    assert params["seed"] == 0 and params["offset"] == 0 and params["keep_prob"] == 1.0
    q = torch.randn(1, 2, 4, 8)
    plain = npu_ops.npu_fusion_attention(q, q, q, 2, "BNSD", scale=0.3)[0]
    seeded = npu_ops.npu_fusion_attention(q, q, q, 2, "BNSD", scale=0.3, seed=7, offset=3)[0]
    assert torch.equal(plain, seeded)


def test_fusion_attention_grad_returns_the_pinned_meta_outputs():
    """2.10's grad returns ``(dq, dk, dv, dpse, dsink)`` (2.7.1: four); without a sink, dsink is an empty fp32."""
    q = torch.randn(1, 2, 4, 8, dtype=torch.bfloat16)
    meta = real.meta_functions()["npu_fusion_attention_grad"](*_to_meta([q, q, q, q]), 2, "BNSD")
    got = npu_ops.npu_fusion_attention_grad(q, q, q, q, 2, "BNSD")
    assert len(got) == len(meta) == 5
    for i in (0, 1, 2, 4):
        assert (tuple(got[i].shape), got[i].dtype) == (tuple(meta[i].shape), meta[i].dtype), i


def test_k_split_grouped_matmul_is_accepted_by_the_pin_and_refused_by_the_shim():
    """2.10's meta takes ``group_type`` -1, 0 and 2 (2.7.1: -1 and 0); the shim emulates -1 / 0 and refuses the
    K-split 2 saying so, and both refuse any other group_type."""
    gmm = real.meta_functions()["npu_grouped_matmul"]
    x, dy = torch.empty(4, 6, device="meta"), torch.empty(6, 3, device="meta")
    counts = torch.empty(2, dtype=torch.int64, device="meta")
    (out,) = gmm([x], [dy], group_list=counts, split_item=3, group_type=2)
    assert tuple(out.shape) == (2, 4, 3)  # [E, M, N]: one weight gradient per group
    with pytest.raises(RuntimeError, match="group_type only supports -1, 0 and 2"):
        gmm([x], [dy], group_list=counts, split_item=3, group_type=1)
    xs, dys, ends = torch.randn(4, 6), torch.randn(6, 3), torch.tensor([2, 6])
    with pytest.raises(ValueError, match="group_type=2.*not emulated"):
        npu_ops.npu_grouped_matmul([xs], [dys], group_list=ends, split_item=3, group_type=2)
    with pytest.raises(ValueError, match="group_type only supports -1, 0 and 2"):
        npu_ops.npu_grouped_matmul([xs], [dys], group_list=ends, split_item=3, group_type=1)


def test_grouped_matmul_output_dtype_is_the_pinned_int_enum():
    """2.10 passes ``output_dtype`` as torch_npu's dtype enum (``int?``; meta ``gmm_get_dtype``): 15 = bf16 gives
    a bf16 result in the meta and the shim, and an unsupported value is refused by both."""
    gmm = real.meta_functions()["npu_grouped_matmul"]
    x, w = torch.randn(4, 6), torch.randn(6, 3)
    (meta,) = gmm([_to_meta(x)], [_to_meta(w)], split_item=3, group_type=-1, output_dtype=15)
    (got,) = npu_ops.npu_grouped_matmul([x], [w], split_item=3, group_type=-1, output_dtype=15)
    assert meta.dtype == got.dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="not supported"):
        gmm([_to_meta(x)], [_to_meta(w)], split_item=3, group_type=-1, output_dtype=7)
    with pytest.raises(ValueError, match="not supported"):
        npu_ops.npu_grouped_matmul([x], [w], split_item=3, group_type=-1, output_dtype=7)
    names = [name for name, *_ in real.python_params(real.schema("npu_grouped_matmul"))]
    spelled = real.declared_types("npu_grouped_matmul")[names.index("output_dtype")]
    assert spelled == "Optional[int]" and not _type_ok(spelled, torch.bfloat16)
    with pytest.raises(TypeError, match="output_dtype must be an int"):
        npu_ops.npu_grouped_matmul([x], [w], split_item=3, group_type=-1, output_dtype=torch.bfloat16)


def _op_doc(op: str) -> str:
    """The docstring the pinned torch_npu attaches to ``torch_npu.<op>`` (``_add_torch_npu_docstr(op, text)`` calls)."""
    tree = ast.parse(upstream_file("torch-npu", "torch_npu/_op_plugin_docs.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "_add_torch_npu_docstr":
            name, text = (a.value for a in node.args[:2])
            if name == op:
                return text
    raise AssertionError(f"torch-npu {PINNED} documents no {op}")


@pytest.mark.parametrize(
    ("op", "facts"),
    [
        ("npu_rotary_mul", ["input：必选输入，4维Tensor", "D < 896", "B, N < 1000", "B*N <= 1024"]),
        ("npu_moe_token_permute", ["数据类型torch.bfloat16", "数据类型torch.int64", "topK小于等于512"]),
        ("npu_moe_token_unpermute", ["数据类型torch.bfloat16", "支持的数据类型BFLOAT16"]),
        ("npu_fusion_attention", ["取值范围1~768", "Nq取值范围1~256", "varlen场景下长度最大支持1K"]),
        ("npu_grouped_matmul", ["当前支持取-1、0", "列表最大长度为128", "InnerLimit为65536"]),
        ("npu_rms_norm", ["数据类型需要和self保持一致"]),
    ],
)
def test_the_limits_the_shim_enforces_are_in_the_pinned_op_docs(op, facts):
    doc = _op_doc(op)
    for fact in facts:
        assert fact in doc, f"torch-npu {PINNED}'s doc of {op} no longer states {fact!r}; re-derive the shim's limit"


def _public_names(relpath: str) -> set[str]:
    """The names ``from torch_npu.npu.<module> import *`` binds: its ``__all__``, else its public top-level names."""
    tree = ast.parse(upstream_file("torch-npu", relpath).read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
            return {elt.value for elt in node.value.elts}
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return {n for n in names if not n.startswith("_")}


def _torch_npu_npu_names() -> set[str]:
    """What the pinned ``torch_npu.npu`` binds: its ``__all__``, its explicit relative imports and its star imports
    (``from ._backends import *`` brings ``get_soc_version``: ``_backends`` has no ``__all__``)."""
    tree = ast.parse(upstream_file("torch-npu", "torch_npu/npu/__init__.py").read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
            names |= {elt.value for elt in node.value.elts}
        elif isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            if any(alias.name == "*" for alias in node.names):
                names |= _public_names(f"torch_npu/npu/{node.module.replace('.', '/')}.py")
            else:
                names |= {alias.asname or alias.name for alias in node.names}
    return names


def test_shim_device_module_is_a_subset_of_torch_npu_npu():
    """Each torch.npu function the shim provides is one the pinned ``torch_npu.npu`` binds."""
    exported = _torch_npu_npu_names()
    assert {"get_soc_version", "Event", "device_count"} <= exported  # star import, explicit import, __all__
    device = npu_module.build_device_module()
    provided = {name for name in dir(device) if not name.startswith("_")}
    extra = sorted(provided - exported - {"streams"})
    assert not extra, f"shim's torch.npu has {extra}, which torch_npu {PINNED}'s torch_npu.npu does not bind"
    # torch_npu.npu.streams is a submodule; it must exist in the wheel with what the shim gives it
    streams = upstream_file("torch-npu", "torch_npu/npu/streams.py").read_text()
    assert all(f"class {name}(" in streams for name in dir(device.streams) if not name.startswith("_"))


def test_unsupported_dtypes_are_the_pinned_torch_npus():
    """The shim's ``torch_npu.unsupported_dtype`` (which MindSpeed's TensorSyncTool reads to number every other dtype)
    is the pinned wheel's list: torch-npu 2.10 sets it in ``_init/registry/backend.py`` (2.7.1 in its __init__.py,
    the same five quantised dtypes)."""
    from gspo_ascend.device.shim.mindspeed_support import UNSUPPORTED_DTYPES

    tree = ast.parse(upstream_file("torch-npu", "torch_npu/_init/registry/backend.py").read_text())
    lists = [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "unsupported_dtype" for t in node.targets)
    ]
    assert len(lists) == 1
    pinned = [f"torch.{element.attr}" for element in lists[0].elts]
    assert pinned == [str(dtype) for dtype in UNSUPPORTED_DTYPES]
