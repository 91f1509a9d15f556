"""transformers NPU patches on the CPU shim: patched == unpatched, and the patch bookkeeping.

Tiny Qwen2 / Qwen3 / Qwen3-MoE models are built from config (fp32, fixed seed). Every equivalence test runs
the same model unpatched, then patched, and compares logits at real tokens and every parameter gradient of
a fixed linear functional of the logits (relative to the tensor's largest entry: <= 1e-5). The fused ops are
the shim's CPU references (gspo_ascend/device/shim/npu_ops.py), reached through ``import torch_npu``.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

# transformers caches its NPU detection process-wide when modeling_utils is first imported; import it before
# any shim exists so that it reads "no NPU" whatever the test order (the guard tests set it explicitly).
import transformers.modeling_utils  # noqa: F401
from gspo_ascend.patches import POINTS, apply_npu_patches, remove_npu_patches, resolve_attn_implementation

from gspo_ascend.device import CPU, NPU, NPU_SHIM, shim
from gspo_ascend.errors import UserError

FAMILIES = ("qwen2", "qwen3", "qwen3_moe")
TOL = 1e-5
LENGTHS = (9, 6, 4)  # sequences of a padded batch, and the pieces of a packed row
VOCAB = 128


@pytest.fixture
def npu():
    """The shim's torch_npu; patches and shim removed afterwards (the shim only if this fixture installed it)."""
    was_installed = shim.is_installed("npu")
    shim.install(npu=True)
    yield sys.modules["torch_npu"]
    remove_npu_patches()
    if not was_installed:
        shim.uninstall()


def tiny_model(family: str, attn: str = "sdpa", **overrides):
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False, initializer_range=0.1,
    )  # fmt: skip
    if family == "qwen2":
        config = Qwen2Config(**common, **overrides)
    elif family == "qwen3":
        config = Qwen3Config(head_dim=16, **common, **overrides)
    else:
        moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
        config = Qwen3MoeConfig(head_dim=16, **moe, **common, **overrides)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn).float()
    return model.train()  # training mode: the path the patches exist for (attention dropout is 0 anyway)


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def padded_batch(side: str) -> dict[str, torch.Tensor]:
    """Three sequences padded to the longest (left or right), or "full": three of the same length, no padding."""
    lengths = (8, 8, 8) if side == "full" else LENGTHS
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        cols = slice(width - n, width) if side == "left" else slice(0, n)
        ids[row, cols], mask[row, cols] = tokens(n, seed=row), 1
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids, "use_cache": False}


