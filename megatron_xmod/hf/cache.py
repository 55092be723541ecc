"""Sparse KV cache for generation with routed (MoD / X-MoD) models.

A sparse layer attends only among the tokens it routed, so it only ever needs the keys and values
of those tokens: its cache layer grows by one entry per *routed* token (about 1/K of them under the
threshold rule), a dense layer's by one per token. Keys are stored after RoPE, i.e. at the token's
original position, which is also kept (``positions``) for inspection.

In a batch, sequences route different tokens. A pass over several tokens (a prefill) runs a sparse
layer on the same number of tokens for every sequence (the most any sequence routed; the surplus is
padding, ``valid`` False, the same padding the megatron layer uses for threshold routing); the cache
keeps each sequence's valid entries first and the padding after them, past the sequence's fill, where
its next entries overwrite it. A decode step appends only for the sequences that route their new
token, each at its own next column (when a token's routing is too close to call, the layer routes
the whole batch itself and every sequence gets an entry, invalid where not routed). Left padding
enters dense layers as invalid entries. Attention reads ``valid`` as its key mask.

The token-choice bias (Eq.8 of the X-MoD paper) needs no cache: a token's bias in a layer depends
only on its own decisions in the previous sparse layers of the block, all taken in the forward pass
that processes the token, so the model hands it from layer to layer within the pass.

This file is copied verbatim into exported model folders: it imports only torch and transformers.
"""
from __future__ import annotations

