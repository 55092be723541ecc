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

import json
from pathlib import Path

import numpy as np
import torch


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


def check_arguments(args) -> None:
    """Every input problem before anything is loaded: ``field: why; fix``."""
    if args.num_sequences < 1:
        raise ValueError(f"num_sequences: must be >= 1, got {args.num_sequences}")
    if args.micro_batch_size < 1:
        raise ValueError(f"micro_batch_size: must be >= 1, got {args.micro_batch_size}")
    if not Path(args.load).is_dir():
        raise ValueError(f"load: {args.load} is not a folder; give the --save folder of a training run")
    missing = [suffix for suffix in (".bin", ".idx") if not Path(args.data + suffix).is_file()]
    if missing:
        raise ValueError(f"data: {args.data}{missing[0]} not found; give a megatron dataset prefix (without .bin/.idx), "
                         "e.g. the --valid-data-path of the run")


def read_sequences(prefix: str, num_sequences: int, seq_length: int, vocab_size: int) -> torch.Tensor:
    """The first ``num_sequences`` windows of ``seq_length + 1`` tokens of the dataset, documents
    concatenated in order (inputs and next-token labels)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix)
    needed = num_sequences * (seq_length + 1)
    pieces, have = [], 0
    for i in range(len(dataset)):
        piece = np.asarray(dataset[i], dtype=np.int64)
        pieces.append(piece[: needed - have])
        have += len(pieces[-1])
        if have >= needed:
            break
    if have < needed:
        raise ValueError(f"num_sequences: {prefix} holds {have} tokens, enough for {have // (seq_length + 1)} "
                         f"sequences of {seq_length + 1}; ask for fewer")
    tokens = torch.from_numpy(np.concatenate(pieces)).view(num_sequences, seq_length + 1)
    if int(tokens.max()) >= vocab_size:
        raise ValueError(f"data: token id {int(tokens.max())} >= the model's vocabulary ({vocab_size}); "
                         "is it the dataset of this run's tokenizer?")
    return tokens


def load_model(load_dir: str, iteration=None):
    """(model, megatron args, iteration) of a checkpoint; call inside ``single_process_megatron()``."""
    from megatron.core import dist_checkpointing

    from megatron_xmod.hf.checkpoint_io import build_model, checkpoint_path, model_sharded_state_dict, read_common

    path, iteration = checkpoint_path(load_dir, iteration)
    common = read_common(path)
    args = common["args"]
    if getattr(args, "xmod_routing_family", "dense") == "dense":
        raise ValueError(f"load: {path} holds a dense model (no routed layers); routing-report needs MoD or X-MoD")
    model = build_model(args)
    loaded = dist_checkpointing.load({"model": model_sharded_state_dict(model, common.get("content_metadata"))}, str(path))
    model.load_state_dict(loaded["model"], strict=True)
    return model.eval(), args, int(common.get("iteration", iteration))


def run(args) -> int:
    from megatron_xmod.diagnostics.routing_report import (
        format_table,
        plot_selected_fraction,
        plot_update_counts,
        routing_report,
    )
    from megatron_xmod.hf.checkpoint_io import single_process_megatron

    check_arguments(args)
    output = Path(args.output) if args.output else Path(args.load).resolve().parent / "routing_report"
    with single_process_megatron():
        model, megatron_args, iteration = load_model(args.load, args.iteration)
        sequences = read_sequences(args.data, args.num_sequences, megatron_args.seq_length,
                                   megatron_args.padded_vocab_size)
        report = routing_report(model, sequences, args.rule, args.micro_batch_size)
    report.update(checkpoint=str(Path(args.load).resolve()), iteration=iteration, data=args.data,
                  layout=megatron_args.xmod_layout)
    output.mkdir(parents=True, exist_ok=True)
    table = format_table(report)
    (output / "routing_report.txt").write_text(table + "\n")
    (output / "routing_report.json").write_text(json.dumps(report, indent=1))
    title = f"{megatron_args.xmod_layout} ({report['family']}), iteration {iteration}"
    plot_update_counts(report, output / "update_counts.png", title=f"update counts per block: {title}")
    plot_selected_fraction(report, output / "selected_fraction.png", title=f"selected fraction: {title}")
    print(table)
    print(f"\n[xmod] routing report: {output}/routing_report.{{txt,json}}, update_counts.png, selected_fraction.png")
    return 0
