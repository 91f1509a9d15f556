"""The ``selftest`` sub-command: pick the device, run every layer in order, print one line per check.

Each layer runs with this process's stdout / stderr (and its child processes') sent to ``<work dir>/<layer>.log``,
so the report stays one screen; the work dir (rank logs and outputs, the end-to-end run) is removed when everything
passed and kept, with its path printed, when something failed. ``--json`` prints the records as one JSON list on
stdout once the run is over (progress lines go to stderr). Exit status: 0 when no check failed, 1 otherwise, 2 for
bad input (an unknown device, --devices beyond what is visible, a bad ``GSPO_SELFTEST_FAULT``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from ..errors import UserError


def add_selftest_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", choices=("auto", "npu", "cuda", "cpu"), help="as trainer.device")
    p.add_argument(
        "--devices",
        type=int,
        metavar="N",
        help="devices for the multi-device checks (default: all visible; 2 on a CPU)",
    )
    p.add_argument(
        "--quick", action="store_true", help="ops, collectives and the hf rollout only (no vLLM, training or Ray)"
    )
    p.add_argument("--json", action="store_true", help="one JSON record per check on stdout (for bug reports)")
    p.add_argument(
        "--build-ops",
        action="store_true",
        help="only build MindSpeed's JIT ops (setup/mindspeed_ops); launchers run it once per node before the ranks",
    )


def _device_count(backend, requested: int | None) -> int:
    on_host = backend.torch_device_type == "cpu"
    visible = 2 if on_host else backend.device_count()
    if requested is None:
        return visible
    if requested < 1 or (not on_host and requested > visible):
        raise UserError(
            f"--devices {requested}: this {backend.name} node has {visible} visible device(s); use 1-{visible}"
        )
    return requested


def _faults() -> tuple[str, ...]:
    from ..device.shim import selftest_fault

    try:
        faults = selftest_fault.requested()
    except ValueError as exc:
        raise UserError(str(exc)) from None
    from .mc2 import OPS as MC2_OPS
    from .ops import CASES

    checked = sorted({op for case in CASES for op in case.ops} | set(MC2_OPS))
    for fault in faults:
        if fault in selftest_fault.op_faults() and fault not in checked:
            raise UserError(
                f"env {selftest_fault.ENV}={fault} is a shim op no selftest check calls; checked: {', '.join(checked)}"
            )
    return faults


def main_selftest(args: argparse.Namespace) -> int:
    from ..device import get_backend
    from . import report

    faults = _faults()
    backend = get_backend(args.device)  # an unusable device: DeviceError, one line, exit 2
    if args.build_ops:
        return _build_ops_only(backend, args.json)
    devices = _device_count(backend, args.devices)
    work = Path(tempfile.mkdtemp(prefix="gspo-selftest-"))
    say = (
        (lambda line: print(line, file=sys.stderr, flush=True)) if args.json else (lambda line: print(line, flush=True))
    )
    say(_header(backend, devices, args.quick, work, faults))
    start, results = time.perf_counter(), []
    for layer, run in _layers(backend, devices, args.quick, work):
        log = work / f"{layer}.log"
        with report.output_to(log), _environment_kept():
            found = _guarded(layer, run, log)
        for result in found:
            say(report.render_line(result))
        results += found
    failed = report.exit_code(results)
    if failed:
        say(report.summary(results, time.perf_counter() - start) + f"; logs kept in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
        say(report.summary(results, time.perf_counter() - start))
    if args.json:
        print(report.render_json(results), flush=True)
    return failed


def _build_ops_only(backend, as_json: bool) -> int:
    """``--build-ops``: the one check, with the build's own output on stderr (a launcher's log shows the compile);
    exit 0 when built or skipped (no MindSpeed, not an NPU), 1 when a build failed."""
    from . import report
    from .mindspeed_build import FIX, check_mindspeed_ops

    # MindSpeed's builder and ninja (a child process) print the compile log on stdout: file descriptor 1 onto 2
    with report.output_to(Path("/dev/fd/2")):
        result = report.run_check("setup/mindspeed_ops", lambda: check_mindspeed_ops(backend), FIX)
    print(report.render_json([result]) if as_json else report.render_line(result), flush=True)
    return report.exit_code([result])


@contextlib.contextmanager
def _environment_kept() -> Iterator[None]:
    """Every layer starts from the environment the selftest started with: vLLM's engine sets process-wide variables
    (LD_PRELOAD, VLLM_*, ...) that must not reach the processes later layers start."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _guarded(layer: str, run: Callable[[Path], list], log: Path) -> list:
    """A layer's results; should the layer itself raise (not one of its checks), one failing record for it."""
    import traceback

    from .report import Result, first_line

    try:
        return run(log)
    except Exception as exc:
        with log.open("a") as sink:
            traceback.print_exc(file=sink)
        detail = f"the layer raised {first_line(exc)} (traceback in {log})"
        return [Result(layer, "fail", 0.0, detail, "docs/troubleshooting.md#selftest-setup: read the log")]


