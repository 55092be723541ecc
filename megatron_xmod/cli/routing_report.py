"""``xmod routing-report``: routing diagnostics of a saved MoD / X-MoD checkpoint on held-out sequences.

    xmod routing-report --load runs/demo/xmod/ckpt --data data/cache/.../valid_text_document \\
        [--num-sequences 64] [--rule threshold|topk] [--output DIR]

One CPU process: the checkpoint's model is rebuilt from its saved megatron args and loaded with
megatron's distributed checkpointing (:mod:`megatron_xmod.hf.checkpoint_io`); the sequences are the
first ``--num-sequences`` windows of ``seq_length + 1`` tokens of the indexed dataset, documents
concatenated in order. Writes ``routing_report.txt``, ``routing_report.json``,
``update_counts.png`` (the paper's Figure 5) and ``selected_fraction.png`` to ``--output``.
"""
from __future__ import annotations

from megatron_xmod.diagnostics.routing_report import run


def register(subparsers) -> None:
    p = subparsers.add_parser("routing-report", help="routing diagnostics (coverage, Jaccard, update counts, "
                                                     "threshold vs top-k) of a MoD / X-MoD checkpoint")
    p.add_argument("--load", required=True, help="the --save folder of a run (or one of its iter_* folders)")
    p.add_argument("--data", required=True, help="megatron indexed dataset prefix (PREFIX.bin / PREFIX.idx), "
                                                 "e.g. the held-out split the run validated on")
    p.add_argument("--num-sequences", type=int, default=64)
    p.add_argument("--rule", default="threshold", choices=("threshold", "topk"),
                   help="routing rule of the statistics pass (threshold: deployable, the paper's Table 10)")
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--iteration", type=int, default=None, help="checkpoint iteration (default: the latest)")
    p.add_argument("--output", default=None, help="output folder (default: routing_report/ beside --load)")
    p.set_defaults(func=run)
