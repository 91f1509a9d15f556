# shellcheck shell=bash
# Host environment of an NVIDIA H20 node (8 x 96 GB, CUDA 13 wheels). scripts/lib/launch.sh sources it on every
# node before `ray start`: Ray workers inherit the raylet's environment, and a runtime_env cannot pick the NIC.
# By hand:  NIC=<interface> source env/gpu/h20.sh
# Per-job variables are in env/gpu/h20_env.yaml. NPU counterpart: env/npu/atlas_800t_a2.sh (same shape). Every
# value: what, why, source; tests/unit/test_env_profiles.py checks them. Site-specific fabric settings (NCCL_IB_HCA,
# NCCL_IB_GID_INDEX for RoCE) are left to the cluster's own profile: NCCL detects InfiniBand / RoCE by itself.

_gspo_host_profile() {
  local nic=${NIC:-}

  # --- vendor runtime
  # Nothing to source: the CUDA runtime, cuBLAS and NCCL ship inside the torch / vLLM wheels (requirements-gpu.txt);
  # only the NVIDIA driver comes from the host, and nvidia-smi / gspo-ascend doctor check it.
  if ! command -v nvidia-smi >/dev/null; then
    echo "warning: nvidia-smi not found: is the NVIDIA driver installed (or the container started with --gpus)?" >&2
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
  # what: the host NIC NCCL uses for its bootstrap and socket transport ("=" = exactly this name).
  # why: left to itself NCCL may pick a docker bridge or lo, and ranks on other nodes never connect.
  # source: NCCL environment variables (NCCL_SOCKET_IFNAME); counterpart of HCCL_SOCKET_IFNAME on NPU.
  export NCCL_SOCKET_IFNAME="=$nic"
  # what: the NIC of torch.distributed's gloo groups (CPU-side metadata and barriers next to NCCL).
  # why: the same wrong-interface failure as above, for gloo.
  # source: PyTorch distributed docs (GLOO_SOCKET_IFNAME).
  export GLOO_SOCKET_IFNAME=$nic
}

# Keep the caller's shell options as they were (the NPU profile needs this for CANN's scripts; same shape here).
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
