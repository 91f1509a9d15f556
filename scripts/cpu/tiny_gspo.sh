#!/usr/bin/env bash
# GSPO on the embedded tiny Qwen3 (427k parameters) on this machine's CPU: the miniature of the cluster scripts,
# same launcher and steps (a one-node Ray cluster, `ray job submit` with env/cpu/cpu_env.yaml), no accelerator.
# Config: configs/tiny_gspo.yaml; the tiny model and the synthetic arithmetic data are built on first use.
#   run:   bash scripts/cpu/tiny_gspo.sh [key=value ...]      (Ray's job server, ray[default], is in the CPU lock)
#   check: bash scripts/cpu/tiny_gspo.sh --dry-run
# Variables and what every step does: docs/launch-scripts.md.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=../lib/launch.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib/launch.sh"

RUN_NAME=cpu-tiny-gspo
DEVICE=cpu
HARDWARE=cpu
RUNTIME_ENV=env/cpu/cpu_env.yaml
HOST_ENV=""           # a CPU host needs no vendor environment
MAKE_MODEL=(make-tiny-model)              # built on first use, where the trainer's own default puts it
MAKE_DATA=(prepare-data --kind synthetic) # the synthetic arithmetic task
: "${CONFIG:=$REPO/configs/tiny_gspo.yaml}"
: "${MODEL_PATH:=${GSPO_HOME:-$HOME/.cache/gspo-ascend}/tiny-qwen3}"
: "${DATA_DIR:=${GSPO_HOME:-$HOME/.cache/gspo-ascend}/data/synthetic-v2}" # v2: with the held-out split
: "${VAL_FILES:=$DATA_DIR/test.parquet}" # the held-out problems configs/tiny_gspo.yaml validates on
: "${NNODES:=1}"
: "${DEVICES_PER_NODE:=1}"

launch "$@"
