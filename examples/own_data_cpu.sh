#!/usr/bin/env bash
# Your own text on a CPU, start to finish: preprocess -> count -> train -> resume with more
# iterations -> evaluate the last checkpoint. One process per step, no launcher needed (the entry
# point runs one process when no torchrun/SLURM variables are set). Every command is printed before
# it runs and its output kept in $OUT/<step>.log, so each step can be copied and changed.
#
#   INPUT=my_corpus.txt bash examples/own_data_cpu.sh
#   INPUT="notes/ more.jsonl" OUT=runs/mine ITERS=200 MORE=100 bash examples/own_data_cpu.sh
#
# Knobs: INPUT (text or .jsonl files, or folders of them; in text files every blank-line-separated
#        block is a document) OUT VOCAB (SentencePiece pieces, trained on INPUT) BACKBONE (a preset
#        or a backbone JSON file; default: the demo's 6-layer backbone written to $OUT/backbone.json)
#        MODEL (a layout; its activated depth must be the backbone's num_layers) SEQ MBS GBS ITERS
#        MORE (iterations the resume adds) LR EVAL_ITERS EXTRA_ARGS (appended to every training step)
#        PY (the Python to run; default: `python` when it has megatron_xmod and megatron, else the
#        repository's .venv, which scripts/setup_env.sh creates).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
usable() {  # usable PYTHON: it exists and finds megatron_xmod, megatron and torch (nothing is imported)
    "$1" -c 'import importlib.util as u, sys; sys.exit(0 if all(u.find_spec(m) for m in ("megatron_xmod", "megatron", "torch")) else 1)' \
        >/dev/null 2>&1
}
if [ -n "${PY:-}" ]; then
    usable "$PY" || { echo "own_data_cpu.sh: PY: $PY cannot import megatron_xmod, megatron and torch; fix: bash $ROOT/scripts/setup_env.sh and PY=$ROOT/.venv/bin/python, or activate the venv that has them" >&2; exit 2; }
elif command -v python >/dev/null 2>&1 && usable python; then
    PY=python
elif usable "$ROOT/.venv/bin/python"; then
    PY="$ROOT/.venv/bin/python"
else
    echo "own_data_cpu.sh: PY: neither \`python\` nor $ROOT/.venv/bin/python can import megatron_xmod, megatron and torch; fix: bash $ROOT/scripts/setup_env.sh (creates .venv), or set PY=/path/to/python" >&2
    exit 2
fi
echo "[own_data] python: $PY"
read -r -a INPUTS <<< "${INPUT:?set INPUT to your text/.jsonl files or folders of them}"
OUT=${OUT:-runs/own_data}
VOCAB=${VOCAB:-2000}
MODEL=${MODEL:-D*2 + (S4*4 + D)*2}
SEQ=${SEQ:-128}
MBS=${MBS:-4}
GBS=${GBS:-8}
ITERS=${ITERS:-60}
MORE=${MORE:-30}
LR=${LR:-3e-3}
EVAL_ITERS=${EVAL_ITERS:-4}
read -r -a EXTRA <<< "${EXTRA_ARGS:-}"
mkdir -p "$OUT"

# The demo's backbone (xmod demo) as a backbone file: the same fields as the presets of `xmod count`.
if [ -z "${BACKBONE:-}" ]; then
    BACKBONE="$OUT/backbone.json"
    cat > "$BACKBONE" <<EOF
{"hidden_size": 128, "num_attention_heads": 4, "num_query_groups": 2, "head_dim": 32, "ffn_hidden_size": 384,
 "num_layers": 6, "vocab_size": $VOCAB, "rotary_base": 10000, "qk_layernorm": true}
EOF
fi

step() {  # step NAME COMMAND...: print the command, run it, keep its output in $OUT/NAME.log
    local name=$1
    shift
    printf '\n+ %s\n' "$(printf '%q ' "$@")" | tee "$OUT/$name.log"
    "$@" 2>&1 | tee -a "$OUT/$name.log"
}

# 1. Text -> Megatron dataset, with a SentencePiece model trained on the same text. The last line
#    of its output is the entry point's data and tokenizer flags for what it wrote.
step preprocess "$PY" -m megatron_xmod.cli preprocess --input "${INPUTS[@]}" --output-prefix "$OUT/data/text" \
    --tokenizer sentencepiece --train-tokenizer "$VOCAB" --split-blank-lines --quiet
read -r -a DATA_ARGS <<< "$(tail -n 1 "$OUT/preprocess.log")"

# 2. What will be trained: N, N_act, FLOPs/token against the dense model of the same activated depth.
step count "$PY" -m megatron_xmod.cli count --backbone "$BACKBONE" --model "$MODEL" --model dense --seq-len "$SEQ"

COMMON_ARGS=(
    --xmod-cpu
    --xmod-backbone "$BACKBONE"
    --xmod-routing-family xmod
    --xmod-layout "$MODEL"
    "${DATA_ARGS[@]}"
    --seq-length "$SEQ" --max-position-embeddings "$SEQ"
    --micro-batch-size "$MBS" --global-batch-size "$GBS"
    --lr "$LR" --min-lr "$(awk "BEGIN {print $LR / 10}")" --lr-decay-style cosine --lr-warmup-iters 2
    --attention-dropout 0 --hidden-dropout 0 --seed 1234
    --log-interval 5 --eval-interval "$ITERS" --eval-iters "$EVAL_ITERS"
)
TRAIN_ARGS=("${COMMON_ARGS[@]}" --save "$OUT/ckpt" --tensorboard-dir "$OUT/tb")

# 3. Train ITERS iterations and save the last one.
step train "$PY" -m megatron_xmod.pretrain "${TRAIN_ARGS[@]}" --train-iters "$ITERS" --save-interval "$ITERS" \
    "${EXTRA[@]}"

# 4. Resume from it for MORE iterations. The LR schedule's length (train-iters) changes, and megatron
#    refuses a schedule that disagrees with the checkpoint's unless told which one wins:
#    --override-opt_param-scheduler takes this command line's (docs/first_run.md, "Resume").
TOTAL=$((ITERS + MORE))
step resume "$PY" -m megatron_xmod.pretrain "${TRAIN_ARGS[@]}" --train-iters "$TOTAL" --save-interval "$TOTAL" \
    --load "$OUT/ckpt" --override-opt_param-scheduler "${EXTRA[@]}"

# 5. Evaluate the last checkpoint on the held-out splits (no training; nothing written).
step evaluate "$PY" -m megatron_xmod.pretrain "${COMMON_ARGS[@]}" --train-iters "$TOTAL" --load "$OUT/ckpt" \
    --skip-train "${EXTRA[@]}"

echo
echo "done: logs in $OUT/*.log, checkpoints in $OUT/ckpt, tensorboard --logdir $OUT/tb"
