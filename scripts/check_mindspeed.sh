#!/usr/bin/env bash
# Run the real MindSpeed on CPU under our device shim, in a separate venv per MindSpeed branch (issues #13, #26).
# Two branches are held (docs/mindspeed-branches.md lists what differs between them for us, with the test of each):
#   26.1.0  branch 26.1.0_core_r0.12.1, the maintained one (until 2026-12-30): the recommended MindSpeed;
#           venv .venv-mindspeed-26/
#   2.2.0   branch 2.2.0_core_r0.12.1, the MindSpeed of verl's Atlas 800T A2 stack (the field stack; unmaintained
#           since 2026-03-30); venv .venv-mindspeed/
# .ci/run runs both, one after the other. Each venv takes 5.9 GB (torch 2.7.1 from PyPI is a CUDA build with its
# nvidia-* libraries; PyTorch's CPU index is not reachable from every machine). One venv each rather than one venv
# re-installed: MindSpeed's reinstall is cheap (~5 s), but two runs sharing one venv would swap MindSpeed under each
# other's subprocesses; with pip's cache warm the second venv costs its install time, not the download.
# Measured on 2 shared, loaded cores (2026-11-26; docs/mindspeed-branches.md "CI time"): the stack 158-166 s per
# venv (no pip cache here: each venv downloads torch), MindSpeed 25 s (2.2.0) / 43 s (26.1.0), the tiny models once
# per venv, then tests/mindspeed/ (59 tests) 345 s on 2.2.0 and 321 s on 26.1.0: ~5.5 min per branch cached.
#   bash scripts/check_mindspeed.sh                        26.1.0 (MINDSPEED_BRANCH, else 26.1.0): run tests/mindspeed/
#   bash scripts/check_mindspeed.sh --branch 2.2.0         the field stack's MindSpeed
#   bash scripts/check_mindspeed.sh --rebuild              delete the branch's venv and build it again
#   bash scripts/check_mindspeed.sh [--] FILE...           run these test files (or node ids) instead of tests/mindspeed/
# The stack: the NPU pins that run on CPU (requirements-npu.txt: torch 2.7.1, numpy 1.26.4, mbridge 0.13.1, einops;
# megatron-core 0.12.1 and transformers 4.57.6 from requirements-gpu.txt: verl's Ascend image has 4.57.6, the NPU file
# holds 4.57.1 only for vllm-ascend's ceiling, and vllm-ascend is not installed here), MindSpeed with --no-deps (its
# requirements.txt lists auto-tuning and test tools the adaptor does not import), and this package (editable).
# No torch_npu, no CANN: the shim stands in for them (shim.install(mindspeed=True); docs/device-shim.md).
# MindSpeed's source (never copied into this repository; installed and run):
#   MINDSPEED_SRC=<checkout dir or archive> when set, else ../shared/upstream/mindspeed-<branch>_core_r0.12.1-*.tar.gz
# Environment: PYTHON (default python3, 3.10 or 3.11), MINDSPEED_BRANCH (26.1.0 | 2.2.0),
#   MINDSPEED_VENV (default .venv-mindspeed-26 for 26.1.0, .venv-mindspeed for 2.2.0).
set -euo pipefail
self="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"  # the stamp hashes this file: any cwd
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
BRANCH=${MINDSPEED_BRANCH:-26.1.0}
TESTS=(tests/mindspeed)
rebuild=0
while (($#)); do
  case "$1" in
    --branch) BRANCH="${2:-}"; shift 2 || shift ;;
    --branch=*) BRANCH="${1#--branch=}"; shift ;;
    --rebuild) rebuild=1; shift ;;
    *) break ;;
  esac
done
case "$BRANCH" in
  26.1.0) default_venv=.venv-mindspeed-26 ;;
  2.2.0) default_venv=.venv-mindspeed ;;
  *)
    echo "check_mindspeed: --branch (MINDSPEED_BRANCH) is '$BRANCH'; use 26.1.0 (maintained) or 2.2.0 (verl's)" >&2
    exit 2
    ;;
esac
VENV=${MINDSPEED_VENV:-$default_venv}
if ((rebuild)); then rm -rf "$VENV"; fi
[[ "${1:-}" == "--" ]] && shift
(($#)) && TESTS=("$@")

# MindSpeed's source: an explicit MINDSPEED_SRC, else the archive in ../shared/upstream/
src="${MINDSPEED_SRC:-}"
if [[ -z "$src" ]]; then
  for f in ../shared/upstream/mindspeed-"$BRANCH"_core_r0.12.1-*.tar.gz; do
    [[ -f "$f" ]] && src="$f"
  done
fi
if [[ -z "$src" || ! -e "$src" ]]; then
  echo "check_mindspeed: no MindSpeed source${src:+ at $src}. Get branch ${BRANCH}_core_r0.12.1 of the public" \
    "Ascend/MindSpeed repository (git clone -b ${BRANCH}_core_r0.12.1 https://gitcode.com/Ascend/MindSpeed; mirrored at" \
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

from gspo_ascend.doctor.packages import mindspeed_branch, mindspeed_package_dir

names = ("torch", "transformers", "megatron-core", "mbridge", "mindspeed")
branch, evidence = mindspeed_branch(mindspeed_package_dir()) or ("none", "")
print(", ".join(f"{n} {version(n)}" for n in names) + f" (doctor: branch {branch}, {evidence})")
EOF
)"
echo "mindspeed stack: $versions"
# tiny models are built by this stack's transformers and never overwrite .venv's cache
GSPO_HOME="$(cd "$VENV" && pwd)/gspo-home"
export GSPO_HOME
export MINDSPEED_BRANCH="$BRANCH"  # tests/mindspeed/test_mindspeed_branch.py: the doctor must find this branch

start=$SECONDS
rc=0
"$VENV/bin/python" -m pytest -q -p no:cacheprovider "${TESTS[@]}" || rc=$?
echo "check_mindspeed: tests ran in $((SECONDS - start)) s (exit $rc) on $versions"
exit "$rc"
