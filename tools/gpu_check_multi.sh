#!/usr/bin/env bash
# The multi-GPU check of rlt_mega, for a machine with 2 to 8 GPUs (a cluster's first node): on
# NCCL, TP=2, PP=2 and DP=2 with ZeRO-1 (and TP=2 x PP=2 with 4 GPUs or more), each under torchrun
# against one process holding the whole model (losses and parameters after two steps), a
# rollout's replay torch.equal to its mu under each layout (fp32, bf16), and the training ring's
# bubble measured with CUDA events (P2P.wait_s over the step). tools/gpu/multi.py is one layout.
# Then GRPO's sampler and learner roles on 2 GPUs (tools/gpu/roles.py: weights broadcast and
# rollouts sent over NCCL), max_staleness 0 and 1 with partial rollouts, against the colocated run
# bit for bit.
# Until this has passed on a node, train.cuda_graphs with parallel.tp > 1 stays refused.
#
#   source launch/env.sh && bash tools/gpu_check_multi.sh [--smoke] [--out FILE]
#
# About 1 minute per layout. One line per layout; the JSON summary goes to --out, by default
# $OUT/gpu_check_multi.json when $OUT is set, else into a fresh temporary directory. --smoke: the
# same layouts on 2 CPU ranks with gloo. Exit status 0 when every layout passed.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python}"
SMOKE=""
RESULT=""
while [ $# -gt 0 ]; do
  case "$1" in
    --smoke) SMOKE="--smoke" ;;
    --out) [ $# -ge 2 ] || { echo "$0: --out needs a file name" >&2; exit 2; }; RESULT="$2"; shift ;;
    *) echo "usage: $0 [--smoke] [--out FILE]" >&2; exit 2 ;;
  esac
  shift
done
if [ -z "$RESULT" ]; then
  if [ -n "${OUT:-}" ]; then RESULT="$OUT/gpu_check_multi.json"; else RESULT="$(mktemp -d)/gpu_check_multi.json"; fi
fi
if [ -n "$SMOKE" ]; then
  GPUS=2
else
  GPUS="$("$PY" -c 'import torch; print(torch.cuda.device_count())')"
  if [ "$GPUS" -lt 2 ]; then
    echo "$0: $GPUS GPU(s) visible; this check needs 2 to 8 (one GPU: tools/gpu_check.sh)" >&2
    exit 2
  fi
fi
LAYOUTS="tp=2:2 pp=2:2 dp=2:2"
[ "$GPUS" -ge 4 ] && LAYOUTS="$LAYOUTS tp=2,pp=2:4"
LAYOUTS="$LAYOUTS roles:2"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
export PYTHONPATH="$ROOT" PYTHONUNBUFFERED=1
ok=1
files=()
for item in $LAYOUTS; do
  layout="${item%%:*}"; nproc="${item##*:}"
  file="$TMP/$(echo "$layout" | tr '=,' '__').json"
  port="$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
  if [ "$layout" = roles ]; then run=("$ROOT/tools/gpu/roles.py"); else run=("$ROOT/tools/gpu/multi.py" --layout "$layout"); fi
  timeout --kill-after=5 240 "$PY" -m torch.distributed.run --nproc_per_node "$nproc" --master_addr 127.0.0.1 \
    --master_port "$port" "${run[@]}" --out "$file" $SMOKE >"$file.log" 2>&1
  rc=$?
  if [ -f "$file" ]; then
    tail -n 1 "$file.log" | grep -E "^$layout: " || echo "$layout: see $file"
    "$PY" -c "import json, sys; sys.exit(0 if json.load(open(sys.argv[1]))['status'] == 'ok' else 1)" "$file" || ok=0
    files+=("$file")
  else
    echo "$layout: failed (exit $rc, no result; last lines:)"; tail -n 5 "$file.log" | sed 's/^/    /'
    ok=0
  fi
done
mkdir -p "$(dirname "$RESULT")"
"$PY" - "$RESULT" "$ok" "${files[@]}" <<'PYEOF'
import json, sys
out, ok, files = sys.argv[1], sys.argv[2] == "1", sys.argv[3:]
layouts = [json.load(open(f)) for f in files]
bubbles = {l["layout"]: [r["ring"]["bubble"] for r in l["ranks"] if "ring" in r] for l in layouts}
json.dump({"ok": ok, "layouts": layouts, "ring_bubble": {k: v for k, v in bubbles.items() if v}}, open(out, "w"), indent=1)
print(f"gpu_check_multi: {'passed' if ok else 'FAILED'}; ring bubble per stage {({k: v for k, v in bubbles.items() if v})}; JSON: {out}")
PYEOF
[ "$ok" = 1 ]
