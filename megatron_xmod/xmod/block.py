"""Decoder block spec for Dense / MoD / X-MoD GPT models, sliced per pipeline stage like megatron's
``get_gpt_decoder_block_spec``: one layer spec per entry of ``config.layer_layout``."""
from __future__ import annotations

import dataclasses
from typing import Optional

from megatron.core.models.gpt.gpt_layer_specs import (
    LNImpl,
    get_gpt_layer_local_submodules,
    get_gpt_layer_with_transformer_engine_submodules,
)
from megatron.core.transformer.enums import LayerType
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)

from megatron_xmod.xmod.config import XModConfig
from megatron_xmod.xmod.layers import SDPAttention, XModSparseLayer


def transformer_engine_available() -> bool:
    from megatron.core.extensions.transformer_engine import HAVE_TE

    return HAVE_TE


def get_layer_submodules(config: XModConfig, use_transformer_engine: bool) -> TransformerLayerSubmodules:
    """The submodules every layer (dense, sparse or MoE) is built from: megatron's own GPT layer,
    with SDPA core attention on the local path."""
    moe = dict(num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm)
    if use_transformer_engine:
        return get_gpt_layer_with_transformer_engine_submodules(qk_layernorm=config.qk_layernorm, **moe)
    submodules = get_gpt_layer_local_submodules(qk_layernorm=config.qk_layernorm, normalization=config.normalization, **moe)
    return with_sdpa_core_attention(submodules)


def with_sdpa_core_attention(submodules: TransformerLayerSubmodules) -> TransformerLayerSubmodules:
    """``submodules`` with the SDPA core attention (no parameters, so checkpoints are unchanged)."""
    attention = submodules.self_attention
    attention = dataclasses.replace(
        attention, submodules=dataclasses.replace(attention.submodules, core_attention=SDPAttention)
    )
    return dataclasses.replace(submodules, self_attention=attention)


def get_xmod_decoder_layer_specs(config: XModConfig, use_transformer_engine: bool) -> list[ModuleSpec]:
    """One layer spec per layout position; a sparse layer's routing settings are its spec params
    (data only: the routing state is attached to the built model, see :mod:`megatron_xmod.xmod.routing_state`)."""
    submodules = get_layer_submodules(config, use_transformer_engine)
    # Under context parallelism a routed layer's attention runs on its routed tokens at their real positions
    # (XModSparseLayer._context_parallel_batch), which TransformerEngine's CP attention (load-balanced chunks
    # of a whole sequence) cannot express: its core attention is SDPA's, on the same TE projections.
    sparse = submodules
    if use_transformer_engine and config.context_parallel_size > 1:
        sparse = with_sdpa_core_attention(submodules)
    specs = []
    for layer in config.layer_layout.layers:
        if layer.is_sparse:
            params = dict(routing=config.sparse_layer_routing(layer))
            specs.append(ModuleSpec(module=XModSparseLayer, params=params, submodules=sparse))
        else:
            specs.append(ModuleSpec(module=TransformerLayer, submodules=submodules))
    return specs


def resolve_use_transformer_engine(config: XModConfig, use_transformer_engine: Optional[bool]) -> bool:
    if use_transformer_engine is None:
        return transformer_engine_available() and config.transformer_impl == "transformer_engine"
    return use_transformer_engine


def get_xmod_decoder_block_spec(
    config: XModConfig,
    use_transformer_engine: Optional[bool] = None,
    vp_stage: Optional[int] = None,
    pp_rank: Optional[int] = None,
) -> TransformerBlockSubmodules:
    use_transformer_engine = resolve_use_transformer_engine(config, use_transformer_engine)
    layer_specs = get_xmod_decoder_layer_specs(config, use_transformer_engine)
    if config.pipeline_model_parallel_layout is not None:
        layer_ids = config.pipeline_model_parallel_layout.get_layer_id_list(
            layer_type=LayerType.decoder, vp_stage=vp_stage, pp_rank=pp_rank
        )
    else:
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
        layer_ids = list(range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)))
    if use_transformer_engine:
        from megatron.core.extensions.transformer_engine import TENorm

        layer_norm = TENorm
    else:
        layer_norm = LNImpl
    return TransformerBlockSubmodules(layer_specs=[layer_specs[i] for i in layer_ids], layer_norm=layer_norm)

