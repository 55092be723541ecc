"""The training routing step of one sparse layer, fused: the router's bias, the token-choice bias
adjustment (Eq.8), top-k with the routed tokens in position order, the bias update, and the gate
r = sigmoid(score) of the routed tokens (times the X-MoD gate scale varsigma of Eq.7 when given), from
the router logits x w the layer computed.

The router's bias and varsigma enter here rather than in the layer's ``nn.Linear`` and gated update
because their gradients are then sums the backward kernel takes on the way (one launch), where the
layer's ops cost two multiplies and two sums in backward (bench/ops.py; issue 28).

``routing_step`` returns the same tensors whichever backend runs it:

- ``torch``: :func:`routing_step_torch`, composed from :mod:`megatron_xmod.xmod.routing` (the rules'
  one definition);
- ``triton``: :mod:`megatron_xmod.xmod.kernels.triton_routing` (one launch forward, one backward),
  tested against the torch path. It has no host synchronisation and only static shapes
  (k = L/K), so it can be captured in a CUDA graph.

Both write the same destinations (the routing state's buffers, in place): the updated bias, the
routed set, the call's routing statistics and the router BCE (Eq.9). So a sparse layer under top-k
issues no op for them; the two backends leave identical tables (integer counts in fp32), but for the
BCE, a float sum in another order (on a GPU the per-sequence atomic adds make its last bits vary from
run to run).

Selection, highest priority first: the ``backend=`` argument, the ``XMOD_ROUTING_BACKEND``
environment variable (``auto|triton|torch``), then ``auto``: triton for CUDA tensors when Triton
imports, torch otherwise. Triton on CPU tensors needs ``TRITON_INTERPRET=1`` (tests) and is only
used when asked for. A backend that was asked for but cannot run falls back with a WARNING that
says why (logger ``megatron_xmod.xmod.kernels``). ``launch_counts`` counts the routing steps each
backend ran (instrumentation for tests and benchmarks; it holds no model state).

Only the top-k rule (training) over whole sequences is fused: the threshold rule of evaluation
selects a different number of tokens per sequence, and segment-local top-k (``segments`` > 1,
``--xmod-routing-segments``) ranks within segments; both take the torch path, whatever ``backend=``
or the environment ask for (``launch_counts`` then counts a torch step).

Tie rule: the Triton kernel gives ties at the k-th score to the earliest positions; torch.topk
leaves the choice unspecified. With continuous logits ties are rare, but bf16 logits (as
``nn.Linear`` returns them in a bf16 model) make them possible at long L.
"""
from __future__ import annotations

import collections
import logging
import os
from typing import NamedTuple, Optional

import torch
from torch.autograd.function import once_differentiable

from megatron_xmod.xmod.permute.dispatch import LazyTriton
from megatron_xmod.xmod.routing import (
    RoutingDecision,
    route,
    router_bce_loss,
    topk_count,
    update_token_choice_bias,
)
from megatron_xmod.xmod.routing_state import flat_rows

logger = logging.getLogger("megatron_xmod.xmod.kernels")

ENV_BACKEND = "XMOD_ROUTING_BACKEND"
BACKENDS = ("triton", "torch")
launch_counts: collections.Counter = collections.Counter()
_logged: set = set()


class RoutingStep(NamedTuple):
    decision: RoutingDecision  # selected [s, b] bool, scores [s, b] fp32 (differentiable), topk_indices [k, b]
    bias: torch.Tensor  # [s, b] fp32 token-choice bias after this layer (b + increment * selected)
    gate: Optional[torch.Tensor]  # [k, b] fp32 sigmoid(score) (times gate_scale) of the top-k tokens; None for threshold
    flat_rows: Optional[torch.Tensor] = None  # [k*b] int64 topk_indices * b + column (routing_state.flat_rows)
    router_loss: Optional[torch.Tensor] = None  # coeff * router BCE (Eq.9), summed over its elements; differentiable


def _check_destinations(rule, selected_out, previous_selected, statistics, bce_coeff):
    if rule != "topk" and (selected_out is not None or statistics is not None or bce_coeff):
        raise ValueError(f"rule={rule!r}: selected_out, statistics and bce_coeff are for the top-k rule only; "
                         "the threshold rule's layer records its statistics itself")
    if statistics is not None and statistics.has_previous != (previous_selected is not None):
        raise ValueError("statistics: made for a call with" + ("" if statistics.has_previous else "out")
                         + " a previous routed set; pass previous_selected accordingly")
    if statistics is not None and statistics.has_bce != bool(bce_coeff):
        raise ValueError("statistics: made for a call with" + ("" if statistics.has_bce else "out")
                         + " the router BCE; pass bce_coeff > 0 accordingly")


