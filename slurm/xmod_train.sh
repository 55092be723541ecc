#!/bin/bash
# Generic launcher: any model of the X-MoD paper's Table 6 (backbones 165m/298m/556m/936m/1.65b x dense,
# mod, xmod-a4k8, xmod-a3k16, moe-8x64, moe-8x128) on megatron's loop, at equal training compute C.
# Defaults are the paper's headline run (X-MoD A3K16, 1.65B, TP 8, L = 32768, 80 sequences per step,
# Muon Table 5, 1% warmup + cosine to 10%, C = 2.5e20 FLOPs, dropout 0). Named launchers (xmod_1p65b.sh,
# ...) only set defaults and exec this file. See slurm/README.md.
#
#   sbatch --nodes=8 slurm/xmod_train.sh                    # the headline run (DATA=... required)
#   BACKBONE=556m MODEL=moe-8x64 sbatch --nodes=1 slurm/xmod_train.sh
#   DRY_RUN=1 NODES=8 bash slurm/xmod_train.sh              # print the command, validate it, start nothing
#   SMOKE=1 sbatch --wait --gpus-per-node=0 --cpus-per-task=2 slurm/xmod_train.sh   # tiny run on CPU
#
# Environment (default):
#   NODES    nodes (SLURM_JOB_NUM_NODES under sbatch; else 8 for 1.65b, 1 otherwise)
#   NPROC    processes (GPUs) per node (8)        TP  tensor parallel (8 for 1.65b, 1 = DDP otherwise)
#   PP       pipeline parallel (1; > 1 balances stages by cost)  SEQ sequence length (32768)
#   CP       context parallel (1): each sequence split over CP GPUs (megatron's load-balanced layout; SEQ a
#            multiple of 2 x CP, x TP with sequence parallelism); the GPUs of a replica are TP x PP x CP
#   ROUTING_SEGMENTS  --xmod-routing-segments (1): top-k per segment; 2 x CP (or a multiple) gives every CP
#            rank exactly L/(K CP) routed tokens, 1/K of a dense layer's CP traffic (docs/routing.md section 9)
#   GBS      sequences per step (80)              MBS micro-batch size (1)
#   BACKBONE 165m|298m|556m|936m|1.65b (1.65b)    MODEL dense|mod|xmod-a4k8|xmod-a3k16|moe-8x64|moe-8x128|<layout>
#                                                  or <depth>+<moe> (xmod-a4k8+moe-8x64: the MoE in every layer)
#   FLOPS    training compute C (2.5e20); ITERS overrides the iterations derived from it
#   DATA     Megatron .bin/.idx prefix (or a weighted blend "0.5 a 0.5 b"); "mock" = --mock-data
#            (DRY_RUN without DATA validates with --mock-data)
#   SPLIT    train,valid,test split of DATA (99,1,0)
#   TOKENIZER_TYPE   megatron's --tokenizer-type (HuggingFaceTokenizer: GPT-2, the paper's); the dataset's
#            tokenizer, which `xmod preprocess` records in DATA.tokenizer.json, must match (checked before srun):
#            SentencePieceTokenizer for `xmod preprocess --tokenizer sentencepiece`, NullTokenizer for bytes
#   TOKENIZER_MODEL  --tokenizer-model: the HF folder ($ROOT/data/cache/tokenizers/gpt2) or the SentencePiece
#            .model file (TOKENIZER is an older name for it)
#   VOCAB_SIZE --vocab-size (NullTokenizer: the ids as they are; 257 for `xmod preprocess --tokenizer bytes`)
#   RUN_NAME   names the run's folder ($ROOT/runs/RUN_NAME; default MODEL_BACKBONE_L<SEQ>, e.g.
#            xmod-a3k16_1.65b_L32768: one folder per configuration, a resubmission of it resumes)
#   CKPT, TB   checkpoint / tensorboard folders ($ROOT/runs/RUN_NAME/{ckpt,tb}); CKPT is --save and --load
#   EVAL_INTERVAL (500) EVAL_ITERS (20) SAVE_INTERVAL (500) LOG_INTERVAL (10)
#   EXTRA_ARGS extra megatron / --xmod-* flags, appended last (they win)
#   DRY_RUN=1  print the command and run megatron's + the plugin's validation at NODES x NPROC, then exit
#            (and the per-GPU memory estimate: refused above GPU_MEM_GB, default 80); exit 0 when the run
#            would start, 2 with our one-line message (field: why; fix), 1 with megatron's own
#   SMOKE=1    1 node, 2 CPU processes, TP 2, gloo, a tiny X-MoD on the embedded corpus, a few iterations
#   SKIP_DRY_RUN=1  do not validate before srun (a real run validates first, on the batch node)
#   XMOD_ROOT (repository; SLURM_SUBMIT_DIR under sbatch)   XMOD_PY ($XMOD_ROOT/.venv/bin/python)
#   PREEMPT_GRACE  seconds torchrun gives its workers after a second SIGTERM or a failure (240)
#
# Preemption: the run passes --exit-signal-handler. SLURM sends SIGTERM to every process of the job at
# preemption (within its GraceTime) and, with the #SBATCH --signal=TERM@300 below, 300 s before the time
# limit; each worker finishes its iteration, saves a complete checkpoint (manifest included) and exits 0,
# and a resubmission resumes from it. The agent is megatron_xmod.training.torchrun (torchrun's own, but on
# SIGTERM it passes the signal on and waits for its workers, so the step exits 0 however long the save takes).
#SBATCH --job-name=xmod-train
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --exclusive
#SBATCH --time=72:00:00
#SBATCH --output=%x-%j.out
#SBATCH --signal=TERM@300
set -euo pipefail

