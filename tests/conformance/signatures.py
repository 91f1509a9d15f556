"""Signatures of the pinned vLLM 0.11.0 / vllm-ascend 0.11.0 code, and our calls into it, both read with ``ast``.

Upstream side: :func:`find` resolves a dotted name (``vllm.entrypoints.llm.LLM.wake_up``) in the unpacked wheels,
following re-exports (``from x import y``) and, for a method, the class's bases (through their imports); a base
from torch is imported here (torch is installed). :func:`signature` turns the definition into an
``inspect.Signature`` (a class: its ``__init__``, or its fields for a dataclass / msgspec Struct without one).
The wheels cannot be imported here (vLLM's CUDA build, vllm-ascend needs torch_npu), hence the parsing.

Our side: :func:`vllm_calls` walks a module of ours and returns every call whose callee is rooted in vLLM: a
name imported from ``vllm*``, or an attribute chain on a receiver the caller names (``self.llm`` of the engine,
``self`` of the worker extension), through local assignments and ``getattr(x, "name", default)``. A call reached
only through an ``except ImportError`` or a ``getattr`` default is marked ``guarded``: it may be absent from
the pin (the fallback then runs). Deriving the calls from the source is the point: a new call is checked too.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from .upstream import wheel_root

P = inspect.Parameter
_SKIPPED_BASES = {"object", "ABC", "Generic", "Protocol", "abc.ABC"}


# ----------------------------------------------------------------------------------------------- upstream side


@dataclass(frozen=True)
class Definition:
    name: str  # dotted name it was found under
    node: ast.FunctionDef | ast.ClassDef | None  # None: an object of an installed package (torch)
    module: str
    method: bool = False  # found in a class body: the receiver binds the first parameter
    obj: Any = None  # the installed object, when node is None


def _module_file(module: str) -> Path | None:
    for dist in ("vllm", "vllm-ascend"):
        base = wheel_root(dist) / module.replace(".", "/")
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.is_file():
                return path
    return None


@cache
def _tree(module: str) -> ast.Module | None:
    path = _module_file(module)
    return ast.parse(path.read_text()) if path else None


def _imported(module: str, name: str) -> str | None:
    """The dotted name ``name`` refers to in ``module`` through an import statement (anywhere: TYPE_CHECKING too)."""
    is_package = str(_module_file(module)).endswith("__init__.py")
    for node in ast.walk(_tree(module)):
        if isinstance(node, ast.ImportFrom):
            parts = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
            source = ".".join([*parts, node.module or ""] if node.level else [node.module or ""]).strip(".")
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    return f"{source}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname == name or (alias.asname is None and alias.name.split(".")[0] == name):
                    return alias.name if alias.asname else name
    return None


def _is_overload(node: ast.AST) -> bool:
    return any(ast.unparse(d).split(".")[-1] == "overload" for d in getattr(node, "decorator_list", []))


def _top_level(module: str, name: str) -> ast.FunctionDef | ast.ClassDef | None:
    defs = [
        n
        for n in _tree(module).body
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == name
    ]
    defs = [n for n in defs if not _is_overload(n)]
    return defs[-1] if defs else None


def _installed(dotted: str) -> Definition:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)  # AttributeError: the name is not there
        return Definition(dotted, None, ".".join(parts[:i]), method=inspect.isclass(obj) is False, obj=obj)
    raise LookupError(f"cannot import {dotted}")


def find(dotted: str) -> Definition:
    """The pinned definition of ``dotted``; LookupError when the pinned code has no such name."""
    if dotted.split(".")[0] == "torch":
        try:
            return _installed(dotted)
        except AttributeError as exc:
            raise LookupError(str(exc)) from None
    parts = dotted.split(".")
    for i in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:i])
        if _tree(module) is not None:
            return _lookup(module, parts[i:])
    raise LookupError(f"no module of {dotted} in the pinned wheels")


def _lookup(module: str, names: list[str]) -> Definition:
    head, rest = names[0], names[1:]
    node = _top_level(module, head)
    if node is None:
        target = _imported(module, head)
        if target is None:
            raise LookupError(f"{module} has no {head}")
        return find(".".join([target, *rest]))
    if not rest:
        return Definition(f"{module}.{head}", node, module)
    if not isinstance(node, ast.ClassDef) or len(rest) > 1:
        raise LookupError(f"{module}.{'.'.join(names)}: not a method of a class")
    return _member(module, node, rest[0])


def _member(module: str, cls: ast.ClassDef, name: str) -> Definition:
    """``cls.name`` through the class's bases, in order (a left-to-right walk: enough for these hierarchies)."""
    defs = [
        n
        for n in cls.body
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name and not _is_overload(n)
    ]
    if defs:
        return Definition(f"{module}.{cls.name}.{name}", defs[-1], module, method=True)
    for base in cls.bases:
        text = ast.unparse(base.value if isinstance(base, ast.Subscript) else base)
        if text in _SKIPPED_BASES:
            continue
        first, _, rest = text.partition(".")
        local = _top_level(module, first)
        origin = f"{module}.{first}" if local is not None else _imported(module, first)
        if origin is None:
            continue
        try:
            return find(".".join(p for p in (origin, rest, name) if p))
        except LookupError:
            continue
    raise LookupError(f"{module}.{cls.name} has no {name} (bases included)")


