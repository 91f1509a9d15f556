"""The selftest's first two records: what device and stack it ran on (for bug reports), and the tiny model."""

from __future__ import annotations

from importlib import metadata

FIX = "docs/troubleshooting.md#selftest-setup: `gspo-ascend make-tiny-model` (offline), `gspo-ascend doctor`"
_PACKAGES = (
    "torch",
    "torch_npu",
    "transformers",
    "vllm",
    "vllm_ascend",
    "megatron-core",
    "mbridge",
    "mindspeed",
    "ray",
)


def versions() -> str:
    found = []
    for name in _PACKAGES:
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    return ", ".join(found)


def describe_device(backend, devices: int) -> str:
    if backend.emulated:
        what = "npu emulated on the CPU shim (torch_npu stand-in, collectives as gloo)"
    elif backend.name == "cpu":
        what = "cpu"
    else:
        what = f"{backend.name}: {backend.module().get_device_name(0)}, {backend.device_count()} visible"
    bf16 = "bf16 yes" if backend.is_bf16_supported() else "bf16 no"
    return f"{what}; {devices} used; {bf16}; collective backend {backend.comm_backend}; {versions()}"


def tiny_model(cache: dict[str, str]) -> str:
    """The embedded tiny Qwen3 (built offline on first use, about a minute), remembered in ``cache``."""
    if "path" not in cache:
        from ..tiny import ensure_tiny_model

        cache["path"] = str(ensure_tiny_model())
    return cache["path"]
