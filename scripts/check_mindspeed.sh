#!/usr/bin/env bash
# Run the real MindSpeed on CPU under our device shim, in a separate venv per MindSpeed branch (issues #13, #26, #40,
# #41). Three branches are held (docs/mindspeed-branches.md lists what differs between them for us, with the test of
# each):
#   core_r0.16.0  MindSpeed's Mcore 0.16 line, the one the pinned NPU stack installs (requirements-npu.txt: with
#           vllm-ascend 0.23, torch / torch_npu 2.10, megatron-core 0.16.0, the line verl's 2026 Ascend guide runs);
#           venv .venv-mindspeed-16/; runs the whole of tests/mindspeed/
#   26.1.0  branch 26.1.0_core_r0.12.1 of the previous line (megatron-core 0.12.1), maintained until 2026-12-30 and
#           kept for teams on that line; venv .venv-mindspeed-26/; runs only the tests that tell the branches apart:
#           the "test" column of the doc's table "What differs between them for us", read by
#           tests/mindspeed/branch_tests.py (the one list; tests/unit/test_mindspeed_branch_tests.py checks each
#           entry names a real test)
#   2.2.0   branch 2.2.0_core_r0.12.1, the previous line's field MindSpeed (verl's until it moved to core_r0.16.0;
#           unmaintained since 2026-03-30); venv .venv-mindspeed/; the same distinguishing tests; not in CI
# .ci/run runs core_r0.16.0 and 26.1.0, one after the other.
#   bash scripts/check_mindspeed.sh                        core_r0.16.0 (MINDSPEED_BRANCH, else core_r0.16.0)
#   bash scripts/check_mindspeed.sh --branch 26.1.0        the previous line's MindSpeed: the distinguishing tests
#   bash scripts/check_mindspeed.sh --branch 26.1.0 --all  ... the whole of tests/mindspeed/ instead
#   bash scripts/check_mindspeed.sh --rebuild              delete the branch's venv and build it again
#   bash scripts/check_mindspeed.sh --prepare              build the venv and the tiny models only (.ci/run starts
#                                                          both CI branches' in the background while the main suite
#                                                          runs)
#   bash scripts/check_mindspeed.sh [--] FILE...           run these test files (or node ids, or pytest options)
# Caches outside the clone, under GSPO_CI_CACHE (default ~/.cache/gspo-ci); a fresh machine (only Python) fills them
# once, every later venv and clone reuses them; deleting the folder only costs that first fill again:
#   uv-<version>/   uv itself (pip-installed from PyPI into its own small venv)
#   uv/             uv's package cache: torch 2.10.0 and 2.7.1 (CUDA builds with their nvidia-* libraries, run on
#                   CPU: PyTorch's CPU index is not reachable from every machine) are downloaded once; every venv then
#                   hardlinks the installed files from here (uv's default on Linux; on another filesystem than the
#                   clone uv copies them), so a second venv of the same torch costs seconds and almost no disk.
#                   MindSpeed's wheel, built once per archive, is cached here too.
#   gspo-home-<key>/  the tiny models (GSPO_HOME), shared by the venvs of one torch and transformers (the key hashes
#                   their pins), so the same models; gspo_ascend.tiny writes each next to its place and renames it
#                   in, so two runs building at once do not see half a model.
#   locks/          one lock per venv: a run installs into its venv only while no other run uses that venv, so two
#                   runs at once never swap MindSpeed under each other's worker processes (and each branch has its
#                   own venv, so the branches run side by side).
# Measured on 2 shared, loaded cores: docs/mindspeed-branches.md "CI time".
# The stack, one line per branch:
#   core_r0.16.0  the NPU pins that run on CPU: requirements-npu.txt (torch 2.10.0, transformers 5.5.4, numpy 1.26.4,
#                 mbridge 0.15.1, einops, ...) and megatron-core 0.16.0 from requirements-gpu.txt (the NPU file has it
#                 as a Megatron-LM checkout, an @source line)
#   0.12.1 branches  tests/mindspeed/requirements-core_r0.12.1.txt (torch 2.7.1, megatron-core 0.12.1, transformers
#                 4.57.6, mbridge 0.13.1: the previous line's pins), the rest from requirements-npu.txt
# MindSpeed with --no-deps (its requirements.txt lists auto-tuning and test tools the adaptor does not import), and
# this package (editable). No torch_npu, no CANN: the shim stands in for them (shim.install(mindspeed=True);
# docs/device-shim.md). No Megatron-LM either: the shim's megatron.training stand-in (megatron_training.py).
# MindSpeed's source (never copied into this repository; installed and run):
#   MINDSPEED_SRC=<checkout dir or archive> when set, else the branch's archive in ../shared/upstream/
# Environment: PYTHON (default python3, 3.10 or 3.11), MINDSPEED_BRANCH (core_r0.16.0 | 26.1.0 | 2.2.0),
#   MINDSPEED_VENV (default per branch, above), GSPO_CI_CACHE (see above);
#   uv reads its own settings (UV_DEFAULT_INDEX, ...), not pip's configuration.
set -euo pipefail
self="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"  # the stamp hashes this file: any cwd
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
BRANCH=${MINDSPEED_BRANCH:-core_r0.16.0}
rebuild=0
all=0
prepare=0
while (($#)); do
  case "$1" in
    --branch) BRANCH="${2:-}"; shift 2 || shift ;;
    --branch=*) BRANCH="${1#--branch=}"; shift ;;
    --rebuild) rebuild=1; shift ;;
    --all) all=1; shift ;;
    --prepare) prepare=1; shift ;;
    *) break ;;
  esac
