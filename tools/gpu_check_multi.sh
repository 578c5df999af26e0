#!/usr/bin/env bash
# The multi-GPU check of rlt_mega, for a machine with 2 to 8 GPUs (a cluster's first node): on
# NCCL, TP=2, PP=2 and DP=2 with ZeRO-1 (and TP=2 x PP=2 with 4 GPUs or more), each under torchrun
# against one process holding the whole model (losses and parameters after two steps), a
# rollout's replay torch.equal to its mu under each layout (fp32, bf16), and the training ring's
# bubble measured with CUDA events (P2P.wait_s over the step). tools/gpu/multi.py is one layout.
# Then GRPO's sampler and learner roles on 2 GPUs (tools/gpu/roles.py: weights sent and
# rollouts passed over NCCL and the store), max_staleness 0 and 1 with partial rollouts, against
# the colocated run bit for bit; with 4 GPUs or more also their pool form (roles_pool: a learner of
# dp=2 under ZeRO-3 and two sampler replicas, the weights gathered from the partitions and sent in
# buckets over NCCL, the learner's peak of gathered weights at most one bucket).
# Until this has passed on a node, train.cuda_graphs with parallel.tp > 1 stays refused.
#
#   source launch/env.sh && bash tools/gpu_check_multi.sh [--smoke] [--out FILE] [--list GPUS]
#
# About 1 minute per layout. One line per layout; the JSON summary goes to --out, by default
# $OUT/gpu_check_multi.json when $OUT is set, else into a fresh temporary directory. --smoke: the
# same layouts on 2 CPU ranks with gloo. --list GPUS: print the items (layout:processes) a node of
# GPUS GPUs runs, one a line, and exit. Exit status 0 when every layout passed.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python}"
SMOKE=""
RESULT=""
LIST=""
while [ $# -gt 0 ]; do
  case "$1" in
    --smoke) SMOKE="--smoke" ;;
    --out) [ $# -ge 2 ] || { echo "$0: --out needs a file name" >&2; exit 2; }; RESULT="$2"; shift ;;
    --list) [[ $# -ge 2 && "$2" =~ ^[0-9]+$ ]] || { echo "$0: --list needs a number of GPUs" >&2; exit 2; }
            LIST="$2"; shift ;;
    *) echo "usage: $0 [--smoke] [--out FILE] [--list GPUS]" >&2; exit 2 ;;
  esac
  shift
done
layouts() {  # the items a node of $1 GPUs runs
  local items="tp=2:2 pp=2:2 dp=2:2"
  [ "$1" -ge 4 ] && items="$items tp=2,pp=2:4"
  items="$items roles:2"
  [ "$1" -ge 4 ] && items="$items roles_pool:4"
  echo "$items"
}
if [ -n "$LIST" ]; then
  for item in $(layouts "$LIST"); do echo "$item"; done
  exit 0
fi
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
LAYOUTS="$(layouts "$GPUS")"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
export PYTHONPATH="$ROOT" PYTHONUNBUFFERED=1
ok=1
files=()
for item in $LAYOUTS; do
  layout="${item%%:*}"; nproc="${item##*:}"
  file="$TMP/$(echo "$layout" | tr '=,' '__').json"
  port="$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
  case "$layout" in
    roles) run=("$ROOT/tools/gpu/roles.py") ;;
    roles_pool) run=("$ROOT/tools/gpu/roles.py" --pool) ;;
    *) run=("$ROOT/tools/gpu/multi.py" --layout "$layout") ;;
  esac
  limit=240; [ "$layout" = roles_pool ] && limit=480  # two DeepSpeed ZeRO-3 jobs per arm
  timeout --kill-after=5 "$limit" "$PY" -m torch.distributed.run --nproc_per_node "$nproc" --master_addr 127.0.0.1 \
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
