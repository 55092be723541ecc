"""Benchmark the routed-token permutation backends: achieved GB/s vs the device's copy bandwidth.

For every shape (L tokens per sequence, hidden h, nominal sparsity K -> k = L/K routed tokens) and
backend, times the four kernels a sparse layer runs per step through the public autograd ops
(gather fwd/bwd, gated scatter fwd/bwd) and converts each to GB/s using the minimum bytes the op
must move (below). The copy bandwidth (``dst.copy_(src)``) is measured in the same run, so the
"% of copy" column is comparable across machines.

    python bench/permute.py                      # GPU: full grid, every available backend
    python bench/permute.py --device cpu --L 4096 8192 --h 1024   # CPU: torch reference only

Writes bench/results/permute_<tag>.md and .json (date, device, commit, versions, every number).
"""
import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_xmod.permute import dispatch, gather_tokens, scatter_gated  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def minimal_bytes(op, s, k, b, h, esize):
    """Bytes an ideal kernel must read + write (indices and gate are counted, they are small)."""
    rows_s, rows_k, ib = s * b * h * esize, k * b * h * esize, k * b * 8
    return {
        "gather.fwd": 2 * rows_k + ib,                    # read routed rows, write [k,b,h]
        "gather.bwd": rows_s + rows_k + ib,               # write all of grad_x, read grad rows
        "scatter.fwd": 2 * rows_s + rows_k + ib + k * b * esize,  # read x, write out, read y
        "scatter.bwd": 3 * rows_k + ib + 2 * k * b * esize,  # read grad rows + y, write grad_y
    }[op]


class Timer:
    def __init__(self, device, reps, warmup):
        self.device, self.reps, self.warmup = device, reps, warmup

    def __call__(self, fn):
        for _ in range(self.warmup):
            fn()
        times = []
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            for _ in range(self.reps):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) / 1e3)
        else:
            for _ in range(self.reps):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times), min(times)


def copy_bandwidth(device, nbytes, timer):
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    _, best = timer(lambda: dst.copy_(src))
    return 2 * nbytes / best / 1e9  # best-of: the bandwidth the device can reach


def bench_shape(backend, L, h, K, b, dtype, device, timer):
    k = max(L // K, 1)
    gen = torch.Generator(device="cpu").manual_seed(0)
    idx = torch.stack([torch.randperm(L, generator=gen)[:k].sort().values for _ in range(b)], 1).to(device)
    x = torch.randn(L, b, h, dtype=dtype, device=device, requires_grad=True)
    y = torch.randn(k, b, h, dtype=dtype, device=device, requires_grad=True)
    gate = torch.rand(k, b, dtype=dtype, device=device, requires_grad=True)
    go_k = torch.randn(k, b, h, dtype=dtype, device=device)
    go_s = torch.randn(L, b, h, dtype=dtype, device=device)
    kw = dict(backend=backend, check=False)
    g_out = gather_tokens(x, idx, **kw)
    s_out = scatter_gated(x, y, gate, idx, **kw)
    fns = {
        "gather.fwd": lambda: gather_tokens(x, idx, **kw),
        "gather.bwd": lambda: torch.autograd.grad(g_out, (x,), go_k, retain_graph=True),
        "scatter.fwd": lambda: scatter_gated(x, y, gate, idx, **kw),
        # grad_x of the scatter is the incoming grad itself: only y and gate cost anything.
        "scatter.bwd": lambda: torch.autograd.grad(s_out, (y, gate), go_s, retain_graph=True),
    }
    rows = []
    for op, fn in fns.items():
        sec, best = timer(fn)
        nbytes = minimal_bytes(op, L, k, b, h, x.element_size())
        rows.append(dict(backend=backend, op=op, L=L, h=h, K=K, k=k, b=b, dtype=str(dtype).split(".")[-1],
                         us=sec * 1e6, best_us=best * 1e6, bytes=nbytes, gbps=nbytes / sec / 1e9,
                         best_gbps=nbytes / best / 1e9))
    return rows


def device_name(device):
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor() or "unknown CPU"
    return f"CPU: {model} ({torch.get_num_threads()} torch threads)"


def git_commit():
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "megatron_xmod/permute", "csrc", "bench/permute.py"],
                               cwd=ROOT, capture_output=True, text=True).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--L", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    p.add_argument("--h", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--K", type=int, nargs="+", default=[8, 16])
    p.add_argument("--b", type=int, default=1, help="micro-batch size (sequences)")
    p.add_argument("--backends", nargs="+", default=None,
                   help="default: every backend that runs on --device (torch only on CPU)")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--copy-mib", type=int, default=None, help="buffer size for the copy bandwidth")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--tag", default=None)
    a = p.parse_args()

    device = torch.device(a.device)
    on_gpu = device.type == "cuda"
    timer = Timer(device, a.reps or (50 if on_gpu else 5), a.warmup or (10 if on_gpu else 2))
    if a.backends is None:
        a.backends = [n for n in ("torch", "triton", "cuda")
                      if dispatch._unavailable(n, device, torch.bfloat16) is None]
    copy_gbps = copy_bandwidth(device, (a.copy_mib or (1024 if on_gpu else 256)) << 20, timer)
    print(f"device {device_name(device)}: copy bandwidth {copy_gbps:.1f} GB/s; backends {a.backends}", flush=True)

    rows = []
    for L in a.L:
        for h in a.h:
            for K in a.K:
                for be in a.backends:
                    for r in bench_shape(be, L, h, K, a.b, torch.bfloat16, device, timer):
                        r["pct_copy"] = 100 * r["gbps"] / copy_gbps
                        rows.append(r)
                        print(f"  {be:6s} {r['op']:11s} L={L:6d} h={h:5d} K={K:2d}: {r['us']:10.1f} us "
                              f"{r['gbps']:8.1f} GB/s ({r['pct_copy']:5.1f}% of copy)", flush=True)
    ref = {(r["op"], r["L"], r["h"], r["K"]): r["us"] for r in rows if r["backend"] == "torch"}
    for r in rows:
        t = ref.get((r["op"], r["L"], r["h"], r["K"]))
        r["speedup_vs_torch"] = t / r["us"] if t else None

    now = dt.datetime.now(dt.UTC)
    meta = dict(date=now.isoformat(timespec="seconds"), device=device_name(device), device_type=device.type,
                commit=git_commit(), torch=torch.__version__, cuda=torch.version.cuda,
                triton=_triton_version(), copy_gbps=copy_gbps, loadavg_end=_loadavg(), b=a.b, dtype="bfloat16",
                reps=timer.reps, argv=sys.argv[1:])
    tag = a.tag or f"{device.type}_{now.strftime('%Y%m%d')}"
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"permute_{tag}.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    with open(os.path.join(a.out, f"permute_{tag}.md"), "w") as f:
        f.write(render_markdown(meta, rows))
    print(f"wrote {a.out}/permute_{tag}.md and .json")


