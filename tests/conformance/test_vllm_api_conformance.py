"""What the vllm rollout engine asks of vLLM exists in the pinned vLLM 0.11.0 and vllm-ascend 0.11.0 (issue #14).

Read from the wheels' source (vLLM's CUDA wheel cannot be imported here, and vllm-ascend needs torch_npu):
* every keyword ``VLLMRolloutEngine._build_llm`` passes to ``vllm.LLM`` is a field of 0.11.0's ``EngineArgs``
  (``LLM.__init__`` forwards its keywords there), read from our own source so a new keyword is checked too;
* every ``LLM`` method the engine calls is defined by 0.11.0's ``vllm.LLM``;
* what the worker extension calls inside a worker (``model_runner.get_model``, ``vllm_config``) and the sleep /
  wake-up calls are defined by vllm-ascend 0.11.0's ``NPUWorker`` / ``NPUModelRunner``.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap

from gspo_ascend.engines import vllm_rollout

from .upstream import upstream_file


def _class(relpath: str, dist: str, name: str) -> ast.ClassDef:
    tree = ast.parse(upstream_file(dist, relpath).read_text())
    return next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)


def _methods(cls: ast.ClassDef) -> set[str]:
    return {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _our_llm_keywords() -> set[str]:
    """Keys of the kwargs dict in ``_build_llm`` plus the ``kwargs["..."] = ...`` assignments after it."""
    source = inspect.getsource(vllm_rollout.VLLMRolloutEngine._build_llm)
    tree = ast.parse(textwrap.dedent(source))  # decorators included
    keys = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            keys |= {k.value for k in node.keys if isinstance(k, ast.Constant)}
        if isinstance(node, ast.Subscript) and getattr(node.value, "id", "") == "kwargs":
            if isinstance(node.slice, ast.Constant):
                keys.add(node.slice.value)
    return keys


def test_llm_keywords_are_engine_args_of_vllm_0_11():
    engine_args = _class("vllm/engine/arg_utils.py", "vllm", "EngineArgs")
    fields = {n.target.id for n in engine_args.body if isinstance(n, ast.AnnAssign)}
    ours = _our_llm_keywords()
    assert {"logprobs_mode", "worker_extension_cls", "enable_sleep_mode", "tensor_parallel_size"} <= ours
    assert ours - {"model"} <= fields, f"not EngineArgs fields in vLLM 0.11.0: {sorted(ours - {'model'} - fields)}"


def test_llm_methods_the_engine_calls_exist_in_vllm_0_11():
    called = set(re.findall(r"self\.llm\.([a-z_]+)\(", inspect.getsource(vllm_rollout)))
    assert {"generate", "collective_rpc", "sleep", "wake_up", "reset_prefix_cache"} <= called
    missing = called - _methods(_class("vllm/entrypoints/llm.py", "vllm", "LLM"))
    assert not missing, f"vLLM 0.11.0's LLM has no {sorted(missing)}"


def test_worker_side_calls_exist_in_vllm_ascend_0_11():
    worker = _methods(_class("vllm_ascend/worker/worker_v1.py", "vllm-ascend", "NPUWorker"))
    runner = _methods(_class("vllm_ascend/worker/model_runner_v1.py", "vllm-ascend", "NPUModelRunner"))
    assert {"sleep", "wake_up", "get_model"} <= worker
    assert "get_model" in runner
    extension = inspect.getsource(vllm_rollout.WeightSyncExtension)
    assert set(re.findall(r"self\.model_runner\.([a-z_]+)", extension)) <= runner
