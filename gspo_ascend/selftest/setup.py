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


def installed(names=_PACKAGES) -> dict[str, str | None]:
    """Each distribution's installed version, None where it is absent."""
    found: dict[str, str | None] = {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def versions() -> str:
    return ", ".join(f"{name} {version}" for name, version in installed().items() if version)


def describe_device(backend, devices: int) -> str:
    if backend.emulated:
        what = "npu emulated on the CPU shim (torch_npu stand-in, collectives as gloo)"
    elif backend.name == "cpu":
        what = "cpu"
    else:
        what = f"{backend.name}: {backend.device_name()}, {backend.device_count()} visible"
    bf16 = "bf16 yes" if backend.is_bf16_supported() else "bf16 no"
    return f"{what}; {devices} used; {bf16}; collective backend {backend.comm_backend}; {versions()}"


def tiny_model(cache: dict[str, str], moe: bool = False) -> str:
    """The embedded tiny Qwen3, or Qwen3-MoE with ``moe`` (each built offline on first use, about a minute),
    remembered in ``cache``."""
    key = "moe" if moe else "path"
    if key not in cache:
        from ..tiny import ensure_tiny_model

        cache[key] = str(ensure_tiny_model(moe=moe))
    return cache[key]
