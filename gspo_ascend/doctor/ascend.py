"""The Ascend software install, read from its own files (never by importing torch_npu, which may be the
broken thing): driver and firmware ``version.info``, the CANN toolkit in its legacy layout
(``ascend-toolkit/latest/<arch>-linux/ascend_toolkit_install.info``) and the CANN >= 8.5 layout
(``cann[-X.Y.Z]/<arch>-linux/`` with a separate ``ascend_ops_install.info``), ``set_env.sh`` having been
sourced, and the ATB library (nnal/atb) that vllm-ascend needs.

Every path is read under ``ctx.sysroot`` so a container image or a test fixture can be inspected as a host.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .check import Check
from .matrix import CANN_TORCH_NPU
from .versions import compare, key, release

DRIVER_INFO = "/usr/local/Ascend/driver/version.info"
FIRMWARE_INFO = "/usr/local/Ascend/firmware/version.info"
ATB_SET_ENV = "/usr/local/Ascend/nnal/atb/set_env.sh"
LEGACY_HOME = "/usr/local/Ascend/ascend-toolkit/latest"
CANN_ROOT = "/usr/local/Ascend"
MC2_MIN_CANN = "8.0.RC2"
TOOLKIT_FILES = ("ascend_toolkit_install.info", "ascend_all_cann_install.info")
SET_ENV_HINT = (
    "source /usr/local/Ascend/ascend-toolkit/set_env.sh (CANN >= 8.5: /usr/local/Ascend/cann/set_env.sh) "
    "in the shell that starts Ray and training"
)


def read_info(path: Path) -> dict[str, str]:
    """``key=value`` lines of an Ascend .info file; keys lower-cased (the driver writes ``Version=``)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return {}
    pairs = (line.split("=", 1) for line in text.splitlines() if "=" in line)
    return {k.strip().lower(): v.strip() for k, v in pairs}


@dataclass
class AscendInstall:
    driver: str | None = None
    driver_file: Path | None = None
    firmware: str | None = None
    firmware_range: tuple[str, str] | None = None  # compatible_version_fw=[lo,hi] in the driver's file
    cann: str | None = None
    cann_home: Path | None = None
    cann_file: Path | None = None
    layout: str = ""  # legacy | cann-8.5
    ops: str | None = None  # ascend_ops_install.info version (CANN >= 8.5 layout)
    atb_set_env: Path | None = None

    @property
    def present(self) -> bool:
        return bool(self.driver or self.cann)


def _cann_homes(ctx) -> list[Path]:
    homes = []
    if ctx.env.get("ASCEND_HOME_PATH"):
        homes.append(ctx.path(ctx.env["ASCEND_HOME_PATH"]))
    homes.append(ctx.path(LEGACY_HOME))
    root = ctx.path(CANN_ROOT)
    versioned = sorted(root.glob("cann-*"), key=lambda p: key(p.name[5:]), reverse=True) if root.is_dir() else []
    return homes + [root / "cann"] + versioned


def _toolkit_file(home: Path, machine: str) -> Path | None:
    arch_dirs = [home / f"{machine}-linux", *sorted(home.glob("*-linux"))]  # a foreign-arch image still reads
    for arch_dir in arch_dirs:
        for name in TOOLKIT_FILES:
            if (arch_dir / name).is_file():
                return arch_dir / name
    return None


def detect_install(ctx) -> AscendInstall:
    found = AscendInstall()
    driver = read_info(ctx.path(DRIVER_INFO))
    if driver.get("version"):
        found.driver, found.driver_file = driver["version"], ctx.path(DRIVER_INFO)
        bounds = driver.get("compatible_version_fw", "").strip("[]").split(",")
        found.firmware_range = (bounds[0].strip(), bounds[1].strip()) if len(bounds) == 2 else None
    found.firmware = read_info(ctx.path(FIRMWARE_INFO)).get("version")
    for home in _cann_homes(ctx):
        info_file = _toolkit_file(home, ctx.machine)
        if info_file:
            found.cann = read_info(info_file).get("version")
            found.cann_home, found.cann_file = home, info_file
            found.layout = "legacy" if "ascend-toolkit" in str(home) else "cann-8.5"
            found.ops = read_info(info_file.parent / "ascend_ops_install.info").get("version")
            break
    if ctx.path(ATB_SET_ENV).is_file():
        found.atb_set_env = ctx.path(ATB_SET_ENV)
    return found


