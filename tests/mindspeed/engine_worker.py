"""One rank of the megatron engine under the real MindSpeed (emulated NPU); launched by test_mindspeed_engine.py.

    python -m tests.mindspeed.engine_worker --cases fsdp_dense,old_dense,ms_dense_tp1 --out DIR

with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and GSPO_DEVICE_SHIM=1 set. The ``ms_*`` cases run through
tests/integration/megatron_engine_worker.py's machinery (``run_case``: build, log-probs of this rank's rows, update,
export) with the backend ``npu`` (the CPU shim), on which the engine configures MindSpeed itself. Two jobs of this
file count the fused ops MindSpeed's patched code calls and describe the built model.

The ``old_*`` cases run the engine as it was at commit ``OLD_COMMIT`` (its ``engines/megatron.py`` and
``megatron_cp.py``, read with ``git show`` and executed as modules; the other modules are today's, which the old
engine calls with unchanged signatures) on a backend that takes the old engine's real-NPU branch: MindSpeed's adaptor
imported with a neutral argv first (what the old engine's ``import mindspeed.megatron_adaptor`` got in a Ray actor:
Ray's argv has none of MindSpeed's flags), then the old engine. Each records the exception it fails with and the
warnings it logs. The fsdp and old cases must come first in a process (the MindSpeed engine patches the process).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import subprocess
import sys
import types
from pathlib import Path

import torch

from tests.integration import megatron_engine_worker as worker

REPO = Path(__file__).resolve().parents[2]
OLD_COMMIT = "d4f770f"  # issue #13 part 1: the engine before it configured MindSpeed
WIDE = ["actor.tensor_parallel_size=2", "actor.sequence_parallel=true", "model.dtype=bfloat16"]
WIDE_DIR = "tiny-qwen3-wide"
MOE_KV2_DIR = "tiny-qwen3-moe-kv2"
# the shipped 30B training layout (configs/qwen3_30b_a3b_gspo.yaml: TP 4 + SP, PP 2, EP 8 x ETP 1, full recompute,
# offload, distributed optimizer) scaled to 4 ranks: TP 2 x PP 2 (DP 1), EP 2 x ETP 1 folded into each stage's 2
# ranks (expert DP 1). Run in float32 and in the 30B's bf16 (test_mindspeed_training_layout.py says why both).
LAYOUT = [
    "actor.tensor_parallel_size=2", "actor.sequence_parallel=true", "actor.pipeline_parallel_size=2",
    "actor.expert_parallel_size=2", "actor.expert_tensor_parallel_size=1", "actor.recompute=full",
    "actor.offload=true", "actor.use_distributed_optimizer=true",
]  # fmt: skip
CASES = {
    # name: (model, config overrides, jobs in run order); the fsdp references of megatron_engine_worker
    # (fsdp_dense, fsdp_kv2) are used too
    "fsdp_moe": ("moe", ["actor.engine=fsdp"], ("update",)),
    "ms_dense_tp1": ("dense", [], ("count", "log_probs", "update", "describe")),
    "ms_moe_tp1": ("moe", [], ("count", "log_probs", "describe")),
    "ms_dense_tp2": ("dense_kv2", ["actor.tensor_parallel_size=2"], ("count", "log_probs", "update", "describe")),
    # TP 2 over the tiny Qwen3's one KV head: megatron-core 0.16 replicates it (core_r0.16.0 only; 0.12.1 refuses)
    "ms_dense_tp2_kv1": ("dense", ["actor.tensor_parallel_size=2"], ("count", "log_probs", "update", "describe")),
    "ms_moe_ep2": ("moe", ["actor.expert_parallel_size=2"], ("count", "log_probs", "update", "describe")),
    "ms_dense_cp2": ("dense", ["actor.context_parallel_size=2"], ("count", "log_probs", "update", "describe")),
    # MC2 (use_ascend_mc2) needs TP > 1, sequence parallelism and, by torch_npu 2.7.1's limits on its kernels, a
    # bf16 model whose matmul k is >= 256: the "wide" model; its reference is the same layout without MC2
    "ms_wide_sp2": ("wide", [*WIDE, "actor.use_mc2=false"], ("count", "log_probs", "update", "describe")),
    "ms_wide_mc2": ("wide", [*WIDE, "actor.use_mc2=true"], ("count", "log_probs", "update", "describe", "checkpoint")),
    # the training layout (4 ranks) and its reference: the same MoE (two KV heads, which TP 2 needs) in fsdp
    "fsdp_moe_kv2": ("moe_kv2", ["actor.engine=fsdp"], ("update",)),
    "ms_moe_layout": ("moe_kv2", LAYOUT, ("offload", "layout", "count", "update", "describe")),
    "ms_moe_layout_bf16": ("moe_kv2", [*LAYOUT, "model.dtype=bfloat16"], ("offload", "layout", "update")),
}
OLD_CASES = {  # name: (model, config overrides)
    "old_dense": ("dense", []),
    "old_moe": ("moe", []),
    "old_cp2": ("dense", ["actor.context_parallel_size=2"]),
}
worker.CASES.update(CASES)
worker.BACKEND.update({case: "npu" for case in CASES if case.startswith("ms_")})
LOCAL_MODELS = {"wide": WIDE_DIR, "moe_kv2": MOE_KV2_DIR}  # kind -> directory the test process writes in out
_model_path = worker.model_path
worker.model_path = lambda kind, out: str(out / LOCAL_MODELS[kind]) if kind in LOCAL_MODELS else _model_path(kind, out)
_calls: collections.Counter = collections.Counter()


def make_wide_model(out: Path) -> None:
    """A random Qwen3 (tiny's vocabulary and tokenizer) wide enough for torch_npu's MC2 kernels at TP 2: hidden 256
    (the column-parallel all-gather matmul's k), 4 heads of 128 and FFN 512 (the row-parallel matmul-reduce-scatter's
    k per TP rank: 256). Weights rounded to bf16, saved in fp32: the bf16 engine loads them exactly, the fp32 HF
    reference computes with the same numbers."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src = worker.ensure_tiny_model()
    config = AutoConfig.from_pretrained(src)
    config.update(
        dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=128, intermediate_size=512)
    )
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _round_to_bf16(model)
    model.save_pretrained(out / WIDE_DIR)
    AutoTokenizer.from_pretrained(src).save_pretrained(out / WIDE_DIR)


