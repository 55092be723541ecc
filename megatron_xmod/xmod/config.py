"""X-MoD / MoD options on top of megatron's ``TransformerConfig``: the convenient front door.

Everything that shapes the routed model is a field here; :attr:`XModConfig.layer_layout` is the
resolved layout (per-layer list and routing family) that the block spec and the accounting read,
and :meth:`XModConfig.sparse_layer_routing` fills the per-layer settings that travel in the layer
specs (so a sparse layer itself needs no more than megatron's ``TransformerConfig``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_xmod.xmod.layout import Layout, LayoutLayer, resolve_layout
from megatron_xmod.xmod.routing import SparseLayerRouting
from megatron_xmod.xmod.routing_state import check_eval_rule


@dataclass
class XModConfig(TransformerConfig):
    xmod_routing_family: str = "dense"
    """dense | mod | xmod."""

    xmod_sparsity_k: Optional[int] = None
    """K: a sparse layer processes the top 1/K of each sequence's tokens."""

    xmod_anchor_stride: Optional[float] = None
    """A: sparse updates per token between two dense anchors (A*K sparse layers a block); may be
    fractional (0.5) as long as A*K is whole. X-MoD only; default 1."""

    xmod_dense_prefix: Optional[int] = None
    """N0: dense layers before the first sparse block. X-MoD default 4 (the paper's main setting)."""

    xmod_layout: Optional[str] = None
    """Explicit layout in the notation of :mod:`megatron_xmod.xmod.layout` (overrides K/A/N0)."""

    xmod_activated_depth: Optional[int] = None
    """Activated-equivalent depth the derived layout must reach (28 for the Table 4 backbones).
    Defaults to ``num_layers`` for dense models."""

    xmod_token_choice_bias_tau: float = 0.5
    """tau of Eq.(8). The paper gives no value. b counts a token's selections in the current block
    (increment 1), so tau is in logit units per prior selection: 0.5 moves a token sitting just
    above the 0.5 threshold back onto it after one selection (enough to hand ties to tokens not yet
    refined), while a confidently routed token (|s| >~ 2) stays routed: it discourages repeats
    without forcing uniform routing, which is what the paper asks of it."""

    xmod_token_choice_bias_tau_warmup: int = 0
    """Training iterations over which tau ramps linearly from 0 to its value (0: tau from the first
    step). Read from the routing state's iteration, which our entry point sets before each step;
    evaluation of a trained model uses the full tau. See docs/routing.md (the tau study)."""

    xmod_token_choice_bias_increment: float = 1.0
    """Added to b_i each time token i is selected (Eq.8). 1 makes b a selection count; only
    tau * increment matters, so tune tau and keep this at 1."""

    xmod_router_bce_coeff: float = 1e-4
    """Coefficient of the router BCE loss (Eq.9); the paper's sweep chose 1e-4."""

    xmod_gate_scale_init: float = 1.0
    """Initial value of the learnable per-layer gate scale varsigma (Eq.7). 1 keeps the sparse layer
    an ordinary residual layer gated by r at initialisation; megatron's output-layer init already
    scales each branch by the physical depth."""

    xmod_gate_scale_learnable: bool = True
    """False keeps varsigma fixed at its initial value (the paper's "w/o gated residual scaling"
    ablation, Table 3: varsigma = 1, not learned); the parameter stays in the checkpoint."""

    xmod_routing_segments: int = 1
    """S: training top-k ranks each of S equal, contiguous segments of a sequence and routes L/(S K) tokens
    of each (1: the whole sequence, the papers' rule; k = L/K a sequence either way). With context
    parallelism C, S a multiple of 2C puts exactly k/C routed tokens on every CP rank: a routed layer then
    moves 1/K of a dense layer's CP bytes and holds 1/C of the routed activations, against C/K and
    min(k, L/C) rows with S = 1 (docs/routing.md, "Routing segments"). The threshold rule is per token
    and does not see S."""

    xmod_eval_routing: str = "threshold"
    """Routing rule in eval mode when the model is built: threshold (deployable, causal) or topk (for
    comparison). The built model keeps it in its routing state (``routing_state.set_eval_routing``)."""

    xmod_eval_capacity_factor: float = 0.0
    """> 0: threshold-rule evaluation at static shapes: a sparse layer batches each sequence's selection at
    max(this x L/K, 1.25 x its widest selection in the previous pass) tokens, and the decoder reads once
    per forward pass whether a sequence selected more (then the pass runs again at exact widths); the
    results equal exact widths up to the rounding of the padded shapes. 0 (default): each sparse layer
    reads its exact width from the device (one host sync per layer); parallel layouts agree to 1e-5."""

    xmod_compile_layers: bool = False
    """True: every dense layer's forward and every routed layer's update (token gather, attention and MLP,
    gated scatter) run as one ``torch.compile`` region each (static shapes, no graph break), forward and
    backward; the router and routing step stay eager. Layers of one kind and shape share one compiled
    graph, so start-up pays a few compilations, not one per layer (megatron_xmod.xmod.compile)."""

    layer_layout: Optional[Layout] = field(default=None, init=False, repr=False)

    def __post_init__(self):
        if self.xmod_routing_family != "dense":  # before megatron's own CUDA-graph asserts, with the reason
            check_cuda_graph_compatibility(self, self.xmod_token_choice_bias_tau_warmup)
        super().__post_init__()
        self._validate_xmod()

    def _validate_xmod(self) -> None:
        family = self.xmod_routing_family
        activated = self.xmod_activated_depth
        if activated is None and family == "dense":
            activated = self.num_layers
        self.layer_layout = resolve_layout(
            family,
            num_layers=self.num_layers,
            sparsity_k=self.xmod_sparsity_k,
            anchor_stride=self.xmod_anchor_stride,
            dense_prefix=self.xmod_dense_prefix,
            layout=self.xmod_layout,
            activated_depth=activated,
        )
        check_eval_rule(self.xmod_eval_routing)
        if self.xmod_compile_layers:
            check_compile_compatibility(self)
        factor = self.xmod_eval_capacity_factor
        if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor >= 0):
            raise ValueError(f"xmod_eval_capacity_factor: must be a finite number >= 0 (0: exact widths, one host sync "
                             f"per sparse layer), got {factor!r}")
        if family == "mod" and self.xmod_anchor_stride is not None:
            raise ValueError("xmod_anchor_stride: MoD has no anchor stride (it alternates sparse and dense)")
        if self.layer_layout.num_sparse_layers == 0:
            return
        # Validates tau, increment, BCE coefficient and gate init, naming the xmod_* field.
        self.sparse_layer_routing(next(layer for layer in self.layer_layout.layers if layer.is_sparse))
        # Sparse layers carry router/gate parameters that dense layers lack, so the checkpoint
        # cannot stack "layers.*" into one tensor per name: save them layer by layer.
        self.hetereogenous_dist_checkpoint = True
        check_routing_compatibility(self, self.xmod_token_choice_bias_tau)

    def sparse_layer_routing(self, layer: LayoutLayer) -> SparseLayerRouting:
        """The spec params of the sparse layer at ``layer`` of this config's layout."""
        return SparseLayerRouting.at(
            layer, self.layer_layout.family, token_choice_bias_tau=self.xmod_token_choice_bias_tau,
            token_choice_bias_increment=self.xmod_token_choice_bias_increment,
            router_bce_coeff=self.xmod_router_bce_coeff, gate_scale_init=self.xmod_gate_scale_init,
            gate_scale_learnable=self.xmod_gate_scale_learnable,
            token_choice_bias_tau_warmup=self.xmod_token_choice_bias_tau_warmup,
            routing_segments=self.xmod_routing_segments,
        )


