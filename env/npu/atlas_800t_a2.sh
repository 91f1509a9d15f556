# shellcheck shell=bash
# Host environment of an Atlas 800T A2 node (8 x Ascend 910B, CANN 9.1.0). scripts/lib/launch.sh sources it on
# every node before `ray start`: Ray workers inherit the raylet's environment, and a runtime_env cannot source
# scripts. By hand:  NIC=<interface> source env/npu/atlas_800t_a2.sh   (ASCEND_ROOT defaults to /usr/local/Ascend)
# Per-job variables (HCCL timeouts and ports, vllm-ascend switches) are in env/npu/mc2_env.yaml. GPU counterpart:
# env/gpu/h20.sh (same shape). Every value: what, why, source; tests/unit/test_env_profiles.py checks them against
# gspo-ascend doctor's env rules. Deliberately absent: HCCL_INTRA_ROCE_ENABLE (only the 200T A2 Box16 and 300T Pro
# use it) and HCCL_OP_EXPANSION_MODE=AIV (documented as inference-only on A2; training keeps the HOST default;
# gspo_ascend/npu_profile.py SETTINGS lists the whole NPU performance profile, docs/install-npu.md renders it).

_gspo_host_profile() {
  local root=${ASCEND_ROOT:-/usr/local/Ascend} nic=${NIC:-} set_env

  # --- vendor runtime
  # what: CANN toolkit environment: ASCEND_HOME_PATH, ASCEND_TOOLKIT_HOME, ASCEND_OPP_PATH, ASCEND_AICPU_PATH and
  #   CANN's entries in LD_LIBRARY_PATH, PYTHONPATH and PATH.
  # why: torch_npu refuses to import without them ("Please run 'source set_env.sh'", "ASCEND_HOME_PATH environment
  #   variable is not set").
  # source: CANN installation guide (ascend-toolkit/set_env.sh; cann/set_env.sh from CANN 8.5); doctor check ascend-env.
  set_env=$root/ascend-toolkit/set_env.sh
  [[ -f $set_env ]] || set_env=$root/cann/set_env.sh
  if [[ ! -f $set_env ]]; then
    echo "error: no CANN set_env.sh under $root (set ASCEND_ROOT); see docs/install-npu.md" >&2
    return 1
  fi
  # shellcheck disable=SC1090
  source "$set_env"
  # what: ATB (CANN NNAL) environment: ATB_HOME_PATH and ATB's entries in LD_LIBRARY_PATH.
  # why: vllm-ascend links libatb.so; without it vLLM fails with "Failed to infer device type".
  # source: vllm-ascend installation guide and FAQ; doctor check atb.
  if [[ ! -f $root/nnal/atb/set_env.sh ]]; then
    echo "error: no $root/nnal/atb/set_env.sh: install Ascend-cann-nnal 9.1.0 (docs/install-npu.md)" >&2
    return 1
  fi
  # shellcheck disable=SC1091
  source "$root/nnal/atb/set_env.sh"

  # --- host allocator: jemalloc when found (JEMALLOC=<path> names another, JEMALLOC= keeps glibc's malloc)
  local jemalloc=${JEMALLOC-} candidate
  if [[ -z ${JEMALLOC+set} ]]; then
    for candidate in /usr/lib/aarch64-linux-gnu/libjemalloc.so.2 /usr/lib/x86_64-linux-gnu/libjemalloc.so.2 \
      /usr/lib64/libjemalloc.so.2 /usr/local/lib/libjemalloc.so.2; do
      if [[ -f $candidate ]]; then
        jemalloc=$candidate
        break
      fi
    done
    [[ -n $jemalloc ]] || echo "note: jemalloc not found (apt install libjemalloc2 / yum install jemalloc); glibc malloc" >&2
  fi
  if [[ -n $jemalloc && :${LD_PRELOAD:-}: != *:$jemalloc:* ]]; then
    # what: jemalloc as the host malloc of every process started from this shell (Ray, its workers, vLLM's).
    # why: verl's NPU GSPO practice guide: glibc's arenas keep the host memory of long RL runs (weights offloaded
    #   every step, data batches) and Ray's memory monitor then kills workers; jemalloc returns it to the OS.
    #   Absent: a note, not an error (nothing breaks without it); `gspo-ascend doctor` reports it as missing.
    # source: glibc ld.so(8) LD_PRELOAD; the paths: gspo_ascend/npu_profile.py JEMALLOC_PATHS (a test keeps them
    #   equal); doctor line npu-profile.
    export LD_PRELOAD=$jemalloc${LD_PRELOAD:+:$LD_PRELOAD}
  fi

  # --- network interface: NIC, else the interface of the default route
  [[ -n $nic ]] || nic=$(ip -o -4 route show to default 2>/dev/null | awk '{ print $5; exit }')
  if [[ -z $nic ]]; then
    ((${NNODES:-1} == 1)) && return 0
    echo "error: NIC is unset and there is no default route: set NIC=<interface> for a multi-node run" >&2
    return 1
  fi
  if [[ ! -e /sys/class/net/$nic ]]; then
    echo "error: NIC=$nic is not a network interface of this host (ip -br link lists them)" >&2
    return 1
  fi
  # what: the host NIC HCCL uses to reach the root rank while communicators are set up ("=" = exactly this name).
  # why: left to itself HCCL may pick a docker bridge or lo, and ranks on other nodes never connect (EI0006).
  # source: CANN envref HCCL_SOCKET_IFNAME; doctor rule env:HCCL_SOCKET_IFNAME.
  export HCCL_SOCKET_IFNAME="=$nic"
  # what: the NIC of torch.distributed's gloo groups (CPU-side metadata and barriers next to HCCL).
  # why: the same wrong-interface failure as above, for gloo.
  # source: PyTorch distributed docs (GLOO_SOCKET_IFNAME); doctor rule env:HCCL_SOCKET_IFNAME.
  export GLOO_SOCKET_IFNAME=$nic
}

# CANN's set_env.sh scripts read unset variables: run them without the caller's `set -u`, then restore it.
case $- in *u*) _gspo_nounset=1 ;; *) _gspo_nounset=0 ;; esac
set +u
_gspo_rc=0
_gspo_host_profile || _gspo_rc=$?
if ((_gspo_nounset)); then set -u; fi
unset -f _gspo_host_profile
unset _gspo_nounset
if ((_gspo_rc)); then
  unset _gspo_rc
  return 1
fi
unset _gspo_rc