def _round_to_bf16(model) -> None:
    """Weights rounded to bf16, kept in fp32: a bf16 engine loads them exactly, the fp32 references see the same."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())


def make_moe_kv2_model(out: Path) -> None:
    """The tiny Qwen3-MoE with its one KV head duplicated into two (the same function; TP 2 needs two KV heads),
    saved to ``out / MOE_KV2_DIR`` (gspo_ascend.selftest.fixtures.make_kv2_model writes a fixed name: a subfolder).
    Weights rounded to bf16, saved in fp32 (as make_wide_model): a bf16 engine loads them exactly, and the fp32
    references (HF, fsdp) compute with the same numbers as both the fp32 and the bf16 engine."""
    from transformers import AutoModelForCausalLM

    from gspo_ascend.selftest.fixtures import make_kv2_model

    made = make_kv2_model(worker.ensure_tiny_model(moe=True), out / "moe_kv2_build")
    model = AutoModelForCausalLM.from_pretrained(made, dtype=torch.float32)
    _round_to_bf16(model)
    model.save_pretrained(made)
    made.rename(out / MOE_KV2_DIR)


# ----------------------------------------------------------------------------------------------- jobs


def count_fused_ops(engine) -> dict:
    """From here on, count the fused-op calls of this engine (``mindspeed_worker.count_fused_calls``)."""
    from tests.mindspeed.mindspeed_worker import count_fused_calls

    count_fused_calls(_calls)
    _calls.clear()
    return {}


def _mc2_linears(model) -> dict:
    """The MC2 linears of the built model: each one's class, and whether it is ``mindspeed_setup``'s wrapper of
    MindSpeed's (the class our ``mc2_tp_group_wrapper`` makes lives in that module)."""
    found = {name: type(m) for name, m in model.named_modules() if type(m).__name__.startswith("MindSpeedMC2")}
    return {
        "mc2_linears": {name: cls.__name__ for name, cls in found.items()},
        "mc2_wrapped": {name: cls.__module__ == "gspo_ascend.engines.mindspeed_setup" for name, cls in found.items()},
    }


