"""Routing and compute scalars in megatron's own training log (console and tensorboard), and the
start-up summary. Every metric is defined, with its random reference, in docs/metrics.md.

megatron's ``training_log`` prints and writes the loss dictionary; the per-layer routing statistics
and the FLOP accounting are not losses, so :class:`RoutingLog` logs them right after it (patch 13 of
:mod:`megatron_xmod.training.patches`), at the same interval, to the same writer. Tags (other tools
read them; see docs/scaling.md):

- ``tokens seen``, ``training flops`` (cumulative, 3 x forward), ``forward flops per token``,
  ``D over D_dense`` (tokens at equal compute vs the Dense model of the same activated depth),
  ``tokens per second``;
- ``lm loss vs training MFLOPs`` and ``lm loss validation vs training MFLOPs``: the losses megatron
  writes, again with the training FLOPs / 1e6 as the step (tensorboard steps are 64-bit integers);
- ``routing/<metric>`` (mean over the recorders' layers) and ``routing/<metric>/layer_<n>``: the
  sparse layers' selected_fraction, coverage, adjacent_jaccard, router_bce_loss and the DTop-p
  router's metrics, over the steps since the last log line;
- ``routing/eval_<metric>`` (and per layer): the same statistics of each validation, written at the
  iteration of that validation (the last one included) by :meth:`RoutingLog.evaluation`, with
  ``routing/eval_<metric> random`` beside them (what routing blind to the tokens would give).

The adjacent Jaccard of a layer pair where neither layer routed a token is undefined: the layers
record ``jaccard_tensor``'s 1 for it, so :func:`drop_undefined_jaccard` leaves such a pair out of
the per-layer values and the means, and the console says ``n.a.``. From the interval means it can
recognise a pair that routed nothing over the whole interval (a validation where the threshold
rule routes no token); a single empty step among routed ones still counts 1 in its layer's mean.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Optional

import torch

from megatron_xmod.accounting import ModelCount, count, dense_reference
from megatron_xmod.presets import Backbone, ModelDescription
from megatron_xmod.xmod.layout import Layout, parse_layout
from megatron_xmod.xmod.routing_state import per_layer, routing_states


def describe_from_args(args) -> Optional[ModelDescription]:
    """The model megatron's parsed ``args`` build, for the accounting; None for a hand-made expert
    setup, which has no fixed active-expert count to charge."""
    layout = parse_layout(args.xmod_layout, args.xmod_routing_family) if args.xmod_layout else parse_layout(
        f"D*{args.num_layers}")
    backbone = Backbone(
        name="args", hidden_size=args.hidden_size, head_dim=args.kv_channels,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups if args.group_query_attention else args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size, num_layers=round(float(layout.activated_depth)),
        vocab_size=args.padded_vocab_size, qk_layernorm=args.qk_layernorm,
    )
    if getattr(args, "num_experts", None) is None:
        return ModelDescription("args", backbone, layout)
    from megatron_xmod.moe.presets import parse_moe_model

    router = getattr(args, "moe_router_type", None) or "topk"
    preset = getattr(args, "moe_preset", None)
    if preset is not None:  # the preset's experts (shared ones included), with the router actually used
        moe = parse_moe_model(preset)
        if router != moe.router_type:
            moe = dataclasses.replace(moe, router_type=router)
        if router == "dtopp" and args.dtopp_target_experts is not None:
            moe = dataclasses.replace(moe, active_routed=float(args.dtopp_target_experts))
    elif router == "dtopp" and args.dtopp_target_experts is not None:
        moe = parse_moe_model(f"dtopp-t{float(args.dtopp_target_experts):g}-e{args.num_experts}")
    else:
        return None
    if moe.active_routed is None or router == "topp-fixed":
        return None  # a fixed threshold has no set number of active experts to charge
    return ModelDescription("args", backbone, layout, moe)


def metric_names() -> tuple[str, ...]:
    """Every recorder class's metrics: ranks reduce one tensor whose shape these names fix."""
    from megatron_xmod.moe.router import DTopPRouter
    from megatron_xmod.xmod.layers import XModSparseLayer

    return tuple(dict.fromkeys(XModSparseLayer.ROUTING_METRICS + DTopPRouter.ROUTING_METRICS))


def layout_from_args(args) -> Layout:
    if args.xmod_layout:
        return parse_layout(args.xmod_layout, args.xmod_routing_family)
    return parse_layout(f"D*{args.num_layers}")