def _parameters(args: ast.arguments) -> list[P]:
    positional = [*args.posonlyargs, *args.args]
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    out = []
    for i, (arg, default) in enumerate(zip(positional, defaults, strict=True)):
        kind = P.POSITIONAL_ONLY if i < len(args.posonlyargs) else P.POSITIONAL_OR_KEYWORD
        out.append(P(arg.arg, kind, default=P.empty if default is None else ast.unparse(default)))
    if args.vararg:
        out.append(P(args.vararg.arg, P.VAR_POSITIONAL))
    for arg, default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        out.append(P(arg.arg, P.KEYWORD_ONLY, default=P.empty if default is None else ast.unparse(default)))
    if args.kwarg:
        out.append(P(args.kwarg.arg, P.VAR_KEYWORD))
    return out


def _fields(cls: ast.ClassDef) -> inspect.Signature:
    """A dataclass / msgspec Struct without ``__init__``: its annotated fields, in order (ClassVars are not)."""
    params = [
        P(n.target.id, P.POSITIONAL_OR_KEYWORD, default=P.empty if n.value is None else ast.unparse(n.value))
        for n in cls.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and "ClassVar" not in ast.unparse(n)
    ]
    return inspect.Signature(params)


def signature(definition: Definition) -> inspect.Signature:
    """What a caller binds: a method without its receiver, a class's constructor without ``self``."""
    node = definition.node
    if node is None:
        sig = inspect.signature(definition.obj)
        params = list(sig.parameters.values())
        return sig.replace(parameters=params[1:]) if definition.method and params else sig
    if isinstance(node, ast.ClassDef):
        try:
            return signature(_member(definition.module, node, "__init__"))
        except LookupError:
            return _fields(node)
    params = _parameters(node.args)
    decorators = {ast.unparse(d) for d in node.decorator_list}
    if definition.method and "staticmethod" not in decorators and params:
        params = params[1:]
    return inspect.Signature(params)


def forwarded_kwargs(definition: Definition) -> Definition | None:
    """The callee a function passes its ``**kwargs`` on to (``LLM.__init__`` -> ``EngineArgs(..., **kwargs)``)."""
    node = definition.node
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.args.kwarg is None:
        return None
    for call in ast.walk(node):
        if isinstance(call, ast.Call) and any(
            k.arg is None and getattr(k.value, "id", None) == node.args.kwarg.arg for k in call.keywords
        ):
            name = ast.unparse(call.func)
            origin = f"{definition.module}.{name}" if _top_level(definition.module, name) else None
            return find(origin or _imported(definition.module, name) or name)
    return None


