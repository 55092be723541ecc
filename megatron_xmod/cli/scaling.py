"""``xmod plan`` (choose K and A from the law) and ``xmod fit`` (refit the law on your runs)."""
from __future__ import annotations

import json
import math
import os

from megatron_xmod.presets import BACKBONES, Backbone, is_backbone_file, resolve_backbone
from megatron_xmod.scaling.law import TABLE8, LawParams


def _size(text: str, field: str = "max_total_params") -> float:
    """'5e9', '4.8B', '900m' -> parameters."""
    t = text.strip().lower()
    scale = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}.get(t[-1:], 1.0)
    try:
        return float(t[:-1] if scale != 1.0 else t) * scale
    except ValueError:
        raise ValueError(f"{field}: expected a number such as 5e9 or 4.8B, got {text!r}") from None


def _a_grid(text: str) -> tuple[float, ...]:
    try:
        grid = tuple(float(a) for a in text.split(",") if a.strip())
    except ValueError:
        raise ValueError(f"A-grid: expected comma-separated numbers such as 0.5,1,2,3,4,5, got {text!r}") from None
    if not grid or any(not a > 0 for a in grid):
        raise ValueError(f"A-grid: every anchor stride must be > 0, got {text!r}")
    return grid


def load_law(path: str | None) -> LawParams:
    if not path:
        return TABLE8
    if not os.path.isfile(path):
        raise ValueError(f"law {path}: file not found; give the law.json that `xmod fit --out DIR` wrote")
    with open(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"law {path}: not valid JSON ({e}); give the law.json that `xmod fit --out DIR` wrote") from None
    params = data.get("params", data)
    known = set(LawParams.__dataclass_fields__)
    missing = [k for k in ("e", "u", "eta_N", "rho_N", "w", "eta_L", "rho_L", "z", "rho_K", "rho_A") if k not in params]
    if missing:
        raise ValueError(f"law {path}: missing coefficient(s) {', '.join(missing)} (write it with `xmod fit --out`)")
    return LawParams(**{k: float(v) for k, v in params.items() if k in known})


def register(subparsers) -> None:
    p = subparsers.add_parser("plan", help="choose sparsity K and anchor stride A from the X-MoD scaling law")
    p.add_argument("--seq-len", type=int, default=32768, help="training sequence length L (tokens)")
    p.add_argument("--n-act", default=None,
                   help=f"activated size: a preset ({', '.join(BACKBONES)}), a backbone JSON file, or a number of "
                        "parameters (165e6, 300M): a number is planned on the preset of nearest size, or on --backbone "
                        f"when it agrees with that backbone's own activated size (within {N_ACT_TOLERANCE:.0%}); "
                        "default: --backbone's, else 556m")
    p.add_argument("--backbone", default=None,
                   help="the backbone whose layouts are counted (a preset or a JSON file, see `xmod count --help`); "
                        "default: the one --n-act names")
    p.add_argument("--max-total-params", default=None, help="cap on total parameters N, e.g. 5e9 or 4.8B")
    p.add_argument("--A", type=float, default=None, help="fix the anchor stride (default: search --A-grid)")
    p.add_argument("--A-grid", default="0.5,1,2,3,4,5", help="anchor strides to search (the paper's anchor sweep)")
    p.add_argument("--k-max", type=int, default=None,
                   help="largest K to consider (default 16: the largest K the law was fitted on; above it the "
                        "plan extrapolates and says so)")
    p.add_argument("--dense-prefix", type=int, default=4, help="N0, dense layers before the first sparse block")
    p.add_argument("--law", default=None, help="law JSON from `xmod fit --out` (default: Table 8 of the paper)")
    p.add_argument("--throughput", default=None,
                   help="wall-clock mode: CSV with columns K, A, tokens_per_s (optional layout), one row per config")
    p.add_argument("--dense-curve", default=None,
                   help="wall-clock mode: CSV with columns tokens, loss of the dense model at this L and backbone")
    p.add_argument("--hours", type=float, default=None, help="wall-clock mode: training time budget")
    p.add_argument("--moe", default=None, metavar="MODEL",
                   help="an MoE model (moe-8x64, dtopp-t6, ...) as every layer's feed-forward: the plan is the law's "
                        "(fitted without MoE), and the chosen layout is also counted as <layout>+MODEL")
    p.add_argument("--all", action="store_true", help="print every feasible candidate, best first")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.set_defaults(func=run_plan)

    f = subparsers.add_parser(
        "fit", help="refit the X-MoD scaling law on your own sweep (RUNS.csv, see docs/scaling.md)",
        description="Two-stage fit: stage 1 on the A = 1 runs needs one run more than it has coefficients (e, u, w "
                    "and the identifiable exponents: 6 runs for one backbone at one L, 7 with several L, 8 with "
                    "several L and backbones); stage 2 on the A != 1 runs needs 4 (z, rho_K, rho_A), or none "
                    "(then z = 0). Rows training would refuse (K not dividing L, a layout that is not whole) are "
                    "errors naming the row.")
    f.add_argument("runs", help="RUNS.csv, one row per run (columns: docs/scaling.md)")
    f.add_argument("--dense-curve", default=None, help="CSV with columns L, N_act, C, loss of dense runs to interpolate")
    f.add_argument("--law", choices=("reduced", "full"), default="reduced",
                   help="law written as 'params' and used for hold-out and plots: reduced = Eq.(21), full = Eq.(22)")
    f.add_argument("--holdout", default="auto",
                   help="comma list of L, N_act, A; 'auto' = those with enough groups; 'none' to skip")
    f.add_argument("--out", default="scaling_fit", help="folder for law.json and the PNG plots")
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--popsize", type=int, default=15, help="differential evolution population multiplier")
    f.add_argument("--maxiter", type=int, default=200, help="differential evolution generations")
    f.add_argument("--json", action="store_true", help="print the report as JSON")
    f.set_defaults(func=run_fit)


