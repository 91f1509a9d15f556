"""Runs the real MindSpeed under the CPU shim, one case per fresh process (tests/mindspeed/ launches it).

    python -m tests.mindspeed.mindspeed_worker CASE [CASE ...]

Prints one line per case on stdout: ``RESULT {"case": ..., ...}`` (MindSpeed logs to stdout too). A fresh process
per launch matters: MindSpeed registers its ``mindspeed`` torch library at import, so a failed import cannot be
retried in the same process.
"""

from __future__ import annotations

import collections
import json
import os
import sys
from typing import Any

MARK = "RESULT "
CONFIGS: dict[str, dict[str, Any]] = {  # actor overrides, and whether the model has experts
    "dense": {"actor": {}, "moe": False},
    "moe": {"actor": {"expert_parallel_size": 1}, "moe": True},
    "cp2": {"actor": {"context_parallel_size": 2}, "moe": False},
    "mc2": {"actor": {"use_mc2": True, "tensor_parallel_size": 2, "sequence_parallel": True}, "moe": False},
}  # MC2 without TP > 1 and SP is refused by mindspeed_args (test_mindspeed_engine.py)


def _config(kind: str):
    from gspo_ascend.config import Config

    cfg = Config()
    for key, value in CONFIGS[kind]["actor"].items():
        setattr(cfg.actor, key, value)
    if cfg.actor.use_mc2:
        cfg.model.dtype = "bfloat16"  # torch_npu's MC2 kernels take no fp32 (refused by mindspeed_args otherwise)
    return cfg, CONFIGS[kind]["moe"]


def features(kind: str) -> dict[str, Any]:
    """MindSpeed's registered features for one config, and the run-time arguments its patched code reads."""
    from gspo_ascend.engines import mindspeed_setup as ms

    cfg, moe = _config(kind)
    registered = ms.apply(ms.mindspeed_args(cfg, moe=moe))
    args = ms.runtime_args()
    keys = ("use_flash_attn", "use_fused_rmsnorm", "use_fused_rotary_pos_emb",
            "moe_grouped_gemm", "use_ascend_mc2", "context_parallel_size", "context_parallel_algo")  # fmt: skip
    from megatron.core.transformer import TransformerConfig, dot_product_attention

    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2)  # what MindSpeed adds to it
    return {
        "config": {key: getattr(config, key, None) for key in keys},
        "features": {name: list(targets) for name, targets in registered.items()},
        "args": {key: getattr(args, key, None) for key in keys},
        "core_attention": dot_product_attention.DotProductAttention.__module__,
    }


def adaptor() -> dict[str, Any]:
    """Import the real adaptor with MindSpeed's defaults (neutral argv) and report what it touched."""
    sys.argv = sys.argv[:1]
    import mindspeed.megatron_adaptor  # noqa: F401
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    from gspo_ascend.device import shim

    return {
        "cuda_redirect": shim.is_installed("cuda"),  # installed by importing the transfer_to_npu stand-in
        "megatron_imported": "megatron.core" in sys.modules,
        "config_init_wrapped": hasattr(TransformerConfig.__init__, "__wrapped__"),  # MindSpeed wraps it
        "compile_patched": torch.compile.__module__,
    }


