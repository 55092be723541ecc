"""Synthetic sweeps on the scaling-law grid of the X-MoD paper, from a known law plus noise.

X-MoD paper: "X-MoD: Practical Scaling Laws for Sparse-Depth Routing Beyond Mixture-of-Depths".

For tests and for trying `xmod fit` before any run exists. The dense losses are a made-up smooth
function of N_act and L; only the residual (loss - dense_loss) carries the law.
"""
from __future__ import annotations

import csv

import numpy as np

from megatron_xmod.presets import get_backbone
from megatron_xmod.scaling.design import design
from megatron_xmod.scaling.law import TABLE8, LawParams, predict_delta
from megatron_xmod.xmod.layout import LayoutError

# The paper's scaling-law sweep grid (K-L, scale and anchor sweeps); it does not list every K, so
# these K values are our choice.
KL_SWEEP = dict(backbone="556m", L=(2048, 4096, 8192, 16384, 32768), K=(2, 4, 8, 12, 16, 24, 32), extra_2k=(3,))
SCALE_SWEEP = dict(backbones=("165m", "298m", "556m", "936m"), L=32768, K=(2, 4, 8, 12, 16, 24, 32))
ANCHOR_SWEEP = dict(backbone="165m", L=32768, A=(0.5, 1.0, 2.0, 3.0, 4.0, 5.0), K=(4, 8, 12, 16))


def grid() -> list[tuple[str, int, int, float]]:
    """(backbone, L, K, A) of every sparse run, without duplicates. Cells whose K does not divide L
    (training routes exactly L/K tokens and refuses them, so `xmod fit` does too) are left out here,
    and :func:`synthetic_rows` skips layouts that are not whole."""
    cells = []
    for L in KL_SWEEP["L"]:
        cells += [(KL_SWEEP["backbone"], L, K, 1.0) for K in KL_SWEEP["K"] + (KL_SWEEP["extra_2k"] if L == 2048 else ())]
    for b in SCALE_SWEEP["backbones"]:
        cells += [(b, SCALE_SWEEP["L"], K, 1.0) for K in SCALE_SWEEP["K"]]
    for A in ANCHOR_SWEEP["A"]:
        cells += [(ANCHOR_SWEEP["backbone"], ANCHOR_SWEEP["L"], K, A) for K in ANCHOR_SWEEP["K"]]
    return [cell for cell in dict.fromkeys(cells) if cell[1] % cell[2] == 0]


def dense_loss(n_act: float, L: int) -> float:
    return 1.9 + 0.6 * (n_act / 1e8) ** -0.3 + 0.02 * np.log2(L / 2048)


def synthetic_rows(params: LawParams = TABLE8, noise: float = 0.003, seed: int = 0, compute: float = 1e19) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for name, L, K, A in grid():
        try:
            d = design(get_backbone(name), K, A, L)
        except LayoutError:
            continue
        n_act = d.count.active_params
        tokens = compute / (3 * d.count.flops_per_token)  # training FLOPs = forward + backward = 3 x forward
        d_dense = tokens * d.count.flops_ratio_vs_dense
        delta = float(predict_delta(params, n_act, d.capacity_ratio, L, K, A, tokens, d_dense))
        ref = dense_loss(n_act, L)
        rows.append(dict(L=L, N_act=n_act, K=K, A=A, C=compute, tokens=round(tokens), backbone=name,
                         loss=round(ref + delta + rng.normal(0, noise), 6), dense_loss=round(ref, 6)))
    return rows


def write_csv(path: str, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
