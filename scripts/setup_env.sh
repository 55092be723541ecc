#!/usr/bin/env bash
# Creates or refreshes the project venv at .venv/ (idempotent: a second run only checks the stamp).
# Used by README's commands and by .ci/run.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="$ROOT/.venv"
STAMP="$VENV/.xmod-setup-stamp"
want="$(cat requirements/constraints.txt setup.py scripts/setup_env.sh | sha256sum | cut -c1-16)"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && "$VENV/bin/python" -c "import megatron_xmod" 2>/dev/null; then
  echo "[setup] .venv is up to date ($want)"
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  PY="${XMOD_PYTHON:-}"
  if [ -z "$PY" ]; then
    if command -v pyenv >/dev/null 2>&1; then PY="$(PYENV_VERSION=3.12.1 pyenv which python3.12 2>/dev/null || true)"; fi
    [ -n "$PY" ] || PY="$(command -v python3.12 || true)"
  fi
  [ -n "$PY" ] || { echo "[setup] error: Python 3.12 not found (set XMOD_PYTHON=/path/to/python3.12)" >&2; exit 1; }
  echo "[setup] creating .venv with $PY"
  "$PY" -m venv "$VENV"
fi

PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade pip
# torch first and alone: the pinned CUDA wheel of PyPI (runs on CPU when no GPU is present).
"${PIP[@]}" install -q -c requirements/constraints.txt torch
"${PIP[@]}" install -q -c requirements/constraints.txt -e ".[train,export,scaling,test]" ninja
echo "$want" > "$STAMP"
echo "[setup] .venv ready"
