"""Pick K and A (Eq.10) from the law: at a fixed FLOP budget, or at a fixed wall-clock budget.

FLOPs mode minimises the predicted matched-FLOPs residual Delta (Eq.21). That is the design rule of
the X-MoD paper ("X-MoD: Practical Scaling Laws for Sparse-Depth Routing Beyond Mixture-of-Depths"),
and it ignores that deep sparse stacks run below the dense model's throughput (the paper's Table 11:
A3K16 needs half the dense FLOPs per token yet trains at 0.95x the dense throughput). Wall-clock
mode therefore takes measured tokens/s per configuration and compares the loss each reaches in the
same time: a configuration that trains D tokens in that time spends the compute a dense model spends
on D * phi/phi_D tokens, so its loss is L_dense(D * phi/phi_D) + Delta (Eq.37).
"""
from __future__ import annotations

import csv
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from megatron_xmod.presets import Backbone
from megatron_xmod.scaling.design import Design, design
from megatron_xmod.scaling.law import TABLE8, LawParams, asymptotic_exponents, predict_delta
from megatron_xmod.xmod.layout import LayoutError

PAPER_A_GRID = (0.5, 1.0, 2.0, 3.0, 4.0, 5.0)  # the anchor sweep of the paper's scaling-law grid
# Where the paper's law was fitted (its "Scaling law sweep grid"): the K-L sweep at 556M, A = 1, L = 2k..32k
# (64k held out); the scale sweep at 32k, N_act = 165M..936M (1.65B held out); the anchor sweep at 165M, 32k,
# A in 0.5..5 x K in {4, 8, 12, 16}. The default search stays inside K <= 16 and the A grid; outside, the
# law extrapolates, and the planner says so.
FITTED_RANGE = {"L": (2048, 32768), "N_act": (165e6, 936e6), "K": (1, 16), "A": (0.5, 5.0)}
DEFAULT_K_MAX = FITTED_RANGE["K"][1]


def outside_fitted_range(seq_len: int, n_act: float, K: int, A: Optional[float]) -> list[str]:
    """One note per axis on which (L, N_act, K, A) leaves the law's fitted range."""
    notes = []
    lo, hi = FITTED_RANGE["L"]
    if not lo <= seq_len <= hi:
        notes.append(f"L = {seq_len} is outside the law's fitted range L = {lo}..{hi} (extrapolation)")
    lo, hi = FITTED_RANGE["N_act"]
    if not 0.95 * lo <= n_act <= 1.05 * hi:
        notes.append(f"N_act = {n_act / 1e6:.3g}M is outside the law's fitted range {lo / 1e6:.0f}M..{hi / 1e6:.0f}M "
                     "(extrapolation)")
    if K > FITTED_RANGE["K"][1]:
        notes.append(f"K = {K} is above the largest K the law was fitted on ({FITTED_RANGE['K'][1]}; the A-K term saw "
                     "K in 4..16 only): extrapolation")
    lo, hi = FITTED_RANGE["A"]
    if A is not None and not lo <= A <= hi:
        notes.append(f"A = {A:g} is outside the anchor strides the law was fitted on ({lo:g}..{hi:g}): extrapolation")
    return notes


@dataclass
class Option:
    design: Design
    predicted_delta: float
    predicted_loss: Optional[float] = None  # wall-clock mode only
    tokens_per_s: Optional[float] = None

    def to_dict(self) -> dict:
        c = self.design.count
        row = {
            "K": self.design.K,
            "A": self.design.A,
            "layout": self.design.layout.notation,
            "num_layers": c.num_layers,
            "total_params": c.total_params,
            "active_params": c.active_params,
            "capacity_ratio": self.design.capacity_ratio,
            "flops_ratio_vs_dense": c.flops_ratio_vs_dense,
            "predicted_delta": self.predicted_delta,
        }
        if self.design.note:
            row["note"] = self.design.note
        if self.predicted_loss is not None:
            row.update(predicted_loss=self.predicted_loss, tokens_per_s=self.tokens_per_s)
        return row


@dataclass
class Plan:
    mode: str
    seq_len: int
    backbone: str
    best: Option
    options: list[Option]
    infeasible: list[dict] = field(default_factory=list)  # (K, A) with no whole layout
    over_budget: list[dict] = field(default_factory=list)  # whole layouts above --max-total-params
    exponents: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "mode": self.mode,
            "seq_len": self.seq_len,
            "backbone": self.backbone,
            **self.best.to_dict(),
            "asymptotic_exponents": self.exponents,
            "fitted_range": {axis: list(bounds) for axis, bounds in FITTED_RANGE.items()},
            "infeasible": group_infeasible(self.infeasible),
            "num_over_budget": len(self.over_budget),
            "warnings": self.warnings,
            "candidates": [o.to_dict() for o in self.options],
        }