from typing import Optional

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class SparseKVLayer(CacheLayerMixin):
    """K/V of one layer in preallocated buffers ``[batch, kv_heads, capacity, head_dim]``, plus ``valid`` /
    ``positions`` ``[batch, capacity]``.

    Each sequence fills its own columns in order: a decode step in a sparse layer appends only for
    the sequences that route their token there; the others' columns stay empty (invalid), so a batch
    does not pad every sequence to the busiest one step by step. The fill of each sequence is kept on
    the host (``fills``: the model always knows how many entries it appends where, so no write reads
    the device) and on the device (``_fills_device``: the write positions, so no write copies indices
    from the host). ``keys`` / ``values`` / ``valid`` / ``positions`` are views of the columns in use (up to the
    largest fill). Buffers grow by an eighth (at least 16 columns) when full: an append is a write,
    not a copy of the layer's cache.
    """

    is_compileable = False
    is_croppable = False

    def __init__(self, sparse: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.sparse = sparse
        self.valid: Optional[torch.Tensor] = None
        self.positions: Optional[torch.Tensor] = None
        self.fills: list[int] = []
        self._fills_device: Optional[torch.Tensor] = None
        self._buffers: Optional[tuple[torch.Tensor, ...]] = None  # keys, values, valid, positions at full capacity

    @property
    def used(self) -> int:
        """Columns in use: the largest fill of any sequence."""
        return max(self.fills, default=0)

    @property
    def capacity(self) -> int:
        return 0 if self._buffers is None else self._buffers[0].shape[2]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor,
                            batch: Optional[int] = None) -> None:
        _, heads, _, dim = key_states.shape
        batch = key_states.shape[0] if batch is None else batch
        self.device = key_states.device
        self.fills = [0] * batch
        self._fills_device = torch.zeros(batch, dtype=torch.long, device=self.device)
        self._buffers = (key_states.new_empty(batch, heads, 0, dim), value_states.new_empty(batch, heads, 0, dim),
                         torch.zeros(batch, 0, dtype=torch.bool, device=self.device),
                         torch.full((batch, 0), -1, dtype=torch.long, device=self.device))
        self.is_initialized = True

    def _reserve(self, columns: int) -> None:
        if columns <= self.capacity:
            return
        pad = columns + max(16, columns // 8) - self.capacity
        keys, values, valid, positions = self._buffers
        self._buffers = (torch.cat([keys, keys.new_zeros(*keys.shape[:2], pad, keys.shape[3])], dim=2),
                         torch.cat([values, values.new_zeros(*values.shape[:2], pad, values.shape[3])], dim=2),
                         torch.cat([valid, valid.new_zeros(valid.shape[0], pad)], dim=1),
                         torch.cat([positions, positions.new_full((positions.shape[0], pad), -1)], dim=1))

    def _set_views(self) -> None:
        used = self.used
        keys, values, valid, positions = self._buffers
        self.keys, self.values = keys[:, :, :used], values[:, :, :used]
        self.valid, self.positions = valid[:, :used], positions[:, :used]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, valid: Optional[torch.Tensor] = None,
               positions: Optional[torch.Tensor] = None, rows: Optional[list[int]] = None,
               row_index: Optional[torch.Tensor] = None, batch: Optional[int] = None, several_tokens: bool = False,
               *args, **kwargs):
        """Append ``new`` entries ``[n, kv_heads, new, head_dim]`` for the sequences ``rows`` (ascending batch
        rows; ``row_index`` the same on the device; None: every sequence) of a batch of ``batch``
        sequences (needed when the first append is for some of them); ``several_tokens``: the pass runs
        several tokens a sequence (a prefill), so padding is worth a read of the counts. Returns ``(keys, values,
        valid, new_columns)`` of those sequences over the columns any of them uses, ``new_columns``
        ``[n, new]`` the columns of the appended entries (four values where transformers' layers return
        keys and values: the model's attention reads all four). Keys and values of a part of the batch
        that is not a run of consecutive sequences are copies (``index_select``) of their columns."""
        n, _, new, _ = key_states.shape
        # A sparse layer's pass over several tokens of a batch pads each sequence to the busiest: its valid
        # entries go first and the padding after them, past its fill, where its next entries overwrite it;
        # decode steps then attend to valid entries only. One read of the counts (a prefill's).
        compact = self.sparse and several_tokens and valid is not None and n > 1
        added = valid.sum(1) if compact else None
        counts = added.tolist() if compact else [new] * n
        compact = compact and min(counts) < new
        if valid is None:
            valid = torch.ones(n, new, dtype=torch.bool, device=key_states.device)
        if positions is None:
            positions = torch.full((n, new), -1, dtype=torch.long, device=key_states.device)
        if not self.is_initialized:
            if rows is not None and batch is None:
                raise ValueError("batch: the first append for some sequences (rows) needs the batch size")
            self.lazy_initialization(key_states, value_states, batch)
        every = rows is None
        if every:
            rows = list(range(len(self.fills)))
        starts = [self.fills[r] for r in rows]
        width = max(starts) + new
        self._reserve(width)
        keys, values, valid_buffer, position_buffer = self._buffers
        steps = torch.arange(new, device=keys.device)
        if every and min(starts) == width - new and not compact:  # every sequence at the same column
            start = width - new
            keys[:, :, start:width] = key_states
            values[:, :, start:width] = value_states
            valid_buffer[:, start:width] = valid
            position_buffer[:, start:width] = positions
            self._fills_device += new
            new_columns = (start + steps).expand(n, new)
        else:
            if every:
                row_index = torch.arange(len(rows), device=keys.device)
            elif row_index is None:
                row_index = torch.tensor(rows, device=keys.device)  # a host-to-device copy: pass row_index
            index = row_index[:, None]
            if compact:
                order = torch.where(valid, valid.cumsum(1), added[:, None] + (~valid).cumsum(1)) - 1
            else:
                added, order = torch.full_like(row_index, new), steps
            new_columns = self._fills_device[row_index][:, None] + order
            keys[index, :, new_columns] = key_states.transpose(1, 2)
            values[index, :, new_columns] = value_states.transpose(1, 2)
            valid_buffer[index, new_columns] = valid
            position_buffer[index, new_columns] = positions
            self._fills_device.index_add_(0, row_index, added)
        for r, count in zip(rows, counts):
            self.fills[r] += count
        self._set_views()
        if every:
            return keys[:, :, :width], values[:, :, :width], valid_buffer[:, :width], new_columns
        if rows[-1] - rows[0] == len(rows) - 1:  # consecutive sequences (one, typically): views, no copy
            picked = slice(rows[0], rows[-1] + 1)
            return keys[picked, :, :width], values[picked, :, :width], valid_buffer[picked, :width], new_columns
        return (keys[:, :, :width].index_select(0, row_index), values[:, :, :width].index_select(0, row_index),
                valid_buffer[:, :width].index_select(0, row_index), new_columns)

    def get_seq_length(self) -> int:
        return self.used

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.used + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.keys = self.values = self.valid = self.positions = self._buffers = self._fills_device = None
        self.fills = []
        self.is_initialized = False

    def offload(self):
        if self.is_initialized:
            self._buffers = tuple(t.to("cpu", non_blocking=True) for t in self._buffers)
            self._fills_device = self._fills_device.to("cpu", non_blocking=True)
            self._set_views()

    def prefetch(self):
        if self.is_initialized and self._buffers[0].device != self.device:
            self._buffers = tuple(t.to(self.device, non_blocking=True) for t in self._buffers)
            self._fills_device = self._fills_device.to(self.device, non_blocking=True)
            self._set_views()

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("crop: a sparse layer's entries are not one per token; assisted decoding is not "
                                  "supported with XModCache")

    def select_batch(self, indices: torch.Tensor, picked: Optional[list[int]] = None) -> None:
        """Keep the sequences ``indices`` (in that order; ``picked``: the same on the host, else read)."""
        if self.is_initialized:
            indices = indices.to(self._buffers[0].device)
            self._buffers = tuple(t.index_select(0, indices) for t in self._buffers)
            self._fills_device = self._fills_device.index_select(0, indices)
            self.fills = [self.fills[i] for i in (indices.tolist() if picked is None else picked)]
            self._set_views()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.select_batch(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.select_batch(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            picked = [i for i in range(len(self.fills)) for _ in range(repeats)]
            self.select_batch(torch.tensor(picked), picked)

    def nbytes(self, valid_only: bool = False, allocated: bool = False) -> int:
        """Bytes of the keys and values in use (every sequence's columns up to the largest fill);
        ``valid_only``: valid entries only; ``allocated``: the whole preallocated buffers."""
        if not self.is_initialized:
            return 0
        batch, heads, capacity, dim = self._buffers[0].shape
        per_entry = heads * dim * (self._buffers[0].element_size() + self._buffers[1].element_size())
        count = int(self.valid.sum()) if valid_only else batch * (capacity if allocated else self.used)
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
        self.sequences: Optional[int] = None  # the batch size of the current pass (begin_pass)
        self.pass_tokens = 0  # tokens a sequence of the current pass

    def update(self, key_states, value_states, layer_idx: int, valid=None, positions=None, rows=None, row_index=None,
               *args, **kwargs):
        return self.layers[layer_idx].update(key_states, value_states, valid, positions, rows, row_index,
                                             self.sequences, self.pass_tokens > 1)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the sequences ``indices`` in every layer: one read of the indices for all layers."""
        picked = indices.tolist()
        for layer in self.layers:
            layer.select_batch(indices, picked)

    def begin_pass(self, sequences: int, tokens: int) -> None:
        """Called by the model before a forward pass over ``tokens`` new tokens of ``sequences`` sequences."""
        self.sequences, self.pass_tokens = sequences, tokens

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

    def nbytes(self, valid_only: bool = False, allocated: bool = False) -> dict:
        """Cache bytes: ``{"sparse": ..., "dense": ..., "total": ..., "per_layer": [...]}`` (see
        :meth:`SparseKVLayer.nbytes`)."""
        per_layer = [layer.nbytes(valid_only, allocated) for layer in self.layers]
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
