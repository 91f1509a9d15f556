# shellcheck shell=bash
# Shared launcher behind scripts/{npu,gpu,cpu}/*.sh. An entry script sets what differs per target (CONFIG,
# DEVICE, HARDWARE, RUNTIME_ENV, HOST_ENV, RUN_NAME and defaults such as NNODES), sources this file and calls
# `launch "$@"`. Every target then runs the same steps:
#   1. settings from environment variables (`--help` lists them) plus dotted overrides (key=value) as arguments;
#   2. the resolved config (`gspo-ascend train --print-config`), the preflight and the memory plan on the target
#      hardware (`gspo-ascend plan --hardware`): a layout that does not fit the node count, or an OOM, stops here;
#   3. --dry-run: print the commands of steps 4-5 and stop (no Ray, no device touched, nothing written);
#   4. source the host profile (env/<target>/*.sh) and start or join the Ray cluster (scripts/lib/ray.sh);
#   5. on the head: wait for every node, then `ray job submit --runtime-env env/<target>/*.yaml -- python -m
#      gspo_ascend.cli train --config ... overrides`, the same overrides that steps 2 checked.
# How this differs from the field launch scripts (verl, MindSpeed-RL examples): no `pkill -9 python` or
# `ray stop --force` (only what this launcher started is stopped, by PID), the parallel layout is validated against
# the node count before anything starts, and NPU and GPU runs share every line of this file.

LAUNCH_LIB=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$LAUNCH_LIB/../.." && pwd)
LAUNCH_CWD=$PWD # relative paths in the settings are relative to where the user launched from
# shellcheck source-path=SCRIPTDIR source=../lib/ray.sh
source "$LAUNCH_LIB/ray.sh"

DRY_RUN=0
USER_OVERRIDES=()
OVERRIDES=()
MAKE_MODEL=() # gspo-ascend command that builds MODEL_PATH when it is missing (the CPU miniature's tiny model)
MAKE_DATA=()  # gspo-ascend command that writes $DATA_DIR/train.parquet when it is missing (its synthetic task)
# gspo-ascend command every node runs once after its host profile and before Ray starts its workers (the NPU MoE
# scripts: MindSpeed's JIT ops, built by one process instead of by the node's 8 ranks at the first forward)
NODE_PREP=()
# Keys the launcher owns, and the variable that sets each: it waits for NNODES nodes and makes paths absolute (Ray
# uploads the repository as the job's working_dir, so a relative path would point into that temporary copy).
declare -A OWNED_KEYS=([trainer.nnodes]=NNODES [trainer.devices_per_node]=DEVICES_PER_NODE
  [trainer.device]="the script's DEVICE" [trainer.output_dir]=OUTPUT_DIR [model.path]=MODEL_PATH
  [data.train_files]="TRAIN_FILES or DATA_DIR" [data.val_files]=VAL_FILES
  [rollout_pool.devices_per_node]=ROLLOUT_DEVICES_PER_NODE [rollout_pool.nnodes]=NNODES)

say() { printf '%s\n' "$*"; }
section() { printf '\n== %s\n' "$*"; }
die() {
  printf 'error: %s\n' "$*" >&2
  exit 2
}
# A command as it can be pasted into a shell.
show() {
  printf '+'
  printf ' %q' "$@"
  printf '\n'
}
run() {
  show "$@"
  ((DRY_RUN)) || "$@"
}
cli() { "$PYTHON" -m gspo_ascend.cli "$@"; }

