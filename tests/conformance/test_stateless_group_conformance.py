"""The weight-sync group's construction (gspo_ascend/device/stateless_group.py) against the pinned upstream code.

hccl: held to vllm-ascend 0.23.0's ``stateless_init_process_group`` (model_loader/netloader/executor/netloader_pg.py;
0.23.0 dropped 0.11.0's ``NPUPlatform.stateless_init_device_torch_dist_pg``) and to torch-npu 2.10.0.post4 (the
constructor its header declares, and the way its own Python builds the class). nccl / gloo: held to vLLM 0.23.0's
``CudaPlatformBase.stateless_init_device_torch_dist_pg`` and ``init_gloo_process_group``. None of these can run here
(no CANN, no CUDA build), so both sides are read with ``ast`` and reduced to a *recipe* (:func:`recipe`): the
statements that touch torch / torch_npu, with local variables replaced by the expressions they hold, imported
names by their full dotted path and the parameters by their role (store, rank, size, timeout, name; the store's key
prefix: prefix). A changed class
path, argument order, options object, backend type, registration device or a dropped / added
``_set_default_backend`` changes the recipe, on either side.
"""

from __future__ import annotations

import ast
import copy
import re
from pathlib import Path

from tests.conformance.upstream import upstream_file

OURS = Path(__file__).resolve().parents[2] / "gspo_ascend" / "device" / "stateless_group.py"
# upstream parameter names -> the roles our builders' parameters (store, rank, size, timeout) play
ROLES = {
    "prefix_store": "store",
    "group_rank": "rank",
    "group_size": "size",
    "world_size": "size",
    "group_name": "name",
}
HCCL = "torch_npu._C._distributed_c10d.ProcessGroupHCCL"


def _function(path: Path, name: str, cls: str | None = None) -> tuple[ast.FunctionDef, dict[str, str]]:
    """The definition of ``[cls.]name`` in ``path`` and the module's imports (local name -> dotted path)."""
    tree = ast.parse(path.read_text())
    scope = tree.body
    if cls is not None:
        scope = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    fn = next(n for n in scope if isinstance(n, ast.FunctionDef) and n.name == name)
    imports: dict[str, str] = {}
    for node in tree.body:
        _note_import(node, imports)
    return fn, imports