def k_ranges(ks: Sequence[int]) -> str:
    """[2, 3, 4, 7] -> '2-4,7'."""
    out, ks = [], sorted(ks)
    start = prev = ks[0]
    for k in ks[1:] + [None]:
        if k is not None and k == prev + 1:
            prev = k
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if k is not None:
            start = prev = k
    return ",".join(out)


def group_infeasible(items: list[dict]) -> list[dict]:
    """One entry per A: the K values without a whole layout and the first reason (they share it)."""
    by_a: dict = {}
    for it in items:
        by_a.setdefault(it["A"], []).append(it)
    return [{"A": a, "K": [it["K"] for it in its], "reason": its[0]["reason"]} for a, its in by_a.items()]


def _delta(p: LawParams, d: Design, seq_len: int, n_act: Optional[float] = None) -> float:
    """Predicted Delta of a design; 0 for the dense model, by definition (Delta is the loss change
    against the FLOP-matched dense model; the law's bias e describes sparse runs only)."""
    if d.K == 1:
        return 0.0
    if p.v != 0:
        # Eq.(27): at equal compute the exposure ratio is (1/K) phi_D/phi; D_dense only sets a scale,
        # which a plan does not know, so the exposure term cannot be planned with. Say so.
        raise ValueError("law: the planner uses the practical law (v = 0); this law has an exposure term v > 0")
    return float(predict_delta(p, n_act or d.count.active_params, d.capacity_ratio, seq_len, d.K, d.A or 1.0))


def _candidate(backbone: Backbone, K: int, A, seq_len: int, dense_prefix: int, max_total_params,
               infeasible: list, over: list, layout=None):
    """The design for (K, A), or None after recording why it is out (no whole layout, over the cap)."""
    try:
        d = design(backbone, K, A, seq_len, dense_prefix, layout=layout)
    except LayoutError as err:
        infeasible.append({"K": K, "A": A, "reason": str(err)})
        return None
    if max_total_params is not None and d.count.total_params > max_total_params:
        over.append({"K": K, "A": A, "total_params": d.count.total_params})
        return None
    return d


def plan_flops(backbone: Backbone, seq_len: int, params: LawParams = TABLE8, a_grid: Sequence[float] = PAPER_A_GRID,
               k_max: int = DEFAULT_K_MAX, dense_prefix: int = 4, max_total_params: Optional[float] = None,
               n_act: Optional[float] = None) -> Plan:
    """``n_act``: the activated size the law's prefactor uses (default: the counted N_act of each design)."""
    if seq_len < 1:
        raise ValueError(f"seq_len: must be >= 1, got {seq_len}")
    if k_max < 2:
        raise ValueError(f"k_max: must be >= 2, got {k_max}")
    if not a_grid or any(not a > 0 for a in a_grid):
        raise ValueError(f"A: every anchor stride must be > 0, got {list(a_grid)}")
    options, infeasible, over = [], [], []
    for K in range(1, k_max + 1):
        for A in ([None] if K == 1 else a_grid):
            d = _candidate(backbone, K, A, seq_len, dense_prefix, max_total_params, infeasible, over)
            if d is not None:
                options.append(Option(d, _delta(params, d, seq_len, n_act)))
    if not options:
        raise ValueError("max_total_params: no candidate fits; even the dense model has "
                         f"{design(backbone, 1, None, seq_len).count.total_params:,} parameters")
    best = min(options, key=lambda o: o.predicted_delta)
    warnings = []
    if best.design.K == k_max:
        warnings.append(f"K^ = {k_max} is the edge of the search (--k-max)"
                        + ("; it is also the largest K the law was fitted on, so a larger --k-max would extrapolate"
                           if k_max == DEFAULT_K_MAX else "; the law's optimum may lie beyond it"))
    if seq_len % best.design.K:
        # Training routes exactly L/K tokens per sequence (routing.topk_count), so such a K cannot train.
        trainable = [o for o in options if seq_len % o.design.K == 0]
        alternative = min(trainable, key=lambda o: o.predicted_delta) if trainable else None
        warnings.append(
            f"K^ = {best.design.K} does not divide L = {seq_len}; top-k routing needs L/K whole"
            + (f"; the best K that does is K = {alternative.design.K}, A = {alternative.design.A or 1:g} "
               f"(predicted Delta {alternative.predicted_delta:+.4f}, layout {alternative.design.layout.notation})"
               if alternative else ""))
    if best.design.A is not None and len(a_grid) > 1 and best.design.A == max(a_grid):
        warnings.append(f"A^ = {best.design.A:g} is the largest A searched; the law (like the paper's Fig. 2d) "
                        "keeps rewarding larger A, so the optimum is the grid boundary, not a minimum")
    warnings += outside_fitted_range(seq_len, n_act or best.design.n_act, best.design.K, best.design.A)
    return Plan("flops", seq_len, backbone.name, best, options, infeasible, over,
                asymptotic_exponents(params), warnings)