if [ -n "${XMOD_ROOT:-}" ]; then ROOT="$XMOD_ROOT"
elif [ -n "${SLURM_JOB_ID:-}" ] && [ -n "${SLURM_SUBMIT_DIR:-}" ]; then ROOT="$SLURM_SUBMIT_DIR"  # sbatch copies the script
else ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"; fi
PY="${XMOD_PY:-$ROOT/.venv/bin/python}"
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
die() { echo "[xmod] error: $*" >&2; exit 2; }
[ -x "$PY" ] || die "XMOD_PY: no python at $PY; run scripts/setup_env.sh in $ROOT or set XMOD_PY/XMOD_ROOT"

SMOKE="${SMOKE:-0}"
DRY_RUN="${DRY_RUN:-0}"

if [ "$SMOKE" = 1 ]; then
  # A tiny X-MoD (the demo backbone) on the embedded corpus (SentencePiece 8k), CPU, gloo, TP 2.
  NODES=1; NPROC="${NPROC:-2}"; TP="${TP:-2}"; PP="${PP:-1}"; CP="${CP:-1}"; SEQ="${SEQ:-128}"; MBS="${MBS:-2}"; GBS="${GBS:-4}"
  ITERS="${ITERS:-4}"; EVAL_INTERVAL="${EVAL_INTERVAL:-2}"; EVAL_ITERS="${EVAL_ITERS:-1}"
  SAVE_INTERVAL="${SAVE_INTERVAL:-$ITERS}"; LOG_INTERVAL="${LOG_INTERVAL:-1}"
  RUN_DIR="${SMOKE_DIR:-$ROOT/runs/smoke-${SLURM_JOB_ID:-local}}"
  CKPT="${CKPT:-$RUN_DIR/ckpt}"; TB="${TB:-$RUN_DIR/tb}"
  CORPUS_ARGS=$("$PY" -c 'from megatron_xmod.data.corpus import ensure_default_corpus, megatron_args
print(" ".join(megatron_args(ensure_default_corpus("sentencepiece", progress=False))))') \
    || die "SMOKE: the embedded corpus is not available (run scripts/setup_env.sh)"
  # shellcheck disable=SC2206
  MODEL_ARGS=(--hidden-size 128 --ffn-hidden-size 384 --num-attention-heads 4 --group-query-attention
              --num-query-groups 2 --kv-channels 32 --swiglu --normalization RMSNorm --disable-bias-linear
              --position-embedding-type rope --rotary-base 10000 --untie-embeddings-and-output-weights
              --no-rope-fusion --qk-layernorm --xmod-routing-family xmod --xmod-layout "D*2 + (S4*4 + D)*2")
  # shellcheck disable=SC2206
  DATA_ARGS=($CORPUS_ARGS)
  OPT_ARGS=(--lr 3e-3 --xmod-paper-schedule --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 --seed 1234)
  DEVICE_ARGS=(--distributed-backend gloo --no-gradient-accumulation-fusion --transformer-impl local
               --no-persist-layer-norm --no-create-attention-mask-in-dataloader --use-cpu-initialization
               --no-bias-dropout-fusion --no-bias-swiglu-fusion --no-bias-gelu-fusion)  # nothing compiled on CPU
  DESC="smoke: tiny X-MoD D*2 + (S4*4 + D)*2 on CPU"
else
  BACKBONE="${BACKBONE:-1.65b}"
  MODEL="${MODEL:-xmod-a3k16}"
  case "$BACKBONE" in 1.65b|1p65b) big=1 ;; 165m|298m|556m|936m) big=0 ;;
    *) die "BACKBONE: '$BACKBONE' is not one of 165m 298m 556m 936m 1.65b" ;; esac
  NODES="${SLURM_JOB_NUM_NODES:-${NODES:-$([ $big = 1 ] && echo 8 || echo 1)}}"
  NPROC="${NPROC:-8}"
  TP="${TP:-$([ $big = 1 ] && echo 8 || echo 1)}"
  PP="${PP:-1}"; CP="${CP:-1}"; SEQ="${SEQ:-32768}"; GBS="${GBS:-80}"; MBS="${MBS:-1}"
  FLOPS="${FLOPS:-2.5e20}"
  EVAL_INTERVAL="${EVAL_INTERVAL:-500}"; EVAL_ITERS="${EVAL_ITERS:-20}"
  SAVE_INTERVAL="${SAVE_INTERVAL:-500}"; LOG_INTERVAL="${LOG_INTERVAL:-10}"
  # One folder per configuration: two configurations submitted through this file never load each other's
  # checkpoints (the pre-flight also refuses a checkpoint of another model), a resubmission resumes its own.
  RUN_NAME=$(printf '%s' "${RUN_NAME:-${MODEL}_${BACKBONE}_L${SEQ}}" | tr -c 'A-Za-z0-9._-' '_' | tr -s '_')
  CKPT="${CKPT:-$ROOT/runs/$RUN_NAME/ckpt}"; TB="${TB:-$ROOT/runs/$RUN_NAME/tb}"
  SPLIT="${SPLIT:-99,1,0}"

  # The run's tokenizer: megatron's flags. The pre-flight checks it against DATA's record (xmod preprocess).
  TOKENIZER_TYPE="${TOKENIZER_TYPE:-HuggingFaceTokenizer}"
  TOKENIZER_MODEL="${TOKENIZER_MODEL:-${TOKENIZER:-}}"
  case "$TOKENIZER_TYPE" in
    HuggingFaceTokenizer) TOKENIZER_MODEL="${TOKENIZER_MODEL:-$ROOT/data/cache/tokenizers/gpt2}" ;;
    SentencePieceTokenizer|GPTSentencePieceTokenizer|Llama2Tokenizer|TikTokenizer)
      [ -n "$TOKENIZER_MODEL" ] || die "TOKENIZER_MODEL: TOKENIZER_TYPE=$TOKENIZER_TYPE reads a model file; set TOKENIZER_MODEL=PATH (for xmod preprocess --tokenizer sentencepiece: the .model it trained or read)" ;;
    NullTokenizer)
      [ -n "${VOCAB_SIZE:-}" ] || die "VOCAB_SIZE: TOKENIZER_TYPE=NullTokenizer takes the data's token ids as they are; set VOCAB_SIZE (257 for xmod preprocess --tokenizer bytes)"
      TOKENIZER_MODEL="" ;;
  esac
  TOKENIZER_ARGS=(--tokenizer-type "$TOKENIZER_TYPE")
  if [ -n "$TOKENIZER_MODEL" ]; then TOKENIZER_ARGS+=(--tokenizer-model "$TOKENIZER_MODEL"); fi
  if [ -n "${VOCAB_SIZE:-}" ]; then TOKENIZER_ARGS+=(--vocab-size "$VOCAB_SIZE"); fi

  # MoE baselines are --moe-preset (megatron's MoE layers on the dense backbone), the rest a layout.
  case "$MODEL" in
    moe-*|dtopp-*) MODEL_ARGS=(--xmod-backbone "$BACKBONE" --moe-preset "$MODEL") ;;
    *) MODEL_ARGS=(--xmod-backbone "$BACKBONE" --xmod-model "$MODEL") ;;
  esac

  # Equal-compute budget: iterations = C / (3 x forward FLOPs/token x tokens per step), from the accounting.
  if [ -z "${ITERS:-}" ]; then
    FWD=$("$PY" -m megatron_xmod.cli count --backbone "$BACKBONE" --model "$MODEL" --seq-len "$SEQ" --json \
          | "$PY" -c 'import json,sys; print(json.loads(sys.stdin.readline())["flops_per_token"])') \
      || die "MODEL: the accounting does not know '$MODEL' on backbone $BACKBONE (xmod count --model $MODEL)"
    ITERS=$("$PY" -c "print(max(1, round(float('$FLOPS') / (3 * $FWD * $GBS * $SEQ))))")
    echo "[xmod] $MODEL on $BACKBONE: forward FLOPs/token $FWD, $ITERS iterations for C=$FLOPS"
  fi

  if [ -z "${DATA:-}" ] && [ "$DRY_RUN" = 1 ]; then
    echo "[xmod] DATA not set: validating with --mock-data (set DATA to check your corpus and --split too)"
    DATA=mock
  fi
  [ -n "${DATA:-}" ] || die "DATA: set DATA to a Megatron .bin/.idx prefix (xmod preprocess), or DATA=mock"
  if [ "$DATA" = mock ]; then
    DATA_ARGS=(--mock-data "${TOKENIZER_ARGS[@]}")
  else
    # shellcheck disable=SC2206
    DATA_ARGS=(--data-path $DATA --split "$SPLIT" "${TOKENIZER_ARGS[@]}")
  fi
  OPT_ARGS=(--xmod-muon-table5 --xmod-paper-schedule --clip-grad 1.0)
  # The distributed optimizer reduce-scatters every gradient and all-gathers every parameter once a step:
  # X-MoD's 5-10x Dense's parameters make that 5-10x the bytes (an A3K16 step on H100: ~11% if exposed,
  # bench/README.md "Host cost"). Megatron overlaps them with the last micro-batch's backward and the next
  # step's first forward; the run is otherwise identical (tests/test_data_parallel.py).
  OVERLAP_ARGS=(--overlap-grad-reduce --overlap-param-gather)
  DEVICE_ARGS=(--use-distributed-optimizer "${OVERLAP_ARGS[@]}" --bf16 --recompute-granularity selective)
  # Every model: sequence parallelism at TP > 1 (it divides the activations by TP; megatron's MoE layer
  # needs it there); at TP 1 the 556m / 936m models exceed 80 GB at L = 32768 with selective recompute
  # (xmod count --memory): full recompute keeps one input per layer instead
  if [ "$TP" -gt 1 ]; then DEVICE_ARGS+=(--sequence-parallel)
  elif [ "$BACKBONE" = 556m ] || [ "$BACKBONE" = 936m ]; then
    DEVICE_ARGS=(--use-distributed-optimizer "${OVERLAP_ARGS[@]}" --bf16 --recompute-granularity full
                 --recompute-method uniform --recompute-num-layers 1)
  fi
  DESC="$MODEL on $BACKBONE"
