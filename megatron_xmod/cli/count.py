"""``xmod count``: total / activated parameters and forward FLOPs per token of a model."""
from __future__ import annotations

import json
import sys

from megatron_xmod.accounting import count, dense_reference
from megatron_xmod.moe.presets import MOE_MODEL_NAMES
from megatron_xmod.presets import BACKBONE_FILE_FIELDS, BACKBONES, parse_model, resolve_backbone
from megatron_xmod.training.memory_estimate import add_memory_arguments, print_memory


def register(subparsers) -> None:
    p = subparsers.add_parser("count", help="parameters and FLOPs/token of a Dense / MoD / X-MoD model")
    p.add_argument("--backbone", default="556m",
                   help=f"a preset ({', '.join(BACKBONES)}) or a JSON file with the fields "
                        f"{', '.join(BACKBONE_FILE_FIELDS)} (num_layers = the activated depth)")
    p.add_argument("--model", action="append", default=None,
                   help=f"dense, mod, mod-k<K>, xmod-a4k8, xmod-a3k16, xmod-a<A>k<K>, {', '.join(MOE_MODEL_NAMES)}, "
                        "a layout such as 'D*4 + (S8*8 + D)*4', or <depth>+<moe> (xmod-a4k8+moe-8x64: the MoE "
                        "feed-forward in every layer of the layout); repeat for a table (default: the paper's four, "
                        "less those the backbone cannot build)")
    p.add_argument("--seq-len", type=int, default=32768)
    p.add_argument("--mean-doc-length", type=float, default=None,
                   help="training with document masks (--reset-attention-mask): attention spans a token's document "
                        "only, so FLOPs count min(L, this) keys; the token-weighted mean sum(n^2)/sum(n) of the "
                        "packed documents' lengths n (default: full-length attention)")
    p.add_argument("--dense-prefix", type=int, default=4, help="N0 for xmod-a<A>k<K> names")
    p.add_argument("--json", action="store_true", help="one JSON object per model, one per line")
    add_memory_arguments(p)  # --memory: per-GPU bytes by part (megatron_xmod.training.memory_estimate)
    p.set_defaults(func=run)


def _fmt(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.0f}M" if n >= 1e7 else f"{n / 1e6:.2f}M"


DEFAULT_MODELS = ("dense", "mod", "xmod-a4k8", "xmod-a3k16")


def default_models(backbone, dense_prefix: int, out=None) -> list[str]:
    """:data:`DEFAULT_MODELS` less those ``backbone`` cannot build (a small backbone has no room for
    K = 8 MoD or an X-MoD block after N0 dense layers), each skipped one named on a line with its reason."""
    kept = []
    for model in DEFAULT_MODELS:
        try:
            dense_reference(parse_model(model, backbone, dense_prefix=dense_prefix).layout)
        except ValueError as why:
            print(f"note: skipped {model} (default list) on backbone {backbone.name}: {why}", file=out or sys.stdout)
            continue
        kept.append(model)
    return kept


def run(args) -> int:
    backbone = resolve_backbone(args.backbone)
    # an explicitly requested model that cannot be built is an error; the default list skips it
    models = args.model or default_models(backbone, args.dense_prefix, sys.stderr if args.json else sys.stdout)
    if args.memory:
        return print_memory(args, backbone, models)
    rows = []
    for model in models:
        description = parse_model(model, backbone, dense_prefix=args.dense_prefix)
        reference = dense_reference(description.layout)  # refuses a layout no dense model matches
        row = count(description, args.seq_len, args.mean_doc_length).to_dict()
        rows.append(dict(model=model, dense_reference=reference.notation, **row))
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    width = max(12, *(len(r["model"]) for r in rows))
    header = f"{'model':<{width}} {'layers':>6} {'N':>8} {'N_act':>8} {'FLOPs/tok':>10} {'phi/phi_D':>9} {'D/D_D':>6}  layout"
    span = "" if args.mean_doc_length is None else f", attention over documents of {rows[0]['attention_len']} tokens"
    print(f"backbone {backbone.name}, L = {args.seq_len}{span}; phi/phi_D and D/D_D against the dense model of the same "
          f"activated depth ({', '.join(sorted(set(r['dense_reference'] for r in rows)))})")
    print(header)
    for r in rows:
        print(f"{r['model']:<{width}} {r['num_layers']:>6} {_fmt(r['total_params']):>8} {_fmt(r['active_params']):>8} "
              f"{r['flops_per_token']:>10.3g} {r['flops_ratio_vs_dense']:>9.3f} {r['tokens_ratio_vs_dense']:>6.2f}  {r['layout']}")
    others = sorted({r["dense_reference"] for r in rows} - {f"D*{backbone.num_layers}"})
    if others:
        print(f"note: {', '.join(others)} differ from the backbone's activated depth num_layers = {backbone.num_layers}; "
              "each model is compared with the dense model of its own activated depth")
    return 0