# --- wall-clock mode -----------------------------------------------------------------------------

def read_table(path: str, required: Sequence[str], what: str) -> list[dict]:
    if not os.path.isfile(path):
        raise ValueError(f"{what} {path}: file not found; give the path of an existing CSV file "
                         f"(columns: {', '.join(required)})")
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        columns = [c.strip() for c in (reader.fieldnames or [])]
        missing = [c for c in required if c not in columns]
        if missing:
            raise ValueError(f"{what} {path}: missing column(s) {', '.join(missing)}; "
                             f"required: {', '.join(required)} (found: {', '.join(columns) or 'none'})")
        return [{k.strip(): (v or "").strip() for k, v in row.items() if k is not None} for row in reader]


def number(row: dict, column: str, where: str, positive: bool = True, integer: bool = False) -> float:
    text = row.get(column, "")
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{where}: column {column!r} must be a number, got {text!r}") from None
    if integer:
        if not np.isfinite(value) or value != int(value) or value < 1:
            raise ValueError(f"{where}: column {column!r} must be an integer >= 1, got {text!r}")
        return int(value)
    if not np.isfinite(value) or (positive and value <= 0):
        raise ValueError(f"{where}: column {column!r} must be {'> 0' if positive else 'finite'}, got {text!r}")
    return value


class DenseCurve:
    """A dense run's loss against tokens seen, interpolated linearly in log(tokens)."""

    def __init__(self, tokens: Sequence[float], loss: Sequence[float], source: str = "dense curve"):
        order = np.argsort(tokens)
        self.tokens = np.asarray(tokens, float)[order]
        self.loss = np.asarray(loss, float)[order]
        self.source = source
        if len(self.tokens) < 2 or len(np.unique(self.tokens)) != len(self.tokens):
            raise ValueError(f"{source}: needs at least two points with distinct 'tokens'")

    @classmethod
    def from_csv(cls, path: str) -> DenseCurve:
        rows = read_table(path, ("tokens", "loss"), "dense curve")
        where = lambda i: f"dense curve {path} row {i + 2}"  # noqa: E731  (row 1 is the header)
        return cls([number(r, "tokens", where(i)) for i, r in enumerate(rows)],
                   [number(r, "loss", where(i)) for i, r in enumerate(rows)], f"dense curve {path}")

    def __call__(self, tokens: float) -> float:
        if not self.tokens[0] * 0.999 <= tokens <= self.tokens[-1] * 1.001:
            raise ValueError(f"{self.source}: needs the dense loss at {tokens:.3g} tokens, outside the curve's "
                             f"{self.tokens[0]:.3g}..{self.tokens[-1]:.3g}; log a longer dense run or shorten --hours")
        return float(np.interp(np.log(tokens), np.log(self.tokens), self.loss))


def plan_wallclock(backbone: Backbone, seq_len: int, throughput_path: str, dense_curve: DenseCurve, hours: float,
                   params: LawParams = TABLE8, dense_prefix: int = 4,
                   max_total_params: Optional[float] = None, n_act: Optional[float] = None) -> Plan:
    if not hours > 0:
        raise ValueError(f"hours: must be > 0, got {hours}")
    rows = read_table(throughput_path, ("K", "A", "tokens_per_s"), "throughput file")
    if not rows:
        raise ValueError(f"throughput file {throughput_path}: no rows")
    options, infeasible, over = [], [], []
    for i, row in enumerate(rows):
        where = f"throughput file {throughput_path} row {i + 2}"
        K = number(row, "K", where, integer=True)
        A = None if K == 1 else number(row, "A", where)
        tps = number(row, "tokens_per_s", where)
        d = _candidate(backbone, K, A, seq_len, dense_prefix, max_total_params, infeasible, over,
                       layout=row.get("layout") or None)
        if d is None:
            continue
        delta = _delta(params, d, seq_len, n_act)
        tokens = tps * hours * 3600
        loss = dense_curve(tokens * d.count.flops_ratio_vs_dense) + delta
        options.append(Option(d, delta, loss, tps))
    if not options:
        raise ValueError(f"throughput file {throughput_path}: no configuration is feasible within the constraints")
    best = min(options, key=lambda o: o.predicted_loss)
    flops_best = min(options, key=lambda o: o.predicted_delta)
    warnings = []
    if flops_best is not best:
        warnings.append(f"the FLOPs-optimal configuration among these (K={flops_best.design.K}, A={flops_best.design.A}) "
                        "is not the wall-clock-optimal one")
    warnings += outside_fitted_range(seq_len, n_act or best.design.n_act, best.design.K, best.design.A)
    return Plan("wallclock", seq_len, backbone.name, best, options, infeasible, over,
                asymptotic_exponents(params), warnings)