def routing_step_torch(logits: torch.Tensor, sparsity_k: int, rule: str, carried_bias: Optional[torch.Tensor],
                       tau: float, increment: float, bias_out: Optional[torch.Tensor] = None, *,
                       selected_out: Optional[torch.Tensor] = None, previous_selected: Optional[torch.Tensor] = None,
                       statistics=None, bce_coeff: float = 0.0, segments: int = 1,
                       router_bias: Optional[torch.Tensor] = None, gate_scale: Optional[torch.Tensor] = None) -> RoutingStep:
    """The reference: the rules of :mod:`megatron_xmod.xmod.routing`, op by op; writes what
    :func:`routing_step` writes, in the same order (the statistics read the previous routed set before
    ``selected_out``, which may be the same buffer, receives this layer's)."""
    _check_destinations(rule, selected_out, previous_selected, statistics, bce_coeff)
    if router_bias is not None:
        logits = logits + router_bias.float()
    decision = route(logits, sparsity_k, rule, carried_bias, tau, segments)
    bias = update_token_choice_bias(carried_bias, decision.selected, increment, out=bias_out)
    gate = rows = loss = None
    if decision.topk_indices is not None:
        gate = torch.sigmoid(torch.gather(decision.scores, 0, decision.topk_indices))
        if gate_scale is not None:
            gate = gate_scale * gate  # in the parameter's dtype when wider than fp32 (an fp64 test model)
        rows = flat_rows(decision.topk_indices, logits.shape[1])
    bce = router_bce_loss(decision.scores, decision.selected) if bce_coeff else None
    if bce is not None:
        loss = bce_coeff * bce
    if statistics is not None:  # the values routing_state.StepStatistics lists, in its order
        selected = decision.selected
        values = [torch.isfinite(logits).sum(), torch.count_nonzero(bias)]
        if previous_selected is not None:
            values += [(previous_selected & selected).sum(), (previous_selected | selected).sum()]
        values += [bce.detach()] * 2 if bce is not None else []
        # int64 counts (and the float BCE) promote to float32 in the stack or the cat: exact below 2^24
        statistics.table.index_add_(0, statistics.offsets, torch.cat([torch.stack(values), statistics.constants]))
    if selected_out is not None:
        selected_out.copy_(decision.selected)
    return RoutingStep(decision, bias, gate, rows, loss)


def routing_step(logits: torch.Tensor, sparsity_k: int, rule: str, carried_bias: Optional[torch.Tensor] = None,
                 tau: float = 0.0, increment: float = 1.0, *, backend: Optional[str] = None,
                 bias_out: Optional[torch.Tensor] = None, selected_out: Optional[torch.Tensor] = None,
                 previous_selected: Optional[torch.Tensor] = None, statistics=None,
                 bce_coeff: float = 0.0, segments: int = 1, router_bias: Optional[torch.Tensor] = None,
                 gate_scale: Optional[torch.Tensor] = None) -> RoutingStep:
    """Route one sparse layer from its router logits [s, b] (fp32); see the module docstring.
    ``segments``: top-k within each of that many equal segments of a sequence (routing.select_topk).
    ``router_bias``: the router's bias ([1], differentiable), added to the logits first (None: the
    logits have it); ``gate_scale`` (top-k): varsigma ([1], differentiable), which the returned gate
    then carries (X-MoD's gate varsigma * r; None: the gate is r).

    Destinations, written in place (the routing state's buffers: megatron_xmod.xmod.routing_state):

    - ``bias_out``: float32 [s, b] that receives the updated bias (the hand-over buffer, which may also
      be ``carried_bias``); the returned bias is then that buffer;
    - ``selected_out`` (top-k): bool [s, b] that receives the routed set (the hand-over buffer);
    - ``statistics`` (top-k): a ``StepStatistics`` of the routing state, whose table gets this call's
      statistics; ``previous_selected``: the routed set of the layer before (for the adjacent Jaccard;
      it may be ``selected_out``, read before it is overwritten);
    - ``bce_coeff`` > 0 (top-k): also compute the router BCE (Eq.9): ``router_loss`` is coeff * BCE once
      summed (to back-propagate), the statistics get the BCE itself.
    """
    _check_destinations(rule, selected_out, previous_selected, statistics, bce_coeff)
    name = "torch" if rule != "topk" or segments > 1 else _select(backend, logits)
    launch_counts[name] += 1
    if name == "torch":
        return routing_step_torch(logits, sparsity_k, rule, carried_bias, tau, increment, bias_out,
                                  selected_out=selected_out, previous_selected=previous_selected,
                                  statistics=statistics, bce_coeff=bce_coeff, segments=segments,
                                  router_bias=router_bias, gate_scale=gate_scale)
    k = topk_count(logits.shape[0], sparsity_k)
    carried = None if carried_bias is None else carried_bias.detach().float().contiguous()
    logits32 = logits if logits.dtype == torch.float32 else logits.float()
    ops = _triton.module()
    bias = bias_out if bias_out is not None else torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    dest = ops.Destinations(bias, _int8(selected_out, "selected_out"), _int8(previous_selected, "previous_selected"),
                            statistics)
    indices, selected, scores, gate, _, rows, loss = _FusedRoutingStep.apply(
        logits32.contiguous(), _scalar(router_bias, "router_bias"), _scalar(gate_scale, "gate_scale"), carried,
        float(tau), k, float(increment), float(bce_coeff), dest, ops)
    return RoutingStep(RoutingDecision(selected, scores, indices), bias, gate, rows, loss)


