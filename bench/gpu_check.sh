#!/usr/bin/env bash
# One prepared GPU run (issue 15), at most 9 minutes on a bare GPU machine (Python 3.12, torch with
# CUDA, Triton, nvcc, compute-sanitizer; no megatron, no network):
#   env       versions and the card                                  -> $OUT/env.txt
#   wheels    pip install --no-index --find-links $WHEELS (megatron-core, numpy, pytest and its deps)
#   build     csrc/ -> megatron_xmod/_permute_cuda (setup.py build_ext --inplace)
#   tests     GPU tests: CUDA and native Triton kernels vs the torch reference (incl. L=32768, b=8,
#             h=8192 bf16), the fused routing step, its CUDA-graph capture, the HF fixed-shape decode's
#             CUDA graph (no host read in a replayed step, the default path's tokens)  -> $OUT/tests.xml
#   memcheck  compute-sanitizer --tool memcheck on a small case (bench/permute.py --sanitize-case)
#   racecheck compute-sanitizer --tool racecheck on the same case
#   permute   bench/permute.py: kernel-only timing vs copy, bf16/fp16/fp32  -> $OUT/permute_gpu.*
#   ops       bench/ops.py: kernel launches of a routed vs a dense layer    -> $OUT/ops_gpu.*
#   host      bench/host_overhead.py: host us per layer call and per launch at h=64, the step model,
#             eager vs CUDA-graph fwd+bwd of Dense and A3K16 (a failed capture's error is a result),
#             one step of each under torch.profiler at 298m, L=32768 (host vs device time)
#                                                                         -> $OUT/host_overhead_gpu.*
#   generate  bench/generate.py: prefill / decode tokens/s of the HF models, h=512, prompts 256 and 2048,
#             batch 1 and 8, 32 new tokens, the default decode and the fixed-shape one (one CUDA graph
#             with an IF node a sparse layer; needs transformers importable)  -> $OUT/generate_cuda_*
#   throughput bench/throughput.py: tokens/s, L=32768, 4 micro-batches a step -> $OUT/throughput_gpu.*
# Every step runs under its own `timeout` (the caps below add up to 538 s) and writes into $OUT as it
# goes, so a run cut off anywhere still returns what finished; $OUT/summary.txt has one line a step.
#
#   bench/gpu_check.sh                 # on the GPU machine ($OUT set by the device tool)
#   bench/gpu_check.sh --cpu           # the same steps end to end at tiny sizes, here (CI)
#   bench/gpu_check.sh --plan          # print the steps and their caps
#   bench/gpu_check.sh --fetch-wheels  # here, with network: the wheels into runs/gpu_wheels (~50 MB)
#   bench/gpu_check.sh --pins          # the carried wheels' pins, one a line
# --cpu runs every step with the GPU machine's packages only: torch, its own requirements and the wheels
# below (bench/gpu_machine_env.py), so that a step importing anything else fails here, not in the GPU window.
# Env: PY (python), OUT (results), WHEELS (wheel folder, default runs/gpu_wheels), GPU_MACHINE_PACKAGES
# (--cpu: 0 = this environment as it is).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

STEPS=(env wheels build tests memcheck racecheck permute ops host generate throughput)
declare -A CAP=([env]=8 [wheels]=30 [build]=75 [tests]=70 [memcheck]=20 [racecheck]=20 [permute]=30 [ops]=15 [host]=65 [generate]=55 [throughput]=150)
WHEEL_PINS=(megatron-core==0.19.2 numpy==2.5.5 pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 packaging==26.4 pygments==2.21.0
  # transformers and what it needs beyond torch's own dependencies (filelock, fsspec, typing-extensions), for
  # the generate step: pip's resolution of transformers==5.24.0 for CPython 3.12 manylinux
  transformers==5.24.0 huggingface-hub==2.4.0 hf-xet==1.8.0 tokenizers==0.23.3 safetensors==0.8.0
  regex==2026.12.2 pyyaml==6.0.4 tqdm==4.70.1 click==8.5.1 typer==0.29.2 rich==15.0.0 markdown-it-py==4.3.0
  mdurl==0.1.2 shellingham==1.5.4 annotated-doc==0.0.7 httpx2==2.17.0 httpcore2==2.17.0 h11==0.16.0
  anyio==4.16.0 idna==3.21 truststore==0.10.5 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
  typing-inspection==0.4.5)
WHEELS="${WHEELS:-$ROOT/runs/gpu_wheels}"

