#!/usr/bin/env python3
"""Build the device bundle: the packages a GPU machine's image lacks, for a machine with no package index.

    python3 scripts/device/build_bundle.py [--out .bundle] [--python-version 3.12] [--cache DIR] [--strip]

The device image (see IMAGE_PACKAGES) already holds torch, transformers, numpy, ... ; what it lacks travels in OUT:

    OUT/wheels/*.whl       the CARRY packages at the versions pinned in requirements-cpu.txt (the lock our code is
                           tested with), cp<ver> manylinux x86_64 or pure wheels, no dependencies resolved
    OUT/ray-site.tar.xz    Ray installed (no deps) and pruned to what a local ray.init + actors + placement groups
                           use: Ray's wheel is ~80 MB, the pruned site ~20 MB compressed (RAY_PRUNE says what goes)
    OUT/MANIFEST.json      each package, version, file, size; the total

Install it there with `bash scripts/device/install_bundle.sh OUT SITE_DIR`, then run with PYTHONPATH=SITE_DIR.
Stdlib only (runs with any python3 that has pip); downloads go through `python3 -m pip download` and are cached in
--cache (default ~/.cache/gspo-ascend/device-bundle), one folder per target Python version.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LOCK = REPO / "requirements-cpu.txt"
DEFAULT_OUT = REPO / ".bundle"
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "gspo-ascend" / "device-bundle"
RAY_SITE = "ray-site.tar.xz"
MAX_TRAVEL = 64 * 2**20  # the working tree plus everything carried to the device machine

# The device image's Python packages ('cuda' image of nvidia-h100-x1 / nvidia-h200, Python 3.12.3,
# /opt/torch/.venv/bin/python3), as listed by the device notes, read 2026-11-17. Names are normalized (PEP 503).
IMAGE_PACKAGES = frozenset(
    """
    absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
    charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
    cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
    flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
    huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
    jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax
    llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
    multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas
    nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile
    nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13
    nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax
    opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy
    portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
    pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
    python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core
    scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
    sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl
    tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision
    tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug
    wheel wrapt xarray xxhash yarl zipp
    """.split()
)
# The versions of some of them, as the device notes' `pip list` gave them (the others' versions are not recorded).
IMAGE_VERSIONS = {
    "accelerate": "1.15.0",
    "huggingface-hub": "1.33.0",
    "numpy": "2.5.2",
    "safetensors": "0.8.0",
    "sentencepiece": "0.2.2",
    "tiktoken": "0.14.0",
    "tokenizers": "0.23.2",
    "torch": "2.11.0",
    "torchvision": "0.26.0",
    "transformers": "5.17.0",
    "triton": "3.6.0",
}

# What travels as wheels (versions come from the lock), each with why: the image lacks all of them.
CARRY = {
    "jsonschema": "ray's install requirement",
    "jsonschema-specifications": "jsonschema's",
    "referencing": "jsonschema's",
    "rpds-py": "jsonschema's / referencing's",
    "omegaconf": "configs (mbridge, megatron)",
    "antlr4-python3-runtime": "omegaconf's and latex2sympy2_extended's",
    "blake3": "checkpoint checksums",
    "megatron-core": "the Megatron engine",
    "mbridge": "HF <-> Megatron weights",
    "math-verify": "math rewards",
    "latex2sympy2_extended": "math-verify's",
    "trl": "the reference comparisons",
    "datasets": "trl's; data loading",
    "dill": "datasets'",
    "multiprocess": "datasets'",
}
RAY = "ray"

PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)

# Removed from Ray's install (paths relative to the site dir, fnmatch patterns; a trailing '/' = a folder and all in
# it). Nothing here is imported or opened by ray.init(include_dashboard=False) and its processes (gcs_server, raylet,
# the minimal dashboard head, dashboard agent, runtime-env agent, log monitor, autoscaler monitor, workers) when they
# run actors in placement groups with runtime_env env_vars: established once by logging every file those processes
# opened, imported or executed; tests/unit/test_device_bundle.py runs that workload on the pruned site and fails
# on any traceback in Ray's logs.
RAY_PRUNE = (
    "ray/jars/",  # Java worker support
    "ray/dashboard/client/",  # the dashboard's web front end (the dashboard itself stays: its head runs minimal)
    "ray/rllib/",
    "ray/tune/",
    "ray/train/",
    "ray/data/",
    "ray/serve/",
    "ray/air/",
    "ray/llm/",
    "ray/workflow/",
    "ray/util/dask/",
    "ray/util/spark/",
    "ray/includes/",  # Cython declarations (.pxd), build-time only
    "ray/*.pxd",
    "ray/*.pyx",
    "ray/setup-dev.py",
    "ray/autoscaler/_private/aws/",  # cloud node providers; a local cluster uses none
    "ray/autoscaler/_private/gcp/",
    "ray/autoscaler/_private/_azure/",
    "ray/autoscaler/_private/aliyun/",
    "ray/autoscaler/_private/vsphere/",
    "ray/autoscaler/aws/",
    "ray/autoscaler/gcp/",
    "ray/autoscaler/azure/",
    "ray/autoscaler/vsphere/",
    "*/__pycache__/",
    "*.pyc",
)
ELF_MAGIC = b"\x7fELF"


class BundleError(RuntimeError):
    pass


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_pins(lock: Path = LOCK) -> dict[str, str]:
    """normalized name -> pinned version, from a `name==version` lock."""
    pins = {}
    for line in lock.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[normalize(name)] = version.strip()
    return pins


def carried(lock: Path = LOCK) -> dict[str, str]:
    """The bundle's packages (CARRY + ray) -> version pinned in the lock; fails on a package the lock lacks."""
    pins = lock_pins(lock)
    missing = [n for n in (*CARRY, RAY) if normalize(n) not in pins]
    if missing:
        raise BundleError(f"{lock.name} pins none of: {', '.join(missing)}")
    return {n: pins[normalize(n)] for n in (*CARRY, RAY)}


