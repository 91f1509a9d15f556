"""One rank of a multi-device selftest check: ``python -m gspo_ascend.selftest.rank JOB --out DIR --device D ...``.

Started by :func:`.launch.launch_ranks` (RANK / LOCAL_RANK / WORLD_SIZE / MASTER_* set). It resolves the device
through the device contract (the shim when ``GSPO_DEVICE_SHIM=1``), selects device LOCAL_RANK, joins the world over
the backend's collective backend and runs the job's rank function, which writes its results under ``--out`` for
the selftest process to judge.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(prog="gspo_ascend.selftest.rank")
    parser.add_argument("job", choices=("collectives", "mc2", "training", "weight_sync"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", required=True)
    args, rest = parser.parse_known_args()

    import torch.distributed as dist

    from ..device import get_backend
    from ..engines.train_common import select_device

    backend = get_backend(args.device)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    select_device(backend, rank)  # before the group: device-bound collective backends need it
    if args.job == "mc2" and backend.emulated:  # the HCCL communicator names the MC2 ops address (a real torch_npu
        from ..device import shim  # has them: its ProcessGroupHCCL)

        shim.install(mindspeed=True, mc2=True)
    dist.init_process_group(backend.comm_backend, rank=rank, world_size=world)
    try:
        if args.job == "collectives":
            from .collectives import rank_main
        elif args.job == "mc2":
            from .mc2 import rank_main
        elif args.job == "weight_sync":
            from .weight_sync import rank_main
        else:
            from .training import rank_main
        rank_main(backend, args.out, rest)
    except BaseException:
        traceback.print_exc()  # the launcher reads the error line from this rank's log
        _exit(1)
    _exit(0)


def _exit(code: int) -> None:
    """End the rank without tearing the process group down. torch 2.7.1's gloo deadlocks in
    ``destroy_process_group`` (and in the interpreter's own teardown) now and then: the main thread joins gloo's
    worker threads holding the GIL while a worker, freeing the last reference to a finished op's tensor, waits for
    the GIL (measured: 2 hangs in 25 runs of the collectives job, a barrier before the teardown included; 0 in 25
    this way). The results are written by now; the process's end frees the group."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
