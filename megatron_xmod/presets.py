"""Backbone presets of the X-MoD paper (seed 000, Table 4).

All use GQA, SwiGLU, RMSNorm, RoPE and untied input/output embeddings over the GPT-2 vocabulary.
556M and 1.65B follow Qwen3-0.6B / Qwen3-1.7B, so we keep Qwen3's QK-norm and RoPE base too.
"""
from __future__ import annotations

from dataclasses import dataclass

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
