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


class _GatherUniqueRows(torch.autograd.Function):
    """``x2d.index_select(0, rows)`` whose backward writes the rows' gradients (``index_copy``) where
    ``index_select``'s adds them (``index_add``): the same for unique rows, and a compiler need not make the
    writes atomic (Inductor's CPU index_add is an atomic add per element)."""

    @staticmethod
    def forward(ctx, x2d, rows):
        ctx.save_for_backward(rows)
        ctx.num_rows = x2d.shape[0]
        return x2d.index_select(0, rows)

    @staticmethod
    def backward(ctx, grad):
        (rows,) = ctx.saved_tensors
        return grad.new_zeros(ctx.num_rows, grad.shape[1]).index_copy(0, rows, grad), None


def gather_unique_tokens(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """:func:`gather_tokens` for indices unique per sequence (top-k's), with a non-accumulating backward."""
    return _GatherUniqueRows.apply(x.reshape(-1, x.shape[-1]), flat_rows(indices, indices.shape[1])).view(*indices.shape, x.shape[-1])


def scatter_gated(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Return ``x`` with ``x + gate * y`` written at ``indices``; every other token passes unchanged.

    ``y``: ``[k, b, h]``, ``gate``: ``[k, b]``. Indices must be unique per sequence.
    """
    index = indices.unsqueeze(-1).expand(-1, -1, x.shape[-1])
    return x.scatter_add(0, index, gate.unsqueeze(-1).to(y.dtype) * y)
