"""``--xmod-pipeline-balance auto``: the entry point's flags gain the cost-balanced
``--pipeline-model-parallel-layout`` (:mod:`megatron_xmod.pipeline.partition`) when the run is
pipelined (``--pipeline-model-parallel-size`` > 1) and the user gave no layout or uneven split of
their own. The virtual stages per rank come from ``--num-virtual-stages-per-pipeline-rank`` or
``--num-layers-per-virtual-pipeline-stage``; the layout then implies them, so those flags are dropped.
"""
from __future__ import annotations

import argparse
import os

from megatron_xmod.pipeline.cost import layer_items
from megatron_xmod.pipeline.partition import balanced_partition, default_partition
from megatron_xmod.presets import GPT2_VOCAB_SIZE, Backbone, ModelDescription
from megatron_xmod.xmod.layout import Layout

BALANCE_CHOICES = ("default", "auto")
_USER_SPLIT = ("--pipeline-model-parallel-layout", "--decoder-first-pipeline-num-layers",
               "--decoder-last-pipeline-num-layers", "--hybrid-layer-pattern")
_VIRTUAL = {"--num-virtual-stages-per-pipeline-rank", "--num-layers-per-virtual-pipeline-stage"}


def _scan(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for flag in ("--pipeline-model-parallel-size", "--num-virtual-stages-per-pipeline-rank",
                 "--num-layers-per-virtual-pipeline-stage", "--seq-length", "--micro-batch-size", "--hidden-size",
                 "--ffn-hidden-size", "--num-attention-heads", "--num-query-groups", "--kv-channels", "--vocab-size"):
        parser.add_argument(flag, type=int, default=None)
    for flag in _USER_SPLIT:
        parser.add_argument(flag, default=None)
    return parser.parse_known_args(argv)[0]


def backbone_from_flags(pre: argparse.Namespace) -> Backbone:
    missing = [f for f in ("hidden_size", "num_attention_heads") if getattr(pre, f) is None]
    if missing:
        raise ValueError(f"xmod_pipeline_balance: --{missing[0].replace('_', '-')} is needed to cost the layers; "
                         "give --xmod-backbone or megatron's architecture flags")
    heads = pre.num_attention_heads
    head_dim = pre.kv_channels or pre.hidden_size // heads
    return Backbone("flags", pre.hidden_size, head_dim, heads, pre.num_query_groups or heads,
                    pre.ffn_hidden_size or 4 * pre.hidden_size, vocab_size=pre.vocab_size or GPT2_VOCAB_SIZE)


def balanced_layout_flags(argv: list[str], layout: Layout, backbone: Backbone | None = None) -> list[str]:
    """``argv`` with the balanced ``--pipeline-model-parallel-layout`` added (unchanged when the run is
    not pipelined or the user split it already)."""
    pre = _scan(argv)
    pp = pre.pipeline_model_parallel_size or 1
    if pp < 2 or any(getattr(pre, flag[2:].replace("-", "_")) is not None for flag in _USER_SPLIT):
        return argv
    if pre.seq_length is None:
        raise ValueError("xmod_pipeline_balance: --seq-length is needed to cost the layers; add it")
    vpp = pre.num_virtual_stages_per_pipeline_rank or 1
    if pre.num_layers_per_virtual_pipeline_stage:
        per_rank, remainder = divmod(layout.num_layers, pp * pre.num_layers_per_virtual_pipeline_stage)
        if remainder or per_rank < 1:
            raise ValueError(f"num_layers_per_virtual_pipeline_stage: {layout.num_layers} layers do not split into "
                             f"{pp} ranks x {pre.num_layers_per_virtual_pipeline_stage}; use "
                             "--num-virtual-stages-per-pipeline-rank")
        vpp = per_rank
    backbone = backbone or backbone_from_flags(pre)
    items = layer_items(ModelDescription(layout.notation, backbone, layout), pre.seq_length, pre.micro_batch_size or 1)
    if pp * vpp > len(items):
        raise ValueError(f"pipeline_model_parallel_size: {pp} x {vpp} stages exceed the {layout.num_layers} layers; "
                         "use fewer stages")
    partition = balanced_partition(items, pp, vpp)
    if os.environ.get("RANK", "0") == "0":  # once per launch, not once per process
        default = default_partition(items, pp, vpp)
        print(f"[xmod] --xmod-pipeline-balance auto: --pipeline-model-parallel-layout '{partition.layout}' "
              f"(slowest stage / mean {partition.max_over_mean:.3f}; megatron's default split "
              f"{default.max_over_mean:.3f})", flush=True)
    from megatron_xmod.training.flags import drop_flags

    return drop_flags(argv, _VIRTUAL) + ["--pipeline-model-parallel-layout", partition.layout]
