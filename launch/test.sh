#!/usr/bin/env bash
# The whole test suite: creates or reuses .venv, installs rlt_mega and its dependencies, runs pytest.
# The 15 slowest tests are listed at the end (the suite has a 15-minute budget, the unit tier 90 s).
# It runs on RLT_TEST_WORKERS pytest-xdist workers (default 2, this machine's cores): each test file
# runs whole on one worker, the distributed files that share their launches on one (tests/conftest.py);
# `-n 0` runs in-process. The files go out in collection order (distributed, e2e, unit), not xdist's
# default of the most tests first: the long launches start first and the many short unit files come
# last, so that neither worker is left alone at the end with a two-minute e2e file.
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
# The documentation's Mermaid, served by the site itself (tools/docs/package-lock.json), and a
# headless Chromium for tests/e2e/test_docs_browser.py, beside the venv and without root
# (tools/docs/install_chromium.sh: Debian's chromium-headless-shell); each installed once.
if [ ! -f tools/docs/node_modules/mermaid/dist/mermaid.min.js ]; then
  command -v npm >/dev/null || { echo "launch/test.sh: npm is needed to install the docs' Mermaid (tools/docs)" >&2; exit 1; }
  npm ci --prefix tools/docs --no-audit --no-fund --loglevel=error
fi
CHROMIUM_DIR="${RLT_CHROMIUM_DIR:-$VENV/chromium}"
if [ -z "${RLT_CHROMIUM:-}" ] && [ ! -x "$CHROMIUM_DIR/usr/lib/chromium/chromium-headless-shell" ]; then
  bash tools/docs/install_chromium.sh "$CHROMIUM_DIR"
fi
export RLT_CHROMIUM_DIR="$CHROMIUM_DIR"
export PYTHONUNBUFFERED=1  # the log shows progress as it comes (CI writes it to a file)
exec python -m pytest -q -p no:cacheprovider --timeout=900 --durations=15 \
  -n "${RLT_TEST_WORKERS:-2}" --dist loadgroup --no-loadscope-reorder "${@:-tests}"
