"""MoE models by name, in two recipes.

X-MoD recipe: the MoE baselines of the X-MoD paper ("X-MoD: Practical Scaling Laws for
Sparse-Depth Routing Beyond Mixture-of-Depths") and DTop-p / Top-p run *under those baselines'
setup*, a recipe comparison rather than a reproduction of the DTop-p paper:

- ``moe-8x64`` / ``moe-8x128``: the X-MoD paper's "8:64" / "8:128" baselines, DeepSeekMoE style:
  6 of 64 (128) fine-grained routed experts plus 2 shared experts per token, expert FFN size
  d_e = FFN / 8 (its Table 6: 384 / 480 / 768 for 556M / 936M / 1.65B), auxiliary load-balancing
  loss together with the auxiliary-loss-free expert bias (sigmoid scores), no router z-loss, no LM
  z-loss, dropless (no capacity). Everything is megatron-core's own MoE (TopKRouter, expert bias,
  shared experts, dispatcher).
- ``dtopp-t<T>`` (``dtopp-t<T>-e<E>``): the same experts (64, or E, routed + the 2 shared ones)
  with the DTop-p router driving the mean number of routed experts to T, e.g. ``dtopp-t6`` matches
  the FLOPs of ``moe-8x64``. The DTop-p losses and gains follow the DTop-p paper's Table 6,
  including its LM z-loss 1e-4, which the X-MoD baselines do not have: against ``moe-8x64`` it
  differs in that loss as well as in the router.
- ``topp-p<P>`` (``topp-p<P>-e<E>``): fixed-threshold Top-p, the DTop-p ablation baseline, same setup.

DTop-p paper recipe: the setup of "DTop-p MoE: Sparsity-Controlled Dynamic Top-p MoE for Foundation
Model Pre-training" itself (its MoE-*-64E8A models, Tables 1 and 6), for comparing Top-k with
DTop-p as that paper does:

- ``dtopp-paper-topk8``: its Top-k baseline: top-8 of 64 experts, no shared expert, softmax
  scores with "Global 1.0" routing normalisation, load-balancing loss 1e-4, no expert bias;
- ``dtopp-paper-t8``: its DTop-p model: the same 64 experts, T = 8, DRN, PI gains 0.1 / 0.1, p_0 0.25,
  load-balancing loss 1e-4, dynamic loss 1e-3.

Both have LM z-loss 1e-4 and no router z-loss; d_e = FFN / 8 as in the X-MoD recipe.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional

SHARED_EXPERTS = 2
EXPERT_GRANULARITY = 8  # d_e = FFN / 8 reproduces every d_e of the X-MoD paper's Table 6
# Neither paper gives the X-MoD baselines' balancing strengths; these are megatron's /
# DeepSeek-V3's customary values (aux coefficient as in Qwen3-MoE), exposed as ordinary megatron fields.
BASELINE_AUX_LOSS_COEFF = 1e-3
BASELINE_BIAS_UPDATE_RATE = 1e-3
# DTop-p paper, Table 6 (the Top-p and DTop-p columns; its Top-k column has the same LB and LM z-loss).
DTOPP_LB_LOSS_COEFF = 1e-4
DTOPP_DYNAMIC_LOSS_COEFF = 1e-3
DTOPP_LM_Z_LOSS_COEFF = 1e-4

# The DTop-p paper's own setup: its 64E8A models (Table 1), MoE-1.3B-6.9B-64E8A being the main NLP model.
PAPER_ROUTED_EXPERTS = 64  # Table 1: "# Activated/Total Experts" 8/64
PAPER_ACTIVE_EXPERTS = 8  # Table 1: 8 activated; the Top-k baseline's k and DTop-p's target T
# Table 1: MoE FFN dimension 1024 for the 8192 of Dense-1.3B: d_e = FFN / 8, so 8 active experts
# cost the dense FFN. No shared experts: Table 1 lists none, and the MoE output of section 4.1
# sums over the N routed experts only.
PAPER_EXPERT_GRANULARITY = 8
PAPER_ROUTING_NORM_THETA = 1.0  # Table 6, routing normalisation of Top-k and Top-p: "Global 1.0"
PAPER_PI_GAIN = 0.1  # Table 6: K_pro = K_int = 0.1
PAPER_P0 = 0.25  # Table 6: DTop-p probability threshold init

MOE_MODEL_NAMES = ("moe-8x64", "moe-8x128", "dtopp-t<T>[-e<E>]", "topp-p<P>[-e<E>]",
                   "dtopp-paper-topk8", "dtopp-paper-t8")
_NAME = re.compile(r"^(?:moe-8x(?P<moe>\d+)|dtopp-t(?P<t>\d+(?:\.\d+)?)(?:-e(?P<de>\d+))?|"
                   r"topp-p(?P<p>0?\.\d+)(?:-e(?P<pe>\d+))?|dtopp-paper-(?P<paper>topk8|t8))$")


@dataclass(frozen=True)
class MoEModel:
    name: str
    router_type: str  # topk | dtopp | topp-fixed
    routed_experts: int
    active_routed: Optional[float]  # per token, on average for DTop-p; None for topp-fixed
    shared_experts: int = SHARED_EXPERTS
    threshold: Optional[float] = None  # topp-fixed only
    recipe: str = "xmod"  # xmod | dtopp-paper: which paper's setup the losses and balancing follow

    @property
    def granularity(self) -> int:
        return PAPER_EXPERT_GRANULARITY if self.recipe == "dtopp-paper" else EXPERT_GRANULARITY

    def expert_ffn_size(self, ffn_hidden_size: int) -> int:
        """d_e of the dense backbone with FFN size ``ffn_hidden_size``."""
        if ffn_hidden_size % self.granularity:
            raise ValueError(f"ffn_hidden_size: {ffn_hidden_size} is not divisible by the expert granularity "
                             f"{self.granularity}; use a multiple of it")
        return ffn_hidden_size // self.granularity

    def megatron_fields(self, ffn_hidden_size: int) -> dict:
        """megatron TransformerConfig MoE fields, for a dense backbone of FFN size ``ffn_hidden_size``."""
        d_e = self.expert_ffn_size(ffn_hidden_size)
        fields = dict(
            num_moe_experts=self.routed_experts,
            moe_ffn_hidden_size=d_e,
            # Megatron builds the shared experts as one MLP of the summed width: same parameters
            # and FLOPs as SHARED_EXPERTS experts of width d_e.
            moe_shared_expert_intermediate_size=self.shared_experts * d_e if self.shared_experts else None,
            moe_router_dtype="fp32",
            moe_expert_capacity_factor=None,  # dropless
            moe_z_loss_coeff=None,  # no router z-loss in either paper (DTop-p paper Table 6: 0)
        )
        if self.router_type == "topk" and self.recipe == "dtopp-paper":
            fields.update(
                moe_router_topk=int(self.active_routed),
                moe_router_load_balancing_type="aux_loss",
                moe_aux_loss_coeff=DTOPP_LB_LOSS_COEFF,  # Table 6, Top-k column: 1e-4
                moe_router_enable_expert_bias=False,  # Table 6 balances with the LB loss alone
                # P(x) = softmax(W x), weights renormalised over the top k (paper section 4.1):
                # megatron's softmax after top-k (moe_router_pre_softmax False, its default).
                moe_router_score_function="softmax",
                moe_router_pre_softmax=False,
                moe_token_dispatcher_type="alltoall",
            )
        elif self.router_type == "topk":
            fields.update(
                moe_router_topk=int(self.active_routed),
                moe_router_load_balancing_type="aux_loss",
                moe_aux_loss_coeff=BASELINE_AUX_LOSS_COEFF,
                moe_router_enable_expert_bias=True,
                moe_router_bias_update_rate=BASELINE_BIAS_UPDATE_RATE,
                # megatron's expert bias requires sigmoid (or sqrtsoftplus) scores
                moe_router_score_function="sigmoid",
                moe_token_dispatcher_type="alltoall",
            )
        else:
            fields.update(
                # used by the capacity formula only; the router picks a variable number
                moe_router_topk=max(1, math.ceil(self.active_routed or 1)),
                moe_router_load_balancing_type="aux_loss",
                moe_aux_loss_coeff=DTOPP_LB_LOSS_COEFF,
                moe_router_score_function="softmax",
                moe_token_dispatcher_type="allgather",  # dropless with a variable expert count
            )
        return fields

    def moe_fields(self) -> dict:
        """MoEConfig fields beyond megatron's."""
        paper = self.recipe == "dtopp-paper"
        if self.router_type == "topk":
            if not paper:
                return dict(moe_router_type="topk")  # the X-MoD baselines have no LM z-loss
            # DTop-p paper Table 6, Top-k column: LM z-loss 1e-4 as every model of that paper, and
            # the fixed "Global 1.0" routing normalisation (after Skywork-MoE).
            return dict(moe_router_type="topk", lm_z_loss_coeff=DTOPP_LM_Z_LOSS_COEFF, dtopp_routing_norm="fixed",
                        dtopp_routing_norm_init=PAPER_ROUTING_NORM_THETA)
        fields = dict(moe_router_type=self.router_type, dtopp_dynamic_loss_coeff=DTOPP_DYNAMIC_LOSS_COEFF,
                      lm_z_loss_coeff=DTOPP_LM_Z_LOSS_COEFF)
        if self.router_type == "dtopp":
            fields["dtopp_target_experts"] = self.active_routed
        elif self.threshold is not None:  # a Top-k preset switched to topp-fixed keeps the default p_0
            fields["dtopp_p0"] = self.threshold
        if paper:
            # Table 6: DTop-p uses layer-wise DRN (theta_l learnable; its initial value is not
            # stated, 1.0 is the baselines' fixed value), Top-p "Global 1.0"; PI gains and p_0.
            fields.update(dtopp_routing_norm="learnable" if self.router_type == "dtopp" else "fixed",
                          dtopp_routing_norm_init=PAPER_ROUTING_NORM_THETA)
            if self.router_type == "dtopp":
                fields.update(dtopp_kp=PAPER_PI_GAIN, dtopp_ki=PAPER_PI_GAIN, dtopp_p0=PAPER_P0)
        return fields


