"""The routing report of a built model on held-out sequences (the X-MoD paper's Table 10 and Figure 5).

:func:`routing_report` runs the model in eval mode, collects every sparse layer's selections through
the model's own :class:`~megatron_xmod.xmod.routing_state.RoutingState` (an observer, :class:`SelectionRecorder`;
no globals), and reduces them with the pure functions of :mod:`megatron_xmod.diagnostics.routing_stats`:

- a forward under ``rule`` (threshold by default, the deployable rule) gives the per-layer selected
  fraction, the per-block coverage, adjacent-layer Jaccard and update counts, and the LM loss;
- a top-k-driven forward gives the agreement of the threshold rule with top-k at the same scores
  (the paper's mask agreement, plus precision and recall) and the LM loss under top-k.

Numbering is the start-up summary's (and the paper's): blocks from 1 (``block`` in the JSON, the
table and the plots), layers by megatron's 1-based layer numbers; ``index_in_block`` is 0-based.
"""
from __future__ import annotations

import contextlib
import json
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from megatron_xmod.diagnostics.routing_stats import MaskAgreement, block_stats, masks_at_scores, references
from megatron_xmod.xmod.routing_state import eval_routing, routing_states


class SelectionRecorder:
    """Observer of the routing states of a model: per sparse layer number, the selections ``[s, b]``,
    the bias-adjusted scores and the raw router logits of every forward it sees (on the CPU)."""

    def __init__(self):
        self.selected: dict[int, list[torch.Tensor]] = defaultdict(list)
        self.scores: dict[int, list[torch.Tensor]] = defaultdict(list)
        self.logits: dict[int, list[torch.Tensor]] = defaultdict(list)

    def __call__(self, layer_number: int, logits: torch.Tensor, decision) -> None:
        self.selected[layer_number].append(decision.selected.detach().cpu())
        self.scores[layer_number].append(decision.scores.detach().float().cpu())
        self.logits[layer_number].append(logits.detach().float().cpu())

    def layer(self, layer_number: int, what: str = "selected") -> torch.Tensor:
        """All forwards of one layer, sequences concatenated: ``[s, total sequences]``."""
        return torch.cat(getattr(self, what)[layer_number], dim=1)


@contextlib.contextmanager
def record_routing(model) -> Iterable[SelectionRecorder]:
    """Attach a :class:`SelectionRecorder` to the routing states of ``model`` for the block."""
    recorder = SelectionRecorder()
    states = routing_states(model)
    if not states:
        raise ValueError("model: it has no routed (sparse) layers to report on; routing-report needs a MoD or X-MoD model")
    for state in states:
        state.observers.append(recorder)
    try:
        yield recorder
    finally:
        for state in states:
            state.observers.remove(recorder)


def sparse_layer_routing(model) -> dict[int, object]:
    """{layer_number: SparseLayerRouting} of the model's sparse layers, in order."""
    from megatron_xmod.model import sparse_layers

    return {layer.layer_number: layer.routing for layer in sparse_layers(model)}


def _forward(model, sequences: torch.Tensor, micro_batch_size: int) -> torch.Tensor:
    """Mean LM loss of ``sequences`` ``[n, s + 1]`` (inputs and next-token labels) in eval mode."""
    total, count = 0.0, 0
    for start in range(0, sequences.shape[0], micro_batch_size):
        chunk = sequences[start:start + micro_batch_size]
        tokens, labels = chunk[:, :-1], chunk[:, 1:]
        positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
        loss = model(tokens, positions, None, labels=labels)  # [b, s] per-token cross entropy
        total += loss.float().sum().item()
        count += loss.numel()
    return total / count


def routing_report(model, sequences: torch.Tensor, rule: str = "threshold", micro_batch_size: int = 4) -> dict:
    """Statistics of ``model``'s routing on ``sequences`` (``[n, seq_len + 1]`` token ids), as a dict
    (the JSON of ``xmod routing-report``)."""
    if rule not in ("threshold", "topk"):
        raise ValueError(f"rule: {rule!r} is not one of threshold, topk")
    routing = sparse_layer_routing(model)
    if not routing:
        raise ValueError("model: it has no routed (sparse) layers to report on; routing-report needs a MoD or X-MoD model")
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), eval_routing(model, rule), record_routing(model) as main:
            loss = {rule: _forward(model, sequences, micro_batch_size)}
        if rule == "topk":
            topk_pass = main
        else:
            with torch.no_grad(), eval_routing(model, "topk"), record_routing(model) as topk_pass:
                loss["topk"] = _forward(model, sequences, micro_batch_size)
    finally:
        model.train(was_training)
    return _reduce(routing, main, topk_pass, rule, loss, sequences.shape)