_GRAPH_NOTE: set = set()


def check_cuda_graph_compatibility(config, token_choice_bias_tau_warmup: int = 0) -> None:
    """megatron's per-layer CUDA graphs (``--cuda-graph-impl local|transformer_engine``) with routed
    layers: refuse, by field name, what a captured routed layer cannot replay. Training (top-k routing)
    is captured; evaluation (the threshold rule selects a data-dependent number of tokens) runs eagerly.
    See docs/routing.md, "Routing state"."""
    impl = getattr(config, "cuda_graph_impl", "none") or "none"
    if impl == "none":
        return
    fix = f"or drop --cuda-graph-impl {impl}"
    if impl == "full_iteration":
        raise ValueError("cuda_graph_impl: full_iteration captures the forward step too, whose non-finite router-logit "
                         "check and routing statistics are read on the host; use --cuda-graph-impl local or "
                         "transformer_engine (per-layer graphs)")
    if getattr(config, "recompute_granularity", None) == "full":
        raise ValueError("recompute_granularity: full activation recompute and per-layer CUDA graphs do not combine "
                         "(megatron refuses them; a routed layer's recompute replays its token-choice bias from a "
                         f"Python queue); use --recompute-granularity selective or none, {fix}")
    modules = getattr(config, "cuda_graph_modules", None) or []
    modules = [modules] if isinstance(modules, str) else list(modules)
    if any(str(getattr(module, "name", module)).lower() != "full" for module in modules):  # "full": the whole layer
        raise ValueError("cuda_graph_modules: a routed layer is captured whole (its attention and MLP run on the "
                         "routed tokens only, between the router and the gated scatter); leave --cuda-graph-modules "
                         f"empty (the whole layer), {fix}")
    if getattr(config, "sequence_parallel", False):
        raise ValueError("sequence_parallel: the sequence-parallel routed update has data-dependent shapes (the routed "
                         f"tokens each rank holds), which a CUDA graph cannot replay; drop --sequence-parallel, {fix}")
    if getattr(config, "fp16", False):
        raise ValueError("fp16: the router loss's backward reads megatron's dynamic loss scale, which changes between "
                         f"iterations outside the graph; use --bf16, {fix}")
    if token_choice_bias_tau_warmup:
        raise ValueError("xmod_token_choice_bias_tau_warmup: the warm-up changes tau every iteration and a captured "
                         "layer replays the tau it was captured with; set --xmod-token-choice-bias-tau-warmup 0, "
                         f"{fix}")
    if impl not in _GRAPH_NOTE:
        _GRAPH_NOTE.add(impl)
        print(f"[xmod] --cuda-graph-impl {impl}: routed layers are captured for training (top-k routing); "
              "evaluation runs them eagerly (the threshold rule routes a data-dependent number of tokens)", flush=True)


