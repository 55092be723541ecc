"""Forwarding module: the block spec lives in :mod:`megatron_xmod.xmod.block` (kept for launch scripts that import it here)."""
from megatron_xmod.xmod.block import get_xmod_decoder_block_spec  # noqa: F401
