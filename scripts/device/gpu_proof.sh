#!/usr/bin/env bash
# The GPU proof (issue #29): every layer of this build on one accelerator, in one run of about 6 minutes, each step
# with its own time limit (benchmarks/gpu_proof.py says what runs). Writes proof.json, proof.md and
# proof-logs.tar.gz into OUT.
#
#   bash scripts/device/gpu_proof.sh OUT --bundle .bundle [--device cuda] [gpu_proof.py options]   # a GPU machine
#   bash scripts/device/gpu_proof.sh OUT --device cpu                                             # CI, tiny sizes
#
# --bundle DIR: the packages the machine lacks (scripts/device/build_bundle.py builds it here; docs/gpu-proof.md),
# installed into $GSPO_SITE (default /tmp/gspo-site) and put on PYTHONPATH, with this checkout. Without it the
# interpreter is $PYTHON, else .venv/bin/python where it exists (scripts/setup.sh), else python3.
set -euo pipefail
cd "$(dirname "$0")/../.."
[[ $# -ge 1 && "$1" != -* ]] || { echo "usage: $0 OUT [--bundle DIR] [--device cuda|npu|cpu] [...]" >&2; exit 2; }
out=$1
shift
bundle=""
args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --bundle) bundle=${2:?--bundle needs a folder}; shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done
if [[ -n "${PYTHON:-}" ]]; then py=$PYTHON
elif [[ -z "$bundle" && -x .venv/bin/python ]]; then py=.venv/bin/python
else py=python3
fi
if [[ -n "$bundle" ]]; then
  site=${GSPO_SITE:-/tmp/gspo-site}
  start=$SECONDS
  bash scripts/device/install_bundle.sh "$bundle" "$site"
  # this checkout too, installed: gspo_ascend.patches / .env / .configs exist only as pyproject maps them
  "$py" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --disable-pip-version-check \
    --target "$site" . > "$site.gspo-install.log" 2>&1 || {
    # no setuptools / wheel there: lay the package out as pyproject's package-dir does
    echo "gpu_proof: pip could not install this checkout ($(grep -m1 -i error "$site.gspo-install.log")); copying it" >&2
    rm -rf "$site/gspo_ascend" && cp -r gspo_ascend "$site/gspo_ascend"
    for sub in patches env configs; do cp -r "$sub" "$site/gspo_ascend/$sub"; done
  }
  rm -rf build ./*.egg-info
  echo "bundle $bundle and this checkout installed into $site in $((SECONDS - start)) s" >&2
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
fi
exec "$py" benchmarks/gpu_proof.py --out "$out" "${args[@]}"