def _note_import(node: ast.stmt, imports: dict[str, str]) -> None:
    if isinstance(node, ast.Import):
        for alias in node.names:
            imports[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name.split(".")[0]
    elif isinstance(node, ast.ImportFrom) and node.level == 0:
        for alias in node.names:
            imports[alias.asname or alias.name] = f"{node.module}.{alias.name}"


class _Substitute(ast.NodeTransformer):
    def __init__(self, env: dict[str, ast.expr], imports: dict[str, str]):
        self.env, self.imports = env, imports

    def visit_Name(self, node: ast.Name) -> ast.expr:
        if node.id in self.env:
            return copy.deepcopy(self.env[node.id])
        if node.id in self.imports:
            return ast.parse(self.imports[node.id], mode="eval").body
        return ast.Name(ROLES.get(node.id, node.id), ast.Load())


def recipe(fn: ast.FunctionDef, imports: dict[str, str]) -> list[str]:
    """The sorted torch-facing statements of ``fn``, each with its variables expanded (see the module docstring).

    ``if is_torch_equal_or_newer(...)`` takes its body (every pin is torch >= 2.7); ``if <p> is None [or ...]`` for a
    parameter ``p`` defaulting to None takes its body (the call that leaves ``p`` out: netloader_pg.py:122's
    ``pg_options``); any other ``if`` is skipped (our optional extras and error exits); ``try`` and ``with`` bodies are
    walked (our guarded import; vLLM's ``suppress_stdout``). The first argument of a ``PrefixStore(...)`` built here
    is the role ``prefix`` wherever it recurs (netloader_pg.py:106,128: the HCCL group_id is the store prefix), and the
    variable it is assigned to the role ``store`` (the store the group is built on, as our builders receive it)."""
    imports, env, facts, aliases = dict(imports), {}, [], {}
    positional = fn.args.args[len(fn.args.args) - len(fn.args.defaults) :]
    pairs = [
        *zip(positional, fn.args.defaults, strict=True),
        *zip(fn.args.kwonlyargs, fn.args.kw_defaults, strict=True),
    ]
    none_default = {a.arg for a, d in pairs if isinstance(d, ast.Constant) and d.value is None}

    def norm(node: ast.expr) -> str:
        text = ast.unparse(_Substitute(env, imports).visit(copy.deepcopy(node)))
        for expr, role in aliases.items():
            text = text.replace(expr, role)
        return text

    def omitted(test: ast.expr) -> bool:
        first = test.values[0] if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.Or) else test
        return (
            isinstance(first, ast.Compare)
            and isinstance(first.left, ast.Name)
            and first.left.id in none_default
            and isinstance(first.ops[0], ast.Is)
            and isinstance(first.comparators[0], ast.Constant)
            and first.comparators[0].value is None
        )

    def walk(stmts: list[ast.stmt]) -> None:
        for st in stmts:
            _note_import(st, imports)
            if isinstance(st, (ast.Assign, ast.AnnAssign)) and st.value is not None:
                target = st.targets[0] if isinstance(st, ast.Assign) else st.target
                if isinstance(target, ast.Name):
                    value = st.value
                    if isinstance(value, ast.Call) and ast.unparse(value.func).endswith("PrefixStore") and value.args:
                        aliases[norm(value.args[0])] = "prefix"
                        env[target.id] = ast.Name("store", ast.Load())
                        continue
                    env[target.id] = ast.parse(norm(value), mode="eval").body
                elif isinstance(target, ast.Attribute):
                    facts.append(f"{norm(target)} = {norm(st.value)}")
            elif isinstance(st, ast.Expr) and isinstance(st.value, ast.Call):
                facts.append(norm(st.value))
            elif isinstance(st, ast.Return) and st.value is not None:
                facts.append(f"return {norm(st.value)}")
            elif isinstance(st, ast.Try):
                walk(st.body)
            elif isinstance(st, ast.With):  # vLLM 0.23 builds its gloo group under ``with suppress_stdout():``
                walk(st.body)  # (vllm/distributed/utils.py:528), which only silences output
            elif isinstance(st, ast.If) and "is_torch_equal_or_newer" in ast.unparse(st.test):
                assert re.search(r"is_torch_equal_or_newer\(['\"]2\.[0-7]['\"]\)", ast.unparse(st.test)), st.test
                walk(st.body)
            elif isinstance(st, ast.If) and omitted(st.test):
                walk(st.body)

    walk(fn.body)
    return sorted(f for f in facts if f.startswith("torch") or f.startswith("return torch"))


def _ours(name: str) -> list[str]:
    return recipe(*_function(OURS, name))


# netloader_pg.py:145-150: the group entered in torch.distributed's registry. Ours stays outside it (stateless_group.py
# module docstring); ``_world.pg_* = ...`` are item assignments, which the recipe does not collect, so this is the one
# registry statement of their recipe
REGISTRY = "torch._C._distributed_c10d._register_process_group(name, torch.distributed.ProcessGroup(store, rank, size))"


def test_hccl_group_is_built_as_vllm_ascend_builds_it():
    netloader = upstream_file("vllm-ascend", "vllm_ascend/model_loader/netloader/executor/netloader_pg.py")
    theirs = recipe(*_function(netloader, "stateless_init_process_group"))
    assert REGISTRY in theirs
    assert _ours("_hccl_group") == [f for f in theirs if f != REGISTRY]
    # what the comparison covers, spelled out: a recipe reduced to nothing would compare equal too
    options = f"{HCCL}.Options()"
    assert f"{options}._timeout = timeout" in theirs
    assert f"{options}.is_high_priority_stream = False" in theirs
    assert f"{options}.global_ranks_in_group = []" in theirs
    assert f"{options}.group_id = prefix" in theirs  # the PrefixStore's prefix (netloader_pg.py:106,128)
    assert any(f.startswith(f"{HCCL}(store, rank, size, {options})._set_sequence_number_for_group()") for f in theirs)
    register = [f for f in theirs if "._register_backend(" in f]
    assert (
        len(register) == 1 and "torch.device('npu'), torch.distributed.ProcessGroup.BackendType.CUSTOM" in register[0]
    )
    c10d = "torch.distributed.distributed_c10d"
    default = f"{c10d}.Backend.backend_type_map[{c10d}.Backend('hccl')]"
    assert f"torch.distributed.ProcessGroup(store, rank, size)._set_default_backend({default})" in theirs
    assert "torch.distributed.ProcessGroup(store, rank, size)._set_group_name(name)" in theirs
    # vllm-ascend 0.23.0 has no NPUPlatform.stateless_init_device_torch_dist_pg any more (0.11.0's recipe)
    platform = upstream_file("vllm-ascend", "vllm_ascend/platform.py").read_text()
    assert "def stateless_init_device_torch_dist_pg" not in platform


