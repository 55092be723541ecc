"""Plain-torch routed-token permutation: the reference every faster backend is tested against.

Layout is megatron's sequence-first ``[s, b, h]``. ``indices`` is ``[k, b]`` (int64), sorted
ascending per column, so the gathered subsequence keeps the original token order (causality).
"""
import torch

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