def bind(definition: Definition, positional: int, keywords: tuple[str, ...]) -> None:
    """Bind a call of ``positional`` arguments and ``keywords`` to the pinned signature; TypeError when it does not.
    Keywords that land in ``**kwargs`` are bound again where the function forwards them."""
    if isinstance(definition.node, ast.ClassDef):  # a construction: what runs is the class's __init__
        try:
            definition = _member(definition.module, definition.node, "__init__")
        except LookupError:
            pass  # a dataclass / msgspec Struct: signature() reads its fields
    sig = signature(definition)
    bound = sig.bind(*[object()] * positional, **{k: object() for k in keywords})
    # .get: a **kwargs the call passes nothing into has no entry (vLLM 0.23 finalize_layerwise_reload(*args, **kwargs))
    extra = next((bound.arguments.get(p.name) for p in sig.parameters.values() if p.kind is P.VAR_KEYWORD), None)
    if extra:
        target = forwarded_kwargs(definition)
        if target is None:
            raise TypeError(f"{definition.name} takes {sorted(extra)} into **kwargs and passes them nowhere")
        signature(target).bind_partial(**extra)


# ----------------------------------------------------------------------------------------------- our side


@dataclass(frozen=True)
class Call:
    path: str  # symbolic callee: "llm.wake_up", "vllm.config.set_current_vllm_config", "worker.model_runner..."
    line: int
    positional: int
    keywords: tuple[str, ...]
    guarded: bool  # reached through ``except ImportError`` or a getattr default: may be absent from the pin
    opaque: str  # what of the call cannot be read from the source (``*args``, ``**`` of a non-literal), or ""
    node: ast.Call = field(compare=False, repr=False)

    def __str__(self) -> str:
        return f"{self.path}(...) at line {self.line}"


Paths = list[tuple[str, bool]]  # (symbolic path, guarded)


