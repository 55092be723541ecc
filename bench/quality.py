"""Dense, MoD and X-MoD at equal training FLOPs across seeds, and at equal wall clock on this machine.

The demo's models (megatron_xmod.demo: one tiny backbone, activated depth 6, K = 4) trained by the real
entry point on the embedded Shakespeare corpus, ``--seeds`` times each (the seed sets the weight
initialisation and megatron's data order), at every ``--seq-lengths`` L. Each run keeps the demo's
tokens per step (2048: 8 sequences at L = 256, 2 at L = 1024) and its equal-FLOPs rule (the Dense model
gets ``--dense-iters`` steps, a routed one ``dense_iters * phi_D / phi``), then is evaluated from its
final checkpoint on the same held-out sequences (Julius Caesar, Twelfth Night, Macbeth) with the
threshold rule (deployable) and the top-k rule.

Reported per L and model: mean +- standard deviation over seeds of the validation loss; per routed
model, its difference to Dense (paired by seed), mean +- standard deviation and standard error, and
whether it is resolved (|mean| > 2 standard errors). At equal wall clock: each run's validation curve
(in-training validations every ``--eval-interval`` steps, on the same first held-out batches) against
its own training time (megatron's elapsed time per iteration, summed; validation time left out),
interpolated at the shortest total training time of the L's runs, so every model is compared after the
same seconds of training on this machine.

Each finished run is kept (``--runs``, default runs/quality/L<L>/seed<S>/<model>/, with ``run.json``):
an interrupted study resumes where it stopped. Results: bench/results/quality_<machine>_<date>.{md,json,png}.

    .venv/bin/python bench/quality.py                      # 3 seeds x 3 models x L 256 and 1024 (~1 h, 2 cores)
    .venv/bin/python bench/quality.py --seeds 1 --seq-lengths 64 --dense-iters 4   # seconds: a smoke run
    .venv/bin/python bench/quality.py --models dense,moe,xmod,xmod-moe   # depth x width (MoE 8:64 FFNs)
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import re
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from throughput import git_commit, loadavg, machine_name  # noqa: E402  (bench/, this script's folder)

ELAPSED = re.compile(r"iteration\s+(\d+)/\s*\d+ .*?elapsed time per iteration \(ms\): ([0-9.]+)")
TOKENS_PER_STEP = 2048  # the demo's: 8 sequences of 256


def cpu_isa() -> str:
    """The CPU's widest vector extension torch dispatches to (what changes the last digits across CPUs)."""
    import torch

    return torch.backends.cpu.get_cpu_capability()


def training_seconds(train_log: str) -> dict[int, float]:
    """{iteration: seconds of training up to and including it}, from megatron's per-iteration times."""
    total, at = 0.0, {}
    for iteration, ms in ELAPSED.findall(train_log):
        total += float(ms) / 1000
        at[int(iteration)] = total
    return at