def check_compile_compatibility(config) -> None:
    """``--xmod-compile-layers`` (``xmod_compile_layers``) with ``config``: refuse, by field name, what a compiled
    layer region does not run today, before anything is built."""
    fix = "or drop --xmod-compile-layers"
    refused = [
        (getattr(config, "tensor_model_parallel_size", 1) > 1, "tensor_model_parallel_size",
         "a compiled region would trace megatron's tensor-parallel collectives, which it has not been validated with",
         "use --tensor-model-parallel-size 1"),
        (getattr(config, "context_parallel_size", 1) > 1, "context_parallel_size",
         "the context-parallel routed update builds a per-rank batch and mask the region does not cover",
         "use --context-parallel-size 1"),
        ((getattr(config, "cuda_graph_impl", "none") or "none") != "none", "cuda_graph_impl",
         "a CUDA graph captures the eager layer; the two are alternatives", "drop --cuda-graph-impl"),
        (getattr(config, "recompute_granularity", None) is not None, "recompute_granularity",
         "activation recompute replays the layer outside the compiled graph", "drop --recompute-granularity"),
        (bool(getattr(config, "num_moe_experts", None)), "num_moe_experts",
         "megatron's MoE token dispatch has data-dependent shapes", "use a dense feed-forward"),
        (getattr(config, "gradient_accumulation_fusion", False), "gradient_accumulation_fusion",
         "its weight-gradient kernel writes main_grad inside backward, outside what the graph can trace",
         "pass --no-gradient-accumulation-fusion"),
    ]
    for bad, name, why, how in refused:
        if bad:
            raise ValueError(f"{name}: --xmod-compile-layers: {why}; {how}, {fix}")


def check_routing_compatibility(config: TransformerConfig, token_choice_bias_tau: float) -> None:
    """Reject the megatron options a routed layer cannot run with, by field name; any
    ``TransformerConfig`` (a sparse layer checks the config it is built with)."""
    # Sequence and context parallelism are supported: the layer gathers the L router scores across the TP
    # and CP ranks, and under CP all-gathers only its routed tokens' keys and values in its own SDPA core
    # attention (layers.py), whatever --cp-comm-type the dense layers' TransformerEngine attention uses.
    if config.apply_rope_fusion:
        raise ValueError(
            "apply_rope_fusion: routed layers apply RoPE at per-sequence gathered positions, which the "
            "fused kernel does not support; set apply_rope_fusion=False (--no-rope-fusion)"
        )
    # A megatron MoELayer feed-forward (num_moe_experts) is supported: a routed layer hands it only its
    # routed subsequence, so the MoE router, its losses and the expert-bias loads see only routed tokens.
    if config.num_moe_experts is not None and getattr(config, "moe_layer_freq", 1) != 1:
        raise ValueError(f"moe_layer_freq: a routed layout with experts has megatron's MoE feed-forward in every layer, "
                         f"got {config.moe_layer_freq!r}; leave --moe-layer-freq at 1")
