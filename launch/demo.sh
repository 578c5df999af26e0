#!/usr/bin/env bash
# The CPU demo: creates or reuses .venv, then
#   1. writes generated one-step arithmetic problems in GSM8K format (launch/demo_problems.py),
#   2. SFTs a tiny RLT on them (configs/demo_sft.yaml) and exports it,
#   3. runs GRPO from that export (configs/demo_grpo.yaml), rewarded for the correct final
#      answer within a budget of new tokens, with exact replayed log-probabilities,
# and prints the held-out greedy accuracy before, during and after GRPO and the training reward, and
# saves both curves as a PNG beside the TensorBoard logs ($RUN/grpo/curves.png).
# Extra arguments are config overrides for both stages (e.g. `bash launch/demo.sh train.seed=1`);
# SFT_OVERRIDES / GRPO_OVERRIDES (space-separated) go to one stage only; RUN=dir moves the run
# (default runs/demo; it is deleted first); PROBLEMS="--num-train N --num-test M" sizes the data.
# `bash launch/demo.sh --tool` is the tool demo (default RUN=runs/demo_tool): a product plus a number
# whose solutions are written with calculator annotations (<<(896*66)=59136>>59136, demo_problems.py
# --tool), SFT (configs/demo_tool_sft.yaml), GRPO with the calculator environment
# (configs/demo_tool_grpo.yaml), then the final model's held-out greedy accuracy with the tool and
# without it; the PNG also shows the calculator calls per completion.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
# One thread per process: the decoder runs position by position on small matrices, where a
# second thread gains little on a quiet machine and, when other jobs share the cores, makes
# each step many times slower. OMP_NUM_THREADS=2 bash launch/demo.sh on a machine of its own.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# Every variant's start: RUN (default $1; deleted first), the clock, the per-stage overrides and
# the problem sizes from the environment (above), then stage 1, the generated problems
# (demo_problems.py, with the arguments after $1).
start_run() {
  RUN="${RUN:-$1}"
  shift
  rm -rf "$RUN"
  START=$SECONDS
  read -r -a SFT_EXTRA <<< "${SFT_OVERRIDES:-}"
  read -r -a GRPO_EXTRA <<< "${GRPO_OVERRIDES:-}"
  read -r -a PROBLEM_ARGS <<< "${PROBLEMS:-}"
  echo "== 1. generated problems -> $RUN/data"
  python launch/demo_problems.py "$RUN/data" "$@" ${PROBLEM_ARGS[@]+"${PROBLEM_ARGS[@]}"}
}
TOOL=""
if [ "${1:-}" = "--tool" ]; then
  TOOL=_tool
  shift
