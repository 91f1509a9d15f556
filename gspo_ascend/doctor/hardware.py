"""Accelerators on this host, from ``npu-smi info`` and ``nvidia-smi --query-gpu``, plus the per-device memory
table the planner uses (:data:`PROFILES`).

The npu-smi table has two rows per device (``| 0  910B3 | OK | power temp hugepages |`` then
``| 0 | bus-id | aicore  memory x / y  HBM x / y |``); we parse it rather than the JSON-less ``-t`` queries
because ``info`` is what users paste into bug reports and what every driver release prints.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from .check import Check

# Memory facts per device, as the vendors' tools print them (MiB). reserved_mib is what the runtime holds
# before our process allocates anything: npu-smi shows ~3.3 GiB used on an idle 910B; a CUDA context plus
# communicator buffers is ~1 GiB.
PROFILES = {
    "atlas-800t-a2": ("Atlas 800T A2 (8 x Ascend 910B, 64 GB HBM)", "npu", 65536, 4096, 8, r"^910B"),
    "h20": ("NVIDIA H20 (96 GB)", "cuda", 97871, 1024, 8, r"\bH20\b"),
    "h200": ("NVIDIA H200 (141 GB)", "cuda", 143771, 1024, 8, r"\bH200\b"),
    "cpu": ("CPU (host memory shared by the ranks of one node)", "cpu", 0, 0, 1, r"$^"),
}


@dataclass(frozen=True)
class Profile:
    key: str
    title: str
    platform: str
    hbm_mib: int
    reserved_mib: int
    devices_per_node: int


def profile(key: str, devices_per_node: int = 1) -> Profile:
    """The memory profile of ``key``; for ``cpu`` the host's RAM split over ``devices_per_node`` ranks."""
    title, platform, hbm, reserved, per_node, _ = PROFILES[key]
    if key == "cpu":
        ram_mib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
        hbm, per_node = ram_mib // max(devices_per_node, 1), devices_per_node
    return Profile(key, title, platform, hbm, reserved, per_node)


def profile_for(names: list[str]) -> str | None:
    """Which profile a device name from npu-smi / nvidia-smi belongs to (None when unknown)."""
    for key, (*_, pattern) in PROFILES.items():
        if names and all(re.search(pattern, n) for n in names):
            return key
    return None


@dataclass(frozen=True)
class Device:
    index: int
    name: str
    health: str
    hbm_total_mib: int
    hbm_used_mib: int = 0


@dataclass
class HardwareInfo:
    kind: str  # npu | cuda | cpu
    devices: list[Device] = field(default_factory=list)
    tool_version: str = ""
    error: str = ""  # the tool exists but failed or printed nothing we understand

    @property
    def profile(self) -> str | None:
        return profile_for([d.name for d in self.devices]) if self.devices else None


_NPU_ROW = re.compile(r"^\|\s*(\d+)\s+(\S+)\s*\|\s*([A-Za-z][\w ]*?)\s*\|")
# "| 0 | 0000:C1:00.0 | ..." on A2; A3 prints a chip id and a physical id before the bus id
_CHIP_ROW = re.compile(r"^\|\s*\d+(?:\s+\d+)*\s*\|\s*[0-9A-Fa-f]{4}:[0-9A-Fa-f:.]+\s*\|(.*)\|")
_PAIR = re.compile(r"(\d+)\s*/\s*(\d+)")
_SMI_HEADER = re.compile(r"npu-smi\s+(\S+)\s+Version:\s*(\S+)")


def parse_npu_smi(text: str) -> HardwareInfo:
    info = HardwareInfo("npu")
    header = _SMI_HEADER.search(text)
    info.tool_version = header.group(2) if header else ""
    pending = None
    for line in text.splitlines():
        if "Process id" in line:  # the process table below reuses the row shape
            break
        row = _NPU_ROW.match(line)
        if row:
            pending = (int(row.group(1)), row.group(2), row.group(3))
            continue
        chip = _CHIP_ROW.match(line)
        if chip and pending:
            pairs = _PAIR.findall(chip.group(1))
            used, total = (int(pairs[-1][0]), int(pairs[-1][1])) if pairs else (0, 0)
            # one device per chip row (A3 lists two chips under one NPU)
            info.devices.append(Device(len(info.devices), pending[1], pending[2], total, used))
    return info


def parse_nvidia_smi(text: str) -> HardwareInfo:
    """``nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader`` output."""
    info = HardwareInfo("cuda")
    for index, line in enumerate(l for l in text.splitlines() if l.strip()):
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 3:
            continue
        mib = re.match(r"(\d+)", parts[1])
        info.devices.append(Device(index, parts[0], "OK", int(mib.group(1)) if mib else 0))
        info.tool_version = parts[2]
    return info


