"""Every call the vllm rollout engine makes into vLLM binds to the pinned vLLM 0.23.0 / vllm-ascend 0.23.0 signature
(issue #14; issue #25 item 6: parameters, not only names; issue #41 moved the pins from the 0.11 line).

The calls are read from our source (:func:`tests.conformance.signatures.vllm_calls` over the engine's modules,
``gspo_ascend/engines/vllm_rollout.py``, ``vllm_worker.py`` and ``vllm_env.py``), so a new call is checked without
editing this file, and each is bound, with its positional count and keyword names, to the signature parsed from
the pinned wheel (``inspect.Signature.bind``): a renamed or removed parameter (``wake_up(tags)`` ->
``wake_up(tag)``), a new required one, or a keyword passed where the method takes none fails. Keywords
``vllm.LLM`` takes into ``**kwargs`` are bound again where ``LLM.__init__`` forwards them (``EngineArgs``). A call
that only runs behind an ``except ImportError`` or a ``getattr`` default may be absent from the pin (the fallback
runs there); any other absent name fails.

Beyond our own call sites: the ``collective_rpc`` targets bind to our worker extension's methods as vLLM 0.23
calls them on the worker (by name, ``args`` / ``kwargs``) and do not collide with NPUWorker's attributes; and
the worker calls vLLM's executor makes for our ``llm.sleep`` / ``llm.wake_up`` bind to vllm-ascend's
``NPUWorker``.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from gspo_ascend.engines import vllm_env, vllm_rollout, vllm_worker

from .signatures import Call, bind, find, signature, vllm_calls

# Who ``self`` is in our classes: the engine's ``self.llm`` is a ``vllm.LLM``; the worker extension's ``self`` is
# the vLLM worker (its ``gspo_`` attributes are ours).
OUR_RECEIVERS: dict[str, dict[str, str] | str] = {
    "VLLMRolloutEngine": {"llm": "llm"},
    "EngineSteps": {"llm": "llm"},  # multi-turn rollout in flight: the same LLM's engine
    "WeightSyncExtension": "worker",
}

# The pinned classes behind those receivers on the NPU path (vllm-ascend replaces vLLM's worker, model runner
# and platform). The model is a Qwen3 or Qwen3-MoE (the shipped configs); the sync LLM's engine core client is
# in-process (external launcher) or the multiprocess one (vLLM's default).
RECEIVERS = {
    "llm": ("vllm.entrypoints.llm.LLM",),
    "llm.llm_engine": ("vllm.v1.engine.llm_engine.LLMEngine",),
    "llm.llm_engine.engine_core": (
        "vllm.v1.engine.core_client.InprocClient",
        "vllm.v1.engine.core_client.SyncMPClient",
    ),
    # vllm-ascend 0.23 moved NPUWorker from worker/worker_v1.py (gone) to worker/worker.py:89
    "worker": ("vllm_ascend.worker.worker.NPUWorker",),
    "worker.model_runner": ("vllm_ascend.worker.model_runner_v1.NPUModelRunner",),
    "worker.model_runner.get_model()": (
        "vllm.model_executor.models.qwen3.Qwen3ForCausalLM",
        "vllm.model_executor.models.qwen3_moe.Qwen3MoeForCausalLM",
    ),
    "vllm.platforms.current_platform": ("vllm_ascend.platform.NPUPlatform",),
}
NPU_WORKER = RECEIVERS["worker"][0]
SOURCES = [Path(module.__file__) for module in (vllm_rollout, vllm_worker, vllm_env)]
FOUND = [(source.stem, call) for source in SOURCES for call in vllm_calls(source, OUR_RECEIVERS)]
CALLS = [call for _, call in FOUND]


def _targets(call: Call) -> list[str]:
    """The pinned dotted names ``call`` reaches: through its receiver's class, or the imported name itself."""
    prefix = max((r for r in RECEIVERS if call.path.startswith(f"{r}.")), key=len, default=None)
    if prefix is not None:
        return [f"{cls}{call.path[len(prefix) :]}" for cls in RECEIVERS[prefix]]
    return [] if call.path.split(".")[0] in ("llm", "worker") else [call.path]


def test_the_walker_finds_the_engines_vllm_calls():
    """The checks below are only as good as the walker: the calls we know of must be among what it finds."""
    found = {c.path for c in CALLS}
    known = {f"llm.{m}" for m in ("generate", "collective_rpc", "sleep", "wake_up", "reset_prefix_cache")}
    known |= {"vllm.LLM", "vllm.SamplingParams", "worker.model_runner.get_model", "llm.llm_engine.engine_core.shutdown"}
    known |= {"worker.model_runner.get_model().load_weights", "vllm.platforms.current_platform.is_sleep_mode_available"}
    assert known <= found, f"the walker lost {sorted(known - found)}"
    llm = next(c for c in CALLS if c.path == "vllm.LLM")
    assert {"logprobs_mode", "worker_extension_cls", "enable_sleep_mode", "tensor_parallel_size"} <= set(llm.keywords)