def _loadavg():
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


def _triton_version():
    try:
        import triton

        return triton.__version__
    except ImportError:
        return None


def render_markdown(meta, rows):
    out = [f"# Routed-token permutation benchmark ({meta['device_type']})", "",
           f"- date: {meta['date']}", f"- device: {meta['device']}", f"- commit: {meta['commit']}",
           f"- torch {meta['torch']} (CUDA {meta['cuda']}), triton {meta['triton']}",
           f"- copy bandwidth (`dst.copy_(src)`, read+write, best of runs) measured in this run: **{meta['copy_gbps']:.1f} GB/s**",
           f"- load average at the end (1/5/15 min): {meta['loadavg_end']}",
           f"- bf16, micro-batch b={meta['b']}, k = L/K routed tokens per sequence, median of {meta['reps']} runs; "
           "GB/s counts the minimum bytes each op must move (see `minimal_bytes` in bench/permute.py); "
           "times include the Python dispatch and autograd overhead of the public ops.", ""]
    if meta["device_type"] == "cpu":
        out += ["CPU run: only the torch reference runs natively here (Triton on CPU is the interpreter, a "
                "correctness tool; the CUDA extension needs a GPU). GPU numbers come from bench/gpu_check.sh.", ""]
        load, ncpu = meta.get("loadavg_end"), os.cpu_count() or 1
        if load and load[0] > ncpu:
            out += [f"The machine was shared during this run (load average {load[0]} on {ncpu} cores): medians "
                    "include waits for other processes (times near multiples of ~4 ms are scheduler slices), "
                    "so the best-of columns are the better estimate of what the code itself costs.", ""]
        out += ["On CPU the smaller shapes fit in the last-level cache while the copy buffer does not, so "
                "'% of copy' above 100 is cache bandwidth, not a better-than-copy kernel.", ""]
    out += ["| backend | op | L | h | K | k | median (us) | GB/s | % of copy | best (us) | best GB/s | speedup vs torch |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        sp = f"{r['speedup_vs_torch']:.2f}x" if r["speedup_vs_torch"] else "-"
        out.append(f"| {r['backend']} | {r['op']} | {r['L']} | {r['h']} | {r['K']} | {r['k']} | {r['us']:.1f} | "
                   f"{r['gbps']:.1f} | {r['pct_copy']:.1f} | {r['best_us']:.1f} | {r['best_gbps']:.1f} | {sp} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--render":  # re-render a .json result as markdown
        with open(sys.argv[2]) as f:
            d = json.load(f)
        sys.stdout.write(render_markdown(d["meta"], d["rows"]))
    else:
        main()