# ----------------------------------------------------------------------------- random references
def random_reference(layout: Layout, metric: str, layer_number: int) -> Optional[float]:
    """What routing blind to the tokens would give at megatron layer ``layer_number`` (1-based):
    a random 1/K of the tokens per sparse layer, independently per layer (docs/metrics.md)."""
    if not 1 <= layer_number <= layout.num_layers:
        return None
    layer = layout.layers[layer_number - 1]
    if not layer.is_sparse:
        return None
    p = 1.0 / layer.sparsity_k
    name = metric.removeprefix("eval_")
    if name == "selected_fraction":
        return p
    if name == "coverage":  # routed by at least one of the block's sparse layers so far
        return 1.0 - (1.0 - p) ** (layer.index_in_block + 1)
    if name == "adjacent_jaccard":  # |a & b| / |a | b| of two independent random p-subsets
        return p / (2.0 - p)
    return None


def mean_reference(layout: Layout, metric: str, layers: dict[int, float]) -> Optional[float]:
    """The reference averaged over the same layers as the reported mean of ``metric``."""
    refs = [random_reference(layout, metric, n) for n in layers]
    refs = [r for r in refs if r is not None]
    return sum(refs) / len(refs) if refs and len(refs) == len(layers) else None


# ----------------------------------------------------------------------------- undefined Jaccard
def undefined_jaccard_layers(layers: dict[str, dict[int, float]], prefix: str = "") -> set[int]:
    """Layers ``n`` whose adjacent Jaccard (against the sparse layer ``n - 1`` before it in its block)
    is undefined over the interval: neither layer routed a token (both selected fractions 0)."""
    selected = layers.get(prefix + "selected_fraction", {})
    return {n for n in layers.get(prefix + "adjacent_jaccard", {})
            if selected.get(n) == 0.0 and selected.get(n - 1) == 0.0}


def drop_undefined_jaccard(layers: dict[str, dict[int, float]], prefix: str = "") -> tuple[dict, int, int]:
    """``layers`` ({metric: {layer: interval mean}}) without the undefined adjacent Jaccard values,
    and (undefined pairs, pairs) of that metric."""
    name = prefix + "adjacent_jaccard"
    undefined = undefined_jaccard_layers(layers, prefix)
    pairs = len(layers.get(name, {}))
    if undefined:
        layers = dict(layers)
        layers[name] = {n: v for n, v in layers[name].items() if n not in undefined}
    return layers, len(undefined), pairs


def _not_available(undefined: int, pairs: int) -> str:
    return f"n.a. for {undefined} of {pairs} layer pairs: neither layer routed a token"


# ----------------------------------------------------------------------------- start-up summary
def layer_map(layout: Layout) -> list[str]:
    """megatron layer numbers (1-based) -> layout positions, runs of alike layers merged."""
    runs: list[list] = []  # [first, last, key]
    for number, layer in enumerate(layout.layers, 1):
        key = (layer.kind, layer.block, layer.sparsity_k)
        if runs and runs[-1][2] == key and runs[-1][1] == number - 1:
            runs[-1][1] = number
        else:
            runs.append([number, number, key])
    out = []
    for first, last, (kind, block, k) in runs:
        span = f"{first}" if first == last else f"{first}-{last}"
        if kind == "sparse":
            start = layout.layers[first - 1].index_in_block + 1
            end = layout.layers[last - 1].index_in_block + 1
            where = f"#{start}" if start == end else f"#{start}-#{end}"
            out.append(f"{span} sparse K={k} (block {block + 1}, {where})")
        elif kind == "anchor":
            out.append(f"{span} anchor (block {block + 1})")
        else:
            out.append(f"{span} dense")
    return out


def _wrap(items: list[str], width: int = 96, indent: str = " " * 13) -> str:
    lines, line = [], ""
    for item in items:
        candidate = f"{line} | {item}" if line else item
        if line and len(candidate) > width:
            lines.append(line)
            candidate = item
        line = candidate
    lines.append(line)
    return ("\n" + indent).join(lines)


def _fmt_count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _data_in_use(args) -> str:
    if args.mock_data:
        return "mock data (megatron's MockGPTDataset)"
    parts = []
    if args.data_path:
        parts.append(f"--data-path {' '.join(args.data_path)} (split {args.split})")
    for name in ("train", "valid", "test"):
        paths = getattr(args, f"{name}_data_path", None)
        if paths:
            parts.append(f"{name}: {' '.join(paths)}")
    return "; ".join(parts) or "per-split data arguments file"


