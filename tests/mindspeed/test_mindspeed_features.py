"""Which MindSpeed features our engine's arguments register (gspo_ascend.engines.mindspeed_setup), read from the
real MindSpeed: its features manager decides, we record what each feature registered."""

from __future__ import annotations

import pytest

# Level-0 features: MindSpeed applies them whatever the arguments (megatron basics, PTNorm = fused RMSNorm, the
# fused RoPE / SwiGLU / softmax function replacements, grouped-matmul helpers, ...).
ALWAYS = {
    "requirements_basic", "megatron_basic", "transformer_engine_basic", "grouped_matmul", "use_swiglu",
    "fused_softmax", "use_fused_rotary_pos_emb", "moe_permute_fusion", "affinity", "profiler_default",
    "vocab_parallel", "llava_multimodal", "mcore_rearrange",
}  # fmt: skip
# the features that depend on the config, per config (mindspeed_worker.CONFIGS)
EXPECTED = {
    "dense": {"use_flash_attn", "no_create_attention_mask_in_dataloader"},
    "moe": {"use_flash_attn", "no_create_attention_mask_in_dataloader", "moe_grouped_gemm"},
    "cp2": {"context_parallel_size"},  # MindSpeed's CP attention class replaces the flash-attention forward patch
    "mc2": {"use_flash_attn", "no_create_attention_mask_in_dataloader", "use_ascend_mc2"},
}
# What core_r0.16.0 adds (doctor's branch name "0.16.0"), read from its features_manager: `dsa` is a level-0 feature
# (transformer/experimental_attention_variant/dsa.py: optimization_level=0; it patches megatron's DSA spec builder
# and rotate_activation, which our Qwen3 layers never reach); `gated-delta-net` registers its GatedDeltaNet class
# whenever CP > 1 (context_parallel/gated_delta_net.py register_patches: `_use_cp`), again a layer we do not have.
BRANCH_ALWAYS = {"0.16.0": {"dsa"}}
BRANCH_EXPECTED = {"0.16.0": {"cp2": {"gated_delta_net"}}}
KINDS = list(EXPECTED)  # the configs run here
DPA = "megatron.core.transformer.dot_product_attention.DotProductAttention"
ROPE = "megatron.core.models.common.embeddings.rope_utils.apply_rotary_pos_emb"


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    """Each config's features in a fresh process (the adaptor imported once, then our repatch)."""
    from tests.mindspeed.conftest import run_worker

    tmp = tmp_path_factory.mktemp("ms")
    return {kind: run_worker(f"features:{kind}", tmp_path=tmp)[f"features:{kind}"] for kind in KINDS}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_features_registered_per_config(fresh, kind):
    from gspo_ascend.doctor.packages import mindspeed_branch, mindspeed_package_dir

    registered = fresh[kind]["features"]
    branch = mindspeed_branch(mindspeed_package_dir())[0]
    extra = BRANCH_ALWAYS.get(branch, set()) | BRANCH_EXPECTED.get(branch, {}).get(kind, set())
    assert set(registered) == ALWAYS | EXPECTED[kind] | extra
    # fused RMSNorm is MindSpeed's PTNorm in megatron's norm slots; fused RoPE and SwiGLU replace megatron's functions
    assert "megatron.core.models.gpt.gpt_layer_specs.LNImpl" in registered["megatron_basic"]
    assert ROPE in registered["use_fused_rotary_pos_emb"]
    assert "megatron.core.fusions.fused_bias_swiglu.SwiGLUFunction" in registered["use_swiglu"]
    if "use_flash_attn" in EXPECTED[kind]:
        assert registered["use_flash_attn"] == [f"{DPA}.forward"]
    if kind == "moe":
        assert "megatron.core.transformer.moe.experts.GroupedMLP" in registered["moe_grouped_gemm"]
    if kind == "cp2":
        assert DPA in registered["context_parallel_size"]
        assert fresh[kind]["core_attention"] == "mindspeed.core.context_parallel.adaptor"
    else:
        assert fresh[kind]["core_attention"] == "megatron.core.transformer.dot_product_attention"
    if kind == "mc2":
        assert "megatron.core.tensor_parallel.layers.ColumnParallelLinear" in registered["use_ascend_mc2"]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_runtime_arguments_carry_the_config(fresh, kind):
    """MindSpeed's patched code reads these at run time (get_full_args): our values, not its defaults."""
    args = fresh[kind]["args"]
    assert args["use_flash_attn"] and args["use_fused_rmsnorm"] and args["use_fused_rotary_pos_emb"]
    assert args["moe_grouped_gemm"] == (kind == "moe")
    assert args["use_ascend_mc2"] == (kind == "mc2")
    assert args["context_parallel_size"] == (2 if kind == "cp2" else 1)
    assert args["context_parallel_algo"] == "megatron_cp_algo"
    # MindSpeed's TransformerConfig.__init__ wrapper copies them into every config built afterwards
    assert fresh[kind]["config"] == args


def test_repatching_in_one_process_equals_fresh_processes(fresh, worker):
    """apply() for one config after another (MindSpeed's repatch) leaves nothing of the previous config behind.
    One process: moe right after cp2 shows the CP attention class undone and the flash-attention forward patched
    again (each result records the core attention's module and the patch targets); a second process for cp2 then
    dense showed the same and cost ~35 s of core_r0.16.0's CI stage."""
    order = [kind for kind in ["dense", "cp2", "moe", "mc2"] if kind in KINDS]
    results = worker(*[f"features:{kind}" for kind in order])
    assert fresh["cp2"]["core_attention"] != fresh["moe"]["core_attention"]  # so moe after cp2 can tell
    for kind in order:
        assert results[f"features:{kind}"] == fresh[kind], kind