def _reduce(routing: dict, main: SelectionRecorder, topk_pass: SelectionRecorder, rule: str, loss: dict,
            shape) -> dict:
    layers, blocks, total_agreement = [], defaultdict(list), MaskAgreement()
    for number, spec in routing.items():
        selected, logits = main.layer(number), main.layer(number, "logits")
        # the paper's agreement: in the top-k-driven forward, both masks from the same scores
        agreement = MaskAgreement()
        for scores in topk_pass.scores[number]:
            agreement.add(*masks_at_scores(scores, spec.sparsity_k, spec.routing_segments))
        total_agreement.both += agreement.both
        total_agreement.threshold_only += agreement.threshold_only
        total_agreement.topk_only += agreement.topk_only
        total_agreement.neither += agreement.neither
        layers.append({
            "layer": number, "block": spec.block + 1, "index_in_block": spec.index_in_block,
            "sparsity_k": spec.sparsity_k,
            "selected_fraction": selected.float().mean().item(), "nominal_fraction": 1.0 / spec.sparsity_k,
            "router_logit_mean": logits.mean().item(), "router_logit_std": logits.std().item(),
            "token_choice_bias_tau": spec.token_choice_bias_tau,
            "threshold_vs_topk": agreement.to_dict(),
        })
        blocks[spec.block].append((number, selected))
    block_rows = []
    for block, members in sorted(blocks.items()):
        numbers = [n for n, _ in members]
        k = routing[numbers[0]].sparsity_k
        stats = block_stats(torch.stack([s for _, s in members]), k)
        block_rows.append({"block": block + 1, "layers": numbers, **stats.to_dict(),
                           "references": references(k, stats.num_layers)})
    jaccards = [b["adjacent_jaccard"] for b in block_rows if b["adjacent_jaccard"] is not None]
    summary = {
        "selected_fraction": sum(row["selected_fraction"] for row in layers) / len(layers),
        "nominal_fraction": sum(row["nominal_fraction"] for row in layers) / len(layers),
        "coverage": sum(b["coverage"] for b in block_rows) / len(block_rows),
        "adjacent_jaccard": sum(jaccards) / len(jaccards) if jaccards else None,
        "mean_update_count": sum(b["mean_update_count"] for b in block_rows) / len(block_rows),
        "threshold_vs_topk": total_agreement.to_dict(),
        "lm_loss": loss,
    }
    first = routing[next(iter(routing))]
    return {"rule": rule, "family": first.family, "num_sequences": int(shape[0]), "seq_length": int(shape[1]) - 1,
            "summary": summary, "blocks": block_rows, "layers": layers}


# ----------------------------------------------------------------------------------------------- output
def _pct(value: Optional[float]) -> str:
    return "-" if value is None else f"{100 * value:.2f}"


