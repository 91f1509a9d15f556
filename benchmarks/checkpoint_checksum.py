"""What the content checksums cost a checkpoint (gspo_ascend/checkpoint.py): commit and verify, with and without.

Two payloads: the tiny model's real checkpoint file sizes (fsdp engine, float32, 5.3 MB: ``__0_0.distcp``
holding weights + AdamW state, its metadata, the rank file, ``rng.pt``) and one 1 GiB shard. For each: the
commit (fsyncs included), the BLAKE3 checksums alone (the part the commit adds), and the full
verify a resume makes; then the throughput of BLAKE3 against SHA-256 and BLAKE2b on the same bytes.
Best of ``--rounds``; the files are in the page cache (they were just written), as they are at a real commit.

    .venv/bin/python benchmarks/checkpoint_checksum.py [--rounds 5] [--big-mib 1024] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import tempfile
import time
from pathlib import Path

from gspo_ascend import checkpoint as ck

# the tiny model's step_N/ (fsdp; data.train_batch_size=8, rollout.n=4), from `find step_N -type f -printf '%s %p'`
TINY_FILES = {
    "engine/__0_0.distcp": 5_297_677,
    "engine/.metadata": 34_374,
    "engine/engine_rank0.pt": 6_924,
    "rng.pt": 18_965,
}


def best(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def write(tmp: Path, files: dict[str, int]) -> None:
    for rel, size in files.items():
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        with open(tmp / rel, "wb") as f:
            for left in range(size, 0, -(64 << 20)):
                f.write(os.urandom(min(left, 64 << 20)))


def commit_time(root: Path, files: dict[str, int], rounds: int) -> float:
    samples = []
    for i in range(rounds):
        out = root / f"commit-{i}"
        tmp = ck.begin(out, 1)
        write(tmp, files)
        start = time.perf_counter()
        ck.commit(tmp, 1, {})
        samples.append(time.perf_counter() - start)
        shutil.rmtree(out)
    return min(samples)


def throughput(path: Path, rounds: int) -> dict[str, float]:
    size = path.stat().st_size

    def hashlib_file(name: str):
        with open(path, "rb") as f:
            hashlib.file_digest(f, name)

    return {
        "blake3 (file_checksum)": size / best(lambda: ck.file_checksum(path), rounds) / 1e9,
        "sha256": size / best(lambda: hashlib_file("sha256"), rounds) / 1e9,
        "blake2b": size / best(lambda: hashlib_file("blake2b"), rounds) / 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--big-mib", type=int, default=1024)
    parser.add_argument("--dir", default=None, help="where to write (default: the system temp dir)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir))
    try:
        for name, files in (
            ("tiny model", TINY_FILES),
            (f"{args.big_mib} MiB shard", {"shard.bin": args.big_mib << 20}),
        ):
            total = sum(files.values())
            commit = commit_time(root, files, args.rounds)
            out = root / "verify"
            tmp = ck.begin(out, 1)
            write(tmp, files)
            final = ck.commit(tmp, 1, {})
            paths = [p for p in final.rglob("*") if p.is_file() and p.name != ck.COMPLETE_MARKER]
            checksums = best(lambda paths=paths: [ck.file_checksum(p) for p in paths], args.rounds)
            verify = best(lambda final=final: ck.checkpoint_problem(final, verify=True), args.rounds)
            print(
                f"{name} ({total / 1e6:.1f} MB): commit {commit * 1e3:.1f} ms, of which checksums "
                f"{checksums * 1e3:.2f} ms; verify at resume {verify * 1e3:.2f} ms"
            )
            if name != "tiny model":
                rates = throughput(next(final.rglob("shard.bin")), args.rounds)
                print(
                    "  throughput, GB/s (blake3 on all cores, hashlib on one): "
                    + ", ".join(f"{k} {v:.2f}" for k, v in rates.items())
                )
            shutil.rmtree(out)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