done
case "$BRANCH" in  # the venv, the archive's name in ../shared/upstream/, the file of the line's own pins
  core_r0.16.0) default_venv=.venv-mindspeed-16 archive=core_r0.16.0 line_pins=requirements-npu.txt ;;
  26.1.0) default_venv=.venv-mindspeed-26 archive=26.1.0_core_r0.12.1 line_pins=tests/mindspeed/requirements-core_r0.12.1.txt ;;
  2.2.0) default_venv=.venv-mindspeed archive=2.2.0_core_r0.12.1 line_pins=tests/mindspeed/requirements-core_r0.12.1.txt ;;
  *)
    echo "check_mindspeed: --branch (MINDSPEED_BRANCH) is '$BRANCH'; use core_r0.16.0 (the pinned line), 26.1.0 or" \
      "2.2.0 (the previous line's)" >&2
    exit 2
    ;;
esac
VENV=${MINDSPEED_VENV:-$default_venv}
CACHE=${GSPO_CI_CACHE:-$HOME/.cache/gspo-ci}
[[ "${1:-}" == "--" ]] && shift
if (($#)); then
  TESTS=("$@")
elif [[ "$BRANCH" == core_r0.16.0 ]] || ((all)); then
  TESTS=(tests/mindspeed)
else  # a previous-line branch: the tests of the doc's table (plain Python reads them: no venv needed)
  mapfile -t TESTS < <("$PY" -m tests.mindspeed.branch_tests)
  ((${#TESTS[@]})) || { echo "check_mindspeed: no tests read from docs/mindspeed-branches.md" >&2; exit 1; }
fi

# MindSpeed's source: an explicit MINDSPEED_SRC, else the archive in ../shared/upstream/
src="${MINDSPEED_SRC:-}"
if [[ -z "$src" ]]; then
  for f in ../shared/upstream/mindspeed-"$archive"-*.tar.gz; do
    [[ -f "$f" ]] && src="$f"
  done
fi
if [[ -z "$src" || ! -e "$src" ]]; then
  echo "check_mindspeed: no MindSpeed source${src:+ at $src}. Get branch $archive of the public" \
    "Ascend/MindSpeed repository (git clone -b $archive https://gitcode.com/Ascend/MindSpeed; mirrored at" \
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
if [[ "$BRANCH" == core_r0.16.0 ]]; then
  core_pin="$(pin megatron-core requirements-gpu.txt)"  # the NPU file has it as an @source line (Megatron-LM)
else
  core_pin="$(pin megatron-core "$line_pins")"
fi
PINS=(
  "$(pin torch "$line_pins")" "$(pin numpy "$line_pins")" "$(pin mbridge "$line_pins")"
  "$(pin einops "$line_pins")" "$core_pin" "$(pin transformers "$line_pins")" "$(pin safetensors requirements-npu.txt)"
  "$(pin pyyaml requirements-npu.txt)" "$(pin omegaconf requirements-npu.txt)" "$(pin rich requirements-npu.txt)"
  "$(pin math-verify requirements-npu.txt)"  # the tiny models (gspo_ascend.tiny) score their warm start with it
  "$(pin blake3 requirements-npu.txt)"  # checkpoint checksums (gspo_ascend/checkpoint.py): this package's dependency
  "$(pin psutil requirements-npu.txt)"  # MindSpeed's requirements.txt; megatron-core's filesystem_async imports it, MindSpeed patches that module
  "$(pin scipy requirements-npu.txt)"  # MindSpeed's requirements.txt; core_r0.16.0's adaptor imports it (the DSA feature)
  "setuptools>=68" wheel pytest
)
# core_r0.16.0's adaptor reaches transformers' lazy image processors (its patch manager probes a transformers
# attribute), which import torchvision; the NPU stack has it (vllm-ascend 0.23.0 pins it)
[[ "$BRANCH" != core_r0.16.0 ]] || PINS+=("$(pin torchvision requirements-npu.txt)")
for p in "${PINS[@]}"; do [[ -n "$p" ]] || exit 1; done  # pin() failed inside $(...): its message is above

# uv, once per machine (scripts/lib/uv.sh, shared with scripts/setup.sh)
# shellcheck source-path=SCRIPTDIR source=lib/uv.sh
source scripts/lib/uv.sh
UV=$(uv_bin "$PY") || { echo "check_mindspeed: uv $UV_VERSION could not be installed from PyPI" >&2; exit 1; }
export UV_CACHE_DIR="$CACHE/uv" UV_NO_PROGRESS=1
uv_pip() { "$UV" pip "$1" --python "$VENV/bin/python" --quiet "${@:2}"; }

# this venv's lock: exclusive while installing, shared while testing (a run that must install waits for the others)
mkdir -p "$CACHE/locks"
exec 9>"$CACHE/locks/$(realpath -m "$VENV" | sha256sum | cut -c1-16).lock"
flock 9
if ((rebuild)); then rm -rf "$VENV"; fi
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv --without-pip "$VENV"
# the helper's UV_VERSION (scripts/lib/uv.sh) is part of how the venv was built, so a bump rebuilds it
stamp="$VENV/.gspo-mindspeed-$( (printf '%s\n' "${PINS[@]}"; cat pyproject.toml "$self" "${self%/*}/lib/uv.sh") |
  sha256sum | cut -c1-16)"
if [[ ! -f "$stamp" ]]; then
  start=$SECONDS
  uv_pip install "${PINS[@]}"
  uv_pip install --no-deps --no-build-isolation -e .
  rm -f "$VENV"/.gspo-mindspeed-* "$VENV"/.gspo-mindspeed-src-*
  touch "$stamp"
  echo "check_mindspeed: stack installed in $((SECONDS - start)) s ($(du -sh "$VENV" | cut -f1) venv, most of it" \
    "hardlinks into $UV_CACHE_DIR)"
fi
# MindSpeed itself: reinstalled when the archive changes (its wheel, built once per archive, comes from uv's
# cache); a checkout directory is built and reinstalled every run
src_id="dir"
[[ -f "$src" ]] && src_id="$(sha256sum "$src" | cut -c1-16)"
src_stamp="$VENV/.gspo-mindspeed-src-$src_id"
if [[ ! -f "$src_stamp" ]]; then
  start=$SECONDS
  refresh=()
  [[ "$src_id" == dir ]] && refresh=(--refresh-package mindspeed)
  # named: uv would read the name from the archive's file name (mindspeed-26.1.0_core_r0.12.1-...)
  uv_pip install --no-deps --reinstall-package mindspeed "${refresh[@]}" "mindspeed @ file://$(realpath "$src")"
  rm -f "$VENV"/.gspo-mindspeed-src-*
  [[ "$src_id" == dir ]] || touch "$src_stamp"
  echo "check_mindspeed: MindSpeed installed from $src in $((SECONDS - start)) s"
fi
flock -s 9  # from here on other runs may test in this venv too; none may install into it until this one ends

versions="$("$VENV/bin/python" - <<'EOF'
from importlib.metadata import version

from gspo_ascend.doctor.packages import mindspeed_branch, mindspeed_package_dir

names = ("torch", "transformers", "megatron-core", "mbridge", "mindspeed")
branch, evidence = mindspeed_branch(mindspeed_package_dir()) or ("none", "")
print(", ".join(f"{n} {version(n)}" for n in names) + f" (doctor: branch {branch}, {evidence})")
EOF
)"
echo "mindspeed stack: $versions"
# the tiny models: built by this stack's torch and transformers (the key), so both branches' venvs share them; never
# written into .venv's cache (~/.cache/gspo-ascend), which another transformers builds
GSPO_HOME="$CACHE/gspo-home-$(printf '%s\n' "${PINS[0]}" "${PINS[5]}" | sha256sum | cut -c1-12)"
export GSPO_HOME
export MINDSPEED_BRANCH="$BRANCH"  # tests/mindspeed/test_mindspeed_branch.py: the doctor must find this branch
if ((prepare)); then  # the venv and the tiny models its tests read; no test
  start=$SECONDS
  "$VENV/bin/python" -c "from gspo_ascend.tiny import ensure_tiny_model as m; m(); m(moe=True)"
  echo "check_mindspeed: $BRANCH prepared (venv, tiny models in $GSPO_HOME: $((SECONDS - start)) s)"
  exit 0
fi

start=$SECONDS
rc=0
echo "check_mindspeed: on $BRANCH: ${TESTS[*]}"
# pyproject's addopts run the main suite on two pytest-xdist workers; not here: these tests start their own gloo
# ranks (up to four processes on the two cores), and this venv has no xdist
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -o "addopts=-ra --durations=15" "${TESTS[@]}" || rc=$?
echo "check_mindspeed: tests ran in $((SECONDS - start)) s (exit $rc) on $versions"
exit "$rc"
