"""The training routing step of one sparse layer, fused: router logits, bias adjustment (Eq.8),
top-k with the routed tokens in position order, the bias update, and the gate r = sigmoid(score).

``routing_step`` returns the same tensors whichever backend runs it:

- ``torch``: :func:`routing_step_torch`, composed from :mod:`megatron_xmod.routing` (the rules'
  one definition; ~20 framework ops forward);
- ``triton``: :mod:`megatron_xmod.kernels.triton_routing` (two launches forward, one backward),
  tested against the torch path. It has no host synchronisation and only static shapes
  (k = L/K), so it can be captured in a CUDA graph.

Selection, highest priority first: the ``backend=`` argument, the ``XMOD_ROUTING_BACKEND``
environment variable (``auto|triton|torch``), then ``auto``: triton for CUDA tensors when Triton
imports, torch otherwise. Triton on CPU tensors needs ``TRITON_INTERPRET=1`` (tests) and is only
used when asked for. A backend that was asked for but cannot run falls back with a WARNING that
says why (logger ``megatron_xmod.kernels``). ``launch_counts`` counts the routing steps each
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

from megatron_xmod.routing import route, topk_count, update_token_choice_bias

logger = logging.getLogger("megatron_xmod.kernels")

ENV_BACKEND = "XMOD_ROUTING_BACKEND"
BACKENDS = ("triton", "torch")
launch_counts: collections.Counter = collections.Counter()
_logged: set = set()
_triton_mod = None
_triton_error: Optional[str] = None


class RoutingStep(NamedTuple):
    indices: Optional[torch.Tensor]  # [k, b] int64, routed positions in ascending order (top-k only)
    selected: torch.Tensor  # [s, b] bool
    scores: torch.Tensor  # [s, b] fp32 bias-adjusted logits s - tau*b (differentiable)
    gate: Optional[torch.Tensor]  # [k, b] fp32 sigmoid(score) of the routed tokens (differentiable)
    bias: torch.Tensor  # [s, b] fp32 token-choice bias after this layer (b + increment * selected)


def routing_step_torch(hidden_states, router: torch.nn.Linear, sparsity_k: int, rule: str,
                       carried_bias: Optional[torch.Tensor], tau: float, increment: float) -> RoutingStep:
    """The reference: the rules of :mod:`megatron_xmod.routing`, op by op."""
    logits = router(hidden_states).squeeze(-1).float()  # [s, b]
    decision = route(logits, sparsity_k, rule, carried_bias, tau)
    bias = update_token_choice_bias(carried_bias, decision.selected, increment)
    gate = None
    if decision.topk_indices is not None:
        gate = torch.sigmoid(torch.gather(decision.scores, 0, decision.topk_indices))
    return RoutingStep(decision.topk_indices, decision.selected, decision.scores, gate, bias)


def routing_step(hidden_states: torch.Tensor, router: torch.nn.Linear, sparsity_k: int, rule: str,
                 carried_bias: Optional[torch.Tensor] = None, tau: float = 0.0, increment: float = 1.0, *,
                 backend: Optional[str] = None) -> RoutingStep:
    """Route ``hidden_states`` [s, b, h] with ``router`` (Linear(h, 1)); see the module docstring."""
    name = "torch" if rule != "topk" else _select(backend, hidden_states)
    launch_counts[name] += 1
    if name == "torch":
        return routing_step_torch(hidden_states, router, sparsity_k, rule, carried_bias, tau, increment)
    k = topk_count(hidden_states.shape[0], sparsity_k)
    carried = None if carried_bias is None else carried_bias.detach().float().contiguous()
    with torch.profiler.record_function("triton::routing_step"):
        indices, selected, scores, gate, bias, _ = _FusedRoutingStep.apply(
            hidden_states, router.weight, router.bias, carried, float(tau), k, float(increment), _triton())
    return RoutingStep(indices, selected, scores, gate, bias)


class _FusedRoutingStep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, w0, carried, tau, k, increment, ops):
        x = x.contiguous()
        w = weight.reshape(-1).contiguous()
        w0 = w0.reshape(1) if w0 is not None else torch.zeros(1, dtype=w.dtype, device=w.device)
        indices, selected, scores, gate, bias, slot = ops.forward(x, w, w0, carried, tau, k, increment)
        ctx.ops, ctx.has_w0 = ops, weight is not None
        ctx.save_for_backward(x, w, gate, slot)
        ctx.mark_non_differentiable(indices, selected, bias, slot)
        return indices, selected, scores, gate, bias, slot

    @staticmethod
    @once_differentiable
    def backward(ctx, _gi, _gs, dscores, dgate, _gb, _gslot):
        x, w, gate, slot = ctx.saved_tensors
        need_dx, need_w, need_w0 = ctx.needs_input_grad[:3]
        dx, dw, dw0 = ctx.ops.backward(
            x, w, None if dscores is None else dscores.contiguous(), None if dgate is None else dgate.contiguous(),
            gate, slot, need_dx, need_w or need_w0)
        dw = dw.view(1, -1).to(w.dtype) if need_w else None
        dw0 = dw0.to(w.dtype) if need_w0 else None
        return dx, dw, dw0, None, None, None, None, None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _triton():
    global _triton_mod, _triton_error
    if _triton_mod is None and _triton_error is None:
        try:
            from megatron_xmod.kernels import triton_routing

            _triton_mod = triton_routing
        except Exception as e:  # ImportError, or a triton that fails to initialise
            _triton_error = f"triton is not usable ({type(e).__name__}: {e})"
    return _triton_mod


def _triton_unavailable(x: torch.Tensor) -> Optional[str]:
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"the triton routing step supports float32/float16/bfloat16, not {x.dtype}"
    if x.device.type != "cuda" and not _interpreting():
        return f"triton needs CUDA tensors (these are on {x.device}) or TRITON_INTERPRET=1"
    if _triton() is None:
        return _triton_error
    return None


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