def describe(engine) -> dict:
    """What the engine built under MindSpeed: the fused-op calls since ``count``, the MindSpeed fields of the model's
    TransformerConfig, the classes of core attention / experts / optimizer, and MindSpeed's patch targets outside
    megatron (the process-wide ones)."""
    from gspo_ascend.engines import megatron_bridge as mb
    from gspo_ascend.engines import mindspeed_setup

    model = mb.unwrap(engine.models[0])
    layer = model.decoder.layers[0]
    keys = ("use_flash_attn", "use_fused_rmsnorm", "use_fused_rotary_pos_emb", "moe_grouped_gemm",
            "use_ascend_mc2", "bias_activation_fusion", "context_parallel_algo")  # fmt: skip
    # MindSpeed sets sparse_mode at the first forward on the core attention's config, which megatron-core 0.16
    # deep-copies from the model's where TP exceeds the KV heads (transformer/attention.py: tmp_config)
    core_config = layer.self_attention.core_attention.config
    inner = [type(sub.optimizer).__module__ + "." + type(sub.optimizer).__name__ for sub in engine._sub_optimizers()]
    targets = {t for registered in mindspeed_setup.registered_features().values() for t in registered}
    outside = sorted(t for t in targets if not t.startswith("megatron."))
    return {
        "calls": dict(_calls),
        "config": {**{k: getattr(engine.tconfig, k, None) for k in keys}, "sparse_mode": core_config.sparse_mode},
        "core_attention": type(layer.self_attention.core_attention).__name__,
        "norm": type(layer.input_layernorm).__module__,
        "experts": type(layer.mlp.experts).__name__ if engine.moe else None,
        "optimizer": inner,
        "process_wide_targets": outside,
        "float64_all_reduce": _float64_all_reduce(engine),
        **_mc2_linears(model),
        **_process_wide_behaviour(),
        "lifted": _lifted_behaviour(),
        "after_lift": _process_wide_behaviour(),
    }


def _process_wide_behaviour() -> dict:
    """Two of MindSpeed's process-wide patches observed from outside megatron: ``Tensor.view`` of a non-contiguous
    (but viewable) tensor returns a view of a *copy*, so writes through it are lost; ``torch.compile`` returns the
    function unchanged (MindSpeed's ``dummy_compile``)."""
    base = torch.zeros(4, 4)
    base[:, :2].view(4, 2).fill_(1.0)  # plain torch: a view of base's memory
    compiled = torch.compile(torch.sin)
    return {
        "view_writes_through": bool(base[:, :2].eq(1.0).all()),
        "compile_module": torch.compile.__module__,
        "compile_returns_eager_wrapper": compiled.__module__.startswith("mindspeed"),
    }


def _lifted_behaviour() -> dict:
    """The same observations inside ``mindspeed_setup.patches_lifted()`` (how the vLLM rollout calls vLLM beside
    MindSpeed), plus a float64 SUM over all ranks through the plain ``all_reduce``, and the targets lifted."""
    import torch.distributed as dist

    from gspo_ascend.engines import mindspeed_setup

    with mindspeed_setup.patches_lifted() as lifted:
        seen = _process_wide_behaviour()
        total = torch.tensor([dist.get_rank() + 1.0], dtype=torch.float64)
        dist.all_reduce(total)
        nested = mindspeed_setup.patches_lifted().__enter__()  # nothing left to lift
    return {**seen, "float64_sum": float(total), "targets": sorted(lifted), "nested": nested}


