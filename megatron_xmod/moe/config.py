"""MoE and DTop-p options on top of :class:`~megatron_xmod.xmod.config.XModConfig`.

Megatron's own MoE fields (``num_moe_experts``, ``moe_router_topk``, ``moe_aux_loss_coeff``,
``moe_z_loss_coeff``, ``moe_router_enable_expert_bias``, dispatcher, capacity, ...) keep their
meaning; the fields below add what megatron does not have: the router choice, the Top-p threshold
and its PI controller, Dynamic Routing Normalisation and the dynamic (entropy) loss.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from megatron_xmod.xmod.config import XModConfig

ROUTER_TYPES = ("topk", "dtopp", "topp-fixed")
ROUTING_NORMS = ("learnable", "fixed", "none")
TOPP_DISPATCHERS = ("allgather", "alltoall")
_TOPP_LOAD_BALANCING = ("aux_loss", "none")


@dataclass
class MoEConfig(XModConfig):
    moe_router_type: str = "topk"
    """topk: megatron's TopKRouter, as BaselineTopKRouter (the X-MoD paper's 8:64 / 8:128 baselines,
    the DTop-p paper's Top-k baseline). dtopp: Top-p routing whose
    threshold follows a PI controller (DTop-p). topp-fixed: Top-p with the fixed threshold
    ``dtopp_p0`` (the ablation baseline of the DTop-p paper)."""

    dtopp_target_experts: Optional[float] = None
    """T: set-point of the PI controller, routed experts per token on average (shared experts not
    counted). Required for dtopp; may be fractional."""

    dtopp_layer_targets: Optional[Sequence[float]] = None
    """Layer-wise variant only: one target per layer (length num_layers). Default: T everywhere."""

    dtopp_layerwise: bool = False
    """One PI controller per layer, each driving its own layer to its target (paper 4.2.3), instead
    of one global threshold driving the mean over all layers."""

    dtopp_kp: float = 0.1
    """K_pro of the PI controller (paper Table 6: 0.1)."""

    dtopp_ki: float = 0.1
    """K_int of the PI controller (paper Table 6: 0.1)."""

    dtopp_p0: float = 0.25
    """p_0: initial threshold and the controller's offset (paper: 0.25). topp-fixed uses it as the
    threshold."""

    dtopp_routing_norm: Optional[str] = None
    """learnable: DRN, softmax(theta_l * (z - mu) / sigma) with a learnable theta_l per layer
    (Top-p router types only). fixed: the same normalisation with theta fixed at
    ``dtopp_routing_norm_init`` (the DTop-p paper's Top-k/Top-p baselines, 'Global 1.0'; for topk
    :class:`~megatron_xmod.moe.router.BaselineTopKRouter` applies it). none: megatron's plain
    scores of z. Default: learnable for dtopp, fixed for topp-fixed, none for topk."""

    dtopp_routing_norm_init: float = 1.0
    """Initial (or fixed) theta."""

    dtopp_dynamic_loss_coeff: float = 1e-3
    """lambda_dl of the dynamic loss, the mean routing entropy (paper Eq.13: 1e-3)."""

    lm_z_loss_coeff: float = 0.0
    """lambda_z of the LM z-loss (DTop-p paper Eq.10 and Table 6: 1e-4 for every model it trains,
    its Top-k baseline included); applied by the loss function through
    :func:`megatron_xmod.moe.losses.lm_z_loss`, not by the model."""

    def __post_init__(self):
        super().__post_init__()
        self._validate_moe()

    @property
    def is_topp(self) -> bool:
        return self.moe_router_type in ("dtopp", "topp-fixed")

    def layer_target(self, layer_number: int) -> float:
        """Set-point of the controller of (1-based, global) ``layer_number``."""
        if self.dtopp_layerwise and self.dtopp_layer_targets is not None:
            return float(self.dtopp_layer_targets[layer_number - 1])
        return float(self.dtopp_target_experts)

    def _validate_moe(self) -> None:
        if self.moe_router_type not in ROUTER_TYPES:
            raise ValueError(f"moe_router_type: {self.moe_router_type!r} is not one of {', '.join(ROUTER_TYPES)}")
        if self.dtopp_routing_norm is None:
            self.dtopp_routing_norm = {"dtopp": "learnable", "topp-fixed": "fixed"}.get(self.moe_router_type, "none")
        if self.dtopp_routing_norm not in ROUTING_NORMS:
            raise ValueError(f"dtopp_routing_norm: {self.dtopp_routing_norm!r} is not one of {', '.join(ROUTING_NORMS)}")
        if self.moe_router_type == "topk" and self.dtopp_routing_norm == "learnable":
            raise ValueError("dtopp_routing_norm: a learnable theta (DRN) is part of DTop-p, not of Top-k routing; "
                             "use 'fixed' (the DTop-p paper's Top-k baseline) or 'none'")
        for name in ("dtopp_kp", "dtopp_ki", "dtopp_dynamic_loss_coeff", "lm_z_loss_coeff"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name}: must be a finite number >= 0, got {value!r}")
        if not (0 < self.dtopp_p0 < 1):
            raise ValueError(f"dtopp_p0: the threshold lives in (0, 1), got {self.dtopp_p0!r}")
        if not (math.isfinite(self.dtopp_routing_norm_init) and self.dtopp_routing_norm_init > 0):
            raise ValueError(f"dtopp_routing_norm_init: must be > 0, got {self.dtopp_routing_norm_init!r}")
        if not self.is_topp:
            return
        experts = self.num_moe_experts
        if experts is None:
            raise ValueError(f"num_moe_experts: moe_router_type={self.moe_router_type} needs an MoE model")
        if self.moe_router_type == "dtopp":
            target = self.dtopp_target_experts
            if target is None or not (1 <= target <= experts):
                raise ValueError(f"dtopp_target_experts: must be in [1, num_moe_experts={experts}], got {target!r}")
        if self.dtopp_layer_targets is not None:
            if not self.dtopp_layerwise:
                raise ValueError("dtopp_layer_targets: only the layer-wise variant has per-layer targets; set dtopp_layerwise=True")
            if len(self.dtopp_layer_targets) != self.num_layers:
                raise ValueError(
                    f"dtopp_layer_targets: needs one target per layer ({self.num_layers}), got {len(self.dtopp_layer_targets)}")
            bad = [t for t in self.dtopp_layer_targets if not (1 <= t <= experts)]
            if bad:
                raise ValueError(f"dtopp_layer_targets: every target must be in [1, {experts}], got {bad}")
        check_topp_compatibility(self)


def check_topp_compatibility(config) -> None:
    """Reject the megatron MoE options a variable number of experts per token cannot work with.

    Top-p routes each token to a different number of experts, so every component that assumes
    ``moe_router_topk`` experts per token is ruled out here, by field name.
    """
    dispatcher = config.moe_token_dispatcher_type
    if dispatcher not in TOPP_DISPATCHERS:
        raise ValueError(
            f"moe_token_dispatcher_type: {dispatcher!r} is not supported with Top-p routing (the flex/DeepEP "
            f"dispatchers rebuild a fixed top-k index list); use one of {', '.join(TOPP_DISPATCHERS)}")
    if dispatcher == "alltoall":
        # Dropless alltoall sizes its permutation buffer as tokens * moe_router_topk; only with a
        # capacity factor does it size it from the routing map (token_dispatcher.py preprocess).
        if config.moe_expert_capacity_factor is None:
            raise ValueError(
                "moe_expert_capacity_factor: the alltoall dispatcher needs a capacity with Top-p routing (its dropless "
                "path assumes moe_router_topk experts per token); set a capacity factor (>= num_moe_experts / "
                "moe_router_topk never drops a token) or use moe_token_dispatcher_type='allgather'")
        if config.moe_pad_expert_input_to_capacity:
            raise ValueError("moe_pad_expert_input_to_capacity: padding to capacity is not supported with Top-p routing")
    if config.moe_router_enable_expert_bias:
        raise ValueError("moe_router_enable_expert_bias: the aux-loss-free expert bias is a Top-k feature; "
                         "Top-p balances experts with the load-balancing loss (moe_aux_loss_coeff)")
    if config.moe_router_score_function != "softmax":
        raise ValueError(f"moe_router_score_function: Top-p needs a probability distribution over experts; "
                         f"must be 'softmax', got {config.moe_router_score_function!r}")
    balancing = config.moe_router_load_balancing_type
    if balancing not in _TOPP_LOAD_BALANCING:
        raise ValueError(f"moe_router_load_balancing_type: {balancing!r} is not one of {', '.join(_TOPP_LOAD_BALANCING)} "
                         f"with Top-p routing")
    for name in ("moe_router_num_groups", "moe_router_group_topk", "moe_router_topk_scaling_factor"):
        if getattr(config, name) is not None:
            raise ValueError(f"{name}: not supported with Top-p routing, must be None")
    if config.moe_router_fusion:
        raise ValueError("moe_router_fusion: the fused kernels compute top-k; set moe_router_fusion=False")
    if config.moe_enable_routing_replay:
        raise ValueError("moe_enable_routing_replay: not supported with Top-p routing")
