#!/usr/bin/env bash
# Distributed pretraining with the DeepSpeed launcher: one node, or the nodes of a hostfile
# (lines "hostname slots=N"; the launcher reaches them with pdsh/ssh and needs the same path
# and environment on each).
#
#   bash launch/deepspeed.sh --config configs/small_cpu.yaml parallel.zero_stage=2
#   HOSTFILE=launch/hostfile.example bash launch/deepspeed.sh --config configs/rlt_48x48.yaml \
#       parallel.tp=8 parallel.pp=4 parallel.zero_stage=1
#
# Every argument goes to `rlt-mega $COMMAND` (default pretrain; COMMAND=sft or grpo for the
# others). NPROC_PER_NODE (one node, no hostfile) defaults
# to the number of GPUs, or 2 on a CPU-only machine. --no_local_rank: rlt-mega reads LOCAL_RANK
# from the environment, as under torchrun.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/launch/env.sh"
cd "$ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
PORT="${MASTER_PORT:-29500}"
if [ -n "${HOSTFILE:-}" ]; then
  exec deepspeed --hostfile "$HOSTFILE" --master_port "$PORT" --no_local_rank --module rlt_mega "${COMMAND:-pretrain}" "$@"
fi
GPUS="$(python -c 'import torch; print(torch.cuda.device_count())')"
NPROC_PER_NODE="${NPROC_PER_NODE:-$([ "$GPUS" -gt 0 ] && echo "$GPUS" || echo 2)}"
exec deepspeed --num_gpus "$NPROC_PER_NODE" --master_port "$PORT" --no_local_rank --module rlt_mega "${COMMAND:-pretrain}" "$@"
