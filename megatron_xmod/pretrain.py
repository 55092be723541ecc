"""Pre-train Dense / MoD / X-MoD / MoE GPT models on megatron's own training loop.

    python -m megatron_xmod.pretrain [any megatron-LM argument] [--xmod-* arguments]
    torchrun --nproc_per_node=8 -m megatron_xmod.pretrain ...

Modelled on Megatron-LM's ``pretrain_gpt.py``: ``megatron.training.pretrain`` with the hooks of
:mod:`megatron_xmod.training.hooks`, plus the ``--xmod-*`` argument group. Every standard megatron
argument keeps working. ``--xmod-backbone`` expands a Table 4 preset into megatron's own
architecture flags (placed before the user's flags, so explicit flags still win).
"""
from __future__ import annotations

import os
import sys
from typing import Optional

from megatron_xmod.training import patches
from megatron_xmod.training.flags import expand_arguments
from megatron_xmod.training.providers import config_from_args


# ----------------------------------------------------------------------------- main
def main(argv: Optional[list[str]] = None) -> None:
    with patches.cpu_patches(training=True):
        _pretrain(expand_arguments(list(sys.argv[1:] if argv is None else argv)))


def _pretrain(argv: list[str]) -> None:
    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    from megatron_xmod.training.hooks import xmod_train_hooks

    sys.argv = [sys.argv[0]] + argv
    hooks = xmod_train_hooks()
    patches.skip_dataset_helper_build()
    args = parse_and_validate_args(extra_args_provider=hooks.extra_args_provider)
    _validate_before_training(args)
    patches.call_after_training_log(hooks.after_training_log)
    config_container = pretrain_cfg_container_from_args(args, None)
    pretrain(config_container, hooks.datasets_provider, ModelType.encoder_or_decoder, hooks.forward_step,
             model_provider=hooks.model_provider)


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
