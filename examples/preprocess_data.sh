#!/usr/bin/env bash
# Text / JSONL -> a Megatron indexed dataset (PREFIX.bin + PREFIX.idx) for --data-path, with the
# plugin's `xmod preprocess` (GPT-2 BPE read offline and checked by sha256, SentencePiece, or bytes).
#
#   INPUT="corpus.jsonl more/" OUTPUT_PREFIX=data/my_text bash examples/preprocess_data.sh
#   DRY_RUN=1 ... bash examples/preprocess_data.sh      # print the command only
#
# Knobs: INPUT (files or folders, space-separated) OUTPUT_PREFIX TOKENIZER (gpt2 | sentencepiece |
#        bytes) TOKENIZER_MODEL (SentencePiece .model) JSONL_KEY WORKERS EXTRA_ARGS.
set -euo pipefail

XMOD=${XMOD:-xmod}
read -r -a INPUTS <<< "${INPUT:?set INPUT to text/.jsonl files or folders of them}"
OUTPUT_PREFIX=${OUTPUT_PREFIX:?set OUTPUT_PREFIX (writes OUTPUT_PREFIX.bin and .idx)}
TOKENIZER=${TOKENIZER:-gpt2}
JSONL_KEY=${JSONL_KEY:-text}
WORKERS=${WORKERS:-8}
read -r -a EXTRA <<< "${EXTRA_ARGS:-}"

PREPROCESS_ARGS=(
    --input "${INPUTS[@]}"
    --output-prefix "$OUTPUT_PREFIX"
    --tokenizer "$TOKENIZER"
    --jsonl-key "$JSONL_KEY"
    --workers "$WORKERS"
)
if [ -n "${TOKENIZER_MODEL:-}" ]; then
    PREPROCESS_ARGS+=(--tokenizer-model "$TOKENIZER_MODEL")
fi
ARGS=("${PREPROCESS_ARGS[@]}" "${EXTRA[@]}")

echo "$XMOD preprocess ${ARGS[*]}"
if [ "${DRY_RUN:-0}" = "1" ]; then
    exit 0
fi
exec $XMOD preprocess "${ARGS[@]}"
