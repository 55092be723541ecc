#!/usr/bin/env bash
# X-MoD pre-training through the plugin's entry point (megatron's own training loop plus --xmod-*),
# one node, torchrun. Every knob is an environment variable; the defaults are the paper's 936M
# X-MoD A4K8 on 8 GPUs at L = 32768.
#
#   DATA=/data/my_text_document TOKENIZER=/models/tokenizer bash examples/pretrain_xmod.sh
#   DRY_RUN=1 ... bash examples/pretrain_xmod.sh     # print the command, validate it, run nothing
#
# Knobs: NNODES NPROC NODE_RANK MASTER_ADDR MASTER_PORT TP PP BACKBONE MODEL SEQ MBS GBS ITERS LR
#        DATA TOKENIZER_TYPE TOKENIZER CKPT TB EXTRA_ARGS (appended last, so they win over everything above).
# TOKENIZER_TYPE (default HuggingFaceTokenizer) and TOKENIZER (its --tokenizer-model: a HF folder or name, or
# a SentencePiece .model) must be the tokenizer DATA was made with: `xmod preprocess` records it in
# DATA.tokenizer.json and the dry run refuses another (SentencePieceTokenizer for --tokenizer sentencepiece).
# Multi-node SLURM jobs: slurm/xmod_train.sh.
set -euo pipefail

PY=${PY:-python}
NNODES=${NNODES:-1}
NPROC=${NPROC:-8}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
TP=${TP:-8}   # one 8-GPU node; at L = 32768 a 936M X-MoD needs TP 8 with sequence parallelism (xmod count --memory)
PP=${PP:-1}
BACKBONE=${BACKBONE:-936m}
MODEL=${MODEL:-xmod-a4k8}
SEQ=${SEQ:-32768}
MBS=${MBS:-1}
GBS=${GBS:-80}
ITERS=${ITERS:-20000}
LR=${LR:-3.2e-3}
DATA=${DATA:?set DATA to a Megatron dataset prefix (PREFIX.bin/.idx; make one with examples/preprocess_data.sh)}
TOKENIZER_TYPE=${TOKENIZER_TYPE:-HuggingFaceTokenizer}
TOKENIZER=${TOKENIZER:?set TOKENIZER to the --tokenizer-model of TOKENIZER_TYPE (a Hugging Face tokenizer folder or name; a SentencePiece .model)}
CKPT=${CKPT:-checkpoints/${MODEL}_${BACKBONE}}
TB=${TB:-tensorboard/${MODEL}_${BACKBONE}}
read -r -a EXTRA <<< "${EXTRA_ARGS:-}"

DISTRIBUTED_ARGS=(
    --nnodes "$NNODES"
    --nproc_per_node "$NPROC"
    --node_rank "$NODE_RANK"
    --master_addr "$MASTER_ADDR"
    --master_port "$MASTER_PORT"
)

MODEL_ARGS=(
    --xmod-backbone "$BACKBONE"
    --xmod-model "$MODEL"
    --seq-length "$SEQ"
    --max-position-embeddings "$SEQ"
    --attention-dropout 0
    --hidden-dropout 0
)

TRAINING_ARGS=(
    --micro-batch-size "$MBS"
    --global-batch-size "$GBS"
    --train-iters "$ITERS"
    --xmod-muon-table5
    --lr "$LR"
    --xmod-paper-schedule
    --bf16
)

PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP"
    --pipeline-model-parallel-size "$PP"
    --use-distributed-optimizer
    --overlap-grad-reduce    # the DP sync behind compute: it moves every parameter (X-MoD: 5-10x Dense's)
    --overlap-param-gather
    --recompute-granularity selective
)
if [ "$TP" -gt 1 ]; then PARALLEL_ARGS+=(--sequence-parallel); fi

DATA_ARGS=(
    --data-path "$DATA"
    --split 98,2,0
    --tokenizer-type "$TOKENIZER_TYPE"
    --tokenizer-model "$TOKENIZER"
)

OUTPUT_ARGS=(
    --log-interval 10
    --eval-interval 1000
    --eval-iters 10
    --save-interval 1000
    --save "$CKPT"
    --load "$CKPT"
    --tensorboard-dir "$TB"
)

ARGS=("${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" "${EXTRA[@]}")

if [ "${DRY_RUN:-0}" = "1" ]; then
    echo "torchrun ${DISTRIBUTED_ARGS[*]} -m megatron_xmod.pretrain ${ARGS[*]}"
    # megatron's full argument validation plus the plugin's, at this launch's world size, no GPU
    WORLD_SIZE=$((NNODES * NPROC)) exec "$PY" -m megatron_xmod.training.dry_run "${ARGS[@]}"
fi
exec "$PY" -m megatron_xmod.training.torchrun "${DISTRIBUTED_ARGS[@]}" -m megatron_xmod.pretrain "${ARGS[@]}"
