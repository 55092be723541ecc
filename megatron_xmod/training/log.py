"""Routing and compute scalars in megatron's own training log (console and tensorboard).

megatron's ``training_log`` prints and writes the loss dictionary; the per-layer routing statistics
and the FLOP accounting are not losses, so :class:`RoutingLog` logs them right after it (patch 13 of
:mod:`megatron_xmod.training.patches`), at the same interval, to the same writer. Tags (other tools
read them; see docs/scaling.md):

- ``tokens seen``, ``training flops`` (cumulative, 3 x forward), ``forward flops per token``,
  ``D over D_dense`` (tokens at equal compute vs the Dense model of the same backbone);
- ``routing/<metric>`` (mean over the recorders' layers) and ``routing/<metric>/layer_<n>``: the
  sparse layers' selected_fraction, coverage, adjacent_jaccard, router_bce_loss (eval_* under
  validation) and the DTop-p router's metrics.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from megatron_xmod.accounting import ModelCount, count
from megatron_xmod.layout import parse_layout
from megatron_xmod.presets import Backbone, ModelDescription
from megatron_xmod.routing_state import report


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
    from megatron_xmod.layers import XModSparseLayer
    from megatron_xmod.moe.router import DTopPRouter

    return tuple(dict.fromkeys(XModSparseLayer.ROUTING_METRICS + DTopPRouter.ROUTING_METRICS))


@dataclasses.dataclass
class RoutingLog:
    """Logs one run's routing statistics and compute; ``model_chunks`` are this rank's built chunks."""

    model_chunks: list = dataclasses.field(default_factory=list)
    accounting: Optional[ModelCount] = None  # computed once, at the first log; None when uncountable
    _counted: bool = False

    def __call__(self, iteration: int) -> dict[str, float]:
        from megatron.training import get_args, get_tensorboard_writer, print_rank_last

        args = get_args()
        if iteration % args.log_interval:
            return {}
        if not self._counted:
            description = describe_from_args(args)
            self.accounting = None if description is None else count(description, args.seq_length)
            self._counted = True
        tokens = args.consumed_train_samples * args.seq_length
        scalars = {"tokens seen": float(tokens)}
        if self.accounting is not None:
            scalars.update({
                "training flops": 3.0 * self.accounting.flops_per_token * tokens,
                "forward flops per token": self.accounting.flops_per_token,
                "D over D_dense": self.accounting.tokens_ratio_vs_dense,
            })
        names = metric_names()
        world = torch.distributed.group.WORLD if torch.distributed.is_initialized() else None
        routing = report(self.model_chunks, names=names, num_layers=args.num_layers, group=world)
        scalars.update({f"routing/{name}": value for name, value in routing.items()})
        writer = get_tensorboard_writer()
        if writer is not None:
            for tag, value in scalars.items():
                writer.add_scalar(tag, value, iteration)
        summary = " | ".join(f"{name}: {scalars[name]:.4g}" for name in
                             ("tokens seen", "training flops", "forward flops per token", "D over D_dense") if name in scalars)
        means = " | ".join(f"{name}: {routing[name]:.4f}" for name in names if name in routing)
        print_rank_last(f" [xmod] iteration {iteration:8d} | {summary}" + (f" | {means}" if means else ""))
        return scalars
