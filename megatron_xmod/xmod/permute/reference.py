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


class _SplitUniqueRows(torch.autograd.Function):
    """(``x2d`` itself, ``x2d.index_select(0, rows)``): the residual stream and the routed rows of one x, with
    one backward for both: the residual's gradient with the rows' gradients added at ``rows``, one pass over
    it, where two uses of x would make the autograd engine (or a compiler) scatter the rows into a fresh
    full-length buffer of zeros and add it to the residual's gradient: three passes and two full-length
    buffers a routed layer. Rows unique (top-k's): the rows are written (``index_put``, ``index_copy``), not
    added as ``index_select``'s backward adds them, so a compiler need not make the writes atomic (Inductor's
    CPU index_add is an atomic add per element)."""

    @staticmethod
    def forward(ctx, x2d, rows):
        ctx.save_for_backward(rows)
        ctx.num_rows = x2d.shape[0]
        return x2d.view_as(x2d), x2d.index_select(0, rows)

    @staticmethod
    def backward(ctx, grad_residual, grad_rows):
        (rows,) = ctx.saved_tensors
        if grad_residual is None:
            return grad_rows.new_zeros(ctx.num_rows, grad_rows.shape[1]).index_copy(0, rows, grad_rows), None
        if grad_rows is None:
            return grad_residual, None
        return grad_residual.index_put((rows,), grad_residual.index_select(0, rows) + grad_rows), None


def split_unique_tokens(x: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x as the residual stream, :func:`gather_tokens` of it) for indices unique per sequence, whose
    gradients meet in one pass (:class:`_SplitUniqueRows`): a routed update that reads x twice (its routed
    rows and the residual it scatters onto) should take both from here."""
    residual, routed = _SplitUniqueRows.apply(x.reshape(-1, x.shape[-1]), flat_rows(indices, indices.shape[1]))
    return residual.view_as(x), routed.view(*indices.shape, x.shape[-1])


def gather_unique_tokens(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """:func:`gather_tokens` for indices unique per sequence (top-k's), with a non-accumulating backward (the
    routed rows of :func:`split_unique_tokens` alone: their gradients written into zeros)."""
    return split_unique_tokens(x, indices)[1]


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
    (:func:`add_rows_` -> :func:`rows_for_update` -> the router, when the router read the stream itself).

    Made empty by the layer and wired by ``routing_state.router_logits``: ``chain`` is an object shared by
    the updates of one chain (routing_state.ChainCursor) whose ``stream_grad`` attribute holds the gradient
    buffer the chain made, the only one written in place (any other gradient, which autograd may have
    handed to other nodes too: an add's backward gives both summands one tensor, is copied once first);
    ``router`` True: the layer's input continues the chain (the stream is the block's, updated in place) and
    the router's backward takes the gradient from here, adds its part in place and returns it as the
    stream's (routing_state.RouterLogits); False: :func:`rows_for_update`'s backward returns it."""

    __slots__ = ("grad", "router", "chain")

    def __init__(self):
        self.grad: Optional[torch.Tensor] = None
        self.chain = None
        self.router = False


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
        elif chain is None or grad is not chain.stream_grad:  # not the chain's own buffer: the rows added into a copy, one pass
            flat = grad.reshape(-1, grad.shape[-1])
            grad = (flat.clone() if grad_rows is None else
                    flat.index_put((rows,), flat.index_select(0, rows) + grad_rows)).view(ctx.shape)
            grad_rows = None
        if grad_rows is not None:
            grad.view(-1, grad.shape[-1]).index_add_(0, rows, grad_rows)  # rows unique: no two adds meet
        if handover.router:
            chain.stream_grad = handover.grad = grad
            return None, None, None, None
        if chain is not None:
            chain.stream_grad = None  # the chain's first layer: the buffer leaves the chain
        return grad, None, None, None


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
    place with :func:`add_rows_` and the same ``stream_grad``. ``after``: a differentiable tensor whose
    producer's backward must run after this one's (the router logits, when the router takes the stream's
    gradient: autograd orders backward nodes by their edges only)."""
    return _RowsForUpdate.apply(stream, rows, stream_grad, after)


def add_rows_(stream: torch.Tensor, rows: torch.Tensor, update: torch.Tensor, stream_grad: StreamGrad) -> torch.Tensor:
    """``stream`` [s, b, h] with ``update`` [n, h] added at its flat rows ``rows`` (unique), in place; returns
    ``stream``. Those rows must have been read by :func:`rows_for_update` with ``stream_grad``, whose backward
    completes the stream's gradient. Nothing may have saved ``stream`` for backward (autograd's version
    check raises if something did)."""
    return _AddRows.apply(stream, rows, update, stream_grad)
