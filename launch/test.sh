#!/usr/bin/env bash
# The whole test suite: creates or reuses .venv, installs rlt_mega and its dependencies, runs pytest.
# Extra arguments go to pytest (e.g. `bash launch/test.sh tests/unit/test_model.py -k visibility`);
# `bash launch/test.sh -m unit` runs one tier (unit, distributed, e2e: pytest.ini).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
exec python -m pytest -q -p no:cacheprovider --timeout=900 "${@:-tests}"
