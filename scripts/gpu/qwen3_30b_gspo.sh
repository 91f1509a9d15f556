#!/usr/bin/env bash
# GSPO on Qwen3-30B-A3B (MoE) on 2 x NVIDIA H20 nodes (8 x 96 GB GPUs each): Megatron engine (megatron-core)
# for training, vLLM for rollout. Config: configs/qwen3_30b_a3b_gspo.yaml (TP 4 x PP 2, EP 8, rollout TP 4).
#   head:      MODEL_PATH=/models/Qwen3-30B-A3B DATA_DIR=data/dapo bash scripts/gpu/qwen3_30b_gspo.sh [key=value ...]
#   worker(s): NODE_RANK=1 HEAD_ADDR=<head ip> bash scripts/gpu/qwen3_30b_gspo.sh
#   check:     bash scripts/gpu/qwen3_30b_gspo.sh --dry-run   (config, preflight, memory plan, commands; no hardware)
# Variants: 4 nodes: NNODES=4 ... actor.pipeline_parallel_size=4 data.train_batch_size=512; 1 node: NNODES=1 ...
# actor.expert_parallel_size=4 (fits on 96 GB GPUs).
# Variables, variants and what every step does: docs/launch-scripts.md. Same shape as scripts/npu/qwen3_30b_gspo.sh.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=../lib/launch.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib/launch.sh"

RUN_NAME=gpu-qwen3-30b-a3b-gspo
DEVICE=cuda
HARDWARE=h20
RUNTIME_ENV=env/gpu/h20_env.yaml
HOST_ENV=env/gpu/h20.sh
: "${CONFIG:=$REPO/configs/qwen3_30b_a3b_gspo.yaml}"
: "${DATA_DIR:=$REPO/data/dapo}"
: "${NNODES:=2}"
: "${DEVICES_PER_NODE:=8}"

launch "$@"
