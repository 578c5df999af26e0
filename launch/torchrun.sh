#!/usr/bin/env bash
# Distributed pretraining with torchrun: one node, or several with a c10d rendezvous.
#
#   bash launch/torchrun.sh --config configs/small_cpu.yaml parallel.tp=2 parallel.pp=2
#   NNODES=4 NPROC_PER_NODE=8 RDZV_ENDPOINT=node0:29500 RDZV_ID=job42 \
#       bash launch/torchrun.sh --config configs/rlt_48x48.yaml parallel.tp=8 parallel.pp=4 parallel.zero_stage=1
#
# Every argument goes to `rlt-mega $COMMAND` (a config and dotted overrides; COMMAND defaults to
# pretrain, COMMAND=sft or COMMAND=grpo for the others). Run the same
# command on every node (RDZV_ENDPOINT: host:port of any one of them). NPROC_PER_NODE defaults
# to the number of GPUs, or 2 on a CPU-only machine (gloo). parallel.dp is what is left of the
# world size after tp * pp.
#
# Elastic restarts: MAX_RESTARTS=2 lets torchrun restart the whole group when a rank dies; with
# train.resume=auto the ranks continue from the last checkpoint, bit for bit
# (tests/e2e/test_elastic.py).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/launch/env.sh"
cd "$ROOT"
GPUS="$(python -c 'import torch; print(torch.cuda.device_count())')"
NPROC_PER_NODE="${NPROC_PER_NODE:-$([ "$GPUS" -gt 0 ] && echo "$GPUS" || echo 2)}"
NNODES="${NNODES:-1}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# Without it torchrun's agent keeps one TCPStore for every attempt and restarted ranks read the
# dead ranks' addresses ("Gloo connectFullMesh failed ... Connection refused" or an NCCL init
# failure; pytorch/pytorch#135712). The c10d rendezvous then gives each attempt a fresh store.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
MAX_RESTARTS="${MAX_RESTARTS:-0}"
if [ "$NNODES" -gt 1 ]; then
  : "${RDZV_ENDPOINT:?set RDZV_ENDPOINT=host:port (any node of the job) for a multi-node run}"
  exec torchrun --nnodes "$NNODES" --nproc_per_node "$NPROC_PER_NODE" --max-restarts "$MAX_RESTARTS" --rdzv_backend c10d \
    --rdzv_endpoint "$RDZV_ENDPOINT" --rdzv_id "${RDZV_ID:-rlt_mega}" -m rlt_mega "${COMMAND:-pretrain}" "$@"
fi
exec torchrun --standalone --nproc_per_node "$NPROC_PER_NODE" --max-restarts "$MAX_RESTARTS" -m rlt_mega "${COMMAND:-pretrain}" "$@"