MODE=gpu
CAP_SCALE="${CAP_SCALE:-}"
case "${1:-}" in
  --cpu) MODE=cpu ;;
  --pins) printf '%s\n' "${WHEEL_PINS[@]}"; exit 0 ;;
  --plan)
    total=0
    for s in "${STEPS[@]}"; do echo "$s ${CAP[$s]}"; total=$((total + CAP[$s])); done
    echo "total $total"; exit 0 ;;
  --fetch-wheels)
    mkdir -p "$WHEELS"
    "${PY:-python3}" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d "$WHEELS" "${WHEEL_PINS[@]}" || exit 1
    ls -l "$WHEELS"; du -sh "$WHEELS"; exit 0 ;;
  "") ;;
  *) echo "bench/gpu_check.sh: unknown option '$1'; use --cpu, --plan, --pins or --fetch-wheels" >&2; exit 2 ;;
esac

# --cpu: the caps are the GPU run's; the shared CPU gets CAP_SCALE times them (default 4).
[ -z "$CAP_SCALE" ] && { [ "$MODE" = cpu ] && CAP_SCALE=4 || CAP_SCALE=1; }
PY="${PY:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY="$(command -v python3 || command -v python)"; fi
fi
OUT="${OUT:-$ROOT/bench/results/gpu_check_${MODE}_$(date -u +%Y%m%d_%H%M%S)}"
mkdir -p "$OUT"
if [ "$MODE" = cpu ] && [ "${GPU_MACHINE_PACKAGES:-1}" = 1 ]; then
  # The steps see only what the GPU machine has: torch with its own requirements and the carried wheels
  # (bench/gpu_machine_env.py; GPU_MACHINE_PACKAGES=0 runs them in this environment as it is). The view, links
  # into this environment, lives in a temporary folder of its own, removed at exit (links only).
  VIEW_DIR="$(mktemp -d "${TMPDIR:-/tmp}/xmod_gpu_machine_env.XXXXXX")" || exit 1
  trap 'rm -rf "$VIEW_DIR"' EXIT
  PY="$("$PY" bench/gpu_machine_env.py "$VIEW_DIR" "${WHEEL_PINS[@]}")" || exit 1
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/xmod_triton_cache}"
SUMMARY="$OUT/summary.txt"
echo "gpu_check $MODE $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)" > "$SUMMARY"
status=0

# step NAME CMD...: run CMD under the step's cap, log to $OUT/NAME.log, one summary line.
step() {
  local name="$1"; shift
  local t0=$SECONDS rc cap=$((CAP[$name] * CAP_SCALE))
  echo "=== [$(date -u +%H:%M:%S)] $name (cap $cap s): $*"
  # bash -c: the step may be one of the functions below (exported before the steps run)
  timeout --kill-after=5 "$cap" bash -c '"$@"' _ "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  tail -n 15 "$OUT/$name.log"
  local verdict=ok
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && verdict="TIMEOUT"
  [ $rc -ne 0 ] && [ "$verdict" = ok ] && verdict="FAILED rc=$rc"
  [ $rc -ne 0 ] && status=1
  echo "$name $verdict $((SECONDS - t0))s" | tee -a "$SUMMARY"
}

env_report() {
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null || echo "nvidia-smi: not available"
  "$PY" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'gpu', torch.cuda.is_available() and torch.cuda.get_device_name(0))"
  "$PY" -c "import triton; print('triton', triton.__version__)" || echo "triton: not importable"
  command -v nvcc >/dev/null && nvcc --version | tail -n 2 || echo "nvcc: not found"
  command -v compute-sanitizer >/dev/null && compute-sanitizer --version | tail -n 1 || echo "compute-sanitizer: not found"
  nproc; uptime
}

