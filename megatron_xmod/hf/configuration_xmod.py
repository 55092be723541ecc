"""Hugging Face configuration of the models megatron_xmod trains: dense, MoD, X-MoD (any layout), the
MoE baselines and DTop-p.

This file is copied verbatim into every exported model folder, so it imports nothing but
transformers (and the standard library). The fields describe the megatron model exactly; a setting
the HF model cannot reproduce is an error here (``field: why; fix``), never a silently different
model. :func:`megatron_xmod.hf.state_dict_adapter.hf_config_from_megatron` fills it from a
megatron config.
"""
from __future__ import annotations

import math
from typing import Optional

from transformers import PretrainedConfig

ROUTING_FAMILIES = ("dense", "mod", "xmod")
LAYER_KINDS = ("dense", "sparse")
ROUTING_RULES = ("threshold", "topk")
MOE_ROUTER_TYPES = ("topk", "dtopp", "topp-fixed")
MOE_SCORE_FUNCTIONS = ("softmax", "sigmoid")
MOE_ROUTING_NORMS = ("none", "fixed", "learnable")
HIDDEN_ACTS = ("silu", "gelu")


class XModHFConfig(PretrainedConfig):
    """One decoder-only transformer (megatron's GPTModel with RoPE, RMSNorm, untied embeddings by
    default), whose layers are dense or sparse (routed, MoD Eq.6 / X-MoD Eq.7 of "X-MoD: Practical
    Scaling Laws for Sparse-Depth Routing Beyond Mixture-of-Depths"), and whose MLPs are dense or
    MoE (Top-k with optional expert bias, or Top-p as in "DTop-p MoE").

    Layout: ``layer_kinds[i]`` is "dense" or "sparse", ``layer_sparsity_k[i]`` the K of a sparse
    layer (1 for dense). A sparse layer takes the token-choice bias b of the sparse layer right
    before it (consecutive sparse layers form a block; a dense layer resets b), as megatron's
    ``RoutingState`` hands it over. ``routing_rule``: "threshold" (the causal rule
    s - tau*b >= 0, what megatron's eval mode uses, deployable token by token; the default) or
    "topk" (top L/K per sequence, for full-sequence scoring only; with ``routing_segments`` S > 1, the
    top L/(S K) of each of S equal segments, as the run trained with --xmod-routing-segments).
    """

    model_type = "megatron_xmod"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 50257,
        hidden_size: int = 512,
        intermediate_size: int = 1536,
        num_hidden_layers: int = 4,
        num_attention_heads: int = 8,
        num_key_value_heads: Optional[int] = None,
        head_dim: Optional[int] = None,
        max_position_embeddings: int = 4096,
        rms_norm_eps: float = 1e-6,
        rope_theta: float = 1_000_000.0,
        rotary_percent: float = 1.0,
        rotary_interleaved: bool = False,
        qk_layernorm: bool = True,
        hidden_act: str = "silu",
        gated_linear_unit: bool = True,
        tie_word_embeddings: bool = False,
        # --- sparse-depth routing (MoD / X-MoD) ---
        routing_family: str = "dense",
        layer_kinds: Optional[list] = None,
        layer_sparsity_k: Optional[list] = None,
        layout: Optional[str] = None,
        token_choice_bias_tau: float = 0.5,
        token_choice_bias_increment: float = 1.0,
        routing_rule: str = "threshold",
        routing_segments: int = 1,
        # --- MoE (every layer's MLP when num_experts is set) ---
        num_experts: Optional[int] = None,
        moe_intermediate_size: Optional[int] = None,
        shared_expert_intermediate_size: Optional[int] = None,
        moe_router_type: str = "topk",
        moe_router_topk: int = 2,
        moe_score_function: str = "softmax",
        moe_router_pre_softmax: bool = False,
        moe_router_topk_scaling_factor: Optional[float] = None,
        moe_expert_bias: bool = False,
        moe_routing_norm: str = "none",
        moe_routing_norm_theta: float = 1.0,
        initializer_range: float = 0.02,
        use_cache: bool = True,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        self.head_dim = hidden_size // num_attention_heads if head_dim is None else head_dim
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        self.rotary_percent = rotary_percent
        self.rotary_interleaved = rotary_interleaved
        self.qk_layernorm = qk_layernorm
        self.hidden_act = hidden_act
        self.gated_linear_unit = gated_linear_unit
        self.routing_family = routing_family
        self.layer_kinds = list(layer_kinds) if layer_kinds is not None else ["dense"] * num_hidden_layers
        self.layer_sparsity_k = (list(layer_sparsity_k) if layer_sparsity_k is not None
                                 else [1] * len(self.layer_kinds))
        self.layout = layout
        self.token_choice_bias_tau = token_choice_bias_tau
        self.token_choice_bias_increment = token_choice_bias_increment
        self.routing_rule = routing_rule
        self.routing_segments = routing_segments
        self.num_experts = num_experts
        self.moe_intermediate_size = moe_intermediate_size
        self.shared_expert_intermediate_size = shared_expert_intermediate_size
        self.moe_router_type = moe_router_type
        self.moe_router_topk = moe_router_topk
        self.moe_score_function = moe_score_function
        self.moe_router_pre_softmax = moe_router_pre_softmax
        self.moe_router_topk_scaling_factor = moe_router_topk_scaling_factor
        self.moe_expert_bias = moe_expert_bias
        self.moe_routing_norm = moe_routing_norm
        self.moe_routing_norm_theta = moe_routing_norm_theta
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
        self.validate_xmod()

    # --- derived ----------------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    def is_sparse(self, layer: int) -> bool:
        return self.layer_kinds[layer] == "sparse"

    def carries_bias(self, layer: int) -> bool:
        """A sparse layer takes the token-choice bias of the layer before it when that one is sparse too."""
        return layer > 0 and self.is_sparse(layer) and self.is_sparse(layer - 1)

    # --- validation -------------------------------------------------------------------------------
    def validate_xmod(self) -> None:
        """Refuse what the modeling code cannot run, naming the field."""
        def need(condition: bool, message: str) -> None:
            if not condition:
                raise ValueError(message)

        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            need(isinstance(value, int) and value >= 1, f"{name}: must be an integer >= 1, got {value!r}")
        need(self.num_attention_heads % self.num_key_value_heads == 0,
             f"num_key_value_heads: must divide num_attention_heads ({self.num_attention_heads}), got "
             f"{self.num_key_value_heads}; use a divisor")
        need(0 < self.rotary_percent <= 1 and int(self.head_dim * self.rotary_percent) % 2 == 0,
             f"rotary_percent: must be in (0, 1] with an even rotary dimension, got {self.rotary_percent!r}")
        need(self.hidden_act in HIDDEN_ACTS, f"hidden_act: {self.hidden_act!r} is not one of {', '.join(HIDDEN_ACTS)}")
        need(self.routing_family in ROUTING_FAMILIES,
             f"routing_family: {self.routing_family!r} is not one of {', '.join(ROUTING_FAMILIES)}")
        need(self.routing_rule in ROUTING_RULES,
             f"routing_rule: {self.routing_rule!r} is not one of {', '.join(ROUTING_RULES)}")
        need(len(self.layer_kinds) == self.num_hidden_layers,
             f"layer_kinds: needs one entry per layer ({self.num_hidden_layers}), got {len(self.layer_kinds)}")
        need(len(self.layer_sparsity_k) == self.num_hidden_layers,
             f"layer_sparsity_k: needs one entry per layer ({self.num_hidden_layers}), got {len(self.layer_sparsity_k)}")
        bad = [t for t in self.layer_kinds if t not in LAYER_KINDS]
        need(not bad, f"layer_kinds: {bad} are not {' or '.join(LAYER_KINDS)}")
        for i, (kind, k) in enumerate(zip(self.layer_kinds, self.layer_sparsity_k)):
            need(isinstance(k, int) and k >= 1, f"layer_sparsity_k: layer {i} needs an integer K >= 1, got {k!r}")
            need(kind == "sparse" or k == 1, f"layer_sparsity_k: dense layer {i} must have K = 1, got {k}")
        has_sparse = "sparse" in self.layer_kinds
        need(has_sparse == (self.routing_family != "dense"),
             f"routing_family: {self.routing_family!r} with {'some' if has_sparse else 'no'} sparse layers; a "
             "dense family has no sparse layer and a routed family (mod, xmod) has at least one")
        need(isinstance(self.routing_segments, int) and not isinstance(self.routing_segments, bool)
             and self.routing_segments >= 1,
             f"routing_segments: the segments top-k ranks a sequence in must be an integer >= 1, got "
             f"{self.routing_segments!r}")
        for name in ("token_choice_bias_tau", "token_choice_bias_increment"):
            value = getattr(self, name)
            need(isinstance(value, (int, float)) and math.isfinite(value) and value >= 0,
                 f"{name}: must be a finite number >= 0, got {value!r}")
        if not self.is_moe:
            return
        need(isinstance(self.num_experts, int) and self.num_experts >= 1,
             f"num_experts: must be an integer >= 1, got {self.num_experts!r}")
        need(isinstance(self.moe_intermediate_size, int) and self.moe_intermediate_size >= 1,
             f"moe_intermediate_size: must be an integer >= 1 for an MoE model, got {self.moe_intermediate_size!r}")
        need(self.moe_router_type in MOE_ROUTER_TYPES,
             f"moe_router_type: {self.moe_router_type!r} is not one of {', '.join(MOE_ROUTER_TYPES)}")
        need(self.moe_score_function in MOE_SCORE_FUNCTIONS,
             f"moe_score_function: {self.moe_score_function!r} is not one of {', '.join(MOE_SCORE_FUNCTIONS)}")
        need(self.moe_routing_norm in MOE_ROUTING_NORMS,
             f"moe_routing_norm: {self.moe_routing_norm!r} is not one of {', '.join(MOE_ROUTING_NORMS)}")
        need(1 <= self.moe_router_topk <= self.num_experts,
             f"moe_router_topk: must be in [1, num_experts={self.num_experts}], got {self.moe_router_topk!r}")
        if self.moe_router_type == "topk":
            need(self.moe_routing_norm != "learnable",
                 "moe_routing_norm: a learnable theta (DRN) belongs to Top-p routing; use 'fixed' or 'none'")
            need(not (self.moe_router_pre_softmax and self.moe_score_function != "softmax"),
                 "moe_router_pre_softmax: only with moe_score_function='softmax'")
        else:
            need(self.moe_score_function == "softmax",
                 f"moe_score_function: Top-p routing needs 'softmax', got {self.moe_score_function!r}")
            need(not self.moe_expert_bias, "moe_expert_bias: the expert bias is a Top-k feature; set it False")