def count_fused_calls(calls: collections.Counter) -> None:
    """From here on, count in ``calls`` every ``torch_npu.npu_*`` call and every call of the shim's references for
    MindSpeed's own compiled ops (what MindSpeed's patched megatron reaches). Idempotent: a counted op is not
    wrapped twice."""
    import torch_npu  # the shim's stand-in

    from gspo_ascend.device.shim import mindspeed_ops

    def counting(name: str, fn: Any) -> Any:
        if getattr(fn, "_counted", False):
            return fn

        def call(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            if name == "npu_fusion_attention":  # also by layout: TND is a packed (THD) micro-batch
                layout = kwargs.get("input_layout", args[4] if len(args) > 4 else None)
                calls[f"{name}[{layout}]"] += 1
                if layout == "TND" and list(kwargs.get("actual_seq_qlen") or [None])[0] == 0:
                    calls[f"{name}[TND with a leading 0]"] += 1  # torch_npu documents ends without it
            return fn(*args, **kwargs)

        call._counted = True
        return call

    for name in [n for n in dir(torch_npu) if n.startswith("npu_")]:
        setattr(torch_npu, name, counting(name, getattr(torch_npu, name)))
    for module in mindspeed_ops.OP_MODULES.values():
        for name in [n for n in vars(module) if not n.startswith("_")]:
            setattr(module, name, counting(f"mindspeed.{name}", getattr(module, name)))


_calls: collections.Counter = collections.Counter()  # the counting wrappers are installed once a process


def forward(kind: str) -> dict[str, Any]:
    """One forward and backward of megatron-core's GPTModel (Qwen3-like, 2 layers) with MindSpeed's patches (or,
    for kind "plain", without MindSpeed); returns the logits, the counted fused-op calls and the grad norm. Another
    MindSpeed kind may follow in the same process (conftest.py ``in_one_process``): the process group is kept, the
    model-parallel state rebuilt, the counts started again."""
    import torch
    import torch.nn.functional as F

    if kind != "plain":
        features(kind)
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    count_fused_calls(_calls)
    _calls.clear()

    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.destroy_model_parallel()  # a no-op for the first forward of a process
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)
    moe = kind == "moe"
    kw = dict(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16, ffn_hidden_size=128,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        qk_layernorm=True, layernorm_epsilon=1e-6, params_dtype=torch.float32, hidden_dropout=0.0,
        attention_dropout=0.0, variable_seq_lengths=True, moe_token_dispatcher_type="alltoall",
        # the engine's settings without Transformer Engine (engines/megatron.py)
        bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False, apply_rope_fusion=False, bias_dropout_fusion=False,
    )  # fmt: skip
    if moe:
        kw.update(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_grouped_gemm=True,
                  moe_router_dtype="fp32", moe_aux_loss_coeff=0.0)  # fmt: skip
    config = TransformerConfig(**kw)
    spec = get_gpt_layer_local_spec(num_experts=4 if moe else None, moe_grouped_gemm=moe, qk_layernorm=True)
    model = GPTModel(config, spec, vocab_size=128, max_sequence_length=64, position_embedding_type="rope")
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 128, (2, 16), generator=generator)
    positions = torch.arange(16).expand(2, 16)
    logits = model(tokens, positions, attention_mask=None)  # the engine's call: right padding, no mask
    logits.float().pow(2).mean().backward()
    grad_norm = torch.sqrt(sum(p.grad.float().pow(2).sum() for p in model.parameters() if p.grad is not None))
    return {
        "logits": logits.detach().flatten().tolist(),
        "calls": dict(_calls),
        "grad_norm": float(grad_norm),
        "experts": type(model.decoder.layers[0].mlp.experts).__name__ if moe else None,
    }


def gmm() -> dict[str, Any]:
    """MindSpeed's own ``mindspeed.ops.gmm.npu_gmm`` (its torch-library op, autograd Function and builder, with the
    shim's CPU reference as the compiled module) against per-group matmuls in float64: forward and gradients."""
    import mindspeed.megatron_adaptor  # noqa: F401  (the adaptor imports the CUDA redirection first)
    import torch
    from mindspeed.ops.gmm import npu_gmm

    generator = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, 5, 2])  # an empty group included
    x = torch.randn(int(counts.sum()), 8, generator=generator, requires_grad=True)
    w = torch.randn(4, 8, 6, generator=generator, requires_grad=True)
    dy = torch.randn(int(counts.sum()), 6, generator=generator)
    y = npu_gmm(x, w, group_list=torch.cumsum(counts, 0), group_type=0)
    y.backward(dy)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    groups = torch.repeat_interleave(torch.arange(4), counts)
    ref = torch.einsum("mk,mkn->mn", x64, w64[groups])
    ref.backward(dy.double())
    return {
        "y": float((y.double() - ref).abs().max()),
        "dx": float((x.grad.double() - x64.grad).abs().max()),
        "dw": float((w.grad.double() - w64.grad).abs().max()),
        "scale": float(ref.abs().max()),
    }


def uninstall() -> dict[str, Any]:
    """Install the MindSpeed support, import the transfer_to_npu stand-in, uninstall: what is left behind."""
    import torch

    from gspo_ascend.device import shim
    from gspo_ascend.device.shim import cuda_redirect

    original_mapping = cuda_redirect._cpu_if_cuda
    shim.install(mindspeed=True)
    import torch_npu.contrib.transfer_to_npu  # noqa: F401

    installed = {
        "torchair": "torchair" in sys.modules,
        "cuda": shim.is_installed("cuda"),
        "npu_method": "npu" in vars(torch.Tensor),
    }
    shim.uninstall()
    names = ("torch_npu", "torchair", "torchair.ge", "acl", "torch_npu.contrib", "torch_npu.contrib.transfer_to_npu")
    return {
        "installed": installed,
        "left_in_sys_modules": [n for n in names if n in sys.modules],
        "npu_method": "npu" in vars(torch.Tensor),
        "mapping_restored": cuda_redirect._cpu_if_cuda is original_mapping,
        "cuda": shim.is_installed("cuda"),
    }


def main(cases: list[str]) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    from gspo_ascend.device import shim

    for case in cases:
        kind, _, arg = case.partition(":")
        if kind == "uninstall":
            result = uninstall()
        else:
            if kind == "forward" and arg == "plain":
                shim.install(npu=True, cuda=True)
            else:
                shim.install(mindspeed=True)
            cases = {"adaptor": adaptor, "features": features, "forward": forward, "gmm": gmm}
            result = cases[kind](*([arg] if arg else []))
        print(MARK + json.dumps({"case": case, **result}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
