"""Pre-train Dense / MoD / X-MoD GPT models on megatron's own training loop.

    python -m megatron_xmod.pretrain [any megatron-LM argument] [--xmod-* arguments]
    torchrun --nproc_per_node=8 -m megatron_xmod.pretrain ...

Modelled on Megatron-LM's ``pretrain_gpt.py``: ``megatron.training.pretrain`` with our model
provider, forward step and dataset provider, plus the ``--xmod-*`` argument group. Every standard
megatron argument keeps working. ``--xmod-backbone`` expands a Table 4 preset into megatron's own
architecture flags (placed before the user's flags, so explicit flags still win).
"""
from __future__ import annotations

import argparse
import os
import sys
from functools import partial
from typing import Optional

import torch

from megatron_xmod import cpu_compat, metrics
from megatron_xmod.layout import ROUTING_FAMILIES, LayoutError, layout_from_model_name, resolve_layout
from megatron_xmod.presets import BACKBONES, get_backbone

MUON_TABLE5 = [  # seed 000, Table 5 (peak LR 3.2e-3; AdamW settings for the non-matrix parameters)
    "--optimizer", "muon", "--lr", "3.2e-3", "--muon-momentum", "0.95", "--muon-num-ns-steps", "5",
    "--muon-nesterov", "--muon-scale-mode", "spectral", "--muon-extra-scale-factor", "0.2",
    "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--adam-eps", "1e-8", "--weight-decay", "0.1",
]
PAPER_SCHEDULE = ["--lr-decay-style", "cosine", "--lr-warmup-fraction", "0.01"]  # cosine to 10% of peak


def add_xmod_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``--xmod-*`` group; each dest is an :class:`XModConfig` field name, so megatron's
    ``core_transformer_config_from_args`` maps them onto the config unchanged."""
    group = parser.add_argument_group("X-MoD", "sparse-depth routing (megatron_xmod)")
    group.add_argument("--xmod-backbone", default=None, choices=sorted(BACKBONES),
                       help="Table 4 preset: expands to megatron's architecture flags")
    group.add_argument("--xmod-model", default=None,
                       help="named model: dense, mod, mod-k<K>, xmod-a<A>k<K> (xmod-a4k8, xmod-a3k16) or a layout")
    group.add_argument("--xmod-routing-family", dest="xmod_routing_family", default="dense", choices=ROUTING_FAMILIES)
    group.add_argument("--xmod-sparsity-k", dest="xmod_sparsity_k", type=int, default=None, help="K")
    group.add_argument("--xmod-anchor-stride", dest="xmod_anchor_stride", type=float, default=None, help="A")
    group.add_argument("--xmod-dense-prefix", dest="xmod_dense_prefix", type=int, default=None, help="N0")
    group.add_argument("--xmod-layout", dest="xmod_layout", default=None, help="e.g. 'D*4 + (S8*8 + D)*4'")
    group.add_argument("--xmod-activated-depth", dest="xmod_activated_depth", type=int, default=None)
    group.add_argument("--xmod-token-choice-bias-tau", dest="xmod_token_choice_bias_tau", type=float, default=0.5)
    group.add_argument("--xmod-token-choice-bias-increment", dest="xmod_token_choice_bias_increment", type=float, default=1.0)
    group.add_argument("--xmod-router-bce-coeff", dest="xmod_router_bce_coeff", type=float, default=1e-4)
    group.add_argument("--xmod-gate-scale-init", dest="xmod_gate_scale_init", type=float, default=1.0)
    group.add_argument("--xmod-eval-routing", dest="xmod_eval_routing", default="threshold", choices=("threshold", "topk"))
    group.add_argument("--xmod-muon-table5", action="store_true", help="the paper's Muon settings (Table 5)")
    group.add_argument("--xmod-paper-schedule", action="store_true", help="1%% warmup, cosine to 10%% of peak")
    group.add_argument("--xmod-no-topk-validation", action="store_true",
                       help="skip the top-k routing comparison loss during validation")
    return parser


def _preparse(argv: list[str]) -> argparse.Namespace:
    parser = add_xmod_arguments(argparse.ArgumentParser(add_help=False, allow_abbrev=False))
    parser.add_argument("--num-layers", type=int, default=None)
    parser.add_argument("--lr", default=None)
    parser.add_argument("--min-lr", default=None)
    return parser.parse_known_args(argv)[0]


def backbone_flags(b) -> list[str]:
    """megatron's own architecture flags for a :class:`~megatron_xmod.presets.Backbone`."""
    flags = ["--hidden-size", str(b.hidden_size), "--ffn-hidden-size", str(b.ffn_hidden_size),
             "--num-attention-heads", str(b.num_attention_heads), "--group-query-attention",
             "--num-query-groups", str(b.num_query_groups), "--kv-channels", str(b.head_dim),
             "--swiglu", "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--disable-bias-linear",
             "--position-embedding-type", "rope", "--rotary-base", str(b.rotary_base),
             "--untie-embeddings-and-output-weights", "--no-rope-fusion"]
    return flags + (["--qk-layernorm"] if b.qk_layernorm else [])


