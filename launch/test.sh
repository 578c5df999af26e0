#!/usr/bin/env bash
# The whole test suite: creates or reuses .venv, installs rlt_mega and its dependencies, runs pytest.
# The 15 slowest tests are listed at the end (the suite has a 15-minute budget, the unit tier 90 s).
# It runs on RLT_TEST_WORKERS pytest-xdist workers (default 2, this machine's cores): each test file
# runs whole on one worker, the distributed tier on one (tests/conftest.py); `-n 0` runs in-process.
# Extra arguments go to pytest (e.g. `bash launch/test.sh tests/unit/test_model.py -k visibility`);
# `bash launch/test.sh -m unit` runs one tier (unit, distributed, e2e: pytest.ini).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
# verl's own GRPO functions, which tests/unit/test_grpo_toolbox.py compares ours with: its source
# only (verl pins transformers<5.11 and imports ray), beside the venv; tests/verl_reference.py
# loads it and fails when it is missing. The version is tests/verl_reference.py's VERSION.
VERL_DIR="${RLT_VERL_DIR:-$VENV/verl-0.9.1}"
if [ ! -f "$VERL_DIR/verl/trainer/ppo/core_algos.py" ]; then
  python -m pip install -q --no-deps --target "$VERL_DIR" "verl==0.9.1" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
fi
export RLT_VERL_DIR="$VERL_DIR"
exec python -m pytest -q -p no:cacheprovider --timeout=900 --durations=15 \
  -n "${RLT_TEST_WORKERS:-2}" --dist loadgroup "${@:-tests}"
