"""Host cost of the routed layers (issue 28, item 1): is a 161- or 298-layer model host-bound?

1. Layers: host time (us) per call of a dense, an X-MoD sparse and a MoD sparse layer, forward and
   backward apart, built as bench/ops.py builds them, at a width where compute is negligible
   (h = 64, L = 128, b = 1): wall clock of ``--calls`` calls, median of ``--repeats``. On CUDA the
   times are CPU-side timestamps (no synchronisation inside the loop; one before and after), i.e.
   the time Python and the framework take to issue the work. The launches per call (bench/ops.py's
   counting, CUDA kernel events on a GPU) give the host time per launch.
2. Steps: the whole training step (megatron's forward_backward_func over one micro-batch, then the
   DistributedOptimizer step; bench/throughput.py's ModelRun) of Dense / MoD / A4K8 / A3K16 at that
   width and the backbone's activated depth (28), set against the sum of their layers' host times.
3. Step model: for the headline configurations (1.65b backbone, L = 32768, TP 8, one micro-batch),
   device time = forward FLOPs per token x 3 x L / TP / (peak x MFU) (megatron_xmod.accounting, as
   ``xmod count --backbone 1.65b`` prints them) and host time = sum over layers of launches per
   layer x host time per launch, eager (measured here) and graphed (one graph launch per layer for
   the forward and one for the backward, at GRAPH_LAUNCH_US each); host-bound factor = host / device.
4. On CUDA (``--graphs``): eager vs CUDA-graph fwd+bwd of a Dense and an A3K16 model at that width
   (``torch.cuda.graph``; a capture that fails is a result: its error is recorded), and one training
   step under ``torch.profiler``: wall, host (sum of the ops' self CPU time) and device (sum of
   kernel time) per step.

    python bench/host_overhead.py                    # CPU, writes bench/results/host_overhead_cpu_<date>.*
    python bench/host_overhead.py --device cuda --graphs
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

from bench import ops, throughput  # noqa: E402
from megatron_xmod.accounting import count  # noqa: E402
from megatron_xmod.presets import Backbone, get_backbone, parse_model  # noqa: E402

MODELS = ("dense", "mod", "xmod-a4k8", "xmod-a3k16")
# The Table 4 shape (GQA 2:1, SwiGLU 3x, 28 activated layers) at a width where compute is negligible.
HOST_BACKBONE = Backbone("host-64", hidden_size=64, head_dim=16, num_attention_heads=4, num_query_groups=2,
                         ffn_hidden_size=192, num_layers=28, vocab_size=256, rotary_base=10000)
# Peak dense (no 2:4 sparsity) bf16 tensor-core FLOP/s, from NVIDIA's datasheets: A100 SXM 312 TFLOP/s
# ("NVIDIA A100 Tensor Core GPU" datasheet), H100 SXM5 989 TFLOP/s (1979 "with sparsity", "NVIDIA H100
# Tensor Core GPU" datasheet), H200 SXM 989 TFLOP/s (same GH100 tensor cores, "NVIDIA H200" datasheet).
PEAK_BF16_FLOPS = {"A100": 312e12, "H100": 989e12, "H200": 989e12}
# Host cost of one cudaGraphLaunch, an assumption (order of one eager launch's host cost; a graph
# launch is one API call whatever the number of kernels in it), not measured here: gpu_check.sh's
# host step measures eager vs graphed steps on the GPU.
GRAPH_LAUNCH_US = 10.0
GRAPHS_PER_LAYER = 2  # megatron's per-layer CUDA graphs: one for the forward, one for the backward
HEADLINE = dict(backbone="1.65b", seq_len=32768, tp=8, micro_batch=1)
# Inter-node bandwidth per GPU, one direction (bytes/s): DGX A100 has one 200 Gb/s HDR InfiniBand
# port per GPU, DGX H100 / H200 one 400 Gb/s NDR port per GPU (NVIDIA's DGX datasheets).
LINK_BYTES_PER_S = {"A100": 25e9, "H100": 50e9, "H200": 50e9}
# Per optimizer step, the paper's protocol (80 sequences a step on 8 GPUs: 10 micro-batches a GPU),
# and a data-parallel group across nodes (TP 8 fills a node: DP = the number of nodes).
DP_STEP = dict(dp=8, micro_batches=10)
# megatron's DDP bucket when none is given: max(40M, 1M x DP) parameters (DistributedDataParallel.__init__).
DDP_BUCKET_PARAMS = 40e6


# ------------------------------------------------------------------------------------ 1. layers

def time_layer(layer, hidden, rope, device, before=None, calls=50, repeats=5) -> dict:
    """Host time (us) of one forward and one backward call: the mean over ``calls`` calls, median
    (and best) of ``repeats``; wall clock, and this process's CPU time (``time.process_time``,
    which leaves out the waits for other processes on a shared machine)."""
    grad = torch.randn_like(hidden)
    layer.train()
    for _ in range(3):  # warm-up
        if before:
            before()
        out, _ = layer(hidden.detach().requires_grad_(True), attention_mask=None, rotary_pos_emb=rope)
        out.backward(grad)
    wall = {"forward": [], "backward": []}
    cpu = {"forward": [], "backward": []}
    for _ in range(repeats):
        inputs = [hidden.detach().clone().requires_grad_(True) for _ in range(calls)]
        throughput._sync(device)
        sums = dict.fromkeys(("fw", "bw", "fc", "bc"), 0.0)
        for x in inputs:
            if before:
                before()
            t0, c0 = time.perf_counter(), time.process_time()
            out, _ = layer(x, attention_mask=None, rotary_pos_emb=rope)
            t1, c1 = time.perf_counter(), time.process_time()
            out.backward(grad)
            t2, c2 = time.perf_counter(), time.process_time()
            sums["fw"] += t1 - t0
            sums["bw"] += t2 - t1
            sums["fc"] += c1 - c0
            sums["bc"] += c2 - c1
        throughput._sync(device)
        wall["forward"].append(sums["fw"] / calls * 1e6)
        wall["backward"].append(sums["bw"] / calls * 1e6)
        cpu["forward"].append(sums["fc"] / calls * 1e6)
        cpu["backward"].append(sums["bc"] / calls * 1e6)
    out = {}
    for phase in ("forward", "backward"):
        out.update({f"{phase}_us": statistics.median(wall[phase]), f"{phase}_best_us": min(wall[phase]),
                    f"{phase}_cpu_us": statistics.median(cpu[phase]), f"{phase}_us_all": wall[phase]})
    return out


def measure_layers(device, seq_len=128, batch=1, hidden_size=64, calls=50, repeats=5) -> list[dict]:
    """Host us per call and launches per call of the three layers, forward and backward."""
    ops._set_path("fused" if device.type == "cuda" else "torch")
    try:
        targets, rope, hidden, _models = ops.build_layers(device, seq_len, batch, hidden_size, head_dim=16,
                                                          ffn_hidden_size=3 * hidden_size)
        rows = []
        for name, (layer, before) in targets.items():
            timed = time_layer(layer, hidden, rope, device, before, calls, repeats)
            counted = {r["phase"]: r for r in ops.profile_layer(layer, hidden, rope, device, before, with_stack=False)}
            key = "cuda_kernels" if device.type == "cuda" else "kernels"
            launches = {phase: counted[phase][key] for phase in ("forward", "backward")}
            rows.append(dict(layer=name, **timed, forward_launches=launches["forward"],
                             backward_launches=launches["backward"],
                             us_per_launch=(timed["forward_us"] + timed["backward_us"])
                             / max(1, launches["forward"] + launches["backward"]),
                             cpu_us_per_launch=(timed["forward_cpu_us"] + timed["backward_cpu_us"])
                             / max(1, launches["forward"] + launches["backward"])))
    finally:
        ops._set_path("torch")
        for name in ("XMOD_ROUTING_BACKEND", "XMOD_PERMUTE_CHECK"):
            os.environ.pop(name, None)
    return rows


def host_us_per_launch(layer_rows, basis: str = "") -> float:
    """All three layers' host time over all their launches (forward and backward); ``basis``
    "" (wall clock) or "cpu_" (this process's CPU time)."""
    us = sum(r[f"forward_{basis}us"] + r[f"backward_{basis}us"] for r in layer_rows)
    return us / sum(r["forward_launches"] + r["backward_launches"] for r in layer_rows)


# ------------------------------------------------------------------------------------ 2. steps

def sparse_layer_kind(model: str) -> str:
    return "mod_sparse" if model.startswith("mod") else "xmod_sparse"


def measure_steps(device, models=MODELS, backbone=HOST_BACKBONE, seq_len=128, warmup=1, steps=3, layer_rows=None):
    """Whole training steps (one micro-batch) at the host width, interleaved as throughput.py does,
    with the sum of the layers' host times for comparison."""
    results = throughput.time_models(backbone, models, seq_len, 1, 1, device, device.type == "cuda", warmup, steps,
                                     1, interleave=True)
    per_layer = {r["layer"]: r["forward_us"] + r["backward_us"] for r in layer_rows or []}
    rows = []
    for m in models:
        layout = parse_model(m, backbone).layout
        r = results[m]
        n_sparse = layout.num_sparse_layers
        n_dense = layout.num_layers - n_sparse
        layers_ms = ((n_dense * per_layer["dense"] + n_sparse * per_layer[sparse_layer_kind(m)]) / 1e3
                     if per_layer else None)
        rows.append(dict(model=m, num_layers=layout.num_layers, num_sparse_layers=n_sparse,
                         fwd_bwd_ms=r["fwd_bwd_s"] * 1e3, optimizer_ms=r["optimizer_s"] * 1e3,
                         step_ms=(r["fwd_bwd_s"] + r["optimizer_s"]) * 1e3,
                         fwd_bwd_us_per_layer=r["fwd_bwd_s"] * 1e6 / layout.num_layers,
                         layers_sum_ms=layers_ms, fwd_bwd_s_all=r["train_fwd_bwd_s"],
                         optimizer_s_all=r["train_optimizer_s"], params=r["params"]))
    return rows


# ------------------------------------------------------------------------------------ 3. step model

def step_model(flops_per_token, seq_len, tp, n_dense, n_sparse, dense_launches, sparse_launches, us_per_launch,
               peak_flops, mfu, micro_batch=1, graph_launch_us=GRAPH_LAUNCH_US, graphs_per_layer=GRAPHS_PER_LAYER):
    """Device and host seconds per micro-batch (forward + backward) of one GPU, and host / device.

    device = flops_per_token x 3 (forward + backward) x tokens / TP / (peak x MFU);
    host eager = (n_dense x dense launches + n_sparse x sparse launches) x us_per_launch;
    host graphed = layers x graphs_per_layer x graph_launch_us."""
    flops = flops_per_token * 3 * seq_len * micro_batch / tp
    device_s = flops / (peak_flops * mfu)
    launches = n_dense * dense_launches + n_sparse * sparse_launches
    eager_s = launches * us_per_launch * 1e-6
    graphed_s = (n_dense + n_sparse) * graphs_per_layer * graph_launch_us * 1e-6
    return dict(flops_per_gpu=flops, device_s=device_s, launches=launches, eager_host_s=eager_s,
                graphed_host_s=graphed_s, eager_factor=eager_s / device_s, graphed_factor=graphed_s / device_s)


def dp_sync_model(total_params, tp, dp, link_bytes_per_s, grad_bytes=4, param_bytes=2):
    """Bytes and seconds per optimizer step that one GPU moves for megatron's distributed optimizer over
    a data-parallel group of ``dp`` ranks (ring collectives): the reduce-scatter of the fp32 gradient
    buffer and the all-gather of the bf16 parameters, each (dp - 1) / dp of this GPU's share
    total_params / TP. Every parameter counts, not only the activated ones: X-MoD's 5-10x Dense's
    parameters (``xmod count``, column N) move 5-10x the bytes whatever the FLOPs per token."""
    per_gpu = total_params / tp
    share = (dp - 1) / dp
    reduce_scatter_s = per_gpu * grad_bytes * share / link_bytes_per_s
    all_gather_s = per_gpu * param_bytes * share / link_bytes_per_s
    return dict(dp=dp, dp_bytes=per_gpu * (grad_bytes + param_bytes) * share, dp_sync_s=reduce_scatter_s + all_gather_s,
                dp_reduce_scatter_s=reduce_scatter_s, dp_all_gather_s=all_gather_s, dp_params_per_gpu=per_gpu)


def exposed_sync_s(synced: dict, micro_batch_device_s: float, bucket_params: float = DDP_BUCKET_PARAMS) -> float:
    """What of :func:`dp_sync_model`'s sync a step still waits for with --overlap-grad-reduce and
    --overlap-param-gather (the launchers' setting): each gradient bucket's reduce-scatter runs while the last
    micro-batch's backward (2/3 of its device time) computes the buckets before it, each parameter bucket's
    all-gather while the next forward (1/3) computes the layers before it; what does not fit behind them is
    exposed, and so is one bucket of each (the last gradient bucket, the first parameter bucket), which
    nothing precedes or follows. A model: communication and compute share nothing (no SM or memory
    contention), buckets even."""
    bucket = min(1.0, bucket_params / synced["dp_params_per_gpu"]) if synced["dp_params_per_gpu"] else 0.0
    exposed = 0.0
    for collective_s, hidden_behind_s in ((synced["dp_reduce_scatter_s"], micro_batch_device_s * 2 / 3),
                                          (synced["dp_all_gather_s"], micro_batch_device_s / 3)):
        exposed += max(collective_s - hidden_behind_s, collective_s * bucket)
    return exposed


def headline_table(layer_rows, us_per_launch, mfu=0.45, gpus=tuple(PEAK_BF16_FLOPS), models=MODELS,
                   backbone=HEADLINE["backbone"], seq_len=HEADLINE["seq_len"], tp=HEADLINE["tp"],
                   graph_launch_us=GRAPH_LAUNCH_US, cpu_us_per_launch=None, dp_step=DP_STEP) -> list[dict]:
    """The step model of every model x GPU; with ``cpu_us_per_launch`` also the eager host time on
    the CPU-time basis (``eager_host_cpu_s``, ``eager_cpu_factor``); per optimizer step of
    ``dp_step['micro_batches']`` micro-batches, the data-parallel sync over ``dp_step['dp']`` ranks
    (:func:`dp_sync_model`) and its share of the step if nothing overlaps it, and what megatron's overlap
    leaves exposed (:func:`exposed_sync_s`)."""
    b = get_backbone(backbone)
    launches = {r["layer"]: r["forward_launches"] + r["backward_launches"] for r in layer_rows}
    rows = []
    for m in models:
        description = parse_model(m, b)
        counted = count(description, seq_len)
        n_sparse = description.layout.num_sparse_layers
        n_dense = description.layout.num_layers - n_sparse
        for gpu in gpus:
            predicted = step_model(counted.flops_per_token, seq_len, tp, n_dense, n_sparse, launches["dense"],
                                   launches[sparse_layer_kind(m)], us_per_launch, PEAK_BF16_FLOPS[gpu], mfu,
                                   graph_launch_us=graph_launch_us)
            if cpu_us_per_launch is not None:
                predicted["eager_host_cpu_s"] = predicted["launches"] * cpu_us_per_launch * 1e-6
                predicted["eager_cpu_factor"] = predicted["eager_host_cpu_s"] / predicted["device_s"]
            # Per optimizer step: the micro-batches' device time against the data-parallel sync, not overlapped
            # and overlapped as the launchers run it.
            synced = dp_sync_model(counted.total_params, tp, dp_step["dp"], LINK_BYTES_PER_S[gpu])
            step_device_s = dp_step["micro_batches"] * predicted["device_s"]
            exposed = exposed_sync_s(synced, predicted["device_s"])
            predicted.update(synced, total_params=counted.total_params, micro_batches=dp_step["micro_batches"],
                             step_device_s=step_device_s,
                             dp_sync_fraction=synced["dp_sync_s"] / (step_device_s + synced["dp_sync_s"]),
                             dp_exposed_s=exposed, dp_exposed_fraction=exposed / (step_device_s + exposed))
            rows.append(dict(model=m, gpu=gpu, num_layers=description.layout.num_layers,
                             flops_per_token=counted.flops_per_token, mfu=mfu, **predicted))
    return rows


# ------------------------------------------------------------------------------------ 4. GPU only

def graph_rows(device, models=("dense", "xmod-a3k16"), backbone=HOST_BACKBONE, seq_len=128, iters=20) -> list[dict]:
    """Eager vs CUDA-graph forward+backward of the unwrapped GPT model at the host width. A capture
    that fails is recorded with its error (the routed layers keep state outside their inputs and
    outputs; see bench/README.md)."""
    if device.type != "cuda":
        return [dict(model=m, error="skipped: CUDA graphs need a CUDA device") for m in models]
    from megatron_xmod.model import build_gpt_model

    rows = []
    for m in models:
        row = dict(model=m, num_layers=parse_model(m, backbone).layout.num_layers)
        try:
            config = throughput.model_config(backbone, m, device, bf16=False)
            model = build_gpt_model(config, backbone.vocab_size, seq_len, rotary_base=backbone.rotary_base).cuda().train()
            tokens = torch.randint(0, backbone.vocab_size, (1, seq_len), device=device)
            labels = torch.randint(0, backbone.vocab_size, (1, seq_len), device=device)
            position_ids = torch.arange(seq_len, device=device).unsqueeze(0)

            def fwd_bwd(model=model, tokens=tokens, position_ids=position_ids, labels=labels):
                loss = model(tokens, position_ids, None, labels=labels).float().mean()
                loss.backward()
                return loss

            for _ in range(3):
                fwd_bwd()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(iters):
                fwd_bwd()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            row.update(eager_host_ms=(t1 - t0) / iters * 1e3, eager_wall_ms=(t2 - t0) / iters * 1e3)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):
                    fwd_bwd()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph):
                    fwd_bwd()
            except Exception as e:  # noqa: BLE001 - the capture's failure is the result
                # the first error inside the capture, when ending the capture raised another one
                first = e.__context__ if e.__context__ is not None else e
                row["capture_error"] = "; ".join(f"{type(x).__name__}: {str(x).splitlines()[0] if str(x) else ''}"[:300]
                                                 for x in dict.fromkeys([first, e]))
                rows.append(row)
                continue
            graph.replay()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(iters):
                graph.replay()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            row.update(graph_host_ms=(t1 - t0) / iters * 1e3, graph_wall_ms=(t2 - t0) / iters * 1e3,
                       speedup=row["eager_wall_ms"] / ((t2 - t0) / iters * 1e3))
        except Exception as e:  # noqa: BLE001 - recorded, the other rows still run
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:400]
        rows.append(row)
        throughput.free_memory(device)
    return rows


