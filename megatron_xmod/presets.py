"""Backbones and named models: the one place that says which model a name describes.

Backbones are the X-MoD paper's Table 4 ("X-MoD: ..."; all use GQA, SwiGLU, RMSNorm, RoPE and
untied input/output embeddings over the GPT-2 vocabulary; 556M and 1.65B follow Qwen3-0.6B /
Qwen3-1.7B, so we keep Qwen3's QK-norm and RoPE base too). :func:`parse_model` turns a model name
(dense, mod, mod-k<K>, xmod-a<A>k<K>, a layout string, the MoE and DTop-p names) into a
:class:`ModelDescription` that the accounting, the model builders and the entry point all read.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_xmod.layout import Layout, layout_from_model_name, parse_layout
from megatron_xmod.moe.presets import MoEModel, is_moe_model_name, parse_moe_model

GPT2_VOCAB_SIZE = 50257


@dataclass(frozen=True)
class Backbone:
    name: str
    hidden_size: int
    head_dim: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    num_layers: int = 28  # the activated depth every routed model is matched to
    vocab_size: int = GPT2_VOCAB_SIZE
    qk_layernorm: bool = True
    rotary_base: int = 1_000_000

    @property
    def attention_dim(self) -> int:
        return self.num_attention_heads * self.head_dim


BACKBONES = {
    b.name: b
    for b in (
        Backbone("165m", 512, 64, 16, 8, 1536),
        Backbone("298m", 768, 64, 16, 8, 2304),
        Backbone("556m", 1024, 128, 16, 8, 3072),
        Backbone("936m", 1536, 128, 16, 8, 3840),
        Backbone("1.65b", 2048, 128, 16, 8, 6144),
    )
}
_ALIASES = {"1p65b": "1.65b", "1650m": "1.65b"}


def get_backbone(name: str) -> Backbone:
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in BACKBONES:
        raise ValueError(f"backbone: {name!r} is not one of {', '.join(BACKBONES)}")
    return BACKBONES[key]


def backbone_flags(b: Backbone) -> list[str]:
    """megatron's own architecture flags for a backbone."""
    flags = ["--hidden-size", str(b.hidden_size), "--ffn-hidden-size", str(b.ffn_hidden_size),
             "--num-attention-heads", str(b.num_attention_heads), "--group-query-attention",
             "--num-query-groups", str(b.num_query_groups), "--kv-channels", str(b.head_dim),
             "--swiglu", "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--disable-bias-linear",
             "--position-embedding-type", "rope", "--rotary-base", str(b.rotary_base),
             "--untie-embeddings-and-output-weights", "--no-rope-fusion"]
    return flags + (["--qk-layernorm"] if b.qk_layernorm else [])


@dataclass(frozen=True)
class ModelDescription:
    """A model on a backbone: its per-layer layout (with the routing family) and, for MoE models,
    the expert setup of every layer."""

    name: str
    backbone: Backbone
    layout: Layout
    moe: Optional[MoEModel] = None

    @property
    def family(self) -> str:
        return self.layout.family


def parse_model(name: str, backbone: Backbone, dense_prefix: int = 4, family: Optional[str] = None) -> ModelDescription:
    """``dense``, ``mod``, ``mod-k<K>``, ``xmod-a<A>k<K>``, a layout string (X-MoD unless
    ``family`` says mod), ``moe-8x64`` / ``moe-8x128`` and the DTop-p / Top-p names.

    Routed names derive their layout for the backbone's activated depth (``num_layers``); an MoE
    model puts experts in every one of those layers.
    """
    if is_moe_model_name(name):
        moe = parse_moe_model(name)
        return ModelDescription(name, backbone, parse_layout(f"D*{backbone.num_layers}"), moe)
    layout = layout_from_model_name(name, activated_depth=backbone.num_layers, dense_prefix=dense_prefix, family=family)
    return ModelDescription(name, backbone, layout)
