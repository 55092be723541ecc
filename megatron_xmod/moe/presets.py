"""MoE models of the X-MoD comparison (seed 000) and DTop-p models, by name.

- ``moe-8x64`` / ``moe-8x128``: the paper's "8:64" / "8:128" baselines, DeepSeekMoE style: 6 of
  64 (128) fine-grained routed experts plus 2 shared experts per token, expert FFN size
  d_e = FFN / 8 (Table 6: 384 / 480 / 768 for 556M / 936M / 1.65B), auxiliary load-balancing loss
  together with the auxiliary-loss-free expert bias, no router z-loss, dropless (no capacity).
  Everything is megatron-core's own MoE (TopKRouter, expert bias, shared experts, dispatcher).
- ``dtopp-t<T>`` (``dtopp-t<T>-e<E>``): the same experts (64, or E, routed + 2 shared) with the
  DTop-p router driving the mean number of routed experts to T, e.g. ``dtopp-t6`` matches the
  FLOPs of ``moe-8x64``. DTop-p losses and gains follow the DTop-p paper's Table 6.
- ``topp-p<P>`` (``topp-p<P>-e<E>``): fixed-threshold Top-p, the DTop-p ablation baseline.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional


SHARED_EXPERTS = 2
EXPERT_GRANULARITY = 8  # d_e = FFN / 8 reproduces every d_e of Table 6
# Neither paper gives the baselines' balancing strengths; these are megatron's / DeepSeek-V3's
# customary values (aux coefficient as in Qwen3-MoE), exposed as ordinary megatron fields.
BASELINE_AUX_LOSS_COEFF = 1e-3
BASELINE_BIAS_UPDATE_RATE = 1e-3
# DTop-p paper, Table 6.
DTOPP_LB_LOSS_COEFF = 1e-4
DTOPP_DYNAMIC_LOSS_COEFF = 1e-3
DTOPP_LM_Z_LOSS_COEFF = 1e-4

MOE_MODEL_NAMES = ("moe-8x64", "moe-8x128", "dtopp-t<T>[-e<E>]", "topp-p<P>[-e<E>]")
_NAME = re.compile(r"^(?:moe-8x(?P<moe>\d+)|dtopp-t(?P<t>\d+(?:\.\d+)?)(?:-e(?P<de>\d+))?|"
                   r"topp-p(?P<p>0?\.\d+)(?:-e(?P<pe>\d+))?)$")


@dataclass(frozen=True)
class MoEModel:
    name: str
    router_type: str  # topk | dtopp | topp-fixed
    routed_experts: int
    active_routed: Optional[float]  # per token, on average for DTop-p; None for topp-fixed
    shared_experts: int = SHARED_EXPERTS
    threshold: Optional[float] = None  # topp-fixed only

    def expert_ffn_size(self, ffn_hidden_size: int) -> int:
        """d_e of the dense backbone with FFN size ``ffn_hidden_size``."""
        if ffn_hidden_size % EXPERT_GRANULARITY:
            raise ValueError(f"ffn_hidden_size: {ffn_hidden_size} is not divisible by the expert granularity "
                             f"{EXPERT_GRANULARITY}")
        return ffn_hidden_size // EXPERT_GRANULARITY

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
            moe_z_loss_coeff=None,  # no router z-loss in either paper
        )
        if self.router_type == "topk":
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
        if self.router_type == "topk":
            return dict(moe_router_type="topk")
        fields = dict(moe_router_type=self.router_type, dtopp_dynamic_loss_coeff=DTOPP_DYNAMIC_LOSS_COEFF,
                      lm_z_loss_coeff=DTOPP_LM_Z_LOSS_COEFF)
        if self.router_type == "dtopp":
            fields["dtopp_target_experts"] = self.active_routed
        else:
            fields["dtopp_p0"] = self.threshold
        return fields


def is_moe_model_name(name: str) -> bool:
    return name.lower().startswith(("moe-", "dtopp-", "topp-"))


def parse_moe_model(name: str) -> MoEModel:
    match = _NAME.match(name.lower())
    if not match:
        raise ValueError(f"model: {name!r} is not an MoE model; use one of {', '.join(MOE_MODEL_NAMES)}")
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