def _float64_all_reduce(engine) -> dict:
    """A float64 SUM over all ranks through ``torch.distributed.all_reduce`` as the process now has it (MindSpeed's
    bypass wrapped by our fix), and through MindSpeed's own bypass alone."""
    import torch.distributed as dist
    from mindspeed.patch_utils import MindSpeedPatchesManager

    from gspo_ascend.engines import mindspeed_setup

    rank = dist.get_rank()
    patched = torch.tensor([rank + 1.0], dtype=torch.float64)
    dist.all_reduce(patched)
    patch = MindSpeedPatchesManager.patches_info[mindspeed_setup.ALL_REDUCE]
    mindspeed_only = patch.wrappers[0](patch.orig_func)  # MindSpeed's torch_all_reduce_double_dtype_bypass_wrapper
    raw = torch.tensor([rank + 1.0], dtype=torch.float64)
    mindspeed_only(raw)
    return {"ours": float(patched), "mindspeed_bypass": float(raw), "wrappers": [w.__name__ for w in patch.wrappers]}


def layout(engine) -> dict:
    """The layout the engine really built (megatron's parallel state, the model's config, the optimizer's
    classes), this rank's parameters (dense / expert), and from here on the offload accounting right after each
    optimizer step (every rank steps; only the last stage computes losses, where offload_round_trip records)."""
    from megatron.core import parallel_state as ps

    from gspo_ascend.engines import megatron_bridge as mb

    model = mb.unwrap(engine.models[0])
    params = [p for m in engine.models for p in m.parameters()]
    expert = [p for p in params if not getattr(p, "allreduce", True)]  # megatron marks expert parameters so
    steps: list[dict] = []
    step = engine.optimizer.step_with_ready_grads

    def recording_step(*args, **kwargs):
        out = step(*args, **kwargs)
        steps.append(engine.resident_bytes())  # inside the update: every part up, AdamW's state just made
        return out

    engine.optimizer.step_with_ready_grads = recording_step
    checkpoints = _count_checkpoints()
    sizes = ("tensor_model_parallel", "pipeline_model_parallel", "expert_model_parallel", "expert_tensor_parallel")
    return {
        "sizes": {n: getattr(ps, f"get_{n}_world_size")() for n in (*sizes, "data_parallel")},
        "stage": ps.get_pipeline_model_parallel_rank(),
        "layers": len(model.decoder.layers),
        "local_experts": getattr(model.decoder.layers[0].mlp, "num_local_experts", None),
        "recompute": {k: getattr(engine.tconfig, k) for k in ("recompute_granularity", "recompute_method",
                                                              "recompute_num_layers", "sequence_parallel")},
        "optimizers": [type(engine.optimizer).__name__, *(type(s).__name__ for s in engine._sub_optimizers())],
        "numel": {"dense": sum(p.numel() for p in params) - sum(p.numel() for p in expert),
                  "expert": sum(p.numel() for p in expert)},
        "step_resident": steps,
        "checkpoints": checkpoints,
    }  # fmt: skip


def _count_checkpoints() -> list[int]:
    """From here on, count megatron's activation checkpoints (``tensor_parallel.checkpoint``, which megatron's and
    MindSpeed's ``_checkpointed_forward`` call once per recomputed chunk of layers); the list's one item grows."""
    from megatron.core import tensor_parallel

    count, checkpoint = [0], tensor_parallel.checkpoint

    def counting(*args, **kwargs):
        count[0] += 1
        return checkpoint(*args, **kwargs)

    tensor_parallel.checkpoint = counting
    return count


worker.EXTRA_JOBS.update(count=count_fused_ops, describe=describe, layout=layout)


# ----------------------------------------------------------------------------------------------- the old engine


def _git_show(path: str) -> str:
    return subprocess.run(
        ["git", "show", f"{OLD_COMMIT}:{path}"], capture_output=True, text=True, check=True, cwd=REPO
    ).stdout


