#!/usr/bin/env bash
# Runs every benchmark in tools/bench once, one after another (never two at a time: on a
# 2-core machine they would time each other), in quick settings that keep the whole run under
# 10 minutes on this CPU; each prints its own table of ratios measured within its run.
# Creates or reuses .venv like launch/test.sh. Extra arguments: the benchmarks to run
# (training pipeline rollout peer rollout_parallel stability check_every; default all; and rollout_rows, learner_rows,
# grpo, grpo_sampling, data, sft_packing, compiled_step, env_rollout, async_grpo, lora).
# GSM8K_DIR: a directory holding GSM8K's train.jsonl (default data/gsm8k) for the GSM8K-shaped ones.
#
#     bash tools/bench/all.sh                 # everything, ~10 minutes on 2 CPU cores
#     bash tools/bench/all.sh training        # one of them
# Each writes its results to docs/bench/NAME.json (--json); docs/performance.md is re-rendered from them.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../../launch/env.sh"
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=1  # multi-process benchmarks: one thread per rank

run() {  # name, command...
  local name=$1; shift
  echo; echo "==== $name: $*"
  local t0=$SECONDS
  "$@"
  echo "==== $name: $((SECONDS - t0)) s"
}

want() { [[ " ${SELECTED} " == *" $1 "* ]]; }
SELECTED="${*:-training pipeline rollout peer rollout_parallel stability check_every}"
GSM8K="${GSM8K_DIR:-data/gsm8k}"

# The decoder and encoder FLOP rates against the matmul peak, fused and module path; training
# tokens/s fused against module path; activation checkpointing at T=512.
# Memory: no checkpointing against decoder-per-step + encoder-per-layer, one profiled step each,
# two timing rounds (`--modes every_k=8+enc step+enc` adds the cheapest mode, ~90 s more).
want training && run training python tools/bench/training.py --only flops throughput memory --modes step+enc --repeats 2 --json docs/bench/training.json
# The ring bubble: emulated stages and the tiny model; throughput layouts skipped.
want pipeline && run pipeline python tools/bench/pipeline.py --skip-throughput --json docs/bench/pipeline.json
# The deferred-memory speed-up (rollout tokens/s across C), replay/rollout, hybrid/dense (small_cpu, batch 8, 128
# new tokens, with the module path's figures beside the fused step's); the HF generate peer.
want rollout && run rollout python tools/bench/rollout.py --repeats 4 --learner-repeats 2 --json docs/bench/rollout.json
want peer && run peer python tools/bench/peer.py --json docs/bench/peer.json
want rollout_parallel && run rollout_parallel torchrun --nproc_per_node 2 tools/bench/rollout_parallel.py \
  --data "$GSM8K" --quick --json docs/bench/rollout_parallel.json
want stability && run stability python tools/bench/stability.py --steps 40 --lr 1e-3 --json docs/bench/stability.json
# What sampling.check_every costs the row schedule (the plan alone, no model: seconds).
want check_every && run check_every python tools/bench/check_every.py --data "$GSM8K" --json docs/bench/check_every.json
# The row schedule (issue 12; not in the default list: ~5 minutes on one quiet core): shared prompts,
# compaction and slots = rows / 4 against lockstep, 64 GSM8K rows per call (GSM8K_DIR: a directory
# holding GSM8K's train.jsonl, default data/gsm8k).
want rollout_rows && run rollout_rows python tools/bench/rollout_rows.py --data "$GSM8K" --repeats 1 \
  --json docs/bench/rollout_rows.json
# The learner's dense schedule following the data against the padded one (2 x 8 rows).
want learner_rows && run learner_rows python tools/bench/learner_rows.py --data "$GSM8K" --quick \
  --json docs/bench/learner_rows.json
# A whole GRPO step (generate, replay, update), every issue-12 switch on against off (not in the default
# list: ~10 minutes of CPU time at 2 x 64 rows; the same GSM8K directory).
want grpo && run grpo python tools/bench/grpo.py --data "$GSM8K" --repeats 1 --json docs/bench/grpo.json
# GRPO seconds per step with DAPO's dynamic sampling off and on (tiny model, 2 timed steps).
want grpo_sampling && run grpo_sampling python tools/bench/grpo_sampling.py --steps 2 --json docs/bench/grpo_sampling.json
# Pretraining data (issue 18; not in the default list: ~6 minutes on 200 MB): preprocess MB/s with
# 1 and 2 workers, start-up time and peak RSS of the indexed against the in-memory path.
want data && run data python tools/bench/data.py --json docs/bench/data.json
# Packed SFT (issue 14; not in the default list: ~3 minutes): tokens/s of 32 GSM8K pairs packed into rows of 1024
# against one pair a row.
want sft_packing && run sft_packing python tools/bench/sft_packing.py --pairs 32 --seq-len 1024 --repeats 2 \
  --json docs/bench/sft_packing.json
# Compiling the fused decoder step with torch.compile (minutes of compilation; one round).
want compiled_step && TORCHINDUCTOR_COMPILE_THREADS=1 run compiled_step python tools/bench/compiled_step.py --repeats 1 \
  --json docs/bench/compiled_step.json
# What a calculator environment costs a GRPO rollout and its replay (issue 28).
want env_rollout && run env_rollout python tools/bench/env_rollout.py --data "$GSM8K" --json docs/bench/env_rollout.json
# Asynchronous GRPO, max_staleness 1 against 0 on two processes (issue 29; tiny, 3 steps).
want async_grpo && run async_grpo python tools/bench/async_grpo.py --quick --json docs/bench/async_grpo.json
# LoRA against full fine-tuning: SFT and GRPO steps, the planner's memory (issue 30).
want lora && run lora python tools/bench/lora.py --repeats 1 --seq-len 64 --json docs/bench/lora.json
python tools/docs/render_performance.py  # docs/performance.md from docs/bench/*.json
echo; echo "==== all: $SECONDS s"
