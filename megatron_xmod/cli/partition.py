"""``xmod partition``: the pipeline layout that minimises the slowest stage of a model.

    xmod partition --backbone 1.65b --model xmod-a3k16 --seq-len 32768 --pp 8 [--vpp 2] [--json]

prints megatron's ``--pipeline-model-parallel-layout`` string, a per-stage table and the imbalance
(slowest stage / mean stage) of the layout next to megatron's default even split by layer count.
"""
from __future__ import annotations

import json

from megatron_xmod.pipeline.cost import DEFAULT_HARDWARE, Hardware, model_items
from megatron_xmod.pipeline.partition import Partition, balanced_partition, default_partition
from megatron_xmod.presets import BACKBONE_FILE_FIELDS, BACKBONES, Backbone, parse_model, resolve_backbone


def register(subparsers) -> None:
    p = subparsers.add_parser("partition", help="cost-balanced pipeline stages (megatron's --pipeline-model-parallel-layout)")
    p.add_argument("--backbone", required=True,
                   help=f"a preset ({', '.join(BACKBONES)}) or a JSON file with the fields "
                        f"{', '.join(BACKBONE_FILE_FIELDS)} (as xmod count --backbone)")
    p.add_argument("--model", required=True, help="dense, mod, mod-k<K>, xmod-a4k8, xmod-a3k16, xmod-a<A>k<K> or a layout")
    p.add_argument("--seq-len", type=int, default=32768)
    p.add_argument("--pp", type=int, required=True, help="pipeline-parallel size")
    p.add_argument("--vpp", type=int, default=1, help="virtual stages per pipeline rank (interleaved schedule)")
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--num-microbatches", type=int, default=None,
                   help="micro-batches per step (caps the in-flight count; default: enough to fill the pipeline)")
    p.add_argument("--dense-prefix", type=int, default=4, help="N0 for xmod-a<A>k<K> names")
    p.add_argument("--calibration", default=None, help="JSON of measured seconds per item kind (D, S<K>, E, L)")
    p.add_argument("--flops-per-s", type=float, default=Hardware.flops_per_s, help="achieved FLOP/s of one device")
    p.add_argument("--bytes-per-s", type=float, default=Hardware.bytes_per_s, help="achieved memory bandwidth, B/s")
    p.add_argument("--block-aligned", action="store_true",
                   help="no stage starts inside a sparse block: for Megatron-LM's pretrain_gpt.py --spec, which cannot "
                        "carry the token-choice bias across stages (our entry point can: any boundary)")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.set_defaults(func=run)


def plan(backbone: str | Backbone, model: str, seq_len: int, pp: int, vpp: int = 1, micro_batch_size: int = 1,
         num_microbatches=None, dense_prefix: int = 4, calibration=None,
         hardware: Hardware = DEFAULT_HARDWARE, block_aligned: bool = False) -> tuple[Partition, Partition]:
    """(balanced, default) partitions of ``model`` on ``backbone`` (a preset, a backbone JSON file or a
    :class:`Backbone`); ``block_aligned``: no balanced stage starts at a sparse layer that continues a block
    (items are [E, layers, L]: layer i is item i + 1)."""
    description = parse_model(model, resolve_backbone(backbone), dense_prefix=dense_prefix)
    items = model_items(description, seq_len, micro_batch_size, hardware, calibration)
    if pp * vpp > len(items):
        raise ValueError(f"pp/vpp: {pp} x {vpp} stages exceed the {len(items) - 2} layers (+ embedding and loss); "
                         "use fewer stages")
    inside_blocks = [i + 1 for i, layer in enumerate(description.layout.layers)
                     if block_aligned and layer.is_sparse and layer.index_in_block > 0]
    return (balanced_partition(items, pp, vpp, num_microbatches, inside_blocks),
            default_partition(items, pp, vpp, num_microbatches))


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def run(args) -> int:
    backbone = resolve_backbone(args.backbone)
    balanced, default = plan(backbone, args.model, args.seq_len, args.pp, args.vpp, args.micro_batch_size,
                             args.num_microbatches, args.dense_prefix, args.calibration,
                             Hardware(args.flops_per_s, args.bytes_per_s), args.block_aligned)
    if args.json:
        out = balanced.to_dict()
        out.update(default_layout=default.layout, default_max_over_mean=default.max_over_mean,
                   default_rank_max_over_mean=default.rank_max_over_mean, backbone=backbone.name,
                   model=args.model, seq_len=args.seq_len, block_aligned=args.block_aligned)
        print(json.dumps(out))
        return 0
    print(f"{args.model} on {backbone.name}, L = {args.seq_len}, PP = {args.pp}, VPP = {args.vpp}")
    print(f"--pipeline-model-parallel-layout '{balanced.layout}'")
    print(f"{'rank':>4} {'vp':>3} {'layers':>6}  {'items':<10} {'time ms':>8} {'TFLOPs':>8} {'params M':>9} "
          f"{'act GiB':>8} {'in-flight':>9}")
    for s in balanced.stages:
        print(f"{s.pp_rank:>4} {s.vp_stage:>3} {s.layers:>6}  {s.items:<10} {s.time_s * 1e3:>8.2f} {s.flops / 1e12:>8.2f} "
              f"{s.params / 1e6:>9.1f} {_gib(s.activation_bytes):>8} {s.in_flight:>9}")
    print(f"slowest stage / mean: {balanced.max_over_mean:.3f} balanced, {default.max_over_mean:.3f} an even split by layer "
          f"count, megatron's default where it divides ({default.layout}); per rank {balanced.rank_max_over_mean:.3f} vs {default.rank_max_over_mean:.3f}")
    return 0