usage() {
  cat <<EOF
usage: bash ${0#"$REPO"/} [--dry-run] [key=value ...]

GSPO with ${CONFIG#"$REPO"/} on $HARDWARE (trainer.device=$DEVICE).
Dotted overrides (key=value) change the config. --dry-run resolves the config, runs the preflight and the
memory plan, prints the commands and starts nothing.

Environment (current value):
  MODEL_PATH=${MODEL_PATH:-<model.path of the config>}  local HF model directory
  DATA_DIR=${DATA_DIR:-}  holds train.parquet (gspo-ascend prepare-data); TRAIN_FILES / VAL_FILES: comma lists
  OUTPUT_DIR=${OUTPUT_DIR:-$REPO/runs/$RUN_NAME}  checkpoints and metrics (shared storage on multi-node)
  NNODES=${NNODES:-1} DEVICES_PER_NODE=${DEVICES_PER_NODE:-8} NODE_RANK=${NODE_RANK:-0}  rank 0 = head
  ROLLOUT_DEVICES_PER_NODE=${ROLLOUT_DEVICES_PER_NODE:-0}  a rollout pool's devices on every node (0 = colocated)
  HEAD_ADDR=${HEAD_ADDR:-<this host>}  head address (required on workers) RAY_PORT=${RAY_PORT:-6379}
  DASHBOARD_PORT=${DASHBOARD_PORT:-8265} JOB_ADDRESS=${JOB_ADDRESS:-http://127.0.0.1:<DASHBOARD_PORT>}
  NIC=${NIC:-<default route>}  network interface for HCCL / NCCL / gloo (host profile)
  PYTHON=${PYTHON:-<.venv/bin/python or python3>} WAIT_TIMEOUT=${WAIT_TIMEOUT:-900}
  also CONFIG, RAY_TMPDIR, RAY_START_ARGS, RAY_POLL_S, ASCEND_ROOT: see docs/launch-scripts.md
EOF
}

parse_args() {
  local arg key
  for arg in "$@"; do
    case $arg in
      --dry-run) DRY_RUN=1 ;;
      -h | --help)
        usage
        exit 0
        ;;
      *=*)
        key=${arg%%=*}
        if [[ -n ${OWNED_KEYS[$key]+set} ]]; then
          die "override '$arg': the launcher sets $key from ${OWNED_KEYS[$key]}; set that instead"
        fi
        USER_OVERRIDES+=("$arg")
        ;;
      *) die "unknown argument '$arg'; pass --dry-run, --help or dotted overrides such as rollout.n=16" ;;
    esac
  done
}

