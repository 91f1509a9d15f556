"""Packaging and import hygiene: works without torch_npu, survives a broken one, ships patches/ and env/."""

from __future__ import annotations

import subprocess
import sys
import zipfile

import pytest

from tests.conftest import REPO

BROKEN_TORCH_NPU = {
    "RuntimeError": "raise RuntimeError('ASCEND_HOME_PATH environment variable is not set')\n",
    "ImportError": "raise ImportError('libhccl.so: cannot open shared object file: No such file or directory')\n",
}


def make_broken_torch_npu(root, kind: str):
    """A torch_npu that fails like a wheel without CANN, including torch's auto-load entry point."""
    pkg = root / "torch_npu"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(BROKEN_TORCH_NPU[kind] + "def _autoload():\n    pass\n")
    dist = root / "torch_npu-2.7.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: torch_npu\nVersion: 2.7.1\n")
    (dist / "entry_points.txt").write_text("[torch.backends]\ntorch_npu = torch_npu:_autoload\n")
    return root


def py(code: str, **env) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        cwd=REPO,
        timeout=120,
    )


def test_import_without_torch_npu():
    proc = py(
        "import gspo_ascend, sys; import gspo_ascend.cli; print('torch_npu' in sys.modules, 'torch' in sys.modules)"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [
        "False",
        "False",
    ]  # importing the package loads neither torch nor torch_npu


@pytest.mark.parametrize("kind", sorted(BROKEN_TORCH_NPU))
def test_broken_torch_npu_leaves_package_usable(tmp_path, kind):
    path = str(make_broken_torch_npu(tmp_path, kind))
    # the hazard is real: with auto-load on, plain `import torch` dies
    hazard = py("import torch", PYTHONPATH=path, TORCH_DEVICE_BACKEND_AUTOLOAD="1")
    assert hazard.returncode != 0
    # gspo_ascend first: the package works, auto resolves to CPU, npu names the cause
    code = (
        "import gspo_ascend, torch\n"
        "from gspo_ascend.device import get_backend\n"
        "from gspo_ascend.errors import DeviceError\n"
        "print(get_backend('auto').name)\n"
        "try:\n    get_backend('npu')\nexcept DeviceError as e:\n    print(e)\n"
    )
    proc = py(code, PYTHONPATH=path)
    assert proc.returncode == 0, proc.stderr
    first, second = proc.stdout.strip().splitlines()
    assert first == "cpu"
    assert f"torch_npu failed to import ({kind}" in second and "GSPO_DEVICE_SHIM=1" in second
    help_proc = py("from gspo_ascend.cli import main; main(['--help'])", PYTHONPATH=path)
    assert "doctor" in help_proc.stdout
    doctor = py("from gspo_ascend.cli import main; raise SystemExit(main(['doctor']))", PYTHONPATH=path)
    assert doctor.returncode == 0, doctor.stderr
    assert "[warn] torch_npu" in doctor.stdout


@pytest.mark.slow
def test_wheel_ships_patches_env_and_configs(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(REPO),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    (wheel,) = tmp_path.glob("gspo_ascend-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "gspo_ascend/patches/__init__.py" in names
    assert "gspo_ascend/env/__init__.py" in names
    assert "gspo_ascend/configs/tiny_gspo.yaml" in names
    assert "gspo_ascend/device/shim/npu_ops.py" in names
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "gspo-ascend = gspo_ascend.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()


def test_pyproject_lists_every_subpackage():
    """pyproject names the wheel's packages by hand: a subpackage left out imports from a checkout and fails from
    the wheel (read from the source tree, not from a build: setuptools' build/ keeps stale copies)."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "gspo_ascend").rglob("__init__.py")}
    assert found - listed == set(), "add them to [tool.setuptools] packages in pyproject.toml"
