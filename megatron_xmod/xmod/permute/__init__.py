"""Routed-token permutation ops (gather the routed tokens, scatter the gated update back).

``gather_tokens`` and ``scatter_gated`` dispatch to the fastest available backend (CUDA
extension, Triton, plain torch); see :mod:`megatron_xmod.xmod.permute.dispatch`. The plain-torch
definitions that every backend is tested against are in :mod:`megatron_xmod.xmod.permute.reference`.
"""
from megatron_xmod.xmod.permute.dispatch import (
    BACKENDS,
    ENV_BACKEND,
    ResidualGrad,
    gather_tokens,
    scatter_gated,
    selected_backend,
    set_backend,
)

__all__ = ["gather_tokens", "scatter_gated", "ResidualGrad", "set_backend", "selected_backend", "BACKENDS", "ENV_BACKEND"]