def fitting_seq_len(backbone, model: str, seq_len: int, device, least: int = 4096) -> int:
    """``seq_len``, halved (not below ``least``) while throughput.py's estimate of ``model``'s training memory
    exceeds 90% of the GPU's: A3K16 at 298m and L = 32768 is ~117 GB by that estimate, which an H200 holds
    and an H100 does not."""
    if device.type != "cuda":
        return seq_len
    total_gib = torch.cuda.get_device_properties(device).total_memory / 2**30
    while seq_len // 2 >= least and sum(throughput.estimated_parts_gib(backbone, model, seq_len, 1)) > 0.9 * total_gib:
        seq_len //= 2
    return seq_len


def profile_steps(device, models=("dense", "xmod-a3k16"), backbone=HOST_BACKBONE, seq_len=128) -> list[dict]:
    """One training step (one micro-batch, after a warm-up step) under torch.profiler: wall, host
    (sum of the ops' self CPU time; the profiler's own overhead included) and device (sum of the
    kernels' time) per step. Every model at the longest of ``seq_len``, ``seq_len`` / 2, ... that the
    memory estimate fits on the GPU (the row's seq_len)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    seq_len = min(fitting_seq_len(backbone, m, seq_len, device) for m in models)  # one length: the rows compare
    rows = []
    for m in models:
        try:
            run = throughput.ModelRun(backbone, m, seq_len, 1, 1, device, device.type == "cuda")
            run.train_step(timed=False)
            with profile(activities=activities) as prof:
                run.train_step(timed=True)
        except Exception as e:  # noqa: BLE001 - recorded (e.g. out of memory, or a context a failed capture broke)
            rows.append(dict(model=m, backbone=backbone.name, seq_len=seq_len, error=f"{type(e).__name__}: {e}"[:300]))
            run = None
            throughput.free_memory(device)
            continue
        events = prof.key_averages()
        host_us = sum(e.self_cpu_time_total for e in events)
        device_us = (sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) for e in events)
                     if device.type == "cuda" else None)
        wall = run.fwd_bwd_s[-1] + run.optimizer_s[-1]
        rows.append(dict(model=m, backbone=backbone.name, seq_len=seq_len, num_layers=parse_model(m, backbone).layout.num_layers,
                         wall_ms=wall * 1e3, host_ops_ms=host_us / 1e3,
                         device_ms=device_us / 1e3 if device_us is not None else None,
                         device_busy=(device_us / 1e6 / wall) if device_us is not None else None))
        del run
        throughput.free_memory(device)
    return rows


# ------------------------------------------------------------------------------------ report

def render_markdown(meta, layers, steps, model_rows, graphs, profiled) -> str:
    f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    out = [f"# Host cost of dense and routed layers ({meta['device']})", "",
           f"- date: {meta['date']}; commit {meta['commit']}; torch {meta['torch']}",
           f"- load average before/after (1/5/15 min): {meta['loadavg_start']} / {meta['loadavg']}",
           f"- layers: h={meta['hidden_size']}, L={meta['seq_len']}, b=1; {meta['calls']} calls, median of "
           f"{meta['repeats']} repeats; routing path {meta['path']}", "",
           "## Host time per layer call", "",
           "| layer | forward us (best, CPU time) | launches | backward us (best, CPU time) | launches | us per launch |",
           "|---|---:|---:|---:|---:|---:|"]
    for r in layers:
        out.append(f"| {r['layer']} | {r['forward_us']:.0f} ({r['forward_best_us']:.0f}, {r['forward_cpu_us']:.0f}) | "
                   f"{r['forward_launches']} | {r['backward_us']:.0f} ({r['backward_best_us']:.0f}, "
                   f"{r['backward_cpu_us']:.0f}) | {r['backward_launches']} | {r['us_per_launch']:.1f} |")
    out += ["", f"All three layers: {meta['us_per_launch']:.1f} us per launch (wall clock, median: the step model's "
            f"host cost per eager launch); {f(meta.get('cpu_us_per_launch'), '.1f')} us on the CPU-time basis (this "
            f"process's CPU time with {meta.get('torch_threads')} torch thread(s): the waits for other processes "
            "left out). Best: the fastest repeat.", "",
            f"## Whole training step at h={meta['hidden_size']}, L={meta['seq_len']}, activated depth "
            f"{meta['activated_depth']} (one micro-batch; models interleaved)", "",
            "| model | layers | fwd+bwd ms | optimizer ms | fwd+bwd us per layer | sum of its layers' calls ms |",
            "|---|---:|---:|---:|---:|---:|"]
    for r in steps:
        out.append(f"| {r['model']} | {r['num_layers']} | {r['fwd_bwd_ms']:.1f} | {r['optimizer_ms']:.1f} | "
                   f"{r['fwd_bwd_us_per_layer']:.0f} | {f(r['layers_sum_ms'], '.1f')} |")
    h = meta["headline"]
    out += ["", f"## Step model: backbone {h['backbone']}, L={h['seq_len']}, TP {h['tp']}, one micro-batch, "
            f"MFU {meta['mfu']:.0%}", "",
            f"device = FLOPs/token x 3 x L / TP / (peak bf16 x MFU); host eager = launches x {meta['us_per_launch']:.1f} "
            f"us (measured above, this CPU); host graphed = layers x {GRAPHS_PER_LAYER} x {meta['graph_launch_us']:.0f} us "
            "(assumed per graph launch). Launch counts per layer from the table above (TP 1: TP adds its "
            "collectives, a few per layer).", "",
            "| model | GPU | layers | FLOPs/GPU | device ms | launches | host eager ms | eager host/device "
            "| eager, CPU-time basis | host graphed ms | graphed host/device |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in model_rows:
        cpu_basis = (f"{r['eager_host_cpu_s'] * 1e3:.0f} ms, {r['eager_cpu_factor']:.2f}x" if "eager_cpu_factor" in r
                     else "-")
        out.append(f"| {r['model']} | {r['gpu']} | {r['num_layers']} | {r['flops_per_gpu']:.2e} | {r['device_s'] * 1e3:.0f} | "
                   f"{r['launches']} | {r['eager_host_s'] * 1e3:.0f} | {r['eager_factor']:.2f}x | {cpu_basis} | "
                   f"{r['graphed_host_s'] * 1e3:.1f} | {r['graphed_factor']:.3f}x |")
    if model_rows and "dp_sync_s" in model_rows[0]:
        r0 = model_rows[0]
        out += ["", f"## Per optimizer step: {r0['micro_batches']} micro-batches and the data-parallel sync over "
                f"DP {r0['dp']} (TP {h['tp']})", "",
                "Megatron's distributed optimizer reduce-scatters the fp32 gradients and all-gathers the bf16 "
                "parameters once a step: (DP - 1) / DP x N / TP x 6 bytes per GPU, over one InfiniBand port per "
                "GPU (A100 200 Gb/s, H100/H200 400 Gb/s). N counts every parameter, so X-MoD's sync grows with "
                "its physical depth, not its FLOPs. Megatron overlaps the sync with the last backward and the "
                "next forward (--overlap-grad-reduce, --overlap-param-gather, which the launchers pass): 'exposed' is "
                "what a step still waits for then (a model: the part that does not fit behind the last micro-batch's "
                "backward, 2/3 of its device time, and the next forward, 1/3, or at least one DDP bucket of each).", "",
                "| model | GPU | N | GB per GPU | sync ms | micro-batches' device ms | share, not overlapped | "
                "exposed ms, overlapped | share, overlapped |",
                "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in model_rows:
            out.append(f"| {r['model']} | {r['gpu']} | {r['total_params'] / 1e9:.2f}B | {r['dp_bytes'] / 1e9:.2f} | "
                       f"{r['dp_sync_s'] * 1e3:.0f} | {r['step_device_s'] * 1e3:.0f} | {r['dp_sync_fraction']:.1%} | "
                       f"{r['dp_exposed_s'] * 1e3:.0f} | {r['dp_exposed_fraction']:.1%} |")
    if graphs:
        out += ["", "## Eager vs CUDA graph (fwd+bwd of the GPT model at the host width)", "",
                "| model | layers | eager host ms | eager wall ms | graph host ms | graph wall ms | speed-up | error |",
                "|---|---:|---:|---:|---:|---:|---:|---|"]
        for r in graphs:
            err = r.get("capture_error") or r.get("error") or ""
            out.append(f"| {r['model']} | {r.get('num_layers', '-')} | {f(r.get('eager_host_ms'), '.1f')} | "
                       f"{f(r.get('eager_wall_ms'), '.1f')} | {f(r.get('graph_host_ms'), '.2f')} | "
                       f"{f(r.get('graph_wall_ms'), '.2f')} | {f(r.get('speedup'), '.1f')} | {err} |")
    if profiled:
        out += ["", "## One training step under torch.profiler", "",
                "| model | backbone | L | layers | wall ms | host (ops' self CPU) ms | device (kernels) ms | device busy |",
                "|---|---|---:|---:|---:|---:|---:|---:|"]
        for r in profiled:
            if "error" in r:
                out.append(f"| {r['model']} | {r['backbone']} | {r['seq_len']} | - | {r['error']} | | | |")
                continue
            out.append(f"| {r['model']} | {r['backbone']} | {r['seq_len']} | {r['num_layers']} | {r['wall_ms']:.1f} | "
                       f"{r['host_ops_ms']:.1f} | {f(r['device_ms'], '.1f')} | {f(r['device_busy'], '.0%')} |")
    if meta["device_type"] == "cpu":
        out += ["", "On CPU the host time per call includes the ops' own (small) compute at this width, so the us "
                "per launch is an upper bound of the dispatch cost; a GPU host CPU differs from this one."]
        if meta["loadavg_start"] and meta["loadavg_start"][0] > 0.5 * (os.cpu_count() or 1):
            out += [f"The machine was shared (load {meta['loadavg_start'][0]} on {os.cpu_count()} cores)."]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--activated-depth", type=int, default=28)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (default 1: host dispatch is one thread, and the CPU-time basis "
                        "is then this thread's; 0 leaves torch's default)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--mfu", type=float, default=0.45)
    p.add_argument("--graph-launch-us", type=float, default=GRAPH_LAUNCH_US)
    p.add_argument("--graphs", action="store_true", help="eager vs CUDA graph and the torch.profiler step (CUDA)")
    p.add_argument("--profile-backbone", default=None, help="backbone of the profiled step (default: the host width)")
    p.add_argument("--profile-seq-len", type=int, default=None)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    p.add_argument("--tag", default=None, help="results name host_overhead_<tag>.* (default <device>_<date>)")
    a = p.parse_args(argv)
    device_name = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device_name not in ("cpu", "cuda"):
        p.error(f"--device: {device_name!r} is not cpu or cuda")
    if device_name == "cuda" and not torch.cuda.is_available():
        p.error("--device: cuda requested but no CUDA device is available")
    unknown = [m for m in a.models if m not in MODELS]
    if unknown:
        p.error(f"--models: {unknown} not among {', '.join(MODELS)}")
    if a.seq_len % 16 or a.hidden_size % 32:
        p.error("--seq-len: a multiple of 16; --hidden-size: a multiple of 32")
    device = torch.device(device_name)
    backbone = Backbone("host-64" if a.hidden_size == 64 else f"host-{a.hidden_size}", hidden_size=a.hidden_size,
                        head_dim=16, num_attention_heads=a.hidden_size // 16, num_query_groups=a.hidden_size // 32,
                        ffn_hidden_size=3 * a.hidden_size, num_layers=a.activated_depth, vocab_size=256,
                        rotary_base=10000)
    threads_before = torch.get_num_threads()
    if a.threads:
        torch.set_num_threads(a.threads)
    try:
        return _run(a, device, backbone)
    finally:
        torch.set_num_threads(threads_before)


def _run(a, device, backbone) -> int:
    loadavg_start = throughput.loadavg()
    tag = a.tag or f"{device.type}_{dt.datetime.now(dt.UTC).strftime('%Y%m%d')}"
    os.makedirs(a.out, exist_ok=True)
    found = dict(layers=[], steps=[], step_model=[], graphs=None, profiled=None)

    def write():  # after every part: a run cut off by a time limit keeps what finished
        us = host_us_per_launch(found["layers"]) if found["layers"] else None
        cpu_us = host_us_per_launch(found["layers"], "cpu_") if found["layers"] else None
        meta = throughput.run_meta(device, dict(
            loadavg_start=loadavg_start, hidden_size=a.hidden_size, seq_len=a.seq_len,
            activated_depth=a.activated_depth, calls=a.calls, repeats=a.repeats,
            path="fused" if device.type == "cuda" else "torch", us_per_launch=us, cpu_us_per_launch=cpu_us,
            torch_threads=torch.get_num_threads(), mfu=a.mfu,
            graph_launch_us=a.graph_launch_us, headline=HEADLINE, peak_bf16_flops=PEAK_BF16_FLOPS))
        with open(os.path.join(a.out, f"host_overhead_{tag}.json"), "w") as fh:
            json.dump(dict(meta=meta, **found), fh, indent=1)
        text = render_markdown(meta, found["layers"], found["steps"], found["step_model"], found["graphs"],
                               found["profiled"])
        with open(os.path.join(a.out, f"host_overhead_{tag}.md"), "w") as fh:
            fh.write(text)
        return text

    def stamp(what):
        print(f"[{dt.datetime.now().strftime('%H:%M:%S')}] {what}", flush=True)

    with throughput.single_rank_megatron():
        stamp("layers")
        found["layers"] = measure_layers(device, a.seq_len, 1, a.hidden_size, a.calls, a.repeats)
        found["step_model"] = headline_table(found["layers"], host_us_per_launch(found["layers"]), a.mfu,
                                             graph_launch_us=a.graph_launch_us,
                                             cpu_us_per_launch=host_us_per_launch(found["layers"], "cpu_"))
        write()
        stamp("steps")
        found["steps"] = measure_steps(device, a.models, backbone, a.seq_len, 1, a.steps, found["layers"])
        write()
        if a.graphs:  # Dense and the deepest model asked for (A3K16 by default)
            pair = list(dict.fromkeys([a.models[0], a.models[-1]]))
            pb = get_backbone(a.profile_backbone) if a.profile_backbone else backbone
            stamp("graphs")  # before the (slower) profiled steps; a failed capture's error is a result
            found["graphs"] = graph_rows(device, pair, backbone, a.seq_len)
            write()
            stamp(f"profiler ({pb.name}, L up to {a.profile_seq_len or a.seq_len}: the longest half that fits)")
            found["profiled"] = profile_steps(device, pair, pb, a.profile_seq_len or a.seq_len)
    print(write())
    return 0


if __name__ == "__main__":
    sys.exit(main())
