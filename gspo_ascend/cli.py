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

from .errors import UserError


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML config file (sections: model, data, rollout, actor, algorithm, trainer)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. algorithm.loss=grpo")


def cmd_train(args: argparse.Namespace) -> int:
    from . import config

    cfg = config.load_config(args.config, args.overrides)
    if args.print_config:
        import yaml

        print(yaml.safe_dump(config.to_dict(cfg), sort_keys=False), end="")
        return 0
    from .device import get_backend

    backend = get_backend(cfg.trainer.device)  # fails early, with the fix, when the device is unusable
    if args.dry_run:
        print(f"config ok; device backend: {backend.name}{' (CPU shim)' if backend.emulated else ''}")
        return 0
    raise UserError(
        "the training loop is not part of this build yet (tracked as issue #5); "
        "use --print-config or --dry-run to check a config"
    )


def cmd_doctor(args: argparse.Namespace) -> int:
    from .doctor import render_text, run_checks

    results = run_checks()
    if args.json:
        print(json.dumps([r.as_dict() for r in results], indent=2))
    else:
        print(render_text(results))
    return 1 if any(r.status == "fail" for r in results) else 0


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

    p = sub.add_parser("doctor", help="check this machine: device, drivers, package versions")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_doctor)
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
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