abs_path() {
  if [[ -z $1 || $1 == /* ]]; then printf '%s' "$1"; else printf '%s/%s' "$LAUNCH_CWD" "$1"; fi
}

# "a,b" -> "['/abs/a','/abs/b']": quoted items so that OmegaConf reads any path as one string.
as_list() {
  local items=() item
  IFS=, read -r -a items <<<"$1"
  local out=""
  for item in "${items[@]}"; do
    [[ -n $item ]] && out+="${out:+,}'$(abs_path "$item")'"
  done
  printf '[%s]' "$out"
}

node_ip() {
  local ip=""
  if [[ -n ${NIC:-} ]] && command -v ip >/dev/null; then
    ip=$(ip -4 -o addr show dev "$NIC" 2>/dev/null | awk '{ split($4, a, "/"); print a[1]; exit }')
  fi
  [[ -n $ip ]] || ip=$(hostname -I 2>/dev/null | awk '{ print $1 }')
  printf '%s' "${ip:-127.0.0.1}"
}

check_int() {
  [[ ${!1} =~ ^[0-9]+$ ]] || die "$1='${!1}' must be a non-negative integer"
}

resolve_settings() {
  local name
  : "${NNODES:=1}" "${DEVICES_PER_NODE:=8}" "${NODE_RANK:=0}" "${RAY_PORT:=6379}" "${DASHBOARD_PORT:=8265}"
  : "${WAIT_TIMEOUT:=900}" "${ROLLOUT_DEVICES_PER_NODE:=0}"
  for name in NNODES DEVICES_PER_NODE ROLLOUT_DEVICES_PER_NODE NODE_RANK RAY_PORT DASHBOARD_PORT WAIT_TIMEOUT; do
    check_int "$name"
  done
  # Every node runs this same script, so a rollout pool shares every node with the trainer pool: each node gives Ray
  # both pools' devices (the two placement groups then split them; docs/disaggregated.md)
  NODE_DEVICES=$((DEVICES_PER_NODE + ROLLOUT_DEVICES_PER_NODE))
  ((NNODES >= 1 && NODE_RANK < NNODES)) || die "NODE_RANK=$NODE_RANK must be in 0..$((NNODES - 1)) (NNODES=$NNODES)"
  if [[ -z ${PYTHON:-} ]]; then
    PYTHON=python3
    [[ -x $REPO/.venv/bin/python ]] && PYTHON=$REPO/.venv/bin/python
  fi
  PYTHON=$(command -v "$PYTHON") || die "PYTHON: no such interpreter; set PYTHON=/path/to/python"
  RAY_BIN=$(dirname "$PYTHON")/ray
  [[ -x $RAY_BIN ]] || RAY_BIN=ray
  CONFIG=$(abs_path "$CONFIG")
  [[ -f $CONFIG ]] || die "CONFIG=$CONFIG does not exist"
  MODEL_PATH=$(abs_path "${MODEL_PATH:-}")
  DATA_DIR=$(abs_path "${DATA_DIR:-}")
  [[ -n ${TRAIN_FILES:-} || -z $DATA_DIR ]] || TRAIN_FILES=$DATA_DIR/train.parquet
  OUTPUT_DIR=$(abs_path "${OUTPUT_DIR:-$REPO/runs/$RUN_NAME}")
  ROLE="head"
  ((NODE_RANK == 0)) || ROLE="worker"
  if [[ -z ${HEAD_ADDR:-} ]]; then
    [[ $ROLE == head ]] || die "NODE_RANK=$NODE_RANK is a worker: set HEAD_ADDR to the head node's address"
    HEAD_ADDR=127.0.0.1
    ((NNODES == 1)) || HEAD_ADDR=$(node_ip)
  fi
  JOB_ADDRESS=${JOB_ADDRESS:-http://127.0.0.1:$DASHBOARD_PORT}
  RAY_LOG=$OUTPUT_DIR/launch/ray-$ROLE-$(hostname 2>/dev/null || echo node).log
  # Ray's resource name for the device comes from the device contract (gspo_ascend.device), not a second table.
  RAY_RESOURCE=$("$PYTHON" -c 'import sys; from gspo_ascend import device as d
print({"npu": d.NPU, "cuda": d.CUDA, "cpu": d.CPU}[sys.argv[1]].ray_resource or "CPU")' "$DEVICE") ||
    die "cannot import gspo_ascend with $PYTHON; install the package or set PYTHON"
}

build_overrides() {
  OVERRIDES=("trainer.device=$DEVICE" "trainer.nnodes=$NNODES" "trainer.devices_per_node=$DEVICES_PER_NODE"
    "trainer.output_dir=$OUTPUT_DIR")
  ((ROLLOUT_DEVICES_PER_NODE == 0)) ||
    OVERRIDES+=("rollout_pool.nnodes=$NNODES" "rollout_pool.devices_per_node=$ROLLOUT_DEVICES_PER_NODE")
  [[ -z $MODEL_PATH ]] || OVERRIDES+=("model.path=$MODEL_PATH")
  [[ -z ${TRAIN_FILES:-} ]] || OVERRIDES+=("data.train_files=$(as_list "$TRAIN_FILES")")
  [[ -z ${VAL_FILES:-} ]] || OVERRIDES+=("data.val_files=$(as_list "$VAL_FILES")")
  OVERRIDES+=("${USER_OVERRIDES[@]}")
}

model_missing() { [[ -n $MODEL_PATH && ! -f $MODEL_PATH/config.json ]]; }
data_missing() { [[ -n $DATA_DIR && ! -f $DATA_DIR/train.parquet ]]; }

# Inputs a target builds itself (MAKE_MODEL / MAKE_DATA: the CPU miniature's tiny model and synthetic task).
prepare_inputs() {
  local gspo=("$PYTHON" -m gspo_ascend.cli) model=0 data=0
  ((${#MAKE_MODEL[@]})) && model_missing && model=1
  ((${#MAKE_DATA[@]})) && data_missing && data=1
  ((model + data)) || return 0
  section "inputs built on this machine"
  ((!model)) || run "${gspo[@]}" "${MAKE_MODEL[@]}" --output-dir "$MODEL_PATH"
  ((!data)) || run "${gspo[@]}" "${MAKE_DATA[@]}" --output-dir "$DATA_DIR"
}

check_config() {
  local plan rc=0
  section "resolved config: ${CONFIG#"$REPO"/} + overrides"
  cli train --config "$CONFIG" "${OVERRIDES[@]}" --print-config || die "the config does not resolve (message above)"
  section "preflight and memory plan on $HARDWARE ($NNODES x $NODE_DEVICES)"
  if ((DRY_RUN && ${#MAKE_MODEL[@]})) && model_missing; then
    say "# plan skipped: $MODEL_PATH does not exist yet; a real run builds it first (command above)"
    return 0
  fi
  plan=$(cli plan --config "$CONFIG" "${OVERRIDES[@]}" --hardware "$HARDWARE") || rc=$?
  [[ -z $plan ]] || say "$plan"
  case $rc in
    0) ;;
    1) die "the memory plan is OOM on $HARDWARE: apply one of the knobs above (as overrides) or add nodes" ;;
    *) die "the preflight or the plan rejected this config (message above); nothing was started" ;;
  esac
  if [[ $plan == *"verdict: tight"* ]]; then
    say "warning: the plan is tight on $HARDWARE; the knobs above are the first things to try after an OOM"
  fi
}

# What a real run needs on the head besides the config; a dry run only reports it.
check_inputs() {
  local missing=() file files=()
  model_missing && ((${#MAKE_MODEL[@]} == 0)) && missing+=("MODEL_PATH=$MODEL_PATH (no config.json)")
  [[ -z ${TRAIN_FILES:-} ]] || IFS=, read -r -a files <<<"$TRAIN_FILES"
  ((${#MAKE_DATA[@]} == 0)) || files=() # built by prepare_inputs
  for file in "${files[@]}"; do
    [[ -f $(abs_path "$file") ]] || missing+=("$(abs_path "$file") (gspo-ascend prepare-data writes it)")
  done
  "$PYTHON" -c 'import ray.dashboard.optional_deps' 2>/dev/null ||
    missing+=("Ray's job server for \`ray job submit\`: pip install 'ray[default]' (pinned in requirements-*.txt)")
  ((${#missing[@]})) || return 0
  if ((DRY_RUN)); then
    printf '# note: a real run needs %s\n' "${missing[@]}"
  else
    printf 'error: missing %s\n' "${missing[@]}" >&2
    exit 2
  fi
}

start_node() {
  local what="commands: node rank $NODE_RANK of $NNODES ($ROLE)"
  ((!DRY_RUN)) || what+=", dry run: nothing is started"
  section "$what"
  # shellcheck disable=SC1090  # the host profile is chosen by the entry script
  [[ -z $HOST_ENV ]] || run source "$HOST_ENV"
  # after the profile (CANN's ASCEND_HOME_PATH), before Ray: the workers inherit this environment, so they look in
  # the same torch extensions directory and find the ops built
  if ((${#NODE_PREP[@]})); then
    run "$PYTHON" -m gspo_ascend.cli "${NODE_PREP[@]}" || die "node preparation failed (message above); nothing started"
  fi
  ray_auth
  if [[ $ROLE == worker ]]; then
    ray_worker_join
    return 0
  fi
  ray_head_up
  ray_wait_nodes
  ray_submit "$PYTHON" -m gspo_ascend.cli train --config "$CONFIG" "${OVERRIDES[@]}"
}

on_exit() {
  local rc=$?
  ray_cleanup
  exit "$rc"
}

launch() {
  parse_args "$@"
  resolve_settings
  build_overrides
  cd "$REPO" || die "cannot enter $REPO"
  local pools=""
  ((ROLLOUT_DEVICES_PER_NODE == 0)) || pools=" ($DEVICES_PER_NODE trainer + $ROLLOUT_DEVICES_PER_NODE rollout)"
  say "gspo-ascend launch: $RUN_NAME on $HARDWARE, $NNODES node(s) x $NODE_DEVICES $RAY_RESOURCE$pools"
  if [[ $ROLE == head ]]; then
    prepare_inputs
    check_config
    check_inputs
  fi
  trap on_exit EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
  start_node
  ((DRY_RUN)) && say "dry run complete: nothing was started"
  return 0
}