# ----------------------------------------------------------------------------------------------- checks


def check_driver(ctx) -> list[Check]:
    inst = ctx.install
    if not inst.driver:
        return [
            Check("ascend-driver", "fail", f"no {DRIVER_INFO} under {ctx.sysroot}", "install the Ascend HDK driver")
        ]
    checks = [Check("ascend-driver", "ok", f"driver {inst.driver} ({DRIVER_INFO})")]
    if inst.firmware and inst.firmware_range:
        lo, hi = inst.firmware_range
        if compare(inst.firmware, lo) < 0 or compare(inst.firmware, hi) > 0:
            checks.append(
                Check(
                    "ascend-firmware",
                    "fail",
                    f"firmware {inst.firmware} is outside driver {inst.driver}'s compatible range [{lo}, {hi}]",
                    "install the firmware package of the same HDK release as the driver",
                )
            )
        else:
            checks.append(Check("ascend-firmware", "ok", f"firmware {inst.firmware} within [{lo}, {hi}]"))
    return checks


def check_cann(ctx) -> list[Check]:
    inst, planned = ctx.install, (ctx.planned or {}).get("cann")
    if not inst.cann:
        if planned:
            return [Check("cann", "ok", f"CANN {planned} (planned, from --versions; none installed)")]
        return [
            Check(
                "cann",
                "fail",
                f"no CANN toolkit under {ctx.path(LEGACY_HOME)} or {ctx.path(CANN_ROOT)}/cann*",
                "install the CANN toolkit (and the 910B ops/kernels package) matching torch_npu; see "
                "docs/version-matrix.md",
            )
        ]
    where = f"{inst.layout} layout, {inst.cann_file}"
    checks = [Check("cann", "ok", f"CANN {inst.cann} ({where})" + (f"; planned {planned}" if planned else ""))]
    if inst.layout == "cann-8.5" and inst.ops != inst.cann:
        what = "is missing" if not inst.ops else f"is {inst.ops}, toolkit {inst.cann}"
        checks.append(
            Check(
                "cann-ops",
                "fail",
                f"CANN ops package (ascend_ops_install.info) {what} in {inst.cann_file.parent}",
                f"install Ascend-cann-910b-ops {inst.cann} next to the toolkit: torch_npu has no kernels without it",
            )
        )
    return checks + check_mc2_cann(ctx, inst.cann)


def check_mc2_cann(ctx, cann: str) -> list[Check]:
    """MC2 fused ops need CANN and driver >= 8.0.RC2 (torch_npu MC2 op docs)."""
    if ctx.config is None or not ctx.config.actor.use_mc2 or compare(cann, MC2_MIN_CANN) >= 0:
        return []
    return [
        Check(
            "mc2-cann",
            "fail",
            f"actor.use_mc2=true needs CANN >= {MC2_MIN_CANN}, found {cann}",
            "upgrade CANN or set actor.use_mc2=false",
        )
    ]


def check_set_env(ctx) -> list[Check]:
    """set_env.sh exports ASCEND_HOME_PATH / ASCEND_OPP_PATH; torch_npu refuses to import without them."""
    missing = [v for v in ("ASCEND_HOME_PATH", "ASCEND_OPP_PATH") if not ctx.env.get(v)]
    if missing:
        return [Check("ascend-env", "fail", f"set_env.sh not sourced: {', '.join(missing)} unset", SET_ENV_HINT)]
    home = ctx.env["ASCEND_HOME_PATH"]
    if not ctx.path(home).is_dir():
        return [Check("ascend-env", "fail", f"ASCEND_HOME_PATH={home} does not exist", SET_ENV_HINT)]
    return [Check("ascend-env", "ok", f"ASCEND_HOME_PATH={home}, ASCEND_OPP_PATH={ctx.env['ASCEND_OPP_PATH']}")]


