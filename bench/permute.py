"""Kernel-only timing of the routed-token permutation primitives vs a copy of the same bytes.

For every shape (L tokens per sequence, hidden h, sparsity K -> k = L/K routed tokens, micro-batch
b, dtype) and backend, times the four kernels a sparse layer runs per step, called as the
backend's primitives (no autograd, no input checks):

    gather.fwd   gather(x, idx)                           the routed rows [k, b, h]
    gather.bwd   scatter_add_gated(None, dy, None, idx)   d x: zeros except the routed rows
    scatter.fwd  scatter_add_gated(x, y, gate, idx)       x + gate * y at the routed rows
    scatter.bwd  scatter_backward(dout, y, gate, idx)     d y and d gate

The fused routing step (``routing.fwd``: Triton vs its torch path, fp32 logits) is timed first,
per L and b. Each is compared with ``dst.copy_(src)`` moving the same number of bytes (``minimal_bytes``: what
an ideal kernel must read plus write), timed the same way; ``of copy`` = copy time / kernel time.

Timing on GPU: ``triton.testing.do_bench`` (median; it clears the L2 cache with a 256 MB write
before every call, and that write keeps the GPU busy while the host launches the next call, so
the events measure the kernel and not Python). On CPU: the median wall time of ``--reps`` calls.
Every finished row is appended to ``permute_<tag>.jsonl`` as it is measured (a run cut off by a
time limit keeps what it measured); the .json and .md are written at the end.

    python bench/permute.py                                   # GPU: the full grid (issue 15)
    python bench/permute.py --device cpu --L 512 --h 64 --b 1 --dtypes float32
    python bench/permute.py --sanitize-case                   # one small call of every kernel (compute-sanitizer)
    python bench/permute.py --render results.json             # markdown of a finished run
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

import torch  # noqa: E402

from megatron_xmod.xmod.permute import dispatch, reference  # noqa: E402

OPS = ("gather.fwd", "gather.bwd", "scatter.fwd", "scatter.bwd")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def minimal_bytes(op, s, k, b, h, esize):
    """Bytes an ideal kernel must read + write (indices and gate are counted, they are small)."""
    rows_s, rows_k, ib = s * b * h * esize, k * b * h * esize, k * b * 8
    return {
        "gather.fwd": 2 * rows_k + ib,  # read routed rows, write [k,b,h]
        "gather.bwd": rows_s + rows_k + ib,  # write all of grad_x, read grad rows
        "scatter.fwd": 2 * rows_s + rows_k + ib + k * b * esize,  # read x, write out, read y
        "scatter.bwd": 3 * rows_k + ib + 2 * k * b * esize,  # read grad rows + y, write grad_y
    }[op]


class TorchPrimitives:
    """The same three primitives in plain torch (what the layer runs without a kernel backend)."""

    @staticmethod
    def gather(x, idx):
        return reference.gather_tokens(x, idx)

    @staticmethod
    def scatter_add_gated(x, y, gate, idx, s):
        index = idx.unsqueeze(-1).expand(-1, -1, y.shape[-1])
        upd = y if gate is None else gate.unsqueeze(-1) * y
        base = x if x is not None else y.new_zeros((s,) + tuple(y.shape[1:]))
        return base.scatter_add(0, index, upd)

    @staticmethod
    def scatter_backward(go, y, gate, idx, need_y, need_gate):
        rows = reference.gather_tokens(go, idx)
        return (gate.unsqueeze(-1) * rows if need_y else None,
                (rows.float() * y.float()).sum(-1).to(gate.dtype) if need_gate else None)


def primitives(backend):
    return TorchPrimitives if backend == "torch" else dispatch._ops(backend)


def make_timer(device, reps, warmup_ms, rep_ms):
    if device.type == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median") / 1e3

    def cpu_timer(fn):
        fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return cpu_timer


def make_case(L, h, K, b, dtype, device, seed=0):
    k = max(L // K, 1)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    idx = torch.stack([torch.randperm(L, generator=gen)[:k].sort().values for _ in range(b)], 1).to(device)
    g = torch.Generator(device=device).manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=g, device=device, dtype=torch.float32).to(dtype)  # noqa: E731
    return dict(k=k, idx=idx, x=randn(L, b, h), y=randn(k, b, h), gate=randn(k, b).sigmoid().to(dtype),
                go_s=randn(L, b, h), go_k=randn(k, b, h))


def calls(p, c, L):
    """The four kernels of a sparse layer's step as zero-argument calls of primitives ``p``."""
    idx = c["idx"]
    return {
        "gather.fwd": lambda: p.gather(c["x"], idx),
        "gather.bwd": lambda: p.scatter_add_gated(None, c["go_k"], None, idx, L),
        "scatter.fwd": lambda: p.scatter_add_gated(c["x"], c["y"], c["gate"], idx, L),
        "scatter.bwd": lambda: p.scatter_backward(c["go_s"], c["y"], c["gate"], idx, True, True),
    }


