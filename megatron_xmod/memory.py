"""Activation memory of routed layers: the router's full-length input saved once per block, and the
token-choice bias replayed under full activation recompute.

**Router input, once per block.** A routed layer touches only its L/K routed rows, but its router
(d -> 1) scores every token, and the router weight's gradient sum_i g_i x_i needs the layer input x at
all L positions (the BCE loss of Eq.(9) and the bias make every g_i non-zero). ``nn.Linear`` saves x
for that: one full-length [L, b, h] tensor per routed layer, more than everything else the layer
saves once K >= 8. Consecutive routed layers of a block change only their routed rows, and every other
row passes through bit-identical, so

    x_l = x_base with, for each earlier layer j of the chain, the rows that layer j wrote

where x_base is the input of the chain's first layer. :class:`RouterLogits` saves x_base (shared by
the whole chain: one tensor, counted once) and, per earlier layer, its written rows [k*b, h] with
their flat indices; backward rebuilds x_l by copying rows (no arithmetic, so bit-exact) and computes
the router gradients with the same matmuls as ``nn.Linear``'s backward. Memory per routed layer:
O(L/K), plus one O(L) base per block.

The chain is handed from layer to layer by :class:`RouterInputCarry` (kept in the model chunk's
``RoutingState``), which holds weak references only (autograd's saved tensors keep the rows alive;
nothing outlives the backward pass) and checks that a layer's input really is the previous routed
layer's output; otherwise (a dense anchor in between, a checkpoint boundary, an offloading hook that
dropped a tensor) the layer starts a new chain with its own input as the base.

**Full recompute.** Under megatron's full activation recompute a checkpointed chunk of layers runs
twice: once without autograd in the forward pass, again with autograd inside the backward pass (chunks
in reverse order). The token-choice bias (Eq.8) is carried from layer to layer, so the replay must see
the bias of the first pass: :class:`RecomputeReplay` queues each checkpointed layer's carried bias in
the first pass and hands it back in the replay (first in, first out per layer, which is the order of
micro-batches in megatron's schedules).
"""
from __future__ import annotations

import weakref
from collections import defaultdict, deque
from typing import Optional

import torch
import torch.nn.functional as F


def recompute_phase(training: bool) -> Optional[str]:
    """"first" in the no-grad first pass of megatron's full recompute, "replay" when the chunk is
    recomputed inside the backward pass, None otherwise."""
    from megatron.core.tensor_parallel.random import is_checkpointing

    if not (training and is_checkpointing()):
        return None
    return "replay" if torch.is_grad_enabled() else "first"


class RecomputeReplay:
    """The carried token-choice bias of every checkpointed layer, from the first pass to its replay."""

    def __init__(self):
        self._queues: dict[int, deque] = defaultdict(deque)

    def push(self, layer_number: int, carried) -> None:
        self._queues[layer_number].append(carried)

    def pop(self, layer_number: int):
        queue = self._queues.get(layer_number)
        if not queue:
            raise RuntimeError(
                f"recompute: sparse layer {layer_number} is being recomputed but its first pass left no "
                "token-choice bias; the forward and the recompute must run under megatron's CheckpointFunction")
        return queue.popleft()

    def clear(self) -> None:
        self._queues.clear()


def _fingerprint(x: torch.Tensor) -> tuple:
    return (x.data_ptr(), tuple(x.shape), x.stride(), x._version, x.device)


class RouterInputCarry:
    """Hands the router-input chain of a block from one routed layer to the next (weak references only)."""

    def __init__(self):
        self._layer_number: Optional[int] = None
        self._base: Optional[weakref.ref] = None
        self._links: list[tuple[torch.Tensor, weakref.ref]] = []  # (flat row indices, weakref to rows)
        self._output: Optional[weakref.ref] = None
        self._output_fingerprint: Optional[tuple] = None
        self._written: Optional[torch.Tensor] = None  # flat rows the previous layer wrote

    def take(self, layer_number: int, x: torch.Tensor):
        """(base, [(flat indices, rows), ...]) from which ``x`` is rebuilt, or None: ``x`` starts a chain."""
        if self._layer_number != layer_number - 1 or self._output is None:
            return None
        output, base = self._output(), self._base()
        if output is None or base is None or _fingerprint(x) != self._output_fingerprint:
            return None
        links = []
        for index, rows in self._links:
            rows = rows()
            if rows is None:
                return None
            links.append((index, rows))
        # The rows the previous layer wrote, read from its output (this layer's input): exact.
        written = self._written
        links.append((written, x.detach().reshape(-1, x.shape[-1]).index_select(0, written)))
        return base, links

    def put(self, layer_number: int, chain, output: torch.Tensor, written: torch.Tensor) -> None:
        """After routed layer ``layer_number`` (its chain from :func:`router_logits`) wrote the flat
        rows ``written`` of ``output``."""
        base, links = chain
        self._layer_number = layer_number
        self._base = weakref.ref(base)
        self._links = [(index, weakref.ref(rows)) for index, rows in links]
        self._output = weakref.ref(output)
        self._output_fingerprint = _fingerprint(output)
        self._written = written

    def clear(self) -> None:
        self.__init__()


def rebuild_input(base: torch.Tensor, links) -> torch.Tensor:
    """x_l: the chain's base with every earlier layer's written rows copied in, in layer order."""
    if not links:
        return base
    x = base.clone()
    flat = x.view(-1, x.shape[-1])
    for index, rows in links:
        flat.index_copy_(0, index, rows)
    return x


class RouterLogits(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` of the d -> 1 router, saving the chain (base + rows) instead of x.

    Inputs: x [s, b, h], weight [1, h], bias [1] (or None), the chain's base (x.detach() itself when x
    starts the chain), then the chain's (flat indices, rows) pairs, flattened.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, base, *links):
        ctx.x_shape, ctx.has_bias = x.shape, bias is not None
        ctx.save_for_backward(weight, base, *links)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        weight, base, *flat_links = ctx.saved_tensors
        links = list(zip(flat_links[0::2], flat_links[1::2]))
        grad = grad_output.reshape(-1, grad_output.shape[-1])  # [s*b, 1]
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = grad.mm(weight).view(ctx.x_shape)
        if ctx.needs_input_grad[1]:  # as addmm's backward computes it: (x^T g)^T
            x = rebuild_input(base, links)
            grad_weight = x.reshape(-1, x.shape[-1]).t().mm(grad).t()
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad.sum(0)
        return (grad_x, grad_weight, grad_bias, None) + (None,) * len(flat_links)


def router_logits(router: torch.nn.Linear, x: torch.Tensor, carry: Optional[RouterInputCarry], layer_number: int):
    """Router logits [s, b, 1] and the chain (for :meth:`RouterInputCarry.put`), or (logits, None)
    when nothing needs saving (no autograd) and a plain ``nn.Linear`` call does."""
    if carry is None or not (torch.is_grad_enabled() and router.weight.requires_grad):
        return router(x), None
    chain = carry.take(layer_number, x)
    if chain is None:  # x starts a chain: it is its own base (the same object that the carry refers to)
        chain = (x.detach(), [])
    base, links = chain
    flat = [t for pair in links for t in pair]
    return RouterLogits.apply(x, router.weight, router.bias, base, *flat), chain


def flat_rows(indices: torch.Tensor, batch: int) -> torch.Tensor:
    """Rows of an [s, b, h] tensor viewed as [s*b, h] at positions ``indices`` [k, b] of each sequence."""
    return (indices * batch + torch.arange(batch, device=indices.device)).reshape(-1)