def _module(name: str, source: str, filename: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__file__ = filename
    sys.modules[name] = module  # dataclasses look their module up
    exec(compile(source, filename, "exec"), module.__dict__)
    return module


def old_engine_module() -> types.ModuleType:
    """``gspo_ascend/engines/megatron.py`` at ``OLD_COMMIT``, importing that commit's ``megatron_cp.py``."""
    if "gspo_old.megatron" in sys.modules:
        return sys.modules["gspo_old.megatron"]
    cp = _module("gspo_old.megatron_cp", _git_show("gspo_ascend/engines/megatron_cp.py"), f"{OLD_COMMIT}:megatron_cp")
    source = _git_show("gspo_ascend/engines/megatron.py")
    line = "from gspo_ascend.engines import megatron_cp as cp_support\n"
    assert line in source
    module = _module("gspo_old.megatron", source.replace(line, ""), f"{OLD_COMMIT}:megatron.py")
    module.cp_support = cp
    return module


def run_old_case(case: str, out: Path, rank: int, world: int) -> None:
    """The old engine on a "real NPU" as its code sees it (name npu, not emulated; tensors on the CPU): build it
    and compute log-probs; record the first exception and the warnings."""
    from gspo_ascend.config import load_config
    from gspo_ascend.device import NPU_SHIM, shim
    from gspo_ascend.engines import megatron_bridge as mb
    from gspo_ascend.engines import mindspeed_setup
    from gspo_ascend.engines.megatron_compat import destroy_model_parallel
    from gspo_ascend.engines.microbatch import dp_shard

    kind, overrides = OLD_CASES[case]
    old = old_engine_module()
    mb.prime_device_context()
    shim.install(mindspeed=True)  # on the NPU: the real torch_npu
    with mindspeed_setup._neutral_argv():  # what the old engine's import of the adaptor saw in a Ray actor
        import mindspeed.megatron_adaptor  # noqa: F401
    backend = dataclasses.replace(NPU_SHIM, emulated=False)
    cfg = load_config(None, [*worker.BASE, *overrides])
    batch = torch.load(out / "batches.pt", weights_only=False)["main"]
    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger(old.__name__).addHandler(handler)
    engine, stage, error, experts = None, "build", None, None
    try:
        engine = old.MegatronEngine(cfg, backend, worker.model_path(kind, out))
        if engine.moe:
            experts = type(mb.unwrap(engine.models[0]).decoder.layers[0].mlp.experts).__name__
        stage = "log_probs"
        engine.compute_log_probs(dp_shard(batch, rank, world, 1), worker.TEMPERATURE)
        stage = "done"
    except Exception as exc:  # noqa: BLE001 -- recording it is the point
        error = f"{type(exc).__name__}: {exc}"
    finally:
        if engine is not None:
            engine.close()
        else:
            destroy_model_parallel()
    result = {"case": case, "stage": stage, "error": error, "warnings": warnings, "experts": experts}
    torch.save(result, out / f"{case}.rank{rank}.pt")


def launch_worlds(out: Path, worlds: list[tuple[int, list[str]]], timeout_s: float) -> None:
    """The test side: run this worker's ``cases`` at each (world size, cases), in order, on the emulated NPU."""
    import pytest

    from tests.integration.launch import launch_ranks

    with pytest.MonkeyPatch.context() as env:
        env.setenv("GSPO_DEVICE_SHIM", "1")  # trainer.device=npu is the emulated NPU
        env.setenv("TORCH_EXTENSIONS_DIR", str(out / "torch_extensions"))  # MindSpeed creates it at import
        for world, cases in worlds:
            launch_ranks(
                world, [__file__, "--cases", ",".join(cases), "--out", str(out)], f"world{world}", out, timeout_s
            )


def main() -> None:
    import argparse
    import os

    import torch.distributed as dist

    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", required=True)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for case in args.cases.split(","):
            if case in OLD_CASES:
                run_old_case(case, args.out, rank, world)
            else:
                worker.run_case(case, args.out, rank, world)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
