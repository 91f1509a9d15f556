"""House rule: no torch.cuda, "nccl" or "hccl" outside gspo_ascend/device/ (route through the device contract).

ruff's banned-api rule (pyproject.toml) covers `torch.cuda` imports and attribute use; this test also covers
the backend-name strings, which no ruff rule can see, and scans every shipped Python tree.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

SCANNED = ["gspo_ascend", "patches", "scripts", "benchmarks", "env"]
ALLOWED = REPO / "gspo_ascend" / "device"
BANNED_STRINGS = {"nccl", "hccl"}


def violations(source: str, filename: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.lower() in BANNED_STRINGS:
            found.append(f"{filename}:{node.lineno}: backend name {node.value!r}")
        if isinstance(node, ast.Attribute) and node.attr == "cuda":
            base = node.value
            if isinstance(base, ast.Name) and base.id == "torch":
                found.append(f"{filename}:{node.lineno}: torch.cuda")
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if any(n == "torch.cuda" or n.startswith("torch.cuda.") for n in names):
                found.append(f"{filename}:{node.lineno}: import torch.cuda")
    return found


def test_checker_catches_violations():
    bad = 'import torch\nimport torch.cuda\ntorch.cuda.synchronize()\nbackend = "nccl"\nx = "HCCL"\n'
    assert len(violations(bad, "bad.py")) == 4
    assert violations('backend = device.comm_backend\ndoc = "uses nccl underneath"\n', "ok.py") == []


def test_no_device_api_outside_device_layer():
    found = []
    for top in SCANNED:
        for path in sorted((REPO / top).rglob("*.py")):
            if ALLOWED in path.parents:
                continue
            found += violations(path.read_text(), str(path.relative_to(REPO)))
    assert found == [], "route these through gspo_ascend.device:\n" + "\n".join(found)


def _ruff(*args: str):
    import subprocess
    import sys

    ruff = Path(sys.executable).with_name("ruff")
    return subprocess.run([str(ruff), *args], capture_output=True, text=True, cwd=REPO, timeout=120)


def test_ruff_check_clean():
    proc = _ruff("check", ".")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ruff_format_clean():
    proc = _ruff("format", "--check", ".")
    assert proc.returncode == 0, proc.stdout + proc.stderr
