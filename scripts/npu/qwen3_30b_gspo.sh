#!/usr/bin/env bash
# GSPO on Qwen3-30B-A3B (MoE) on 2 x Atlas 800T A2 (8 x Ascend 910B, 64 GB each): Megatron engine (MindSpeed)
# for training, vllm-ascend for rollout. Config: configs/qwen3_30b_a3b_gspo.yaml (TP 4 x PP 2, EP 8, rollout TP 4).
#   head:      MODEL_PATH=/models/Qwen3-30B-A3B DATA_DIR=data/dapo bash scripts/npu/qwen3_30b_gspo.sh [key=value ...]
#   worker(s): NODE_RANK=1 HEAD_ADDR=<head ip> bash scripts/npu/qwen3_30b_gspo.sh
#   check:     bash scripts/npu/qwen3_30b_gspo.sh --dry-run   (config, preflight, memory plan, commands; no hardware)
# Variants: 4 nodes: NNODES=4 ... actor.pipeline_parallel_size=4 data.train_batch_size=512. One node cannot hold
# the training state (18 B/param over 8 x 64 GB: the plan is OOM); on 96 GB GPUs it can (scripts/gpu/).
# Variables, variants and what every step does: docs/launch-scripts.md. Same shape as scripts/gpu/qwen3_30b_gspo.sh.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=../lib/launch.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib/launch.sh"

RUN_NAME=npu-qwen3-30b-a3b-gspo
DEVICE=npu
HARDWARE=atlas-800t-a2
RUNTIME_ENV=env/npu/mc2_env.yaml
HOST_ENV=env/npu/atlas_800t_a2.sh
# MindSpeed's grouped GEMM and RoPE ops are compiled on first use: once per node here, not by 8 ranks in step 1
NODE_PREP=(selftest --device npu --build-ops)
: "${CONFIG:=$REPO/configs/qwen3_30b_a3b_gspo.yaml}"
: "${DATA_DIR:=$REPO/data/dapo}"
: "${NNODES:=2}"
: "${DEVICES_PER_NODE:=8}"

launch "$@"
