"""Sparse KV cache for generation with routed (MoD / X-MoD) models.

A sparse layer attends only among the tokens it routed, so it only ever needs the keys and values
of those tokens: its cache layer grows by one entry per *routed* token (about 1/K of them under the
threshold rule), a dense layer's by one per token. Keys are stored after RoPE, i.e. at the token's
original position, which is also kept (``positions``) for inspection.

In a batch, sequences route different tokens: an update appends the same number of entries to
every sequence (the most any sequence routed in that step) and marks the surplus invalid
(``valid``), the same padding the megatron layer uses for threshold routing; left padding enters
as invalid entries too. Attention reads ``valid`` as its key mask.

The token-choice bias (Eq.8 of the X-MoD paper) needs no cache: a token's bias in a layer depends
only on its own decisions in the previous sparse layers of the block, all taken in the forward pass
that processes the token, so the model hands it from layer to layer within the pass.

This file is copied verbatim into exported model folders: it imports only torch and transformers.
"""
from __future__ import annotations

from typing import Optional

import torch
from transformers.cache_utils import Cache, DynamicLayer


class SparseKVLayer(DynamicLayer):
    """K/V of one layer, ``[batch, kv_heads, entries, head_dim]``, plus ``valid`` / ``positions`` ``[batch, entries]``."""

    is_croppable = False

    def __init__(self, sparse: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.sparse = sparse
        self.valid: Optional[torch.Tensor] = None
        self.positions: Optional[torch.Tensor] = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, valid: Optional[torch.Tensor] = None,
               positions: Optional[torch.Tensor] = None, *args, **kwargs):
        """Append entries; returns (keys, values, valid) of the whole layer."""
        batch, _, new, _ = key_states.shape
        if valid is None:
            valid = torch.ones(batch, new, dtype=torch.bool, device=key_states.device)
        if positions is None:
            positions = torch.full((batch, new), -1, dtype=torch.long, device=key_states.device)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.keys, self.values, self.valid, self.positions = key_states, value_states, valid, positions
        else:
            self.keys = torch.cat([self.keys, key_states], dim=-2)
            self.values = torch.cat([self.values, value_states], dim=-2)
            self.valid = torch.cat([self.valid, valid], dim=-1)
            self.positions = torch.cat([self.positions, positions], dim=-1)
        return self.keys, self.values, self.valid

    def reset(self) -> None:
        self.valid = self.positions = None
        super().reset()

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("crop: a sparse layer's entries are not one per token; assisted decoding is not "
                                  "supported with XModCache")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self.keys, self.values, self.valid, self.positions = (
                t.repeat_interleave(repeats, dim=0) for t in (self.keys, self.values, self.valid, self.positions))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            indices = indices.to(self.keys.device)
            self.keys, self.values, self.valid, self.positions = (
                t.index_select(0, indices) for t in (self.keys, self.values, self.valid, self.positions))

    def nbytes(self, valid_only: bool = False) -> int:
        """Bytes of the stored keys and values (``valid_only``: counting valid entries only)."""
        if not self.is_initialized:
            return 0
        batch, heads, entries, dim = self.keys.shape
        per_entry = heads * dim * (self.keys.element_size() + self.values.element_size())
        count = int(self.valid.sum()) if valid_only else batch * entries
        return count * per_entry


class XModCache(Cache):
    """One :class:`SparseKVLayer` per decoder layer; ``get_seq_length`` counts tokens seen (not entries)."""

    def __init__(self, config=None, num_layers: Optional[int] = None, sparse_layers: Optional[list] = None):
        if config is not None:
            num_layers = config.num_hidden_layers
            sparse_layers = [config.is_sparse(i) for i in range(num_layers)]
        if num_layers is None:
            raise ValueError("num_layers: XModCache needs the model config or the number of layers")
        sparse_layers = sparse_layers or [False] * num_layers
        super().__init__(layers=[SparseKVLayer(sparse=bool(s)) for s in sparse_layers])
        self.seen_tokens = 0

    def update(self, key_states, value_states, layer_idx: int, valid=None, positions=None, *args, **kwargs):
        return self.layers[layer_idx].update(key_states, value_states, valid, positions)

    def advance(self, num_tokens: int) -> None:
        """Called by the model after each forward pass over ``num_tokens`` new tokens."""
        self.seen_tokens += num_tokens

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.layers[layer_idx].get_seq_length() + query_length, 0

    @property
    def is_compileable(self) -> bool:
        return False

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()
        self.seen_tokens = 0

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("crop: not supported by XModCache (sparse layers keep routed tokens only)")

    def nbytes(self, valid_only: bool = False) -> dict:
        """Cache bytes: ``{"sparse": ..., "dense": ..., "total": ..., "per_layer": [...]}``."""
        per_layer = [layer.nbytes(valid_only) for layer in self.layers]
        sparse = sum(b for b, layer in zip(per_layer, self.layers) if layer.sparse)
        return {"sparse": sparse, "dense": sum(per_layer) - sparse, "total": sum(per_layer), "per_layer": per_layer}

    def entries(self) -> list[int]:
        """Valid cached entries per layer (summed over the batch)."""
        return [0 if layer.valid is None else int(layer.valid.sum()) for layer in self.layers]


def dense_cache_bytes(config, num_tokens: int, batch_size: int = 1, dtype: torch.dtype = torch.float32) -> int:
    """Bytes a dense KV cache (every layer keeps every token) holds after ``num_tokens`` tokens."""
    element = torch.empty((), dtype=dtype).element_size()
    per_token = 2 * config.num_key_value_heads * config.head_dim * element
    return config.num_hidden_layers * batch_size * num_tokens * per_token