def is_moe_model_name(name: str) -> bool:
    return name.lower().startswith(("moe-", "dtopp-", "topp-"))


def parse_moe_model(name: str) -> MoEModel:
    match = _NAME.match(name.lower())
    if not match:
        raise ValueError(f"model: {name!r} is not an MoE model; use one of {', '.join(MOE_MODEL_NAMES)}")
    if match["paper"]:
        router = "topk" if match["paper"] == "topk8" else "dtopp"
        return MoEModel(name.lower(), router, PAPER_ROUTED_EXPERTS, float(PAPER_ACTIVE_EXPERTS), shared_experts=0,
                        recipe="dtopp-paper")
    if match["moe"]:
        experts = int(match["moe"])
        if experts not in (64, 128):
            raise ValueError(f"model: {name!r}: the X-MoD baselines are moe-8x64 and moe-8x128")
        return MoEModel(name.lower(), "topk", experts, 8 - SHARED_EXPERTS)
    if match["t"]:
        experts = int(match["de"] or 64)
        target = float(match["t"])
        if not 1 <= target <= experts:
            raise ValueError(f"model: {name!r}: target T must be in [1, {experts}]")
        return MoEModel(name.lower(), "dtopp", experts, target)
    threshold = float(match["p"])
    if not 0 < threshold < 1:
        raise ValueError(f"model: {name!r}: threshold must be in (0, 1)")
    return MoEModel(name.lower(), "topp-fixed", int(match["pe"] or 64), None, threshold=threshold)