def format_table(report: dict) -> str:
    """The report as text: one row per block, one per layer, then the summary."""
    lines = [f"routing report: {report['family']}, {report['num_sequences']} sequences of {report['seq_length']} "
             f"tokens, statistics under the {report['rule']} rule (percentages); blocks numbered from 1 and "
             "layers by megatron's layer numbers, as in the start-up summary", ""]
    lines.append(f"{'block':>5} {'layers':>9} {'T':>3} {'K':>3} {'sel %':>7} {'1/K %':>6} {'cover':>7} "
                 f"{'rand':>7} {'Jacc':>7} {'rand':>7} {'mean n':>7}")
    for b in report["blocks"]:
        ref = b["references"]["independent_random"]
        mean_selected = sum(b["selected_fraction"]) / len(b["selected_fraction"])
        lines.append(f"{b['block']:>5} {b['layers'][0]:>4}-{b['layers'][-1]:<4} {b['num_layers']:>3} {b['sparsity_k']:>3} "
                     f"{_pct(mean_selected):>7} {_pct(1 / b['sparsity_k']):>6} {_pct(b['coverage']):>7} "
                     f"{_pct(ref['coverage']):>7} {_pct(b['adjacent_jaccard']):>7} "
                     f"{_pct(ref['adjacent_jaccard'] if b['num_layers'] > 1 else None):>7} {b['mean_update_count']:>7.3f}")
    lines += ["", f"{'layer':>5} {'block':>5} {'sel %':>7} {'1/K %':>6} {'agree':>7} {'prec':>7} {'recall':>7} "
                  f"{'logit mean':>10} {'logit std':>9}"]
    for row in report["layers"]:
        a = row["threshold_vs_topk"]
        lines.append(f"{row['layer']:>5} {row['block']:>5} {_pct(row['selected_fraction']):>7} "
                     f"{_pct(row['nominal_fraction']):>6} {_pct(a['agreement']):>7} {_pct(a['precision']):>7} "
                     f"{_pct(a['recall']):>7} {row['router_logit_mean']:>10.3f} {row['router_logit_std']:>9.3f}")
    s = report["summary"]
    a = s["threshold_vs_topk"]
    losses = ", ".join(f"{rule} {value:.4f}" for rule, value in s["lm_loss"].items())
    lines += ["", f"selected fraction ({report['rule']}): {_pct(s['selected_fraction'])}% against 1/K = "
                  f"{_pct(s['nominal_fraction'])}%",
              f"coverage {_pct(s['coverage'])}%, adjacent Jaccard {_pct(s['adjacent_jaccard'])}%, "
              f"mean updates per token and block {s['mean_update_count']:.3f}",
              f"threshold vs top-k at the same scores (top-k forward): agreement {_pct(a['agreement'])}%, "
              f"precision {_pct(a['precision'])}%, recall {_pct(a['recall'])}%; threshold selects "
              f"{_pct(a['threshold_selected_fraction'])}%",
              f"LM loss: {losses}",
              "references: rand = independent random subsets of rate 1/K (coverage 1-(1-1/K)^T, Jaccard "
              "p/(2-p)); the same subset repeated gives coverage 1/K and Jaccard 100"]
    if report["rule"] == "threshold":
        if abs(s["selected_fraction"] - s["nominal_fraction"]) > 0.2 * s["nominal_fraction"]:
            lines.append(f"note: the threshold rule routes {_pct(s['selected_fraction'])}% of tokens where training "
                         f"routed {_pct(s['nominal_fraction'])}%; the evaluated model computes "
                         f"{'less' if s['selected_fraction'] < s['nominal_fraction'] else 'more'} than it was trained "
                         "for (docs/routing.md: calibration)")
        off = [row["layer"] for row in report["layers"]
               if not 0.5 <= row["selected_fraction"] / row["nominal_fraction"] <= 2.0]
        if off:
            lines.append(f"note: {len(off)} of {len(report['layers'])} sparse layers route less than half or more than "
                         f"twice 1/K under the threshold rule (layers {', '.join(map(str, off))}); see "
                         "docs/routing.md: calibration")
    return "\n".join(lines)


