"""Decode steps of fixed shapes at fixed addresses: what one CUDA graph can capture and replay.

A routed model's default decode path (``XModModel._decode_sparse_run``) lets the host decide which
sparse layer runs next, so it reads the device once per routing event (~24 reads a token at X-MoD
A4K8, batch 1) and launches every kernel from Python. The fixed-shape path here keeps everything a
decode step reads and writes in buffers allocated once, after the prefill:

- dense layers: keys and values ``[batch, kv_heads, max_cache_len, head_dim]`` and ``key_valid``
  ``[batch, max_cache_len]``, written at ``column`` (a device counter, the same for every dense layer);
- sparse layers: one flat buffer of keys and values ``[1, kv_heads, slots, head_dim]`` holding every
  sequence's region (``starts`` ``[batch]``) and ``lengths`` ``[batch]`` (entries a sequence holds, on the
  device); a sequence's entries are its routed tokens in token order, as in
  :class:`~cache.SparseKVLayer`. A region is as long as the sequence's entries after the prefill plus the
  tokens left to ``max_cache_len`` (a decode step adds at most one entry a sequence), so no step ever
  grows a buffer or asks the device how full one is, and no sequence is padded to the busiest one (one
  sparse layer routed 4 to 82 tokens of 256-token prompts across a batch of 8: bench/README.md);
- the step's inputs (token ids, positions, which tokens are valid) and its output (the hidden states
  after the final norm).

A sparse layer decides on the device (router, threshold, token-choice bias) and runs its attention and
MLP under :meth:`StaticDecodeState.branch`: the body computes every sequence's row (at decode a layer's
cost is reading its weights, which one row reads as well as eight), appends every sequence's key and
value at that sequence's ``lengths`` and adds the gated update to the routed rows only; ``lengths`` then
grows by one where the token was routed, so a sequence that did not route it overwrites that entry at
its next routed step. Eagerly the branch is a Python ``if`` on ``any(routed)`` (one read a sparse
layer, free on a CPU); under CUDA-graph capture it is a conditional IF node, so the device skips a
layer that routes no token and a replayed step makes no host read at all.

Attention: a dense layer's reads its whole buffer with a mask (the columns past ``column``), as
transformers' static cache does; a sparse layer's reads each sequence's region up to its entries on a
GPU (region_attention.py's Triton kernel, whose loop bounds live on the device), and elsewhere the
batch's queries attend together over the whole flat buffer, each masked to its own region.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Optional

import torch

try:  # an exported folder: the verbatim copy next to this file
    from .region_attention import region_attention
except ImportError:  # inside the megatron_xmod package
    from megatron_xmod.hf.region_attention import region_attention


_PROBED: dict = {}  # CUDA device -> whether a conditional node captured and replayed correctly there


def conditional_nodes_available(device: Optional[torch.device] = None) -> bool:
    """CUDA graphs with IF nodes work on ``device`` (None: the current CUDA device): not ROCm, a torch that
    captures them, and a driver and CUDA (>= 12.4) that run them: one tiny capture, replayed with the flag
    false and true, probed once a device."""
    if (not torch.cuda.is_available() or torch.version.hip is not None
            or not hasattr(torch.cuda.CUDAGraph, "begin_capture_to_if_node")):
        return False
    if device is None or device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _PROBED:
        _PROBED[device] = _conditional_node_works(device)
    return _PROBED[device]


def _conditional_node_works(device: torch.device) -> bool:
    try:
        with torch.cuda.device(device):
            flag = torch.zeros((), dtype=torch.bool, device=device)
            counter = torch.zeros(1, device=device)
            graph = torch.cuda.CUDAGraph()
            torch.cuda.synchronize(device)
            with torch.cuda.graph(graph, stream=torch.cuda.Stream(device)):
                graph.begin_capture_to_if_node(flag)
                try:
                    counter.add_(1)
                finally:
                    graph.end_capture_to_conditional_node()
            graph.replay()  # flag false: the body is skipped
            flag.fill_(True)
            graph.replay()
            torch.cuda.synchronize(device)
            return float(counter) == 1.0
    except Exception:  # noqa: BLE001 (any failure means: decode eagerly)
        return False


class StaticDecodeState:
    """The buffers of fixed-shape decode steps for one batch (module docstring), built from a prefilled
    :class:`~cache.XModCache`; ``max_cache_len``: the tokens a sequence may reach, prompt included."""

    def __init__(self, cache, max_cache_len: int, graphed: Optional[bool] = None, one_device: bool = True):
        filled = [layer for layer in cache.layers if layer.is_initialized]
        if not filled:
            raise ValueError("cache: a fixed-shape decode starts from a prefilled cache; run the prompt through the "
                             "model with this cache first")
        # batch, kv heads, head dim, key and value dtypes, device: the same in every layer
        if filled[0].sparse:
            entry = (filled[0].batch, *filled[0]._entry, filled[0].device)
        else:
            keys, values = filled[0].keys, filled[0].values
            entry = (keys.shape[0], keys.shape[1], keys.shape[3], keys.dtype, values.dtype, keys.device)
        seen = cache.get_seq_length()
        if seen >= max_cache_len:
            raise ValueError(f"max_cache_len: the prompt has {seen} tokens, max_cache_len is {max_cache_len}; "
                             "pass a max_cache_len above the prompt length plus the tokens to generate")
        self.max_cache_len, self.prompt_tokens = max_cache_len, seen
        self.sparse = [layer.sparse for layer in cache.layers]
        self.layers: list[tuple[torch.Tensor, ...]] = []
        for layer in cache.layers:
            self.layers.append(self._sparse_buffers(layer, entry, max_cache_len - seen) if layer.sparse
                               else self._dense_buffers(layer, max_cache_len))
        self.batch, self.device = entry[0], entry[5]
        self.column = torch.full((1,), seen, dtype=torch.long, device=self.device)
        self.input_ids = torch.zeros(self.batch, 1, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(self.batch, 1, dtype=torch.long, device=self.device)
        self.valid = torch.ones(self.batch, 1, dtype=torch.bool, device=self.device)
        self.hidden: Optional[torch.Tensor] = None  # [batch, 1, hidden], allocated by the first step
        self.steps = 0
        capturable = self.device.type == "cuda" and one_device and conditional_nodes_available(self.device)
        self.graphed = capturable if graphed is None else graphed
        if self.graphed and not capturable:
            raise ValueError("graphed: CUDA-graph capture of a decode step needs the model on one GPU whose torch, "
                             "driver and CUDA (>= 12.4) run conditional nodes "
                             "(torch.cuda.CUDAGraph.begin_capture_to_if_node); pass graphed=False")
        self.attention_backend = "auto"  # of the sparse layers' region attention: auto, torch or triton
        self.graph = None
        self._capturing = None  # the CUDA graph being captured, whose IF nodes branch() opens

    @staticmethod
    def _dense_buffers(layer, capacity: int) -> tuple[torch.Tensor, ...]:
        batch, heads, used, dim = layer.keys.shape
        keys = layer.keys.new_zeros(batch, heads, capacity, dim)
        values = layer.values.new_zeros(batch, heads, capacity, dim)
        key_valid = torch.zeros(batch, capacity, dtype=torch.bool, device=keys.device)
        keys[:, :, :used], values[:, :, :used], key_valid[:, :used] = layer.keys, layer.values, layer.valid
        return keys, values, key_valid

    @staticmethod
    def _sparse_buffers(layer, entry, headroom: int) -> tuple[torch.Tensor, ...]:
        """A sparse layer's valid entries, each sequence's packed at the start of its region (a sequence whose
        entries are not all valid: one host read, once); ``entry``: (batch, kv heads, head dim, key dtype,
        value dtype, device)."""
        batch, heads, dim, key_dtype, value_dtype, device = entry
        kept = []
        for row in range(layer.batch if layer.is_initialized else 0):
            keys, values, valid, _ = layer.sequence(row)
            if not layer.all_valid[row]:
                keep = valid.nonzero().flatten()
                keys, values = keys.index_select(1, keep), values.index_select(1, keep)
            kept.append((keys, values))
        lengths = [k.shape[1] for k, _ in kept] or [0] * batch
        starts = [sum(lengths[:row]) + row * headroom for row in range(batch)]
        keys = torch.zeros(1, heads, sum(lengths) + batch * headroom, dim, dtype=key_dtype, device=device)
        values = torch.zeros_like(keys, dtype=value_dtype)
        for (k, v), start in zip(kept, starts):
            keys[0, :, start:start + k.shape[1]], values[0, :, start:start + v.shape[1]] = k, v
        return (keys, values, torch.tensor(lengths, dtype=torch.long, device=device),
                torch.tensor(starts, dtype=torch.long, device=device))

    def buffers(self) -> list[torch.Tensor]:
        """Every tensor a step reads or writes that outlives it."""
        fixed = [self.column, self.input_ids, self.positions, self.valid]
        return fixed + [t for layer in self.layers for t in layer] + ([] if self.hidden is None else [self.hidden])

    # -- what a step calls ----------------------------------------------------------------------------
    def attention(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Append this step's keys and values ``[batch, kv_heads, 1, head_dim]`` to layer ``layer_idx``'s
        buffers and attend: each query ``[batch, heads, 1, head_dim]`` to its sequence's entries and its own.
        Returns ``[batch, heads, 1, head_dim]``. A sparse layer's regions go through
        :func:`~region_attention.region_attention` (``attention_backend``)."""
        if self.sparse[layer_idx]:
            key_buffer, value_buffer, lengths, starts = self.layers[layer_idx]
            at = starts + lengths  # each sequence's next slot
            key_buffer[0].index_copy_(1, at, k[:, :, 0].transpose(0, 1))
            value_buffer[0].index_copy_(1, at, v[:, :, 0].transpose(0, 1))
            return region_attention(q, key_buffer, value_buffer, starts, at + 1, scale, self.attention_backend)
        key_buffer, value_buffer, key_valid = self.layers[layer_idx]
        key_buffer.index_copy_(2, self.column, k)
        value_buffer.index_copy_(2, self.column, v)
        key_valid.index_copy_(1, self.column, self.valid)
        allowed = key_valid.index_fill(1, self.column, True)  # a padding token attends to itself
        return torch.nn.functional.scaled_dot_product_attention(q, key_buffer, value_buffer,
                                                                attn_mask=allowed[:, None, None, :], scale=scale,
                                                                enable_gqa=q.shape[1] != key_buffer.shape[1])

    def advance_sparse(self, layer_idx: int, routed: torch.Tensor) -> None:
        """Keep this step's entry of layer ``layer_idx`` for the sequences that routed it (``routed`` ``[batch, 1]``)."""
        self.layers[layer_idx][2].add_(routed.view(-1))

    def branch(self, pred: torch.Tensor, body: Callable[[], None]) -> None:
        """Run ``body()`` when the 0-dim bool ``pred`` is True: an IF node under CUDA-graph capture (the
        device decides), else a Python ``if`` (one read)."""
        if self._capturing is not None:
            self._capturing.begin_capture_to_if_node(pred)
            try:
                body()
            finally:
                self._capturing.end_capture_to_conditional_node()
        elif bool(pred):
            body()

    # -- running steps --------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, run: Callable[[StaticDecodeState], torch.Tensor], input_ids: torch.Tensor,
             positions: torch.Tensor, valid: Optional[torch.Tensor]) -> torch.Tensor:
        """One decode step: ``run(self)`` computes it from the input buffers and returns the final hidden
        states. Eager for the first step; with ``graphed`` the second step captures ``run`` as one CUDA graph
        and every step from then on replays it. Returns the output buffer (overwritten by the next step)."""
        if self.prompt_tokens + self.steps + 1 > self.max_cache_len:
            raise ValueError(f"max_cache_len: the cache holds {self.max_cache_len} tokens a sequence and is full; "
                             "generate fewer tokens or pass a larger max_cache_len")
        self.input_ids.copy_(input_ids)
        self.positions.copy_(positions)
        if valid is None:
            self.valid.fill_(True)
        else:
            self.valid.copy_(valid)
        if self.graph is None and self.graphed and self.steps >= 1:
            self._capture(run)
        if self.graph is not None:
            with self._on_device():
                self.graph.replay()
        else:
            hidden = run(self)
            if self.hidden is None:
                self.hidden = torch.empty_like(hidden)
            self.hidden.copy_(hidden)
        self.steps += 1
        return self.hidden

    def _capture(self, run) -> None:
        """Capture ``run`` (one step writing ``self.hidden``) as a CUDA graph. The layers that routed no token
        in the eager steps have not run their kernels yet: a first, relaxed capture into a graph that is
        thrown away initialises them (a capture executes nothing, so the state is untouched), as torch's own
        ``ControlFlowOpWarmupDispatchMode`` warms both sides of a ``torch.cond``."""
        def body():
            self.hidden.copy_(run(self))

        with self._on_device():
            # a stream of the state's device: torch.cuda.graph's default capture stream is created on
            # whichever device was current when it was first used
            stream = None
            if self.device.type == "cuda":
                stream = torch.cuda.Stream(self.device)
                torch.cuda.synchronize(self.device)
            for mode in ("relaxed", "global"):
                graph = torch.cuda.CUDAGraph()
                self._capturing = graph
                try:
                    with torch.cuda.graph(graph, stream=stream, capture_error_mode=mode):
                        body()
                finally:
                    self._capturing = None
        self.graph = graph

    def _on_device(self):
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def nbytes(self, valid_only: bool = False, allocated: bool = False) -> dict:
        """As :meth:`~cache.XModCache.nbytes` (``valid_only`` reads the device)."""
        per_layer = []
        for sparse, (keys, values, third, *_) in zip(self.sparse, self.layers):
            batch, heads, capacity, dim = keys.shape
            per_entry = heads * dim * (keys.element_size() + values.element_size())
            if allocated:
                count = batch * capacity
            elif sparse:
                count = int(third.sum())
            else:
                count = int(third.sum()) if valid_only else batch * int(self.column)
            per_layer.append(count * per_entry)
        sparse = sum(b for b, s in zip(per_layer, self.sparse) if s)
        return {"sparse": sparse, "dense": sum(per_layer) - sparse, "total": sum(per_layer), "per_layer": per_layer}

    def entries(self) -> list[int]:
        """Valid cached entries per layer, summed over the batch (one device read)."""
        counts = [third.sum() for third in (layer[2] for layer in self.layers)]
        return [int(c) for c in torch.stack(counts).tolist()]
