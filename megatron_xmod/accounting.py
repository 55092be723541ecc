"""Parameter and FLOP accounting for Dense / MoD / X-MoD models, read from the per-layer layout.

Conventions (the paper's, checked against Table 6 of seed 000):
- parameters: untied input and output embeddings of ``vocab_size`` rows (50257, unpadded);
- activated-equivalent parameters (Eq.4/5): a sparse layer counts 1/K of its parameters, since a
  token passes through it with probability 1/K; the router sees every token and counts fully;
- forward FLOPs per token (Eq.24/25 made exact): 2 x activated non-embedding matmul parameters
  + 4 * L * (heads * head_dim) * sum over layers of (fraction routed * keys attended / L),
  attention counted at full length L (non-causal) and without the LM head;
- at equal training compute C, tokens seen scale as 1/FLOPs (Eq.26): D/D_D = phi_D / phi.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from fractions import Fraction

from megatron_xmod.layout import Layout, LayerSpec, parse_layout
from megatron_xmod.presets import Backbone


def layer_matmul_params(b: Backbone) -> int:
    qkv = b.hidden_size * (b.attention_dim + 2 * b.num_query_groups * b.head_dim)
    proj = b.attention_dim * b.hidden_size
    swiglu_fc1 = b.hidden_size * 2 * b.ffn_hidden_size
    fc2 = b.ffn_hidden_size * b.hidden_size
    return qkv + proj + swiglu_fc1 + fc2


def layer_norm_params(b: Backbone) -> int:
    return 2 * b.hidden_size + (2 * b.head_dim if b.qk_layernorm else 0)


def router_params(b: Backbone, family: str) -> int:
    """Router d->1 with bias; X-MoD adds the per-layer gate scale (varsigma)."""
    return b.hidden_size + 1 + (1 if family == "xmod" else 0)


def layer_params(b: Backbone, spec: LayerSpec, family: str = "xmod") -> int:
    return layer_matmul_params(b) + layer_norm_params(b) + (router_params(b, family) if spec.is_sparse else 0)


def embedding_params(b: Backbone) -> int:
    return 2 * b.vocab_size * b.hidden_size + b.hidden_size  # input + untied output + final norm


def _family(layout: Layout, family: str | None) -> str:
    if family:
        return family
    return "xmod" if layout.num_sparse_layers else "dense"


@dataclass(frozen=True)
class ModelCount:
    backbone: str
    layout: str
    seq_len: int
    num_layers: int
    num_sparse_layers: int
    activated_depth: float
    total_params: int
    active_params: int
    flops_per_token: float
    dense_flops_per_token: float
    flops_ratio_vs_dense: float
    tokens_ratio_vs_dense: float  # D / D_D at equal training compute

    def to_dict(self) -> dict:
        return asdict(self)


def forward_flops_per_token(b: Backbone, layout: Layout, seq_len: int) -> float:
    matmul = layer_matmul_params(b)
    activated_matmul = Fraction(0)
    attention_units = Fraction(0)  # sum of routed fraction * (keys attended / L)
    for spec in layout.layers:
        activated_matmul += spec.routed_fraction * matmul
        if spec.is_sparse:
            activated_matmul += b.hidden_size  # every token is scored by the router
        attention_units += spec.routed_fraction * spec.routed_fraction
    return float(2 * activated_matmul + 4 * seq_len * b.attention_dim * attention_units)


def count_model(b: Backbone, layout: Layout | str, seq_len: int, family: str | None = None) -> ModelCount:
    if isinstance(layout, str):
        layout = parse_layout(layout)
    if seq_len < 1:
        raise ValueError(f"seq_len: must be >= 1, got {seq_len}")
    family = _family(layout, family)
    total = embedding_params(b) + sum(layer_params(b, s, family) for s in layout.layers)
    active = embedding_params(b) + sum(
        spec.routed_fraction * (layer_matmul_params(b) + layer_norm_params(b))
        + (router_params(b, family) if spec.is_sparse else 0)
        for spec in layout.layers
    )
    flops = forward_flops_per_token(b, layout, seq_len)
    dense_flops = forward_flops_per_token(b, parse_layout(f"D*{b.num_layers}"), seq_len)
    return ModelCount(
        backbone=b.name,
        layout=layout.notation,
        seq_len=seq_len,
        num_layers=layout.num_layers,
        num_sparse_layers=layout.num_sparse_layers,
        activated_depth=float(layout.activated_depth),
        total_params=int(total),
        active_params=int(round(active)),
        flops_per_token=flops,
        dense_flops_per_token=dense_flops,
        flops_ratio_vs_dense=flops / dense_flops,
        tokens_ratio_vs_dense=dense_flops / flops,
    )
