"""Which MoE kernel the pinned vLLM 0.23.0 runs on a CUDA device, and whether it returns the routes (issue #42).

``engines/vllm_env.py::cuda_route_moe_backend`` names Triton on sm 10.x where routes are asked for, and nothing
elsewhere. Its reasons are facts of the wheel, held here:

* the priority of the unquantized backends by device: ``_get_priority_backends`` of
  ``fused_moe/oracle/unquantized.py`` is run itself (its source, compiled here, with its own ``UnquantizedMoeBackend``
  enum), against a stand-in ``current_platform`` that answers the capability queries as an H100, an A100, a B200,
  an RTX Blackwell would; each candidate's ``_supports_current_device`` likewise (FlashInfer's TRTLLM bf16 kernel:
  sm 10.x alone), and its ``_supports_quant_scheme`` for unquantized weights. The rest of each kernel's
  ``is_supported_config`` (SiLU, softmax top-k renormalised, TP only: Qwen3-MoE) is not checked here; it does not
  vary by device for these kernels (read in the wheel);
* which kernels are monolithic (route inside themselves: the runner skips the router) and which are modular (the
  router routes, and its ``select_experts`` calls the capture hook);
* that an explicit ``moe_backend`` is taken before the FlashInfer environment switches, and that "triton" is one.

The real vLLM 0.23 cannot import on this box (its CUDA extension); the CPU build that CI runs picks its own kernel
(``engines/vllm_env.py::cpu_build_route_gap``, measured in tests/integration/test_vllm_routes.py).
"""

from __future__ import annotations

import ast
import builtins
import copy
import enum
from types import SimpleNamespace

import pytest

from gspo_ascend.engines import vllm_env

from .signatures import find

MOE = "vllm.model_executor.layers.fused_moe"
ORACLE = f"{MOE}.oracle.unquantized"
KERNELS = {  # the unquantized backends' classes (oracle/unquantized.py::backend_to_kernel_cls)
    "FLASHINFER_TRTLLM": f"{MOE}.experts.trtllm_bf16_moe.TrtLlmBf16Experts",
    "FLASHINFER_CUTLASS": f"{MOE}.experts.flashinfer_cutlass_moe.FlashInferExperts",
    "TRITON": f"{MOE}.experts.triton_moe.TritonExperts",
}
DEVICES = {"A100": (8, 0), "H100 / H20": (9, 0), "B200": (10, 0), "RTX Blackwell": (12, 0)}
# read in oracle/unquantized.py and each kernel's _supports_current_device / _supports_quant_scheme: FlashInfer
# TRTLLM's bf16 kernel is sm 10.x alone, CUTLASS's sm 9.0 / 10.x / 12.x, and on sm 9.x both go behind Triton
DEFAULT_KERNEL = {
    "A100": "TRITON",
    "H100 / H20": "TRITON",
    "B200": "FLASHINFER_TRTLLM",
    "RTX Blackwell": "FLASHINFER_CUTLASS",
}


def _node(dotted: str) -> ast.FunctionDef | ast.ClassDef:
    """A copy of the pinned definition's AST (signatures.find: methods through their bases; the parsed modules are
    shared with the signature suite, so what is compiled here is copied first)."""
    try:
        return copy.deepcopy(find(dotted).node)
    except LookupError as e:
        pytest.fail(f"vLLM 0.23.0 has no {dotted} ({e}): the pinned wheel changed")


class Platform:
    """vLLM's ``current_platform`` as a CUDA device of one capability answers the queries these functions make
    (``platforms/interface.py``: a family is the major, ``to_int() // 10 == family // 10``)."""

    def __init__(self, capability: tuple[int, int]):
        self.major, self.minor = capability

    def is_cuda(self) -> bool:
        return True

    def is_cuda_alike(self) -> bool:
        return True

    def supports_fp8(self) -> bool:  # CudaPlatform: sm 8.9 and later
        return (self.major, self.minor) >= (8, 9)

    def is_rocm(self) -> bool:
        return False

    def is_xpu(self) -> bool:
        return False

    def is_cpu(self) -> bool:
        return False

    def is_device_capability_family(self, capability: int, device_id: int = 0) -> bool:
        return self.major == capability // 10

    def is_device_capability(self, capability, device_id: int = 0) -> bool:
        wanted = capability if isinstance(capability, tuple) else divmod(capability, 10)
        return (self.major, self.minor) == tuple(wanted)

    def has_device_capability(self, capability, device_id: int = 0) -> bool:
        wanted = capability if isinstance(capability, tuple) else divmod(capability, 10)
        return (self.major, self.minor) >= tuple(wanted)


def _compiled(nodes: list[ast.AST], namespace: dict) -> dict:
    module = ast.Module(body=nodes, type_ignores=[])
    exec(compile(ast.fix_missing_locations(module), "<vllm 0.23.0>", "exec"), namespace)  # upstream's own source
    return namespace


def _priority(capability: tuple[int, int]) -> list[str]:
    namespace = _compiled(
        [_node(f"{ORACLE}.UnquantizedMoeBackend"), _node(f"{ORACLE}._get_priority_backends")],
        {"Enum": enum.Enum, "current_platform": Platform(capability), "FusedMoEConfig": object},
    )
    config = SimpleNamespace(moe_parallel_config=SimpleNamespace(dp_size=1))  # TP only, as our rollout runs
    return [b.name for b in namespace["_get_priority_backends"](config)]