def expand_arguments(argv: list[str]) -> list[str]:
    """Turn ``--xmod-backbone``/``--xmod-model`` and the presets into plain megatron flags.

    Layout errors surface here, before megatron starts anything.
    """
    pre = _preparse(argv)
    head: list[str] = []
    activated = pre.xmod_activated_depth
    if pre.xmod_backbone:
        b = get_backbone(pre.xmod_backbone)
        activated = activated or b.num_layers
        head += backbone_flags(b)
    dense_prefix = pre.xmod_dense_prefix
    if pre.xmod_model:
        if pre.xmod_layout:
            raise LayoutError("xmod_model: give either --xmod-model or --xmod-layout")
        layout = layout_from_model_name(pre.xmod_model, activated_depth=activated or 28,
                                        dense_prefix=4 if dense_prefix is None else dense_prefix)
        family = "dense" if layout.num_sparse_layers == 0 else ("mod" if pre.xmod_model.startswith("mod") else "xmod")
    else:
        family = pre.xmod_routing_family
        layout = resolve_layout(family, num_layers=None if activated else pre.num_layers,
                                sparsity_k=pre.xmod_sparsity_k, anchor_stride=pre.xmod_anchor_stride,
                                dense_prefix=dense_prefix, layout=pre.xmod_layout, activated_depth=activated)
    # From here on the layout is explicit: the config re-validates it against --num-layers.
    argv = _drop_flags(argv, {"--xmod-model", "--xmod-routing-family", "--xmod-layout", "--xmod-anchor-stride",
                              "--xmod-dense-prefix", "--xmod-activated-depth"})
    tail = ["--xmod-routing-family", family, "--xmod-layout", layout.notation]
    if pre.num_layers is None:
        head += ["--num-layers", str(layout.num_layers)]
    if layout.num_sparse_layers:
        head += ["--no-rope-fusion"]
    if pre.xmod_muon_table5:
        head += MUON_TABLE5
    if pre.xmod_paper_schedule:
        head += PAPER_SCHEDULE
        if pre.min_lr is None:
            lr = pre.lr if pre.lr is not None else ("3.2e-3" if pre.xmod_muon_table5 else None)
            if lr is None:
                raise LayoutError("lr: --xmod-paper-schedule decays to 10% of the peak, so it needs --lr")
            tail += ["--min-lr", str(float(lr) * 0.1)]
    from megatron_xmod.moe.args import expand_moe_arguments

    # MoE presets size their experts from --ffn-hidden-size, which the backbone expansion provides.
    return expand_moe_arguments(head + argv + tail)


def _drop_flags(argv: list[str], flags: set[str]) -> list[str]:
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
            continue
        name = item.split("=", 1)[0]
        if name in flags:
            skip = "=" not in item
            continue
        out.append(item)
    return out


