"""The routing rules of MoD / X-MoD, in one place, in plain torch (the X-MoD paper, Eq.(6)-(9)).

Reused by the megatron layers, the diagnostics and the tests. Shapes follow
megatron: scores are ``[s, b]`` (sequence first).

- training: per-sequence top-k with k = L/K exactly; indices sorted by position so that causal
  attention among the routed tokens stays causal (Raposo et al.; X-MoD keeps this). With S routing
  segments the top L/(S K) of each of S equal, contiguous segments instead (k stays L/K): what lets
  context parallelism give every rank exactly k/C routed tokens (docs/routing.md, section 9);
- evaluation: the causal threshold rule sigma(s - tau*b) >= 0.5, i.e. s - tau*b >= 0, which
  depends on nothing but the token's own state (deployable autoregressively);
- token-choice bias b (Eq.8): carried across the consecutive sparse layers of a block, raised by
  ``increment`` whenever a token is selected, reset at the dense anchor;
- router BCE (Eq.9) between the threshold prediction and the top-k choice;
- the gated residual update of the routed tokens: MoD's Eq.(6) and X-MoD's Eq.(7).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

SPARSE_FAMILIES = ("mod", "xmod")
EVAL_ROUTING_RULES = ("threshold", "topk")


@dataclass(frozen=True)
class SparseLayerRouting:
    """Everything that shapes one sparse layer's routing: plain data that travels in its layer spec,
    so that the layer also builds inside a model whose config is megatron's ``TransformerConfig``.
    ``XModConfig.sparse_layer_routing`` fills it from the config fields of the same names."""

    family: str  # mod: x + a + r*f (Eq.6); xmod: x + varsigma*r*(a + f) (Eq.7)
    sparsity_k: int  # the layer processes the top L/K tokens of each sequence
    token_choice_bias_tau: float = 0.5
    token_choice_bias_increment: float = 1.0
    router_bce_coeff: float = 1e-4
    gate_scale_init: float = 1.0
    gate_scale_learnable: bool = True  # False: varsigma stays at gate_scale_init (Table 3 ablation, fixed 1)
    token_choice_bias_tau_warmup: int = 0  # iterations over which tau ramps linearly from 0 (0: no warm-up)
    routing_segments: int = 1  # top-k per sequence (1) or per each of S equal segments of it (select_topk)
    block: int = 0  # sparse block of the layout
    index_in_block: int = 0  # position among the block's sparse layers (0: b starts at 0)

    @classmethod
    def at(cls, layer, family: str, **settings) -> SparseLayerRouting:
        """The settings of the sparse layout position ``layer`` (a ``layout.LayoutLayer``): its K and
        block position, plus the ``settings`` every sparse layer of the model shares."""
        return cls(family=family, sparsity_k=layer.sparsity_k, block=layer.block,
                   index_in_block=layer.index_in_block, **settings)

    def effective_tau(self, iteration: Optional[int]) -> float:
        """tau at training ``iteration`` under the warm-up (:func:`tau_at`); the full tau for None."""
        return tau_at(self.token_choice_bias_tau, self.token_choice_bias_tau_warmup, iteration)

    def __post_init__(self):
        if self.family not in SPARSE_FAMILIES:
            raise ValueError(f"routing_family: sparse layers are {' or '.join(SPARSE_FAMILIES)}, got {self.family!r}")
        # K = 1 (every token routed) is the dense limit case; a layout writes it as D.
        if not (isinstance(self.sparsity_k, int) and self.sparsity_k >= 1):
            raise ValueError(f"sparsity_k: a sparse layer needs an integer K >= 1, got {self.sparsity_k!r}")
        for name in ("token_choice_bias_tau", "token_choice_bias_increment", "router_bce_coeff"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"xmod_{name}: must be a finite number >= 0, got {value!r}")
        check_routing_segments(self.routing_segments)
        warmup = self.token_choice_bias_tau_warmup
        if not (isinstance(warmup, int) and warmup >= 0):
            raise ValueError(f"xmod_token_choice_bias_tau_warmup: must be an integer number of iterations >= 0, got {warmup!r}")
        if not (math.isfinite(self.gate_scale_init) and self.gate_scale_init > 0):
            raise ValueError(
                f"xmod_gate_scale_init: must be > 0 (0 would cut the gradient of the router and of the "
                f"layer), got {self.gate_scale_init!r}"
            )


def tau_at(tau: float, warmup: int, iteration: Optional[int]) -> float:
    """The token-choice bias scale at training ``iteration``: tau * min(1, iteration / warmup).

    ``iteration`` None means a trained model (evaluation, diagnostics, export): the full tau. The
    warm-up starts from 0 so that the first steps rank tokens by the router alone; see docs/routing.md.
    """
    if warmup <= 0 or iteration is None:
        return tau
    return tau * min(1.0, max(0, iteration) / warmup)


def adjusted_logits(logits: torch.Tensor, token_choice_bias: Optional[torch.Tensor], tau: float) -> torch.Tensor:
    """s - tau * b (Eq.8, inside the sigmoid). ``token_choice_bias`` None means b = 0."""
    if token_choice_bias is None or tau == 0:
        return logits
    return logits - tau * token_choice_bias


def check_routing_segments(segments) -> int:
    if not (isinstance(segments, int) and not isinstance(segments, bool) and segments >= 1):
        raise ValueError(f"xmod_routing_segments: the number of segments each sequence's top-k is taken over must be "
                         f"an integer >= 1 (1: the whole sequence), got {segments!r}")
    return segments


def topk_count(seq_len: int, sparsity_k: int, segments: int = 1) -> int:
    """k = L/K exactly: the training capacity is a whole fraction of the sequence (with S routing
    segments, of each segment: L/(S K) a segment, still L/K a sequence)."""
    if seq_len % (sparsity_k * segments):
        per = (f"routing segments x sparsity K = {segments} x {sparsity_k}" if segments > 1
               else f"sparsity K ({sparsity_k})")
        raise ValueError(
            f"seq_length: top-k routing needs the sequence length ({seq_len}) to be divisible by "
            f"{per} so that exactly L/K tokens are routed; change the sequence length"
            + (" or the routing segments (--xmod-routing-segments; HF: routing_segments)" if segments > 1 else "")
        )
    return seq_len // sparsity_k


def select_topk(scores: torch.Tensor, sparsity_k: int, segments: int = 1) -> torch.Tensor:
    """Indices ``[k, b]`` of the top L/K scores of each sequence, sorted by position; with ``segments``
    S > 1, the top L/(S K) of each of the S contiguous segments of L/S positions (segment-local top-k:
    any S consecutive L/S-token windows route the same number of tokens)."""
    seq_len, batch = scores.shape
    k = topk_count(seq_len, sparsity_k, segments)
    if segments == 1:
        indices = torch.topk(scores.detach(), k, dim=0, sorted=False).indices
        return torch.sort(indices, dim=0).values
    span = seq_len // segments
    indices = torch.topk(scores.detach().reshape(segments, span, batch), k // segments, dim=1, sorted=False).indices
    starts = torch.arange(0, seq_len, span, device=scores.device).view(segments, 1, 1)
    return (torch.sort(indices, dim=1).values + starts).reshape(k, batch)


def context_parallel_width(routed: int, seq_len: int, cp_size: int, segments: int = 1) -> int:
    """The static number of a sequence's ``routed`` tokens that one CP rank may hold (the width of its
    routed batch, XModSparseLayer._context_parallel_batch): under top-k over the whole sequence any
    number up to min(k, L/C); under segment-local top-k whose segments megatron's 2C load-balanced
    chunks hold whole (S a multiple of 2C), exactly k/C, since each rank holds S/C segments of k/S."""
    if segments > 1 and segments % (2 * cp_size) == 0:
        return routed // cp_size
    return min(routed, seq_len // cp_size)


def select_threshold(scores: torch.Tensor) -> torch.Tensor:
    """Boolean mask ``[s, b]``: sigmoid(score) >= 0.5."""
    return scores.detach() >= 0


def indices_to_mask(indices: torch.Tensor, seq_len: int) -> torch.Tensor:
    mask = torch.zeros(seq_len, indices.shape[1], dtype=torch.bool, device=indices.device)
    return mask.scatter_(0, indices, True)


def eval_capacity(seq_len: int, tokens: float) -> int:
    """A static width of a threshold-routed batch for about ``tokens`` tokens a sequence: rounded up to a
    multiple of 8 (matmul-friendly shapes), at least 1, at most L (see RoutingState.eval_capacity)."""
    return max(1, min(seq_len, -(-math.ceil(tokens) // 8) * 8))


def capacity_selection(selected: torch.Tensor, capacity: Optional[int] = None):
    """Batch the threshold rule's variable per-sequence selection ``[s, b]`` into ``[C, b]``:
    ``(indices, valid, width)``.

    Column j lists its selected positions in ascending order, then its earliest unselected positions
    as padding (``valid`` False). Real tokens come first, so plain causal attention among the batch
    keeps them causal and away from the padding on every attention backend, without a mask; the
    caller gives the padding a zero gate. The indices are unique per column but not sorted past the
    real tokens: they go through the plain-torch permutation.

    ``width`` is the largest selection of any column. ``capacity`` None: C = width, read by the host
    (an int; one sync), and ``(None, None, 0)`` when nothing is selected. ``capacity`` C: a static shape
    and no sync; ``width`` stays a 0-d device tensor, and a column that selected more than C tokens
    lost those past C (the caller must then route again without a capacity).
    """
    seq_len = selected.shape[0]
    width = selected.sum(0).max()
    if capacity is None:
        capacity = width = int(width)
        if width == 0:
            return None, None, 0
    positions = torch.arange(seq_len, device=selected.device).unsqueeze(1)
    selected_first = torch.where(selected, positions, positions + seq_len)
    # the C smallest keys of each column, in ascending order: selected positions, then padding
    keys = torch.topk(selected_first, capacity, dim=0, largest=False, sorted=True).values
    return keys % seq_len, keys < seq_len, width


def update_token_choice_bias(
    token_choice_bias: Optional[torch.Tensor], selected: torch.Tensor, increment: float,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """b_i += increment for every selected token (Eq.8). ``out``: a float32 buffer to write the new b
    into (it may be ``token_choice_bias`` itself), one op either way."""
    if out is not None:
        if token_choice_bias is None:
            return torch.mul(selected, increment, out=out)
        return torch.add(token_choice_bias, selected, alpha=increment, out=out)
    step = selected.to(torch.float32) * increment
    return step if token_choice_bias is None else token_choice_bias + step


def router_bce_loss(scores: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    """Eq.(9): BCE between p = sigmoid(score) and the top-k choice q, averaged over all tokens.

    ``scores`` are the bias-adjusted logits: the threshold rule used at evaluation thresholds
    exactly these, so this is the prediction that must agree with top-k (with tau = 0 it is
    Eq.(9) verbatim, p_i = sigmoid(s_i)).
    """
    return F.binary_cross_entropy_with_logits(scores.float(), selected.to(torch.float32))


def gated_residual(family: str, attention: torch.Tensor, mlp: torch.Tensor, r: torch.Tensor,
                   gate_scale: Optional[torch.Tensor] = None, keep: Optional[torch.Tensor] = None):
    """The update of the routed tokens as ``(delta, gate)``, applied as x + gate * delta on their rows.

    - X-MoD, Eq.(7): x + varsigma * r * (a + f): delta = a + f, gate = varsigma * r;
    - MoD, Eq.(6): x + a + r * f: delta = a + r * f, gate = 1.

    ``attention``/``mlp`` are a and f of the routed tokens ``[..., h]``, ``r`` their router weights
    sigmoid(s - tau*b) (shape ``[...]``), ``keep`` 1 for a routed token and 0 for padding of a padded
    batch (None: no padding). The gate is kept apart from delta so that a fused gated scatter can apply it.
    X-MoD with ``gate_scale`` None: ``r`` is varsigma * r already (the fused routing step's gate).
    """
    if family == "xmod":
        gate = r if gate_scale is None else gate_scale * r
        return attention + mlp, gate if keep is None else gate * keep
    return attention + r.unsqueeze(-1) * mlp, torch.ones_like(r) if keep is None else keep


class RoutingDecision(NamedTuple):
    selected: torch.Tensor  # [s, b] bool
    scores: torch.Tensor  # [s, b] bias-adjusted router logits (differentiable)
    topk_indices: Optional[torch.Tensor]  # [k, b] sorted positions when routed by top-k


def route(
    logits: torch.Tensor,
    sparsity_k: int,
    rule: str,
    token_choice_bias: Optional[torch.Tensor] = None,
    tau: float = 0.0,
    segments: int = 1,
) -> RoutingDecision:
    """Route one sparse layer: ``rule`` is "topk" (training) or "threshold" (evaluation); ``segments``:
    top-k over each of that many equal segments of a sequence (the threshold rule is per token)."""
    scores = adjusted_logits(logits, token_choice_bias, tau)
    if rule == "topk":
        indices = select_topk(scores, sparsity_k, segments)
        return RoutingDecision(indices_to_mask(indices, scores.shape[0]), scores, indices)
    if rule == "threshold":
        return RoutingDecision(select_threshold(scores), scores, None)
    raise ValueError(f"rule: {rule!r} is not one of topk, threshold")


def jaccard_tensor(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a & b| / |a | b| of two routed-token masks (adjacent-layer overlap, Table 10); 1 if both empty."""
    union = (a | b).sum()
    return torch.where(union > 0, (a & b).sum() / union.clamp(min=1), torch.ones((), device=a.device))


def check_eval_rule(rule: str) -> str:
    """The evaluation rule of a model's sparse layers: threshold (deployable) or topk (comparison)."""
    if rule not in EVAL_ROUTING_RULES:
        raise ValueError(f"xmod_eval_routing: {rule!r} is not one of {', '.join(EVAL_ROUTING_RULES)}")
    return rule