fi
# `bash launch/demo.sh --async` (default RUN=runs/demo_async): the same SFT, then GRPO with a sampler
# role (docs/guide/demo.md#the-async-demo): two processes under torchrun (launch/torchrun.sh), rank 0
# learning while rank 1 samples the next step; each step learns samples one policy version old
# (max_staleness 1), its ratio taken against the step's replayed starting policy and weighted by
# min(pi_old / mu, 2) (token_tis), at half the synchronous learning rate: the decoupled ratio lets
# each step move as far from its starting policy as a synchronous step does, on samples one
# version older, and at 1e-4 the held-out accuracy trailed by 0.03-0.08 (docs/guide/demo.md).
# `bash launch/demo.sh --distill` (default RUN=runs/demo_distill): on-policy distillation
# (docs/guide/grpo.md#distillation): the demo's model after SFT and GRPO is the teacher (TEACHER=dir
# reuses an export of it instead of training one), a smaller RLT (configs/demo_distill_sft.yaml:
# d_model 64) is SFT'd on the same data, then GRPO from the student's export twice with the same
# steps and seed: alone, and with grpo.teacher (teacher_coef 1: the teacher's per-token reverse KL
# alone; dynamic sampling off, as a group of equal task rewards still carries the teacher's signal); held-out accuracy by step and by wall-clock second for both, beside the teacher's, in
# $RUN/distill.json (docs/guide/grpo.md#distillation). DISTILL_OVERRIDES (space-separated) go to the
# distilled arm only (e.g. DISTILL_OVERRIDES=grpo.teacher_topk=8: the teacher's top-k forward KL).
if [ "${1:-}" = "--distill" ]; then
  shift
  start_run runs/demo_distill
  TEACHER_DIR="${TEACHER:-}"
  if [ -z "$TEACHER_DIR" ]; then
    echo "== 2. the teacher: the demo's SFT then GRPO (configs/demo_sft.yaml, configs/demo_grpo.yaml)"
    rlt-mega sft --config configs/demo_sft.yaml data.train=$RUN/data checkpoint.dir=$RUN/teacher_sft/checkpoints \
      logging.dir=$RUN/teacher_sft/tb "$@" ${SFT_EXTRA[@]+"${SFT_EXTRA[@]}"}
    rlt-mega export $RUN/teacher_sft/checkpoints $RUN/teacher_sft/export
    rlt-mega grpo --config configs/demo_grpo.yaml data.train=$RUN/data train.init_from=$RUN/teacher_sft/export \
      checkpoint.dir=$RUN/teacher/checkpoints logging.dir=$RUN/teacher/tb "$@" ${GRPO_EXTRA[@]+"${GRPO_EXTRA[@]}"}
    rlt-mega export $RUN/teacher/checkpoints $RUN/teacher/export
    TEACHER_DIR=$RUN/teacher/export
  fi
  echo "== 3. the student: a smaller RLT, SFT on the same data (configs/demo_distill_sft.yaml)"
  rlt-mega sft --config configs/demo_distill_sft.yaml data.train=$RUN/data checkpoint.dir=$RUN/student_sft/checkpoints \
    logging.dir=$RUN/student_sft/tb "$@" ${SFT_EXTRA[@]+"${SFT_EXTRA[@]}"}
  rlt-mega export $RUN/student_sft/checkpoints $RUN/student_sft/export
  for ARM in grpo distill; do
    echo "== 4. the student's GRPO: $ARM"
    rlt-mega grpo --config configs/demo_distill_grpo.yaml data.train=$RUN/data train.init_from=$RUN/student_sft/export \
      checkpoint.dir=$RUN/$ARM/checkpoints logging.dir=$RUN/$ARM/tb \
      $( [ $ARM = distill ] && echo grpo.teacher=$TEACHER_DIR grpo.dynamic_sampling=false ${DISTILL_OVERRIDES:-} ) "$@" \
      ${GRPO_EXTRA[@]+"${GRPO_EXTRA[@]}"}
  done
  echo "== 5. the teacher on the held-out problems"
  TEACHER_ACC=$(rlt-mega eval --config configs/demo_grpo.yaml train.init_from=$TEACHER_DIR "$@" \
    --data $RUN/data/test.jsonl --output $RUN/teacher_eval.jsonl | grep -o "greedy accuracy: [0-9.]*" | grep -o "[0-9.]*$")
  python launch/demo_distill_curves.py "$RUN" --teacher-accuracy "$TEACHER_ACC" --json "$RUN/distill.json" --run="--distill $*"
  echo "demo finished in $((SECONDS - START)) s"
  exit 0
fi
GRPO=(rlt-mega grpo)
ASYNC=()
VARIANT=""  # recorded with the curves (docs/demo/*.json: `bash launch/demo.sh $VARIANT...`)
if [ "${1:-}" = "--async" ]; then
  VARIANT="--async "
  GRPO=(env COMMAND=grpo NPROC_PER_NODE=2 bash launch/torchrun.sh)
  ASYNC=(grpo.sampler_replicas=1 grpo.max_staleness=1 grpo.is_correction=token_tis optim.lr=5.0e-5 optim.min_lr=5.0e-6)
  RUN="${RUN:-runs/demo_async}"
  shift
fi
start_run "runs/demo$TOOL" ${TOOL:+--tool}