# ----------------------------------------------------------------------------- model
def config_from_args(args):
    """XModConfig from megatron's parsed arguments (``--xmod-*`` dests are its field names); a
    MoEConfig when ``--num-experts``/``--moe-preset`` ask for experts."""
    import dataclasses

    from megatron.training.arguments import core_transformer_config_from_args

    from megatron_xmod.config import XModConfig

    config = core_transformer_config_from_args(args, XModConfig)
    if config.num_moe_experts is None and getattr(args, "moe_preset", None) is None:
        return config
    from megatron_xmod.moe.args import apply_moe_arguments
    from megatron_xmod.moe.config import MoEConfig

    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(XModConfig) if f.init}
    return MoEConfig(**apply_moe_arguments(args, fields))


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    from megatron.training import get_args

    from megatron_xmod.model import build_gpt_model

    args = get_args()
    config = config_from_args(args)
    build = build_gpt_model
    if config.num_moe_experts is not None:
        from megatron_xmod.moe.model import build_moe_gpt_model as build
    return build(
        config, args.padded_vocab_size, args.max_position_embeddings, pre_process=pre_process,
        post_process=post_process, rotary_base=args.rotary_base, vp_stage=vp_stage, pg_collection=pg_collection,
        use_transformer_engine=args.transformer_impl == "transformer_engine",
    )


# ----------------------------------------------------------------------------- data
def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.training import get_args, get_tokenizer, print_rank_0
    from megatron.training.utils import get_blend_and_blend_per_split

    args = get_args()
    blend, blend_per_split = get_blend_and_blend_per_split(args)  # paths checked in _validate_before_training
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend, blend_per_split=blend_per_split,
        split=args.split, path_to_cache=args.data_cache_path, tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids, reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss, create_attention_mask=args.create_attention_mask_in_dataloader,
    )
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    datasets = BlendedMegatronDatasetBuilder(GPTDataset, train_val_test_num_samples, lambda: True, config).build()
    print_rank_0("> finished creating GPT datasets ...")
    return datasets


# Every rank reads its own copy of the batch (TP ranks see identical samples), so no broadcast.
train_valid_test_datasets_provider.is_distributed = True


# ----------------------------------------------------------------------------- step
def loss_func(loss_mask: torch.Tensor, router_bce: Optional[torch.Tensor], topk_losses: Optional[torch.Tensor],
              lm_z_loss: Optional[tuple], output_tensor: torch.Tensor):
    """``lm_z_loss``: (labels, coefficient) when the model returned logits for the DTop-p LM z-loss."""
    mask = loss_mask.view(-1).float()
    num_tokens = mask.sum().detach().to(torch.int)
    z_report = None
    if lm_z_loss is not None:
        from megatron_xmod.moe.losses import lm_cross_entropy_and_z_loss

        labels, coefficient = lm_z_loss
        cross_entropy, z_loss = lm_cross_entropy_and_z_loss(output_tensor, labels)
        losses = cross_entropy.float().view(-1)
        z_sum = torch.sum(z_loss.float().view(-1) * mask)
        z_report = torch.cat([z_sum.detach().view(1), num_tokens.view(1)])
        loss = torch.sum(losses * mask) + coefficient * z_sum
        lm_sum = torch.sum(losses * mask).detach()
    else:
        losses = output_tensor.float().view(-1)
        loss = torch.sum(losses * mask)
        lm_sum = loss.detach()
    reports = {"lm loss": torch.cat([lm_sum.view(1), num_tokens.view(1)])}
    if z_report is not None:
        reports["lm z loss"] = z_report
    if router_bce is not None:
        reports["router bce loss"] = torch.cat([(router_bce.detach() * num_tokens).view(1), num_tokens.view(1)])
    if topk_losses is not None:
        topk = torch.sum(topk_losses.float().view(-1) * mask)
        reports["lm loss topk routing"] = torch.cat([topk.view(1), num_tokens.view(1)])
    return loss, num_tokens, reports


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    from megatron.core import parallel_state

    from megatron_xmod.model import set_eval_routing, sparse_layers

    batch = next(data_iterator)
    tokens, labels = batch["tokens"], batch["labels"]
    loss_mask, position_ids = batch["loss_mask"], batch["position_ids"]
    attention_mask = batch.get("attention_mask")
    from megatron.core.utils import get_attr_wrapped_model

    z_coefficient = getattr(get_attr_wrapped_model(model, "config"), "lm_z_loss_coeff", 0.0)
    if z_coefficient > 0 and model.training:
        # the z-loss needs the logits, so the loss is computed here instead of inside GPTModel
        output = model(tokens, position_ids, attention_mask)
        lm_z_loss = (labels, z_coefficient)
    else:
        output = model(tokens, position_ids, attention_mask, labels=labels)
        lm_z_loss = None
    router_bce = metrics.take_microbatch_losses() if model.training else None

    topk_losses = None
    from megatron.training import get_args

    routed = [] if model.training or get_args().xmod_no_topk_validation else sparse_layers(model)
    if routed and parallel_state.get_pipeline_model_parallel_world_size() == 1:
        # Validation reports the deployable threshold rule; the same batch under top-k routing is
        # the comparison the paper's Table 10 makes.
        rule = routed[0].config.xmod_eval_routing
        set_eval_routing(model, "topk" if rule == "threshold" else "threshold")
        with torch.no_grad():
            topk_losses = model(tokens, position_ids, attention_mask, labels=labels)
        set_eval_routing(model, rule)
    return output, partial(loss_func, loss_mask, router_bce, topk_losses, lm_z_loss)