def _header(backend, devices: int, quick: bool, work: Path, faults: tuple[str, ...]) -> str:
    from .. import __version__
    from ..device.shim import selftest_fault

    what = "npu emulated on the CPU shim" if backend.emulated else backend.name
    mode = "quick" if quick else "full"
    line = f"gspo-ascend selftest (gspo-ascend {__version__}): {what}, {devices} device(s), {mode} run; work dir {work}"
    for fault in faults:
        served = fault == selftest_fault.ROLLOUT_WEIGHT_UPDATE or backend.emulated
        line += f"\nTEST-ONLY fault injected: {selftest_fault.ENV}={fault}" + (
            "" if served else " (no shim op serves it on this device: nothing is perturbed)"
        )
    return line


def _tiny_models(cache: dict[str, str], quick: bool) -> str:
    """The dense tiny model's path, and the MoE one's unless --quick skips every check that runs it (a first build
    costs about a minute)."""
    from .setup import tiny_model

    moe = "MoE model not needed (--quick)" if quick else f"MoE at {tiny_model(cache, moe=True)}"
    return f"at {tiny_model(cache)}; {moe}"


def _layers(backend, devices: int, quick: bool, work: Path) -> list[tuple[str, Callable[[Path], list]]]:
    """(layer name, run(log) -> results) in order; imports are lazy so each layer pays only for itself."""
    from .report import CheckSkipped, run_check
    from .setup import FIX as SETUP_FIX
    from .setup import describe_device, tiny_model

    model: dict[str, str] = {}

    def ops(log):
        from .ops import check_ops

        return check_ops(backend, log)

    def collectives(log):
        from . import mc2
        from . import weight_sync as ws
        from .collectives import FIX, check_collectives

        return [
            run_check("collectives", lambda: check_collectives(backend, devices, work / "collectives"), FIX, log),
            run_check("collectives/mc2", lambda: mc2.check_mc2(backend, devices, work / "mc2"), mc2.FIX, log),
            run_check(
                "collectives/weight_sync", lambda: ws.check_weight_sync(backend, devices, work / "sync"), ws.FIX, log
            ),
        ]

    def rollout(log):
        from .rollout import check_rollout

        return check_rollout(backend, tiny_model(model), quick, log, moe_path=lambda: tiny_model(model, moe=True))

    def training(log):
        from .training import check_training

        return check_training(backend, devices, work / "training", quick, log)

    def e2e(log):
        from .e2e import FIX, check_e2e

        def body() -> str:
            if quick:
                raise CheckSkipped("--quick (about a minute on a CPU; run without --quick)")
            return check_e2e(backend, devices, work)

        return [run_check("e2e/ray_gspo", body, FIX, log)]

    def setup(log):
        from . import mindspeed_build

        return [
            run_check("setup/device", lambda: describe_device(backend, devices), SETUP_FIX, log),
            run_check("setup/tiny_model", lambda: _tiny_models(model, quick), SETUP_FIX, log),
            # here, before the op checks and any rank: the ranks then find the extensions built (mindspeed_build.py)
            run_check(
                "setup/mindspeed_ops", lambda: mindspeed_build.check_mindspeed_ops(backend), mindspeed_build.FIX, log
            ),
        ]

    return [("setup", setup), ("ops", ops), ("collectives", collectives), ("rollout", rollout),
            ("training", training), ("e2e", e2e)]  # fmt: skip
