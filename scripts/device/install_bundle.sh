#!/usr/bin/env bash
# Install a device bundle (scripts/device/build_bundle.py) into SITE_DIR, on a machine with no package index:
#   bash scripts/device/install_bundle.sh BUNDLE_DIR SITE_DIR     then run with PYTHONPATH=SITE_DIR
# Wheels go in with pip (--no-index --no-deps --target), Ray's pruned site is unpacked next to them; then every
# package of MANIFEST.json is checked to be in SITE_DIR. Any failure: one line on stderr, exit 1.
# PYTHON (default python3) must be the CPython version the bundle was built for.
set -euo pipefail
PYTHON=${PYTHON:-python3}
die() { echo "install_bundle: error: $*" >&2; exit 1; }

[[ $# -eq 2 ]] || die "usage: install_bundle.sh BUNDLE_DIR SITE_DIR"
BUNDLE=$1 SITE=$2
[[ -f "$BUNDLE/MANIFEST.json" ]] || die "$BUNDLE/MANIFEST.json is missing (build it with scripts/device/build_bundle.py)"
[[ -f "$BUNDLE/ray-site.tar.xz" ]] || die "$BUNDLE/ray-site.tar.xz is missing"
compgen -G "$BUNDLE/wheels/*.whl" > /dev/null || die "$BUNDLE/wheels/ holds no wheels"
want=$("$PYTHON" -c 'import json, sys; print(json.load(open(sys.argv[1]))["python_version"])' "$BUNDLE/MANIFEST.json") ||
  die "cannot read $BUNDLE/MANIFEST.json with $PYTHON"
have=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
[[ "$want" == "$have" ]] || die "the bundle is for Python $want, $PYTHON is $have (rebuild with --python-version $have)"
mkdir -p "$SITE"

log=$(mktemp)
trap 'rm -f "$log"' EXIT
"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --disable-pip-version-check \
  --target "$SITE" "$BUNDLE"/wheels/*.whl > "$log" 2>&1 ||
  die "pip install of $BUNDLE/wheels failed: $(grep -m1 -E 'ERROR|Error' "$log" || tail -1 "$log")"

# Python's tarfile rather than tar -J: the image need not have xz; the 'data' filter refuses paths leaving SITE.
"$PYTHON" - "$BUNDLE/ray-site.tar.xz" "$SITE" <<'EOF' || die "unpacking $BUNDLE/ray-site.tar.xz failed"
import shutil, sys, tarfile
from pathlib import Path

site = Path(sys.argv[2])
for old in ("ray", *(p.name for p in site.glob("ray-*.dist-info"))):  # an older unpack: replace it, don't merge
    shutil.rmtree(site / old, ignore_errors=True)
with tarfile.open(sys.argv[1]) as tf:
    tf.extractall(site, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
EOF

# Every package of the manifest, by its dist-info, and Ray's executables.
missing=$("$PYTHON" - "$BUNDLE/MANIFEST.json" "$SITE" <<'EOF'
import json, os, re, sys
from pathlib import Path

site = Path(sys.argv[2])
def norm(name):
    return re.sub(r"[-_.]+", "_", name).lower()

have = set()
for d in site.glob("*.dist-info"):  # name-version.dist-info
    name, _, version = d.name[: -len(".dist-info")].rpartition("-")
    have.add((norm(name), version))
packages = json.load(open(sys.argv[1]))["packages"]
missing = [f"{p['name']}=={p['version']}" for p in packages if (norm(p["name"]), p["version"]) not in have]
missing += [str(site / x) for x in ("ray/_raylet.so", "ray/core/src/ray/raylet/raylet", "ray/core/src/ray/gcs/gcs_server")
            if not os.access(site / x, os.R_OK | (os.X_OK if "/src/" in x else 0))]
print(", ".join(missing))
EOF
) || die "cannot check the install in $SITE"
[[ -z "$missing" ]] || die "missing in $SITE after the install: $missing"
wheels=("$BUNDLE"/wheels/*.whl)
echo "install_bundle: ${#wheels[@]} wheels and Ray installed in $SITE; run with PYTHONPATH=$SITE"