def run_one(model: str, seq_length: int, seed: int, iterations: int, a, run_dir: Path, corpus_args) -> dict:
    from megatron_xmod.demo import _train, read_run

    record = run_dir / "run.json"
    if record.is_file():
        return json.loads(record.read_text())
    per_step = max(1, TOKENS_PER_STEP // seq_length)
    args = SimpleNamespace(seq_length=seq_length, micro_batch_size=min(4, per_step), global_batch_size=per_step,
                           lr=a.lr, eval_interval=a.eval_interval, eval_iters=a.eval_iters,
                           final_eval_iters=a.final_eval_iters, seed=seed)
    started = time.time()
    _train(model, iterations, args, corpus_args, run_dir.parent)  # writes run_dir = parent / model
    result = read_run(run_dir)
    seconds = training_seconds((run_dir / "train.log").read_text())
    result.update(model=model, seq_length=seq_length, seed=seed, iterations=iterations,
                  train_seconds=seconds[max(seconds)] if seconds else None, wall_seconds=time.time() - started,
                  time_curve=[(seconds[i], loss) for i, loss in result["validation"] if i in seconds])
    record.write_text(json.dumps(result, indent=1))
    return result


def mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else float("nan")


def loss_at(curve: list[tuple[float, float]], seconds: float) -> float:
    """The validation loss of a (seconds, loss) curve at ``seconds``, linearly interpolated."""
    points = sorted(curve)
    if seconds <= points[0][0]:
        return points[0][1]
    for (t0, l0), (t1, l1) in zip(points, points[1:]):
        if t0 <= seconds <= t1:
            return l0 + (l1 - l0) * (seconds - t0) / (t1 - t0) if t1 > t0 else l1
    return points[-1][1]


# Two-sided 95% quantiles of Student's t by degrees of freedom (seeds - 1): with 3 seeds, 2 standard
# errors are only an ~82% interval, so the stricter test is reported beside the 2-SE rule.
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def paired(a: dict[int, float], b: dict[int, float]) -> Optional[dict]:
    """a - b paired by seed: mean, sd, standard error, resolved (|mean| > 2 standard errors) and
    resolved_t95 (|mean| > the 95% t quantile x SE)."""
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return None
    diffs = [a[s] - b[s] for s in seeds]
    d_mean, d_sd = mean_sd(diffs)
    n = len(diffs)
    se = d_sd / math.sqrt(n) if n > 1 else float("nan")
    return dict(diff_mean=d_mean, diff_sd=d_sd, diff_se=se, diffs=diffs, seeds=seeds,
                resolved=bool(n > 1 and abs(d_mean) > 2 * se),
                resolved_t95=bool(n > 1 and abs(d_mean) > T95.get(n - 1, 1.96) * se))


def compare(runs: list[dict], models: list[str], key) -> dict:
    """Per model: mean/sd of key(run) over seeds; per other model the paired difference to Dense (to the
    first model of ``models`` when Dense did not run: ``reference``), and X-MoD's to MoD
    (``xmod_minus_mod``) when both ran."""
    out = {}
    by = {m: {r["seed"]: key(r) for r in runs if r["model"] == m and key(r) is not None} for m in models}
    reference = "dense" if "dense" in models else models[0]
    for m in models:
        values = list(by[m].values())
        if not values:
            continue
        mean, sd = mean_sd(values)
        row = {"mean": mean, "sd": sd, "n": len(values)}
        if m != reference:
            row.update(paired(by[m], by.get(reference, {})) or {}, reference=reference)
        if m == "xmod" and by.get("mod"):
            row["xmod_minus_mod"] = paired(by["xmod"], by["mod"])
        out[m] = row
    return out


def summarise(runs: list[dict], models: list[str], lengths: list[int]) -> dict:
    summary = {}
    for L in lengths:
        at_l = [r for r in runs if r["seq_length"] == L]
        if not at_l:
            continue
        timed = [r for r in at_l if r.get("time_curve")]
        horizon = min(r["time_curve"][-1][0] for r in timed) if timed else None
        summary[L] = {
            "equal_flops_threshold": compare(at_l, models, lambda r: r["val_loss_threshold"]),
            # Dense has no routing: its loss under "top-k" is its one loss
            "equal_flops_topk": compare(at_l, models, lambda r: r["val_loss_topk"] if r["val_loss_topk"] is not None
                                        else r["val_loss_threshold"]),
            "equal_wall_clock": compare(at_l, models, lambda r, t=horizon: loss_at(r["time_curve"], t)
                                        if r.get("time_curve") else None),
            "wall_clock_horizon_s": horizon,
            "train_seconds": compare(at_l, models, lambda r: r["train_seconds"]),
        }
    return summary


def _verdict(d: dict) -> str:
    if d["resolved_t95"]:
        return "resolved, also at 95% (t)"
    return "resolved at 2 SE, not at 95% (t)" if d["resolved"] else "not resolved"


def _fmt_row(name: str, row: dict) -> str:
    diff = "-"
    if "diff_mean" in row:
        reference = "Dense" if row.get("reference", "dense") == "dense" else row["reference"]
        diff = (f"minus {reference} {row['diff_mean']:+.4f} +- {row['diff_sd']:.4f} (SE {row['diff_se']:.4f}; "
                f"{_verdict(row)})")
    versus_mod = row.get("xmod_minus_mod")
    if versus_mod:
        diff += (f"; minus MoD {versus_mod['diff_mean']:+.4f} +- {versus_mod['diff_sd']:.4f} "
                 f"(SE {versus_mod['diff_se']:.4f}; {_verdict(versus_mod)})")
    return f"| {name} | {row['mean']:.4f} +- {row['sd']:.4f} | {row['n']} | {diff} |"


def write_results(summary: dict, runs: list[dict], meta: dict, out: Path, tag: str) -> Path:
    models = ", ".join(next(iter(summary.values()))["equal_flops_threshold"]) if summary else "no runs yet"
    lines = [f"# Quality across seeds: {models} at equal training FLOPs and at equal wall clock ({meta['machine']})",
             "", f"- date: {meta['date']}; commit {meta['commit']}; CPU ISA {meta['isa']}; "
             f"load average before/after {meta['load_before']} / {meta['load_after']}",
             f"- models: the demo's (megatron_xmod.demo.MODELS), {meta['tokens_per_step']} tokens a step, the Dense model "
             f"{meta['dense_iters']} steps and the others at its training FLOPs; seeds {meta['seeds']}",
             "- loss: final checkpoint on the same held-out sequences; differences paired by seed; resolved: "
             "|mean difference| > 2 standard errors (SE = sd / sqrt(seeds)); with few seeds that is a wide net (an ~82% "
             "interval at 3 seeds, ~86% at 4), so the 95% test of Student's t (4.30 SE at 3 seeds, 3.18 at 4) is given too",
             ""]
    for L, s in summary.items():
        for title, key in (("equal training FLOPs, threshold rule (deployable)", "equal_flops_threshold"),
                           ("equal training FLOPs, top-k rule", "equal_flops_topk"),
                           (f"equal wall clock on this machine (validation curve at {s['wall_clock_horizon_s']:.0f} s "
                            "of training, the shortest run's total; threshold rule)", "equal_wall_clock")):
            lines += [f"## L = {L}: {title}", "", "| model | val loss (mean +- sd) | seeds | paired differences |",
                      "|---|---:|---:|---|"]
            lines += [_fmt_row(m, row) for m, row in s[key].items()]
            lines.append("")
        secs = s["train_seconds"]
        lines += [f"Training time at L = {L} (s, mean +- sd): " + ", ".join(
            f"{m} {row['mean']:.0f} +- {row['sd']:.0f}" for m, row in secs.items()), ""]
    md = out / f"quality_{tag}.md"
    md.write_text("\n".join(lines) + "\n")
    (out / f"quality_{tag}.json").write_text(json.dumps({"meta": meta, "summary": summary, "runs": runs}, indent=1))
    _plot(summary, out / f"quality_{tag}.png")
    return md


def _plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(L, key) for L in summary for key in ("equal_flops_threshold", "equal_wall_clock")]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.4), squeeze=False)
    for ax, (L, key) in zip(axes[0], panels):
        rows = summary[L][key]
        names = list(rows)
        for i, m in enumerate(names):
            row = rows[m]
            ax.errorbar([i], [row["mean"]], yerr=[row["sd"]], fmt="o", capsize=4)
        ax.set_xticks(range(len(names)), names)
        ax.set_title(f"L={L}, {'equal FLOPs' if key == 'equal_flops_threshold' else 'equal wall clock'}", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("validation loss (threshold rule), mean +- sd over seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--seq-lengths", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--models", default="dense,mod,xmod")
    p.add_argument("--dense-iters", type=int, default=160)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-interval", type=int, default=20)
    p.add_argument("--eval-iters", type=int, default=2)
    p.add_argument("--final-eval-iters", type=int, default=16)
    p.add_argument("--tokenizer", default="sentencepiece")
    p.add_argument("--runs", default=str(REPO / "runs" / "quality"))
    p.add_argument("--out", default=str(REPO / "bench" / "results"))
    p.add_argument("--tag", default=None, help="results name quality_<tag>.* (default cpu_<date>)")
    p.add_argument("--write-demo-record", action="store_true",
                   help="write the L = 256 spread to megatron_xmod/data/demo_seed_spread.json, which `xmod demo` "
                        "prints under its table (the demo's settings: L 256, 8 sequences a step)")
    a = p.parse_args(argv)
    from megatron_xmod.data.corpus import ensure_default_corpus
    from megatron_xmod.data.tokenizers import megatron_tokenizer_args
    from megatron_xmod.demo import equal_flops_iterations

    models = [m.strip() for m in a.models.split(",") if m.strip()]
    corpus = ensure_default_corpus(a.tokenizer, progress=True)
    corpus_args = ["--train-data-path", corpus["train"], "--valid-data-path", corpus["valid"],
                   "--test-data-path", corpus["test"], *megatron_tokenizer_args(a.tokenizer, corpus.get("tokenizer_model"))]
    for L in a.seq_lengths:
        if TOKENS_PER_STEP % L:
            raise ValueError(f"seq_lengths: {L} does not divide the {TOKENS_PER_STEP} tokens a step; pick a divisor")
    import torch

    meta = dict(machine=machine_name(torch.device("cpu")), date=datetime.datetime.now(datetime.UTC)
                .isoformat(timespec="seconds"), commit=git_commit(), isa=cpu_isa(), load_before=loadavg(),
                tokens_per_step=TOKENS_PER_STEP, dense_iters=a.dense_iters, seeds=a.seeds)
    tag = a.tag or f"cpu_{datetime.date.today():%Y%m%d}"
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    total = len(a.seq_lengths) * len(a.seeds) * len(models)
    for L in a.seq_lengths:
        iterations = equal_flops_iterations(a.dense_iters, L)
        for seed in a.seeds:  # every model of a seed before the next seed: an interrupted study stays balanced
            for m in models:
                print(f"[quality] run {len(runs) + 1}/{total}: L={L} seed={seed} {m} ({iterations[m]} steps)", flush=True)
                runs.append(run_one(m, L, seed, iterations[m], a, Path(a.runs) / f"L{L}" / f"seed{seed}" / m,
                                    corpus_args))
                meta["load_after"] = loadavg()
                summary = summarise(runs, models, a.seq_lengths)
                md = write_results(summary, runs, meta, out, tag)
    print(md.read_text())
    print(f"[quality] {md}")
    if a.write_demo_record:
        print(f"[quality] {write_demo_record(summary, meta, a, md)}")
    return 0


def write_demo_record(summary: dict, meta: dict, a, md: Path) -> Path:
    """The demo's seed spread (megatron_xmod.demo.seed_spread_lines): L = 256, threshold rule, equal FLOPs."""
    from megatron_xmod.demo import SEED_SPREAD

    if 256 not in summary:
        raise ValueError("write_demo_record: the demo runs at L = 256; include 256 in --seq-lengths")
    rows = summary[256]["equal_flops_threshold"]
    keys = ("mean", "sd", "n", "diff_mean", "diff_sd", "diff_se", "resolved", "resolved_t95", "xmod_minus_mod")
    models = {name: {key: row[key] for key in keys if key in row} for name, row in rows.items()}
    record = dict(source=str(md.relative_to(REPO)) if md.is_relative_to(REPO) else str(md), machine=meta["machine"],
                  isa=meta["isa"], date=meta["date"][:10], seeds=len(meta["seeds"]), models=models,
                  settings=dict(seq_length=256, dense_iters=a.dense_iters, micro_batch_size=4, global_batch_size=8,
                                lr=a.lr, tokenizer=a.tokenizer))
    SEED_SPREAD.write_text(json.dumps(record, indent=1) + "\n")
    return SEED_SPREAD


if __name__ == "__main__":
    sys.exit(main())