def test_nccl_group_is_built_as_vllm_builds_it():
    theirs = recipe(
        *_function(
            upstream_file("vllm", "vllm/platforms/cuda.py"), "stateless_init_device_torch_dist_pg", "CudaPlatformBase"
        )
    )
    assert _ours("_nccl_group") == theirs
    assert any("torch.device('cuda'), torch.distributed.ProcessGroup.BackendType.NCCL" in f for f in theirs)


def test_gloo_group_is_built_as_vllm_builds_it():
    theirs = recipe(*_function(upstream_file("vllm", "vllm/distributed/utils.py"), "init_gloo_process_group"))
    assert _ours("_gloo_group") == theirs
    assert any("torch.device('cpu'), torch.distributed.ProcessGroup.BackendType.GLOO" in f for f in theirs)


def test_torch_npu_declares_the_constructor_we_call():
    """torch-npu 2.7.1's header: ``ProcessGroupHCCL(store, int rank, int size, intrusive_ptr<Options>)`` (the other
    constructor, with a group name, is deprecated), and ``Options`` is a ``c10d::Backend::Options`` (where torch's
    binding defines ``_timeout``) constructible without arguments."""
    header = upstream_file("torch-npu", "torch_npu/include/torch_npu/csrc/distributed/ProcessGroupHCCL.hpp").read_text()
    constructors = re.findall(r"(C10_DEPRECATED\s+)?ProcessGroupHCCL\(([^()]*(?:\([^()]*\)[^()]*)*)\)", header)
    current = [params for deprecated, params in constructors if not deprecated and "Store" in params]
    assert len(current) == 1, constructors
    types = [" ".join(p.split("=")[0].split()[:-1]) for p in current[0].split(",")]
    assert types == [
        "const c10::intrusive_ptr<c10d::Store>&",
        "int",
        "int",
        "c10::intrusive_ptr<Options>",
    ]
    assert re.search(r"struct Options\s*:\s*c10d::Backend::Options", header)
    assert re.search(r"explicit Options\(bool is_high_priority_stream = false\);", header)
    # ours passes exactly those four, the options made by Options() (held here too, not only through vllm-ascend)
    assert any(f"{HCCL}(store, rank, size, {HCCL}.Options())" in f for f in _ours("_hccl_group"))


def test_torch_npu_builds_the_class_the_same_way_itself():
    """The pinned torch-npu's own backend factory (``_new_process_group_hccl_helper``, what
    ``init_process_group("hccl")`` runs; in 2.10 it moved from ``torch_npu/__init__.py`` to
    ``torch_npu/_init/registry/distributed.py:4-20``) calls the same class path with (store, rank, size, options)
    and sets ``_timeout`` on its Options."""
    init = upstream_file("torch-npu", "torch_npu/_init/registry/distributed.py")
    fn = next(
        n for n in ast.walk(ast.parse(init.read_text())) if getattr(n, "name", "") == "_new_process_group_hccl_helper"
    )
    calls = [c for c in ast.walk(fn) if isinstance(c, ast.Call) and ast.unparse(c.func) == HCCL]
    assert len(calls) == 1 and len(calls[0].args) == 4 and not calls[0].keywords
    assert "_timeout" in {
        t.attr for a in ast.walk(fn) if isinstance(a, ast.Assign) for t in a.targets if isinstance(t, ast.Attribute)
    }
    assert HCCL in _ours_classes()


def _ours_classes() -> set[str]:
    fn, _ = _function(OURS, "_hccl_group")
    found = {}
    for node in ast.walk(fn):
        _note_import(node, found)
    return set(found.values())
