"""Parameter and FLOP accounting of every model the plugin builds, read from its :class:`ModelDescription`.

Conventions (the X-MoD paper's, checked against its Table 6):
- parameters: untied input and output embeddings of ``vocab_size`` rows (50257, unpadded);
- activated-equivalent parameters (Eq.4/5): a sparse layer counts 1/K of its parameters, since a
  token passes through it with probability 1/K; the router sees every token and counts fully;
  an MoE layer counts its router, its shared experts and the routed experts a token activates
  (T on average for DTop-p); the expert bias of the baselines is a buffer, not a parameter; a routed
  layer with an MoE feed-forward counts 1/K of that (its whole MoE layer runs on the routed tokens);
- forward FLOPs per token (Eq.24/25 made exact): 2 x activated non-embedding matmul parameters
  + 4 * L * (heads * head_dim) * sum over layers of (fraction routed * keys attended / L),
  attention counted at full length L (non-causal) and without the LM head; with document masks
  (--reset-attention-mask), over the token's document only: ``mean_doc_length`` M replaces L by
  min(L, M) in the attention term (M the token-weighted mean length sum(n^2) / sum(n) of the documents
  the sequences pack, which equals the plain mean when all have one length);
- at equal training compute C, tokens seen scale as 1/FLOPs (Eq.26): D/D_D = phi_D / phi.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import NamedTuple, Optional

from megatron_xmod.moe.presets import MoEModel
from megatron_xmod.presets import Backbone, ModelDescription, parse_model
from megatron_xmod.xmod.layout import Layout, LayoutLayer, parse_layout


def attention_matmul_params(b: Backbone) -> int:
    qkv = b.hidden_size * (b.attention_dim + 2 * b.num_query_groups * b.head_dim)
    return qkv + b.attention_dim * b.hidden_size


def mlp_matmul_params(b: Backbone, ffn_hidden_size: int) -> int:
    return 3 * b.hidden_size * ffn_hidden_size  # SwiGLU: fc1 (d -> 2 ffn) + fc2 (ffn -> d)


def layer_matmul_params(b: Backbone) -> int:
    return attention_matmul_params(b) + mlp_matmul_params(b, b.ffn_hidden_size)


def layer_norm_params(b: Backbone) -> int:
    return 2 * b.hidden_size + (2 * b.head_dim if b.qk_layernorm else 0)


def router_params(b: Backbone, family: str) -> int:
    """Router d->1 with bias; X-MoD adds the per-layer gate scale (varsigma), MoD has none."""
    return b.hidden_size + 1 + (1 if family == "xmod" else 0)


def embedding_params(b: Backbone) -> int:
    return 2 * b.vocab_size * b.hidden_size + b.hidden_size  # input + untied output + final norm


class LayerCount(NamedTuple):
    total: Fraction  # parameters
    active: Fraction  # activated-equivalent parameters
    active_matmul: Fraction  # matmul parameters a token passes through (x 2 = forward FLOPs)
    attention_units: Fraction  # fraction routed * fraction of keys attended


def count_layer(b: Backbone, layer: LayoutLayer, family: str, moe: Optional[MoEModel] = None) -> LayerCount:
    """One layer of a layout: dense, or routed with a token passing through it with probability
    ``routed_fraction`` (its own layer scaled so, plus its router, which scores every token); the
    feed-forward is the backbone's SwiGLU or, with ``moe``, the MoE layer (router, shared experts and
    the routed experts a token activates)."""
    norms = layer_norm_params(b)
    attention = attention_matmul_params(b)
    if moe is None:
        total = active_matmul = attention + mlp_matmul_params(b, b.ffn_hidden_size)
        extra = 0  # parameters a token uses that are no matmul (besides the norms)
    else:
        if moe.active_routed is None:
            raise ValueError(f"model: {moe.name}: a fixed-threshold Top-p model has no set number of active experts")
        expert = mlp_matmul_params(b, moe.expert_ffn_size(b.ffn_hidden_size))
        router = moe.routed_experts * b.hidden_size
        extra = 1 if moe.router_type == "dtopp" else 0  # DRN's theta_l
        active_matmul = attention + router + (Fraction(moe.active_routed) + moe.shared_experts) * expert
        total = attention + router + (moe.routed_experts + moe.shared_experts) * expert
    if not layer.is_sparse:
        return LayerCount(Fraction(total + norms + extra), active_matmul + norms + extra, Fraction(active_matmul),
                          Fraction(1))
    routed = layer.routed_fraction
    router = router_params(b, family)
    return LayerCount(Fraction(total + norms + extra + router), routed * (active_matmul + norms + extra) + router,
                      routed * active_matmul + b.hidden_size,  # every token is scored by the router
                      routed * routed)


@dataclass(frozen=True)
class ModelCount:
    backbone: str
    layout: str
    seq_len: int
    attention_len: int  # keys a token's attention spans: L, or min(L, mean document length) with document masks
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


def _sum_layers(b: Backbone, layout: Layout, moe: Optional[MoEModel]) -> LayerCount:
    layers = [count_layer(b, layer, layout.family, moe) for layer in layout.layers]
    return LayerCount(*(sum(column, Fraction(0)) for column in zip(*layers)))


def _forward_flops(b: Backbone, totals: LayerCount, seq_len: int) -> float:
    return float(2 * totals.active_matmul + 4 * seq_len * b.attention_dim * totals.attention_units)


def dense_reference(layout: Layout) -> Layout:
    """The dense model a layout is compared with: the same activated depth (phi/phi_D, D/D_D are
    only meaningful between models a token passes through equally deep)."""
    depth = layout.activated_depth
    if depth.denominator != 1:
        raise ValueError(f"layout: {layout.notation!r} activates {float(depth):g} layers per token, which no dense "
                         "model matches; make the activated depth whole (e.g. a sparse block of A*K layers of "
                         "sparsity K activates A layers)")
    return parse_layout(f"D*{int(depth)}")


def count(model: ModelDescription, seq_len: int, mean_doc_length: Optional[float] = None) -> ModelCount:
    """Parameters and FLOPs of ``model``; the dense reference is the dense model of the same
    activated depth on the same backbone (:func:`dense_reference`; NaN ratios when there is none).
    ``mean_doc_length``: attention over documents of that (token-weighted) mean length, not the whole
    sequence (document masks; see the module docstring)."""
    if seq_len < 1:
        raise ValueError(f"seq_len: must be >= 1, got {seq_len}")
    if mean_doc_length is not None and not mean_doc_length >= 1:
        raise ValueError(f"mean_doc_length: must be >= 1 token, got {mean_doc_length!r}")
    attention_len = seq_len if mean_doc_length is None else min(seq_len, round(mean_doc_length))
    b, layout, moe = model.backbone, model.layout, model.moe
    totals = _sum_layers(b, layout, moe)
    flops = _forward_flops(b, totals, attention_len)
    try:
        dense_flops = _forward_flops(b, _sum_layers(b, dense_reference(layout), None), attention_len)
    except ValueError:  # a fractional activated depth: no dense model to compare with (xmod count refuses it)
        dense_flops = float("nan")
    notation = layout.notation
    if moe is not None:
        d_e = moe.expert_ffn_size(b.ffn_hidden_size)
        experts = f"MoE {moe.active_routed:g}:{moe.routed_experts}+{moe.shared_experts} d_e={d_e} ({moe.router_type})"
        notation = experts if layout.num_sparse_layers == 0 else f"{notation} | {experts}"
    return ModelCount(
        backbone=b.name,
        layout=notation,
        seq_len=seq_len,
        attention_len=attention_len,
        num_layers=layout.num_layers,
        num_sparse_layers=layout.num_sparse_layers,
        activated_depth=float(layout.activated_depth),
        total_params=int(embedding_params(b) + totals.total),
        active_params=int(round(embedding_params(b) + totals.active)),
        flops_per_token=flops,
        dense_flops_per_token=dense_flops,
        flops_ratio_vs_dense=flops / dense_flops,
        tokens_ratio_vs_dense=dense_flops / flops,
    )


def count_model(b: Backbone, model: str | Layout, seq_len: int, dense_prefix: int = 4,
                mean_doc_length: Optional[float] = None) -> ModelCount:
    """:func:`count` of a model name or layout (see :func:`~megatron_xmod.presets.parse_model`) on ``b``."""
    if isinstance(model, Layout):
        return count(ModelDescription(model.notation, b, model), seq_len, mean_doc_length)
    return count(parse_model(model, b, dense_prefix=dense_prefix), seq_len, mean_doc_length)