install_wheels() {
  if "$PY" -c "import megatron.core, pytest, numpy, transformers" 2>/dev/null; then
    echo "megatron-core, pytest, numpy and transformers already importable"; return 0
  fi
  [ -d "$WHEELS" ] || { echo "no wheel folder $WHEELS (make it with --fetch-wheels and carry it)"; return 1; }
  ls -l "$WHEELS"
  "$PY" -m pip install --no-index --find-links "$WHEELS" --no-deps --quiet "$WHEELS"/*.whl
}

build_ext() {
  # CUDA_HOME from nvcc when that directory is a real toolkit (an nvcc wrapper in /usr/local/bin would
  # give /usr/local); otherwise setup.py searches /usr/local/cuda*.
  if [ -z "${CUDA_HOME:-}" ] && command -v nvcc >/dev/null; then
    local cand
    cand="$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")"
    [ -f "$cand/include/cuda_runtime.h" ] && export CUDA_HOME="$cand"
  fi
  local nv_inc
  nv_inc="$("$PY" -c 'import nvidia,os;print(os.path.join(list(nvidia.__path__)[0],"cu13/include"))' 2>/dev/null || true)"
  [ -n "$nv_inc" ] && [ -d "$nv_inc" ] && export CPATH="$nv_inc${CPATH:+:$CPATH}"
  if [ "$MODE" = cpu ]; then  # no GPU here: setup.py runs without compiling; say if the built extension is stale
    XMOD_BUILD_CUDA_EXT=0 "$PY" setup.py -q build_ext --inplace || return 1
    local so
    so="$(ls megatron_xmod/_permute_cuda*.so 2>/dev/null | head -n 1)"
    if [ -z "$so" ]; then echo "no built extension here"
    elif [ -n "$(find csrc -newer "$so")" ]; then echo "$so is older than csrc/: rebuild it (pip install -e .)"
    else echo "$so is up to date with csrc/"; fi
    return 0
  fi
  export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS="${MAX_JOBS:-$(nproc)}"
  XMOD_BUILD_CUDA_EXT=1 "$PY" setup.py -q build_ext --inplace &&
    "$PY" -c "import megatron_xmod._permute_cuda as m; print('extension OK:', m.__file__)"
}

sanitize() {
  local tool="$1"
  if [ "$MODE" = cpu ] || ! command -v compute-sanitizer >/dev/null; then
    echo "compute-sanitizer not run ($MODE mode or not installed)"
    if [ "$tool" = memcheck ]; then  # the case itself, Triton interpreted, once
      TRITON_INTERPRET=1 "$PY" bench/permute.py --device cpu --sanitize-case
    fi
    return
  fi
  compute-sanitizer --tool "$tool" --error-exitcode 3 "$PY" bench/permute.py --sanitize-case
}

export -f env_report install_wheels build_ext sanitize
export MODE PY OUT WHEELS

step env env_report
if [ "$MODE" = gpu ]; then
  step wheels install_wheels
else
  step wheels "$PY" -c "import megatron.core, pytest, numpy; print('megatron-core, pytest, numpy importable; wheels not installed in --cpu mode')"
fi
step build build_ext
if [ "$MODE" = gpu ]; then
  step tests "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_permute.py tests/test_kernels.py \
    tests/test_hf_static_decode.py -k "gpu_" \
    --junitxml="$OUT/tests.xml"
else
  step tests env TRITON_INTERPRET=1 "$PY" -m pytest -q -p no:cacheprovider tests/test_kernels.py \
    -k "triton_interp_matches_reference" --junitxml="$OUT/tests.xml"
fi
step memcheck sanitize memcheck
step racecheck sanitize racecheck
if [ "$MODE" = gpu ]; then
  step permute "$PY" bench/permute.py --out "$OUT" --tag gpu --max-seconds $((CAP[permute] - 15))
  step ops "$PY" bench/ops.py --device cuda --out "$OUT" --tag gpu
  step host "$PY" bench/host_overhead.py --device cuda --graphs --profile-backbone 298m --profile-seq-len 32768 \
    --steps 2 --out "$OUT" --tag gpu
  step generate "$PY" bench/generate.py --device cuda --prompts 256 2048 --batches 1 8 --new-tokens 32 --repeats 1 \
    --fixed-shape --out "$OUT"
  # 4 micro-batches a step here to fit the cap (the paper's protocol, 10, is throughput.py's GPU default)
  step throughput "$PY" bench/throughput.py --num-microbatches 4 --warmup 1 --steps 1 --eval-steps 1 --out "$OUT" --tag gpu
else
  step permute "$PY" bench/permute.py --device cpu --L 256 --h 64 --b 1 2 --dtypes float32 --reps 2 --out "$OUT" --tag cpu
  step ops "$PY" bench/ops.py --paths torch --seq-len 16 --batch 1 --out "$OUT" --tag cpu
  step host "$PY" bench/host_overhead.py --device cpu --models dense mod --activated-depth 9 --hidden-size 32 \
    --seq-len 16 --calls 2 --repeats 1 --steps 1 --graphs --out "$OUT" --tag cpu
  step generate "$PY" bench/generate.py --quick --models dense mod --fixed-shape --out "$OUT"
  step throughput "$PY" bench/throughput.py --tiny --activated-depth 9 --models dense xmod-a4k8 --num-microbatches 2 \
    --out "$OUT" --tag cpu
fi
echo "done: status $status, results in $OUT"; cat "$SUMMARY"
exit $status
