# shellcheck shell=bash
# Ray cluster lifecycle for scripts/lib/launch.sh: start the head or join it, wait until every node has joined,
# submit the training job, and on exit stop only what this launcher started.
#
# How we stop things, and why it differs from the field scripts (which begin with `pkill -9 python` and
# `ray stop --force`): we run `ray start ... --block` in the background and keep its PID. On exit we SIGTERM that
# PID and Ray tears down exactly the processes that command spawned (gcs_server, raylet, dashboard, workers).
# We never call `ray stop`, which stops every Ray process of this user on the host, including clusters and jobs
# that are not ours. A cluster that was already running is used as is and left running; the job we submitted is
# stopped by its submission id if we are interrupted.
#
# Reads: DRY_RUN, NNODES, NODE_DEVICES (a node's devices: both pools'), DEVICES_PER_NODE and
# ROLLOUT_DEVICES_PER_NODE (the two pools' shares of them), HEAD_ADDR, RAY_PORT, DASHBOARD_PORT,
# WAIT_TIMEOUT, RAY_BIN, RAY_RESOURCE, RAY_LOG, JOB_ADDRESS, RUNTIME_ENV, RUN_NAME and the optional RAY_TMPDIR
# (Ray's --temp-dir), RAY_START_ARGS (extra `ray start` arguments), RAY_POLL_S (seconds between checks); uses say /
# show / die.

RAY_STARTED_PID=""  # the `ray start --block` process this launcher started, if any
RAY_MARKER=${RAY_TMPDIR:-/tmp/ray}/ray_current_cluster # Ray's "latest cluster" file; ray.init("auto") follows it
RAY_MARKER_OURS=""  # its content once our head was up: removed on exit when still ours (a stale one misleads)
JOB_ID=""           # submission id of the job this launcher submitted and that may still be running

ray_cli() { "$RAY_BIN" "$@"; }

# Whether anything accepts a TCP connection at host:port ($1), in at most 2 s. `ray status` against an address
# where nothing listens retries for ~40 s before it gives up (Ray 2.60 on the CI box): probing the port first
# makes "no cluster yet" (every fresh launch) and "GCS not up yet" (the first polls after `ray start`) instant.
port_listens() {
  local host=${1%:*} port=${1##*:}
  timeout 2 bash -c 'exec 3<>"/dev/tcp/$0/$1"' "$host" "$port" 2>/dev/null
}

ray_answers() { port_listens "$1" && ray_cli status --address="$1" >/dev/null 2>&1; }

# "<alive nodes> <total of resource $2>" parsed from `ray status` (the GCS answers it without the dashboard).
ray_nodes_and_devices() {
  port_listens "$1" || { echo "0 0"; return 0; }
  ray_cli status --address="$1" 2>/dev/null | awk -v res="$2" '
    /^Active:/ { active = 1; next }
    /^(Pending|Recent failures):/ { active = 0 }
    active && /node_/ { nodes++ }
    $2 == res && $1 ~ /\// { split($1, used_total, "/"); total = used_total[2] }
    END { printf "%d %d\n", nodes, total }'
}

# Ray >= 2.5x authenticates clients with a token when one exists; a head started with a token and a `ray status`
# without it disagree ("InvalidAuthToken"), so token mode is set explicitly for every Ray command we run.
ray_auth() {
  export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}
  [[ $RAY_AUTH_MODE == token ]] || return 0
  if ((!DRY_RUN)) && ! ray_cli get-auth-token --help >/dev/null 2>&1; then
    return 0 # a Ray without token authentication: nothing to set up
  fi
  if [[ -n ${RAY_AUTH_TOKEN:-} || -s ${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token} ]]; then
    return 0
  fi
  if ((NNODES > 1)); then
    local fix="run \`ray get-auth-token --generate >/dev/null\` once, copy ~/.ray/auth_token to every node (or"
    fix+=" export RAY_AUTH_TOKEN=<token> on each)"
    ((DRY_RUN)) || die "a multi-node Ray cluster needs the same token on every node: $fix, then relaunch"
    say "# note: no Ray token on this node yet; a multi-node cluster needs the same one everywhere: $fix"
    return 0
  fi
  say "# no Ray token yet on this single node: create one (~/.ray/auth_token; never printed)"
  show "$RAY_BIN" get-auth-token --generate
  ((DRY_RUN)) || ray_cli get-auth-token --generate >/dev/null
}

