"""Sparse KV cache for generation with routed (MoD / X-MoD) models.

A sparse layer attends only among the tokens it routed, so it only ever needs the keys and values
of those tokens: its cache layer grows by one entry per *routed* token (about 1/K of them under the
threshold rule), a dense layer's by one per token. Keys are stored after RoPE, i.e. at the token's
original position, which is also kept (``positions``: for inspection, and for ``XModCache.crop``).

In a batch, sequences route different tokens, so a sparse layer keeps one buffer per sequence, as
long as that sequence's entries: a pass (a prefill or a decode step) appends each sequence's routed
tokens on their own, for the sequences that route any (when a decode token's routing is too close to
call and the layer knows only that some sequence routes its token, every sequence gets an entry,
invalid where not routed). A dense layer keeps every token of every sequence in one batched buffer;
left padding enters it as invalid entries. Attention reads ``valid`` as its key mask.

The token-choice bias (Eq.8 of the X-MoD paper) needs no cache: a token's bias in a layer depends
only on its own decisions in the previous sparse layers of the block, all taken in the forward pass
that processes the token, so the model hands it from layer to layer within the pass.

``XModCache(config, max_cache_len=N)`` decodes on fixed-shape buffers instead (static_decode.py): after
the prefill, the first decode step moves the entries into buffers sized for N tokens a sequence, which
one CUDA graph can replay.

This file is copied verbatim into exported model folders: it imports only torch, transformers and
static_decode.py.
"""
from __future__ import annotations

from typing import Optional

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

try:  # an exported folder: the verbatim copy next to this file
    from .static_decode import StaticDecodeState, check_sparse_room
except ImportError:  # inside the megatron_xmod package
    from megatron_xmod.hf.static_decode import StaticDecodeState, check_sparse_room


def tokens_to_drop(tokens_to_remove: int) -> int:
    """The number of tokens ``crop(tokens_to_remove)`` drops: transformers' convention is a count <= 0."""
    if tokens_to_remove > 0:
        raise ValueError(f"crop: tokens_to_remove is minus the number of tokens to drop (transformers' "
                         f"convention), got {tokens_to_remove}; pass -{tokens_to_remove}")
    return -tokens_to_remove