def plot_update_counts(report: dict, path, title: Optional[str] = None):
    """Figure 5: per block, the distribution of per-token update counts, with the binomial
    (independent random subsets) reference; blocks of equal length share one panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_length = defaultdict(list)
    for b in report["blocks"]:
        by_length[(b["num_layers"], b["sparsity_k"])].append(b)
    fig, axes = plt.subplots(1, len(by_length), figsize=(5 * len(by_length), 3.6), squeeze=False)
    for ax, ((length, k), members) in zip(axes[0], sorted(by_length.items())):
        counts = list(range(length + 1))
        for b in members:
            ax.plot(counts, b["update_count_distribution"], marker="o", alpha=0.8, label=f"block {b['block']}")
        ax.plot(counts, b["references"]["independent_random"]["update_count_distribution"], "k--", marker="x",
                label=f"Binomial({length}, 1/{k})")
        ax.axvline(length / k, color="grey", linewidth=0.8, linestyle=":")
        ax.set_xlabel(f"updates per token within a block (T = {length}, K = {k}; dotted: A = T/K)")
        ax.set_ylabel("fraction of tokens")
        ax.set_xticks(counts if length <= 16 else counts[:: max(1, length // 16)])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title or f"per-token update counts ({report['family']}, {report['rule']} rule)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_selected_fraction(report: dict, path, title: Optional[str] = None):
    """Selected fraction per sparse layer against 1/K (the evaluation's calibration)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.4))
    numbers = [row["layer"] for row in report["layers"]]
    ax.plot(numbers, [row["selected_fraction"] for row in report["layers"]], marker="o",
            label=f"selected ({report['rule']} rule)")
    ax.plot(numbers, [row["threshold_vs_topk"]["threshold_selected_fraction"] for row in report["layers"]],
            marker="x", alpha=0.7, label="threshold at top-k forward's scores")
    ax.plot(numbers, [row["nominal_fraction"] for row in report["layers"]], "k--", label="1/K (training)")
    ax.set_xlabel("layer number")
    ax.set_ylabel("fraction of tokens routed")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title or "selected fraction per sparse layer", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# --- a checkpoint's report (xmod routing-report) ------------------------------------------------
def check_arguments(args) -> None:
    """Every input problem before anything is loaded: ``field: why; fix``."""
    if args.num_sequences < 1:
        raise ValueError(f"num_sequences: must be >= 1, got {args.num_sequences}")
    if args.micro_batch_size < 1:
        raise ValueError(f"micro_batch_size: must be >= 1, got {args.micro_batch_size}")
    if not Path(args.load).is_dir():
        raise ValueError(f"load: {args.load} is not a folder; give the --save folder of a training run")
    missing = [suffix for suffix in (".bin", ".idx") if not Path(args.data + suffix).is_file()]
    if missing:
        raise ValueError(f"data: {args.data}{missing[0]} not found; give a megatron dataset prefix (without .bin/.idx), "
                         "e.g. the --valid-data-path of the run")


def read_sequences(prefix: str, num_sequences: int, seq_length: int, vocab_size: int) -> torch.Tensor:
    """The first ``num_sequences`` windows of ``seq_length + 1`` tokens of the dataset, documents
    concatenated in order (inputs and next-token labels)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix)
    needed = num_sequences * (seq_length + 1)
    pieces, have = [], 0
    for i in range(len(dataset)):
        piece = np.asarray(dataset[i], dtype=np.int64)
        pieces.append(piece[: needed - have])
        have += len(pieces[-1])
        if have >= needed:
            break
    if have < needed:
        raise ValueError(f"num_sequences: {prefix} holds {have} tokens, enough for {have // (seq_length + 1)} "
                         f"sequences of {seq_length + 1}; ask for fewer")
    tokens = torch.from_numpy(np.concatenate(pieces)).view(num_sequences, seq_length + 1)
    if int(tokens.max()) >= vocab_size:
        raise ValueError(f"data: token id {int(tokens.max())} >= the model's vocabulary ({vocab_size}); "
                         "is it the dataset of this run's tokenizer?")
    return tokens


def load_model(load_dir: str, iteration=None):
    """(model, megatron args, iteration) of a checkpoint; call inside ``single_process_megatron()``."""
    from megatron.core import dist_checkpointing

    from megatron_xmod.hf.checkpoint_io import build_model, checkpoint_path, model_sharded_state_dict, read_common

    path, iteration = checkpoint_path(load_dir, iteration)
    common = read_common(path)
    args = common["args"]
    if getattr(args, "xmod_routing_family", "dense") == "dense":
        raise ValueError(f"load: {path} holds a dense model (no routed layers); routing-report needs MoD or X-MoD")
    model = build_model(args)
    loaded = dist_checkpointing.load({"model": model_sharded_state_dict(model, common.get("content_metadata"))}, str(path))
    model.load_state_dict(loaded["model"], strict=True)
    return model.eval(), args, int(common.get("iteration", iteration))


def run(args) -> int:
    from megatron_xmod.diagnostics.routing_report import (
        format_table,
        plot_selected_fraction,
        plot_update_counts,
        routing_report,
    )
    from megatron_xmod.hf.checkpoint_io import single_process_megatron

    check_arguments(args)
    output = Path(args.output) if args.output else Path(args.load).resolve().parent / "routing_report"
    with single_process_megatron():
        model, megatron_args, iteration = load_model(args.load, args.iteration)
        sequences = read_sequences(args.data, args.num_sequences, megatron_args.seq_length,
                                   megatron_args.padded_vocab_size)
        report = routing_report(model, sequences, args.rule, args.micro_batch_size)
    report.update(checkpoint=str(Path(args.load).resolve()), iteration=iteration, data=args.data,
                  layout=megatron_args.xmod_layout)
    output.mkdir(parents=True, exist_ok=True)
    table = format_table(report)
    (output / "routing_report.txt").write_text(table + "\n")
    (output / "routing_report.json").write_text(json.dumps(report, indent=1))
    title = f"{megatron_args.xmod_layout} ({report['family']}), iteration {iteration}"
    plot_update_counts(report, output / "update_counts.png", title=f"update counts per block: {title}")
    plot_selected_fraction(report, output / "selected_fraction.png", title=f"selected fraction: {title}")
    print(table)
    print(f"\n[xmod] routing report: {output}/routing_report.{{txt,json}}, update_counts.png, selected_fraction.png")
    return 0