def _supports(backend: str, method: str, capability: tuple[int, int], *args) -> bool:
    """One of a kernel's ``_supports_*`` static methods, its own source run as this device; names it reads that
    are not the platform's (quantisation keys) are distinct stand-ins, equal only to themselves."""
    node = _node(f"{KERNELS[backend]}.{method}")
    node.decorator_list = []
    namespace = {
        "current_platform": Platform(capability),
        "has_flashinfer_trtllm_fused_moe": lambda: True,  # FlashInfer installed: vLLM's fastest case
        "has_flashinfer_cutlass_fused_moe": lambda: True,
    }
    for name in {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} - set(namespace) - set(dir(builtins)):
        namespace[name] = object()
    return bool(_compiled([node], namespace)[method](*args))


def _supports_device(backend: str, capability: tuple[int, int]) -> bool:
    """``is_supported_config``'s device and quantisation checks for an unquantized model (weight and activation
    keys None), the two that differ by device for Qwen3-MoE in bf16."""
    return _supports(backend, "_supports_current_device", capability) and _supports(
        backend, "_supports_quant_scheme", capability, None, None
    )


def _default_kernel(capability: tuple[int, int]) -> str:
    """The first backend of the priority that this device supports (``select_unquantized_moe_backend``'s loop)."""
    for backend in _priority(capability):
        if backend in KERNELS and _supports_device(backend, capability):
            return backend
        assert backend in KERNELS, f"{backend} comes before a supported kernel on sm {capability}"
    pytest.fail(f"no unquantized MoE kernel of vLLM 0.23 supports sm {capability}")


def _kind(backend: str) -> str:
    """The kernel's kind, monolithic or modular, by its class's base in ``modular_kernel.py`` (one of the two)."""
    bases = {ast.unparse(b) for b in _node(KERNELS[backend]).bases}
    kinds = [k for k in ("monolithic", "modular") if f"mk.FusedMoEExperts{k.capitalize()}" in bases]
    assert len(kinds) == 1, f"{KERNELS[backend]}'s bases {sorted(bases)}"
    return kinds[0]


@pytest.mark.parametrize("device", DEVICES)
def test_vllm_0_23_routes_through_the_capture_hook_unless_told_on_sm_10(monkeypatch, device):
    """On every device but sm 10.x, vLLM 0.23's default unquantized MoE kernel is a modular one (the router
    routes): our rule passes nothing there. On sm 10.x the default is FlashInfer TRTLLM, monolithic: the rule names
    Triton, a modular kernel that every CUDA device runs."""
    capability = DEVICES[device]
    kernel = _default_kernel(capability)
    assert kernel == DEFAULT_KERNEL[device]
    assert (_kind(kernel) == "monolithic") == (capability[0] in vllm_env.CUDA_MONOLITHIC_MOE_MAJORS)
    expected = vllm_env.ROUTED_MOE_BACKEND if capability[0] in vllm_env.CUDA_MONOLITHIC_MOE_MAJORS else None
    monkeypatch.setattr(vllm_env, "vllm_release", lambda: (0, 23))
    assert vllm_env.cuda_route_moe_backend(capability) == expected
    chosen = vllm_env.ROUTED_MOE_BACKEND.upper()
    assert _kind(chosen) == "modular" and _supports_device(chosen, capability)


def test_a_monolithic_kernel_skips_the_router_whose_select_experts_captures():
    """``runner/moe_runner.py::_apply_quant_method``: a monolithic kernel gets the router logits and never calls
    ``router.select_experts``; the modular branch does, and ``BaseRouter.select_experts`` calls ``capture_fn``
    (``router/base_router.py``), the hook vLLM's model runner binds to the route buffer."""
    apply = _node(f"{MOE}.runner.moe_runner.MoERunner._apply_quant_method")
    branch = next(n for n in ast.walk(apply) if isinstance(n, ast.If) and "is_monolithic" in ast.unparse(n.test))
    assert "select_experts" not in ast.unparse(branch.body) and "apply_monolithic" in ast.unparse(branch.body)
    assert "self.router.select_experts" in ast.unparse(branch.orelse)
    select = _node(f"{MOE}.router.base_router.BaseRouter.select_experts")
    assert "self.capture_fn(topk_ids)" in ast.unparse(select)


def test_an_explicit_moe_backend_is_taken_before_the_flashinfer_switches():
    """``select_unquantized_moe_backend`` returns the user's ``moe_backend`` before it reads
    VLLM_USE_FLASHINFER_MOE_FP16, and "triton" maps to the Triton kernel (``map_unquantized_backend``). The
    engine argument itself binds to ``EngineArgs`` in test_vllm_api_conformance.py (our call passes it)."""
    select = _node(f"{ORACLE}.select_unquantized_moe_backend")
    explicit = next(
        n for n in select.body if isinstance(n, ast.If) and "runner_backend != 'auto'" in ast.unparse(n.test)
    )
    switches = [n for n in select.body if "VLLM_USE_FLASHINFER_MOE_FP16" in ast.unparse(n)]
    assert switches and explicit.lineno < switches[0].lineno
    assert isinstance(explicit.body[-1], ast.Return)
    mapping = _node(f"{ORACLE}.map_unquantized_backend")
    assert f"'{vllm_env.ROUTED_MOE_BACKEND}': UnquantizedMoeBackend.TRITON" in ast.unparse(mapping)
