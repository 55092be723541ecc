#!/bin/bash
# X-MoD A3K16 at N_act = 1.65B (Table 6 / Eq.36 of the X-MoD paper,
# "X-MoD: Practical Scaling Laws for Sparse-Depth Routing Beyond Mixture-of-Depths", arXiv:2609.34212):
# 8 nodes x 8 GPUs, TP=8 as in the paper,
# L = 32768, ~2.5M tokens per step (Eq.32), Muon with Table 5 settings, 1% warmup + cosine to 10%,
# training compute C = 2.5e20 FLOPs (iterations derived from the accounting module, not hard-coded).
#
#   sbatch slurm/xmod_1p65b.sh                  # env overrides: DATA, TOKENIZER, CKPT, TB, MODEL, FLOPS
#SBATCH --job-name=xmod-1p65b
#SBATCH --nodes=8
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --exclusive
#SBATCH --time=72:00:00
#SBATCH --output=%x-%j.out
set -euo pipefail

ROOT="${XMOD_ROOT:-${SLURM_SUBMIT_DIR:-$(pwd)}}"
PY="${XMOD_PY:-$ROOT/.venv/bin/python}"
MODEL="${MODEL:-xmod-a3k16}"
SEQ=32768
GBS=76                                     # 76 x 32768 = 2.49M tokens per step
FLOPS="${FLOPS:-2.5e20}"
DATA="${DATA:?set DATA to a Megatron .bin/.idx prefix (xmod preprocess)}"
TOKENIZER="${TOKENIZER:-$ROOT/data/cache/tokenizers/gpt2}"
CKPT="${CKPT:-$ROOT/runs/$SLURM_JOB_NAME/ckpt}"
TB="${TB:-$ROOT/runs/$SLURM_JOB_NAME/tb}"

# Equal-compute budget: iterations = C / (3 * forward FLOPs/token * tokens/step).
FWD=$("$PY" -m megatron_xmod.cli count --backbone 1.65b --model "$MODEL" --seq-len $SEQ --json \
      | "$PY" -c 'import json,sys; print(json.loads(sys.stdin.readline())["flops_per_token"])')
ITERS=$("$PY" -c "print(max(1, round(float('$FLOPS') / (3 * $FWD * $GBS * $SEQ))))")
echo "[xmod] $MODEL: forward FLOPs/token $FWD, $ITERS iterations for C=$FLOPS"

MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_ADDR MASTER_PORT=${MASTER_PORT:-29500} CUDA_DEVICE_MAX_CONNECTIONS=1

srun --kill-on-bad-exit=1 "$PY" -m torch.distributed.run \
  --nnodes="$SLURM_JOB_NUM_NODES" --nproc_per_node=8 --node_rank="$SLURM_NODEID" \
  --rdzv_backend=c10d --rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv_id="$SLURM_JOB_ID" \
  -m megatron_xmod.pretrain \
  --xmod-backbone 1.65b --xmod-model "$MODEL" \
  --tensor-model-parallel-size 8 --use-distributed-optimizer --bf16 \
  --seq-length $SEQ --max-position-embeddings $SEQ --micro-batch-size 1 --global-batch-size $GBS \
  --train-iters "$ITERS" --xmod-muon-table5 --xmod-paper-schedule --clip-grad 1.0 \
  --data-path "$DATA" --split 99,1,0 --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER" \
  --save "$CKPT" --load "$CKPT" --save-interval 500 --tensorboard-dir "$TB" \
  --log-interval 10 --eval-interval 500 --eval-iters 20 --recompute-granularity selective
