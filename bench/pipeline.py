"""Pipeline stages of the deep X-MoD models: cost-balanced layout vs megatron's default split.

For 1.65B X-MoD A3K16 (298 layers) and 936M X-MoD A4K8 (161 layers) at L = 32768, PP 4 and 8,
VPP 1/2/4: the slowest stage (chunk) time from the cost model (:mod:`megatron_xmod.pipeline.cost`,
H100-class achieved rates, uncalibrated), the step time and bubble from a simulation of megatron's
1F1B / interleaved schedule (:mod:`megatron_xmod.pipeline.schedule`, free communication), balanced
(``xmod partition``) vs default (even split by layer count).

    python bench/pipeline.py [--microbatches 32] [--out bench/results]

Writes ``pipeline_<date>.json`` / ``.md`` and ``pipeline_stage_load.png`` (per-rank load, PP 8).
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
from pathlib import Path

from megatron_xmod.pipeline.cost import layer_items
from megatron_xmod.pipeline.partition import balanced_partition, default_partition
from megatron_xmod.pipeline.schedule import simulate
from megatron_xmod.presets import get_backbone, parse_model

MODELS = (("1.65b", "xmod-a3k16"), ("936m", "xmod-a4k8"))
SEQ_LEN = 32768
MACHINE = "2-core CPU dev machine, no GPU (analytic cost model + schedule simulation; no device timing)"


def rows(microbatches: int) -> list[dict]:
    out = []
    for backbone, model in MODELS:
        items = layer_items(parse_model(model, get_backbone(backbone)), SEQ_LEN)
        for pp in (4, 8):
            for vpp in (1, 2, 4):
                row = dict(backbone=backbone, model=model, seq_len=SEQ_LEN, pp=pp, vpp=vpp, microbatches=microbatches)
                for name, partition in (("balanced", balanced_partition(items, pp, vpp)),
                                        ("default", default_partition(items, pp, vpp))):
                    simulation = simulate(partition.chunk_times, pp, microbatches)
                    row[name] = dict(layout=partition.layout, slowest_stage_ms=max(partition.chunk_times) * 1e3,
                                     max_over_mean=partition.max_over_mean,
                                     rank_max_over_mean=partition.rank_max_over_mean,
                                     step_time_s=simulation.step_time, bubble=simulation.bubble,
                                     rank_times_ms=[t * 1e3 for t in partition.rank_times],
                                     peak_activation_gib=max(s.activation_bytes for s in partition.stages) / 2**30)
                row["speedup"] = row["default"]["step_time_s"] / row["balanced"]["step_time_s"]
                out.append(row)
    return out


def markdown(results: list[dict], date: str, microbatches: int) -> str:
    lines = [f"# Pipeline stages: balanced vs megatron's default split ({date})", "",
             f"Machine: {MACHINE}. L = {SEQ_LEN}, micro-batch 1, {microbatches} micro-batches per step, "
             "H100-class achieved rates (600 TFLOP/s, 2.5 TB/s), communication free.", "",
             "| model | PP | VPP | slowest stage ms (bal / def) | max/mean (bal / def) | step s (bal / def) "
             "| bubble (bal / def) | speed-up |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        b, d = r["balanced"], r["default"]
        lines.append(f"| {r['backbone']} {r['model']} | {r['pp']} | {r['vpp']} | {b['slowest_stage_ms']:.1f} / "
                     f"{d['slowest_stage_ms']:.1f} | {b['max_over_mean']:.3f} / {d['max_over_mean']:.3f} | "
                     f"{b['step_time_s']:.2f} / {d['step_time_s']:.2f} | {b['bubble']:.3f} / {d['bubble']:.3f} | "
                     f"{r['speedup']:.2f}x |")
    lines += ["", "Balanced layouts (``--pipeline-model-parallel-layout``):", ""]
    lines += [f"- {r['backbone']} {r['model']} PP {r['pp']} VPP {r['vpp']}: `{r['balanced']['layout']}`" for r in results]
    return "\n".join(lines) + "\n"


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chosen = [r for r in results if r["vpp"] == 1]
    fig, axes = plt.subplots(len(MODELS), 2, figsize=(11, 6.5), squeeze=False)
    for ax, r in zip(axes.flat, chosen):
        ranks = range(r["pp"])
        width = 0.4
        ax.bar([x - width / 2 for x in ranks], r["default"]["rank_times_ms"], width, label="megatron default", color="#c44e52")
        ax.bar([x + width / 2 for x in ranks], r["balanced"]["rank_times_ms"], width, label="balanced", color="#4c72b0")
        ax.set_title(f"{r['backbone']} {r['model']}, PP {r['pp']}: max/mean {r['default']['max_over_mean']:.2f} -> "
                     f"{r['balanced']['max_over_mean']:.3f}", fontsize=9)
        ax.set_xlabel("pipeline rank")
        ax.set_ylabel("fwd+bwd ms per micro-batch")
        ax.set_xticks(list(ranks))
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"Per-stage load at L = {SEQ_LEN} (cost model)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=32)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = parser.parse_args()
    now = datetime.datetime.now(datetime.UTC)
    date = now.strftime("%Y-%m-%d %H:%M UTC")
    results = rows(args.microbatches)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"pipeline_{now:%Y%m%d}"
    meta = dict(date=date, machine=MACHINE, host=platform.node(), microbatches=args.microbatches)
    stem.with_suffix(".json").write_text(json.dumps(dict(meta, results=results), indent=1))
    stem.with_suffix(".md").write_text(markdown(results, date, args.microbatches))
    plot(results, out / "pipeline_stage_load.png")
    print(markdown(results, date, args.microbatches))


if __name__ == "__main__":
    main()