class _KVLayer(CacheLayerMixin):
    """What both layer caches share: transformers' interface around ``update`` / ``select_batch``."""

    is_compileable = False
    is_croppable = True  # through XModCache.crop, which knows the positions of the tokens it drops
    sparse = False

    def get_seq_length(self) -> int:
        return self.used

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.used + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.select_batch(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.select_batch(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            picked = [i for i in range(self.batch) for _ in range(repeats)]
            self.select_batch(torch.tensor(picked), picked)

    def entries_per_sequence(self) -> list[int]:
        """Valid entries of each sequence (a device read each)."""
        if not self.is_initialized:
            return []
        return [int(self.sequence(row)[2].sum()) for row in range(self.batch)]


class DenseKVLayer(_KVLayer):
    """K/V of a dense layer, which caches every token of every sequence (left padding as invalid
    entries): preallocated buffers ``[batch, kv_heads, capacity, head_dim]`` and ``valid`` / ``positions``
    ``[batch, capacity]``, every sequence at the same column. ``keys`` / ``values`` / ``valid`` /
    ``positions`` are views of the columns in use. The buffers grow by an eighth (at least 16 columns)
    when full: a decode step writes its entry, not a copy of the layer's cache (``torch.cat`` in
    transformers' ``DynamicLayer``)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.valid: Optional[torch.Tensor] = None
        self.positions: Optional[torch.Tensor] = None
        self.used = 0
        self.all_valid = True  # no invalid entry was ever appended (valid=None each time): attention needs no mask
        self._buffers: Optional[tuple[torch.Tensor, ...]] = None  # keys, values, valid, positions at full capacity

    @property
    def batch(self) -> int:
        return 0 if self._buffers is None else self._buffers[0].shape[0]

    @property
    def capacity(self) -> int:
        return 0 if self._buffers is None else self._buffers[0].shape[2]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, dim = key_states.shape
        self.device = key_states.device
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
        keys, values, valid, positions = self._buffers
        self.keys, self.values = keys[:, :, :self.used], values[:, :, :self.used]
        self.valid, self.positions = valid[:, :self.used], positions[:, :self.used]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, valid: Optional[torch.Tensor] = None,
               positions: Optional[torch.Tensor] = None, rows: Optional[list[int]] = None, *args, **kwargs):
        """Append ``[batch, kv_heads, new, head_dim]`` entries, one per token of every sequence (``valid``
        None: all of them valid). Returns ``(keys, values, valid, new_columns)`` over the columns in use
        (``new_columns`` ``[batch, new]``: the columns of the appended entries); ``valid`` and
        ``new_columns`` are None while every entry ever appended was valid (this pass's are the last columns)."""
        if rows is not None:
            raise ValueError("rows: a dense layer's cache appends for every sequence of the batch")
        batch, _, new, _ = key_states.shape
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, self.used = self.used, self.used + new
        self._reserve(self.used)
        keys, values, valid_buffer, position_buffer = self._buffers
        keys[:, :, start:self.used] = key_states
        values[:, :, start:self.used] = value_states
        valid_buffer[:, start:self.used] = True if valid is None else valid
        position_buffer[:, start:self.used] = -1 if positions is None else positions
        self.all_valid = self.all_valid and valid is None
        self._set_views()
        if self.all_valid:  # this pass's entries are the last columns of every sequence, as the attention assumes
            return self.keys, self.values, None, None
        new_columns = torch.arange(start, self.used, device=keys.device).expand(batch, new)
        return self.keys, self.values, self.valid, new_columns

    def sequence(self, row: int) -> tuple[torch.Tensor, ...]:
        """Views of sequence ``row``'s entries in use: keys and values ``[kv_heads, n, head_dim]``, valid and
        positions ``[n]``."""
        return self.keys[row], self.values[row], self.valid[row], self.positions[row]

    def keep_tokens(self, count: int) -> None:
        """Drop every column past the first ``count`` (one a token)."""
        if self.is_initialized and count < self.used:
            self.used = count
            self._set_views()

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` columns (transformers' convention: a count <= 0)."""
        self.keep_tokens(self.used - tokens_to_drop(tokens_to_remove))

    def entries_per_sequence(self) -> list[int]:
        """Valid entries of each sequence (one device read)."""
        return self.valid.sum(1).tolist() if self.is_initialized else []

    def reset(self) -> None:
        self.keys = self.values = self.valid = self.positions = self._buffers = None
        self.used = 0
        self.all_valid = True
        self.is_initialized = False

    def offload(self):
        if self.is_initialized:
            self._buffers = tuple(t.to("cpu", non_blocking=True) for t in self._buffers)
            self._set_views()

    def prefetch(self):
        if self.is_initialized and self._buffers[0].device != self.device:
            self._buffers = tuple(t.to(self.device, non_blocking=True) for t in self._buffers)
            self._set_views()

    def select_batch(self, indices: torch.Tensor, picked: Optional[list[int]] = None) -> None:
        """Keep the sequences ``indices`` (in that order)."""
        if self.is_initialized:
            indices = indices.to(self._buffers[0].device)
            self._buffers = tuple(t.index_select(0, indices) for t in self._buffers)
            self._set_views()

    def nbytes(self, valid_only: bool = False, allocated: bool = False) -> int:
        """Bytes of the keys and values in use; ``valid_only``: valid entries only; ``allocated``: the whole
        preallocated buffers."""
        if not self.is_initialized:
            return 0
        batch, heads, capacity, dim = self._buffers[0].shape
        per_entry = heads * dim * (self._buffers[0].element_size() + self._buffers[1].element_size())
        count = int(self.valid.sum()) if valid_only else batch * (capacity if allocated else self.used)
        return count * per_entry


class SparseKVLayer(_KVLayer):
    """K/V of a sparse layer: one buffer per sequence (keys and values ``[kv_heads, capacity, head_dim]``,
    ``valid`` / ``positions`` ``[1, capacity]``), each as long as that sequence's own entries (plus growth),
    so a batch holds what each of its sequences routed and no padding: sequences route very different
    numbers of tokens (one sparse layer of the batch-8 benchmark routed 4 to 82 of a prompt's 256), and
    one buffer as wide as the busiest sequence held ~2.8x the valid entries at batch 8.

    The model appends each sequence's routed tokens of a pass (a prefill's or a decode step's) on their
    own. The fill of each sequence is kept on the host (``fills``: the model always knows how many entries
    it appends where, so no write reads the device). A buffer grows by an eighth (at least 16 entries)
    when full: an append is a write, not a copy of the sequence's cache.
    """

    sparse = True

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.fills: list[int] = []
        self.all_valid: list[bool] = []  # a sequence's entries were all appended as valid (valid=None): no mask
        self._offloaded = False
        self._sequences: list[Optional[tuple[torch.Tensor, ...]]] = []  # keys, values, valid, positions a sequence

    @property
    def batch(self) -> int:
        return len(self.fills)

    @property
    def used(self) -> int:
        """Entries of the longest sequence."""
        return max(self.fills, default=0)

    def capacity(self, row: int) -> int:
        stored = self._sequences[row]
        return 0 if stored is None else stored[0].shape[1]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor,
                            batch: Optional[int] = None) -> None:
        _, heads, _, dim = key_states.shape
        batch = key_states.shape[0] if batch is None else batch
        self.device = key_states.device
        self._entry = (heads, dim, key_states.dtype, value_states.dtype)
        self.fills = [0] * batch
        self.all_valid = [True] * batch
        self._sequences = [None] * batch
        self.is_initialized = True

    def _reserve(self, row: int, entries: int) -> tuple[torch.Tensor, ...]:
        stored = self._sequences[row]
        if entries <= self.capacity(row):
            return stored
        capacity = entries + max(16, entries // 8)
        heads, dim, key_dtype, value_dtype = self._entry
        grown = (torch.zeros(heads, capacity, dim, dtype=key_dtype, device=self.device),
                 torch.zeros(heads, capacity, dim, dtype=value_dtype, device=self.device),
                 torch.zeros(1, capacity, dtype=torch.bool, device=self.device),
                 torch.full((1, capacity), -1, dtype=torch.long, device=self.device))
        if stored is not None:
            fill = self.fills[row]
            for buffer, old in zip(grown, stored):
                buffer[:, :fill] = old[:, :fill]
        self._sequences[row] = grown
        return grown

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, valid: Optional[torch.Tensor] = None,
               positions: Optional[torch.Tensor] = None, rows: Optional[list[int]] = None,
               batch: Optional[int] = None, *args, **kwargs):
        """Append ``new`` entries ``[n, kv_heads, new, head_dim]`` for the sequences ``rows`` (ascending batch
        rows; None: every sequence) of a batch of ``batch``
        sequences (needed when the first append is for some of them); ``valid`` None: all of them valid.
        Returns ``(keys, values, valid, new_columns)`` of those sequences (``[n, kv_heads, keys, head_dim]``,
        ``[n, keys]``; ``new_columns`` ``[n, new]`` the columns of this pass's entries; four values where
        transformers' layers return keys and values: the model's attention reads all four).

        One sequence (a prefill's or a decode step's routing sequence, the model's only call): views of its
        buffer, no copy, and ``valid`` / ``new_columns`` None while every entry the sequence ever appended
        was valid (this pass's entries are then its last ``new`` keys; attention needs no padding mask).
        Several: their entries so far padded to the longest, then this pass's."""
        n, _, new, _ = key_states.shape
        if not self.is_initialized:
            if rows is not None and batch is None:
                raise ValueError("batch: the first append for some sequences (rows) needs the batch size")
            self.lazy_initialization(key_states, value_states, batch)
        if rows is None:
            rows = list(range(self.batch))
        if n == 1:
            row, start = rows[0], self.fills[rows[0]]
            keys, values, key_valid, key_positions = self._reserve(row, start + new)
            end = start + new
            keys[:, start:end] = key_states[0]
            values[:, start:end] = value_states[0]
            key_valid[:, start:end] = True if valid is None else valid
            key_positions[:, start:end] = -1 if positions is None else positions
            self.fills[row] = end
            self.all_valid[row] = self.all_valid[row] and valid is None
            if self.all_valid[row]:
                return keys[None, :, :end], values[None, :, :end], None, None
            columns = torch.arange(start, end, device=key_states.device)[None]
            return keys[None, :, :end], values[None, :, :end], key_valid[:, :end], columns
        if valid is None:
            valid = torch.ones(n, new, dtype=torch.bool, device=key_states.device)
        else:
            for row in rows:
                self.all_valid[row] = False
        if positions is None:
            positions = torch.full((n, new), -1, dtype=torch.long, device=key_states.device)
        # a sequence's entries along dim 1 of each of its buffers: [kv_heads, new, head_dim] and [1, new]
        entries = (key_states, value_states, valid[:, None], positions[:, None])
        starts = [self.fills[r] for r in rows]
        # A host-to-device copy of n integers, no sync: only direct callers append several rows at once
        # (the model appends sequence by sequence).
        new_columns = (torch.tensor(starts, device=key_states.device)[:, None]
                       + torch.arange(new, device=key_states.device))
        heads, dim, _, _ = self._entry
        width = max(starts) + new
        padded = (key_states.new_zeros(n, heads, width, dim), value_states.new_zeros(n, heads, width, dim),
                  valid.new_zeros(n, 1, width), positions.new_full((n, 1, width), -1))
        for i, (row, start) in enumerate(zip(rows, starts)):
            stored = self._reserve(row, start + new)
            for buffer, old, entry in zip(padded, stored, entries):
                old[:, start:start + new] = entry[i]
                buffer[i, :, :start + new] = old[:, :start + new]
            self.fills[row] += new
        return padded[0], padded[1], padded[2][:, 0], new_columns

    def sequence(self, row: int) -> tuple[torch.Tensor, ...]:
        """Views of sequence ``row``'s entries: keys and values ``[kv_heads, n, head_dim]``, valid and
        positions ``[n]``."""
        fill, stored = self.fills[row], self._sequences[row]
        if stored is None:
            heads, dim, key_dtype, value_dtype = self._entry
            return (torch.zeros(heads, 0, dim, dtype=key_dtype, device=self.device),
                    torch.zeros(heads, 0, dim, dtype=value_dtype, device=self.device),
                    torch.zeros(0, dtype=torch.bool, device=self.device),
                    torch.zeros(0, dtype=torch.long, device=self.device))
        keys, values, valid, positions = (buffer[:, :fill] for buffer in stored)
        return keys, values, valid[0], positions[0]

    def entries_before(self, cut: torch.Tensor) -> torch.Tensor:
        """``[batch, 2]`` on the device: for each sequence, how many of its entries lie at positions before
        ``cut[row]``, and 1 if those are its first entries (positions in token order, as the model appends
        them), else 0."""
        counts = []
        for row, (fill, stored) in enumerate(zip(self.fills, self._sequences)):
            if stored is None:
                counts.append(torch.tensor([0, 1], device=cut.device))
                continue
            before = (stored[3][0, :fill] < cut[row].to(stored[3].device)).long()
            # the entries before the cut come first iff the running product (1 until the first entry at or
            # past it) sums to as many
            count = before.sum()
            counts.append(torch.stack([count, (before.cumprod(0).sum() == count).long()]).to(cut.device))
        return torch.stack(counts) if counts else cut.new_zeros(0, 2)

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("crop: a sparse layer holds entries of the tokens it routed, not one a token, so it cannot "
                         "tell alone which to drop; crop the XModCache, which knows the dropped tokens' positions")

    def keep_entries(self, counts: list[int]) -> None:
        """Keep the first ``counts[row]`` entries of each sequence (appends are in token order)."""
        self.fills = [min(fill, count) for fill, count in zip(self.fills, counts)]

    def reset(self) -> None:
        self._sequences, self.fills, self.all_valid = [], [], []
        self._offloaded = False
        self.is_initialized = False

    def _move(self, device) -> None:
        self._sequences = [None if stored is None else tuple(t.to(device, non_blocking=True) for t in stored)
                           for stored in self._sequences]

    def offload(self):
        if self.is_initialized:
            self._move("cpu")
            self._offloaded = True

    def prefetch(self):
        if self.is_initialized and self._offloaded:
            self._move(self.device)
            self._offloaded = False

    def select_batch(self, indices: torch.Tensor, picked: Optional[list[int]] = None) -> None:
        """Keep the sequences ``indices`` (in that order; ``picked``: the same on the host, else read). A
        sequence kept twice (beam search) gets a copy of its buffers."""
        if self.is_initialized:
            picked = indices.tolist() if picked is None else picked
            kept, sequences = set(), []
            for row in picked:
                stored = self._sequences[row]
                if row in kept and stored is not None:
                    stored = tuple(t.clone() for t in stored)
                kept.add(row)
                sequences.append(stored)
            self._sequences = sequences
            self.fills = [self.fills[row] for row in picked]
            self.all_valid = [self.all_valid[row] for row in picked]

    def nbytes(self, valid_only: bool = False, allocated: bool = False) -> int:
        """Bytes of the keys and values in use (each sequence's entries); ``valid_only``: valid entries
        only; ``allocated``: the whole buffers."""
        if not self.is_initialized:
            return 0
        heads, dim, key_dtype, value_dtype = self._entry
        per_entry = heads * dim * (torch.empty((), dtype=key_dtype).element_size()
                                   + torch.empty((), dtype=value_dtype).element_size())
        if valid_only:
            count = sum(self.entries_per_sequence())
        else:
            count = sum(map(self.capacity, range(self.batch))) if allocated else sum(self.fills)
        return count * per_entry


class XModCache(Cache):
    """A :class:`SparseKVLayer` per sparse decoder layer, a :class:`DenseKVLayer` per dense one;
    ``get_seq_length`` counts tokens seen (not entries).

    ``max_cache_len``: decode on fixed-shape buffers for that many tokens a sequence (prompt included;
    :class:`StaticDecodeState`, built from this cache's entries at the first decode step, or the model's
    state of an earlier generation refilled with them; ``graphed``: capture
    the step as a CUDA graph, by default where the GPU and torch can; ``sparse_room``: "adaptive" or "full",
    the room of the sparse layers' regions, static_decode.py). What generate's greedy search and
    sampling need works on it; beam search, assisted decoding and ``crop`` need the default cache."""

    def __init__(self, config=None, num_layers: Optional[int] = None, sparse_layers: Optional[list] = None,
                 max_cache_len: Optional[int] = None, graphed: Optional[bool] = None, sparse_room: str = "adaptive"):
        if config is not None:
            num_layers = config.num_hidden_layers
            sparse_layers = [config.is_sparse(i) for i in range(num_layers)]
        if num_layers is None:
            raise ValueError("num_layers: XModCache needs the model config or the number of layers")
        sparse_layers = sparse_layers or [False] * num_layers
        super().__init__(layers=[SparseKVLayer() if s else DenseKVLayer() for s in sparse_layers])
        if max_cache_len is not None and not (isinstance(max_cache_len, int) and max_cache_len > 0):
            raise ValueError(f"max_cache_len: the tokens a sequence may reach must be a positive integer, got "
                             f"{max_cache_len!r}")
        self.max_cache_len, self.graphed, self.sparse_room = max_cache_len, graphed, check_sparse_room(sparse_room)
        self.static: Optional[StaticDecodeState] = None
        self._released = False  # the fixed-shape buffers went to a newer cache (release_static)
        self.seen_tokens = 0
        self.sequences: Optional[int] = None  # the batch size of the current pass (begin_pass)
        # positions [b, n] and valid [b, n] (None: all) of every pass's tokens, for crop
        self._passes: list[tuple[torch.Tensor, Optional[torch.Tensor]]] = []

    def update(self, key_states, value_states, layer_idx: int, valid=None, positions=None, rows=None,
               *args, **kwargs):
        self._refuse_when_static("update")
        return self.layers[layer_idx].update(key_states, value_states, valid, positions, rows, self.sequences)

    def static_state(self, one_device: bool = True, reuse: Optional[StaticDecodeState] = None,
                     model=None) -> StaticDecodeState:
        """The fixed-shape decode buffers (``max_cache_len``), built from the entries so far at the first
        call; the per-layer caches are emptied then (their entries live in the buffers). ``one_device``: the
        model's parameters are on one device (a CUDA graph captures one). ``reuse``: the state of an earlier
        generation of ``model``, refilled with these entries where it can take them
        (:meth:`StaticDecodeState.refill`: its buffers and captured graph kept), else left alone."""
        if self.static is None:
            self._refuse_when_released("a decode step")
            settings = (self.graphed, one_device, self.sparse_room)
            if reuse is not None and reuse.refill(self, self.max_cache_len, *settings, model=model):
                self.static = reuse
            else:
                self.static = StaticDecodeState(self, self.max_cache_len, *settings, model=model)
            for layer in self.layers:
                layer.reset()
        return self.static

    def release_static(self) -> None:
        """Give up the fixed-shape buffers (a newer cache of the model took them over): later passes are refused."""
        self.static, self._released = None, True

    def _refuse_when_released(self, what: str) -> None:
        if self._released:
            raise ValueError(f"{what}: this cache's fixed-shape buffers were handed to a newer fixed-shape cache of "
                             "the same model (a model reuses one fixed-shape decode state, and its captured graph, "
                             "from one generation to the next); continue that generation, or start a new one with "
                             "a new cache")

    def _refuse_when_static(self, what: str) -> None:
        self._refuse_when_released(what)
        if self.static is not None:
            raise ValueError(f"{what}: a fixed-shape cache (max_cache_len) keeps its batch and entries in place; "
                             "beam search, assisted decoding and crop need XModCache without max_cache_len")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the sequences ``indices`` in every layer: one read of the indices for all layers."""
        self._refuse_when_static("batch_select_indices")
        picked = indices.tolist()
        for layer in self.layers:
            layer.select_batch(indices, picked)
        if self._passes:
            positions, valid = self._tokens()
            indices = indices.to(positions.device)
            self._passes = [(positions.index_select(0, indices), valid.index_select(0, indices))]

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._refuse_when_static("batch_repeat_interleave")
        super().batch_repeat_interleave(repeats)
        if self._passes:
            self._passes = [tuple(t.repeat_interleave(repeats, dim=0) for t in self._tokens())]

    def begin_pass(self, sequences: int, positions: Optional[torch.Tensor] = None,
                   valid: Optional[torch.Tensor] = None) -> None:
        """Called by the model before a forward pass over ``sequences`` sequences whose new tokens sit at
        ``positions`` ``[b, n]`` (``valid``: which are not padding; None: all), kept for :meth:`crop`."""
        self.sequences = sequences
        if positions is not None:  # copies: the caller may reuse its tensors for the next pass
            self._passes.append((positions.clone(), None if valid is None else valid.clone()))
            if len(self._passes) > 64:  # a decode step is a pass: keep one tensor, not one per token
                self._passes = [self._tokens()]

    def _tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions and valid ``[b, tokens seen]`` of every token passed so far."""
        positions = torch.cat([p for p, _ in self._passes], dim=1)
        valid = torch.cat([torch.ones_like(p, dtype=torch.bool) if v is None else v for p, v in self._passes], dim=1)
        return positions, valid

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens of every sequence (transformers' convention: a count <= 0;
        assisted decoding drops a rejected draft's tail so). Dense layers drop their last columns. A sparse
        layer holds a sequence's routed tokens in token order, at increasing positions, so it drops those at
        or past the position of the sequence's first dropped (valid) token: one device read for all layers.
        Valid entries come out exactly as in a cache that never saw the dropped tokens; an invalid entry
        (a padding token's, masked by attention) may stay. Entries out of token order (padding inside a pass
        at positions given by ``position_ids``) are refused before anything is dropped."""
        drop = tokens_to_drop(tokens_to_remove)
        if drop == 0:
            return
        self._refuse_when_static("crop")
        if drop > self.seen_tokens:
            raise ValueError(f"crop: cannot drop {drop} tokens, the cache has seen {self.seen_tokens}")
        if sum(p.shape[1] for p, _ in self._passes) != self.seen_tokens:
            raise ValueError("crop: the cache does not know the positions of every token it holds (a forward pass "
                             "called begin_pass without them); crop needs XModModel's passes")
        keep = self.seen_tokens - drop
        positions, valid = self._tokens()
        dropped = torch.where(valid[:, keep:], positions[:, keep:], torch.iinfo(positions.dtype).max)
        cut = dropped.amin(1)  # [b]: the first dropped token's position (max: nothing valid dropped)
        sparse = [layer for layer in self.layers if layer.sparse and layer.is_initialized]
        counts = torch.stack([layer.entries_before(cut) for layer in sparse]).tolist() if sparse else []
        if not all(ordered for layer_counts in counts for _, ordered in layer_counts):
            raise ValueError("crop: a sparse layer holds entries whose positions are not in token order (padding "
                             "inside a pass, at positions given by position_ids), so the dropped tokens' entries "
                             "cannot be told apart; nothing was dropped")
        for layer, layer_counts in zip(sparse, counts):
            layer.keep_entries([count for count, _ in layer_counts])
        for layer in self.layers:
            if not layer.sparse:
                layer.crop(-drop)
        self._passes = [(positions[:, :keep], valid[:, :keep])]
        self.seen_tokens = keep

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
        self.static, self._released = None, False
        self.seen_tokens = 0
        self._passes = []

    def nbytes(self, valid_only: bool = False, allocated: bool = False) -> dict:
        """Cache bytes: ``{"sparse": ..., "dense": ..., "total": ..., "per_layer": [...]}`` (see
        :meth:`SparseKVLayer.nbytes`)."""
        self._refuse_when_released("nbytes")
        if self.static is not None:
            return self.static.nbytes(valid_only, allocated)
        per_layer = [layer.nbytes(valid_only, allocated) for layer in self.layers]
        sparse = sum(b for b, layer in zip(per_layer, self.layers) if layer.sparse)
        return {"sparse": sparse, "dense": sum(per_layer) - sparse, "total": sum(per_layer), "per_layer": per_layer}

    def entries(self) -> list[int]:
        """Valid cached entries per layer (summed over the batch)."""
        self._refuse_when_released("entries")
        if self.static is not None:
            return self.static.entries()
        return [sum(layer.entries_per_sequence()) for layer in self.layers]


def dense_cache_bytes(config, num_tokens: int, batch_size: int = 1, dtype: torch.dtype = torch.float32) -> int:
    """Bytes a dense KV cache (every layer keeps every token) holds after ``num_tokens`` tokens."""
    element = torch.empty((), dtype=dtype).element_size()
    per_token = 2 * config.num_key_value_heads * config.head_dim * element
    return config.num_hidden_layers * batch_size * num_tokens * per_token
