"""Refit the law on your own runs: the two-stage protocol and grouped hold-out (Eq.37-39) of the
X-MoD paper, "X-MoD: Practical Scaling Laws for Sparse-Depth Routing Beyond Mixture-of-Depths".

Stage 1 fits the base law (e, u, [v], w and their exponents) on the A = 1 runs, where R_AK = 0.
Stage 2 freezes it and calibrates the A-K term (z, rho_K, rho_A) on the anchor sweep (A != 1).
In each stage the exponents are searched by differential evolution, and for every candidate exponent
vector the linear coefficients are solved exactly: non-negative least squares, bias unconstrained.

The paper reports the full law (with P_D) fitting worse in-sample than the reduced law it contains
as its v = 0 case (pooled RMSE 0.01349 vs 0.008758), which a converged search cannot produce. Here
the full search is seeded with the reduced solution (v = 0 is reachable since v >= 0 is solved by NNLS), and if the
search still ends worse, the reduced solution embedded in the full law is kept and that is reported.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import differential_evolution, nnls

from megatron_xmod.scaling.law import TABLE8, LawParams, features, predict_delta, predict_loss
from megatron_xmod.scaling.runs import Runs

BOUNDS = {"eta_N": (0.0, 1.0), "rho_N": (0.05, 3.0), "eta_L": (0.0, 2.0), "rho_L": (0.05, 2.0),
          "eta_D": (0.0, 1.0), "rho_D": (0.05, 3.0), "rho_K": (0.05, 2.0), "rho_A": (0.05, 3.0)}
BASE_EXPONENTS = {"reduced": ("eta_N", "rho_N", "eta_L", "rho_L"),
                  "full": ("eta_N", "rho_N", "eta_L", "rho_L", "eta_D", "rho_D")}
BASE_COLUMNS = {"reduced": (0, 2), "full": (0, 1, 2)}  # feature columns: -R_N, P_D, P_L, -R_AK
LAWS = tuple(BASE_EXPONENTS)
HOLDOUTS = ("L", "N_act", "A")


@dataclass(frozen=True)
class SearchOptions:
    seed: int = 0
    popsize: int = 15
    maxiter: int = 200
    tol: float = 1e-10


def _nonneg_lstsq(X: np.ndarray, y: np.ndarray, bias: bool) -> tuple[float, np.ndarray]:
    """min ||y - e - X c|| with c >= 0 and e free: the optimal e is mean(y - X c), so centre and NNLS."""
    if bias:
        xm, ym = X.mean(axis=0), y.mean()
        X, y = X - xm, y - ym
    scale = np.linalg.norm(X, axis=0)
    scale[scale == 0] = 1.0  # a constant feature (e.g. a single L) carries no information: coefficient 0
    c, _ = nnls(X / scale, y, maxiter=50 * X.shape[1])
    c = c / scale
    return (float(ym - xm @ c) if bias else 0.0), c


def _search(objective, names, opts: SearchOptions, x0=None):
    bounds = [BOUNDS[n] for n in names]
    if x0 is not None:
        x0 = np.clip(x0, [b[0] for b in bounds], [b[1] for b in bounds])
    result = differential_evolution(objective, bounds, seed=opts.seed, popsize=opts.popsize, maxiter=opts.maxiter,
                                    tol=opts.tol, polish=True, x0=x0)
    return result.x, float(result.fun)


def fit_base(runs: Runs, law: str = "reduced", opts: SearchOptions = SearchOptions(),
             start: LawParams | None = None) -> tuple[LawParams, float]:
    """Stage 1 on A = 1 runs. Returns the law (z = 0) and its mean squared residual."""
    if law not in LAWS:
        raise ValueError(f"law: must be one of {', '.join(LAWS)}, got {law!r}")
    names, cols = BASE_EXPONENTS[law], list(BASE_COLUMNS[law])
    y = runs.delta
    template = TABLE8.replace(v=0.0, z=0.0)
    # With one backbone (or one L) in the data the size (context) exponent is not identifiable: it only
    # rescales u (w). Pin it to 0, "no dependence", rather than let the search pick an arbitrary value
    # that then decides every prediction at other sizes (e.g. leave-one-L-out holding out the L of the
    # scale sweep).
    pinned = {}
    if len(set(runs.backbone.tolist())) == 1:
        pinned["eta_N"] = 0.0
    if len(set(runs.L.tolist())) == 1:
        pinned["eta_L"] = 0.0
    template = template.replace(**pinned)
    names = tuple(n for n in names if n not in pinned)

    def solve(x):
        p = template.replace(**{n: float(v) for n, v in zip(names, x)})
        X = features(p, **runs.law_inputs())[:, cols]
        e, c = _nonneg_lstsq(X, y, bias=True)
        return p, e, c, float(np.mean((y - e - X @ c) ** 2))

    x0 = None if start is None else np.array([getattr(start, n) for n in names])
    x, _ = _search(lambda x: solve(x)[3], names, opts, x0)
    p, e, c, mse = solve(x)
    coef = {k: float(v) for k, v in zip(("u", "v", "w") if law == "full" else ("u", "w"), c)}
    return p.replace(e=e, **coef), mse


def fit_anchor(runs: Runs, base: LawParams, opts: SearchOptions = SearchOptions()) -> LawParams:
    """Stage 2: z, rho_K, rho_A on the anchor runs with the base law frozen (A = 1 rows add nothing)."""
    anchor = runs.subset(runs.A != 1)
    if len(anchor) == 0:
        return base.replace(z=0.0)
    base0 = base.replace(z=0.0)
    r = anchor.delta - predict_delta(base0, **anchor.law_inputs())
    names = ("rho_K", "rho_A")

    def solve(x):
        p = base0.replace(rho_K=float(x[0]), rho_A=float(x[1]))
        X = features(p, **anchor.law_inputs())[:, [3]]
        _, c = _nonneg_lstsq(X, r, bias=False)
        return p.replace(z=float(c[0])), float(np.mean((r - X @ c) ** 2))

    x, _ = _search(lambda x: solve(x)[1], names, opts, np.array([base.rho_K, base.rho_A]))
    return solve(x)[0]


ANCHOR_COEFFICIENTS = ("z", "rho_K", "rho_A")


def minimum_runs(runs: Runs, law: str = "reduced") -> dict[str, int]:
    """The fewest runs each stage needs: one more than the coefficients it fits. Stage 1 (A = 1 runs)
    fits e, u, w (and v for the full law) plus the exponents the data can identify (eta_N needs two
    backbones, eta_L two sequence lengths); stage 2 (A != 1 runs) fits z, rho_K, rho_A, or is skipped
    (z = 0) when there is no anchor run."""
    base = runs.subset(runs.A == 1)
    exponents = [n for n in BASE_EXPONENTS[law]
                 if not (n == "eta_N" and len(set(base.backbone.tolist())) <= 1)
                 and not (n == "eta_L" and len(set(base.L.tolist())) <= 1)]
    linear = 4 if law == "full" else 3
    return {"stage 1 (A = 1)": linear + len(exponents) + 1, "stage 2 (A != 1)": len(ANCHOR_COEFFICIENTS) + 1}


def check_minimum_runs(runs: Runs, law: str = "reduced") -> None:
    """Refuse, before any search, a sweep with fewer runs than a stage has coefficients to fit."""
    need = minimum_runs(runs, law)
    have = {"stage 1 (A = 1)": int((runs.A == 1).sum()), "stage 2 (A != 1)": int((runs.A != 1).sum())}
    for stage, n in need.items():
        if have[stage] < n and not (stage.startswith("stage 2") and have[stage] == 0):
            raise ValueError(f"RUNS.csv: {stage} needs at least {n} sparse runs (one more than the coefficients it "
                             f"fits), found {have[stage]}; add runs"
                             + (" with A = 1 (the A-K term is defined relative to A = 1)" if stage.startswith("stage 1")
                                else " with A != 1, or drop the anchor runs to fit the base law alone (z = 0)"))


def fit_two_stage(runs: Runs, law: str = "reduced", opts: SearchOptions = SearchOptions(),
                  start: LawParams | None = None) -> LawParams:
    base_runs = runs.subset(runs.A == 1)
    check_minimum_runs(runs, "reduced")
    base, _ = fit_base(base_runs, law, opts, start)
    return fit_anchor(runs, base, opts)


def metrics(pred: np.ndarray, obs: np.ndarray) -> dict:
    err = np.asarray(pred) - np.asarray(obs)
    return {"n": int(err.size), "rmse": float(np.sqrt(np.mean(err ** 2))), "mae": float(np.mean(np.abs(err)))}


def in_sample(p: LawParams, runs: Runs) -> dict:
    pred = predict_loss(p, runs.dense_loss, **runs.law_inputs())  # Eq.(37)
    m = metrics(pred, runs.loss)
    d = runs.delta
    m["r2_delta"] = float(1 - np.sum((pred - runs.loss) ** 2) / np.sum((d - d.mean()) ** 2))
    return m


@dataclass
class FitReport:
    reduced: LawParams
    full: LawParams
    reduced_metrics: dict
    full_metrics: dict
    full_fell_back: bool
    holdout: dict = field(default_factory=dict)

    def to_dict(self, law: str) -> dict:
        return {"law": law, "params": (self.full if law == "full" else self.reduced).to_dict(),
                "reduced": {"params": self.reduced.to_dict(), "in_sample": self.reduced_metrics},
                "full": {"params": self.full.to_dict(), "in_sample": self.full_metrics,
                         "fell_back_to_reduced": self.full_fell_back},
                "holdout": {k: {kk: vv for kk, vv in v.items() if kk != "points"} for k, v in self.holdout.items()}}


def fit_both(runs: Runs, opts: SearchOptions = SearchOptions()) -> tuple[LawParams, LawParams, bool]:
    """Reduced law, then the full law searched from it; the full law can only match or beat it in-sample."""
    reduced = fit_two_stage(runs, "reduced", opts)
    full = fit_two_stage(runs, "full", opts, start=reduced)
    if in_sample(full, runs)["rmse"] > in_sample(reduced, runs)["rmse"]:
        return reduced, reduced.replace(v=0.0), True
    return reduced, full, False


def _fit(runs: Runs, law: str, opts: SearchOptions) -> LawParams:
    return fit_both(runs, opts)[1] if law == "full" else fit_two_stage(runs, law, opts)


def _group_values(runs: Runs, by: str) -> np.ndarray:
    # N_act groups are backbones: the counted N_act of one backbone varies with K by its router weights.
    return runs.L if by == "L" else runs.backbone


def check_holdout(runs: Runs, by: str) -> list:
    """The groups a leave-one-out split would hold out; raises when there are too few to learn from."""
    if by not in HOLDOUTS:
        raise ValueError(f"holdout: must be among {', '.join(HOLDOUTS)}, got {by!r}")
    if by == "A":
        groups = sorted(set(runs.A[runs.A != 1].tolist()))
        if len(groups) < 2:
            raise ValueError(f"holdout A: leave-one-A-out needs at least 2 anchor strides A != 1 (A = 1 is the "
                             f"zero-interaction baseline, never held out); found {groups or 'none'}")
        return groups
    base = runs.subset(runs.A == 1)
    groups = sorted(set(_group_values(base, by).tolist()))
    if len(groups) < 3:
        raise ValueError(f"holdout {by}: leave-one-{by}-out needs at least 3 distinct {by} among the A = 1 runs "
                         f"(two left to fit the {'context' if by == 'L' else 'scale'} exponent); found "
                         f"{len(groups)}: {', '.join(str(g) for g in groups) or 'none'}")
    return groups


def holdout(runs: Runs, by: str, law: str = "reduced", opts: SearchOptions = SearchOptions(),
            base_params: LawParams | None = None) -> dict:
    """Grouped hold-out of Eq.(38)-(39): refit without one group, predict its raw losses (Eq.37)."""
    groups = check_holdout(runs, by)
    pred_all, obs_all, per_group, points = [], [], [], []
    for g in groups:
        if by == "A":
            # Base law from all A = 1 runs (never held out), A-K term from the other anchor strides.
            base = base_params or fit_base(runs.subset(runs.A == 1), law, opts)[0]
            train = runs.subset(runs.A != g)
            test = runs.subset(runs.A == g)
            p = fit_anchor(train, base, opts)
        else:
            values = _group_values(runs, by)
            train = runs.subset((runs.A == 1) & (values != g))
            test = runs.subset((runs.A == 1) & (values == g))
            # Score only held-out runs whose other axis the training split spans: with the 556M K-L
            # sweep held out, nothing left varies L, so its 2k-16k runs test no transfer, only a prior.
            other, seen = (test.backbone, train.backbone) if by == "L" else (test.L, train.L)
            covered = np.isin(other, seen)
            skipped = int((~covered).sum())
            test = test.subset(covered)
            if len(test) == 0:
                per_group.append({"group": g, "n": 0, "skipped": skipped})
                continue
            p = _fit(train, law, opts)  # A = 1 only: stage 2 is a no-op
        pred = predict_loss(p, test.dense_loss, **test.law_inputs())
        per_group.append({"group": g, **metrics(pred, test.loss), **({"skipped": skipped} if by != "A" and skipped else {})})
        pred_all.append(pred)
        obs_all.append(test.loss)
        points += list(zip(pred.tolist(), test.loss.tolist()))
    return {"by": by, **metrics(np.concatenate(pred_all), np.concatenate(obs_all)), "groups": per_group,
            "points": points}
