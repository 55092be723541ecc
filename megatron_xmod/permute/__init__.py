"""Routed-token permutation ops (gather the routed tokens, scatter the gated update back)."""
from megatron_xmod.permute.reference import gather_tokens, scatter_gated

__all__ = ["gather_tokens", "scatter_gated"]