fi

WORLD_SIZE=$((NODES * NPROC))
# shellcheck disable=SC2206
EXTRA=(${EXTRA_ARGS:-})
# PP > 1: cost-balanced pipeline stages (xmod partition), unless EXTRA_ARGS gives a split of its own
PP_ARGS=()
if [ "$PP" -gt 1 ]; then PP_ARGS=(--xmod-pipeline-balance auto); fi
TRAIN_ARGS=("${MODEL_ARGS[@]}"
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" --context-parallel-size "$CP"
  --xmod-routing-segments "${ROUTING_SEGMENTS:-1}" "${DEVICE_ARGS[@]}" "${PP_ARGS[@]}"
  --seq-length "$SEQ" --max-position-embeddings "$SEQ" --micro-batch-size "$MBS" --global-batch-size "$GBS"
  --train-iters "$ITERS" "${OPT_ARGS[@]}" --attention-dropout 0 --hidden-dropout 0
  "${DATA_ARGS[@]}"
  --save "$CKPT" --load "$CKPT" --save-interval "$SAVE_INTERVAL" --tensorboard-dir "$TB"
  --log-interval "$LOG_INTERVAL" --eval-interval "$EVAL_INTERVAL" --eval-iters "$EVAL_ITERS"
  --exit-signal-handler "${EXTRA[@]}")

