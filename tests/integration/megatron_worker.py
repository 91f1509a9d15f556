"""One rank of a tiny megatron-core training job on CPU; launched by test_megatron_cpu.py.

Run as ``python megatron_worker.py --jobs dense_tp2,dense_pp2,moe_ep2 --out DIR`` with RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set. Jobs run one after another in the same process group (re-initialising
megatron's parallel state in between, which saves the ~5 s interpreter + megatron start per job). Each job
writes ``DIR/<job>.rank<r>.json`` with the per-step losses this rank saw (only the last pipeline stage sees
losses) and any extra facts the test checks.

Everything megatron gets is its own machinery: GPTModel with the local (non-Transformer-Engine) layer spec,
megatron's DistributedDataParallel wrapper, get_megatron_optimizer and get_forward_backward_func.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import zlib
from pathlib import Path

# The CUDA->CPU redirection must be in place before megatron.core is imported (megatron binds some torch.cuda
# names at import time); it is installed only in processes that ask for it, like this one.
from gspo_ascend.device import shim

shim.install(npu=False, cuda=True)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state, tensor_parallel  # noqa: E402
from megatron.core.distributed import (  # noqa: E402
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402

from gspo_ascend.engines.megatron_compat import destroy_model_parallel, patch_megatron_core  # noqa: E402

patch_megatron_core()  # what this megatron-core needs (0.12: the cluster pin; 0.16 without TE: the router)

SEED = 1234
VOCAB, SEQ, HIDDEN, LAYERS, HEADS = 128, 16, 64, 2, 4
MICRO_BATCH, NUM_MICRO_BATCHES = 2, 4

# Dense jobs start from one set of reference weights (see load_reference_weights) and all see the same global
# batch, so their losses must agree; the MoE job gives each data-parallel rank its own fixed batch.
JOBS = {
    "dense_ref": dict(tp=1, pp=1, ep=1, moe=False, dist_opt=False, recompute=False, steps=4),
    # TP=2 also recomputes activations: tensor_parallel.checkpoint saves and restores the CUDA RNG state.
    "dense_tp2": dict(tp=2, pp=1, ep=1, moe=False, dist_opt=False, recompute=True, steps=4),
    "dense_pp2": dict(tp=1, pp=2, ep=1, moe=False, dist_opt=False, recompute=False, steps=4),
    "moe_ep2": dict(tp=1, pp=1, ep=2, moe=True, dist_opt=True, recompute=False, steps=6),
}


def transformer_config(tp: int, pp: int, ep: int, moe: bool, recompute: bool = False) -> TransformerConfig:
    extra = {}
    if recompute:
        extra.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if moe:
        extra.update(
            num_moe_experts=4,
            moe_router_topk=2,
            moe_token_dispatcher_type="alltoall",
            moe_aux_loss_coeff=1e-2,
            expert_model_parallel_size=ep,
            # as Qwen3-MoE; megatron-core 0.12 also refuses biases on MoE layers (0.16 allows them)
            add_bias_linear=False,
        )
    return TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        ffn_hidden_size=4 * HIDDEN,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
        params_dtype=torch.float32,
        # Dropout off: TP=2 must reproduce TP=1 exactly, and their dropout streams differ by design.
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **extra,
    )


def build_model(config: TransformerConfig, moe: bool, dist_opt: bool) -> DistributedDataParallel:
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(num_experts=4 if moe else None),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=pp_rank == 0,
        post_process=pp_rank == pp_size - 1,
        position_embedding_type="rope",
    )
    if not moe:
        load_reference_weights(model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=dist_opt, overlap_grad_reduce=False
    )
    # What megatron.training wires up: the schedule calls this after the last backward to reduce gradients
    # across data-parallel ranks (all-reduce, or reduce-scatter for the distributed optimizer).
    config.finalize_model_grads_func = finalize_model_grads
    return DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)


def load_reference_weights(model: GPTModel) -> None:
    """Give every weight matrix the value a TP=1, PP=1 model has under the same global name, sliced for this
    TP rank: one checkpoint loaded into differently parallelised models. (Megatron's own initialisation
    cannot be compared across PP sizes: each stage draws its layers' weights from the start of the stream.)
    Norm weights and biases keep their deterministic ones / zeros."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    layers = model.decoder.layers

    def global_layer(match: re.Match) -> str:  # a PP stage numbers its layers from 0; layer_number is global
        return f"decoder.layers.{layers[int(match.group(1))].layer_number - 1}."

    for name, param in model.named_parameters():
        if param.dim() < 2:
            continue
        global_name = re.sub(r"^decoder\.layers\.(\d+)\.", global_layer, name)
        split = getattr(param, "tensor_model_parallel", False)
        shape = list(param.shape)
        if split:
            shape[param.partition_dim] *= tp_size
        gen = torch.Generator().manual_seed(zlib.crc32(global_name.encode()))
        full = torch.randn(shape, generator=gen) * 0.02
        with torch.no_grad():
            param.copy_(full.chunk(tp_size, dim=param.partition_dim)[tp_rank] if split else full)


def global_batch(seed: int = SEED) -> list[dict[str, torch.Tensor]]:
    """A fixed list of micro-batches (the same every step, so the loss must fall)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (NUM_MICRO_BATCHES, MICRO_BATCH, SEQ + 1), generator=gen)
    position_ids = torch.arange(SEQ).expand(MICRO_BATCH, SEQ)
    return [
        {"tokens": t[:, :-1].contiguous(), "labels": t[:, 1:].contiguous(), "position_ids": position_ids}
        for t in tokens
    ]


def loss_func(output_tensor: torch.Tensor):
    loss = output_tensor.float().mean()  # output_tensor: per-token cross entropy [B, S]
    # clone: the schedule divides the returned loss in place by the number of micro-batches
    return loss, {"lm loss": loss.detach().clone()}


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, loss_func


def make_optimizer(model: DistributedDataParallel, dist_opt: bool):
    config = OptimizerConfig(
        optimizer="adam", lr=1e-3, weight_decay=0.0, clip_grad=1.0, use_distributed_optimizer=dist_opt
    )
    return get_megatron_optimizer(config, [model])


def train(model: DistributedDataParallel, optimizer, steps: int, data_seed: int) -> list[float]:
    forward_backward = get_forward_backward_func()
    losses = []
    for _ in range(steps):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        out = forward_backward(
            forward_step_func=forward_step,
            data_iterator=iter(global_batch(data_seed)),
            model=[model],
            num_microbatches=NUM_MICRO_BATCHES,
            seq_length=SEQ,
            micro_batch_size=MICRO_BATCH,
            forward_only=False,
        )
        update_ok, _grad_norm, _ = optimizer.step()
        assert update_ok
        if out:  # only the last pipeline stage gets the loss dicts
            losses.append(sum(float(d["lm loss"]) for d in out) / len(out))
    return losses


def run_job(name: str, out_dir: Path, rank: int) -> None:
    spec = JOBS[name]
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=spec["tp"],
        pipeline_model_parallel_size=spec["pp"],
        expert_model_parallel_size=spec["ep"],
    )
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    config = transformer_config(spec["tp"], spec["pp"], spec["ep"], spec["moe"], spec["recompute"])
    model = build_model(config, spec["moe"], spec["dist_opt"])
    optimizer = make_optimizer(model, spec["dist_opt"])
    # Dense jobs: every rank the same global batch. MoE: one fixed batch per data-parallel rank, so the
    # alltoall dispatcher moves unequal token counts between the two expert-parallel ranks.
    data_seed = SEED + (parallel_state.get_data_parallel_rank() if spec["moe"] else 0)
    result = {
        "losses": train(model, optimizer, spec["steps"], data_seed),
        "forward_backward": get_forward_backward_func().__name__,
        "optimizers": [type(o).__name__ for o in getattr(optimizer, "chained_optimizers", [optimizer])],
    }
    if spec["moe"]:
        mlp = model.module.decoder.layers[0].mlp
        result["dispatcher"] = type(mlp.token_dispatcher).__name__
        result["local_experts"] = mlp.num_local_experts
    if name == "dense_tp2":
        result["rng_tracker"] = check_rng_tracker(spec)
    (out_dir / f"{name}.rank{rank}.json").write_text(json.dumps(result))
    destroy_model_parallel()  # megatron's, plus the embedding-group rank lists megatron-core 0.12 leaves behind


def check_rng_tracker(spec: dict) -> dict:
    """GPU-style init under TP=2: split weights come from per-TP-rank forks of the CUDA RNG, replicated ones
    from the default stream. Only if the tracker really restores the default state after each fork do the
    replicated weights (learned position embeddings) agree across TP ranks."""
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    config = transformer_config(spec["tp"], spec["pp"], spec["ep"], False)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="learned_absolute",
    )
    group = parallel_state.get_tensor_model_parallel_group()
    replicated = model.embedding.position_embeddings.weight.detach()
    split = model.embedding.word_embeddings.weight.detach()
    return {"replicated_equal": _same_on_all(replicated, group), "split_equal": _same_on_all(split, group)}


def _same_on_all(tensor: torch.Tensor, group) -> bool:
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, tensor.contiguous(), group=group)
    return all(torch.equal(gathered[0], t) for t in gathered[1:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", required=True, help="comma-separated names from JOBS")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)  # two ranks share two cores in CI
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for name in args.jobs.split(","):
            run_job(name, args.out, rank)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
