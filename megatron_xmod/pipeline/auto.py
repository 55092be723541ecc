"""``--xmod-pipeline-balance auto``: the cost-balanced ``--pipeline-model-parallel-layout``
(:mod:`megatron_xmod.pipeline.partition`) of a pipelined run whose user gave no layout or uneven split
of their own. The entry point's flags (:mod:`megatron_xmod.training.flags`) read the command line and
call :func:`balanced_layout` with what it says.
"""
from __future__ import annotations

import os
from typing import Optional

from megatron_xmod.pipeline.cost import layer_items
from megatron_xmod.pipeline.partition import balanced_partition, default_partition
from megatron_xmod.presets import GPT2_VOCAB_SIZE, Backbone, ModelDescription
from megatron_xmod.xmod.layout import Layout


def backbone_from_architecture(hidden_size: Optional[int], num_attention_heads: Optional[int],
                               num_query_groups: Optional[int] = None, kv_channels: Optional[int] = None,
                               ffn_hidden_size: Optional[int] = None, vocab_size: Optional[int] = None) -> Backbone:
    """The backbone megatron's architecture flags describe (the layer costs need its widths)."""
    for name, value in (("hidden_size", hidden_size), ("num_attention_heads", num_attention_heads)):
        if value is None:
            raise ValueError(f"xmod_pipeline_balance: --{name.replace('_', '-')} is needed to cost the layers; "
                             "give --xmod-backbone or megatron's architecture flags")
    head_dim = kv_channels or hidden_size // num_attention_heads
    return Backbone("flags", hidden_size, head_dim, num_attention_heads, num_query_groups or num_attention_heads,
                    ffn_hidden_size or 4 * hidden_size, vocab_size=vocab_size or GPT2_VOCAB_SIZE)


def balanced_layout(layout: Layout, backbone: Backbone, seq_length: Optional[int], micro_batch_size: int,
                    pipeline_size: int, virtual_stages: Optional[int] = None,
                    layers_per_virtual_stage: Optional[int] = None) -> str:
    """The ``--pipeline-model-parallel-layout`` that minimises the slowest stage of ``layout`` on
    ``pipeline_size`` ranks (``virtual_stages`` per rank, or as many as ``layers_per_virtual_stage`` gives)."""
    if seq_length is None:
        raise ValueError("xmod_pipeline_balance: --seq-length is needed to cost the layers; add it")
    vpp = virtual_stages or 1
    if layers_per_virtual_stage:
        per_rank, remainder = divmod(layout.num_layers, pipeline_size * layers_per_virtual_stage)
        if remainder or per_rank < 1:
            raise ValueError(f"num_layers_per_virtual_pipeline_stage: {layout.num_layers} layers do not split into "
                             f"{pipeline_size} ranks x {layers_per_virtual_stage}; use "
                             "--num-virtual-stages-per-pipeline-rank")
        vpp = per_rank
    items = layer_items(ModelDescription(layout.notation, backbone, layout), seq_length, micro_batch_size)
    if pipeline_size * vpp > len(items):
        raise ValueError(f"pipeline_model_parallel_size: {pipeline_size} x {vpp} stages exceed the "
                         f"{layout.num_layers} layers; use fewer stages")
    partition = balanced_partition(items, pipeline_size, vpp)
    if os.environ.get("RANK", "0") == "0":  # once per launch, not once per process
        default = default_partition(items, pipeline_size, vpp)
        print(f"[xmod] --xmod-pipeline-balance auto: --pipeline-model-parallel-layout '{partition.layout}' "
              f"(slowest stage / mean {partition.max_over_mean:.3f}; megatron's default split "
              f"{default.max_over_mean:.3f})", flush=True)
    return partition.layout
