#!/usr/bin/env bash
# The GPU proof (issue #29): every layer of this build on one accelerator, in one run of about 6 minutes, each step
# with its own time limit (benchmarks/gpu_proof.py says what runs). Writes proof.json, proof.md and
# proof-logs.tar.gz into OUT.
#
#   bash scripts/device/gpu_proof.sh OUT --bundle .bundle [--device cuda] [gpu_proof.py options]   # a GPU machine
#   bash scripts/device/gpu_proof.sh OUT --device cpu                                             # CI, tiny sizes
#
# --bundle DIR: the packages the machine lacks (scripts/device/build_bundle.py builds it here; docs/gpu-proof.md),
# installed with this checkout into $GSPO_SITE (default /tmp/gspo-site), which goes on PYTHONPATH. Without it the
# interpreter is $PYTHON, else .venv/bin/python where it exists (scripts/setup.sh), else python3, and gspo-ascend
# must be installed in it. Bad input: one line, exit 2.
set -euo pipefail
die() { echo "gpu_proof: error: $*" >&2; exit 2; }
[[ $# -ge 1 && "$1" != -* ]] || die "usage: $0 OUT [--bundle DIR] [--device cuda|npu|cpu] [gpu_proof.py options]"
out=$(realpath -m "$1")  # OUT and DIR as the caller named them, before the cd below
shift
bundle=""
args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --bundle) [[ $# -ge 2 ]] || die "--bundle needs a folder (scripts/device/build_bundle.py makes one)"
              bundle=$(realpath -m "$2"); shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done
cd "$(dirname "$0")/../.."
if [[ -n "${PYTHON:-}" ]]; then py=$PYTHON
elif [[ -z "$bundle" && -x .venv/bin/python ]]; then py=$PWD/.venv/bin/python
else py=python3
fi
if [[ -n "$bundle" ]]; then
  [[ -f "$bundle/MANIFEST.json" ]] || die "$bundle is not a bundle (no MANIFEST.json); build it with scripts/device/build_bundle.py"
  site=${GSPO_SITE:-/tmp/gspo-site}
  start=$SECONDS
  bash scripts/device/install_bundle.sh "$bundle" "$site"
  # this checkout too, installed: gspo_ascend.patches / .env / .configs exist only as pyproject maps them. From a
  # copy of the package's sources, so no build/ or egg-info is written into (or picked up from) the checkout.
  src=$(mktemp -d)
  cp -r gspo_ascend patches env configs pyproject.toml README.md "$src/"
  find "$src" -name __pycache__ -prune -exec rm -rf {} +
  "$py" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --disable-pip-version-check \
    --target "$site" "$src" > "$site.gspo-install.log" 2>&1 || {
    # no setuptools / wheel there: lay the package out as pyproject's package-dir does
    echo "gpu_proof: pip could not install this checkout ($(grep -m1 -i error "$site.gspo-install.log")); copying it" >&2
    rm -rf "$site/gspo_ascend" && cp -r "$src/gspo_ascend" "$site/gspo_ascend"
    for sub in patches env configs; do cp -r "$src/$sub" "$site/gspo_ascend/$sub"; done
  }
  rm -rf "$src"
  echo "bundle $bundle and this checkout installed into $site in $((SECONDS - start)) s" >&2
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
# from outside the checkout: its bare gspo_ascend/ (no configs/ in it) must not be what is found
(cd / && "$py" -c "import gspo_ascend.configs, gspo_ascend.env") 2> /dev/null ||
  die "gspo-ascend is not installed for $py (bash scripts/setup.sh, or --bundle DIR on a machine without an index)"
exec "$py" benchmarks/gpu_proof.py --out "$out" "${args[@]}"
