#!/usr/bin/env bash
# GSPO on Qwen3-30B-A3B (MoE) with disaggregated rollout on 2 x Atlas 800T A2 (8 x Ascend 910B, 64 GB each): per
# node 6 NPUs train (Megatron / MindSpeed) and 2 generate (vllm-ascend), one-step-off (rollout_pool.max_staleness=1):
# batch k + 1 generates while batch k trains. Config: configs/qwen3_30b_a3b_gspo_disagg.yaml (trainer 2 x 6: TP 2 x
# PP 6, EP 2; rollout pool 2 x 2: vLLM TP 2; each node gives Ray both shares, so 6 + 2 is where the ranks run).
#   head:      MODEL_PATH=/models/Qwen3-30B-A3B DATA_DIR=data/dapo bash scripts/npu/qwen3_30b_gspo_disagg.sh
#   worker(s): NODE_RANK=1 HEAD_ADDR=<head ip> bash scripts/npu/qwen3_30b_gspo_disagg.sh
#   check:     bash scripts/npu/qwen3_30b_gspo_disagg.sh --dry-run   (config, preflight, memory plan; no hardware)
# Why 4 rollout : 12 trainer: `python benchmarks/step_model.py --preset qwen3-30b-a3b-atlas-2x8` recommends it, and
# it is the only split whose trainer pool fits here (8 training NPUs: OOM, 66.8 GiB of 60.0). The same model
# predicts this run SLOWER than the colocated scripts/npu/qwen3_30b_gspo.sh (~1910 s vs ~1200 s a step: 4 NPUs
# generate a batch in ~1900 s, all 16 in ~1070 s); it is a model, not a measurement: this script is how to
# measure it (docs/disaggregated.md). Same shape as scripts/gpu/qwen3_30b_gspo_disagg.sh.
set -euo pipefail
# shellcheck source-path=SCRIPTDIR source=../lib/launch.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib/launch.sh"

RUN_NAME=npu-qwen3-30b-a3b-gspo-disagg
DEVICE=npu
HARDWARE=atlas-800t-a2
RUNTIME_ENV=env/npu/mc2_env.yaml
HOST_ENV=env/npu/atlas_800t_a2.sh
# MindSpeed's grouped GEMM and RoPE ops are compiled on first use: once per node here, not by 8 ranks in step 1
NODE_PREP=(selftest --device npu --build-ops)
: "${CONFIG:=$REPO/configs/qwen3_30b_a3b_gspo_disagg.yaml}"
: "${DATA_DIR:=$REPO/data/dapo}"
: "${NNODES:=2}"
: "${DEVICES_PER_NODE:=6}"         # the trainer pool's devices on each node
: "${ROLLOUT_DEVICES_PER_NODE:=2}" # the rollout pool's devices on each node

launch "$@"
