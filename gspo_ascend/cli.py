"""``gspo-ascend`` command line: one sub-command per user job.

Bad input ends with ``error: <one line>`` on stderr and exit code 2, never a traceback (``UserError``).
Heavy imports (torch, Ray, vLLM, Megatron) happen inside the sub-commands, so ``gspo-ascend --help`` is
instant and works without torch_npu or CANN.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

from .errors import Stopped, UserError

DEFAULT_TRAIN_CONFIG = "tiny_gspo.yaml"  # the embedded CPU default: GSPO on the tiny model and arithmetic task


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        help="YAML config file (sections: model, data, rollout, actor, algorithm, reward, trainer, validation)",
    )
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. algorithm.loss=grpo")


def cmd_train(args: argparse.Namespace) -> int:
    from . import config

    _default_train_config(args)
    # --dry-run validates through the preflight, which reports every problem instead of the first
    cfg = config.load_config(args.config, args.overrides, validate=not args.dry_run)
    if args.print_config:
        import yaml

        print(yaml.safe_dump(config.to_dict(cfg), sort_keys=False), end="")
        return 0
    if args.dry_run:
        return dry_run(cfg)
    from .device import get_backend

    get_backend(cfg.trainer.device)  # fails early, with the fix, when the device is unusable
    from .trainer import train

    train(cfg)
    return 0


def dry_run(cfg) -> int:
    """``train --dry-run``: every config and layout finding first, then the device's. The device comes last
    because a laptop checking an NPU cluster's config has no NPU: its finding must not hide the layout problems
    that would otherwise surface only on the cluster."""
    from .device import get_backend
    from .doctor import preflight
    from .doctor.check import Check
    from .errors import DeviceError
    from .rundir import output_dir_check

    findings = [*preflight.preflight(cfg), output_dir_check(cfg.trainer.output_dir)]
    try:
        backend = get_backend(cfg.trainer.device)
        device = Check("device", "ok", f"{backend.name}{' (CPU shim)' if backend.emulated else ''}")
    except DeviceError as exc:
        device = Check("device", "fail", str(exc))
    failed = preflight.failures(findings)
    if device.status == "fail" and not failed:
        _print_findings(findings)
        raise DeviceError(device.finding)  # the one problem: its own line, as a real run would print it
    _print_findings([*findings, device])
    if failed:
        on_device = " and 1 with the device" if device.status == "fail" else ""
        raise UserError(f"preflight found {len(failed)} problem(s) in the config{on_device} (listed above on stdout)")
    print(f"config ok; device backend: {device.finding}")
    return 0


def _print_findings(checks) -> None:
    for c in checks:
        if c.status != "ok":
            print(f"[{c.status:>4}] {c.name}: {c.finding}" + (f"\n       fix: {c.fix}" if c.fix else ""))


def _default_train_config(args: argparse.Namespace) -> None:
    """`gspo-ascend train` without --config runs the embedded CPU default (configs/tiny_gspo.yaml)."""
    if args.config is None:
        from importlib.resources import files

        args.config = str(files("gspo_ascend.configs") / DEFAULT_TRAIN_CONFIG)


def cmd_doctor(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .doctor import Context, exit_code, render_json, render_text, run_checks
    from .doctor.context import check_sysroot, load_versions
    from .doctor.preflight import preflight_file

    sysroot = check_sysroot(args.sysroot) if args.sysroot else Path("/")
    planned = load_versions(args.versions) if args.versions else None
    ctx = Context(sysroot=sysroot, planned=planned, versions_file=args.versions)
    config_checks = None
    if args.config or args.overrides:
        ctx.config, config_checks = preflight_file(args.config, args.overrides, versions=planned)
    results = run_checks(ctx, config_checks)
    print(render_json(results) if args.json else render_text(results))
    return exit_code(results)


def cmd_plan(args: argparse.Namespace) -> int:
    from .doctor.planner import plan_from_config, render_text

    result = plan_from_config(args.config, args.overrides, args.hardware)
    print(json.dumps(result.as_dict(), indent=2) if args.json else render_text(result))
    return 1 if result.verdict == "OOM" else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gspo-ascend",
        description="GSPO RL post-training on Ascend NPUs, NVIDIA GPUs and CPU (docs/ for guides).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("train", help="run GSPO / GSPO-token / GRPO training from a config")
    _add_config_args(p)
    p.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    p.add_argument("--dry-run", action="store_true", help="validate the config and the device, run nothing")
    p.set_defaults(func=cmd_train)

    from .plot import add_plot_args, main_plot

    p = sub.add_parser("plot", help="PNG curves (reward, clip fraction, response length) of a run directory")
    add_plot_args(p)
    p.set_defaults(func=main_plot)

    from .evaluation import add_eval_args, main_eval

    p = sub.add_parser("eval", help="mean@n / pass@k / maj@k of an HF checkpoint on prompt files (JSON + table)")
    add_eval_args(p)
    p.set_defaults(func=main_eval)

    p = sub.add_parser("doctor", help="check this machine (or a planned stack) and, with --config, the config")
    _add_config_args(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--sysroot", metavar="DIR", help="read the Ascend driver / CANN files under DIR instead of /")
    p.add_argument("--versions", metavar="FILE", help="JSON {package: version} used instead of installed versions")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("plan", help="per-device memory plan (training + rollout) with a fits / tight / OOM verdict")
    _add_config_args(p)
    p.add_argument(
        "--hardware",
        default="auto",
        help="atlas-800t-a2 | h20 | h200 | cpu (default: from trainer.device, else this host)",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_plan)

    from .data.cli import add_prepare_data_args, main_prepare_data
    from .tiny import add_make_tiny_model_args, main_make_tiny_model

    p = sub.add_parser("make-tiny-model", help="build the embedded tiny Qwen3 / Qwen3-MoE model offline")
    add_make_tiny_model_args(p)
    p.set_defaults(func=main_make_tiny_model)

    p = sub.add_parser("prepare-data", help="convert local gsm8k / MATH-lighteval / DAPO-Math files to parquet")
    add_prepare_data_args(p)
    p.set_defaults(func=main_prepare_data)

    from .selftest.cli import add_selftest_args, main_selftest

    p = sub.add_parser("selftest", help="run every layer (ops .. Ray) on this node's devices against the CPU reference")
    add_selftest_args(p)
    p.set_defaults(func=main_selftest)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except Stopped as exc:  # SIGTERM: checkpoint saved at a safe point (preempt.py)
        print(f"stopped: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