def routing_segments_note(args, layout) -> str:
    """What --xmod-routing-segments means for this run's routed layers ('' when it has none, or S = 1 without CP)."""
    if layout.num_sparse_layers == 0:
        return ""
    segments, cp = getattr(args, "xmod_routing_segments", 1) or 1, getattr(args, "context_parallel_size", 1) or 1
    if cp == 1:
        return f"top-k over {segments} segments of {args.seq_length // segments} tokens" if segments > 1 else ""
    if segments % (2 * cp) == 0:
        return (f"top-k over {segments} segments: every CP rank holds exactly L/(K x {cp}) routed tokens of a sequence "
                "(1/K of a dense layer's CP traffic)")
    return (f"top-k over {'the whole sequence' if segments == 1 else f'{segments} segments'}: a CP rank's routed batch "
            f"is sized for min(L/K, L/{cp}) tokens ({cp}/K of a dense layer's CP traffic); --xmod-routing-segments "
            f"{2 * cp} (or a multiple) gives exactly L/(K x {cp}), docs/routing.md section 9")


def startup_summary(args, argument_dump: str = "") -> str:
    """One block, printed by rank 0 before training: what will be trained, on what, for how long."""
    layout = layout_from_args(args)
    description = describe_from_args(args)
    tokens_per_step = args.global_batch_size * args.seq_length
    lines = ["=" * 30 + " megatron_xmod run " + "=" * 30]
    family = {"dense": "Dense", "mod": "MoD", "xmod": "X-MoD"}.get(layout.family, layout.family)
    if getattr(args, "num_experts", None):
        family += f" + MoE ({args.num_experts} experts, router {getattr(args, 'moe_router_type', None) or 'topk'})"
    lines.append(f"model      {family}: {layout.notation} ({layout.num_layers} layers, {layout.num_sparse_layers} "
                 f"sparse; activated depth {float(layout.activated_depth):g})")
    lines.append("layers     " + _wrap(layer_map(layout)))
    lines.append(f"width      hidden {args.hidden_size}, {args.num_attention_heads} heads x {args.kv_channels}, "
                 f"{args.num_query_groups if args.group_query_attention else args.num_attention_heads} query groups, "
                 f"ffn {args.ffn_hidden_size}, vocabulary {args.padded_vocab_size} (padded)")
    counted = None if description is None else count(description, args.seq_length)
    if counted is None:
        lines.append("size       not counted (a fixed-threshold expert router has no set number of active experts)")
    else:
        lines.append(f"size       N = {_fmt_count(counted.total_params)}, N_act = {_fmt_count(counted.active_params)} "
                     f"(embeddings included), forward FLOPs/token {counted.flops_per_token:.4g} (no LM head, "
                     f"attention at L = {args.seq_length})")
        try:
            reference = dense_reference(layout).notation
            lines.append(f"compute    phi/phi_D = {counted.flops_ratio_vs_dense:.3f}, D/D_D = "
                         f"{counted.tokens_ratio_vs_dense:.3f} (vs the dense {reference} of the same activated "
                         "depth: tokens trained at equal FLOPs)")
        except ValueError as error:
            lines.append(f"compute    no dense reference: {error}")
        if getattr(args, "reset_attention_mask", False):
            lines.append(f"documents  --reset-attention-mask: attention spans a token's own document, so the FLOPs above "
                         f"(attention over L = {args.seq_length}) are an upper bound; at a mean document length M: "
                         f"xmod count --seq-len {args.seq_length} --mean-doc-length M")
    note = routing_segments_note(args, layout)
    if note:
        lines.append("routing    " + note)
    if args.train_iters:
        total = args.train_iters * tokens_per_step
        flops = f", {3 * counted.flops_per_token * total:.3g} training FLOPs" if counted else ""
        lines.append(f"schedule   {args.train_iters} iterations x {args.global_batch_size} sequences x "
                     f"{args.seq_length} tokens = {tokens_per_step:,} tokens per step, {total:,} tokens{flops}")
    else:
        lines.append(f"schedule   {args.train_samples} samples; {tokens_per_step:,} tokens per step")
    lines.append(f"validation every {args.eval_interval} iterations, {args.eval_iters} batches, routing rule "
                 f"{args.xmod_eval_routing}")
    lines.append(f"data       {_data_in_use(args)}")
    tokenizer = args.tokenizer_type + (f" {args.tokenizer_model}" if getattr(args, "tokenizer_model", None) else "")
    lines.append(f"tokenizer  {tokenizer} (vocabulary {args.padded_vocab_size} after padding)")
    lines.append(f"parallel   world {args.world_size} = data {args.data_parallel_size} x tensor "
                 f"{args.tensor_model_parallel_size} x pipeline {args.pipeline_model_parallel_size}")
    sync = data_parallel_sync(args)
    if sync:
        lines.append("dp sync    " + sync)
    outputs = [f"checkpoints {args.save}" if args.save else "no checkpoints (--save)",
               f"tensorboard {args.tensorboard_dir}" if args.tensorboard_dir else "no tensorboard (--tensorboard-dir)"]
    if args.load:
        outputs.append(f"resumes from {args.load}")
    lines.append("outputs    " + "; ".join(outputs))
    if argument_dump:
        lines.append(f"megatron's argument list: {argument_dump}")
    lines.append("metrics    defined in docs/metrics.md")
    lines.append("=" * 79)
    return "\n".join(lines)


