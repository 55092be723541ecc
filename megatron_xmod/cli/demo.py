"""``xmod demo``: Dense, MoD and X-MoD trained at equal FLOPs on CPU (:mod:`megatron_xmod.demo`)."""
from __future__ import annotations

from megatron_xmod.demo import run


def register(subparsers) -> None:
    p = subparsers.add_parser("demo", help="train Dense / MoD / X-MoD at equal FLOPs on CPU and compare")
    p.add_argument("--out", default="runs/demo", help="output folder (logs, checkpoints, tensorboard, table, plot)")
    p.add_argument("--dense-iters", type=int, default=160, help="iterations of the Dense model; others match its FLOPs")
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--global-batch-size", type=int, default=8)
    p.add_argument("--eval-interval", type=int, default=40)
    p.add_argument("--eval-iters", type=int, default=4, help="per periodic validation (the curve)")
    p.add_argument("--final-eval-iters", type=int, default=16, help="for the table: the same batches for every model")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--models", default="dense,mod,xmod", help="comma-separated subset of dense,mod,xmod")
    p.add_argument("--tokenizer", default="sentencepiece", choices=("sentencepiece", "gpt2"),
                   help="sentencepiece: 8k vocabulary trained on the corpus (default; on 2 CPU cores the "
                        "50k-row GPT-2 output layer would cost 6x the whole transformer); gpt2: the paper's")
    p.set_defaults(func=run)
