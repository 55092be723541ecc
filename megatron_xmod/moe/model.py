"""MoE GPT models: megatron-core ``GPTModel`` with megatron's MoE layer, the DTop-p router
plugged into ``MoESubmodules.router`` when the config asks for Top-p routing and
:class:`~megatron_xmod.moe.router.BaselineTopKRouter` (megatron's TopKRouter with the padding
guard and the baselines' fixed routing normalisation) otherwise. The MoE feed-forward goes into every
layer of the config's layout, routed (MoD / X-MoD) layers included, which run it on their routed tokens."""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from megatron_xmod.model import build_gpt_model, config_from_backbone
from megatron_xmod.moe.config import MoEConfig
from megatron_xmod.moe.presets import MOE_MODEL_NAMES, parse_moe_model
from megatron_xmod.moe.router import BaselineTopKRouter, DTopPRouter, dtopp_finalize_model_grads
from megatron_xmod.presets import Backbone, split_model_name
from megatron_xmod.xmod.block import get_layer_submodules, get_xmod_decoder_block_spec, resolve_use_transformer_engine
from megatron_xmod.xmod.config import XModConfig

_MOE_CONFIG_FIELDS = {f.name for f in dataclasses.fields(MoEConfig)} - {f.name for f in dataclasses.fields(XModConfig)}


def moe_config_from_backbone(backbone: Backbone, model: str = "moe-8x64", dense_prefix: int = 4,
                             **overrides) -> MoEConfig:
    """A :class:`MoEConfig` for a Table 4 backbone and an MoE model name (see
    :mod:`megatron_xmod.moe.presets`), or a depth model with that MoE feed-forward in every layer
    (``xmod-a4k8+moe-8x64``, see :func:`~megatron_xmod.presets.split_model_name`). ``overrides`` are
    any TransformerConfig / XModConfig / MoEConfig fields (e.g. ``moe_token_dispatcher_type``,
    ``dtopp_kp``, ``expert_model_parallel_size``)."""
    depth, width = split_model_name(model)
    if width is None:
        raise ValueError(f"model: {model!r} has no experts; name an MoE model ({', '.join(MOE_MODEL_NAMES)}) "
                         f"or add one to a depth model ({model}+moe-8x64), or use megatron_xmod.model.config_from_backbone")
    spec = parse_moe_model(width)
    fields = {**spec.megatron_fields(backbone.ffn_hidden_size), **spec.moe_fields(), **overrides}
    moe_fields = {k: fields.pop(k) for k in list(fields) if k in _MOE_CONFIG_FIELDS}
    # The backbone and the layout come from the one place that maps a backbone and a depth model to a config.
    base = config_from_backbone(backbone, depth or "dense", dense_prefix=dense_prefix, **fields)
    init_fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(XModConfig) if f.init}
    return MoEConfig(**init_fields, **moe_fields)


def get_moe_layer_spec(config: MoEConfig, use_transformer_engine: Optional[bool] = None) -> ModuleSpec:
    """megatron's GPT layer with MoE (experts, shared experts, dispatcher); the DTop-p router
    replaces TopKRouter for Top-p router types, BaselineTopKRouter for topk."""
    if config.num_moe_experts is None:
        raise ValueError("num_moe_experts: an MoE layer spec needs experts")
    submodules = get_layer_submodules(config, resolve_use_transformer_engine(config, use_transformer_engine))
    router = DTopPRouter if config.is_topp else BaselineTopKRouter
    return ModuleSpec(module=TransformerLayer, submodules=with_moe_router(submodules, router))


def with_moe_router(submodules: TransformerLayerSubmodules, router: type) -> TransformerLayerSubmodules:
    """megatron's MoE layer submodules with ``router`` in ``MoESubmodules.router``."""
    mlp = submodules.mlp
    if not (isinstance(mlp, functools.partial) and "submodules" in mlp.keywords):
        raise TypeError(f"megatron's MoE spec changed shape (got {mlp!r}); cannot plug the router")
    moe_submodules = dataclasses.replace(mlp.keywords["submodules"], router=router)
    return dataclasses.replace(
        submodules, mlp=functools.partial(mlp.func, *mlp.args, **{**mlp.keywords, "submodules": moe_submodules}))


def get_moe_decoder_block_spec(config: MoEConfig, use_transformer_engine: Optional[bool] = None,
                               vp_stage: Optional[int] = None, pp_rank: Optional[int] = None) -> TransformerBlockSubmodules:
    """The decoder block of ``config``'s layout (dense, MoD or X-MoD, sliced for the pipeline stage as
    :func:`~megatron_xmod.xmod.block.get_xmod_decoder_block_spec` does) with :func:`get_moe_layer_spec`'s
    MoE submodules in every layer: a routed layer runs megatron's MoE layer on its routed tokens."""
    block = get_xmod_decoder_block_spec(config, use_transformer_engine, vp_stage=vp_stage, pp_rank=pp_rank)
    submodules = get_moe_layer_spec(config, use_transformer_engine).submodules
    return dataclasses.replace(
        block, layer_specs=[dataclasses.replace(spec, submodules=submodules) for spec in block.layer_specs])


def build_moe_gpt_model(
    config: MoEConfig,
    vocab_size: int,
    max_sequence_length: int,
    pre_process: bool = True,
    post_process: bool = True,
    rotary_base: int = 1_000_000,
    vp_stage: Optional[int] = None,
    pg_collection=None,
    use_transformer_engine: Optional[bool] = None,
) -> GPTModel:
    """Untied embeddings and RoPE, as every model of both papers' comparisons.

    For ``moe_router_type='dtopp'`` this also sets ``config.finalize_model_grads_func`` (when
    unset) to :func:`~megatron_xmod.moe.router.dtopp_finalize_model_grads`, so megatron's
    training loop advances the PI controllers once per global batch.
    """
    if not isinstance(config, MoEConfig):
        raise ValueError("config: build_moe_gpt_model needs a MoEConfig (see moe_config_from_backbone)")
    if config.moe_router_type == "dtopp" and config.finalize_model_grads_func is None:
        config.finalize_model_grads_func = dtopp_finalize_model_grads
    return build_gpt_model(
        config, vocab_size, max_sequence_length, pre_process=pre_process, post_process=post_process,
        rotary_base=rotary_base, vp_stage=vp_stage, pg_collection=pg_collection,
        transformer_layer_spec=get_moe_decoder_block_spec(config, use_transformer_engine, vp_stage=vp_stage),
    )
