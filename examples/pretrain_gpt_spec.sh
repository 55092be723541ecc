#!/usr/bin/env bash
# X-MoD in YOUR Megatron-LM launch: Megatron-LM's own pretrain_gpt.py (tag core_v0.19.0, unmodified)
# with the plugin's layer spec, `--spec megatron_xmod.spec xmod_a3k16`. Only megatron's flags: the
# routing settings travel in the spec (any other layout: docs/cluster.md). Defaults: the paper's
# 936M X-MoD A3K16 (298 physical layers) on 8 GPUs at L = 32768.
#
#   MEGATRON_LM=/path/to/Megatron-LM DATA=/data/my_text_document TOKENIZER=/models/tok bash examples/pretrain_gpt_spec.sh
#   DRY_RUN=1 ... bash examples/pretrain_gpt_spec.sh     # print the command, validate it, run nothing
#
# Knobs: MEGATRON_LM NNODES NPROC NODE_RANK MASTER_ADDR MASTER_PORT TP PP PP_LAYOUT SPEC NUM_LAYERS SEQ
#        MBS GBS ITERS DATA TOKENIZER_TYPE TOKENIZER CKPT TB EXTRA_ARGS (appended last, so they win).
# TOKENIZER_TYPE (default HuggingFaceTokenizer) and TOKENIZER (its --tokenizer-model: a HF folder or name, or
# a SentencePiece .model) must be the tokenizer DATA was made with: `xmod preprocess` records it in
# DATA.tokenizer.json and the dry run refuses another (SentencePieceTokenizer for --tokenizer sentencepiece).
# PP > 1: no pipeline stage may start inside a sparse block (this route cannot carry the token-choice
# bias between stages). A balanced block-aligned layout for 4 nodes of 8 GPUs at TP 8, PP 4 (run on each
# node with NODE_RANK and MASTER_ADDR set): NNODES=4 PP=4 \
#   PP_LAYOUT=$(xmod partition --backbone 936m --model xmod-a3k16 --pp 4 --block-aligned --json | jq -r .layout)
# Megatron imports --spec's module and, if that import fails, logs one line and trains its default
# DENSE model of --num-layers layers: this script checks the spec first (python -m megatron_xmod.spec),
# and the run prints "[xmod] --spec built layers ..." on every pipeline stage.
set -euo pipefail

PY=${PY:-python}
MEGATRON_LM=${MEGATRON_LM:?set MEGATRON_LM to a Megatron-LM checkout (tag core_v0.19.0)}
NNODES=${NNODES:-1}
NPROC=${NPROC:-8}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
TP=${TP:-8}   # one 8-GPU node; at L = 32768 a 936M X-MoD needs TP 8 with sequence parallelism (xmod count --memory)
PP=${PP:-1}
PP_LAYOUT=${PP_LAYOUT:-}              # megatron's --pipeline-model-parallel-layout (default: its even split)
SPEC=${SPEC:-xmod_a3k16}            # dense (28 layers), mod (49), xmod_a4k8 (161), xmod_a3k16 (298)
NUM_LAYERS=${NUM_LAYERS:-298}
SEQ=${SEQ:-32768}
MBS=${MBS:-1}
GBS=${GBS:-80}
ITERS=${ITERS:-20000}
DATA=${DATA:?set DATA to a Megatron dataset prefix (PREFIX.bin/.idx; make one with examples/preprocess_data.sh)}
TOKENIZER_TYPE=${TOKENIZER_TYPE:-HuggingFaceTokenizer}
TOKENIZER=${TOKENIZER:?set TOKENIZER to the --tokenizer-model of TOKENIZER_TYPE (a Hugging Face tokenizer folder or name; a SentencePiece .model)}
CKPT=${CKPT:-checkpoints/${SPEC}_gpt}
TB=${TB:-tensorboard/${SPEC}_gpt}
read -r -a EXTRA <<< "${EXTRA_ARGS:-}"

DISTRIBUTED_ARGS=(
    --nnodes "$NNODES"
    --nproc_per_node "$NPROC"
    --node_rank "$NODE_RANK"
    --master_addr "$MASTER_ADDR"
    --master_port "$MASTER_PORT"
)

# The 936M backbone (the paper's Table 4; = megatron_xmod.presets.backbone_flags(get_backbone("936m"))).
GPT_MODEL_ARGS=(
    --spec megatron_xmod.spec "$SPEC"
    --num-layers "$NUM_LAYERS"
    --hidden-size 1536
    --ffn-hidden-size 3840
    --num-attention-heads 16
    --group-query-attention
    --num-query-groups 8
    --kv-channels 128
    --swiglu
    --normalization RMSNorm
    --norm-epsilon 1e-6
    --disable-bias-linear
    --position-embedding-type rope
    --rotary-base 1000000
    --untie-embeddings-and-output-weights
    --no-rope-fusion
    --qk-layernorm
    --seq-length "$SEQ"
    --max-position-embeddings "$SEQ"
    --attention-dropout 0
    --hidden-dropout 0
)

# The paper's Muon settings (Table 5) and schedule: 1% warm-up, cosine to 10% of the peak.
TRAINING_ARGS=(
    --micro-batch-size "$MBS"
    --global-batch-size "$GBS"
    --train-iters "$ITERS"
    --optimizer muon
    --lr 3.2e-3
    --muon-momentum 0.95
    --muon-num-ns-steps 5
    --muon-nesterov
    --muon-scale-mode spectral
    --muon-extra-scale-factor 0.2
    --adam-beta1 0.9
    --adam-beta2 0.95
    --adam-eps 1e-8
    --weight-decay 0.1
    --lr-decay-style cosine
    --lr-warmup-fraction 0.01
    --min-lr 3.2e-4
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
if [ -n "$PP_LAYOUT" ]; then PARALLEL_ARGS+=(--pipeline-model-parallel-layout "$PP_LAYOUT"); fi

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

ARGS=("${GPT_MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" "${EXTRA[@]}")

# The spec exists, matches --num-layers, and no pipeline stage starts inside a sparse block (errors that
# megatron would swallow or hit only once the nodes are up); it reads the pipeline flags of the whole
# argument list, EXTRA_ARGS included, and ignores the rest.
"$PY" -m megatron_xmod.spec megatron_xmod.spec "$SPEC" "${ARGS[@]}"
if [ "${DRY_RUN:-0}" = "1" ]; then
    echo "torchrun ${DISTRIBUTED_ARGS[*]} $MEGATRON_LM/pretrain_gpt.py ${ARGS[*]}"
    # megatron's full argument validation at this launch's world size (no GPU, no process group)
    WORLD_SIZE=$((NNODES * NPROC)) exec "$PY" -m megatron_xmod.training.dry_run "${ARGS[@]}"
fi
cd "$MEGATRON_LM"
exec "$PY" -m torch.distributed.run "${DISTRIBUTED_ARGS[@]}" pretrain_gpt.py "${ARGS[@]}"
