#!/usr/bin/env bash
# Creates or reuses ./.venv and installs rlt_mega with every dependency.
# torch is pinned and installed first: any other version (or an open range) would make
# pip fetch a multi-GB CUDA build; a CPU wheel of exactly 2.13.0 is used where one exists.
# Sourced by launch/demo.sh and launch/test.sh; safe to run repeatedly (a stamp file
# keyed on setup.py skips the install when nothing changed).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${RLT_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.rlt_mega_installed"
WANT="$(cat "$ROOT/setup.py" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q "torch==2.13.0"
  "$VENV/bin/python" -m pip install -q -e "$ROOT[test]"
  echo "$WANT" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
export PYTHONUNBUFFERED=1
