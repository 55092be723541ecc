"""How much a neighbour's memory traffic moves the CPU throughput ratio of X-MoD to Dense.

The CPU bench (throughput.py) measured A3K16 at 0.80x of Dense on one day and 0.95-0.98x on another, on
the same CPU model, the same code and an idle load average. The load average counts this machine's own
CPUs only; a process of another machine on the same host that streams memory does not show in it, yet it
takes shared cache and memory bandwidth. A 298-layer A3K16 micro-batch streams its 235M parameters'
weights, gradients and fp32 main gradients (several GB) where Dense's 22.6M mostly stay in the caches, so such
a neighbour should slow X-MoD more than Dense.

This script checks it: each model's training forward + backward of one micro-batch (throughput.ModelRun:
megatron's schedule, DDP, compiled layers), one torch thread pinned to CPU 0, alternately alone and with a
neighbour pinned to CPU 1 that copies 256 MiB back and forth (its own process, no compute to speak of),
the models interleaved within each phase. It prints and writes the per-micro-batch medians and the
ratio Dense / model in each phase; the ratio's drop is what the neighbour costs X-MoD beyond Dense.

    python bench/contention.py                 # cpu-256, L = 2048, Dense and A3K16, 3 rounds
    python bench/contention.py --tiny          # seconds (the CI test)
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import throughput  # noqa: E402


def copy_forever(cpu: int, mib: int) -> None:
    """The neighbour: one thread on ``cpu`` streaming ``mib`` MiB back and forth until killed."""
    os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    a = torch.ones(mib * 2**20 // 4)
    b = torch.empty_like(a)
    while True:
        b.copy_(a)
        a.copy_(b)


def run_phases(models, backbone, seq_len: int, rounds: int, neighbour_cpu: int, neighbour_mib: int):
    """({(model, phase): [fwd+bwd s]}, {phase: [GB/s]}): ``rounds`` rounds of the models' steps alone,
    then beside the neighbour, the models interleaved within a phase."""
    times = {(m, phase): [] for m in models for phase in ("alone", "neighbour")}
    bandwidth = {"alone": [], "neighbour": []}
    spawn = multiprocessing.get_context("spawn")  # no fork of a process holding torch's threads
    with throughput.single_rank_megatron():
        runs = {m: throughput.ModelRun(backbone, m, seq_len, 1, 1, torch.device("cpu"), False, compile_layers=True)
                for m in models}
        for run in runs.values():  # compiles
            run.train_step(timed=False)
        for i in range(rounds):
            for phase in ("alone", "neighbour"):
                neighbour = None
                if phase == "neighbour":
                    neighbour = spawn.Process(target=copy_forever, args=(neighbour_cpu, neighbour_mib), daemon=True)
                    neighbour.start()
                    time.sleep(1.0)  # past its start-up and first allocation
                try:
                    bandwidth[phase].append(throughput.memory_bandwidth_gbs("cpu"))
                    for m, run in runs.items():
                        run.train_step(timed=True)
                        times[(m, phase)].append(run.fwd_bwd_s[-1])
                        print(f"round {i + 1} {phase:9s} {m:11s} {run.fwd_bwd_s[-1]:.3f} s", flush=True)
                finally:
                    if neighbour is not None:
                        neighbour.kill()
                        neighbour.join()
    return times, bandwidth


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["dense", "xmod-a3k16"])
    p.add_argument("--rounds", type=int, default=3, help="rounds of (alone, with the neighbour)")
    p.add_argument("--neighbour-mib", type=int, default=256)
    p.add_argument("--tiny", action="store_true", help=f"{throughput.TINY_BACKBONE.name}, L = 64, 1 round: seconds")
    p.add_argument("--out", default=os.path.join(throughput.ROOT, "bench", "results"))
    p.add_argument("--tag", default=None, help="results name contention_<tag>.* (default cpu_<date>)")
    a = p.parse_args(argv)
    if "dense" not in a.models:
        p.error("--models: the ratios are to Dense; include dense")
    unknown = [m for m in a.models if m not in throughput.MODELS]
    if unknown:
        p.error(f"--models: {unknown} not among {', '.join(throughput.MODELS)}")
    if a.rounds < 1:
        p.error("--rounds: at least 1")
    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        p.error("this machine: the bench pins itself to one CPU and the neighbour to another; it needs 2 CPUs "
                "it may pin to (Linux)")
    backbone = throughput.TINY_BACKBONE if a.tiny else throughput.CPU_BACKBONE
    seq_len, rounds = (64, 1) if a.tiny else (2048, a.rounds)
    mine, theirs = sorted(os.sched_getaffinity(0))[:2]

    loadavg_start = throughput.loadavg()
    throughput.keep_freed_memory()
    cpus, threads = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, {mine})
    torch.set_num_threads(1)
    try:
        times, bandwidth = run_phases(a.models, backbone, seq_len, rounds, theirs, a.neighbour_mib)
    finally:  # a caller (a test) keeps its CPUs and threads
        os.sched_setaffinity(0, cpus)
        torch.set_num_threads(threads)

    median = {key: statistics.median(v) for key, v in times.items()}
    rows = []
    for m in a.models:
        alone, busy = (median["dense", ph] / median[m, ph] for ph in ("alone", "neighbour"))
        rows.append(dict(model=m, alone_s=median[m, "alone"], neighbour_s=median[m, "neighbour"],
                         slowdown=median[m, "neighbour"] / median[m, "alone"], ratio_alone=alone,
                         ratio_neighbour=busy))
    meta = throughput.run_meta("cpu", dict(backbone=backbone.name, seq_len=seq_len, rounds=rounds,
                                           neighbour_mib=a.neighbour_mib, cpus=[mine, theirs],
                                           loadavg_start=loadavg_start, memory_gbs=bandwidth))
    tag = a.tag or f"cpu_{meta['date'][:10].replace('-', '')}"
    lines = [f"# Throughput under a memory-streaming neighbour ({meta['device']})", "",
             f"- date: {meta['date']}; commit {meta['commit']}; torch {meta['torch']}",
             f"- {backbone.name}, L = {seq_len}, one micro-batch a step, training forward + backward (compiled layers), "
             f"one torch thread on CPU {mine}; median of {rounds} round(s), the models interleaved",
             f"- neighbour: a process on CPU {theirs} copying {a.neighbour_mib} MiB back and forth",
             f"- load average before/after: {loadavg_start} / {meta['loadavg']}; this process's copy bandwidth "
             f"(GB/s) alone {bandwidth['alone']}, beside the neighbour {bandwidth['neighbour']}", "",
             "| model | alone s | with the neighbour s | slowdown | vs Dense alone | vs Dense with the neighbour |",
             "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['model']} | {r['alone_s']:.3f} | {r['neighbour_s']:.3f} | {r['slowdown']:.2f}x | "
              f"{r['ratio_alone']:.2f}x | {r['ratio_neighbour']:.2f}x |" for r in rows]
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"contention_{tag}.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows, times={f"{m} {ph}": v for (m, ph), v in times.items()}), f, indent=1)
    with open(os.path.join(a.out, f"contention_{tag}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines[-len(rows) - 2:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
