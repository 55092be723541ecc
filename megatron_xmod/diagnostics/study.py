"""Summaries of a set of runs for docs/routing.md: the routing report of each run's final checkpoint
on the same held-out sequences, its validation curve and evaluation routing statistics from
tensorboard, and comparison plots (update counts, validation loss)."""
from __future__ import annotations

import json
from pathlib import Path


def read_scalars(tb_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags: dict[str, dict[int, float]] = {}
    for event_file in sorted(tb_dir.iterdir()):
        events = EventAccumulator(str(event_file), size_guidance={"scalars": 0})
        events.Reload()
        for tag in events.Tags()["scalars"]:
            tags.setdefault(tag, {}).update({e.step: e.value for e in events.Scalars(tag)})
    return tags


def report_run(run_dir: Path, valid_prefix: str, num_sequences: int = 32) -> dict:
    """``xmod routing-report`` of a run's checkpoint (written to ``run_dir/routing_report``)."""
    import argparse

    from megatron_xmod.diagnostics.cli import run

    run(argparse.Namespace(load=str(run_dir / "ckpt"), data=valid_prefix, num_sequences=num_sequences,
                           rule="threshold", micro_batch_size=4, iteration=None,
                           output=str(run_dir / "routing_report")))
    return json.loads((run_dir / "routing_report" / "routing_report.json").read_text())


def summarize(out: Path, names: list[str], valid_prefix: str, variants: dict) -> dict:
    rows = {}
    for name in names:
        run_dir = out / name
        report = report_run(run_dir, valid_prefix)
        tags = read_scalars(run_dir / "tb")
        validation = tags.get("lm loss validation", {})
        s = report["summary"]
        rows[name] = {
            "tau": variants[name][0], "warmup_fraction": variants[name][1], "extra": list(variants[name][2]),
            "val_loss_curve": sorted(validation.items()),
            "val_loss_final": validation[max(validation)] if validation else None,
            "report_lm_loss": s["lm_loss"], "coverage": s["coverage"], "adjacent_jaccard": s["adjacent_jaccard"],
            "eval_selected_fraction": s["selected_fraction"], "nominal_fraction": s["nominal_fraction"],
            "threshold_vs_topk": s["threshold_vs_topk"],
            "update_count_distribution": [b["update_count_distribution"] for b in report["blocks"]],
            "router_logit_std": [row["router_logit_std"] for row in report["layers"]],
            "train_selected_eval_curve": sorted(tags.get("routing/eval_selected_fraction", {}).items()),
            "references": report["blocks"][0]["references"],
        }
    plot_comparison(rows, out)
    return rows


def plot_comparison(rows: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (counts_ax, loss_ax) = plt.subplots(1, 2, figsize=(11, 3.8))
    reference = None
    for name, row in rows.items():
        # blocks of the demo layout have equal length: average their distributions
        dists = row["update_count_distribution"]
        mean = [sum(d[c] for d in dists) / len(dists) for c in range(len(dists[0]))]
        counts_ax.plot(range(len(mean)), mean, marker="o", label=name)
        reference = row["references"]["independent_random"]["update_count_distribution"]
        if row["val_loss_curve"]:
            steps, losses = zip(*row["val_loss_curve"])
            loss_ax.plot(steps, losses, marker="o", label=name)
    if reference:
        counts_ax.plot(range(len(reference)), reference, "k--", marker="x", label="Binomial(T, 1/K)")
    counts_ax.set_xlabel("updates per token within a block (T = 4, K = 4, A = 1)")
    counts_ax.set_ylabel("fraction of tokens (threshold rule)")
    counts_ax.grid(alpha=0.3)
    counts_ax.legend(fontsize=7)
    loss_ax.set_xlabel("iteration")
    loss_ax.set_ylabel("validation loss (same held-out sequences each time)")
    loss_ax.grid(alpha=0.3)
    loss_ax.legend(fontsize=7)
    fig.suptitle("token-choice bias scale on the demo's X-MoD (D*2 + (S4*4 + D)*2)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "tau_study.png", dpi=120)
    plt.close(fig)
