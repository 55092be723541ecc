"""``xmod demo``: the main job. Dense, MoD and X-MoD at equal training FLOPs on the embedded corpus.

Each model is trained by the real entry point (``python -m megatron_xmod.pretrain`` under
torch.distributed.run, megatron's own loop, checkpoints and tensorboard) on the Shakespeare
corpus, validated with the deployable threshold routing on whole plays it never saw, and the table
and plot are read back from the runs' tensorboard logs.

The equal-compute rule is the paper's (Eq.26): the Dense model gets ``--dense-iters`` iterations,
a routed model ``dense_iters * phi_D / phi`` (FLOPs/token from the accounting module, forward
without the LM head; training = 3 x forward).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

from megatron_xmod.presets import Backbone

# Not a paper backbone: small enough for 2 CPU cores, same family (GQA, SwiGLU, RMSNorm, RoPE, QK-norm).
DEMO_BACKBONE = Backbone("demo", hidden_size=128, head_dim=32, num_attention_heads=4, num_query_groups=2,
                         ffn_hidden_size=384, num_layers=6, rotary_base=10000)
# megatron on a CPU, megatron's compiled fusions off (training/flags.py); expanded by the entry point
CPU_FLAGS = ["--xmod-cpu"]
# Activated depth 6 for all; K = 4 so that routing is visible at a 256-token context. A layout may end in
# "+<MoE model>" (that MoE feed-forward in every layer): the width-sparse runs of bench/quality.py
# (--models dense,moe,xmod,xmod-moe), not part of the demo's default three.
MODELS = {
    "dense": ("dense", "D*6"),
    "mod": ("mod", "D + (S4 + D)*4"),
    "xmod": ("xmod", "D*2 + (S4*4 + D)*2"),
    "moe": ("dense", "D*6+moe-8x64"),
    "xmod-moe": ("xmod", "D*2 + (S4*4 + D)*2+moe-8x64"),
    "xmod-seg4": ("xmod", "D*2 + (S4*4 + D)*2"),  # top-k per quarter of the sequence (bench/quality.py)
}
# Training flags of a model beyond its family and layout (the routing rule of a variant).
MODEL_FLAGS = {"xmod-seg4": ["--xmod-routing-segments", "4"]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def equal_flops_iterations(dense_iters: int, seq_length: int) -> dict[str, int]:
    return {name: max(1, round(dense_iters * _accounting(name, seq_length).tokens_ratio_vs_dense)) for name in MODELS}


TRAIN_PROGRESS = re.compile(r"iteration\s+(\d+)/\s*\d+")
EVAL_PROGRESS = re.compile(r"Evaluating iter (\d+)/")


def _launch(command: list[str], log_path: Path, total: int, desc: str, progress: re.Pattern) -> str:
    """Run one entry-point process, log its command and output, show a progress bar; returns the output."""
    from tqdm import tqdm

    env = dict(os.environ, OMP_NUM_THREADS=str(os.cpu_count() or 1))
    lines = []
    with open(log_path, "w") as log, tqdm(total=total, desc=desc, unit="it") as bar:
        # The exact command first, so that a run can be copied and changed (docs/first_run.md).
        log.write(f"+ {shlex.join(command)}\n\n")
        log.flush()
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        for line in process.stdout:
            log.write(line)
            lines.append(line)
            match = progress.search(line)
            if match:
                bar.update(max(0, min(total, int(match.group(1))) - bar.n))
        if process.wait() != 0:
            raise RuntimeError(f"{desc}: failed (exit {process.returncode}); see {log_path}")
    return "".join(lines)


def _train(name: str, iters: int, args, corpus_args: list[str], out: Path) -> Path:
    """Train with periodic validation (the curve), then evaluate the final checkpoint once more with
    ``--skip-train --load``: megatron then reads the held-out sets from their start, so every model is
    scored on the same sequences (paired, like the paper's shared validation shards)."""
    from megatron_xmod.presets import backbone_flags, split_model_name

    family, model = MODELS[name]
    layout, moe = split_model_name(model)
    run_dir = out / name
    run_dir.mkdir(parents=True, exist_ok=True)
    common = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1",
              "-m", "megatron_xmod.pretrain", "--xmod-routing-family", family, "--xmod-layout", layout,
              *(["--moe-preset", moe] if moe else []), *MODEL_FLAGS.get(name, ()),
              *backbone_flags(DEMO_BACKBONE), *CPU_FLAGS, *corpus_args,
              "--seq-length", str(args.seq_length), "--max-position-embeddings", str(args.seq_length),
              "--micro-batch-size", str(args.micro_batch_size), "--global-batch-size", str(args.global_batch_size),
              "--train-iters", str(iters), "--lr", str(args.lr), "--xmod-paper-schedule",
              "--weight-decay", "0.1", "--adam-beta2", "0.95", "--clip-grad", "1.0",
              "--attention-dropout", "0", "--hidden-dropout", "0", "--seed", str(getattr(args, "seed", 1234)),
              "--log-interval", "1", "--eval-interval", str(args.eval_interval)]
    _launch(common[:4] + [f"--master_port={_free_port()}"] + common[4:]
            + ["--eval-iters", str(args.eval_iters), "--tensorboard-dir", str(run_dir / "tb"),
               "--save", str(run_dir / "ckpt"), "--save-interval", str(iters)],
            run_dir / "train.log", iters, f"{name:>5} train ({layout})", TRAIN_PROGRESS)
    _launch(common[:4] + [f"--master_port={_free_port()}"] + common[4:]
            + ["--eval-iters", str(args.final_eval_iters), "--skip-train", "--load", str(run_dir / "ckpt")],
            run_dir / "eval.log", args.final_eval_iters, f"{name:>5} eval", EVAL_PROGRESS)
    return run_dir


