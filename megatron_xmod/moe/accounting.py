"""Parameters and FLOPs/token of the MoE models, with the conventions of
:mod:`megatron_xmod.accounting` (untied 50257-row embeddings, forward FLOPs = 2 x activated
non-embedding matmul parameters + full-length attention, no LM head).

Per layer: attention (as dense) + router (E x d, no bias) + E routed and the shared experts, each a
SwiGLU MLP of 3 d d_e parameters; DTop-p adds theta_l (DRN). The expert bias of the baselines is a
buffer, not a parameter. A token activates the router, its routed experts (T on average for
DTop-p) and the shared experts; as in the paper, all MoE models count full attention.
"""
from __future__ import annotations

from megatron_xmod.accounting import ModelCount, embedding_params, forward_flops_per_token, layer_norm_params
from megatron_xmod.layout import parse_layout
from megatron_xmod.moe.presets import MoEModel, parse_moe_model
from megatron_xmod.presets import Backbone


def attention_matmul_params(b: Backbone) -> int:
    qkv = b.hidden_size * (b.attention_dim + 2 * b.num_query_groups * b.head_dim)
    return qkv + b.attention_dim * b.hidden_size


def expert_params(b: Backbone, d_e: int) -> int:
    return 3 * b.hidden_size * d_e  # SwiGLU: fc1 (d -> 2 d_e) + fc2 (d_e -> d)


def moe_layer_params(b: Backbone, model: MoEModel) -> int:
    d_e = model.expert_ffn_size(b.ffn_hidden_size)
    router = model.routed_experts * b.hidden_size + (1 if model.router_type == "dtopp" else 0)
    experts = (model.routed_experts + model.shared_experts) * expert_params(b, d_e)
    return attention_matmul_params(b) + layer_norm_params(b) + router + experts


def moe_active_layer_params(b: Backbone, model: MoEModel) -> float:
    if model.active_routed is None:
        raise ValueError(f"model: {model.name}: a fixed-threshold Top-p model has no set number of active experts")
    d_e = model.expert_ffn_size(b.ffn_hidden_size)
    router = model.routed_experts * b.hidden_size
    return attention_matmul_params(b) + router + (model.active_routed + model.shared_experts) * expert_params(b, d_e)


def count_moe_model(b: Backbone, model: MoEModel | str, seq_len: int) -> ModelCount:
    if isinstance(model, str):
        model = parse_moe_model(model)
    if seq_len < 1:
        raise ValueError(f"seq_len: must be >= 1, got {seq_len}")
    layers = b.num_layers
    active_matmul = moe_active_layer_params(b, model)
    flops = layers * (2 * active_matmul + 4 * seq_len * b.attention_dim)
    dense_flops = forward_flops_per_token(b, parse_layout(f"D*{layers}"), seq_len)
    active_norms = layer_norm_params(b) + (1 if model.router_type == "dtopp" else 0)
    d_e = model.expert_ffn_size(b.ffn_hidden_size)
    return ModelCount(
        backbone=b.name,
        layout=f"MoE {model.active_routed:g}:{model.routed_experts}+{model.shared_experts} d_e={d_e} ({model.router_type})",
        seq_len=seq_len,
        num_layers=layers,
        num_sparse_layers=0,
        activated_depth=float(layers),
        total_params=embedding_params(b) + layers * moe_layer_params(b, model),
        active_params=int(round(embedding_params(b) + layers * (active_matmul + active_norms))),
        flops_per_token=flops,
        dense_flops_per_token=dense_flops,
        flops_ratio_vs_dense=flops / dense_flops,
        tokens_ratio_vs_dense=dense_flops / flops,
    )