# What the tools print when they are installed but the host has no device (a CPU node with drivers).
NO_DEVICE_MESSAGES = ("No devices were found",)
NVIDIA_QUERY = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]


def probe(runner) -> HardwareInfo:
    """npu-smi first (an Atlas host), then nvidia-smi, else CPU."""
    for argv, parse, kind in ((["npu-smi", "info"], parse_npu_smi, "npu"), (NVIDIA_QUERY, parse_nvidia_smi, "cuda")):
        result = runner.run(argv)
        if result is None:
            continue
        if result.returncode != 0:
            first = (result.stderr or result.stdout).strip().splitlines()
            if any(m in (result.stderr + result.stdout) for m in NO_DEVICE_MESSAGES):
                continue  # the tool is installed on a host without the devices: not a fault
            return HardwareInfo(
                kind, error=f"`{' '.join(argv[:2])}` exited {result.returncode}: {first[0] if first else ''}"
            )
        info = parse(result.stdout)
        if not info.devices:
            info.error = f"`{' '.join(argv[:2])}` listed no devices"
        return info
    return HardwareInfo("cpu")


_FIX = {
    "npu": "run `npu-smi info` as root; in a container map /dev/davinci*, /dev/davinci_manager, /dev/hisi_hdc, "
    "/dev/devmm_svm and /usr/local/Ascend/driver",
    "cuda": "check `nvidia-smi`; in a container run with --gpus all (NVIDIA container toolkit)",
}


def check_hardware(info: HardwareInfo) -> list[Check]:
    if info.kind == "cpu":
        return [Check("hardware", "ok", "no npu-smi or nvidia-smi on this host: CPU mode")]
    if info.error:
        return [Check("hardware", "fail", info.error, _FIX[info.kind])]
    names = sorted({d.name for d in info.devices})
    hbm = sorted({d.hbm_total_mib for d in info.devices})
    tool = f"npu-smi {info.tool_version}" if info.kind == "npu" else f"driver {info.tool_version}"
    summary = f"{len(info.devices)} x {'/'.join(names)}, {'/'.join(map(str, hbm))} MiB each ({tool})"
    sick = [f"{d.index}:{d.health}" for d in info.devices if d.health.upper() != "OK"]
    checks = []
    if sick:
        status = "fail" if any(not h.endswith("Warning") for h in sick) else "warn"
        checks.append(Check("hardware", status, f"{summary}; unhealthy devices {', '.join(sick)}", _FIX[info.kind]))
    else:
        checks.append(Check("hardware", "ok", f"{summary}; all healthy"))
    if info.kind == "npu" and info.profile != "atlas-800t-a2":
        checks.append(
            Check(
                "hardware-model",
                "warn",
                f"{'/'.join(names)} is not an Atlas A2 910B chip; memory plans and MC2 limits here assume the A2",
                "pass --hardware to `gspo-ascend plan` with a matching profile; re-check MC2 limits (A3: TP <= 32)",
            )
        )
    elif info.kind == "cuda" and info.profile is None:
        checks.append(
            Check(
                "hardware-model",
                "warn",
                f"no memory profile for {'/'.join(names)} (known: H20, H200)",
                "pass --hardware to `gspo-ascend plan` with the closest profile",
            )
        )
    return checks


def resolve_profile(key: str, cfg, runner=None) -> Profile:
    """``plan --hardware``: a named profile, or ``auto`` = from trainer.device, else from this host's tools."""
    from ..errors import UserError

    per_node = cfg.trainer.devices_per_node
    if key != "auto":
        if key not in PROFILES:
            raise UserError(f"--hardware '{key}' is unknown; choose one of: {', '.join(PROFILES)}")
        return profile(key, per_node)
    by_device = {"npu": "atlas-800t-a2", "cpu": "cpu"}.get(cfg.trainer.device)
    if by_device:
        return profile(by_device, per_node)
    if runner is None:
        from .runner import SystemRunner

        runner = SystemRunner()
    info = probe(runner)
    found = "atlas-800t-a2" if info.kind == "npu" else info.profile if info.kind == "cuda" else "cpu"
    if found is None:
        names = "/".join(sorted({d.name for d in info.devices})) or "unknown GPU"
        raise UserError(f"no memory profile for {names}; pass --hardware ({', '.join(PROFILES)})")
    return profile(found, per_node)
