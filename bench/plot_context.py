"""Training speed-up over Dense against the sequence length, from `throughput.py` result files (one file per L).

    python bench/plot_context.py bench/results/throughput_cpu_idle_20261205_compiled_s19.json \
        bench/results/throughput_cpu_idle_20261205_L8192_compiled_s22.json \
        bench/results/throughput_cpu_idle_20261205_L16384_compiled_s22.json \
        --out bench/results/context_cpu_20261205_s22.png

One line per routed model: its training tokens/s over Dense's in the same run (solid) and its FLOP-ideal
ratio (dashed, `megatron_xmod.accounting`). The files must come from one device and backbone: ratios
compare models within a run, never absolute times across runs.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def speedups(results: list[dict]) -> dict[str, list[tuple[int, float, float]]]:
    """{model: [(L, train tokens/s vs Dense, FLOP-ideal ratio), ...] sorted by L} of throughput.py results."""
    if not results:
        raise ValueError("results: no throughput.py result files given; pass one JSON file per sequence length")
    first = results[0]["meta"]
    for result in results[1:]:
        for field in ("device", "backbone"):
            if result["meta"][field] != first[field]:
                raise ValueError(f"{field}: the files mix {first[field]!r} and {result['meta'][field]!r}; plot runs "
                                 "of one device and backbone together")
    lines: dict[str, list[tuple[int, float, float]]] = {}
    for result in results:
        for row in result["rows"]:
            if row["model"] != "dense":
                lines.setdefault(row["model"], []).append((result["meta"]["seq_len"], row["train_ratio"],
                                                           row["ideal_ratio"]))
    return {model: sorted(points) for model, points in lines.items()}


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for k, (model, points) in enumerate(speedups(results).items()):
        lengths = [length for length, _, _ in points]
        ax.plot(lengths, [ratio for _, ratio, _ in points], marker="o", color=f"C{k}", label=f"{model} measured")
        ax.plot(lengths, [ideal for _, _, ideal in points], linestyle="--", color=f"C{k}", label=f"{model} FLOP-ideal")
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length L (tokens)")
    ax.set_ylabel("training tokens/s vs Dense")
    meta = results[0]["meta"]
    ax.set_title(f"{meta['backbone']['name']}, {meta['device']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", help="throughput.py result JSON files, one per sequence length")
    p.add_argument("--out", required=True, help="the PNG to write")
    args = p.parse_args(argv)
    results = [json.loads(Path(name).read_text()) for name in args.results]
    plot(results, Path(args.out))
    for model, points in speedups(results).items():
        print(model, "  ".join(f"L={length}: {ratio:.2f}x (ideal {ideal:.2f}x)" for length, ratio, ideal in points))


if __name__ == "__main__":
    main()
