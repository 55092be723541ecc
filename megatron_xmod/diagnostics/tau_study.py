"""The token-choice bias scale study (docs/routing.md): the demo's X-MoD trained with tau = 0, 0.5, 1
and the warm-up schedule, then routing-reported on the same held-out sequences.

    python -m megatron_xmod.diagnostics.tau_study [--out runs/tau_study] [--iters 171] [--only train|report]

Each run is the real entry point (as ``xmod demo`` runs it: the demo's backbone, layout
``D*2 + (S4*4 + D)*2``, corpus, optimiser and flags), trained one after the other (CPU is shared).
Periodic validation restarts at the first held-out sequence every time (patch 16), so the last
point of each curve is a paired comparison across the four runs.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

VARIANTS = {  # name: (tau, warm-up iterations as a fraction of the run, extra flags)
    "tau0": (0.0, 0.0, ()),
    "tau0.5": (0.5, 0.0, ()),
    "tau1": (1.0, 0.0, ()),
    "tau0.5-warmup": (0.5, 0.25, ()),
    # threshold calibration (docs/routing.md): the router BCE coefficient 100x the paper's 1e-4
    "tau0.5-bce1e-2": (0.5, 0.0, ("--xmod-router-bce-coeff", "1e-2")),
}


def _train(name: str, tau: float, warmup: int, extra, args, corpus_args: list[str], out: Path) -> Path:
    from megatron_xmod.demo import CPU_FLAGS, DEMO_BACKBONE, MODELS, TRAIN_PROGRESS, _free_port, _launch
    from megatron_xmod.presets import backbone_flags

    family, layout = MODELS["xmod"]
    run_dir = out / name
    run_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", f"--master_port={_free_port()}",
               "-m", "megatron_xmod.pretrain", "--xmod-routing-family", family, "--xmod-layout", layout,
               *backbone_flags(DEMO_BACKBONE), *CPU_FLAGS, *corpus_args,
               "--seq-length", "256", "--max-position-embeddings", "256",
               "--micro-batch-size", "4", "--global-batch-size", str(args.global_batch_size),
               "--train-iters", str(args.iters), "--lr", "3e-3", "--xmod-paper-schedule",
               "--weight-decay", "0.1", "--adam-beta2", "0.95", "--clip-grad", "1.0",
               "--attention-dropout", "0", "--hidden-dropout", "0", "--seed", "1234",
               "--log-interval", "1", "--eval-interval", str(args.eval_interval), "--eval-iters", str(args.eval_iters),
               "--xmod-token-choice-bias-tau", str(tau), "--xmod-token-choice-bias-tau-warmup", str(warmup),
               "--tensorboard-dir", str(run_dir / "tb"), "--save", str(run_dir / "ckpt"),
               "--save-interval", str(args.iters), *extra]
    _launch(command, run_dir / "train.log", args.iters, f"{name:>14} train", TRAIN_PROGRESS)
    return run_dir


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/tau_study")
    parser.add_argument("--iters", type=int, default=171, help="the demo's X-MoD gets 171 at equal FLOPs")
    parser.add_argument("--global-batch-size", type=int, default=8, help="the demo's 8; 4 halves the cost")
    parser.add_argument("--eval-interval", type=int, default=40)
    parser.add_argument("--eval-iters", type=int, default=8, help="8 x 8 = 64 held-out sequences per validation")
    parser.add_argument("--only", choices=("train", "report"), default=None)
    parser.add_argument("--variants", default="tau0,tau0.5,tau1,tau0.5-warmup")
    args = parser.parse_args(argv)
    from megatron_xmod.data.corpus import ensure_default_corpus
    from megatron_xmod.data.tokenizers import megatron_tokenizer_args

    out = Path(args.out)
    corpus = ensure_default_corpus("sentencepiece", progress=False)
    corpus_args = ["--train-data-path", corpus["train"], "--valid-data-path", corpus["valid"],
                   "--test-data-path", corpus["test"],
                   *megatron_tokenizer_args("sentencepiece", corpus.get("tokenizer_model"))]
    names = [n for n in args.variants.split(",") if n]
    if args.only != "report":
        for name in names:
            tau, fraction, extra = VARIANTS[name]
            _train(name, tau, round(fraction * args.iters), extra, args, corpus_args, out)
    if args.only != "train":
        from megatron_xmod.diagnostics.study import summarize

        summary = summarize(out, names, corpus["valid"], VARIANTS)
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
