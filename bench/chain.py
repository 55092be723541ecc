"""Backward cost of the router-input chain (megatron_xmod.xmod.routing_state): the chain cursor, which walks
one buffer back through a block a layer at a time (2N - 3 row copies for a block of N routed layers),
against rebuilding every layer's router input from the block base (N(N - 1)/2 row copies and a
full-length clone per layer, the code before the cursor), in one process with the two interleaved step
by step (so that load drift hits both alike; ratio of medians).

    python bench/chain.py                           # cpu-256, L = 2048, X-MoD A4K8 and A3K16
    python bench/chain.py --models xmod-a3k16 --steps 6

Each step is one forward + backward of the whole model (megatron's GPTModel built by megatron_xmod, no
optimizer). Writes ``chain_<machine>_<date>.json`` / ``.md`` under ``--out``.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import torch  # noqa: E402
from throughput import CPU_BACKBONE, model_config, run_meta, single_rank_megatron  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from megatron_xmod.xmod import routing_state  # noqa: E402


class CopyCounter(TorchDispatchMode):
    """Row copies (``index_copy_``) and full-length clones of one step: the rebuild's launches on a GPU."""

    def __init__(self):
        super().__init__()
        self.counts = {"index_copy_": 0, "clone": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.index_copy_.default:
            self.counts["index_copy_"] += 1
        elif func is torch.ops.aten.clone.default:
            self.counts["clone"] += 1
        return func(*args, **(kwargs or {}))


def rebuild_from_base(cursor, base, links):
    """The rebuild before the cursor: the base cloned, then every earlier layer's rows copied in."""
    if not links:
        return base
    x = base.clone()
    flat = x.view(-1, x.shape[-1])
    for link in links:
        flat.index_copy_(0, link.index, link.after)
    return x


def measure(name: str, seq_len: int, steps: int) -> dict:
    from megatron_xmod.model import build_gpt_model

    config = model_config(CPU_BACKBONE, name, torch.device("cpu"), False)
    model = build_gpt_model(config, CPU_BACKBONE.vocab_size, seq_len, rotary_base=CPU_BACKBONE.rotary_base)
    tokens = torch.randint(0, CPU_BACKBONE.vocab_size, (1, seq_len))
    positions = torch.arange(seq_len)[None]

    def step():
        model.zero_grad(set_to_none=True)
        model(tokens, positions, None, labels=tokens).float().mean().backward()

    cursor = routing_state.ChainCursor.input
    times = {"cursor": [], "from_base": []}
    copies = {}
    try:
        step()  # warm-up
        for mode, rebuild in (("cursor", cursor), ("from_base", rebuild_from_base)):
            routing_state.ChainCursor.input = rebuild
            with CopyCounter() as counted:
                step()
            copies[mode] = dict(counted.counts)
        for i in range(2 * steps):
            mode = "cursor" if i % 2 == 0 else "from_base"
            routing_state.ChainCursor.input = cursor if mode == "cursor" else rebuild_from_base
            start = time.perf_counter()
            step()
            times[mode].append(time.perf_counter() - start)
    finally:
        routing_state.ChainCursor.input = cursor
    medians = {k: statistics.median(v) for k, v in times.items()}
    return dict(model=name, layers=config.num_layers, steps=steps, seconds=times, median_s=medians,
                ratio=medians["cursor"] / medians["from_base"], copies=copies)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["xmod-a4k8", "xmod-a3k16"])
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=4, help="timed steps per variant (interleaved)")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    a = p.parse_args(argv)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    meta = run_meta("cpu", dict(backbone=CPU_BACKBONE.name, seq_len=a.seq_len))
    with single_rank_megatron():
        rows = []
        for name in a.models:
            rows.append(measure(name, a.seq_len, a.steps))
            print(f"{name}: cursor {rows[-1]['median_s']['cursor']:.3f} s, from base "
                  f"{rows[-1]['median_s']['from_base']:.3f} s per fwd+bwd ({rows[-1]['ratio']:.3f}x)", flush=True)
    meta["loadavg_after"] = run_meta("cpu", {})["loadavg"]
    tag = f"cpu_{dt.date.today():%Y%m%d}"
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"chain_{tag}.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    lines = [f"# Router-input chain in backward: cursor vs rebuild from the block base ({meta['device']})", "",
             f"- {meta['date']}; commit {meta['commit']}; torch {meta['torch']}; load before/after {meta['loadavg']} / "
             f"{meta['loadavg_after']}",
             f"- backbone {CPU_BACKBONE.name}, L = {a.seq_len}, micro-batch 1, fp32; one forward + backward of the whole "
             f"model per step, the two variants interleaved, {a.steps} timed steps each (median)", "",
             "| model | layers | row copies + clones per step: cursor | from base | cursor s | from base s | cursor / from base |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        c, b = r["copies"]["cursor"], r["copies"]["from_base"]
        lines.append(f"| {r['model']} | {r['layers']} | {c['index_copy_']} + {c['clone']} | {b['index_copy_']} + {b['clone']} | "
                     f"{r['median_s']['cursor']:.3f} | {r['median_s']['from_base']:.3f} | {r['ratio']:.3f} |")
    with open(os.path.join(a.out, f"chain_{tag}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
