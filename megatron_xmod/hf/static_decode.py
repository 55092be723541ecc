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
  :class:`~cache.SparseKVLayer`. A region is the sequence's entries plus room for the entries it may
  add (a decode step adds at most one a sequence), and no sequence is padded to the busiest one (one
  sparse layer routed 4 to 82 tokens of 256-token prompts across a batch of 8: bench/README.md). How
  much room (``sparse_room``): "adaptive" (default) sizes it by the rate at which the sequence routed
  tokens to the layer so far, ``ROOM_SLACK`` times that over the tokens left plus ``ROOM_MARGIN``, and
  the host, which knows that no region can fill in fewer steps than its smallest free room, reads the
  counts back only then (one read, at most every ``ROOM_MARGIN // 2`` steps) and lays out again a layer
  whose regions run short (a new layout: a graph is captured again); "full" gives every region room for every
  token left to ``max_cache_len``, never reads and never lays out again, for ~K times the memory of a
  sparse layer's entries in a long generation;
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
import math
import warnings
from collections.abc import Callable
from typing import NamedTuple, Optional

import torch

try:  # an exported folder: the verbatim copy next to this file
    from .region_attention import region_attention
except ImportError:  # inside the megatron_xmod package
    from megatron_xmod.hf.region_attention import region_attention


_PROBED: dict = {}  # CUDA device -> whether a conditional node captured and replayed correctly there

SPARSE_ROOM_POLICIES = ("adaptive", "full")
# "adaptive" room: ROOM_SLACK x the entries a sequence's rate so far predicts for the tokens left, plus
# ROOM_MARGIN; a region runs short only where a sequence routes tokens to a layer at 1.5x its earlier rate
# or more, and the margin bounds how often the host reads the counts (at most every ROOM_MARGIN // 2 steps)
ROOM_SLACK = 1.5
ROOM_MARGIN = 16


def region_room(rate: float, remaining: int, policy: str = "adaptive") -> int:
    """Room in a sequence's region of a sparse layer for the ``remaining`` decode steps, the sequence routing
    tokens to the layer at ``rate``: every remaining step under "full", else ``ROOM_SLACK`` x the entries the
    rate predicts plus ``ROOM_MARGIN`` (at least 1, at most ``remaining``)."""
    if policy == "full":
        return remaining
    return min(remaining, max(1, math.ceil(remaining * rate * ROOM_SLACK) + ROOM_MARGIN))


class RegionLayout(NamedTuple):
    """The host's copy of a sparse layer's layout: each region's first slot and size (entries + room), and the
    entries each held and the tokens seen when it was laid out (the routing rates since then)."""

    starts: list[int]
    sizes: list[int]
    lengths: list[int]
    tokens: int


def extension_if_nodes():
    """megatron_xmod's CUDA extension where it opens IF nodes itself (csrc/graph_if_node.cu), for a torch whose
    ``CUDAGraph`` cannot (before 2.12); None where it is not built (an exported folder without the package,
    no CUDA toolkit at install, another torch's build)."""
    try:
        from megatron_xmod import _permute_cuda
    except ImportError:
        return None
    return _permute_cuda if getattr(_permute_cuda, "if_nodes_built", lambda: False)() else None


def if_node_provider() -> str:
    """Who opens a decode graph's IF nodes here: "torch" (>= 2.12), "extension" (csrc/graph_if_node.cu) or
    "none" (the fixed-shape decode then runs eagerly on a GPU too)."""
    if hasattr(torch.cuda.CUDAGraph, "begin_capture_to_if_node"):
        return "torch"
    return "extension" if extension_if_nodes() is not None else "none"


def begin_if_node(graph, pool: GraphPool, pred: torch.Tensor) -> None:
    """In ``graph``'s capture into ``pool`` (given to ``torch.cuda.graph``: a ``CUDAGraph`` tells its pool only
    once captured), open an IF node on the 0-dim bool ``pred``: the work that follows is captured into its body,
    which a replay runs only where ``pred`` is True, until :func:`end_if_node`. torch's own
    (``CUDAGraph.begin_capture_to_if_node``, torch >= 2.12), else the package's extension's."""
    if hasattr(graph, "begin_capture_to_if_node"):
        graph.begin_capture_to_if_node(pred)
        pool.taken += 1
    else:
        extension_if_nodes().begin_capture_to_if_node(pred, *pool.handle)


def end_if_node(graph, pool: GraphPool) -> None:
    if hasattr(graph, "end_capture_to_conditional_node"):
        graph.end_capture_to_conditional_node()
        pool.taken += 1
    else:
        extension_if_nodes().end_capture_to_conditional_node()


# torch's IF nodes switch a capture's allocations to a node's body and back by ending and beginning allocation
# to the graph's pool again, and the caching allocator's beginAllocateToPool takes a use of the pool at every
# beginning, which these nodes never give back (torch's own use_mem_pool does, with releasePool): a graph of N
# nodes would hold its pool 2N + 1 times, CUDAGraph.reset gives back one, and the pool, with every block it
# cached, would never be freed. Read in torch's source; the first and last minor releases given back for. A
# later torch gets nothing given back until checked (a torch that gave them back itself, in reset say, would
# otherwise have them released twice and fail the allocator's assertion).
IF_NODES_TAKE_POOL_USES = ((2, 12), (2, 14))


def if_nodes_take_pool_uses() -> bool:
    """Whether this torch opens the IF nodes on a GPU here and its nodes take pool uses that
    :meth:`GraphPool.give_back` must return."""
    release = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    first, last = IF_NODES_TAKE_POOL_USES
    return (if_node_provider() == "torch" and first <= release <= last and hasattr(torch.cuda, "MemPool")
            and torch.cuda.is_available())


class GraphPool:
    """The memory pool of one CUDA-graph capture on the current device: ``handle`` for ``torch.cuda.graph``'s
    ``pool``. Where torch's IF nodes take uses of it (:func:`if_nodes_take_pool_uses`) it is a
    ``torch.cuda.MemPool``, whose use count tells what they took, and ``taken`` counts the nodes' starts and
    ends that took one; :meth:`give_back` then returns exactly those after the capture."""

    def __init__(self):
        self.owner = torch.cuda.MemPool() if if_nodes_take_pool_uses() else None
        self.device_index = torch.cuda.current_device() if self.owner is not None else None
        self.handle = self.owner.id if self.owner is not None else torch.cuda.graph_pool_handle()
        self.taken = 0

    def give_back(self) -> int:
        """After the capture (failed or not), give back the uses torch's nodes took, where the pool's use count
        shows exactly them above the MemPool's and the capture's (a torch that balances its own shows none);
        then drop the MemPool, whose use the capture's keeps the pool alive without. Returns how many."""
        if self.owner is None:
            return 0
        surplus, given = self.owner.use_count() - 2, 0
        if surplus == self.taken:
            for _ in range(surplus):
                release_pool_use(self.device_index, self.handle)
            given = surplus
        elif surplus > 0:  # (below 0: the capture failed before it took its use)
            warnings.warn(f"static decode: a CUDA graph's memory pool holds {surplus} uses beyond its capture's where "
                          f"its {self.taken} IF-node starts and ends took {self.taken} (torch {torch.__version__}); "
                          "none given back: the pool stays after the graph is gone", stacklevel=2)
        self.owner = None
        return given


def release_pool_use(device_index: int, pool) -> None:
    """One use of ``pool`` given back to the caching allocator (a function of its own for the tests' allocator)."""
    torch._C._cuda_releasePool(device_index, pool)


def conditional_nodes_available(device: Optional[torch.device] = None) -> bool:
    """CUDA graphs with IF nodes work on ``device`` (None: the current CUDA device): not ROCm, a torch that
    captures them or the package's extension that does (:func:`begin_if_node`), and a driver and CUDA
    (>= 12.4) that run them: one tiny capture, replayed with the flag false and true, probed once a device."""
    if (not torch.cuda.is_available() or torch.version.hip is not None
            or if_node_provider() == "none"):
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
            graph, pool = torch.cuda.CUDAGraph(), GraphPool()
            torch.cuda.synchronize(device)
            # relaxed, as the decode state's first capture: the extension's first node creates a stream
            try:
                with torch.cuda.graph(graph, pool=pool.handle, stream=torch.cuda.Stream(device),
                                      capture_error_mode="relaxed"):
                    begin_if_node(graph, pool, flag)
                    try:
                        counter.add_(1)
                    finally:
                        end_if_node(graph, pool)
            finally:
                pool.give_back()
            graph.replay()  # flag false: the body is skipped
            flag.fill_(True)
            graph.replay()
            torch.cuda.synchronize(device)
            return float(counter) == 1.0
    except Exception:  # noqa: BLE001 (any failure means: decode eagerly)
        return False


_CAPTURE_NEEDS = ("torch, driver and CUDA (>= 12.4) run conditional nodes (torch >= 2.12, or megatron_xmod's CUDA "
                  "extension built with CUDA >= 12.4)")


def decode_graphed(device: torch.device, one_device: bool, graphed: Optional[bool]) -> bool:
    """Whether fixed-shape decode steps on ``device`` are captured as a CUDA graph: ``graphed``, or where it is
    None, whether they can be (the model on one GPU that runs IF nodes). Refuses True where they cannot; warns
    where a GPU decodes them eagerly by default, since each step then reads the device once a sparse layer
    (more often than the default cache's run-ahead does)."""
    capturable = device.type == "cuda" and one_device and conditional_nodes_available(device)
    if graphed and not capturable:
        raise ValueError(f"graphed: CUDA-graph capture of a decode step needs the model on one GPU whose "
                         f"{_CAPTURE_NEEDS}; pass graphed=False")
    if graphed is None and device.type == "cuda" and not capturable:
        where = "the model spans several devices" if not one_device else "conditional nodes do not run here"
        warnings.warn(f"static decode on {device}: no CUDA graph ({where}), so each fixed-shape step reads the device "
                      "once a sparse layer; the default cache (no max_cache_len, no cache_implementation=\"static\") "
                      f"reads it less often; a graph needs the model on one GPU whose {_CAPTURE_NEEDS}", stacklevel=3)
    return capturable if graphed is None else graphed


class StaticDecodeState:
    """The buffers of fixed-shape decode steps for one batch (module docstring), built from a prefilled
    :class:`~cache.XModCache`; ``max_cache_len``: the tokens a sequence may reach, prompt included."""

    def __init__(self, cache, max_cache_len: int, graphed: Optional[bool] = None, one_device: bool = True,
                 sparse_room: str = "adaptive", model=None):
        check_sparse_room(sparse_room)
        entry, seen = self._prompt(cache, max_cache_len)
        self.model = model_fingerprint(model)  # what refill checks a later generation's model against
        self.sparse_room, self.requested = sparse_room, (graphed, one_device, sparse_room)
        self.sparse = [layer.sparse for layer in cache.layers]
        self.batch, self.device, self._entry = entry[0], entry[5], entry
        self.graph = None
        self.pool_uses_given_back = 0  # uses of graph pools that torch's IF nodes took (GraphPool.give_back)
        self._capturing = None  # (CUDA graph, its memory pool) being captured, whose IF nodes branch() opens
        self._warm = False  # a capture of this state's step succeeded: lazy initialisations are done
        # per sparse layer, the host's copy of its layout: each region's start and size (entries + room)
        self.regions: dict[int, RegionLayout] = {}
        self.layers: list[tuple[torch.Tensor, ...]] = [None] * len(cache.layers)
        self.column = torch.zeros(1, dtype=torch.long, device=self.device)
        self.input_ids = torch.zeros(self.batch, 1, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(self.batch, 1, dtype=torch.long, device=self.device)
        self.valid = torch.ones(self.batch, 1, dtype=torch.bool, device=self.device)
        self.hidden: Optional[torch.Tensor] = None  # [batch, 1, hidden], allocated by the first step
        self._fill(cache, max_cache_len, seen)
        self.graphed = decode_graphed(self.device, one_device, graphed)
        self.attention_backend = "auto"  # of the sparse layers' region attention: auto, torch or triton
        self.owner = cache  # the XModCache whose entries the buffers hold (refill hands them to another)

    @staticmethod
    def _prompt(cache, max_cache_len: int):
        """(batch, kv heads, head dim, key dtype, value dtype, device) of ``cache``'s entries and the tokens it
        has seen, checked against ``max_cache_len``."""
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
        return entry, seen

    def _fill(self, cache, max_cache_len: int, seen: int) -> None:
        """Move ``cache``'s prefilled entries into the buffers, in place where a buffer is there and holds them
        (a refill), else into new ones; start the generation's counters."""
        self.max_cache_len, self.prompt_tokens = max_cache_len, seen
        free = [max_cache_len - seen]
        for i, layer in enumerate(cache.layers):
            if layer.sparse:
                kept = self._valid_entries(layer)
                lengths = [k.shape[1] for k, _ in kept]
                self.layers[i] = self._lay_out(i, kept, lengths, seen, max_cache_len - seen, reuse=self.layers[i])
                free.append(self._least_free(i, lengths))
            else:
                self.layers[i] = self._dense_buffers(layer, max_cache_len, reuse=self.layers[i])
        # decode steps that cannot fill any region, whatever they route: the host reads the counts only after them
        self._unchecked = min(free)
        self.relayouts = 0  # sparse layers laid out again because a region ran short (adaptive room)
        self.room_reads = 0  # host reads of the counts
        self.layout_changes = 0  # reads after which some layer was laid out again (under graphs: a new capture)
        self.column.fill_(seen)
        self.steps = 0

    def refill(self, cache, max_cache_len: int, graphed: Optional[bool] = None, one_device: bool = True,
               sparse_room: str = "adaptive", model=None) -> bool:
        """Take over ``cache``'s prefilled entries (a later generation of the same model, whose
        ``XModModel.static_decode_state`` this is) into these buffers, keeping the captured graph where every
        buffer holds the new prompt's entries in place (a sparse layer whose regions do not fit gets new buffers,
        and the next step captures again). False, nothing changed, where the new generation differs in batch,
        KV shape, dtype, device, layers or settings, or needs more than the dense layers' ``max_cache_len``
        columns, or where ``model`` (the module whose step the graph captured) has other parameter tensors or
        another configuration than when the state was built (a graph holds the addresses and constants it
        captured). The cache that held the buffers before, if it still does, is released
        (:meth:`XModCache.release_static`)."""
        entry, seen = self._prompt(cache, max_cache_len)
        if (entry != self._entry or [layer.sparse for layer in cache.layers] != self.sparse
                or (graphed, one_device, sparse_room) != self.requested or model_fingerprint(model) != self.model
                or any(not sparse and buffers[0].shape[2] < max_cache_len
                       for sparse, buffers in zip(self.sparse, self.layers))):
            return False
        if self.owner is not None and self.owner is not cache and self.owner.static is self:
            self.owner.release_static()
        self._fill(cache, max_cache_len, seen)
        self.owner = cache
        return True

    @staticmethod
    def _dense_buffers(layer, capacity: int, reuse=None) -> tuple[torch.Tensor, ...]:
        """A dense layer's entries at the start of ``capacity`` columns: in the buffers ``reuse`` (key_valid
        masks what a generation before left past them), else new ones."""
        batch, heads, used, dim = layer.keys.shape
        if reuse is not None:
            keys, values, key_valid = reuse
            key_valid.zero_()
        else:
            keys = layer.keys.new_zeros(batch, heads, capacity, dim)
            values = layer.values.new_zeros(batch, heads, capacity, dim)
            key_valid = torch.zeros(batch, capacity, dtype=torch.bool, device=keys.device)
        keys[:, :, :used], values[:, :, :used], key_valid[:, :used] = layer.keys, layer.values, layer.valid
        return keys, values, key_valid

    def _valid_entries(self, layer) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A per-sequence sparse layer's valid (keys, values) ``[kv_heads, n, head_dim]`` a sequence (a sequence
        whose entries are not all valid: one host read, once); empty for a layer that holds nothing yet."""
        batch, heads, dim, key_dtype, value_dtype, device = self._entry
        if not layer.is_initialized:
            empty = torch.zeros(heads, 0, dim, dtype=key_dtype, device=device)
            return [(empty, empty.to(value_dtype))] * batch
        kept = []
        for row in range(layer.batch):
            keys, values, valid, _ = layer.sequence(row)
            if not layer.all_valid[row]:
                keep = valid.nonzero().flatten()
                keys, values = keys.index_select(1, keep), values.index_select(1, keep)
            kept.append((keys, values))
        return kept

    def _lay_out(self, layer_idx: int, kept, lengths: list[int], tokens: int, remaining: int,
                 reuse=None, least_room: Optional[list[int]] = None) -> tuple[torch.Tensor, ...]:
        """Sparse layer ``layer_idx``'s flat buffers: each sequence's first ``lengths`` entries of ``kept``
        packed at the start of its region, followed by its room (:func:`region_room` at the sequence's rate:
        entries over the ``tokens`` seen, or since the layer's previous layout where that is higher, for the
        ``remaining`` steps; at least ``least_room``); the layout's host copy goes to ``regions``. In the
        buffers ``reuse`` where they hold the regions (their spare slots shared out as more room), else in new
        ones (a graph captured on the old ones is dropped). ``kept`` must not be views of ``reuse``."""
        batch, heads, dim, key_dtype, value_dtype, device = self._entry
        rooms = self._rooms(self.regions.get(layer_idx) if reuse is None else None, lengths, tokens, remaining)
        sizes = [n + max(room, least) for n, room, least in zip(lengths, rooms, least_room or [0] * batch)]
        if reuse is not None and sum(sizes) <= reuse[0].shape[2]:
            keys, values, counts, starts = reuse
            spare = (keys.shape[2] - sum(sizes)) // batch
            sizes = [size + spare for size in sizes]
        else:
            keys = torch.zeros(1, heads, sum(sizes), dim, dtype=key_dtype, device=device)
            values = torch.zeros_like(keys, dtype=value_dtype)
            counts, starts = (torch.zeros(batch, dtype=torch.long, device=device) for _ in range(2))
            self.graph = None
        first = [sum(sizes[:row]) for row in range(batch)]
        for (k, v), start, n in zip(kept, first, lengths):
            keys[0, :, start:start + n], values[0, :, start:start + n] = k[:, :n], v[:, :n]
        # from pinned memory without blocking on a GPU: a pageable copy waits for the stream, twice a layer
        pinned = counts.device.type == "cuda"
        counts.copy_(torch.tensor(lengths, dtype=torch.long, pin_memory=pinned), non_blocking=pinned)
        starts.copy_(torch.tensor(first, dtype=torch.long, pin_memory=pinned), non_blocking=pinned)
        self.regions[layer_idx] = RegionLayout(first, sizes, list(lengths), tokens)
        return keys, values, counts, starts

    def _ensure_room(self) -> None:
        """Before a step: where a region might fill in it, read every sparse layer's counts (one host read).
        Where a region is short of room (below both the steps left and half the margin), lay out again every
        layer at risk: one with a region whose free room is below what :func:`region_room` gives it now (at
        its rate over all its tokens, or since the layer's last layout where that is higher), a region that
        ran short getting at least twice the room it had. So the layouts change together, at few reads (under
        CUDA graphs each such read means one new capture: the next step captures the new buffers)."""
        if self._unchecked > 0:
            return
        remaining = self.max_cache_len - self.prompt_tokens - self.steps  # this step included
        sparse = sorted(self.regions)
        counts = torch.cat([self.layers[i][2] for i in sparse]).tolist()  # the one host read
        self.room_reads += 1
        tokens = self.prompt_tokens + self.steps
        short = min(remaining, max(1, ROOM_MARGIN // 2))
        lengths = {i: counts[j * self.batch:(j + 1) * self.batch] for j, i in enumerate(sparse)}
        free = {i: self._least_free(i, lengths[i]) for i in sparse}
        if min(free.values()) < short:
            self.layout_changes += 1
            for i in sparse:
                before = self.regions[i]
                rooms = self._rooms(before, lengths[i], tokens, remaining)
                if all(size - n >= room for size, n, room in zip(before.sizes, lengths[i], rooms)):
                    continue
                least_room = [min(remaining, 2 * (size - then)) if size - n < short else 0
                              for size, n, then in zip(before.sizes, lengths[i], before.lengths)]
                keys, values = self.layers[i][:2]
                kept = [(keys[0, :, s:s + n], values[0, :, s:s + n]) for s, n in zip(before.starts, lengths[i])]
                self.layers[i] = self._lay_out(i, kept, lengths[i], tokens, remaining, least_room=least_room)
                free[i] = self._least_free(i, lengths[i])
                self.relayouts += 1
        self._unchecked = min([remaining, *free.values()])

    def _rooms(self, before: Optional[RegionLayout], lengths: list[int], tokens: int, remaining: int) -> list[int]:
        """:func:`region_room` of each sequence of a layer: at its rate over the ``tokens`` seen, or since the
        layer's layout ``before`` where that is higher."""
        rates = [n / max(tokens, 1) for n in lengths]
        if before is not None and tokens > before.tokens:
            rates = [max(rate, (n - then) / (tokens - before.tokens))
                     for rate, n, then in zip(rates, lengths, before.lengths)]
        return [region_room(rate, remaining, self.sparse_room) for rate in rates]

    def _least_free(self, layer_idx: int, lengths: list[int]) -> int:
        return min(size - n for size, n in zip(self.regions[layer_idx].sizes, lengths))

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
            graph, pool = self._capturing
            begin_if_node(graph, pool, pred)
            try:
                body()
            finally:
                end_if_node(graph, pool)
        elif bool(pred):
            body()

    # -- running steps --------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, run: Callable[[StaticDecodeState], torch.Tensor], input_ids: torch.Tensor,
             positions: torch.Tensor, valid: Optional[torch.Tensor]) -> torch.Tensor:
        """One decode step: ``run(self)`` computes it from the input buffers and returns the final hidden
        states. Eager for the first step of a new state; with ``graphed`` the second step captures ``run`` as
        one CUDA graph and every step from then on replays it, until a new layout of a sparse layer drops the
        graph (the next step captures again); a refilled state whose buffers all stayed replays from its first
        step. Returns the output buffer (overwritten by the next step)."""
        if self.prompt_tokens + self.steps + 1 > self.max_cache_len:
            raise ValueError(f"max_cache_len: the cache holds {self.max_cache_len} tokens a sequence and is full; "
                             "generate fewer tokens or pass a larger max_cache_len")
        self._ensure_room()
        self._unchecked -= 1
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
        ``ControlFlowOpWarmupDispatchMode`` warms both sides of a ``torch.cond``. A later capture of the same
        state (its buffers laid out again, or refilled by another generation) has every kernel initialised
        and captures once, falling back to the warm-up if that capture fails."""
        def body():
            self.hidden.copy_(run(self))

        with self._on_device():
            # a stream of the state's device: torch.cuda.graph's default capture stream is created on
            # whichever device was current when it was first used
            stream = None
            if self.device.type == "cuda":
                stream = torch.cuda.Stream(self.device)
                torch.cuda.synchronize(self.device)
            if self._warm:
                current = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
                try:
                    self.graph = self._captured(body, stream, "global")
                    return
                except RuntimeError:
                    if current is not None:  # a failed capture's exit may leave its capture stream current
                        torch.cuda.set_stream(current)
            self._captured(body, stream, "relaxed")
            self.graph = self._captured(body, stream, "global")
            self._warm = True

    def _captured(self, body, stream, mode: str):
        graph, pool = torch.cuda.CUDAGraph(), GraphPool()
        self._capturing = graph, pool
        try:
            with torch.cuda.graph(graph, pool=pool.handle, stream=stream, capture_error_mode=mode):
                body()
        finally:
            self._capturing = None
            self.pool_uses_given_back += pool.give_back()
        return graph

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


def check_sparse_room(policy) -> str:
    if policy not in SPARSE_ROOM_POLICIES:
        raise ValueError(f"sparse_room: the room of a sparse layer's regions is one of {', '.join(SPARSE_ROOM_POLICIES)}, "
                         f"got {policy!r}; 'adaptive' (default) sizes it by each sequence's routing so far, 'full' "
                         "keeps room for every token left to max_cache_len")
    return policy


def model_fingerprint(model) -> Optional[tuple]:
    """What a captured decode step depends on besides the state's buffers: the addresses of ``model``'s
    parameters and its configuration (None: no model given)."""
    if model is None:
        return None
    config = getattr(model, "config", None)
    return (tuple(p.data_ptr() for p in model.parameters()),
            None if config is None else repr(sorted(config.to_dict().items(), key=lambda kv: kv[0])))