def probe(shape: tuple[int, ...]) -> torch.Tensor:
    """Fixed random weights: the loss sum(logits * w) has a different gradient for every logit."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(7))


def grads(model) -> dict[str, torch.Tensor]:
    # An expert that got no token has grad None unpatched on transformers 4.x (ModuleList) and zeros patched.
    return {n: (p.grad if p.grad is not None else torch.zeros_like(p)).clone() for n, p in model.named_parameters()}


def forward_backward(model, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = model(**batch).logits  # [B, S, V]
    real = batch["attention_mask"].bool()
    picked = logits[real]  # [tokens, V]: pad rows are undefined in both implementations
    (picked * probe(picked.shape)).sum().backward()
    return picked.detach(), grads(model)


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def assert_equivalent(got, want) -> None:
    (logits, g_got), (ref, g_want) = got, want
    assert rel_diff(logits, ref) <= TOL, f"logits differ: {rel_diff(logits, ref):.2e}"
    assert g_got.keys() == g_want.keys()
    worst = max(g_want, key=lambda name: rel_diff(g_got[name], g_want[name]))
    assert rel_diff(g_got[worst], g_want[worst]) <= TOL, f"grad {worst}: {rel_diff(g_got[worst], g_want[worst]):.2e}"


def spy_attention(npu, monkeypatch) -> list[str]:
    """Record the input_layout of every npu_fusion_attention call (proves which path a test exercised)."""
    layouts: list[str] = []
    real = npu.npu_fusion_attention

    def spy(query, key, value, head_num, input_layout, *args, **kwargs):
        layouts.append(input_layout)
        return real(query, key, value, head_num, input_layout, *args, **kwargs)

    monkeypatch.setattr(npu, "npu_fusion_attention", spy)
    return layouts


# --------------------------------------------------------------------------------------------------------
# Equivalence: patched == unpatched
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("side", ["full", "left", "right"])
def test_patched_matches_unpatched_on_padded_batches(npu, monkeypatch, family, side):
    model = tiny_model(family)
    batch = padded_batch(side)
    want = forward_backward(model, batch)
    summary = apply_npu_patches(model)
    assert set(summary.applied) == set(POINTS) - {"flash_attn_guard"} - ({"moe"} if family != "qwen3_moe" else set())
    layouts = spy_attention(npu, monkeypatch)
    assert_equivalent(forward_backward(model, batch), want)
    assert set(layouts) == ({"BSND"} if side == "full" else {"TND"})  # padding goes through the varlen path


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_sequences_match_separate_unpatched_runs(npu, monkeypatch, family):
    """One row holding three sequences (position_ids restart at 0) == each sequence run alone, unpatched."""
    model = tiny_model(family)
    pieces = [tokens(n, seed=10 + i) for i, n in enumerate(LENGTHS)]
    weights = probe((sum(LENGTHS), VOCAB))
    model.zero_grad(set_to_none=True)
    ref, start = [], 0
    for piece in pieces:  # reference: separate forward/backward passes, gradients accumulate
        logits = model(input_ids=piece[None], use_cache=False).logits[0]
        (logits * weights[start : start + len(piece)]).sum().backward()
        ref.append(logits.detach())
        start += len(piece)
    want = (torch.cat(ref), grads(model))

    apply_npu_patches(model)
    layouts = spy_attention(npu, monkeypatch)
    model.zero_grad(set_to_none=True)
    position_ids = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    logits = model(input_ids=torch.cat(pieces)[None], position_ids=position_ids, use_cache=False).logits[0]
    (logits * weights).sum().backward()
    assert_equivalent((logits.detach(), grads(model)), want)
    assert set(layouts) == {"TND"}


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_cached_decoding_with_left_padding(npu, monkeypatch, family):
    """Prefill a left-padded batch into a KV cache, then decode one token: the dense explicit-mask path."""
    model = tiny_model(family).eval()
    batch = padded_batch("left")
    step_mask = torch.cat([batch["attention_mask"], torch.ones(3, 1, dtype=torch.long)], dim=1)
    step = {"input_ids": tokens(3, seed=5)[:, None], "attention_mask": step_mask}
    step["position_ids"] = batch["position_ids"][:, -1:] + 1

    def run():
        with torch.no_grad():
            prefill = model(**{**batch, "use_cache": True})
            decode = model(**step, past_key_values=prefill.past_key_values, use_cache=True)
        return prefill.logits[batch["attention_mask"].bool()], decode.logits

    want = run()
    apply_npu_patches(model)
    layouts = spy_attention(npu, monkeypatch)
    got = run()
    assert rel_diff(got[0], want[0]) <= TOL and rel_diff(got[1], want[1]) <= TOL
    assert layouts == ["TND"] * 2 + ["BSND"] * 2  # 2 layers: prefill varlen, decode dense with a mask


def test_bf16_moe_takes_torch_npus_permute_and_matches_unpatched(npu, monkeypatch):
    """In bf16 (the NPU training dtype) the experts go through npu_moe_token_permute / unpermute, whose 2.7.1
    builds take bf16 tokens and int64 indices only; the result equals the unpatched bf16 model to bf16 rounding."""
    model = tiny_model("qwen3_moe").to(torch.bfloat16)
    batch = padded_batch("full")
    want = forward_backward(model, batch)
    used = []
    for op in ("npu_moe_token_permute", "npu_moe_token_unpermute"):
        real = getattr(npu, op)
        monkeypatch.setattr(npu, op, lambda *a, _real=real, _op=op, **k: used.append(_op) or _real(*a, **k))
    apply_npu_patches(model)
    logits, g = forward_backward(model, batch)
    assert used.count("npu_moe_token_permute") == 2 and used.count("npu_moe_token_unpermute") == 2  # 2 layers
    # bf16 keeps 8 mantissa bits: sums in another order differ by a few units in the last place (~1e-2)
    assert rel_diff(logits.float(), want[0].float()) <= 3e-2
    assert max(rel_diff(g[n].float(), want[1][n].float()) for n in g) <= 6e-2


def test_grouped_linear_forward_and_backward_match_a_loop(npu):
    """GroupedLinear (gmm forward, gmm dx, per-expert dW) == per-expert matmuls, with an empty expert."""
    from gspo_ascend.patches.npu_moe import GroupedLinear, tokens_per_expert

    from gspo_ascend.device.shim.npu_ops import float64_reference

    counts = tokens_per_expert(torch.tensor([[0, 2], [2, 0], [3, 2], [0, 3], [2, 2]]), num_experts=4)
    assert counts.tolist() == [3, 0, 5, 2]  # expert 1 gets no rows
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(10, 6, generator=gen, dtype=torch.float64, requires_grad=True)  # rows sorted by expert
    w = torch.randn(4, 5, 6, generator=gen, dtype=torch.float64, requires_grad=True)  # [E, N, K]
    g = torch.randn(10, 5, generator=gen, dtype=torch.float64)
    ends = counts.cumsum(0).tolist()
    loop = torch.cat([x[s:e] @ w[i].T for i, (s, e) in enumerate(zip([0, *ends[:-1]], ends, strict=True))])
    want = torch.autograd.grad(loop, (x, w), g)
    with float64_reference():  # exact gradients: the NPU itself has no float64 gmm
        out = GroupedLinear.apply(x, w, counts)
        got = torch.autograd.grad(out, (x, w), g)
    torch.testing.assert_close(out, loop)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])  # expert 1's gradient is exactly zero in both


def test_sequence_plan_is_computed_once_per_forward(npu, monkeypatch):
    """The packed-sequence plan costs host syncs: once per forward, not per layer; in-place edits invalidate it."""
    from gspo_ascend.patches import npu_attention

    calls = []
    real = npu_attention._sequence_plan
    monkeypatch.setattr(npu_attention, "_sequence_plan", lambda *args: calls.append(1) or real(*args))
    model = tiny_model("qwen3").eval()
    apply_npu_patches(model)
    ids = torch.cat([tokens(n, seed=i) for i, n in enumerate(LENGTHS)])[None]
    position_ids = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    with torch.no_grad():
        model(input_ids=ids, position_ids=position_ids, use_cache=False)
        assert len(calls) == 1  # two layers, one plan
        position_ids[0] = torch.arange(ids.shape[1])  # same tensor, now a single sequence
        plain = model(input_ids=ids, position_ids=position_ids, use_cache=False).logits
        assert len(calls) == 2
        remove_npu_patches()
        want = model(input_ids=ids, use_cache=False).logits
    assert rel_diff(plain, want) <= TOL


@pytest.mark.parametrize(("x_dtype", "w_dtype"), [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
def test_rms_norm_keeps_transformers_output_dtype(npu, x_dtype, w_dtype):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    norm = Qwen3RMSNorm(16, eps=1e-6).to(w_dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 16))
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(0)).to(x_dtype)
    want = norm(x)
    apply_npu_patches("qwen3")
    got = norm(x)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)  # HF rounds the normalised x to bf16 first


# --------------------------------------------------------------------------------------------------------
# Summary, idempotency, reversibility
# --------------------------------------------------------------------------------------------------------


def patch_slots(family: str) -> dict[str, object]:
    """The objects the patches replace, read straight from their owners (class __dict__, module, registries)."""
    import importlib

    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    prefix = {"qwen2": "Qwen2", "qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe"}[family]
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    slots = {
        "rms_norm": vars(getattr(module, f"{prefix}RMSNorm"))["forward"],
        "rotary": module.apply_rotary_pos_emb,
        "mlp": vars(getattr(module, f"{prefix}MLP"))["forward"],
        "attention": AttentionInterface._global_mapping.get("npu_fusion"),
        "mask": AttentionMaskInterface._global_mapping.get("npu_fusion"),
    }
    if family == "qwen3_moe":
        import transformers

        moe_cls = "Qwen3MoeExperts" if transformers.__version__ >= "5" else "Qwen3MoeSparseMoeBlock"
        slots["moe"] = vars(getattr(module, moe_cls))["forward"]
    return slots


@pytest.mark.parametrize("family", FAMILIES)
def test_summary_lists_every_patch_point(npu, family):
    summary = apply_npu_patches(tiny_model(family))
    expected = [p for p in POINTS if family == "qwen3_moe" or p != "moe"]
    assert summary.points == expected
    assert summary.entry("flash_attn_guard").status == "skipped"
    assert all(summary.status(p) == "applied" for p in expected if p != "flash_attn_guard")
    text = summary.render()
    assert text.startswith(f"NPU patches for {family}: transformers ") and "(CPU shim)" in text
    lines = text.splitlines()
    assert len(lines) == len(expected) + 1 and all(len(line) <= 120 for line in lines), text
    assert all(point in text for point in expected)


def test_applying_twice_changes_nothing(npu):
    model = tiny_model("qwen3_moe")
    originals = patch_slots("qwen3_moe")
    apply_npu_patches(model)
    patched = patch_slots("qwen3_moe")
    again = apply_npu_patches(model)
    assert all(again.status(p) == "already applied" for p in POINTS if p != "flash_attn_guard")
    assert all(patch_slots("qwen3_moe")[k] is v for k, v in patched.items())
    assert model.config._attn_implementation == "npu_fusion"
    remove_npu_patches()  # the second apply must not have recorded our own functions as "originals"
    assert all(patch_slots("qwen3_moe")[k] is v for k, v in originals.items())


@pytest.mark.parametrize("family", FAMILIES)
def test_remove_restores_the_exact_originals(npu, family):
    model = tiny_model(family)
    originals = patch_slots(family)
    assert originals["attention"] is None and originals["mask"] is None
    apply_npu_patches(model)
    patched = patch_slots(family)
    assert all(patched[k] is not v for k, v in originals.items())
    assert remove_npu_patches() > 0
    restored = patch_slots(family)
    assert all(restored[k] is v for k, v in originals.items())
    assert model.config._attn_implementation == "sdpa"
    assert remove_npu_patches() == 0


def test_family_name_registers_npu_fusion_for_loading(npu):
    summary = apply_npu_patches("Qwen2.5")
    assert summary.family == "qwen2"
    assert "attn_implementation='npu_fusion'" in summary.entry("attention").detail
    assert summary.status("flash_attn_guard") == "skipped"
    model = tiny_model("qwen2", attn="npu_fusion")  # transformers accepts the registered name at load time
    batch = padded_batch("right")
    patched = forward_backward(model, batch)
    remove_npu_patches()
    model.config._attn_implementation = "sdpa"
    assert_equivalent(patched, forward_backward(model, batch))


@pytest.mark.parametrize("target", ["llama", types.SimpleNamespace(config=types.SimpleNamespace(model_type="llama"))])
def test_unsupported_family_is_a_one_line_user_error(npu, target):
    with pytest.raises(UserError) as err:
        apply_npu_patches(target)
    message = str(err.value)
    assert "\n" not in message and "'llama'" in message
    assert all(name in message for name in ("qwen2", "qwen3", "qwen3_moe"))


def test_unknown_excluded_point_is_a_user_error(npu):
    with pytest.raises(UserError, match="unknown NPU patch point"):
        apply_npu_patches("qwen3", exclude=("rmsnorm",))


def test_other_backends_skip_every_point(npu):
    originals = patch_slots("qwen3")
    summary = apply_npu_patches(tiny_model("qwen3"), backend=CPU)
    assert summary.applied == [] and "device is cpu" in summary.entry("rms_norm").detail
    assert all(patch_slots("qwen3")[k] is v for k, v in originals.items())


def test_transformers_outside_the_gates_skips_every_point(npu, monkeypatch):
    from gspo_ascend.patches import _core

    monkeypatch.setattr(_core, "transformers_version", lambda: "5.25.0")
    summary = apply_npu_patches(tiny_model("qwen3"), backend=NPU_SHIM)
    assert summary.layout is None and summary.applied == []
    assert "5.25.0 is outside the tested gates" in summary.entry("rotary").detail


@pytest.mark.parametrize("error", [ModuleNotFoundError("No module named 'torch_npu'"), RuntimeError("libhccl.so")])
def test_missing_torch_npu_is_a_user_error(npu, monkeypatch, error):
    import importlib

    from gspo_ascend.device import detect

    real_import = importlib.import_module

    def broken(name, *args):
        if name == "torch_npu":
            raise error
        return real_import(name, *args)

    # the guarded import lives in the device layer; break it there, as a CANN-less wheel would
    monkeypatch.setattr(detect.importlib, "import_module", broken)
    with pytest.raises(UserError, match="NPU patches need torch_npu"):
        apply_npu_patches("qwen3")


def test_excluded_points_are_left_alone(npu):
    originals = patch_slots("qwen3")
    summary = apply_npu_patches(tiny_model("qwen3"), exclude=("rms_norm", "attention"))
    assert summary.entry("rms_norm").detail == "excluded by the caller" and summary.status("mlp") == "applied"
    slots = patch_slots("qwen3")
    assert slots["rms_norm"] is originals["rms_norm"] and slots["attention"] is None


def test_sliding_window_models_keep_their_attention(npu):
    model = tiny_model("qwen3", use_sliding_window=True, sliding_window=4, max_window_layers=0)
    summary = apply_npu_patches(model)
    assert summary.status("attention") == "skipped" and "sliding window 4" in summary.entry("attention").detail
    assert model.config._attn_implementation == "sdpa"


# --------------------------------------------------------------------------------------------------------
# flash_attention_2 guard
# --------------------------------------------------------------------------------------------------------


def fa2_model(family: str = "qwen3"):
    """A model whose config asks for flash_attention_2 (built with sdpa: loading FA2 fails on this host)."""
    model = tiny_model(family)
    model.config._attn_implementation = "flash_attention_2"
    return model


@pytest.fixture
def broken_fa2(npu, monkeypatch):
    """Simulate transformers 4.53.0 / 4.55.3 on an NPU: its flash_attention_2 demands the flash_attn package."""
    from importlib.metadata import PackageNotFoundError

    from gspo_ascend.patches import npu_attention
    from transformers.modeling_utils import AttentionInterface

    def fa2_forward(*args, **kwargs):
        raise PackageNotFoundError("flash_attn")  # str(): "No package metadata was found for flash_attn"

    monkeypatch.setitem(AttentionInterface._global_mapping, "flash_attention_2", fa2_forward)
    monkeypatch.setattr(npu_attention, "fa2_needs_flash_attn_package", lambda version: True)
    return npu


def test_unguarded_flash_attention_2_fails_like_the_field_report(broken_fa2):
    from importlib.metadata import PackageNotFoundError

    with pytest.raises(PackageNotFoundError, match="No package metadata was found for flash_attn"):
        fa2_model()(**padded_batch("full"))


def test_guard_routes_flash_attention_2_to_npu_fusion(broken_fa2):
    model = fa2_model()
    batch = padded_batch("right")
    model.config._attn_implementation = "sdpa"
    want = forward_backward(model, batch)
    model.config._attn_implementation = "flash_attention_2"
    summary = apply_npu_patches(model)
    guard = summary.entry("flash_attn_guard")
    assert guard.status == "applied" and guard.detail.startswith("flash_attention_2 -> npu_fusion")
    assert "FA2 needs flash_attn" in guard.detail
    assert_equivalent(forward_backward(model, batch), want)
    remove_npu_patches()
    assert model.config._attn_implementation == "flash_attention_2"


def test_guard_falls_back_to_sdpa_without_the_attention_patch(broken_fa2):
    model = fa2_model()
    summary = apply_npu_patches(model, exclude=("attention",))
    guard = summary.entry("flash_attn_guard")
    assert guard.status == "applied" and guard.detail.startswith("flash_attention_2 -> sdpa")
    assert model.config._attn_implementation == "sdpa"
    model(**padded_batch("left"))  # runs
    assert apply_npu_patches(model, exclude=("attention",)).status("flash_attn_guard") == "already applied"
    remove_npu_patches()
    assert model.config._attn_implementation == "flash_attention_2"


@pytest.mark.parametrize("detected", [True, False])
def test_guard_on_a_fixed_transformers_depends_on_its_npu_detection(npu, monkeypatch, detected):
    from gspo_ascend.patches import npu_attention

    monkeypatch.setattr(npu_attention, "fa2_needs_flash_attn_package", lambda version: False)
    monkeypatch.setattr(npu_attention, "_transformers_sees_npu", lambda: detected)
    model = fa2_model()
    guard = apply_npu_patches(model, exclude=("attention",)).entry("flash_attn_guard")
    if detected:  # transformers maps FA2 to torch_npu itself: nothing to do
        assert guard.status == "skipped" and "runs FA2 on NPU itself" in guard.detail
        assert model.config._attn_implementation == "flash_attention_2"
    else:
        assert guard.detail == "flash_attention_2 -> sdpa (transformers does not detect torch_npu)"


@pytest.mark.parametrize(
    ("version", "broken"), [("4.52.4", False), ("4.53.0", True), ("4.55.3", True), ("4.57.6", False), ("5.19.0", False)]
)
def test_flash_attn_version_table(version, broken):
    from gspo_ascend.patches.npu_attention import fa2_needs_flash_attn_package

    assert fa2_needs_flash_attn_package(version) is broken


def test_resolve_attn_implementation(monkeypatch):
    from gspo_ascend.patches import _core, npu_attention

    monkeypatch.setattr(npu_attention, "_transformers_sees_npu", lambda: True)
    assert resolve_attn_implementation("flash_attention_2", CPU) == "flash_attention_2"  # not our business
    assert resolve_attn_implementation("sdpa", NPU) == "sdpa"
    monkeypatch.setattr(_core, "transformers_version", lambda: "4.55.3")
    assert resolve_attn_implementation("flash_attention_2", NPU) == "sdpa"
    monkeypatch.setattr(_core, "transformers_version", lambda: "4.57.6")
    assert resolve_attn_implementation("flash_attention_2", NPU) == "flash_attention_2"
    monkeypatch.setattr(npu_attention, "_transformers_sees_npu", lambda: False)
    assert resolve_attn_implementation("flash_attention_2", NPU_SHIM) == "sdpa"


def test_npu_fusion_refuses_a_sliding_window(npu):
    from gspo_ascend.patches.npu_attention import npu_fusion_attention_forward

    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(ValueError, match="sliding-window"):
        npu_fusion_attention_forward(torch.nn.Module(), q, q, q, None, sliding_window=2)
