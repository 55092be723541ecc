"""PNG plots of a fit: Delta vs K per sweep with the fitted curves, and predicted vs observed loss."""
from __future__ import annotations

import os

import numpy as np

from megatron_xmod.scaling.design import design
from megatron_xmod.scaling.law import LawParams, predict_delta, predict_loss
from megatron_xmod.scaling.runs import Runs
from megatron_xmod.xmod.layout import LayoutError


def _pyplot():
    """pyplot on the Agg backend, selected only when a plot is written (never at import time)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: CI and training nodes have no display
    import matplotlib.pyplot as plt

    return plt


def plot_delta_vs_k(p: LawParams, runs: Runs, path: str) -> str:
    plt = _pyplot()
    base = runs.subset(runs.A == 1)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    sweeps = sorted(set(zip(base.backbone.tolist(), base.L.tolist())), key=lambda s: (s[0], s[1]))
    colors = plt.cm.viridis(np.linspace(0, 0.9, max(len(sweeps), 1)))
    for color, (name, L) in zip(colors, sweeps):
        g = base.subset((base.backbone == name) & (base.L == L))
        ks, deltas = [], []
        for K in range(1, int(g.K.max() * 1.5) + 1):
            try:
                d = design(name, K, 1.0, int(L), int(g.dense_prefix[0]))
            except LayoutError:
                continue
            # Equal compute within a sweep: the dense run's tokens are fixed, the sparse run's scale as phi_D/phi.
            d_dense = float(np.median(g.d_dense))
            ks.append(K)
            deltas.append(float(predict_delta(p, np.median(g.n_act), d.capacity_ratio, L, K, 1.0,
                                              d_dense / d.count.flops_ratio_vs_dense, d_dense)))
        ax.plot(ks, deltas, color=color, lw=1.5)
        ax.scatter(g.K, g.delta, color=color, s=18, label=f"{name}, L={int(L)}")
    ax.axhline(0, color="grey", lw=0.5)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("K (A = 1)")
    ax.set_ylabel("Δ = loss − matched dense loss")
    ax.legend(fontsize=7)
    ax.set_title("matched-FLOPs residual: observed (dots) and fitted law (lines)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_predicted_vs_observed(p: LawParams, runs: Runs, holdouts: dict, path: str) -> str:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 5))
    pred = predict_loss(p, runs.dense_loss, **runs.law_inputs())
    ax.scatter(runs.loss, pred, s=14, label="in-sample", color="black")
    for i, (marker, (by, h)) in enumerate(zip("s^D", holdouts.items())):
        if h.get("points"):
            hp, ho = np.array(h["points"]).T
            ax.scatter(ho, hp, s=18, marker=marker, facecolors="none", label=f"leave-one-{by}-out",
                       edgecolors=plt.cm.tab10(i + 1))
    lo, hi = float(runs.loss.min()), float(runs.loss.max())
    pad = 0.05 * (hi - lo + 1e-9)
    ax.plot([lo - pad, hi + pad], [lo - pad, hi + pad], color="grey", lw=0.8)
    ax.set_xlabel("observed loss")
    ax.set_ylabel("predicted loss (Eq. 37)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_plots(p: LawParams, runs: Runs, holdouts: dict, out_dir: str) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    return [plot_delta_vs_k(p, runs, os.path.join(out_dir, "delta_vs_k.png")),
            plot_predicted_vs_observed(p, runs, holdouts, os.path.join(out_dir, "predicted_vs_observed.png"))]
