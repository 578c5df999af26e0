#!/usr/bin/env bash
# The CPU demo: creates or reuses .venv, then pretrains a tiny RLT on generated arithmetic
# word problems (GSM8K format) for a few minutes, showing the loss fall.
# Extra arguments are config overrides (e.g. `bash launch/demo.sh train.steps=100`).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
RUN=runs/demo
rm -rf "$RUN"
echo "== pretraining a tiny RLT on generated arithmetic problems (TensorBoard logs: $RUN/tb)"
rlt-mega pretrain --config configs/tiny_cpu.yaml checkpoint.dir=$RUN/ckpt logging.dir=$RUN/tb "$@"
python - "$RUN/tb" <<'PY'
import sys
from rlt_mega.metrics import read_metrics
rows = read_metrics(sys.argv[1])
train = [(r["step"], r["train/loss"]) for r in rows if "train/loss" in r]
evals = [(r["step"], r["eval/loss"]) for r in rows if "eval/loss" in r]
print("\nstep  train loss")
for step, loss in train[:: max(1, len(train) // 10)] + [train[-1]]:
    print(f"{step:4d}  {loss:.3f}")
print("eval loss:", ", ".join(f"step {s}: {l:.3f}" for s, l in evals))
PY
echo "TensorBoard: tensorboard --logdir $RUN/tb"