def check_atb(ctx) -> list[Check]:
    """vllm-ascend links libatb.so from nnal/atb (vllm-ascend FAQ: 'Failed to infer device type')."""
    if not ctx.uses_vllm:
        return []
    status = "fail" if ctx.config is not None else "warn"  # without a config vLLM use is only inferred
    if ctx.install.atb_set_env is None:
        return [
            Check(
                "atb",
                status,
                f"no {ATB_SET_ENV}: the ATB library (libatb.so) vllm-ascend needs is not installed",
                "install the CANN NNAL (Ascend-cann-nnal) package of the same CANN release",
            )
        ]
    if not ctx.env.get("ATB_HOME_PATH"):
        return [Check("atb", status, "ATB installed but ATB_HOME_PATH unset", f"source {ATB_SET_ENV}")]
    return [Check("atb", "ok", f"ATB_HOME_PATH={ctx.env['ATB_HOME_PATH']}")]


def cann_for_torch_npu(torch_npu: str) -> str | None:
    """The CANN a torch_npu build is made for. Ascend rebuilds each torch_npu base release (2.7.1) as post builds
    for later CANNs, and the table lists only some of them: a build goes with the nearest listed build of its base
    at or below it (2.7.1.post6 -> 2.7.1.post4, CANN 9.0.0; 2.7.1.post11 -> 2.7.1.post8, CANN 9.1.0;
    2.10.0.post6 -> 2.10.0.post4, CANN 9.1.0). A release whose base the table does not list (2.11.0) has no known
    CANN: None, a warning, not a guess from a range row (the 9.1.0 row spans 2.7.1.post8 … 2.12.0 in PEP 440 order,
    yet vllm-ascend 0.20 pairs 2.10.0 with CANN 9.0.0)."""
    same_base = [
        (build, row.cann)
        for row in CANN_TORCH_NPU
        for build in row.torch_npu
        if release(build) == release(torch_npu) and compare(build, torch_npu) <= 0
    ]
    if same_base:
        return max(same_base, key=lambda pair: key(pair[0]))[1]
    return None


def check_torch_npu(ctx) -> list[Check]:
    """torch_npu without CANN: ``import torch_npu`` fails and, through torch's backend auto-load entry point,
    so does plain ``import torch`` in any process without TORCH_DEVICE_BACKEND_AUTOLOAD=0."""
    version = ctx.versions.get("torch-npu")
    if not version:
        if ctx.is_ascend_host:
            cann = ctx.install.cann or "?"
            return [
                Check("torch_npu", "fail", "torch_npu is not installed", f"pip install the torch_npu for CANN {cann}")
            ]
        return []
    if not (ctx.install.cann or (ctx.planned or {}).get("cann")):
        return [_torch_npu_without_cann(ctx, version)]
    if ctx.probe_device and ctx.planned is None:
        from ..device.detect import npu_status

        status = npu_status()
        if not status.available and not status.emulated:
            return [Check("torch_npu", "fail" if ctx.is_ascend_host else "warn", status.reason, SET_ENV_HINT)]
        return [Check("torch_npu", "ok", f"torch_npu {version} imports and sees NPUs")]
    return [Check("torch_npu", "ok", f"torch_npu {version} with CANN present")]


def _torch_npu_without_cann(ctx, version: str) -> Check:
    autoload = ctx.initial_env.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "1")
    hazard = (
        "plain `import torch` fails in this shell (TORCH_DEVICE_BACKEND_AUTOLOAD is not 0)"
        if autoload != "0"
        else "TORCH_DEVICE_BACKEND_AUTOLOAD=0 keeps `import torch` working here"
    )
    needed = cann_for_torch_npu(version) or "the matching release"
    return Check(
        "torch_npu",
        "fail" if ctx.is_ascend_host else "warn",
        f"torch_npu {version} is installed but no CANN toolkit was found: `import torch_npu` fails (libhccl.so); "
        + hazard,
        f"on an Atlas host install CANN {needed} and source set_env.sh; elsewhere `pip uninstall torch_npu` or "
        "export TORCH_DEVICE_BACKEND_AUTOLOAD=0 for every process (Ray workers included)",
    )


def ascend_checks(ctx) -> list[Check]:
    if not ctx.is_ascend_host:
        checks = check_torch_npu(ctx)
        if ctx.platform == "npu":  # a planned NPU stack checked from a non-Ascend machine
            checks += check_cann(ctx) if (ctx.planned or {}).get("cann") else []
            return checks
        return [Check("ascend", "ok", f"not an Ascend host (no driver or CANN under {ctx.sysroot})")] + checks
    return check_driver(ctx) + check_cann(ctx) + check_set_env(ctx) + check_atb(ctx) + check_torch_npu(ctx)
