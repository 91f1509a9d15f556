#!/usr/bin/env bash
# Run the real MindSpeed (Ascend/MindSpeed branch 2.2.0_core_r0.12.1, the MindSpeed of verl's Atlas 800T A2 stack)
# on CPU under our device shim, in a separate venv .venv-mindspeed/ (issue #13). .ci/run runs it after the README's
# test command. The venv takes 5.9 GB (torch 2.7.1 from PyPI is a CUDA build with its nvidia-* libraries;
# PyTorch's CPU index is not reachable from every machine): built in 100-150 s with a fast link, plus ~80 s for the
# tiny models once; tests/mindspeed/ then runs in ~75 s on 2 cores.
#   bash scripts/check_mindspeed.sh                  build .venv-mindspeed once (reused later), run tests/mindspeed/
#   bash scripts/check_mindspeed.sh --rebuild        delete .venv-mindspeed and build it again
#   bash scripts/check_mindspeed.sh [--] FILE...     run these test files (or node ids) instead of tests/mindspeed/
# The stack: the NPU pins that run on CPU (requirements-npu.txt: torch 2.7.1, numpy 1.26.4, mbridge 0.13.1, einops;
# megatron-core 0.12.1 and transformers 4.57.6 from requirements-gpu.txt: verl's Ascend image has 4.57.6, the NPU file
# holds 4.57.1 only for vllm-ascend's ceiling, and vllm-ascend is not installed here), MindSpeed with --no-deps (its
# requirements.txt lists auto-tuning and test tools the adaptor does not import), and this package (editable).
# No torch_npu, no CANN: the shim stands in for them (shim.install(mindspeed=True); docs/device-shim.md).
# MindSpeed's source (never copied into this repository; installed and run):
#   MINDSPEED_SRC=<checkout dir or archive> when set, else ../shared/upstream/mindspeed-2.2.0_core_r0.12.1-*.tar.gz
# Environment: PYTHON (default python3, 3.10 or 3.11), MINDSPEED_VENV (default .venv-mindspeed).
set -euo pipefail
self="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"  # the stamp hashes this file: any cwd
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${MINDSPEED_VENV:-.venv-mindspeed}
TESTS=(tests/mindspeed)

if [[ "${1:-}" == "--rebuild" ]]; then
  rm -rf "$VENV"
  shift
fi
[[ "${1:-}" == "--" ]] && shift
(($#)) && TESTS=("$@")

# MindSpeed's source: an explicit MINDSPEED_SRC, else the archive in ../shared/upstream/
src="${MINDSPEED_SRC:-}"
if [[ -z "$src" ]]; then
  for f in ../shared/upstream/mindspeed-2.2.0_core_r0.12.1-*.tar.gz; do
    [[ -f "$f" ]] && src="$f"
  done
fi
if [[ -z "$src" || ! -e "$src" ]]; then
  echo "check_mindspeed: no MindSpeed source${src:+ at $src}. Get branch 2.2.0_core_r0.12.1 of the public" \
    "Ascend/MindSpeed repository (git clone -b 2.2.0_core_r0.12.1 https://gitcode.com/Ascend/MindSpeed; mirrored at" \
    "https://github.com/Ascend/MindSpeed) and set MINDSPEED_SRC=<that checkout or an archive of it>." >&2
  exit 1
fi

# one pin per package, read from the requirements files (their comments say why each version)
pin() {  # pin NAME FILE -> the "NAME==VERSION" line of FILE
  local line
  line="$(sed -e 's/#.*//' -e 's/[[:space:]]*$//' "$2" | grep -E "^$1(\[[^]]*\])?(==|>=)" | head -n 1)"
  [[ -n "$line" ]] || { echo "check_mindspeed: no pin for $1 in $2" >&2; exit 1; }
  echo "$line"
}
PINS=(
  "$(pin torch requirements-npu.txt)" "$(pin numpy requirements-npu.txt)" "$(pin mbridge requirements-npu.txt)"
  "$(pin einops requirements-npu.txt)" "$(pin megatron-core requirements-gpu.txt)"
  "$(pin transformers requirements-gpu.txt)" "$(pin safetensors requirements-npu.txt)"
  "$(pin pyyaml requirements-npu.txt)" "$(pin omegaconf requirements-npu.txt)" "$(pin rich requirements-npu.txt)"
  "$(pin math-verify requirements-npu.txt)"  # the tiny models (gspo_ascend.tiny) score their warm start with it
  "$(pin blake3 requirements-npu.txt)"  # checkpoint checksums (gspo_ascend/checkpoint.py): this package's dependency
  "$(pin psutil requirements-npu.txt)"  # MindSpeed's requirements.txt; megatron-core's filesystem_async imports it, MindSpeed patches that module
  "setuptools>=68" wheel pytest
)
for p in "${PINS[@]}"; do [[ -n "$p" ]] || exit 1; done  # pin() failed inside $(...): its message is above

[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
pip_q() {  # quiet pip; drops the warnings about this machine's empty local indexes (file:// extra-index-url)
  "${PIP[@]}" "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}
stamp="$VENV/.gspo-mindspeed-$( (printf '%s\n' "${PINS[@]}"; cat pyproject.toml "$self") | sha256sum | cut -c1-16)"
if [[ ! -f "$stamp" ]]; then
  start=$SECONDS
  pip_q install -q "${PINS[@]}"
  pip_q install -q --no-deps --no-build-isolation -e .
  rm -f "$VENV"/.gspo-mindspeed-* "$VENV"/.gspo-mindspeed-src-*
  touch "$stamp"
  echo "check_mindspeed: stack installed in $((SECONDS - start)) s ($(du -sh "$VENV" | cut -f1) venv)"
fi
# MindSpeed itself: reinstalled when the archive changes (a checkout directory is reinstalled every run, ~5 s)
src_id="dir"
[[ -f "$src" ]] && src_id="$(sha256sum "$src" | cut -c1-16)"
src_stamp="$VENV/.gspo-mindspeed-src-$src_id"
if [[ ! -f "$src_stamp" ]]; then
  start=$SECONDS
  pip_q install -q --no-deps --force-reinstall "$src"
  rm -f "$VENV"/.gspo-mindspeed-src-*
  [[ "$src_id" == dir ]] || touch "$src_stamp"
  echo "check_mindspeed: MindSpeed installed from $src in $((SECONDS - start)) s ($(du -sh "$VENV" | cut -f1) venv)"
fi

versions="$("$VENV/bin/python" - <<'EOF'
from importlib.metadata import version

names = ("torch", "transformers", "megatron-core", "mbridge", "mindspeed")
print(", ".join(f"{n} {version(n)}" for n in names))
EOF
)"
echo "mindspeed stack: $versions"
# tiny models are built by this stack's transformers and never overwrite .venv's cache
GSPO_HOME="$(cd "$VENV" && pwd)/gspo-home"
export GSPO_HOME

start=$SECONDS
rc=0
"$VENV/bin/python" -m pytest -q -p no:cacheprovider "${TESTS[@]}" || rc=$?
echo "check_mindspeed: tests ran in $((SECONDS - start)) s (exit $rc) on $versions"
exit "$rc"
