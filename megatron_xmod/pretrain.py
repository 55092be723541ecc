"""Pre-train Dense / MoD / X-MoD / MoE GPT models on megatron's own training loop.

    python -m megatron_xmod.pretrain [any megatron-LM argument] [--xmod-* arguments]
    torchrun --nproc_per_node=8 -m megatron_xmod.pretrain ...

Modelled on Megatron-LM's ``pretrain_gpt.py``: ``megatron.training.pretrain`` with the hooks of
:mod:`megatron_xmod.training.hooks`, plus the ``--xmod-*`` argument group. Every standard megatron
argument keeps working. ``--xmod-backbone`` expands a Table 4 preset into megatron's own
architecture flags (placed before the user's flags, so explicit flags still win).
"""
from __future__ import annotations

import sys
from typing import Optional

from megatron_xmod.training import patches
from megatron_xmod.training.flags import expand_arguments
from megatron_xmod.training.preflight import validate_before_training


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
    validate_before_training(args)
    patches.call_after_training_log(hooks.after_training_log)
    config_container = pretrain_cfg_container_from_args(args, None)
    pretrain(config_container, hooks.datasets_provider, ModelType.encoder_or_decoder, hooks.forward_step,
             model_provider=hooks.model_provider)


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError) as error:
        print(f"megatron_xmod.pretrain: error: {error}", file=sys.stderr)
        sys.exit(2)