def _with_moe(backbone: Backbone, layout, moe: str, seq_len: int):
    """The count of ``layout`` with the MoE model ``moe`` as every layer's feed-forward."""
    from megatron_xmod.accounting import count
    from megatron_xmod.moe.presets import parse_moe_model
    from megatron_xmod.presets import ModelDescription

    return count(ModelDescription(f"{layout.notation}+{moe}", backbone, layout, parse_moe_model(moe)), seq_len)


def _fmt(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.0f}M" if n >= 1e7 else f"{n / 1e6:.3g}M"


def _infeasible_summary(items: list[dict]) -> str:
    from megatron_xmod.scaling.planner import group_infeasible, k_ranges

    return "; ".join(f"A={g['A']:g}: K={k_ranges(g['K'])}" for g in group_infeasible(items))


# How far a numeric --n-act may be from the --backbone's own activated size (the dense model of its
# depth, embeddings included, as the law counts N_act): nominal sizes such as 556M for 543M pass.
N_ACT_TOLERANCE = 0.10


def plan_backbone(n_act: str | None, backbone: str | None) -> tuple[Backbone, float | None, str]:
    """(backbone the layouts are counted on, N_act the law uses or None for the counted one, note)."""
    from megatron_xmod.accounting import count_model

    if n_act is None:
        return resolve_backbone(backbone or "556m"), None, ""
    if not _is_number(n_act):
        named = resolve_backbone(n_act)
        if backbone is not None and resolve_backbone(backbone) != named:
            raise ValueError(f"backbone: --n-act {n_act} already names a backbone; give --n-act as a number of "
                             "parameters to plan it on --backbone, or leave --n-act out")
        return named, None, ""
    value = _size(n_act, "n_act")
    if not value > 0:
        raise ValueError(f"n_act: must be > 0, got {n_act!r}")
    if backbone is not None:
        b = resolve_backbone(backbone)
        own = count_model(b, f"D*{b.num_layers}", 2048).active_params
        if abs(value - own) > N_ACT_TOLERANCE * own:
            raise ValueError(f"n_act: {value / 1e6:.3g}M disagrees with backbone {b.name}, whose {b.num_layers}-layer "
                             f"dense model activates {own / 1e6:.3g}M parameters (embeddings included, as the law "
                             f"counts N_act); leave --n-act out to plan on the backbone's own size, or give a number "
                             f"within {N_ACT_TOLERANCE:.0%} of it")
        return b, value, f"N_act = {value / 1e6:.3g}M in the law, layouts counted on backbone {b.name} ({own / 1e6:.3g}M)"
    nearest = min(BACKBONES.values(), key=lambda b: abs(math.log(count_model(b, f"D*{b.num_layers}", 2048).active_params
                                                                 / value)))
    return nearest, value, (f"N_act = {value / 1e6:.0f}M; layouts counted on the nearest preset, {nearest.name} "
                            "(give --backbone FILE for your own)")


def _is_number(text: str) -> bool:
    try:
        resolve_backbone(text)
        return False  # a preset name such as 165m, or a backbone file
    except ValueError:
        pass
    try:
        _size(text, "n_act")
        return not is_backbone_file(text)
    except ValueError:
        return False