def bench_shape(backends, L, h, K, b, dtype, device, timer, copy_buffers):
    c = make_case(L, h, K, b, dtype, device)
    k, esize = c["k"], c["x"].element_size()
    src, dst = copy_buffers
    rows = []
    copy_s = {}
    for op in OPS:
        n = minimal_bytes(op, L, k, b, h, esize) // 2  # copy reads n bytes and writes n bytes
        s_view, d_view = src[:n], dst[:n]
        copy_s[op] = timer(lambda d=d_view, s=s_view: d.copy_(s))
    for backend in backends:
        for op, fn in calls(primitives(backend), c, L).items():
            sec = timer(fn)
            nbytes = minimal_bytes(op, L, k, b, h, esize)
            rows.append(dict(backend=backend, op=op, L=L, h=h, K=K, k=k, b=b, dtype=str(dtype).split(".")[-1],
                             us=sec * 1e6, bytes=nbytes, gbps=nbytes / sec / 1e9, copy_us=copy_s[op] * 1e6,
                             copy_gbps=nbytes / copy_s[op] / 1e9, of_copy=copy_s[op] / sec))
    return rows


def bench_routing(L, K, b, device, timer, copy_buffers):
    """The fused routing step (megatron_xmod.xmod.kernels) vs its torch path, forward, fp32 logits [L, b]:
    is one program per sequence fast enough against torch.topk + sort + the elementwise ops?"""
    from megatron_xmod.xmod.kernels import routing_step

    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(L, b, generator=gen, device=device)
    carried = (torch.rand(L, b, generator=gen, device=device) < 0.3).float()
    k = L // K
    # read logits + bias; write scores, bias, mask, slot; write indices and gates
    nbytes = L * b * (4 + 4 + 4 + 4 + 1 + 4) + k * b * (8 + 4)
    src, dst = copy_buffers
    copy_s = timer(lambda: dst[: nbytes // 2].copy_(src[: nbytes // 2]))
    rows = []
    backends = ["torch"] + (["triton"] if device.type == "cuda" else [])
    for backend in backends:
        sec = timer(lambda be=backend: routing_step(logits, K, "topk", carried, 0.5, backend=be))
        rows.append(dict(backend=backend, op="routing.fwd", L=L, h=0, K=K, k=k, b=b, dtype="float32", us=sec * 1e6,
                         bytes=nbytes, gbps=nbytes / sec / 1e9, copy_us=copy_s * 1e6, copy_gbps=nbytes / copy_s / 1e9,
                         of_copy=copy_s / sec))
    return rows


def sanitize_case(device) -> int:
    """One small call of every kernel backend's primitives and of the fused routing step, checked
    against the torch reference: the workload compute-sanitizer inspects (bench/gpu_check.sh)."""
    from megatron_xmod.xmod.kernels import routing_step
    from megatron_xmod.xmod.kernels.routing_step import routing_step_torch

    failures = 0
    backends = [n for n in ("triton", "cuda") if dispatch._unavailable(n, device, torch.float32) is None]
    for backend in backends:
        p, ref = primitives(backend), TorchPrimitives
        for dtype in (torch.float32, torch.bfloat16):
            c = make_case(67, 45, 4, 3, dtype, device, seed=1)  # odd sizes: the masked tails
            pairs = [(p.gather(c["x"], c["idx"]), ref.gather(c["x"], c["idx"])),
                     (p.scatter_add_gated(c["x"], c["y"], c["gate"], c["idx"], 67),
                      ref.scatter_add_gated(c["x"], c["y"], c["gate"], c["idx"], 67)),
                     (p.scatter_add_gated(None, c["go_k"], None, c["idx"], 67),
                      ref.scatter_add_gated(None, c["go_k"], None, c["idx"], 67))]
            pairs += list(zip(p.scatter_backward(c["go_s"], c["y"], c["gate"], c["idx"], True, True),
                              ref.scatter_backward(c["go_s"], c["y"], c["gate"], c["idx"], True, True)))
            for i, (got, want) in enumerate(pairs):
                tol = 1e-5 if dtype == torch.float32 else 3e-2
                if not torch.allclose(got.float(), want.float(), atol=tol, rtol=tol):
                    print(f"MISMATCH {backend} {dtype} primitive #{i}")
                    failures += 1
    if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        logits = torch.randn(300, 3, device=device, requires_grad=True)
        carried = (torch.rand(300, 3, device=device) < 0.3).float()
        got = routing_step(logits, 4, "topk", carried, 0.5, backend="triton")
        want = routing_step_torch(logits, 4, "topk", carried, 0.5, 1.0)
        (got.decision.scores.sum() + got.gate.sum()).backward()
        if not torch.equal(got.decision.topk_indices, want.decision.topk_indices):
            print("MISMATCH routing step")
            failures += 1
        backends.append("routing_step(triton)")
    if device.type == "cuda":
        torch.cuda.synchronize()
    print(f"sanitize case on {device}: {', '.join(backends) or 'no kernel backend'}; {failures} mismatches")
    return 1 if failures else 0


def main(argv=None):
    from bench.throughput import machine_name, run_meta

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--L", type=int, nargs="+", default=[4096, 32768])
    p.add_argument("--h", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--K", type=int, nargs="+", default=[8])
    p.add_argument("--b", type=int, nargs="+", default=[1, 4])
    p.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    p.add_argument("--backends", nargs="+", choices=dispatch.BACKENDS, default=None,
                   help="default: the kernel backends that run on --device (torch on CPU)")
    p.add_argument("--reps", type=int, default=3, help="CPU: timed calls per kernel")
    p.add_argument("--warmup-ms", type=float, default=5, help="GPU: do_bench warm-up time per kernel")
    p.add_argument("--rep-ms", type=float, default=20, help="GPU: do_bench measuring time per kernel")
    p.add_argument("--max-seconds", type=float, default=None, help="stop the grid after this long (rows so far kept)")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--tag", default=None)
    p.add_argument("--sanitize-case", action="store_true", help="one small checked call of every kernel, then exit")
    a = p.parse_args(argv)

    device = torch.device(a.device)
    if a.sanitize_case:
        return sanitize_case(device)
    if a.backends is None:
        a.backends = [n for n in ("triton", "cuda") if dispatch._unavailable(n, device, torch.bfloat16) is None]
        a.backends = a.backends if device.type == "cuda" else ["torch"]
    for be in a.backends:
        why = dispatch._unavailable(be, device, torch.bfloat16)
        if why is not None:
            p.error(f"--backends: {be} cannot run here ({why})")
    timer = make_timer(device, a.reps, a.warmup_ms, a.rep_ms)
    largest = max(minimal_bytes("scatter.fwd", L, L // min(a.K), b, h, 4)
                  for L in a.L for h in a.h for b in a.b) // 2 + 16
    copy_buffers = (torch.empty(largest, dtype=torch.uint8, device=device).random_(),
                    torch.empty(largest, dtype=torch.uint8, device=device))
    tag = a.tag or f"{device.type}_{dt.datetime.now(dt.UTC).strftime('%Y%m%d')}"
    os.makedirs(a.out, exist_ok=True)
    stream = open(os.path.join(a.out, f"permute_{tag}.jsonl"), "w")
    print(f"device {machine_name(device)}; backends {a.backends}", flush=True)
    rows, t_start, cut = [], time.monotonic(), False

    def keep(r):
        rows.append(r)
        stream.write(json.dumps(r) + "\n")
        stream.flush()
        print(f"  {r['backend']:6s} {r['op']:11s} {r['dtype']:8s} L={r['L']:6d} h={r['h']:5d} b={r['b']} K={r['K']:2d}: "
              f"{r['us']:10.1f} us {r['gbps']:8.1f} GB/s ({r['of_copy']:6.1%} of copy)", flush=True)

    for L in a.L:
        for b in a.b:
            for r in bench_routing(L, min(a.K), b, device, timer, copy_buffers):
                keep(r)
    for dname in a.dtypes:
        for L in a.L:
            for h in a.h:
                for b in a.b:
                    for K in a.K:
                        if a.max_seconds and time.monotonic() - t_start > a.max_seconds:
                            cut = True
                            break
                        for r in bench_shape(a.backends, L, h, K, b, DTYPES[dname], device, timer, copy_buffers):
                            keep(r)
                        if device.type == "cuda":
                            torch.cuda.empty_cache()
    stream.close()
    meta = run_meta(device, dict(argv=sys.argv[1:] if argv is None else argv, cut_short=cut,
                                 timing="triton.testing.do_bench, L2 cleared before every call, median"
                                 if device.type == "cuda" else f"median wall time of {a.reps} calls"))
    with open(os.path.join(a.out, f"permute_{tag}.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    with open(os.path.join(a.out, f"permute_{tag}.md"), "w") as f:
        f.write(render_markdown(meta, rows))
    print(f"wrote {a.out}/permute_{tag}.md, .json and .jsonl")
    return 0


def render_markdown(meta, rows):
    out = [f"# Routed-token permutation kernels ({meta['device']})", "",
           f"- date: {meta['date']}; commit {meta['commit']}; torch {meta['torch']} (CUDA {meta['cuda']}), "
           f"triton {meta['triton']}",
           f"- timing: {meta.get('timing')}; kernel primitives called directly (no autograd, no checks)",
           "- GB/s counts the minimum bytes each op must move (`minimal_bytes`); `of copy` = time of "
           "`dst.copy_(src)` moving the same bytes / time of the kernel",
           f"- load average at the end: {meta['loadavg']}" + ("; the grid was cut short by --max-seconds"
                                                             if meta.get("cut_short") else ""), ""]
    target = [r for r in rows if r["op"] in ("scatter.fwd", "gather.bwd") and r["h"] >= 2048 and r["L"] >= 32768]
    if target:
        worst = min(target, key=lambda r: r["of_copy"])
        out += [f"Target (gated scatter forward and gather backward >= 80% of copy for h >= 2048 at L = 32768): "
                f"worst {worst['of_copy']:.0%} ({worst['backend']} {worst['op']} {worst['dtype']} h={worst['h']} "
                f"b={worst['b']}); {sum(r['of_copy'] >= 0.8 for r in target)}/{len(target)} cases meet it.", ""]
    out += ["| backend | op | dtype | L | h | b | K | us | GB/s | copy GB/s | of copy |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['backend']} | {r['op']} | {r['dtype']} | {r['L']} | {r['h']} | {r['b']} | {r['K']} | "
                   f"{r['us']:.1f} | {r['gbps']:.0f} | {r['copy_gbps']:.0f} | {r['of_copy']:.0%} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--render":  # re-render a .json result as markdown
        with open(sys.argv[2]) as f:
            d = json.load(f)
        sys.stdout.write(render_markdown(d["meta"], d["rows"]))
        sys.exit(0)
    sys.exit(main())
