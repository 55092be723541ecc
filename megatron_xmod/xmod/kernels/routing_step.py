"""The training routing step of one sparse layer, fused: bias adjustment (Eq.8), top-k with the
routed tokens in position order, the bias update, and the gate r = sigmoid(score) of the routed
tokens, from the router logits the layer computed.

``routing_step`` returns the same tensors whichever backend runs it:

- ``torch``: :func:`routing_step_torch`, composed from :mod:`megatron_xmod.xmod.routing` (the rules'
  one definition);
- ``triton``: :mod:`megatron_xmod.xmod.kernels.triton_routing` (one launch forward, one backward),
  tested against the torch path. It has no host synchronisation and only static shapes
  (k = L/K), so it can be captured in a CUDA graph.

Selection, highest priority first: the ``backend=`` argument, the ``XMOD_ROUTING_BACKEND``
environment variable (``auto|triton|torch``), then ``auto``: triton for CUDA tensors when Triton
imports, torch otherwise. Triton on CPU tensors needs ``TRITON_INTERPRET=1`` (tests) and is only
used when asked for. A backend that was asked for but cannot run falls back with a WARNING that
says why (logger ``megatron_xmod.xmod.kernels``). ``launch_counts`` counts the routing steps each
backend ran (instrumentation for tests and benchmarks; it holds no model state).

Only the top-k rule (training) is fused: the threshold rule of evaluation selects a different
number of tokens per sequence and always takes the torch path.

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
from megatron_xmod.xmod.routing import RoutingDecision, route, topk_count, update_token_choice_bias

logger = logging.getLogger("megatron_xmod.xmod.kernels")

ENV_BACKEND = "XMOD_ROUTING_BACKEND"
BACKENDS = ("triton", "torch")
launch_counts: collections.Counter = collections.Counter()
_logged: set = set()


class RoutingStep(NamedTuple):
    decision: RoutingDecision  # selected [s, b] bool, scores [s, b] fp32 (differentiable), topk_indices [k, b]
    bias: torch.Tensor  # [s, b] fp32 token-choice bias after this layer (b + increment * selected)
    gate: Optional[torch.Tensor]  # [k, b] fp32 sigmoid(score) of the top-k tokens (differentiable); None for threshold


def routing_step_torch(logits: torch.Tensor, sparsity_k: int, rule: str, carried_bias: Optional[torch.Tensor],
                       tau: float, increment: float, bias_out: Optional[torch.Tensor] = None) -> RoutingStep:
    """The reference: the rules of :mod:`megatron_xmod.xmod.routing`, op by op."""
    decision = route(logits, sparsity_k, rule, carried_bias, tau)
    bias = update_token_choice_bias(carried_bias, decision.selected, increment, out=bias_out)
    gate = None
    if decision.topk_indices is not None:
        gate = torch.sigmoid(torch.gather(decision.scores, 0, decision.topk_indices))
    return RoutingStep(decision, bias, gate)


def routing_step(logits: torch.Tensor, sparsity_k: int, rule: str, carried_bias: Optional[torch.Tensor] = None,
                 tau: float = 0.0, increment: float = 1.0, *, backend: Optional[str] = None,
                 bias_out: Optional[torch.Tensor] = None) -> RoutingStep:
    """Route one sparse layer from its router logits [s, b] (fp32); see the module docstring.
    ``bias_out``: a float32 [s, b] buffer that receives the updated bias (the routing state's hand-over
    buffer, which may also be ``carried_bias``); the returned bias is then that buffer."""
    name = "torch" if rule != "topk" else _select(backend, logits)
    launch_counts[name] += 1
    if name == "torch":
        return routing_step_torch(logits, sparsity_k, rule, carried_bias, tau, increment, bias_out)
    k = topk_count(logits.shape[0], sparsity_k)
    carried = None if carried_bias is None else carried_bias.detach().float().contiguous()
    logits32 = logits if logits.dtype == torch.float32 else logits.float()
    indices, selected, scores, gate, bias, _ = _FusedRoutingStep.apply(
        logits32.contiguous(), carried, float(tau), k, float(increment), _triton.module())
    if bias_out is not None:
        bias = bias_out.copy_(bias)
    return RoutingStep(RoutingDecision(selected, scores, indices), bias, gate)


class _FusedRoutingStep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, carried, tau, k, increment, ops):
        indices, selected, scores, gate, bias, slot = ops.forward(logits, carried, tau, k, increment)
        ctx.ops = ops
        ctx.save_for_backward(gate, slot)
        ctx.mark_non_differentiable(indices, selected, bias, slot)
        ctx.set_materialize_grads(False)  # no zero tensors for the outputs nobody differentiates
        return indices, selected, scores, gate, bias, slot

    @staticmethod
    @once_differentiable
    def backward(ctx, _gi, _gs, dscores, dgate, _gb, _gslot):
        if dgate is None:  # d score / d logit is the identity: nothing to launch
            return dscores, None, None, None, None, None
        gate, slot = ctx.saved_tensors
        dlogits = ctx.ops.backward(None if dscores is None else dscores.float().contiguous(),
                                   dgate.float().contiguous(), gate, slot)
        return dlogits, None, None, None, None, None


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
