#!/usr/bin/env bash
# Creates or reuses ./.venv and installs rlt_mega with every dependency.
# torch is pinned and installed first: any other version (or an open range) would make
# pip fetch a multi-GB CUDA build; a CPU wheel of exactly 2.13.0 is used where one exists.
# Sourced by launch/demo.sh and launch/test.sh; safe to run repeatedly (a stamp file
# keyed on setup.py and this checkout's path skips the install when nothing changed; a venv
# copied from another checkout re-links its editable install here).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${RLT_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.rlt_mega_installed"
WANT="$( (cat "$ROOT/setup.py"; echo "$ROOT") | sha256sum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  # (this machine's pip config names local index folders that may not exist: drop that noise)
  pip_install() {
    "$VENV/bin/python" -m pip install -q "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
  }
  pip_install "torch==2.13.0"
  pip_install -e "$ROOT[test]"
  "$VENV/bin/python" -c "import torch, megatron.core, deepspeed, transformers, rlt_mega" >/dev/null 2>&1 \
    || { echo "launch/env.sh: the install into $VENV is incomplete:" >&2
         "$VENV/bin/python" -c "import torch, megatron.core, deepspeed, transformers, rlt_mega"; exit 1; }
  echo "$WANT" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
export PYTHONUNBUFFERED=1