# ----------------------------------------------------------------------------- main
def main(argv: Optional[list[str]] = None) -> None:
    from megatron_xmod.train_logging import install_routing_logging

    cpu_compat.install(training=True)
    argv = expand_arguments(list(sys.argv[1:] if argv is None else argv))
    sys.argv = [sys.argv[0]] + argv

    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    import megatron.core.datasets.utils as dataset_utils

    # `_compile_dependencies` runs `make` in megatron/core/datasets, but the pip wheel ships the
    # compiled helpers and no Makefile: the build step can only fail there.
    dataset_utils.compile_helpers = lambda: None
    from megatron_xmod.moe.args import add_moe_arguments

    args = parse_and_validate_args(extra_args_provider=lambda parser: add_moe_arguments(add_xmod_arguments(parser)))
    _validate_before_training(args)
    install_routing_logging()
    config_container = pretrain_cfg_container_from_args(args, None)
    pretrain(config_container, train_valid_test_datasets_provider, ModelType.encoder_or_decoder, forward_step,
             model_provider=model_provider)


def _validate_before_training(args) -> None:
    """Fail before any training starts: the routed config, sequence length, data paths."""
    config = config_from_args(args)  # raises with the field name
    ks = {layer.sparsity_k for layer in config.layer_layout.layers if layer.is_sparse}
    if ks and args.reset_attention_mask:
        raise ValueError("reset_attention_mask: routed layers attend causally over the routed subsequence and do "
                         "not apply per-document masks; train without --reset-attention-mask")
    for k in ks:
        if args.seq_length % k:
            raise ValueError(f"seq_length: {args.seq_length} is not divisible by sparsity K={k} (top-k routes exactly L/K tokens)")
    if not args.mock_data:
        paths = [p for p in (args.data_path or []) + (args.train_data_path or []) if not _is_number(p)]
        held_out = [p for p in (args.valid_data_path or []) + (args.test_data_path or []) if not _is_number(p)]
        if not paths and not args.per_split_data_args_path and not args.data_args_path:
            raise ValueError("data_path: no training data given (--data-path PREFIX or --train-data-path PREFIX)")
        for prefix in paths + held_out:
            if not (os.path.exists(prefix + ".bin") and os.path.exists(prefix + ".idx")):
                raise FileNotFoundError(f"data_path: no Megatron dataset at {prefix!r} (expected .bin and .idx; "
                                        "make one with `xmod preprocess`)")


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError) as error:
        print(f"megatron_xmod.pretrain: error: {error}", file=sys.stderr)
        sys.exit(2)