@pytest.mark.parametrize("call", CALLS, ids=[f"{stem}:{c.path}:{c.line}" for stem, c in FOUND])
def test_every_vllm_call_binds_to_the_pinned_signature(call: Call):
    assert not call.opaque, f"{call}: {call.opaque} cannot be read from the source, so it cannot be checked"
    targets = _targets(call)
    assert targets, f"{call}: no pinned class known for this receiver; add it to RECEIVERS"
    for target in targets:
        try:
            definition = find(target)
        except LookupError as exc:
            assert call.guarded, f"{call}: {exc} in the pin, and the call has no ImportError / getattr fallback"
            continue
        try:
            bind(definition, call.positional, call.keywords)
        except TypeError as exc:
            pytest.fail(f"{call} does not bind to the pinned {definition.name}{signature(definition)}: {exc}")


def _literal_args(call: ast.Call) -> tuple[int, list[str]]:
    """(positional count, keyword names) a ``collective_rpc(method, args=(...), kwargs={...})`` sends on."""
    values = {k.arg: k.value for k in call.keywords}
    args, kwargs = values.get("args", ast.Tuple(elts=[])), values.get("kwargs")
    assert isinstance(args, ast.Tuple), f"line {call.lineno}: args= is not a tuple literal"
    if kwargs is None:
        return len(args.elts), []
    if isinstance(kwargs, ast.Dict):
        return len(args.elts), [k.value for k in kwargs.keys]
    assert isinstance(kwargs, ast.Call) and ast.unparse(kwargs.func) == "dict", f"line {call.lineno}: kwargs="
    return len(args.elts), [k.arg for k in kwargs.keywords]


def test_the_receivers_are_in_the_pin():
    """Every pinned class behind a receiver exists: a moved class would make each lookup through it raise
    LookupError, which the checks below take for "absent in the pin" (guarded calls pass, collisions vanish)."""
    for classes in RECEIVERS.values():
        for cls in classes:
            find(cls)
    for method in ("sleep", "wake_up", "load_model"):  # NPUWorker's own (vllm-ascend worker/worker.py:216, 241)
        assert find(f"{NPU_WORKER}.{method}").name.startswith(NPU_WORKER)


def test_collective_rpc_targets_bind_to_the_worker_extension():
    """vLLM 0.23 runs a string ``collective_rpc`` as ``getattr(worker, method)(*args, **kwargs)``: in process
    through ``run_method`` (which moved from ``vllm/utils`` to ``vllm/v1/serial_utils.py:486-510``; the uniproc
    executor imports it, ``uniproc_executor.py:20``), in the multiprocess executor's worker loop
    (``WorkerProc.worker_busy_loop``, ``multiproc_executor.py:969-982``); and it refuses an extension attribute the
    worker class already has (``WorkerWrapperBase.init_worker``)."""
    run_method = ast.unparse(find("vllm.v1.executor.uniproc_executor.run_method").node)
    assert "getattr(obj, method)" in run_method and "func(*args, **kwargs)" in run_method
    busy_loop = ast.unparse(find("vllm.v1.executor.multiproc_executor.WorkerProc.worker_busy_loop").node)
    assert "getattr(self.worker, method)" in busy_loop and "func(*args, **kwargs)" in busy_loop
    rpcs = [c for c in CALLS if c.path == "llm.collective_rpc"]
    names = set()
    for rpc in rpcs:
        method = rpc.node.args[0]
        assert isinstance(method, ast.Constant), f"{rpc}: the method is not a literal name"
        names.add(method.value)
        positional, keywords = _literal_args(rpc.node)
        ours = getattr(vllm_rollout.WeightSyncExtension, method.value)
        try:  # the worker is ``self``
            inspect.signature(ours).bind(object(), *[object()] * positional, **dict.fromkeys(keywords))
        except TypeError as exc:
            pytest.fail(f"{rpc}: WeightSyncExtension.{method.value}{inspect.signature(ours)} takes no such call: {exc}")
    assert {"gspo_begin_weight_update", "gspo_load_weights", "gspo_finish_weight_update"} <= names
    for name in names:
        with pytest.raises(LookupError):
            find(f"{NPU_WORKER}.{name}")


def _worker_rpcs(method: str) -> list[tuple[str, int, list[str]]]:
    """The ``collective_rpc("<name>", ...)`` calls of the pinned vLLM's V1 ``Executor.<method>``."""
    try:
        definition = find(f"vllm.v1.executor.abstract.Executor.{method}")
    except LookupError:
        return []
    return [
        (node.args[0].value, *_literal_args(node))
        for node in ast.walk(definition.node)
        if isinstance(node, ast.Call)
        and getattr(node.func, "attr", "") == "collective_rpc"
        and node.args
        and isinstance(node.args[0], ast.Constant)
    ]


def test_worker_calls_our_llm_calls_reach_bind_to_npu_worker():
    """``LLM.sleep`` / ``LLM.wake_up`` pass through LLMEngine, the engine core client and EngineCore under the same
    name to the executor, whose ``collective_rpc`` runs the worker method: that call must bind to NPUWorker's."""
    reached = set()
    for method in sorted({c.path.split(".")[1] for c in CALLS if c.path.count(".") == 1 and c.path.startswith("llm.")}):
        for name, positional, keywords in _worker_rpcs(method):
            definition = find(f"{NPU_WORKER}.{name}")
            try:
                bind(definition, positional, tuple(keywords))
            except TypeError as exc:
                pytest.fail(
                    f"vLLM's executor calls {name}(**{keywords}); {definition.name}{signature(definition)}: {exc}"
                )
            reached.add(name)
    assert {"sleep", "wake_up"} <= reached