echo "[xmod] $DESC: $NODES node(s) x $NPROC processes = world size $WORLD_SIZE, TP $TP, PP $PP, CP $CP, $GBS sequences per step"
MASTER_PORT=${MASTER_PORT:-$((29500 + ${SLURM_JOB_ID:-0} % 1000))}
CMD=(srun --kill-on-bad-exit=1 --nodes="$NODES" --ntasks-per-node=1 "$PY" -m megatron_xmod.training.torchrun
     --nnodes="$NODES" --nproc_per_node="$NPROC" --shutdown_timeout="${PREEMPT_GRACE:-240}"
     --rdzv_backend=c10d --rdzv_endpoint="\$MASTER_ADDR:$MASTER_PORT" --rdzv_id="${SLURM_JOB_ID:-\$SLURM_JOB_ID}"
     -m megatron_xmod.pretrain "${TRAIN_ARGS[@]}")
echo "[xmod] command: $(printf '%q ' "${CMD[@]}")"

# Validate at the launch's world size before anything distributed starts (cheap: no GPU, no process group).
# Its exit code is the launcher's: 2 for our messages (a file, a flag, a knob), 1 for megatron's own refusals.
if [ "$DRY_RUN" = 1 ] || [ "${SKIP_DRY_RUN:-0}" != 1 ]; then
  rc=0
  XMOD_LAUNCH_NODES=$NODES XMOD_LAUNCH_NPROC=$NPROC WORLD_SIZE=$WORLD_SIZE "$PY" -m megatron_xmod.training.dry_run \
    "${TRAIN_ARGS[@]}" 2> >(grep -v "UserWarning\|warnings.warn\|No CUDA runtime" >&2) || rc=$?
  if [ "$rc" != 0 ]; then
    echo "[xmod] error: the run would fail at world size $WORLD_SIZE (message above); nothing was started" >&2
    exit "$rc"
  fi
fi
[ "$DRY_RUN" = 1 ] && exit 0

[ -n "${SLURM_JOB_ID:-}" ] || die "not inside a SLURM job: submit with sbatch (or DRY_RUN=1 to only validate)"
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_ADDR MASTER_PORT CUDA_DEVICE_MAX_CONNECTIONS=1
if [ "$SMOKE" = 1 ]; then export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"; fi
CMD=("${CMD[@]/\$MASTER_ADDR/$MASTER_ADDR}")  # the rendezvous endpoint, now that the node list is known
exec "${CMD[@]}"