ray_start_bg() {
  show "$RAY_BIN" "$@"
  say "#   ^ in the background, output to $RAY_LOG; its PID is kept so that exactly this node is stopped on exit"
  ((DRY_RUN)) && return 0
  mkdir -p "$(dirname "$RAY_LOG")"
  "$RAY_BIN" "$@" >"$RAY_LOG" 2>&1 &
  RAY_STARTED_PID=$!
}

# `ray start` arguments of this node: the device count, RAY_TMPDIR (Ray accepts --temp-dir on the head only), then
# RAY_START_ARGS (last, so that a user's value of the same option wins). With a rollout pool the node also gives
# each pool its share as a resource of its own (gspo_trainer_pool, gspo_rollout_pool: gspo_ascend/placement.py):
# each pool's bundles ask for one, so Ray puts DEVICES_PER_NODE trainer and ROLLOUT_DEVICES_PER_NODE rollout ranks
# on every node, the split the config describes. Without them PACK fills the first node with the trainer's bundles.
ray_node_args() {
  local custom=()
  case $RAY_RESOURCE in
    GPU) printf '%s\n' "--num-gpus=$NODE_DEVICES" ;;
    CPU) ;; # Ray counts the host's CPUs itself
    *) custom+=("\"$RAY_RESOURCE\":$NODE_DEVICES") ;;
  esac
  if ((${ROLLOUT_DEVICES_PER_NODE:-0} > 0)); then
    custom+=("\"gspo_trainer_pool\":$DEVICES_PER_NODE" "\"gspo_rollout_pool\":$ROLLOUT_DEVICES_PER_NODE")
  fi
  # one --resources: Ray keeps only the last of several
  ((${#custom[@]} == 0)) || (IFS=,; printf '%s\n' "--resources={${custom[*]}}")
  [[ -z ${RAY_TMPDIR:-} || $1 != head ]] || printf '%s\n' "--temp-dir=$RAY_TMPDIR"
  local extra=()
  read -r -a extra <<<"${RAY_START_ARGS:-}"
  ((${#extra[@]} == 0)) || printf '%s\n' "${extra[@]}"
}

ray_head_up() {
  local gcs="$HEAD_ADDR:$RAY_PORT" node_args
  if ((!DRY_RUN)) && ray_answers "$gcs"; then
    say "# a Ray cluster already answers at $gcs: used as is and left running (this launcher did not start it)"
    return 0
  fi
  ((DRY_RUN)) && say "# start a Ray head, unless a cluster already answers at $gcs (then it is used and left running)"
  mapfile -t node_args < <(ray_node_args head)
  # The dashboard (Ray's job server) listens on 127.0.0.1 only: jobs are submitted from this node, and an open
  # job server lets anyone who reaches the port run code on the cluster.
  ray_start_bg start --head --port="$RAY_PORT" --node-ip-address="$HEAD_ADDR" --include-dashboard=true \
    --dashboard-host=127.0.0.1 --dashboard-port="$DASHBOARD_PORT" --disable-usage-stats --block "${node_args[@]}"
}

ray_wait_nodes() {
  local gcs="$HEAD_ADDR:$RAY_PORT" want=$((NNODES * NODE_DEVICES)) start=$SECONDS nodes=0 devices=0
  say "# wait until $NNODES node(s) with $want $RAY_RESOURCE in total have joined $gcs (timeout ${WAIT_TIMEOUT}s)"
  ((DRY_RUN)) && return 0
  while :; do
    if [[ -n $RAY_STARTED_PID ]] && ! kill -0 "$RAY_STARTED_PID" 2>/dev/null; then
      RAY_STARTED_PID=""
      die "\`ray start\` exited; see $RAY_LOG"
    fi
    read -r nodes devices < <(ray_nodes_and_devices "$gcs" "$RAY_RESOURCE")
    if ((nodes >= NNODES)) && { [[ $RAY_RESOURCE == CPU ]] || ((devices >= want)); }; then
      say "# cluster ready: $nodes node(s), $devices $RAY_RESOURCE"
      [[ -n $RAY_STARTED_PID && -f $RAY_MARKER ]] && RAY_MARKER_OURS=$(<"$RAY_MARKER")
      return 0
    fi
    if ((SECONDS - start >= WAIT_TIMEOUT)); then
      die "after ${WAIT_TIMEOUT}s only $nodes of $NNODES node(s) ($devices of $want $RAY_RESOURCE) joined $gcs;" \
        "start each worker with NODE_RANK=<1..$((NNODES - 1))> HEAD_ADDR=$HEAD_ADDR and the same script"
    fi
    sleep "${RAY_POLL_S:-10}"
  done
}

ray_worker_join() {
  local gcs="$HEAD_ADDR:$RAY_PORT" start=$SECONDS node_args
  say "# wait until the head answers at $gcs (timeout ${WAIT_TIMEOUT}s)"
  if ((!DRY_RUN)); then
    until ray_answers "$gcs"; do
      ((SECONDS - start < WAIT_TIMEOUT)) || die "no Ray head answered at $gcs within ${WAIT_TIMEOUT}s"
      sleep "${RAY_POLL_S:-10}"
    done
  fi
  mapfile -t node_args < <(ray_node_args worker)
  ray_start_bg start --address="$gcs" --disable-usage-stats --block "${node_args[@]}"
  say "# serve the cluster until the head stops (Ctrl-C takes this node out)"
  ((DRY_RUN)) && return 0
  wait "$RAY_STARTED_PID" || true
  RAY_STARTED_PID=""
}

ray_submit() {
  local rc=0 id
  id="gspo-$RUN_NAME-$(date +%Y%m%d-%H%M%S)"
  show "$RAY_BIN" job submit --address="$JOB_ADDRESS" --submission-id="$id" --runtime-env="$RUNTIME_ENV" -- "$@"
  ((DRY_RUN)) && return 0
  JOB_ID=$id # from here until it ends, an interrupted launcher stops this job (and only this one)
  ray_cli job submit --address="$JOB_ADDRESS" --submission-id="$id" --runtime-env="$RUNTIME_ENV" -- "$@" || rc=$?
  JOB_ID="" # finished (or failed) on its own: nothing left to stop
  return "$rc"
}

ray_cleanup() {
  if [[ -n $JOB_ID ]]; then
    say "# stopping job $JOB_ID (submitted by this launcher)"
    ray_cli job stop --address="$JOB_ADDRESS" "$JOB_ID" >/dev/null 2>&1 || true
  fi
  [[ -n $RAY_STARTED_PID ]] || return 0
  say "# stopping the Ray node this launcher started (PID $RAY_STARTED_PID)"
  kill -TERM "$RAY_STARTED_PID" 2>/dev/null || true
  local waited=0
  while kill -0 "$RAY_STARTED_PID" 2>/dev/null && ((waited < 60)); do
    sleep 1
    waited=$((waited + 1))
  done
  kill -0 "$RAY_STARTED_PID" 2>/dev/null && kill -KILL "$RAY_STARTED_PID" 2>/dev/null
  if [[ -n $RAY_MARKER_OURS && -f $RAY_MARKER && $(<"$RAY_MARKER") == "$RAY_MARKER_OURS" ]]; then
    rm -f "$RAY_MARKER"
  fi
  RAY_STARTED_PID=""
}