def _scalar(t: Optional[torch.Tensor], name: str) -> Optional[torch.Tensor]:
    if t is not None and t.numel() != 1:
        raise ValueError(f"{name}: the fused routing step takes a one-element tensor, got shape {tuple(t.shape)}")
    return t


def _int8(mask: Optional[torch.Tensor], name: str) -> Optional[torch.Tensor]:
    if mask is None:
        return None
    if mask.dtype != torch.bool or not mask.is_contiguous():
        raise ValueError(f"{name}: the fused routing step writes a contiguous bool [s, b] buffer, got "
                         f"{mask.dtype} (contiguous: {mask.is_contiguous()}); pass the routing state's buffer")
    return mask.view(torch.int8)


class _FusedRoutingStep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, router_bias, gate_scale, carried, tau, k, increment, bce_coeff, dest, ops):
        indices, selected, scores, gate, slot, rows, loss = ops.forward(logits, carried, tau, k, increment,
                                                                       bce_coeff, dest, router_bias, gate_scale)
        ctx.ops, ctx.bce_coeff = ops, bce_coeff
        needs_scores = loss is not None or gate_scale is not None  # the BCE's and varsigma's backward read them
        ctx.save_for_backward(gate, slot, scores if needs_scores else None, router_bias, gate_scale)
        ctx.mark_non_differentiable(indices, selected, slot, rows)
        ctx.set_materialize_grads(False)  # no zero tensors for the outputs nobody differentiates
        return indices, selected, scores, gate, slot, rows, loss

    @staticmethod
    @once_differentiable
    def backward(ctx, _gi, _gs, dscores, dgate, _gslot, _grows, dloss):
        nothing = (None,) * 7
        gate, slot, scores, router_bias, gate_scale = ctx.saved_tensors
        want_bias = router_bias is not None and ctx.needs_input_grad[1]
        want_scale = gate_scale is not None and ctx.needs_input_grad[2] and dgate is not None
        if dgate is None and dloss is None and not want_bias:  # d score / d logit is the identity
            return (dscores, None, None) + nothing
        dlogits, dbias, dscale = ctx.ops.backward(
            None if dscores is None else dscores.float().contiguous(),
            None if dgate is None else dgate.float().contiguous(), gate, slot, scores,
            None if dloss is None else dloss.float(), ctx.bce_coeff, gate_scale,
            router_bias if want_bias else None, gate_scale if want_scale else None)
        return (dlogits, dbias, dscale) + nothing


_triton = LazyTriton("megatron_xmod.xmod.kernels.triton_routing")


def _triton_unavailable(x: torch.Tensor) -> Optional[str]:
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"the triton routing step takes float32/float16/bfloat16 logits, not {x.dtype}"
    return _triton.unavailable(x.device)


def _select(requested: Optional[str], x: torch.Tensor) -> str:
    origin = "argument" if requested is not None else ENV_BACKEND
    want = (requested or os.environ.get(ENV_BACKEND) or "auto").strip().lower()
    if want not in ("auto",) + BACKENDS:
        raise ValueError(f"{origin}={want!r}: expected one of auto, {', '.join(BACKENDS)}")
    if want == "torch":
        return "torch"
    why = _triton_unavailable(x)
    if why is None and (want == "triton" or x.device.type == "cuda"):
        return "triton"
    if want == "triton":
        key = ("fallback", x.device.type, why)
        if key not in _logged:
            _logged.add(key)
            logger.warning("routing step: the triton backend requested by %s cannot run (%s); using torch", origin, why)
    return "torch"