def data_parallel_sync(args) -> str:
    """How the data-parallel ranks sync once a step, and whether it hides behind compute: every parameter
    moves, so a routed model (5-10x Dense's parameters at the same activated depth) pays it 5-10x
    (bench/README.md, "Host cost"); "" without data parallelism."""
    if args.data_parallel_size == 1:
        return ""
    # megatron turns --use-distributed-optimizer into the layer-wise one for Muon (use_distributed_optimizer False)
    sharded = args.use_distributed_optimizer or getattr(args, "use_layer_wise_distributed_optimizer", False)
    grads = "gradients " + ("reduce-scattered" if sharded else "all-reduced") + (
        " during the last micro-batch's backward (--overlap-grad-reduce)" if args.overlap_grad_reduce
        else " after the last micro-batch (exposed: --overlap-grad-reduce hides it)")
    if not sharded:
        return grads
    params = "parameters all-gathered " + (
        "during the next forward (--overlap-param-gather)" if args.overlap_param_gather
        else "after the optimizer step (exposed: --overlap-param-gather hides it)")
    return f"{grads}; {params}"


# ----------------------------------------------------------------------------- the log
def _eta(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


MEGA = 1e6


@dataclasses.dataclass
class RoutingLog:
    """Logs one run's routing statistics and compute; ``model_chunks`` are this rank's built chunks."""

    model_chunks: list = dataclasses.field(default_factory=list)
    accounting: Optional[ModelCount] = None  # computed once, at the first log; None when uncountable
    _counted: bool = False
    _clock: Optional[tuple[float, int, int]] = None  # (time, iteration, tokens) at the last log line
    _paused: float = 0.0  # seconds spent in validation since the last log line
    _watched: object = None  # the tensorboard writer whose losses are mirrored against FLOPs

    def setup(self, args) -> None:
        """Count the model once and mirror the writer's losses against FLOPs (from the first model
        chunk built on, so that iteration 1 is mirrored too)."""
        if not self._counted:
            description = describe_from_args(args)
            self.accounting = None if description is None else count(description, args.seq_length)
            self._counted = True
        from megatron.training import get_tensorboard_writer

        writer = get_tensorboard_writer()
        if writer is not None and self._watched is not writer:
            self._watch(writer, args)

    def training_flops(self, args) -> Optional[float]:
        if self.accounting is None:
            return None
        return 3.0 * self.accounting.flops_per_token * args.consumed_train_samples * args.seq_length

    def _watch(self, writer, args) -> None:
        """megatron writes ``lm loss`` (and its validation) itself; patch 23 writes it again against the
        training FLOPs (in MFLOPs), for compute-matched comparisons."""
        from megatron_xmod.training.patches import add_scalar_also_vs_flops

        add_scalar_also_vs_flops(writer, ("lm loss", "lm loss validation"), lambda: self.training_flops(args), MEGA)
        self._watched = writer

    def __call__(self, iteration: int) -> dict[str, float]:
        from megatron.training import get_args, get_tensorboard_writer, print_rank_last

        args = get_args()
        self.setup(args)
        tokens = args.consumed_train_samples * args.seq_length
        if self._clock is None:  # the first step of this process (warm-up included) starts the clock
            self._clock, self._paused = (time.time(), iteration, tokens), 0.0
        if iteration % args.log_interval:
            return {}
        scalars = {"tokens seen": float(tokens)}
        if self.accounting is not None:
            scalars["training flops"] = self.training_flops(args)
            scalars["forward flops per token"] = self.accounting.flops_per_token
            if self.accounting.tokens_ratio_vs_dense == self.accounting.tokens_ratio_vs_dense:  # not NaN
                scalars["D over D_dense"] = self.accounting.tokens_ratio_vs_dense
        now = time.time()
        speed = eta = None
        if self._clock is not None and iteration > self._clock[1]:
            then, last_iteration, last_tokens = self._clock
            seconds = max(1e-9, now - then - self._paused)
            speed = (tokens - last_tokens) / seconds
            scalars["tokens per second"] = speed
            if args.train_iters:
                eta = (args.train_iters - iteration) * seconds / (iteration - last_iteration)
        self._clock, self._paused = (now, iteration, tokens), 0.0
        names = metric_names()
        world = torch.distributed.group.WORLD if torch.distributed.is_initialized() else None
        layers = per_layer(self.model_chunks, names=names, num_layers=args.num_layers, group=world)
        for state in routing_states(self.model_chunks):
            state.reset()
        layers, undefined, pairs = drop_undefined_jaccard(layers)
        routing: dict[str, float] = {}
        for name, values in layers.items():
            if values:
                routing[name] = sum(values.values()) / len(values)
                routing.update({f"{name}/layer_{n:03d}": v for n, v in values.items()})
        scalars.update({f"routing/{name}": value for name, value in routing.items()})
        writer = get_tensorboard_writer()
        if writer is not None:
            for tag, value in scalars.items():
                writer.add_scalar(tag, value, iteration)
        parts = []
        if speed is not None:
            parts.append(f"tokens/s: {speed:,.0f}")
        if eta is not None:
            parts.append(f"ETA: {_eta(eta)}")
        parts += [f"{name}: {scalars[name]:.4g}" for name in ("tokens seen", "training flops", "D over D_dense")
                  if name in scalars]
        # Under top-k training the selected fraction is 1/K by construction: it is in tensorboard only.
        parts += [f"{name}: {routing[name]:.4f}" for name in names
                  if name in routing and name != "selected_fraction" and not name.startswith("eval_")]
        if undefined == pairs > 0:
            parts.append(f"adjacent_jaccard: {_not_available(undefined, pairs)}")
        print_rank_last(f" [xmod] iteration {iteration:8d} | " + " | ".join(parts))
        return scalars

    # ------------------------------------------------------------------------- validation
    def evaluation(self, iteration: int, write_to_tensorboard: bool, seconds: float = 0.0,
                   split: str = "validation") -> dict[str, float]:
        """After each of megatron's validations (every rank): the evaluation routing statistics of
        that validation, on the console and, at ``iteration``, in tensorboard. The test set's
        (``split="test"``, after training) go to the console only: megatron writes its losses under
        the validation tags at the same step, and the routing tags stay the validation set's."""
        from megatron.training import get_args, get_tensorboard_writer, print_rank_last

        args = get_args()
        self.setup(args)
        self._paused += seconds
        names = tuple(n for n in metric_names() if n.startswith("eval_"))
        world = torch.distributed.group.WORLD if torch.distributed.is_initialized() else None
        layers = per_layer(self.model_chunks, names=names, num_layers=args.num_layers, group=world)
        reset_metrics(self.model_chunks, names)
        layers, undefined, pairs = drop_undefined_jaccard(layers, "eval_")
        layout = layout_from_args(args)
        scalars: dict[str, float] = {}
        parts = []
        for name in names:
            if name == "eval_adjacent_jaccard" and undefined == pairs > 0:
                parts.append(f"adjacent jaccard: {_not_available(undefined, pairs)}")
                continue
            if not layers.get(name):
                continue
            values = layers[name]
            mean = sum(values.values()) / len(values)
            scalars[f"routing/{name}"] = mean
            scalars.update({f"routing/{name}/layer_{n:03d}": v for n, v in values.items()})
            reference = mean_reference(layout, name, values)
            label = name.removeprefix("eval_").replace("_", " ")
            notes = []
            if reference is not None:
                scalars[f"routing/{name} random"] = reference
                notes.append(f"{'1/K' if name == 'eval_selected_fraction' else 'random'}: {reference:.4f}")
            if name == "eval_adjacent_jaccard" and undefined:
                notes.append(_not_available(undefined, pairs))
            parts.append(f"{label}: {mean:.4f}" + (f" ({'; '.join(notes)})" if notes else ""))
        writer = get_tensorboard_writer()
        if writer is not None and write_to_tensorboard and split == "validation":
            for tag, value in scalars.items():
                writer.add_scalar(tag, value, iteration)
        if parts:
            print_rank_last(f" [xmod] {split} routing at iteration {iteration} ({args.xmod_eval_routing} rule) | "
                            + " | ".join(parts))
        return scalars


def reset_metrics(model_chunks, names) -> None:
    """Forget the interval statistics of ``names`` only (the training interval's stay for the log)."""
    for state in routing_states(model_chunks):
        state.forget(names)
