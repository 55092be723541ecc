#!/bin/bash
# Headline baseline: MoE 8:64 (6 of 64 routed + 2 shared experts) at N_act = 1.65B (Table 6), FLOP-matched, 8 nodes x 8 GPUs, TP 8 as in the paper
# (data-parallel 8), L = 32768, 80 sequences per step (the paper's throughput protocol, 2.62M tokens),
# Muon Table 5, 1% warmup + cosine to 10%, C = 2.5e20 FLOPs. A thin wrapper: every knob and its
# default live in slurm/xmod_train.sh (env overrides: DATA, TOKENIZER_TYPE, TOKENIZER_MODEL, RUN_NAME, CKPT, MODEL, FLOPS, ...).
#
#   DRY_RUN=1 bash slurm/moe8x64_1p65b.sh       # validate at 64 ranks, start nothing
#   DATA=/data/my_text_document sbatch slurm/moe8x64_1p65b.sh
#SBATCH --job-name=moe8x64-1p65b
#SBATCH --nodes=8
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --exclusive
#SBATCH --time=72:00:00
#SBATCH --output=%x-%j.out
#SBATCH --signal=TERM@300
set -euo pipefail
export BACKBONE="${BACKBONE:-1.65b}" MODEL="${MODEL:-moe-8x64}" NODES="${NODES:-8}" NPROC="${NPROC:-8}" TP="${TP:-8}"
if [ -n "${SLURM_JOB_ID:-}" ] && [ -n "${SLURM_SUBMIT_DIR:-}" ]; then HERE="${XMOD_ROOT:-$SLURM_SUBMIT_DIR}/slurm"
else HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"; fi
[ -f "$HERE/xmod_train.sh" ] || { echo "[xmod] error: XMOD_ROOT: no $HERE/xmod_train.sh; submit from the repository root or set XMOD_ROOT" >&2; exit 2; }
exec bash "$HERE/xmod_train.sh" "$@"