def wheel_tags(filename: str) -> tuple[str, str, str, str, str]:
    """(normalized name, version, python tag, abi tag, platform tag) of a wheel file name."""
    parts = filename[: -len(".whl")].split("-")
    if len(parts) not in (5, 6):
        raise BundleError(f"not a wheel file name: {filename}")
    return normalize(parts[0]), parts[1], parts[-3], parts[-2], parts[-1]


def compatible(filename: str, python_version: str) -> bool:
    """Whether a wheel installs on CPython `python_version` on manylinux x86_64 (what pip download selects)."""
    _, _, py, abi, plat = wheel_tags(filename)
    minor = int(python_version.split(".")[1])
    pys = set(py.split("."))
    if plat == "any":
        return abi == "none" and bool(pys & {"py3", f"py3{minor}", f"cp3{minor}"})
    if not all(p.startswith("manylinux") and p.endswith("_x86_64") for p in plat.split(".")):
        return False
    stable = abi == "abi3" and any(re.fullmatch(r"cp3(\d+)", t) and int(t[3:]) <= minor for t in pys)
    return f"cp3{minor}" in pys or stable


def pip_download(specs: dict[str, str], python_version: str, dest: Path) -> dict[str, Path]:
    """Download (or reuse from dest) the wheels of name==version for the target; name -> wheel path."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps"]
    cmd += ["--only-binary=:all:", "--python-version", python_version, "--implementation", "cp"]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    cmd += ["-d", str(dest), *(f"{n}=={v}" for n, v in specs.items())]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        err = [ln for ln in (r.stderr + r.stdout).splitlines() if ln.startswith("ERROR")] or [r.stderr[-500:]]
        raise BundleError(f"pip download failed for Python {python_version}: {err[0]}")
    found = {}
    for name, version in specs.items():
        hits = [
            w
            for w in sorted(dest.glob("*.whl"))
            if wheel_tags(w.name)[:2] == (normalize(name), version) and compatible(w.name, python_version)
        ]
        if not hits:
            raise BundleError(f"no wheel of {name}=={version} for CPython {python_version} in {dest}")
        found[name] = hits[-1]
    return found


def pruned(rel: str) -> bool:
    for pat in RAY_PRUNE:
        if fnmatch.fnmatch(rel, pat + "*" if pat.endswith("/") else pat):
            return True
    return False


def unpack_ray(wheel: Path, site: Path, strip: bool) -> dict:
    """Install Ray's wheel into `site` (a wheel is a zip of the site layout) minus RAY_PRUNE; its RECORD then lists
    what stays."""
    kept, dropped, dropped_bytes = [], 0, 0
    with zipfile.ZipFile(wheel) as zf:
        tops = {i.filename.split("/", 1)[0] for i in zf.infolist()}
        if any(t.endswith(".data") for t in tops):
            raise BundleError(f"{wheel.name} has a .data folder: install it with pip install --target instead")
        for info in zf.infolist():
            rel = info.filename
            if rel.endswith("/") or rel.endswith(".dist-info/RECORD"):
                continue
            if pruned(rel):
                dropped, dropped_bytes = dropped + 1, dropped_bytes + info.file_size
                continue
            zf.extract(info, site)
            mode = (info.external_attr >> 16) & 0o777
            if mode:
                os.chmod(site / rel, mode)
            kept.append(rel)
        record = next(t for t in tops if t.endswith(".dist-info")) + "/RECORD"
    (site / record).write_text("".join(f"{r},," + "\n" for r in [*kept, record]))
    stripped = []
    if strip:
        if not shutil.which("strip"):
            raise BundleError("--strip: no `strip` on PATH (binutils)")
        for rel in kept:
            path = site / rel
            with open(path, "rb") as f:
                if f.read(4) != ELF_MAGIC:
                    continue
            before = path.stat().st_size
            subprocess.run(["strip", "--strip-unneeded", str(path)], check=True)
            stripped.append((rel, before - path.stat().st_size))
    return {
        "files": len(kept) + 1,
        "unpacked_size": sum((site / r).stat().st_size for r in [*kept, record]),
        "pruned_files": dropped,
        "pruned_size": dropped_bytes,
        "stripped": {r: saved for r, saved in stripped},
    }


def tar_xz(site: Path, out: Path, level: int) -> None:
    """A reproducible tar of `site` (sorted, no owners, fixed mtime), compressed with xz (the binary when there is
    one, multi-threaded, else Python's lzma)."""

    def clean(ti: tarfile.TarInfo) -> tarfile.TarInfo:
        ti.uid = ti.gid = 0
        ti.uname = ti.gname = ""
        ti.mtime = 1_700_000_000
        return ti

    raw = out.with_suffix("")  # .tar
    with tarfile.open(raw, "w", format=tarfile.PAX_FORMAT) as tf:
        for path in sorted(site.rglob("*")):
            tf.add(path, arcname=str(path.relative_to(site)), recursive=False, filter=clean)
    if shutil.which("xz"):
        with out.open("wb") as dst:
            subprocess.run(["xz", f"-{level}", "-T0", "-c", str(raw)], stdout=dst, check=True)
    else:
        import lzma

        with raw.open("rb") as src, lzma.open(out, "wb", preset=level) as dst:
            shutil.copyfileobj(src, dst, 2**20)
    raw.unlink()


def reset_out(out: Path) -> None:
    """Empty OUT if it is a bundle (or empty); never delete a folder this script did not write."""
    if out.exists():
        entries = {p.name for p in out.iterdir()}
        if entries and "MANIFEST.json" not in entries and not entries <= {"wheels", RAY_SITE}:
            raise BundleError(f"{out} is not empty and holds no MANIFEST.json: refusing to overwrite it")
        shutil.rmtree(out)
    (out / "wheels").mkdir(parents=True)


def build(
    out: Path = DEFAULT_OUT,
    python_version: str = "3.12",
    cache: Path = DEFAULT_CACHE,
    lock: Path = LOCK,
    strip: bool = False,
    xz_level: int = 9,
) -> dict:
    t0 = time.monotonic()
    specs = carried(lock)
    wheels = pip_download(specs, python_version, cache / f"cp{python_version.replace('.', '')}")
    reset_out(out)
    packages = []
    for name in CARRY:
        src = wheels[name]
        shutil.copy2(src, out / "wheels" / src.name)
        size = src.stat().st_size
        packages.append({"name": name, "version": specs[name], "file": f"wheels/{src.name}", "size": size})
    with tempfile.TemporaryDirectory(prefix="ray-site-") as tmp:
        ray = unpack_ray(wheels[RAY], Path(tmp), strip)
        tar_xz(Path(tmp), out / RAY_SITE, xz_level)
    size = (out / RAY_SITE).stat().st_size
    ray |= {"wheel": wheels[RAY].name, "wheel_size": wheels[RAY].stat().st_size}
    packages.append({"name": RAY, "version": specs[RAY], "file": RAY_SITE, "size": size, **ray})
    manifest = {
        "python_version": python_version,
        "platforms": list(PLATFORMS),
        "packages": packages,
        "total_size": sum(p["size"] for p in packages),
        "build_seconds": round(time.monotonic() - t0, 1),
    }
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="bundle folder (default: .bundle at the repo root)")
    ap.add_argument("--python-version", default="3.12", help="target CPython X.Y (default 3.12, the device's)")
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="download cache (default %(default)s)")
    ap.add_argument("--requirements", type=Path, default=LOCK, help="the lock to take versions from")
    ap.add_argument("--strip", action="store_true", help="strip Ray's ELF files' symbol tables (~2 MB less)")
    ap.add_argument("--xz-level", type=int, default=9, choices=range(0, 10), metavar="0-9")
    args = ap.parse_args(argv)
    if not re.fullmatch(r"3\.\d+", args.python_version):
        ap.error(f"--python-version: expected 3.X, got {args.python_version!r}")
    try:
        m = build(args.out, args.python_version, args.cache, args.requirements, args.strip, args.xz_level)
    except (BundleError, subprocess.CalledProcessError, OSError) as e:
        print(f"build_bundle: error: {e}", file=sys.stderr)
        return 1
    for p in m["packages"]:
        print(f"{p['size'] / 2**20:8.2f} MiB  {p['name']}=={p['version']}  {p['file']}")
    total = f"{m['total_size'] / 2**20:8.2f} MiB  total"
    print(f"{total}, for CPython {m['python_version']}, built in {m['build_seconds']} s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
