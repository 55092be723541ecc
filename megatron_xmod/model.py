"""Dense / MoD / X-MoD GPT models: megatron-core ``GPTModel`` with the X-MoD decoder block spec."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel

from megatron_xmod.presets import Backbone, parse_model
from megatron_xmod.xmod.block import get_xmod_decoder_block_spec
from megatron_xmod.xmod.compile import compile_layers
from megatron_xmod.xmod.config import XModConfig
from megatron_xmod.xmod.layers import XModSparseLayer
from megatron_xmod.xmod.routing_state import attach_routing_state, install_capacity_check


def config_from_backbone(backbone: Backbone, model: str = "dense", dense_prefix: int = 4, **overrides) -> XModConfig:
    """An :class:`XModConfig` for a backbone and a routed model name or layout (see ``xmod count``).

    ``overrides`` are any TransformerConfig / XModConfig fields (e.g. ``params_dtype``, ``bf16``,
    ``tensor_model_parallel_size``, ``xmod_token_choice_bias_tau``); an explicit
    ``xmod_routing_family`` re-reads a layout string as that family (e.g. a MoD layout).
    """
    description = parse_model(model, backbone, dense_prefix=dense_prefix, family=overrides.get("xmod_routing_family"))
    if description.moe is not None:
        raise ValueError(f"model: {model!r} is an MoE model; use megatron_xmod.moe.model.moe_config_from_backbone")
    layout = description.layout
    fields = dict(
        num_layers=layout.num_layers,
        hidden_size=backbone.hidden_size,
        num_attention_heads=backbone.num_attention_heads,
        num_query_groups=backbone.num_query_groups,
        kv_channels=backbone.head_dim,
        ffn_hidden_size=backbone.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        gated_linear_unit=True,  # SwiGLU
        activation_func=F.silu,
        add_bias_linear=False,
        qk_layernorm=backbone.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        xmod_routing_family=layout.family,
        xmod_layout=layout.notation,
        xmod_activated_depth=None,
    )
    fields.update(overrides)
    return XModConfig(**fields)


def build_gpt_model(
    config: XModConfig,
    vocab_size: int,
    max_sequence_length: int,
    pre_process: bool = True,
    post_process: bool = True,
    rotary_base: int = 1_000_000,
    vp_stage: Optional[int] = None,
    pg_collection=None,
    use_transformer_engine: Optional[bool] = None,
    transformer_layer_spec=None,
) -> GPTModel:
    """Untied embeddings and RoPE, as in every model of the paper. ``transformer_layer_spec``
    defaults to the X-MoD decoder block of ``config``'s layout. The built model carries its
    :class:`~megatron_xmod.xmod.routing_state.RoutingState` as ``model.routing_state``."""
    if transformer_layer_spec is None:
        transformer_layer_spec = get_xmod_decoder_block_spec(config, use_transformer_engine, vp_stage=vp_stage)
    model = GPTModel(
        config=config,
        transformer_layer_spec=transformer_layer_spec,
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        rotary_base=rotary_base,
        vp_stage=vp_stage,
        pg_collection=pg_collection,
    )
    attach_routing_state(model, eval_rule=getattr(config, "xmod_eval_routing", "threshold"),
                         eval_capacity_factor=getattr(config, "xmod_eval_capacity_factor", 0.0))
    install_capacity_check(model)
    if getattr(config, "xmod_compile_layers", False):
        compile_layers(model)
    return model


def sparse_layers(model: torch.nn.Module) -> list[XModSparseLayer]:
    return [m for m in model.modules() if isinstance(m, XModSparseLayer)]
