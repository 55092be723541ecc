"""Summaries of a set of runs for docs/routing.md: the routing report of each run's final checkpoint
on the same held-out sequences, its validation curve and evaluation routing statistics from
tensorboard, and comparison plots (update counts, validation loss)."""
from __future__ import annotations

import json
import re
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


def validation_curve(log: str) -> dict[int, float]:
    """{iteration: lm loss} of the validation set from megatron's console lines. (Tensorboard's
    ``lm loss validation`` also receives the final *test* evaluation at the last iteration.)"""
    found = re.findall(r"validation loss at iteration (\d+) (?:on validation set )?\| lm loss value: ([0-9.Ee+-]+)", log)
    return {int(i): float(v) for i, v in found}


def report_run(run_dir: Path, valid_prefix: str, rule: str, num_sequences: int = 32) -> dict:
    """``xmod routing-report`` of a run's checkpoint (written to ``run_dir/routing_report_<rule>``)."""
    import argparse

    from megatron_xmod.diagnostics.routing_report import run

    output = run_dir / f"routing_report_{rule}"
    if not (output / "routing_report.json").is_file():
        run(argparse.Namespace(load=str(run_dir / "ckpt"), data=valid_prefix, num_sequences=num_sequences,
                               rule=rule, micro_batch_size=4, iteration=None, output=str(output)))
    return json.loads((output / "routing_report.json").read_text())


def _routing(report: dict) -> dict:
    s = report["summary"]
    return {"coverage": s["coverage"], "adjacent_jaccard": s["adjacent_jaccard"],
            "selected_fraction": s["selected_fraction"], "mean_update_count": s["mean_update_count"],
            "update_count_distribution": [b["update_count_distribution"] for b in report["blocks"]],
            "per_layer_selected_fraction": [row["selected_fraction"] for row in report["layers"]]}


def summarize(out: Path, names: list[str], valid_prefix: str, variants: dict) -> dict:
    rows = {}
    for name in names:
        run_dir = out / name
        threshold, topk = (report_run(run_dir, valid_prefix, rule) for rule in ("threshold", "topk"))
        tags = read_scalars(run_dir / "tb")
        validation = validation_curve((run_dir / "train.log").read_text())
        s = threshold["summary"]
        rows[name] = {
            "tau": variants[name][0], "warmup_fraction": variants[name][1], "extra": list(variants[name][2]),
            "val_loss_curve": sorted(validation.items()),
            "val_loss_final": validation[max(validation)] if validation else None,
            "report_lm_loss": s["lm_loss"], "threshold": _routing(threshold), "topk": _routing(topk),
            "nominal_fraction": s["nominal_fraction"], "threshold_vs_topk": s["threshold_vs_topk"],
            "router_logit_std": [row["router_logit_std"] for row in threshold["layers"]],
            "eval_selected_fraction_curve": sorted(tags.get("routing/eval_selected_fraction", {}).items()),
            "references": threshold["blocks"][0]["references"],
        }
    plot_comparison(rows, out)
    return rows


def plot_comparison(rows: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 3.9))
    reference = None
    for name, row in rows.items():
        for ax, rule in zip(axes[:2], ("topk", "threshold")):
            dists = row[rule]["update_count_distribution"]  # the demo layout's blocks have equal length
            mean = [sum(d[c] for d in dists) / len(dists) for c in range(len(dists[0]))]
            ax.plot(range(len(mean)), mean, marker="o", label=name)
        reference = row["references"]["independent_random"]["update_count_distribution"]
        if row["val_loss_curve"]:
            steps, losses = zip(*row["val_loss_curve"])
            axes[2].plot(steps, losses, marker="o", label=name)
    for ax, rule in zip(axes[:2], ("top-k", "threshold")):
        if reference:
            ax.plot(range(len(reference)), reference, "k--", marker="x", label="Binomial(4, 1/4)")
        ax.set_xlabel("updates per token within a block (T = 4, K = 4, A = 1)")
        ax.set_ylabel(f"fraction of tokens ({rule} rule)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[2].set_xlabel("iteration")
    axes[2].set_ylabel("validation loss (same held-out sequences)")
    axes[2].grid(alpha=0.3)
    axes[2].legend(fontsize=7)
    fig.suptitle("token-choice bias scale on the demo's X-MoD, D*2 + (S4*4 + D)*2 (held-out plays, 32 x 256 tokens)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "tau_study.png", dpi=110)
    plt.close(fig)
