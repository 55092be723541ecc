#!/usr/bin/env bash
# One-shot GPU check of the routed-token permutation kernels, for a lent GPU (e.g. one H200):
#   1. build the CUDA extension in place (fails loudly if it cannot),
#   2. run tests/test_permute.py (CUDA + Triton vs the reference, plus the CPU tests),
#   3. run bench/permute.py over the full shape grid with every backend,
# and leave the log, the test report and the bench table in bench/results/ (and in $OUT when the
# device tool sets it, so they come back). Needs a python with torch (CUDA build), triton, pytest:
# PY=/path/to/python overrides the default (.venv/bin/python, else python3). No network needed.
# Step limits keep the whole run under ~9.5 minutes; a typical run takes 2-4.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PY:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY="$(command -v python3 || command -v python)"; fi
fi
RES="$ROOT/bench/results"
mkdir -p "$RES"
TAG="${TAG:-gpu_$(date -u +%Y%m%d_%H%M%S)}"
LOG="$RES/gpu_check_$TAG.log"
exec > >(tee "$LOG") 2>&1

step() { echo; echo "=== [$(date -u +%H:%M:%S)] $*"; }
status=0
step "environment"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null || echo "nvidia-smi not available"
"$PY" -c "import torch, sys; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'gpu', torch.cuda.is_available() and torch.cuda.get_device_name(0))" \
  || { echo "FATAL: $PY has no working torch"; exit 2; }
git rev-parse --short HEAD 2>/dev/null || true

# Build: CUDA_HOME from nvcc when that directory really is a toolkit (an nvcc wrapper script in
# /usr/local/bin would give /usr/local); otherwise setup.py searches /usr/local/cuda*.
if [ -z "${CUDA_HOME:-}" ] && command -v nvcc >/dev/null; then
  cand="$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")"
  [ -f "$cand/include/cuda_runtime.h" ] && export CUDA_HOME="$cand"
fi
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-8.0;9.0}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
NV_INC="$("$PY" -c 'import nvidia,os;print(os.path.join(list(nvidia.__path__)[0],"cu13/include"))' 2>/dev/null || true)"
[ -n "$NV_INC" ] && [ -d "$NV_INC" ] && export CPATH="$NV_INC${CPATH:+:$CPATH}"
step "build the extension (CUDA_HOME=${CUDA_HOME:-auto} TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST)"
if time XMOD_BUILD_CUDA_EXT=1 timeout 240 "$PY" setup.py -q build_ext --inplace; then
  "$PY" -c "import torch, megatron_xmod._permute_cuda as m; print('extension OK:', m.__file__)" || status=1
else
  echo "BUILD FAILED: tests and bench continue with the Triton and torch backends"; status=1
fi

step "tests/test_permute.py"
time timeout 240 "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_permute.py \
  --junitxml="$RES/gpu_check_${TAG}_tests.xml" -W ignore::DeprecationWarning || status=1

step "bench/permute.py"
# BENCH_ARGS (e.g. "--L 4096 --h 1024") narrows the grid for a quick try.
time timeout 200 "$PY" bench/permute.py --tag "$TAG" ${BENCH_ARGS:-} || status=1

step "done (status $status); results:"
ls -l "$RES" | grep "$TAG"
if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then cp "$RES"/*"$TAG"* "$OUT"/ && echo "copied to \$OUT=$OUT"; fi
exit $status
