"""Routing and compute scalars in megatron's own training log (console and tensorboard).

megatron's ``training_log`` prints and writes the loss dictionary; the per-layer routing statistics
and the FLOP accounting are not losses, so we log them right after it, at the same interval, to
the same writer. Tags (other tools read them; see docs/scaling.md):

- ``tokens seen``, ``training flops`` (cumulative, 3 x forward), ``forward flops per token``,
  ``D over D_dense`` (tokens at equal compute vs the Dense model of the same backbone);
- ``routing/<metric>`` (mean over sparse layers) and ``routing/<metric>/layer_<n>`` for
  selected_fraction, coverage, adjacent_jaccard, router_bce_loss (and eval_* under validation).
"""
from __future__ import annotations

import functools

from megatron_xmod import metrics

_installed = False


def compute_accounting(args):
    """FLOPs/token and D/D_D of the model the arguments describe, from the accounting module."""
    from megatron_xmod.accounting import count_model
    from megatron_xmod.layout import resolve_layout
    from megatron_xmod.presets import Backbone

    layout = resolve_layout(args.xmod_routing_family, num_layers=args.num_layers, layout=args.xmod_layout)
    backbone = Backbone(
        name="args", hidden_size=args.hidden_size, head_dim=args.kv_channels,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups if args.group_query_attention else args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size, num_layers=round(float(layout.activated_depth)),
        vocab_size=args.padded_vocab_size, qk_layernorm=args.qk_layernorm,
    )
    if getattr(args, "num_experts", None) is None:
        return count_model(backbone, layout, args.seq_length, family=args.xmod_routing_family)
    from megatron_xmod.moe.accounting import count_moe_model

    # MoE models are counted by their preset (or DTop-p target); a hand-made expert setup has no
    # fixed active-expert count to charge, so it reports no FLOPs.
    router = getattr(args, "moe_router_type", None) or "topk"
    if router == "dtopp" and args.dtopp_target_experts is not None:
        name = f"dtopp-t{float(args.dtopp_target_experts):g}-e{args.num_experts}"
    elif router == "topk" and getattr(args, "moe_preset", None):
        name = args.moe_preset
    else:
        return None
    return count_moe_model(backbone, name, args.seq_length)


def log_routing_and_compute(iteration: int) -> dict[str, float]:
    from megatron.training import get_args, get_tensorboard_writer, print_rank_last

    args = get_args()
    if iteration % args.log_interval:
        return {}
    count = compute_accounting(args)
    tokens = args.consumed_train_samples * args.seq_length
    scalars = {"tokens seen": float(tokens)}
    if count is not None:
        scalars.update({
            "training flops": 3.0 * count.flops_per_token * tokens,
            "forward flops per token": count.flops_per_token,
            "D over D_dense": count.tokens_ratio_vs_dense,
        })
    routing = metrics.report(num_layers=args.num_layers, group=_world())
    scalars.update({f"routing/{name}": value for name, value in routing.items()})
    writer = get_tensorboard_writer()
    if writer is not None:
        for tag, value in scalars.items():
            writer.add_scalar(tag, value, iteration)
    summary = " | ".join(f"{name}: {scalars[name]:.4g}" for name in
                         ("tokens seen", "training flops", "forward flops per token", "D over D_dense") if name in scalars)
    means = " | ".join(f"{name}: {routing[name]:.4f}" for name in metrics.METRICS if name in routing)
    print_rank_last(f" [xmod] iteration {iteration:8d} | {summary}" + (f" | {means}" if means else ""))
    return scalars


def _world():
    import torch

    return torch.distributed.group.WORLD if torch.distributed.is_initialized() else None


def install_routing_logging() -> None:
    """Wrap megatron.training.training.training_log (called on every rank each iteration)."""
    global _installed
    if _installed:
        return
    import megatron.training.training as training

    original = training.training_log

    @functools.wraps(original)
    def training_log(*args, **kwargs):
        result = original(*args, **kwargs)
        iteration = kwargs["iteration"] if "iteration" in kwargs else args[3]
        log_routing_and_compute(iteration)
        return result

    training.training_log = training_log
    _installed = True
