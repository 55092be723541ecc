"""Activation memory per layer: bytes saved for backward by a dense layer and by routed layers
(K = 4, 8, 16) of the Table 4 backbones, and by whole X-MoD blocks, measured on CPU.

    .venv/bin/python bench/memory.py [--quick] [--out bench/results]

Counted with ``torch.autograd.graph.saved_tensors_hooks`` during the forward pass: every distinct
tensor storage once, parameters excluded, the layer input included when the layer saves it. A routed
layer is measured inside a chain (the second routed layer of ``S<K>*2``): its block's full-length
router base is reported separately (once per block). Each figure is checked against the formulas of
``megatron_xmod.training.memory_estimate`` (the ones ``xmod count --memory`` uses), and the routed layer
against the target ratio routed / dense <= 1.2 / K. "before" is the same layer with the plain
``nn.Linear`` router (one full-length router input saved per routed layer, the state before
megatron_xmod.xmod.routing_state). fp32, micro-batch 1; every term is linear in L (SDPA's flash path on CPU keeps
no L x L matrix), which the 165m rows at two lengths show.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_xmod.cpu_shim import cpu_patches  # noqa: E402

MACHINE = "2-core CPU dev machine, no GPU"


def saved_bytes_per_layer(model, x, rope):
    """Run the decoder layers of ``model`` on ``x``; {layer index: bytes first saved while it ran}."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen, current = {}, [0]
    # The graph keeps a number, this list the tensor: returning a saved output itself from the pack
    # hook would make a tensor -> grad_fn -> tensor cycle that nothing frees.
    kept = []

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and storage.data_ptr() not in seen:
            seen[storage.data_ptr()] = (current[0], storage.nbytes())
        kept.append(t)
        return len(kept) - 1

    with torch.autograd.graph.saved_tensors_hooks(pack, kept.__getitem__):
        h = x
        for i, layer in enumerate(model.decoder.layers):
            current[0] = i
            h, _ = layer(h, rotary_pos_emb=rope)
    per_layer = [0] * len(model.decoder.layers)
    for layer, nbytes in seen.values():
        per_layer[layer] += nbytes
    del h
    kept.clear()
    return per_layer


def measure(backbone, layout, seq_len, family="xmod", plain_router=False):
    from megatron_xmod.model import build_gpt_model, config_from_backbone
    from megatron_xmod.xmod.layers import XModSparseLayer

    overrides = {} if layout.startswith("D") and "S" not in layout else dict(xmod_routing_family=family)
    config = config_from_backbone(backbone, layout, use_cpu_initialization=True, **overrides)
    model = build_gpt_model(config, 256, seq_len, rotary_base=backbone.rotary_base)
    model.train()
    x = torch.randn(seq_len, 1, backbone.hidden_size, requires_grad=True)
    rope = model.rotary_pos_emb(seq_len)
    original = XModSparseLayer._router_logits
    if plain_router:
        XModSparseLayer._router_logits = lambda self, h, stream_grad=None: (F.linear(h, self.router.weight).squeeze(-1).float(), None, h)
    try:
        return saved_bytes_per_layer(model, x, rope)
    finally:
        XModSparseLayer._router_logits = original


def run(quick: bool):
    from megatron_xmod.presets import BACKBONES
    from megatron_xmod.training.memory_estimate import block_base_bytes, dense_layer_bytes, routed_layer_bytes

    lengths = {"165m": [2048, 4096], "298m": [4096], "556m": [4096], "936m": [2048], "1.65b": [2048]}
    if quick:
        lengths = {"165m": [1024]}
    rows = []
    for name, seq_lens in lengths.items():
        b = BACKBONES[name]
        for seq_len in seq_lens:
            dense = measure(b, "D", seq_len)[0]
            row = dict(backbone=name, seq_len=seq_len, dense=dense, dense_formula=dense_layer_bytes(b, seq_len),
                       routed={})
            for k in (4, 8, 16):
                chain = measure(b, f"S{k}*2", seq_len)
                before = measure(b, f"S{k}*2", seq_len, plain_router=True)
                routed = chain[1]
                row["routed"][k] = dict(
                    bytes=routed, formula=routed_layer_bytes(b, seq_len, k), ratio=routed / dense,
                    target=1.2 / k, before=before[1], before_ratio=before[1] / dense,
                    first_in_block=chain[0], block_base_formula=block_base_bytes(b, seq_len))
                print(f"{name} L={seq_len} K={k}: routed {routed / 2**20:.1f} MiB = {routed / dense:.3f} of dense "
                      f"(target {1.2 / k:.3f}; before {before[1] / dense:.3f})", flush=True)
            rows.append(row)
            print(f"{name} L={seq_len}: dense {dense / 2**20:.1f} MiB (formula {row['dense_formula'] / 2**20:.1f})", flush=True)
    blocks = []
    block_layouts = {"xmod-a4k8": "S8*32 + D", "xmod-a3k16": "S16*48 + D"} if not quick else {"xmod-a4k8": "S8*8 + D"}
    b, seq_len = BACKBONES["165m"], (4096 if not quick else 1024)
    dense = measure(b, "D", seq_len)[0]
    for model_name, layout in block_layouts.items():
        per_layer = measure(b, layout, seq_len)
        k = 8 if "S8" in layout else 16
        n = int(layout.split("*")[1].split()[0])
        formula = (n * routed_layer_bytes(b, seq_len, k) + block_base_bytes(b, seq_len)
                   + dense_layer_bytes(b, seq_len))
        before = sum(measure(b, layout, seq_len, plain_router=True))
        blocks.append(dict(model=model_name, backbone="165m", layout=layout, seq_len=seq_len, bytes=sum(per_layer),
                           formula=formula, before=before, dense_layers_equivalent=sum(per_layer) / dense,
                           activated_layers=n / k + 1))
        print(f"block {layout}: {sum(per_layer) / 2**20:.1f} MiB = {sum(per_layer) / dense:.2f} dense layers "
              f"(activated {n / k + 1:g}; before {before / dense:.2f})", flush=True)
    return rows, blocks