def run_plan(args) -> int:
    from megatron_xmod.scaling.planner import DEFAULT_K_MAX, FITTED_RANGE, DenseCurve, plan_flops, plan_wallclock

    backbone, n_act, basis = plan_backbone(args.n_act, args.backbone)
    params = load_law(args.law)
    cap = _size(args.max_total_params) if args.max_total_params else None
    wallclock = [args.throughput, args.dense_curve, args.hours]
    if any(x is not None for x in wallclock):
        if any(x is None for x in wallclock):
            raise ValueError("throughput: wall-clock mode needs all of --throughput, --dense-curve and --hours")
        plan = plan_wallclock(backbone, args.seq_len, args.throughput, DenseCurve.from_csv(args.dense_curve),
                              args.hours, params, args.dense_prefix, cap, n_act)
    else:
        grid = (args.A,) if args.A is not None else _a_grid(args.A_grid)
        k_max = DEFAULT_K_MAX if args.k_max is None else args.k_max
        plan = plan_flops(backbone, args.seq_len, params, grid, k_max, args.dense_prefix, cap, n_act)
    if basis:
        plan.warnings.insert(0, basis)
    combined = None
    if args.moe:
        combined = _with_moe(backbone, plan.best.design.layout, args.moe, args.seq_len)
        plan.warnings.append(
            f"the law was fitted on X-MoD with dense feed-forwards, without MoE: K, A and Delta are that model's; "
            f"with {args.moe} in every layer the layout counts N = {_fmt(combined.total_params)}, N_act = "
            f"{_fmt(combined.active_params)}, phi/phi_D = {combined.flops_ratio_vs_dense:.3f} (vs the dense model "
            "of the same activated depth), and no run has measured how depth and width sparsity combine in the loss")
    result = plan.to_dict()
    if combined is not None:
        result["moe"] = {"model": args.moe, **combined.to_dict()}
    if args.json:
        if not args.all:
            result.pop("candidates")
        print(json.dumps(result, indent=2))
        return 0

    b = plan.best
    c = b.design.count
    law = "fitted law " + args.law if args.law else "Table 8 law"
    print(f"xmod plan ({plan.mode} mode, {law}): backbone {backbone.name}, L = {args.seq_len}"
          + (f", N <= {_fmt(cap)}" if cap else ""))
    print(f"  K = {b.design.K}, A = {'-' if b.design.A is None else f'{b.design.A:g}'}"
          + (f"  ({b.design.note})" if b.design.note else ""))
    print(f"  layout      {b.design.layout.notation}  ({c.num_layers} physical layers)")
    print(f"  N = {_fmt(c.total_params)} ({c.total_params:,}), N_act = {_fmt(c.active_params)} ({c.active_params:,})")
    print(f"  phi/phi_D = {c.flops_ratio_vs_dense:.3f}, D/D_D = {c.tokens_ratio_vs_dense:.2f} at equal compute")
    print(f"  predicted Delta = {b.predicted_delta:+.4f} (loss minus the FLOP-matched dense loss)")
    if b.predicted_loss is not None:
        print(f"  predicted loss after {args.hours:g} h = {b.predicted_loss:.4f} at {b.tokens_per_s:,.0f} tokens/s")
    e = plan.exponents
    print(f"  Eq.(31): K^ ~ L^{e['L']:.3f} * N_act^{e['N_act']:.3f}")
    if not args.law:
        r = FITTED_RANGE
        print(f"  Table 8 was fitted on L = {r['L'][0]}..{r['L'][1]}, N_act = {r['N_act'][0] / 1e6:.0f}M.."
              f"{r['N_act'][1] / 1e6:.0f}M, K <= {r['K'][1]}, A = {r['A'][0]:g}..{r['A'][1]:g} (notes below say when "
              "a plan leaves it), on whole-sequence attention: runs with document masks (--reset-attention-mask) "
              "attend over their documents only, which the law did not see")
    if plan.infeasible:
        print(f"  infeasible (A*K or N1 = ({backbone.num_layers}-N0)/(1+A) with N0 = {args.dense_prefix} not whole), "
              f"skipped: {_infeasible_summary(plan.infeasible)}")
        if not any(o.design.K > 1 for o in plan.options):
            first = next((i for i in plan.infeasible if i["A"] == 1.0), plan.infeasible[0])
            print(f"  note: no sparse layout fits backbone {backbone.name} ({backbone.num_layers} activated layers); "
                  f"at K = {first['K']}, A = {first['A']:g}: {first['reason']}")
    if plan.over_budget:
        print(f"  {len(plan.over_budget)} candidates above the parameter cap")
    for w in plan.warnings:
        print(f"  note: {w}")
    if args.all:
        key = (lambda o: o.predicted_loss) if plan.mode == "wallclock" else (lambda o: o.predicted_delta)
        print(f"  {'K':>3} {'A':>4} {'N':>8} {'phi/phi_D':>9} {'Delta':>8}" + ("  loss" if plan.mode == "wallclock" else ""))
        for o in sorted(plan.options, key=key):
            a = "-" if o.design.A is None else f"{o.design.A:g}"
            print(f"  {o.design.K:>3} {a:>4} {_fmt(o.design.count.total_params):>8} "
                  f"{o.design.count.flops_ratio_vs_dense:>9.3f} {o.predicted_delta:>+8.4f}"
                  + (f"  {o.predicted_loss:.4f}" if o.predicted_loss is not None else ""))
    return 0