def _final_evaluation(log: str) -> dict:
    """megatron's summary line of the --skip-train evaluation on the validation set."""
    line = re.search(r"on validation set \|(.*)", log)
    if not line:
        raise RuntimeError("final evaluation: no 'on validation set' line in eval.log")
    values = {key.strip(): value for key, value in re.findall(r"([a-z -]+?) value: ([0-9.E+-]+)", line.group(1))}
    topk = values.get("lm loss topk routing")
    return {"val_loss_threshold": float(values["lm loss"]), "val_loss_topk": float(topk) if topk else None}


def read_run(run_dir: Path) -> dict:
    """Scalars, parameter count and validation curve of one finished run."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags: dict[str, dict[int, float]] = {}
    for event_file in sorted((run_dir / "tb").iterdir()):
        events = EventAccumulator(str(event_file), size_guidance={"scalars": 0})
        events.Reload()
        for tag in events.Tags()["scalars"]:
            tags.setdefault(tag, {}).update({e.step: e.value for e in events.Scalars(tag)})
    log = (run_dir / "train.log").read_text()
    params = re.findall(r"number of parameters on \(tensor.*?\): (\d+)", log)
    last = max(tags["tokens seen"])
    flops_at = tags["training flops"]
    # megatron writes the final *test* evaluation under the same tensorboard tag and step as the
    # validation ("lm loss validation"), which made the curve jump at its end: read the validation
    # set's points from the console log instead.
    validation = {int(i): float(v) for i, v in re.findall(
        r"validation loss at iteration (\d+) (?:on validation set )?\| lm loss value: ([0-9.Ee+-]+)", log)}
    curve = [(flops_at[step], loss) for step, loss in sorted(validation.items()) if step in flops_at]
    return {
        "total_params": int(params[-1]) if params else None,
        "forward_flops_per_token": tags["forward flops per token"][last],
        "tokens_seen": tags["tokens seen"][last],
        "training_flops": flops_at[last],
        **_final_evaluation((run_dir / "eval.log").read_text()),
        "curve": curve,
        "validation": sorted(validation.items()),  # (iteration, loss) of the in-training validations
    }


def _accounting(name: str, seq_length: int, vocab_size: int = DEMO_BACKBONE.vocab_size):
    """FLOPs/token (vocabulary-free: no LM head) and parameters of one demo model."""
    from megatron_xmod.accounting import count
    from megatron_xmod.presets import parse_model

    family, model = MODELS[name]
    backbone = dataclasses.replace(DEMO_BACKBONE, vocab_size=vocab_size)
    return count(parse_model(model, backbone, family=family), seq_length)


def run(args) -> int:
    from megatron_xmod.data.corpus import ensure_default_corpus
    from megatron_xmod.data.tokenizers import megatron_tokenizer_args

    started = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    corpus = ensure_default_corpus(args.tokenizer, progress=True)
    iterations = equal_flops_iterations(args.dense_iters, args.seq_length)
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = set(names) - set(MODELS)
    if unknown:
        raise ValueError(f"models: {sorted(unknown)} not in {', '.join(MODELS)}")
    data_args = ["--train-data-path", corpus["train"], "--valid-data-path", corpus["valid"],
                 "--test-data-path", corpus["test"],
                 *megatron_tokenizer_args(args.tokenizer, corpus.get("tokenizer_model"))]
    print(f"[demo] equal training FLOPs: iterations {', '.join(f'{n}={iterations[n]}' for n in names)}")
    results = {}
    for name in names:
        results[name] = read_run(_train(name, iterations[name], args, data_args, out))
    from megatron_xmod.data.tokenizers import get_tokenizer

    # megatron pads the embedding rows to a multiple of 128 (--make-vocab-size-divisible-by)
    vocab = get_tokenizer(args.tokenizer, corpus.get("tokenizer_model")).vocab_size
    padded_vocab = -(-vocab // 128) * 128
    dense_tokens = results["dense"]["tokens_seen"] if "dense" in results else None
    rows = []
    for name in names:
        r = results[name]
        counted = _accounting(name, args.seq_length, padded_vocab)
        if counted.total_params != r["total_params"]:
            print(f"[demo] warning: {name}: accounting counts {counted.total_params} parameters, the run built {r['total_params']}")
        rows.append({
            "model": name, "layout": MODELS[name][1],
            "total_params": r["total_params"],
            "active_params": counted.active_params,
            "flops_per_token": r["forward_flops_per_token"], "tokens_seen": r["tokens_seen"],
            "D_over_D_dense": r["tokens_seen"] / dense_tokens if dense_tokens else None,
            "training_flops": r["training_flops"],
            "val_loss_threshold": r["val_loss_threshold"], "val_loss_topk": r["val_loss_topk"],
        })
    _print_table(rows)
    print("\n".join(seed_spread_lines(args)))
    (out / "results.json").write_text(json.dumps({"rows": rows, "curves": {n: results[n]["curve"] for n in names}}, indent=1))
    finals = {r["model"]: (r["training_flops"], r["val_loss_threshold"]) for r in rows}
    plot = _plot({n: results[n]["curve"] for n in names}, finals, out / "val_loss_vs_flops.png")
    print(f"[demo] table: {out / 'results.json'}  plot: {plot}  ({time.time() - started:.0f} s)")
    if "xmod" in names:  # the X-MoD model as a Hugging Face folder, generating (docs/hf.md)
        from megatron_xmod.hf.export import demo_export

        print(demo_export(out / "xmod" / "ckpt", out / "xmod" / "hf", "To be, or not to be"), flush=True)
    return 0


SEED_SPREAD = Path(__file__).resolve().parent / "data" / "demo_seed_spread.json"  # written by bench/quality.py


def seed_spread_lines(args, record_path: Path = SEED_SPREAD) -> list[str]:
    """What the seed study (bench/quality.py) measured at the demo's settings: each model's spread over
    seeds and which of its differences (to Dense, X-MoD to MoD) the spread resolves. Printed under the table, so that a difference in
    the last digits is not read as a ranking."""
    if not record_path.is_file():
        return ["[demo] no seed spread recorded; bench/quality.py measures it"]
    record = json.loads(record_path.read_text())
    settings = {key: getattr(args, key, None) for key in record["settings"]}
    if settings != record["settings"]:
        return [f"[demo] the seed spread of {record['source']} was measured at other settings ({record['settings']}); "
                "bench/quality.py measures it at these"]
    spread = ", ".join(f"{name} {row['sd']:.4f}" for name, row in record["models"].items())
    lines = [f"[demo] seed spread ({record['source']}: {record['seeds']} seeds of these settings, {record['machine']}, "
             f"{record['date']}): sd of val loss {spread}"]
    def verdict(d):
        if d.get("resolved_t95"):
            return "beyond its spread (95%)"
        if d["resolved"]:
            return "beyond 2 standard errors, not at 95%: a weak ranking"
        return f"not resolved by {record['seeds']} seeds: no ranking"

    for name, row in record["models"].items():
        if "diff_mean" in row:
            lines.append(f"[demo]   {name} minus dense: {row['diff_mean']:+.4f} +- {row['diff_sd']:.4f} ({verdict(row)})")
        versus_mod = row.get("xmod_minus_mod")
        if versus_mod:
            lines.append(f"[demo]   {name} minus mod: {versus_mod['diff_mean']:+.4f} +- {versus_mod['diff_sd']:.4f} "
                         f"({verdict(versus_mod)})")
    lines.append("[demo] the last digits repeat only on the same machine and software (docs/reproducibility.md)")
    return lines


def _print_table(rows: list[dict]) -> None:
    print(f"\n{'model':<6} {'layout':<22} {'N total':>9} {'N act':>9} {'FLOPs/tok':>10} {'tokens':>9} "
          f"{'D/D_D':>6} {'val loss':>9} {'(top-k)':>8}")
    for r in rows:
        topk = f"{r['val_loss_topk']:.4f}" if r["val_loss_topk"] is not None else "-"
        ratio = f"{r['D_over_D_dense']:.2f}" if r["D_over_D_dense"] is not None else "-"
        print(f"{r['model']:<6} {r['layout']:<22} {r['total_params']/1e6:>8.2f}M {r['active_params']/1e6:>8.2f}M "
              f"{r['flops_per_token']:>10.3g} {r['tokens_seen']:>9.0f} {ratio:>6} {r['val_loss_threshold']:>9.4f} {topk:>8}")
    print("val loss: held-out plays (Julius Caesar, Twelfth Night, Macbeth), the same sequences for every model, "
          "threshold routing (deployable); (top-k): the same sequences routed by top-k\n")


def _plot(curves: dict[str, list[tuple[float, float]]], finals: dict[str, tuple[float, float]], path: Path) -> Path:
    """Periodic validation (every point on the same first held-out batches: patch 16 of
    training/patches.py restarts the validation set at each evaluation) and,
    as a star, the final paired evaluation that the table reports."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, curve in curves.items():
        if curve:
            flops, loss = zip(*curve)
            line, = ax.plot(flops, loss, marker="o", alpha=0.7, label=f"{name}: {MODELS[name][1]}")
            ax.plot(*finals[name], marker="*", markersize=14, color=line.get_color(), linestyle="none")
    ax.set_xlabel("training FLOPs (3 x forward, without LM head)")
    ax.set_ylabel("validation loss (threshold routing)")
    ax.set_title("Dense / MoD / X-MoD at equal training compute\n(* final checkpoint, same held-out sequences for all)",
                 fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
