"""Backbones and named models: the one place that says which model a name describes.

Backbones are the X-MoD paper's Table 4 ("X-MoD: ..."; all use GQA, SwiGLU, RMSNorm, RoPE and
untied input/output embeddings over the GPT-2 vocabulary; 556M and 1.65B follow Qwen3-0.6B /
Qwen3-1.7B, so we keep Qwen3's QK-norm and RoPE base too). :func:`parse_model` turns a model name
(dense, mod, mod-k<K>, xmod-a<A>k<K>, a layout string, the MoE and DTop-p names) into a
:class:`ModelDescription` that the accounting, the model builders and the entry point all read.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional

from megatron_xmod.moe.presets import MoEModel, is_moe_model_name, parse_moe_model
from megatron_xmod.xmod.layout import Layout, layout_from_model_name, parse_layout

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


# A backbone file holds these fields (the preset backbones' own); required ones have no default.
BACKBONE_FILE_FIELDS = ("hidden_size", "num_attention_heads", "num_query_groups", "head_dim", "ffn_hidden_size",
                        "num_layers", "vocab_size", "rotary_base", "qk_layernorm")
_REQUIRED_FIELDS = ("hidden_size", "num_attention_heads", "ffn_hidden_size", "num_layers")


def is_backbone_file(spec: str) -> bool:
    return str(spec).lower().endswith(".json") or Path(spec).is_file()


def resolve_backbone(spec: str | Backbone) -> Backbone:
    """A preset name (165m ... 1.65b) or a JSON file with the fields of :data:`BACKBONE_FILE_FIELDS`."""
    if isinstance(spec, Backbone):
        return spec
    if is_backbone_file(spec):
        return backbone_from_file(spec)
    try:
        return get_backbone(spec)
    except ValueError:
        raise ValueError(f"backbone: {spec!r} is neither a preset ({', '.join(BACKBONES)}) nor a JSON file; "
                         f"write your model as JSON with the fields {', '.join(BACKBONE_FILE_FIELDS)}") from None


def backbone_from_file(path: str | Path) -> Backbone:
    """Read a backbone JSON file; every problem names the field: ``backbone FILE: field: why; fix``."""
    path = Path(path)
    where = f"backbone {path}"
    if not path.is_file():
        raise ValueError(f"{where}: file not found; give a preset ({', '.join(BACKBONES)}) or an existing JSON file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{where}: not valid JSON ({e}); write one object such as "
                         f"{json.dumps(backbone_to_dict(BACKBONES['165m']))}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a JSON object with the fields {', '.join(BACKBONE_FILE_FIELDS)}")
    return backbone_from_dict(data, where, default_name=path.stem)


def backbone_to_dict(b: Backbone) -> dict:
    return {f: getattr(b, f) for f in BACKBONE_FILE_FIELDS}


def backbone_from_dict(data: dict, where: str = "backbone", default_name: str = "custom") -> Backbone:
    unknown = sorted(set(data) - set(BACKBONE_FILE_FIELDS) - {"name"})
    if unknown:
        raise ValueError(f"{where}: {unknown[0]}: not a backbone field; use only {', '.join(BACKBONE_FILE_FIELDS)}")
    missing = [f for f in _REQUIRED_FIELDS if f not in data]
    if missing:
        raise ValueError(f"{where}: {missing[0]}: missing; add it (required: {', '.join(_REQUIRED_FIELDS)}; "
                         "optional: num_query_groups, head_dim, vocab_size, rotary_base, qk_layernorm)")
    values = {}
    for name in BACKBONE_FILE_FIELDS:
        if name not in data:
            continue
        value = data[name]
        if name == "qk_layernorm":
            if not isinstance(value, bool):
                raise ValueError(f"{where}: qk_layernorm: must be true or false, got {value!r}")
        elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}: {name}: must be a positive integer, got {value!r}; write it without quotes "
                             "or decimals")
        values[name] = value
    heads = values["num_attention_heads"]
    values.setdefault("num_query_groups", heads)
    if "head_dim" not in values:
        if values["hidden_size"] % heads:
            raise ValueError(f"{where}: head_dim: missing, and hidden_size {values['hidden_size']} is not divisible "
                             f"by num_attention_heads {heads}; give head_dim")
        values["head_dim"] = values["hidden_size"] // heads
    if heads % values["num_query_groups"]:
        raise ValueError(f"{where}: num_query_groups: {values['num_query_groups']} does not divide "
                         f"num_attention_heads {heads}; use a divisor of it (GQA)")
    name = data.get("name", default_name)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: name: must be a non-empty string, got {name!r}")
    default = {f.name: f.default for f in fields(Backbone) if f.name in ("vocab_size", "qk_layernorm", "rotary_base")}
    return Backbone(name=name, **{**default, **values})


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


COMBINED_SEPARATOR = "+"


def split_model_name(name: str) -> tuple[Optional[str], Optional[str]]:
    """(depth part, MoE part) of a model name: ``xmod-a4k8+moe-8x64`` -> ("xmod-a4k8", "moe-8x64"),
    ``moe-8x64`` -> (None, "moe-8x64"), ``xmod-a4k8`` -> ("xmod-a4k8", None). The MoE part follows the
    last ``+``, so a layout string with its own ``+`` takes one too (``D*4 + (S8*8 + D)*3+moe-8x64``)."""
    head, separator, tail = name.rpartition(COMBINED_SEPARATOR)
    if separator and is_moe_model_name(tail.strip()):
        depth = head.strip()
        if not depth or is_moe_model_name(depth):
            raise ValueError(f"model: {name!r}: the part before {COMBINED_SEPARATOR}{tail.strip()} must be a depth model "
                             "(dense, mod, mod-k<K>, xmod-a<A>k<K> or a layout), e.g. xmod-a4k8+moe-8x64")
        return depth, tail.strip()
    if is_moe_model_name(name):
        return None, name
    return name, None


def parse_model(name: str, backbone: Backbone, dense_prefix: int = 4, family: Optional[str] = None) -> ModelDescription:
    """``dense``, ``mod``, ``mod-k<K>``, ``xmod-a<A>k<K>``, a layout string (X-MoD unless
    ``family`` says mod), ``moe-8x64`` / ``moe-8x128``, the DTop-p / Top-p names, and a depth model
    with an MoE feed-forward, ``<depth>+<moe>`` (``xmod-a4k8+moe-8x64``, ``mod+dtopp-t6``).

    Routed names derive their layout for the backbone's activated depth (``num_layers``); an MoE
    model puts experts in every layer of its layout (the dense depth when it names no depth model).
    """
    depth, width = split_model_name(name)
    moe = None if width is None else parse_moe_model(width)
    if depth is None:
        layout = parse_layout(f"D*{backbone.num_layers}")
    else:
        layout = layout_from_model_name(depth, activated_depth=backbone.num_layers, dense_prefix=dense_prefix,
                                        family=family)
    return ModelDescription(name, backbone, layout, moe)
