"""Plain-torch routed-token permutation: the reference every faster backend is tested against.

Layout is megatron's sequence-first ``[s, b, h]``. ``indices`` is ``[k, b]`` (int64), sorted
ascending per column, so the gathered subsequence keeps the original token order (causality).
"""
from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from megatron_xmod.xmod.routing_state import flat_rows


def gather_tokens(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``[s, b, h]`` + ``[k, b]`` -> ``[k, b, h]``: the routed tokens of each sequence.

    Rows of the flat ``[s*b, h]`` view: ``index_select`` keeps only the indices for its backward,
    where ``torch.gather`` would keep the whole full-length input (activation memory of a routed layer).
    """
    return x.reshape(-1, x.shape[-1]).index_select(0, flat_rows(indices, indices.shape[1])).view(*indices.shape, x.shape[-1])


def scatter_gated(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Return ``x`` with ``x + gate * y`` written at ``indices``; every other token passes unchanged.

    ``y``: ``[k, b, h]``, ``gate``: ``[k, b]``. Indices must be unique per sequence.
    """
    index = indices.unsqueeze(-1).expand(-1, -1, x.shape[-1])
    return x.scatter_add(0, index, gate.unsqueeze(-1).to(y.dtype) * y)


# --- the routed update in place on the residual stream ------------------------------------------------
# A routed layer changes L/K rows of the residual stream; an out-of-place update copies all L rows forward
# and again backward (the residual's gradient with the rows' added). Along a router-input chain
# (megatron_xmod.xmod.routing_state: a routed layer whose input is the previous routed layer's output; the
# chain saves copies of the rows it needs, never the stream) the stream belongs to the block: the chain's
# first layer updates a copy of its input, every later one adds its rows to that copy in place, and backward
# adds the rows' gradients into one gradient buffer of the chain in place. The full-length passes left a
# layer are the router's (its logits forward; its outer product and weight gradient backward).


class StreamGrad:
    """The residual stream's gradient, handed between the backward nodes of one in-place routed update
    (:func:`add_rows_` -> :func:`rows_for_update` -> the router), each adding its part in place.

    Made empty by the layer and wired by ``routing_state.router_logits`` (under autograd): ``chain`` is an
    object shared by the updates of one router-input chain (routing_state.ChainCursor) whose ``stream_grad``
    attribute holds the gradient buffer the chain made, the only one written in place (any other gradient,
    which autograd may have handed to other nodes too: an add's backward gives both summands one tensor, is
    copied once first); the router's backward takes it from here, adds its outer product and returns it
    as the layer input's (routing_state.RouterLogits). ``continues``: the layer's input continues the chain
    (the previous routed layer's output), so the update writes into it; else into a copy of it. Not wired
    (``chain`` None: no autograd, or no chain): :func:`rows_for_update`'s backward returns the gradient."""

    __slots__ = ("grad", "chain", "continues")

    def __init__(self):
        self.grad: Optional[torch.Tensor] = None
        self.chain = None
        self.continues = False


class _RowsForUpdate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, stream, rows, stream_grad, after):
        ctx.save_for_backward(rows)
        ctx.stream_grad, ctx.shape = stream_grad, stream.shape
        return stream.reshape(-1, stream.shape[-1]).index_select(0, rows)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_rows):
        (rows,) = ctx.saved_tensors
        handover = ctx.stream_grad
        grad, handover.grad = handover.grad, None
        chain = handover.chain
        if grad is None:  # the update's output got no gradient
            grad = grad_rows.new_zeros(ctx.shape)
        elif chain is None or grad is not chain.stream_grad:  # not the chain's own buffer: the rows added into a copy
            grad = grad.clone(memory_format=torch.contiguous_format)
        if grad_rows is not None:
            # a row listed twice (sequence parallelism's stand-ins at row 0) gets both parts: index_add_ sums them
            grad.view(-1, grad.shape[-1]).index_add_(0, rows, grad_rows)
        if chain is None:
            return grad, None, None, None
        chain.stream_grad = handover.grad = grad  # the router's backward adds its part and hands it on
        return None, None, None, None


class _AddRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, stream, rows, update, stream_grad):
        ctx.save_for_backward(rows)
        ctx.stream_grad = stream_grad
        stream.view(-1, stream.shape[-1]).index_add_(0, rows, update.to(stream.dtype))
        ctx.mark_dirty(stream)
        return stream

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        (rows,) = ctx.saved_tensors
        ctx.stream_grad.grad = grad  # d out / d stream is the identity: rows_for_update's backward adds to it
        return None, None, grad.reshape(-1, grad.shape[-1]).index_select(0, rows), None


def rows_for_update(stream: torch.Tensor, rows: torch.Tensor, stream_grad: StreamGrad,
                    after: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The flat rows ``rows`` [n] of ``stream`` [s, b, h] ([n, h], a copy), which an update then adds to in
    place with :func:`add_rows_` and the same ``stream_grad``. ``after``: the router's logits when
    ``stream_grad`` is wired to a chain (the router's backward, which takes the stream's gradient from this
    one's, must run after it, and autograd orders backward nodes by their edges only)."""
    return _RowsForUpdate.apply(stream, rows, stream_grad, after)


def add_rows_(stream: torch.Tensor, rows: torch.Tensor, update: torch.Tensor, stream_grad: StreamGrad) -> torch.Tensor:
    """``stream`` [s, b, h] with ``update`` [n, h] added at its flat rows ``rows`` in place (a row listed twice
    gets both); returns ``stream``. Those rows must have been read by :func:`rows_for_update` with
    ``stream_grad``, whose backward completes the stream's gradient. Nothing may have saved ``stream`` for
    backward (autograd's version check raises if something did)."""
    return _AddRows.apply(stream, rows, update, stream_grad)
