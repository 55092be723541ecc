"""RUNS.csv: one row per training run of a sweep, validated and turned into the law's inputs.

Columns (header names are exact; order is free):
  required  L, N_act, K, A, C, tokens, loss
  one of    dense_loss (the FLOP-matched dense loss of Eq.11), or dense rows to interpolate it from:
            rows with K = 1 in RUNS.csv and/or a --dense-curve CSV with columns L, N_act, C, loss
  optional  backbone (a preset name or a backbone JSON file, relative to the CSV's folder or absolute;
            default: the preset matching N_act), dense_prefix (N0, default 4),
            layout (explicit notation, for layouts Eq.(3) cannot express), dense_tokens (tokens the
            matched dense run saw; default tokens * phi/phi_D, equal compute)
"""
from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, fields
from typing import Optional

import numpy as np

from megatron_xmod.scaling.design import backbone_for, design
from megatron_xmod.scaling.planner import number, read_table
from megatron_xmod.xmod.layout import LayoutError

REQUIRED = ("L", "N_act", "K", "A", "C", "tokens", "loss")


@dataclass
class Runs:
    L: np.ndarray
    n_act: np.ndarray
    K: np.ndarray
    A: np.ndarray
    C: np.ndarray
    tokens: np.ndarray
    loss: np.ndarray
    dense_loss: np.ndarray
    capacity_ratio: np.ndarray
    d_dense: np.ndarray
    backbone: np.ndarray  # preset names, for plots that re-derive layouts
    dense_prefix: np.ndarray

    def __len__(self) -> int:
        return len(self.L)

    @property
    def delta(self) -> np.ndarray:
        return self.loss - self.dense_loss

    def subset(self, mask) -> Runs:
        return Runs(**{f.name: getattr(self, f.name)[mask] for f in fields(self)})

    def law_inputs(self) -> dict:
        return dict(n_act=self.n_act, capacity_ratio=self.capacity_ratio, L=self.L, K=self.K, A=self.A,
                    d_sparse=self.tokens, d_dense=self.d_dense)


def _dense_reference(points: dict, key, C: float, where: str) -> float:
    pts = sorted(points.get(key, []))
    L, backbone = key
    if not pts:
        raise ValueError(f"{where}: column 'dense_loss' is empty and there is no dense run (K = 1 row or "
                         f"--dense-curve) at L={L:g} for backbone {backbone}")
    cs = np.array([p[0] for p in pts])
    if len(pts) == 1 or not cs[0] * 0.98 <= C <= cs[-1] * 1.02:
        near = cs[np.argmin(abs(np.log(cs / C)))]
        if abs(np.log(near / C)) <= np.log(1.02):
            return float(dict(pts)[near])
        raise ValueError(f"{where}: C={C:.3g} lies outside the dense runs' compute {cs[0]:.3g}..{cs[-1]:.3g} at "
                         f"L={L:g} ({backbone}); give 'dense_loss' or a longer dense curve")
    return float(np.interp(np.log(C), np.log(cs), [p[1] for p in pts]))


def _backbone_spec(text: str, csv_path: str) -> str:
    """A backbone column: a preset name as written, or a JSON file made absolute (relative to the CSV)."""
    if not text:
        return ""
    from megatron_xmod.presets import is_backbone_file

    if is_backbone_file(text) or text.lower().endswith(".json"):
        candidate = os.path.join(os.path.dirname(os.path.abspath(csv_path)), text)
        return os.path.abspath(text if os.path.isfile(text) or not os.path.isfile(candidate) else candidate)
    return text


def load_runs(path: str, dense_curve: Optional[str] = None) -> Runs:
    rows = read_table(path, REQUIRED, "RUNS.csv")
    columns = set(rows[0]) if rows else set()
    if not rows:
        raise ValueError(f"RUNS.csv {path}: no rows")

    parsed, dense_points = [], defaultdict(list)
    for i, row in enumerate(rows):
        where = f"RUNS.csv {path} row {i + 2}"
        K = number(row, "K", where, integer=True)
        r = dict(where=where, L=number(row, "L", where), n_act=number(row, "N_act", where), K=K,
                 A=1.0 if K == 1 and not row.get("A") else number(row, "A", where),
                 C=number(row, "C", where), tokens=number(row, "tokens", where), loss=number(row, "loss", where),
                 dense_prefix=int(number(row, "dense_prefix", where, positive=False)) if row.get("dense_prefix") else 4,
                 layout=row.get("layout") or None)
        r["backbone"] = _backbone_spec(row.get("backbone") or "", path)
        try:
            b = backbone_for(r["n_act"], r["backbone"] or None)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
        r["backbone"] = r["backbone"] or b.name
        if K > 1 and int(r["L"]) % K:
            raise ValueError(f"{where}: K: {K} does not divide L = {r['L']:g} (training routes exactly L/K tokens per "
                             "sequence and refuses such a run); drop the row or fix K or L")
        if row.get("dense_loss"):
            r["dense_loss"] = number(row, "dense_loss", where)
        if row.get("dense_tokens"):
            r["dense_tokens"] = number(row, "dense_tokens", where)
        if K == 1:
            dense_points[(r["L"], r["backbone"])].append((r["C"], r["loss"]))
        else:
            parsed.append(r)
    if dense_curve:
        for i, row in enumerate(read_table(dense_curve, ("L", "N_act", "C", "loss"), "dense curve")):
            where = f"dense curve {dense_curve} row {i + 2}"
            spec = _backbone_spec(row.get("backbone") or "", dense_curve)
            b = spec or backbone_for(number(row, "N_act", where)).name
            backbone_for(0.0, b)  # a named backbone must resolve
            dense_points[(number(row, "L", where), b)].append((number(row, "C", where), number(row, "loss", where)))
    if not parsed:
        raise ValueError(f"RUNS.csv {path}: no sparse runs (K > 1) to fit")
    if "dense_loss" not in columns and not dense_points:
        raise ValueError(f"RUNS.csv {path}: missing column 'dense_loss', and no dense runs (K = 1 rows or "
                         "--dense-curve) to interpolate it from")

    out = defaultdict(list)
    for r in parsed:
        try:
            d = design(r["backbone"], r["K"], r["A"], int(r["L"]), r["dense_prefix"], layout=r["layout"])
        except LayoutError as err:
            raise ValueError(f"{r['where']}: {err}") from None
        dense_loss = r.get("dense_loss")
        if dense_loss is None:
            dense_loss = _dense_reference(dense_points, (r["L"], r["backbone"]), r["C"], r["where"])
        for name in ("L", "n_act", "K", "A", "C", "tokens", "loss", "backbone", "dense_prefix"):
            out[name].append(r[name])
        out["dense_loss"].append(dense_loss)
        out["capacity_ratio"].append(d.capacity_ratio)
        # Eq.(26): D_dense = C/phi_D = D_sparse * phi/phi_D when the logs do not give the dense run's tokens.
        out["d_dense"].append(r.get("dense_tokens", r["tokens"] * d.count.flops_ratio_vs_dense))
    return Runs(**{k: np.asarray(v) for k, v in out.items()})
