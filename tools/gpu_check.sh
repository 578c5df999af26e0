#!/usr/bin/env bash
# The GPU check of rlt_mega: at most 6 minutes wall on one H200, time-outs included (the budgets
# below add up to 340 s). Parts run most important first, each in its own subprocess under its
# budget (a killed part is a failure; a part near its deadline stops adding cases and lists the
# ones it did not run): exactness (replay torch.equal to mu), grpo_onpolicy (on-policy ratio
# exactly 1), fused_cuda_graph (train.cuda_graphs captured, deterministic kernels on and off),
# world_of_one (torchrun, NCCL, megatron-core, DeepSpeed ZeRO-1 bf16, checkpoint + exact resume,
# GRPO), sdpa (the model's masked shapes), sync_audit (the row schedule and a dense step against
# stated limits), gradients, qwen2, versions. The figures (bench, bench_loose) run only when
# GPU_CHECK_PARTS names them. tools/gpu_check.py says what each part checks.
#
#   source launch/env.sh && bash tools/gpu_check.sh [--smoke] [--out FILE]
#   GPU_CHECK_PARTS="exactness sdpa" bash tools/gpu_check.sh     # some parts only
#   GPU_CHECK_PARTS="bench bench_loose" bash tools/gpu_check.sh  # the figures (110 s more)
#   GPU_CHECK_PARTS=calibrate bash tools/gpu_check.sh            # the planner's decoder tick, measured (< 3 min)
#
# One line per part (passed / failed (reason) / skipped (why)); the JSON summary goes to --out,
# by default $OUT/gpu_check.json when $OUT is set, else into a fresh temporary directory (never
# the repository), each part's output beside it in gpu_check_logs/. Exit status 0 when no part
# failed.
# --smoke: tiny shapes on whatever device there is (the CPU here), with the smoke budgets: the
# script end to end, the CUDA-only parts reporting "skipped: no CUDA" (tests/e2e/test_gpu_check.py).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python}"
MODE=gpu
RESULT=""
while [ $# -gt 0 ]; do
  case "$1" in
    --smoke) MODE=smoke ;;
    --out) [ $# -ge 2 ] || { echo "$0: --out needs a file name" >&2; exit 2; }; RESULT="$2"; shift ;;
    *) echo "usage: $0 [--smoke] [--out FILE]" >&2; exit 2 ;;
  esac
  shift
done
if [ -z "$RESULT" ]; then
  if [ -n "${OUT:-}" ]; then RESULT="$OUT/gpu_check.json"; else RESULT="$(mktemp -d)/gpu_check.json"; fi
fi
# Seconds per part, start-up (imports, CUDA context) included. H200: 340 s for the default parts,
# each about 1.3x its time measured there (exactness stops adding cases near its deadline):
# exactness 47 s, grpo_onpolicy 19, fused_cuda_graph 41, world_of_one 46, sdpa 8, sync_audit 22,
# gradients 38, qwen2 19, versions 14.
# Smoke: the CPU's (a loaded 2-core machine; tests/e2e/test_gpu_check.py runs them all).
if [ "$MODE" = gpu ]; then
  declare -A BUDGET=([exactness]=55 [grpo_onpolicy]=30 [fused_cuda_graph]=50 [world_of_one]=65 [sdpa]=20
                     [sync_audit]=25 [gradients]=50 [qwen2]=25 [versions]=20 [calibrate]=180 [bench]=60 [bench_loose]=50)
else
  declare -A BUDGET=([exactness]=60 [grpo_onpolicy]=60 [fused_cuda_graph]=75 [world_of_one]=150 [sdpa]=40
                     [sync_audit]=60 [gradients]=60 [qwen2]=75 [versions]=90 [calibrate]=120 [bench]=60 [bench_loose]=60)
fi
PARTS="${GPU_CHECK_PARTS:-exactness grpo_onpolicy fused_cuda_graph world_of_one sdpa sync_audit gradients qwen2 versions}"
for part in $PARTS; do
  [ -n "${BUDGET[$part]:-}" ] || { echo "$0: unknown part '$part' in GPU_CHECK_PARTS (parts: ${!BUDGET[*]})" >&2; exit 2; }
done
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
export GPU_CHECK_TMP="$TMP" PYTHONUNBUFFERED=1
BUDGETS="{"
for part in $PARTS; do
  BUDGETS="$BUDGETS\"$part\": ${BUDGET[$part]},"
  timeout --kill-after=5 "${BUDGET[$part]}" "$PY" "$ROOT/tools/gpu_check.py" --part "$part" --mode "$MODE" \
    --budget "${BUDGET[$part]}" --out "$TMP/$part.json" 2>"$TMP/$part.stderr" >"$TMP/$part.stdout" \
    || { rc=$?; [ -f "$TMP/$part.json" ] || { echo "$part: failed (exit $rc: killed at its ${BUDGET[$part]} s budget or crashed; last stderr:)"; tail -n 3 "$TMP/$part.stderr" | sed 's/^/    /'; }; }
  [ -f "$TMP/$part.json" ] && tail -n 1 "$TMP/$part.stdout"  # the part's line
done
BUDGETS="${BUDGETS%,}}"
mkdir -p "$(dirname "$RESULT")/gpu_check_logs"
for part in $PARTS; do  # each part's output, beside the JSON (what to read when one fails)
  cat "$TMP/$part.stdout" "$TMP/$part.stderr" 2>/dev/null | tail -c 200000 > "$(dirname "$RESULT")/gpu_check_logs/$part.log"
done
"$PY" "$ROOT/tools/gpu_check.py" --summarise "$TMP" --mode "$MODE" --budgets "$BUDGETS" --parts "$PARTS" --out "$RESULT" | tail -n 1
"$PY" -c "import json, sys; sys.exit(0 if json.load(open(sys.argv[1]))['ok'] else 1)" "$RESULT"