echo "== 2. SFT of a tiny RLT (TensorBoard logs: $RUN/sft/tb)"
rlt-mega sft --config configs/demo${TOOL}_sft.yaml data.train=$RUN/data checkpoint.dir=$RUN/sft/checkpoints \
  logging.dir=$RUN/sft/tb "$@" ${SFT_EXTRA[@]+"${SFT_EXTRA[@]}"}
python - "$RUN/sft/tb" <<'PY'
import sys
from rlt_mega.metrics import read_metrics
rows = read_metrics(sys.argv[1])
train = [(r["step"], r["train/loss"]) for r in rows if "train/loss" in r]
shown = train[:: max(1, len(train) // 5)] + [train[-1]]
print("SFT answer-token loss:", ", ".join(f"step {s}: {l:.3f}" for s, l in shown))
PY
rlt-mega export $RUN/sft/checkpoints $RUN/sft/export

echo "== 3. GRPO from the SFT model (TensorBoard logs: $RUN/grpo/tb)"
"${GRPO[@]}" --config configs/demo${TOOL}_grpo.yaml data.train=$RUN/data train.init_from=$RUN/sft/export \
  checkpoint.dir=$RUN/grpo/checkpoints logging.dir=$RUN/grpo/tb ${ASYNC[@]+"${ASYNC[@]}"} "$@" ${GRPO_EXTRA[@]+"${GRPO_EXTRA[@]}"}
python launch/demo_curves.py "$RUN/grpo/tb" "$RUN/grpo/curves.png" --json "$RUN/grpo/curves.json" --run="$VARIANT$*"
python - "$RUN/grpo/tb" <<'PY'
import sys
from rlt_mega.metrics import read_metrics
rows = [r for r in read_metrics(sys.argv[1]) if "reward/mean" in r]
print("GRPO step  reward  |ratio-1| vs sampling version  policy change  max|dense-replay|  KL(mu||dense)")
for r in rows[:: max(1, len(rows) // 8)] + [rows[-1]]:
    show = lambda key, width: f"{r[key]:{width}.1e}" if key in r else "-".rjust(width)
    print(f"{r['step']:9d}  {r['reward/mean']:6.3f}  {show('ratio/onpolicy_max_dev', 28)}  "
          f"{show('ratio/policy_change_max_dev', 13)}  {r['mismatch/logprob_diff_max']:17.1e}  "
          f"{r['mismatch/kl_mu_dense']:13.1e}")
PY
if [ ${#ASYNC[@]} -gt 0 ]; then
  python - "$RUN/grpo/tb" <<'PY'
import sys
from rlt_mega.metrics import read_metrics
rows = [r for r in read_metrics(sys.argv[1]) if "async/learner_idle_fraction" in r]
mean = lambda key: sum(r[key] for r in rows) / len(rows)
rho = [(r["is/rho_min"], r["is/rho_max"]) for r in rows if "is/rho_min" in r]
print(f"async: staleness mean {mean('async/staleness_mean'):.2f} (max {max(r['async/staleness_max'] for r in rows):.0f}), "
      f"learner idle {mean('async/learner_idle_fraction'):.1%} and sampler idle {mean('async/sampler_idle_fraction'):.1%} "
      f"of a step (mean of {len(rows)} steps)" + (f"; pi_old / mu from {min(a for a, _ in rho):.3f} to "
                                                   f"{max(b for _, b in rho):.3f}" if rho else ""))
PY
fi
if [ -n "$TOOL" ]; then
  echo "== 4. the final model on the held-out problems, with the calculator and without it"
  for ENV in calculator ""; do
    ACC=$(rlt-mega eval --config configs/demo_tool_grpo.yaml train.init_from= checkpoint.dir=$RUN/grpo/checkpoints \
      grpo.env=$ENV "$@" ${GRPO_EXTRA[@]+"${GRPO_EXTRA[@]}"} --data $RUN/data/test.jsonl \
      --output "$RUN/eval${ENV:+_$ENV}.jsonl" | grep "greedy accuracy")
    echo "${ENV:-no tool}: held-out $ACC"
  done
fi
echo "demo finished in $((SECONDS - START)) s; TensorBoard: tensorboard --logdir $RUN"
