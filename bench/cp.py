"""Context-parallel traffic of a routed layer against a dense layer, counted on CPU (gloo).

    .venv/bin/python bench/cp.py [--backbone 165m] [--seq-len 2048] [--cp 2 4] [--k 4 8 16] [--out bench/results]

For each CP size C, C processes run a forward and backward pass of a model of one layout through
megatron's GPTModel, each on its rows of megatron's load-balanced layout, and count the bytes that
every collective of megatron's sequence mappings moves (the only collectives a layer issues under CP:
all-gathers forward, reduce-scatters backward): per rank, what an all-gather receives (output minus
input) and what a reduce-scatter sends (input minus output). A dense layer is measured as half of
``D*2``; a routed layer of sparsity K as ``D + S<K>`` minus one dense layer. The routed layer moves its
L router logits (gathered forward, their gradients reduce-scattered backward) and its routed tokens'
keys and values at a static per-rank width w = min(L/K, L/C) (a rank may hold any number of a
sequence's routed tokens, none to all; static shapes need the largest): about C/K of a dense layer
(K >= C). With segment-local top-k over 2C segments (``--xmod-routing-segments 2C``, rows "S<K> seg<2C>")
every rank holds exactly L/(K C) routed tokens and the layer moves 1/K. Target of issue 23: routed <=
1.2/K of dense. fp32, micro-batch 1.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatron_xmod.cpu_shim import cpu_patches  # noqa: E402


def _counting(counts, name, original, received):
    def collective(output, input_, group=None, **kwargs):
        counts[name] = counts.get(name, 0) + received(output, input_)
        return original(output, input_, group=group, **kwargs)
    return collective


def _count(backbone, layout, seq_len, cp, segments=1):
    """Bytes per rank moved by the collectives of one forward + backward of ``layout`` (``segments``: the
    sparse layers' --xmod-routing-segments)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import mappings

    from megatron_xmod.model import build_gpt_model, config_from_backbone
    from megatron_xmod.presets import get_backbone
    from megatron_xmod.xmod.layers import load_balanced_positions

    backbone = get_backbone(backbone)
    config = config_from_backbone(backbone, layout, use_cpu_initialization=True, context_parallel_size=cp,
                                  xmod_routing_segments=segments)
    model = build_gpt_model(config, 256, seq_len, rotary_base=backbone.rotary_base)
    own = load_balanced_positions(seq_len, cp)[parallel_state.get_context_parallel_rank()]
    tokens = torch.randint(0, 256, (1, seq_len), generator=torch.Generator().manual_seed(0))[:, own]
    counts = {}
    gather, scatter = mappings.dist_all_gather_func, mappings.dist_reduce_scatter_func
    mappings.dist_all_gather_func = _counting(counts, "forward all-gather", gather,
                                              lambda out, inp: out.nbytes - inp.nbytes)
    mappings.dist_reduce_scatter_func = _counting(counts, "backward reduce-scatter", scatter,
                                                  lambda out, inp: inp.nbytes - out.nbytes)
    try:
        model.train()
        model(tokens, own.expand_as(tokens), None, labels=tokens).float().mean().backward()
    finally:
        mappings.dist_all_gather_func, mappings.dist_reduce_scatter_func = gather, scatter
    return counts


def _worker(rank, world, port, args, queue):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    os.environ["XMOD_PERMUTE_CHECK"] = "0"
    with cpu_patches(training=False):
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        parallel_state.initialize_model_parallel(context_parallel_size=world)
        torch.manual_seed(0)
        model_parallel_cuda_manual_seed(0)
        rows = []
        dense = _count(args.backbone, "D*2", args.seq_len, world)
        per_dense = {name: value / 2 for name, value in dense.items()}
        rows.append(dict(layer="dense", cp=world, K=1, **per_dense, total=sum(per_dense.values())))
        for k in args.k:
            for segments in (1, 2 * world):
                both = _count(args.backbone, f"D + S{k}", args.seq_len, world, segments)
                routed = {name: value - per_dense.get(name, 0) for name, value in both.items()}
                name = f"routed S{k}" + (f" seg{segments}" if segments > 1 else "")
                rows.append(dict(layer=name, cp=world, K=k, segments=segments, **routed, total=sum(routed.values())))
        if rank == 0:
            queue.put(rows)
        torch.distributed.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write(rows, args, out_dir):
    from throughput import git_commit, loadavg, machine_name

    stamp = datetime.datetime.now(datetime.UTC)
    meta = dict(date=stamp.isoformat(timespec="seconds"), machine=machine_name(torch.device("cpu")), commit=git_commit(),
                load=loadavg(), backbone=args.backbone, seq_len=args.seq_len, dtype="fp32", micro_batch=1)
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, f"cp_cpu_{stamp.strftime('%Y%m%d')}")
    with open(stem + ".json", "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    lines = [f"# Context-parallel traffic per layer ({args.backbone}, L = {args.seq_len}, counted on CPU)", "",
             f"- {meta['date']}; {meta['machine']}; commit {meta['commit']}; load {meta['load']}; fp32, micro-batch 1",
             "- bytes per rank, forward + backward; routed / dense and K x that ratio (target <= 1.2)",
             "- `S<K>`: top-k over the whole sequence (static per-rank width min(L/K, L/C): about C/K); "
             "`S<K> seg<2C>`: --xmod-routing-segments 2C (every rank holds exactly L/(K C) routed tokens: 1/K, "
             "plus the L router logits)", "",
             "| CP | layer | forward all-gather | backward reduce-scatter | total | routed / dense | K x ratio |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for row in rows:
        dense = next(r for r in rows if r["cp"] == row["cp"] and r["layer"] == "dense")
        ratio = row["total"] / dense["total"]
        lines.append(f"| {row['cp']} | {row['layer']} | {row.get('forward all-gather', 0):,.0f} | "
                     f"{row.get('backward reduce-scatter', 0):,.0f} | {row['total']:,.0f} | {ratio:.4f} | "
                     f"{ratio * row['K']:.2f} |")
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return stem


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backbone", default="165m")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--k", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    args = parser.parse_args()
    rows = []
    context = mp.get_context("spawn")
    for cp in args.cp:
        queue = context.Queue()
        mp.start_processes(_worker, args=(cp, _free_port(), args, queue), nprocs=cp, join=True, start_method="spawn")
        rows += queue.get()
    write(rows, args, args.out)


if __name__ == "__main__":
    main()