def _guarded_imports(tree: ast.Module) -> set[int | str]:
    """The import statements inside ``try: ... except ImportError`` (by id), and the modules those import names
    from: another ``from`` import of such a module counts as guarded too, since the code probed the module and
    branches on the answer (``finalize_layerwise_reload`` runs only after ``initialize_layerwise_reload`` from the
    same module imported). A plain ``import vllm`` in a try guards only itself."""
    out: set[int | str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any("ImportError" in ast.unparse(h.type or ast.Pass()) for h in node.handlers):
            for stmt in (n for body in node.body for n in ast.walk(body)):
                if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                    out.add(id(stmt))
                if isinstance(stmt, ast.ImportFrom):
                    out.add(stmt.module or "")
    return out


def _own_nodes(scope: ast.AST):
    """The nodes of ``scope`` outside its nested functions and classes (those are scopes of their own)."""
    for child in ast.iter_child_nodes(scope):
        yield child
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield from _own_nodes(child)


def _dict_keys(scope: ast.AST, name: str) -> set[str] | None:
    """Keys of ``name = {...}`` in ``scope`` plus its ``name["key"] = ...`` stores; None without a dict literal."""
    keys, literal = set(), False
    for node in _own_nodes(scope):
        target = node.target if isinstance(node, ast.AnnAssign) else None
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else target
        if getattr(target, "id", None) == name and isinstance(node.value, ast.Dict):
            literal = True
            keys |= {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
        if isinstance(node, ast.Subscript) and getattr(node.value, "id", None) == name:
            if isinstance(node.ctx, ast.Store) and isinstance(node.slice, ast.Constant):
                keys.add(node.slice.value)
    return keys if literal else None


def _import_bindings(node: ast.Import | ast.ImportFrom, guarded: set[int | str]) -> dict[str, Paths]:
    """The local names an import binds to vLLM: ``import vllm`` -> vllm, ``import a.b as c`` -> a.b, ``from a
    import b as c`` -> a.b; guarded as :func:`_guarded_imports` says."""
    out = {}
    is_guarded = id(node) in guarded or (isinstance(node, ast.ImportFrom) and node.module in guarded)
    for alias in node.names:
        if isinstance(node, ast.ImportFrom):
            full, local = f"{node.module}.{alias.name}", alias.asname or alias.name
        else:
            local = alias.asname or alias.name.split(".")[0]
            full = alias.name if alias.asname else local  # ``import a.b`` binds ``a``
        if full.split(".")[0] in ("vllm", "vllm_ascend"):
            out[local] = [(full, is_guarded)]
    return out


class _Walker:
    """Finds the calls into vLLM of one module (see the module docstring)."""

    def __init__(self, tree: ast.Module, receivers: dict[str, dict[str, str] | str]):
        self.receivers, self.calls = receivers, []
        self.roots = {"vllm", "vllm_ascend"} | {
            v for spec in receivers.values() for v in (spec.values() if isinstance(spec, dict) else [spec])
        }
        self.guarded = _guarded_imports(tree)
        self.scope(tree, {}, None)

    def scope(self, node: ast.AST, outer: dict[str, Paths], cls: str | None) -> None:
        env, loops = dict(outer), {}
        for child in _own_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                env.update(_import_bindings(child, self.guarded))
            if isinstance(child, ast.For) and isinstance(child.target, ast.Name):
                if isinstance(child.iter, (ast.Tuple, ast.List)):
                    loops[child.target.id] = [e.value for e in child.iter.elts if isinstance(e, ast.Constant)]
        for _ in range(2):  # twice: an assignment may use a name assigned further down in walk order
            for child in _own_nodes(node):
                if isinstance(child, ast.Assign) and len(child.targets) == 1 and isinstance(child.targets[0], ast.Name):
                    found = self.paths(child.value, env, cls, loops)
                    if found:
                        env[child.targets[0].id] = found
        for child in _own_nodes(node):
            if isinstance(child, ast.Call):
                self.record(child, node, env, cls, loops)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.scope(child, env, cls)
            elif isinstance(child, ast.ClassDef):
                self.scope(child, env, child.name)

    def self_root(self, cls: str | None, attr: str) -> str | None:
        spec = self.receivers.get(cls or "")
        if isinstance(spec, dict):
            return spec.get(attr)
        # the worker extension's own attributes carry the gspo_ prefix; every other one is the vLLM worker's
        return None if spec is None or attr.startswith(("gspo_", "_gspo")) else f"{spec}.{attr}"

    def paths(self, expr: ast.AST, env: dict[str, Paths], cls: str | None, loops: dict[str, list]) -> Paths:
        if isinstance(expr, ast.Name):
            return env.get(expr.id, [])
        if isinstance(expr, ast.Attribute):
            if isinstance(expr.value, ast.Name) and expr.value.id == "self":
                root = self.self_root(cls, expr.attr)
                return [(root, False)] if root else []
            return [(f"{p}.{expr.attr}", g) for p, g in self.paths(expr.value, env, cls, loops)]
        if not isinstance(expr, ast.Call):
            return []
        if getattr(expr.func, "id", None) == "getattr" and len(expr.args) >= 2:
            name = expr.args[1]
            names = [name.value] if isinstance(name, ast.Constant) else loops.get(getattr(name, "id", ""), [])
            out: Paths = []
            for attr in names:  # getattr(x, "a", default): x.a, guarded by the default
                found = self.paths(ast.Attribute(value=expr.args[0], attr=attr, ctx=ast.Load()), env, cls, loops)
                out += [(p, g or len(expr.args) == 3) for p, g in found]
            return out
        return [(f"{p}()", g) for p, g in self.paths(expr.func, env, cls, loops)]

    def record(self, call: ast.Call, scope: ast.AST, env, cls, loops) -> None:
        opaque = "*args" if any(isinstance(a, ast.Starred) for a in call.args) else ""
        keywords: list[str] = []
        for kw in call.keywords:
            expanded = _dict_keys(scope, kw.value.id) if kw.arg is None and isinstance(kw.value, ast.Name) else None
            if kw.arg is None and expanded is None:
                opaque = f"**{ast.unparse(kw.value)}"
            keywords += [kw.arg] if kw.arg else sorted(expanded or ())
        for path, guarded in self.paths(call.func, env, cls, loops):
            if path.split(".")[0] in self.roots:
                self.calls.append(Call(path, call.lineno, len(call.args), tuple(keywords), guarded, opaque, call))


def vllm_calls(source: Path, receivers: dict[str, dict[str, str] | str]) -> list[Call]:
    """Every call into vLLM in ``source``. ``receivers``: per class of ours, either ``{attribute of self:
    root name}`` (``{"llm": "llm"}``: ``self.llm`` is rooted at ``llm``) or one root name for every attribute of
    ``self`` but our own ``gspo_`` ones (the worker extension, whose ``self`` is the vLLM worker)."""
    return _Walker(ast.parse(source.read_text()), receivers).calls
