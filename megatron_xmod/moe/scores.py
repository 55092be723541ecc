"""The expert-selection rules of the MoE routers at inference, in plain torch (no megatron import).

The megatron routers (:mod:`megatron_xmod.moe.router`) and the Hugging Face model (copied verbatim
into an exported folder as ``moe_scores.py``) both use these functions, so the rules live once:

- :func:`top_p_routing`: DTop-p / Top-p selection ("DTop-p MoE: Sparsity-Controlled Dynamic Top-p
  MoE for Foundation Model Pre-training", section 4);
- :func:`normalize_routing_logits`: its Dynamic Routing Normalisation (section 4.2.2), also the
  fixed "Global 1.0" normalisation of its Top-k / Top-p baselines;
- :func:`topk_routing`: the inference form of megatron-core's ``TopKRouter`` rule
  (``topk_routing_with_score_function``: softmax before or after the top-k, or sigmoid scores with
  the auxiliary-loss-free expert bias and renormalised weights), for the HF model, which cannot
  import megatron.
"""
from __future__ import annotations

from typing import Optional

import torch


def top_p_routing(scores: torch.Tensor, threshold: torch.Tensor | float) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-p selection on a [tokens, experts] probability matrix.

    Each token keeps the smallest prefix of its experts, sorted by probability (ties: lower expert
    index first), whose cumulative probability reaches ``threshold``; at least one expert. Returns
    the weights renormalised over the kept set and the boolean routing map.
    """
    sorted_scores, order = torch.sort(scores, dim=-1, descending=True, stable=True)
    # Mass accumulated *before* each expert (an exclusive prefix sum, not cumsum - x, so that the
    # comparison sees exactly the running sum): keep the expert while the threshold is unmet.
    cumulative = torch.cumsum(sorted_scores, dim=-1)
    mass_before = torch.cat([torch.zeros_like(cumulative[..., :1]), cumulative[..., :-1]], dim=-1)
    keep_sorted = mass_before < threshold
    keep_sorted[..., 0] = True  # p -> 0 still routes every token to its best expert
    routing_map = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    kept = scores * routing_map
    probs = kept / kept.sum(dim=-1, keepdim=True)
    return probs, routing_map


def normalize_routing_logits(logits: torch.Tensor, theta) -> torch.Tensor:
    """theta * (z - mu(z)) / sigma(z) over the experts: the DTop-p paper's Dynamic Routing
    Normalisation (section 4.2.2) with a learnable theta_l, or, with a fixed theta, the "Global 1.0"
    normalisation of its Top-k and Top-p baselines (Table 6, after Skywork-MoE)."""
    mean = logits.mean(dim=-1, keepdim=True)
    std = logits.std(dim=-1, keepdim=True, unbiased=False)
    return theta * (logits - mean) / (std + 1e-6)


def topk_routing(logits: torch.Tensor, topk: int, score_function: str = "softmax", pre_softmax: bool = False,
                 expert_bias: Optional[torch.Tensor] = None, scaling_factor: Optional[float] = None):
    """megatron's Top-k rule on fp32 [tokens, experts] logits: (weights [tokens, topk], expert indices)."""
    if score_function == "softmax":
        if pre_softmax:
            probs, indices = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), topk, dim=-1)
        else:
            top, indices = torch.topk(logits, topk, dim=-1)
            probs = torch.softmax(top, dim=-1, dtype=torch.float32)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits.float())
        if expert_bias is not None:  # the bias steers the choice only; the weights are the plain scores
            _, indices = torch.topk(scores + expert_bias.float(), topk, dim=-1)
            top = torch.gather(scores, -1, indices)
        else:
            top, indices = torch.topk(scores, topk, dim=-1)
        probs = top / (top.sum(dim=-1, keepdim=True) + 1e-20) if topk > 1 else top
    else:
        raise ValueError(f"moe_score_function: {score_function!r} is not one of softmax, sigmoid")
    if scaling_factor:
        probs = probs * scaling_factor
    return probs, indices
