#!/usr/bin/env bash
# GSPO on dense Qwen2.5-3B on 1 x NVIDIA H20 node (8 x 96 GB GPUs): FSDP engine for training,
# vLLM for rollout. Config: configs/qwen25_3b_gspo.yaml, the field layout:
# FSDP over 8 with Ulysses sequence parallel 4 x DP 2, packed micro-batches of 8192 tokens per device, rollout
# TP 2, 16 samples per prompt.
#   run:   MODEL_PATH=/models/Qwen2.5-3B DATA_DIR=data/math bash scripts/gpu/qwen25_3b_gspo.sh [key=value ...]
#   check: bash scripts/gpu/qwen25_3b_gspo.sh --dry-run   (config, preflight, memory plan, commands; no hardware)
# More nodes: NNODES=2 on the head and NODE_RANK=1 HEAD_ADDR=<head ip> on the second node.
# Variables and what every step does: docs/launch-scripts.md. Same shape as scripts/npu/qwen25_3b_gspo.sh.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=../lib/launch.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib/launch.sh"

RUN_NAME=gpu-qwen2.5-3b-gspo
DEVICE=cuda
HARDWARE=h20
RUNTIME_ENV=env/gpu/h20_env.yaml
HOST_ENV=env/gpu/h20.sh
: "${CONFIG:=$REPO/configs/qwen25_3b_gspo.yaml}"
: "${DATA_DIR:=$REPO/data/math}"
: "${NNODES:=1}"
: "${DEVICES_PER_NODE:=8}"

launch "$@"