def run_fit(args) -> int:
    from megatron_xmod.scaling.fit import (
        HOLDOUTS,
        FitReport,
        SearchOptions,
        check_holdout,
        check_minimum_runs,
        fit_both,
        holdout,
        in_sample,
        minimum_runs,
    )
    from megatron_xmod.scaling.plots import write_plots
    from megatron_xmod.scaling.runs import load_runs

    runs = load_runs(args.runs, args.dense_curve)
    if args.popsize < 1 or args.maxiter < 1:
        raise ValueError("popsize/maxiter: must be >= 1")
    check_minimum_runs(runs, "reduced")  # before any search
    opts = SearchOptions(seed=args.seed, popsize=args.popsize, maxiter=args.maxiter)
    if args.holdout == "none":
        kinds = []
    elif args.holdout == "auto":
        kinds = []
        for by in HOLDOUTS:
            try:
                check_holdout(runs, by)
                kinds.append(by)
            except ValueError:
                pass
    else:
        kinds = [k.strip() for k in args.holdout.split(",") if k.strip()]
        for by in kinds:
            check_holdout(runs, by)  # fail before the expensive fits

    reduced, full, fell_back = fit_both(runs, opts)
    chosen = full if args.law == "full" else reduced
    report = FitReport(reduced, full, in_sample(reduced, runs), in_sample(full, runs), fell_back)
    for by in kinds:
        report.holdout[by] = holdout(runs, by, args.law, opts, base_params=chosen.replace(z=0.0))
    os.makedirs(args.out, exist_ok=True)
    result = report.to_dict(args.law)
    result["runs"] = len(runs)
    result["plots"] = write_plots(chosen, runs, report.holdout, args.out)
    law_path = os.path.join(args.out, "law.json")
    with open(law_path, "w") as fh:
        json.dump(result, fh, indent=2)
    result["law_json"] = law_path
    if args.json:
        print(json.dumps(result, indent=2))
        return 0

    print(f"xmod fit: {len(runs)} sparse runs from {args.runs}; two-stage DE (seed {args.seed}) + NNLS")
    need = minimum_runs(runs, "reduced")
    print("  runs per stage: " + ", ".join(f"{stage} {int(((runs.A == 1) if '(A = 1)' in stage else (runs.A != 1)).sum())} "
                                           f"(minimum {n})" for stage, n in need.items()))
    names = ("e", "u", "eta_N", "rho_N", "w", "eta_L", "rho_L", "z", "rho_K", "rho_A", "v", "eta_D", "rho_D")
    print(f"  {'coef':<6} {'Table 8':>10} {'reduced':>11} {'full':>11}")
    for n in names:
        t8 = getattr(TABLE8, n) if n not in ("eta_D", "rho_D") else float("nan")
        print(f"  {n:<6} {t8:>10.5g} {getattr(reduced, n):>11.5g} {getattr(full, n):>11.5g}")
    for label, m in (("reduced (Eq.21)", report.reduced_metrics), ("full (Eq.22)", report.full_metrics)):
        print(f"  in-sample {label:<16} RMSE {m['rmse']:.5f}  MAE {m['mae']:.5f}  R2_Delta {m['r2_delta']:.4f}")
    if fell_back:
        print("  note: the full-law search did not beat the reduced law; kept the reduced solution (v = 0)")
    for by, h in report.holdout.items():
        print(f"  leave-one-{by}-out ({args.law}): RMSE {h['rmse']:.5f}  MAE {h['mae']:.5f}  over {h['n']} runs")
        for g in h["groups"]:
            extra = f", {g['skipped']} not scored (axis not spanned by the rest)" if g.get("skipped") else ""
            scores = f"RMSE {g['rmse']:.5f}  MAE {g['mae']:.5f}" if g["n"] else "no run scored"
            print(f"    held out {g['group']}: {scores}  (n={g['n']}{extra})")
    print(f"  wrote {law_path} and {', '.join(result['plots'])}")
    return 0