def write(rows, blocks, out_dir):
    stamp = datetime.datetime.now(datetime.UTC)
    meta = dict(date=stamp.isoformat(timespec="seconds"), machine=f"{MACHINE} ({platform.processor() or platform.machine()})",
                torch=torch.__version__, dtype="float32", micro_batch=1)
    base = os.path.join(out_dir, f"memory_{stamp:%Y%m%d}")
    with open(base + ".json", "w") as f:
        json.dump(dict(meta, layers=rows, blocks=blocks), f, indent=1)
    mib = lambda x: f"{x / 2**20:.1f}"  # noqa: E731
    lines = [f"# Activation bytes saved for backward per layer ({meta['date']}, {meta['machine']})", "",
             "fp32, micro-batch 1, counted with torch.autograd.graph.saved_tensors_hooks (distinct storages, no "
             "parameters, the layer input included). Routed layer: inside a chain (its block's full-length "
             "router base is held by the first routed layer of the block, last column). `before`: the same layer with the plain "
             "nn.Linear router. Formula: megatron_xmod.training.memory_estimate (what `xmod count --memory` uses).", "",
             "| backbone | L | dense MiB (formula) | K | routed MiB (formula) | routed/dense | target 1.2/K | before/dense | first routed layer of a block MiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for k, v in r["routed"].items():
            lines.append(f"| {r['backbone']} | {r['seq_len']} | {mib(r['dense'])} ({mib(r['dense_formula'])}) | {k} | "
                         f"{mib(v['bytes'])} ({mib(v['formula'])}) | {v['ratio']:.3f} | {v['target']:.3f} | "
                         f"{v['before_ratio']:.3f} | {mib(v['first_in_block'])} |")
    lines += ["", "Whole X-MoD blocks (165m): all layers of the block, its anchor and its base.", "",
              "| model | layout | L | MiB (formula) | in dense layers | activated layers | before (dense layers) |", "|---|---|---|---|---|---|---|"]
    for bl in blocks:
        dense = bl["bytes"] / bl["dense_layers_equivalent"]
        lines.append(f"| {bl['model']} | `{bl['layout']}` | {bl['seq_len']} | {mib(bl['bytes'])} ({mib(bl['formula'])}) | "
                     f"{bl['dense_layers_equivalent']:.2f} | {bl['activated_layers']:g} | {bl['before'] / dense:.2f} |")
    with open(base + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("wrote", base + ".json", base + ".md", plot(base + ".json"))


def plot(json_path: str) -> str:
    """PNG beside the JSON: routed / dense saved bytes per backbone and K, before and after, and 1.2/K."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(json_path) as f:
        data = json.load(f)
    rows = [r for r in data["layers"] if r["seq_len"] == max(x["seq_len"] for x in data["layers"] if x["backbone"] == r["backbone"])]
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.25
    for i, k in enumerate(("4", "8", "16")):
        xs = [j + (i - 1) * width for j in range(len(rows))]
        ax.bar(xs, [r["routed"][k]["before_ratio"] for r in rows], width, color=f"C{i}", alpha=0.35,
               label=f"K={k}: nn.Linear router" if i == 0 else None)
        ax.bar(xs, [r["routed"][k]["ratio"] for r in rows], width, color=f"C{i}", label=f"K={k}: chained router")
        ax.hlines(1.2 / int(k), xs[0] - width, xs[-1] + width, colors=f"C{i}", linestyles="dashed")
    ax.set_xticks(range(len(rows)), [f"{r['backbone']}\nL={r['seq_len']}" for r in rows])
    ax.set_ylabel("saved bytes, routed / dense layer")
    ax.set_title("Activation memory of a routed layer (dashed: target 1.2/K)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    out = json_path[: -len(".json")] + ".png"
    fig.savefig(out, dpi=120)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="165m at L = 1024 only (a smoke run)")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    parser.add_argument("--plot", metavar="JSON", help="only draw the PNG of a recorded result")
    args = parser.parse_args(argv)
    if args.plot:
        print("wrote", plot(args.plot))
        return 0
    torch.manual_seed(0)
    with cpu_patches(training=False):
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29600 + os.getpid() % 1000))
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        parallel_state.initialize_model_parallel(1, 1)
        model_parallel_cuda_manual_seed(0)
        rows, blocks = run(args.quick)
        write(rows, blocks, args.out)
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
