"""Routing state of one built model chunk: what crosses layers within a forward pass, and steps
within a log interval.

One :class:`RoutingState` belongs to one built model chunk (:func:`attach_routing_state`, called by
the model builders). Every module of the chunk that declares ``ROUTING_METRICS`` (the sparse layers,
the DTop-p router) is a *recorder*: it gets the chunk's state as ``module.routing_state`` and
writes to it. The state holds

- the token-choice bias hand-over (Eq.8 of the X-MoD paper): the bias b and the routed set of the
  sparse layer that ran last, taken by the next sparse layer of the same block;
- the evaluation routing rule (threshold or top-k) of the chunk's sparse layers;
- interval statistics, summed on the device (no host sync) until :func:`report`;
- the router losses of the micro-batch being run, which ``forward_step`` takes for the loss
  dictionary;
- the routed layers' activation-memory hand-overs (second half of this module): the router's
  full-length input saved once per block, and the token-choice bias replayed under full recompute.

Nothing here is global: two models in one process share nothing, and a spec stays data.

**Router input, once per block.** A routed layer touches only its L/K routed rows, but its router
(d -> 1) scores every token, and the router weight's gradient sum_i g_i x_i needs the layer input x at
all L positions (the BCE loss of Eq.(9) and the bias make every g_i non-zero). ``nn.Linear`` saves x
for that: one full-length [L, b, h] tensor per routed layer, more than everything else the layer
saves once K >= 8. Consecutive routed layers of a block change only their routed rows, and every other
row passes through bit-identical, so

    x_l = x_base with, for each earlier layer j of the chain, the rows that layer j wrote

where x_base is the input of the chain's first layer. :class:`RouterLogits` saves x_base (shared by
the whole chain: one tensor, counted once) and, per earlier layer, its written rows [k*b, h] with
their flat indices and their values before it wrote them (its gathered input rows, saved by the layer
anyway). Backward rebuilds x_l by copying rows (no arithmetic, so bit-exact), walking one buffer
back through the chain one layer at a time (:class:`ChainCursor`: O(L/K) copies per layer, not O(l)
row sets), and computes the router gradients with the same matmuls as ``nn.Linear``'s backward.
Memory per routed layer: O(L/K), plus one O(L) base per block and one O(L) buffer while its backward runs.

The chain is handed from layer to layer by :class:`RouterInputChain` (kept in the model chunk's
``RoutingState``), which holds weak references only (autograd's saved tensors keep the rows alive;
nothing outlives the backward pass) and checks that a layer's input really is the previous routed
layer's output; otherwise (a dense anchor in between, a checkpoint boundary, an offloading hook that
dropped a tensor) the layer starts a new chain with its own input as the base.

**Full recompute.** Under megatron's full activation recompute a checkpointed chunk of layers runs
twice: once without autograd in the forward pass, again with autograd inside the backward pass (chunks
in reverse order). The token-choice bias (Eq.8) is carried from layer to layer, so the replay must see
the bias of the first pass: :class:`RecomputeReplay` queues each checkpointed layer's carried bias in
the first pass and hands it back in the replay (first in, first out per layer, which is the order of
micro-batches in megatron's schedules).
"""
from __future__ import annotations

import contextlib
import functools
import weakref
from collections import defaultdict, deque
from collections.abc import Callable, Iterable
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from megatron_xmod.xmod.routing import check_eval_rule, eval_capacity

NONFINITE = "nonfinite_router_logits"
# Hidden columns of the statistics table: a recorder writes the number of finite router logits and the
# number of logits (a constant), and the non-finite count is their difference when read (one op less
# per layer than counting the non-finite ones on the device).
_FINITE, _LOGITS = "_finite_router_logits", "_router_logits"


class StepStatistics(NamedTuple):
    """Where a top-k routing step adds the statistics of one call (:meth:`RoutingState.step_statistics`).

    ``offsets`` [n + m] int64 are flat positions in ``table``: first the n counted values, in the order
    finite router logits, covered tokens (b > 0), then with a previous routed set |previous & selected|
    and |previous | selected| (the pooled Jaccard's sum and count), then with the router BCE the BCE
    twice (its metric and the micro-batch loss); then the m entries that get the ``constants`` [m]
    float32 (what the call adds that is known statically: counts of calls, numbers of logits and of
    routed tokens). Both tensors are created once per layer and shape (a captured graph holds them)."""

    table: torch.Tensor  # the state's flat float32 statistics buffer
    offsets: torch.Tensor
    constants: torch.Tensor
    has_previous: bool
    has_bce: bool


class RoutingState:
    """What crosses layers and steps in one built model chunk, in device buffers written in place.

    A recorder's forward reads and writes only tensors that exist before it runs (allocated at the
    chunk's first forward, or when a new [s, b] shape is first seen), so a CUDA graph that captured
    the layer and replays it leaves exactly the state an eager run does:

    - the token-choice bias hand-over: per [s, b] shape, a float32 bias buffer and a bool routed-set
      buffer; a sparse layer writes its updated bias and routed set into them and the next sparse
      layer of the block reads them (:meth:`take_bias`);
    - the interval statistics: one float32 table [layers, 2, metrics] (sums, then counts) to which a
      recorder adds all its values of one call with one ``torch.stack`` and one ``index_add_``
      (:meth:`record_values`), or the top-k routing step of a sparse layer adds them itself, by atomic
      adds in the fused kernel (:meth:`step_statistics`); the table's last two entries accumulate the
      micro-batch's router losses (sum, count), taken by :func:`take_microbatch_loss`. Under top-k
      the adjacent Jaccard is pooled: its sum is the intersections, its count the unions.

    Layers and metrics are registered by :func:`attach_routing_state` (or by a recorder's first
    forward: the table then grows, before any capture).
    """

    def __init__(self, eval_rule: str = "threshold", eval_capacity_factor: Optional[float] = 0.0):
        self.eval_rule = check_eval_rule(eval_rule)
        # Threshold-rule evaluation at a static width (docs/routing.md, "Host synchronisation"): each
        # sparse layer batches its selection at eval_capacity_factor x L/K tokens a sequence, and the
        # chunk's decoder reads once per forward pass whether one overflowed (install_capacity_check,
        # which sets capacity_checked). Without that check, or with a factor of 0 or None, every sparse
        # layer reads the width of its selection from the device instead.
        self.eval_capacity_factor = eval_capacity_factor
        self.capacity_checked = False
        self.capacity_reruns = 0  # forward passes run again at exact widths after an overflow
        self._exact_widths = False
        self._before_pass: Optional[tuple] = None  # what the pass may change, saved at its first sparse layer
        self._widths: Optional[torch.Tensor] = None  # [rows] int64: each layer's widest selection of the pass
        self._capacity: dict[int, tuple[int, int]] = {}  # layer -> (capacity, L) used in this pass
        self._widest: dict[tuple[int, int], int] = {}  # (layer, L) -> widest selection of its last pass
        # Training iteration being run (set_iteration, called by the entry point's forward step with
        # megatron's args.curr_iteration): the token-choice bias warm-up reads it. None outside training:
        # a trained model, full tau.
        self.iteration: Optional[int] = None
        # Callables (layer_number, router logits, RoutingDecision) that see every sparse layer's routing
        # as it happens (the routing report's recorder, megatron_xmod.diagnostics); empty in training.
        self.observers: list[Callable] = []
        # False while a pass runs that must not count in the interval statistics (the top-k comparison
        # pass of validation, training/step.py): see :func:`statistics_paused`.
        self.recording = True
        # Routed layers' activation-memory and full-recompute hand-overs (megatron_xmod.xmod.routing_state).
        self.router_inputs = RouterInputChain()
        self.recompute_replay = RecomputeReplay()
        # registry: table rows (layer numbers) and columns (metric names)
        self._layers: list[int] = []
        self._row: dict[int, int] = {}
        self._names: list[str] = []
        self._column: dict[str, int] = {}
        self._layer_names: dict[int, set[str]] = defaultdict(set)
        self._loss_layers: set[int] = set()  # layers that add micro-batch router losses
        self._bias_sources: set[int] = set()  # layers whose bias the hand-over buffers hold for the next one
        # device buffers
        self._stats: Optional[torch.Tensor] = None  # [rows * 2 * metrics + 2] float32
        self._handover: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # (shape, device) -> (bias, selected)
        self._indices: dict[tuple, torch.Tensor] = {}
        self._constants: dict[tuple, torch.Tensor] = {}

    # --- registry and buffers -----------------------------------------------------------------------
    def register(self, layer_number: int, names: Iterable[str]) -> None:
        """Give ``layer_number`` a row and ``names`` columns of the statistics table (idempotent)."""
        names = [n for name in names for n in ((_FINITE, _LOGITS) if name == NONFINITE else (name,))]
        new_row = layer_number not in self._row
        new_names = [name for name in names if name not in self._column]
        self._layer_names[layer_number].update(names)
        if not (new_row or new_names):
            return
        old_layers, old_names, old = list(self._layers), list(self._names), self._stats
        if new_row:
            self._row[layer_number] = len(self._layers)
            self._layers.append(layer_number)
        for name in new_names:
            self._column[name] = len(self._names)
            self._names.append(name)
        self._indices.clear()
        if old is not None:  # grow (before any capture: registration completes in the first forward)
            self._stats = None
            self._allocate(old.device)
            rows, cols = len(old_layers), len(old_names)
            self._table()[:rows, :, :cols].copy_(old[:-2].view(rows, 2, cols))
            self._stats[-2:].copy_(old[-2:])

    def _allocate(self, device) -> None:
        if self._stats is None or self._stats.device != torch.device(device):
            self._stats = torch.zeros(len(self._layers) * 2 * len(self._names) + 2, dtype=torch.float32, device=device)
            self._indices.clear()
            self._constants.clear()

    def _table(self) -> torch.Tensor:
        """The statistics as [layers, 2 (sum, count), metrics], a view of the buffer."""
        return self._stats[:-2].view(len(self._layers), 2, len(self._names))

    def constant(self, value: float, device) -> torch.Tensor:
        """A 0-d float32 device tensor holding ``value``, created once (a value known statically that a
        recorder writes, such as the selected fraction of top-k or the number of router logits)."""
        key = (float(value), str(device))
        tensor = self._constants.get(key)
        if tensor is None:
            tensor = self._constants[key] = torch.tensor(float(value), dtype=torch.float32, device=device)
        return tensor

    def _index(self, layer_number: int, names: tuple, with_loss: bool, device) -> torch.Tensor:
        key = (layer_number, names, with_loss, str(device))
        index = self._indices.get(key)
        if index is None:
            self.register(layer_number, names)
            self._allocate(device)
            metrics, row = len(self._names), self._row[layer_number]
            columns = [self._column[name] for name in names]
            flat = [row * 2 * metrics + c for c in columns] + [(row * 2 + 1) * metrics + c for c in columns]
            if with_loss:
                size = self._stats.numel()
                flat += [size - 2, size - 1]
            index = self._indices[key] = torch.tensor(flat, dtype=torch.long, device=device)
        return index

    def _offset(self, layer_number: int, name: str, count: bool = False) -> int:
        metrics = len(self._names)
        return (self._row[layer_number] * 2 + int(count)) * metrics + self._column[name]

    def step_statistics(self, layer_number: int, prefix: str, shape: tuple[int, int], routed: int,
                        has_previous: bool, has_bce: bool, device) -> Optional[StepStatistics]:
        """Where the top-k routing step of layer ``layer_number`` ([s, b] = ``shape`` logits, ``routed``
        = k*b tokens routed) adds its call's statistics (names with ``prefix``, "" or "eval_"):
        the non-finite router-logit count, selected fraction, coverage, the pooled adjacent Jaccard
        (with ``has_previous``) and the router BCE as metric and micro-batch loss (``has_bce``). None
        while the statistics are paused."""
        if not self.recording:
            return None
        key = ("step", layer_number, prefix, tuple(shape), routed, has_previous, has_bce, str(device))
        cached = self._indices.get(key)
        if cached is None:
            names = [NONFINITE, prefix + "selected_fraction", prefix + "coverage"]
            names += [prefix + "adjacent_jaccard"] if has_previous else []
            names += ["router_bce_loss"] if has_bce else []
            self.register(layer_number, names)  # may grow the table and clear the caches: before anything is cached
            self._allocate(device)
            if has_bce:
                self._loss_layers.add(layer_number)
            at = functools.partial(self._offset, layer_number)
            loss_sum, loss_count = self._stats.numel() - 2, self._stats.numel() - 1
            counted = [at(_FINITE), at(prefix + "coverage")]
            if has_previous:
                counted += [at(prefix + "adjacent_jaccard"), at(prefix + "adjacent_jaccard", True)]
            if has_bce:
                counted += [at("router_bce_loss"), loss_sum]
            tokens = float(shape[0] * shape[1])
            constant = [(at(_FINITE, True), 1.0), (at(_LOGITS), tokens), (at(_LOGITS, True), 1.0),
                        (at(prefix + "selected_fraction"), float(routed)),
                        (at(prefix + "selected_fraction", True), tokens), (at(prefix + "coverage", True), tokens)]
            if has_bce:
                constant += [(at("router_bce_loss", True), 1.0), (loss_count, 1.0)]
            offsets = torch.tensor(counted + [o for o, _ in constant], dtype=torch.long, device=device)
            values = torch.tensor([v for _, v in constant], dtype=torch.float32, device=device)
            cached = self._indices[key] = (offsets, values)
        return StepStatistics(self._stats, cached[0], cached[1], has_previous, has_bce)

    # --- token-choice bias hand-over ---------------------------------------------------------------
    def bias_buffers(self, shape: tuple[int, ...], device) -> tuple[torch.Tensor, torch.Tensor]:
        """The hand-over buffers (bias float32, routed set bool) for ``shape`` [s, b], created once per
        shape and kept (a captured graph holds their addresses)."""
        key = (tuple(shape), str(device))
        buffers = self._handover.get(key)
        if buffers is None:
            buffers = self._handover[key] = (torch.zeros(shape, dtype=torch.float32, device=device),
                                             torch.zeros(shape, dtype=torch.bool, device=device))
        return buffers

    def take_bias(self, layer_number: int, shape: tuple[int, ...]):
        """(b, routed set) left by the layer directly before ``layer_number``, else (None, None).

        Static: the layer before takes part iff it is a sparse layer of this chunk (consecutive sparse
        layers are one block: an anchor in between, or the first sparse layer of a block, starts at
        b = 0), or the pipeline carry delivers its bias at this chunk's first layer. The buffers are
        returned themselves (views of device memory that the previous layer wrote in place).
        """
        if layer_number - 1 not in self._bias_sources:
            return None, None
        for (buffer_shape, _), buffers in self._handover.items():
            if buffer_shape == tuple(shape):
                return buffers
        return None, None

    def put_bias(self, layer_number: int, bias: torch.Tensor, selected: Optional[torch.Tensor]) -> None:
        """Layer ``layer_number`` hands (b, routed set) to the next one: copied in place into the
        buffers (nothing is copied for a tensor that is the buffer already, nor for ``selected`` None:
        the routing step wrote the routed set into its buffer itself)."""
        self._bias_sources.add(layer_number)
        bias_buffer, selected_buffer = self.bias_buffers(tuple(bias.shape), bias.device)
        if bias is not bias_buffer:
            bias_buffer.copy_(bias)
        if selected is not None and selected is not selected_buffer:
            selected_buffer.copy_(selected)

    # --- threshold-rule evaluation at a static width ------------------------------------------------
    def eval_capacity(self, layer_number: int, seq_len: int, sparsity_k: int, device) -> Optional[int]:
        """The static width of sparse layer ``layer_number``'s threshold batch in this forward pass, or None:
        the layer reads its exact width from the device (one host sync). The width is
        max(eval_capacity_factor x L/K, 1.25 x the layer's widest selection in the previous pass), rounded
        up to a multiple of 8 (routing.eval_capacity). A capacity needs the decoder's overflow check
        (:func:`install_capacity_check`); observers (the routing report) see one pass, at exact widths.
        The pass's first sparse layer saves what the pass may change, so that an overflowing pass can be
        undone and run again."""
        if not (self.capacity_checked and self.eval_capacity_factor) or self._exact_widths or self.observers:
            return None
        if self._before_pass is None:
            self._start_capacity_pass(device)
        tokens = self.eval_capacity_factor * seq_len / sparsity_k
        previous = self._widest.get((layer_number, seq_len))
        capacity = eval_capacity(seq_len, tokens if previous is None else max(tokens, 1.25 * previous))
        self._capacity[layer_number] = (capacity, seq_len)
        return capacity

    def _start_capacity_pass(self, device) -> None:
        rows = len(self._layers)
        if self._widths is None or self._widths.numel() != rows or self._widths.device != torch.device(device):
            self._widths = torch.zeros(rows, dtype=torch.long, device=device)
        self._capacity.clear()
        self._before_pass = self.snapshot()

    def note_width(self, layer_number: int, width) -> None:
        """The widest selection of a sequence in ``layer_number``'s threshold batch: an int (exact width,
        read already) or a 0-d device tensor (capacity pass: kept on the device until the pass ends)."""
        if isinstance(width, torch.Tensor):
            self._widths[self._row[layer_number]] = width
        elif layer_number in self._capacity:
            self._widest[(layer_number, self._capacity[layer_number][1])] = width

    def end_capacity_pass(self) -> bool:
        """End of a forward pass: True when one of its sparse layers selected more tokens of a sequence
        than its capacity; the statistics and hand-over buffers are then as they were before the pass,
        to run it again at exact widths (:meth:`exact_widths`). One host read (the layers' widest
        selections, which also size the next pass), made only if a layer used a capacity."""
        before, self._before_pass = self._before_pass, None
        if before is None:
            return False
        widths = self._widths.tolist()  # the pass's one host sync
        overflow = False
        for layer_number, (capacity, seq_len) in self._capacity.items():
            width = widths[self._row[layer_number]]
            self._widest[(layer_number, seq_len)] = width
            overflow |= width > capacity
        if not overflow:
            return False
        self.restore(before)
        self.capacity_reruns += 1
        return True

    def snapshot(self) -> tuple:
        """Copies of what a pass may change (the statistics with the micro-batch router losses, and the
        token-choice bias hand-over buffers), for :meth:`restore`."""
        stats = None if self._stats is None else self._stats.clone()
        handover = {key: (bias.clone(), selected.clone()) for key, (bias, selected) in self._handover.items()}
        return stats, handover

    def restore(self, saved: tuple) -> None:
        """The statistics and hand-over buffers as :meth:`snapshot` saw them, written in place (a captured
        graph holds their addresses); what was allocated since then goes back to zeros, as it started."""
        stats, handover = saved
        if stats is not None and self._stats is not None and stats.shape == self._stats.shape:
            self._stats.copy_(stats)
        elif self._stats is not None:  # allocated since: there were no statistics before
            self._stats.zero_()
        for key, (bias, selected) in self._handover.items():
            before = handover.get(key)
            if before is None:
                bias.zero_()
                selected.zero_()
            else:
                bias.copy_(before[0])
                selected.copy_(before[1])
        self.router_inputs.clear()

    @contextlib.contextmanager
    def exact_widths(self):
        """Every sparse layer reads the exact width of its threshold selection (the rerun of an overflow)."""
        self._exact_widths = True
        try:
            yield
        finally:
            self._exact_widths = False

    def observe(self, layer_number: int, logits: torch.Tensor, decision) -> None:
        for observer in self.observers:
            observer(layer_number, logits, decision)

    # --- statistics ---------------------------------------------------------------------------------
    def record_values(self, layer_number: int, names: tuple, values: list, microbatch_loss=None,
                      counts: Optional[list] = None) -> None:
        """Add one call's 0-d ``values`` of the metrics ``names`` (and count them), and its micro-batch
        router loss, with one stack and one in-place ``index_add_``; no host sync. ``counts``: what each
        value adds to its count (None: 1, one call); a fraction can be written as (number of tokens,
        :meth:`constant` total) and saves the division: its mean is then over tokens. ``NONFINITE`` is
        written as the pair (finite count, number of logits): see :meth:`nonfinite_values`."""
        if not self.recording:
            names, values = (), []
        if not names and microbatch_loss is None:
            return
        if microbatch_loss is not None:
            self._loss_layers.add(layer_number)
        device = (values[0] if names else microbatch_loss).device
        index = self._index(layer_number, names, microbatch_loss is not None, device)
        one = self.constant(1.0, device)
        counts = [one] * len(names) if counts is None else [one if c is None else c for c in counts]
        parts = [value.detach() for value in values] + counts
        if microbatch_loss is not None:
            parts += [microbatch_loss.detach(), one]
        self._stats.index_add_(0, index, torch.stack(parts))

    def nonfinite_values(self, logits: torch.Tensor) -> tuple[tuple, list]:
        """(names, values) that record the non-finite count of ``logits``: 2 ops (isfinite, sum)."""
        return (_FINITE, _LOGITS), [torch.isfinite(logits).sum(), self.constant(logits.numel(), logits.device)]

    def record(self, name: str, layer_number: int, value: torch.Tensor) -> None:
        """One metric value (:meth:`record_values` writes several at once)."""
        if name == NONFINITE:
            raise ValueError(f"{NONFINITE}: record the router logits with nonfinite_values()")
        self.record_values(layer_number, (name,), [value])

    def add_microbatch_loss(self, loss: torch.Tensor, layer_number: int = 0) -> None:
        self.record_values(layer_number, (), [], microbatch_loss=loss)

    def take_microbatch_sum(self) -> Optional[torch.Tensor]:
        """[sum, count] of the router losses added since the last take (a new tensor), then cleared;
        None when no layer of this state adds any."""
        if not self._loss_layers or self._stats is None:
            return None
        taken = self._stats[-2:].clone()
        self._stats[-2:].zero_()
        return taken

    def take_microbatch_losses(self) -> list[torch.Tensor]:
        """The mean router loss of the micro-batch just run, as a one-element list (empty: none)."""
        taken = self.take_microbatch_sum()
        return [] if taken is None else [taken[0] / taken[1].clamp(min=1)]

    def reset(self) -> None:
        self.router_inputs.clear()
        if self._stats is not None:
            self._stats.zero_()

    def forget(self, names) -> None:
        """Drop the interval statistics of the metrics ``names`` only (e.g. the eval_* ones after a
        validation, leaving the training interval's for the next log line)."""
        names = {n for name in names for n in ((_FINITE, _LOGITS) if name == NONFINITE else (name,))}
        columns = [self._column[name] for name in names if name in self._column]
        if self._stats is not None and columns:
            self._table().index_fill_(2, torch.tensor(columns, device=self._stats.device), 0.0)

    def nonfinite_sums(self) -> tuple[list[int], Optional[torch.Tensor]]:
        """(layer numbers, their non-finite router-logit counts so far): a new device tensor, no host sync."""
        if self._stats is None or _FINITE not in self._column:
            return [], None
        layers = [layer for layer in self._layers if _FINITE in self._layer_names[layer]]
        rows = self._indices.get(("nonfinite rows",))
        if rows is None:
            rows = self._indices[("nonfinite rows",)] = torch.tensor([self._row[layer] for layer in layers],
                                                                      device=self._stats.device)
        sums = self._table()[:, 0].index_select(0, rows)
        return layers, sums[:, self._column[_LOGITS]] - sums[:, self._column[_FINITE]]

    def items(self):
        """((name, layer_number), (sum, count)) of the interval so far, on the host (one read). The
        count is the number of calls, or of tokens for a fraction written per token (the mean is sum / count)."""
        if self._stats is None:
            return iter(())
        table = self._table().detach().cpu()
        entries = []
        for r, layer in enumerate(self._layers):
            for name in self._names:
                if name == _LOGITS:
                    continue
                c = self._column[name]
                count = table[r, 1, c].item()
                if not count:
                    continue
                count = int(count) if count == int(count) else count
                value = table[r, 0, c]
                if name == _FINITE:
                    name, value = NONFINITE, table[r, 0, self._column[_LOGITS]] - value
                entries.append(((name, layer), (value, count)))
        return iter(entries)


def is_recorder(module: torch.nn.Module) -> bool:
    return hasattr(type(module), "ROUTING_METRICS")


def attach_routing_state(model: torch.nn.Module, eval_rule: str = "threshold",
                         eval_capacity_factor: Optional[float] = 0.0) -> RoutingState:
    """Give every recorder of the built model chunk ``model`` one shared :class:`RoutingState`
    (kept as ``model.routing_state``); idempotent."""
    state = getattr(model, "routing_state", None)
    if not isinstance(state, RoutingState):
        state = RoutingState(eval_rule, eval_capacity_factor)
        model.routing_state = state
    for module in model.modules():
        if is_recorder(module):
            module.routing_state = state
            if getattr(module, "layer_number", None) is not None:
                state.register(module.layer_number, type(module).ROUTING_METRICS)
    return state


def install_capacity_check(model: torch.nn.Module) -> bool:
    """Let the threshold rule of ``model``'s sparse layers run at a static width (no host read per
    layer): a forward hook on the chunk's decoder (megatron's TransformerBlock, ``model.decoder``) reads
    once per pass whether a layer overflowed its capacity and, if one did, runs the decoder again at
    exact widths and returns that output. The rerun calls ``forward`` itself with the arguments the
    first run got (after the decoder's pre-hooks, such as the pipeline carry's input split), and the
    routing state is restored first, so the result is that of an exact pass. False (nothing installed)
    for a model without a decoder or without a routing state (attach_routing_state)."""
    state = getattr(model, "routing_state", None)
    decoder = getattr(model, "decoder", None)
    if not isinstance(state, RoutingState) or decoder is None:
        return False
    if not state.capacity_checked:
        def rerun_at_exact_widths(module, args, kwargs, output):
            if not state.end_capacity_pass():
                return None
            with state.exact_widths():
                return module.forward(*args, **kwargs)

        def start_pass(module, args):
            state._before_pass = None  # a pass that raised leaves nothing behind for the next one

        decoder.register_forward_pre_hook(start_pass)
        decoder.register_forward_hook(rerun_at_exact_widths, with_kwargs=True)
        state.capacity_checked = True
    return True


def routing_states(model_chunks: torch.nn.Module | Iterable[torch.nn.Module]) -> list[RoutingState]:
    """The distinct states of the recorders in ``model_chunks`` (wrapped or not), in module order."""
    if isinstance(model_chunks, torch.nn.Module):
        model_chunks = [model_chunks]
    states: list[RoutingState] = []
    for chunk in model_chunks:
        for module in chunk.modules():
            state = getattr(module, "routing_state", None) if is_recorder(module) else None
            if state is not None and all(state is not s for s in states):
                states.append(state)
    return states


def set_eval_routing(model_chunks, rule: str) -> None:
    """Switch the eval-mode routing rule (threshold | topk) of the sparse layers of ``model_chunks``."""
    check_eval_rule(rule)
    for state in routing_states(model_chunks):
        state.eval_rule = rule


def set_iteration(model_chunks, iteration: Optional[int]) -> None:
    """The training iteration the sparse layers of ``model_chunks`` run (the tau warm-up's clock)."""
    for state in routing_states(model_chunks):
        state.iteration = None if iteration is None else int(iteration)


@contextlib.contextmanager
def eval_routing(model_chunks, rule: str):
    states = routing_states(model_chunks)
    previous = [state.eval_rule for state in states]
    set_eval_routing(model_chunks, rule)
    try:
        yield
    finally:
        for state, rule_before in zip(states, previous):
            state.eval_rule = rule_before


@contextlib.contextmanager
def kept_through(modules: Iterable[torch.nn.Module]):
    """Run a block that executes ``modules`` (layers or model chunks) without leaving a trace in their
    routing state: megatron's CUDA-graph capture runs each captured layer on sample inputs, its warm-up
    iterations and then the capture itself (forward and backward), which would otherwise add to the
    interval statistics, the micro-batch router losses and the hand-over buffers, and to the DTop-p
    router's activation counters (its buffers). All of it is written back in place, as it was before the
    block: the captured graphs keep the addresses."""
    modules = list(modules)
    states = routing_states(modules)
    recorders = list({id(m): m for chunk in modules for m in chunk.modules() if is_recorder(m)}.values())
    saved = [state.snapshot() for state in states]
    # by name: a module may replace a buffer during the block (the DTop-p router makes its bf16-cast
    # counters fp32 again at its first forward), and what it holds then is what the graphs write
    buffers = [(module, name, buffer.clone()) for module in recorders
               for name, buffer in module.named_buffers(recurse=False)]
    try:
        yield
    finally:
        for state, before in zip(states, saved):
            state.restore(before)
        for module, name, before in buffers:
            getattr(module, name).copy_(before)


@contextlib.contextmanager
def statistics_paused(model_chunks):
    """Run a pass that leaves the interval statistics alone (the validation's top-k comparison: the
    eval_* statistics then describe the evaluation rule only)."""
    states = routing_states(model_chunks)
    previous = [state.recording for state in states]
    for state in states:
        state.recording = False
    try:
        yield
    finally:
        for state, before in zip(states, previous):
            state.recording = before


def take_microbatch_loss(model_chunks) -> Optional[torch.Tensor]:
    """Mean router loss over the recorders of ``model_chunks`` for the micro-batch just run (then cleared)."""
    taken = [t for state in routing_states(model_chunks) if (t := state.take_microbatch_sum()) is not None]
    if not taken:
        return None
    total = taken[0] if len(taken) == 1 else torch.stack(taken).sum(0)
    return total[0] / total[1].clamp(min=1)


def per_layer(model_chunks, names: Optional[Iterable[str]] = None, num_layers: Optional[int] = None,
              group=None) -> dict[str, dict[int, float]]:
    """{metric: {layer_number: mean over the interval}} of ``model_chunks``' states.

    With ``group``, every rank of it must call this together with the same ``names`` (ranks reduce
    one tensor, whose shape the names fix: pass the union of the recorder classes' ROUTING_METRICS)
    and the same ``num_layers``.
    """
    entries = [entry for state in routing_states(model_chunks) for entry in state.items()]
    names = sorted({name for (name, _), _ in entries}) if names is None else list(names)
    if num_layers is None:
        num_layers = max((layer for (_, layer), _ in entries), default=0)
    totals = torch.zeros(len(names), num_layers + 1, 2)
    for (name, layer), (value, count) in entries:
        if name in names:
            totals[names.index(name), layer] += torch.stack([value.cpu(), torch.tensor(float(count))])
    if group is not None and torch.distributed.is_initialized():
        device = "cuda" if torch.cuda.is_available() else "cpu"
        reduced = totals.to(device)
        torch.distributed.all_reduce(reduced, group=group)
        totals = reduced.cpu()
    out: dict[str, dict[int, float]] = defaultdict(dict)
    for i, name in enumerate(names):
        for layer in range(num_layers + 1):
            total, count = totals[i, layer].tolist()
            if count:
                out[name][layer] = total / count
    return out


def report(model_chunks, names: Optional[Iterable[str]] = None, num_layers: Optional[int] = None, group=None,
           reset_after: bool = True) -> dict[str, float]:
    """Flat dict: ``<metric>`` (mean over layers) and ``<metric>/layer_<n>`` entries."""
    flat: dict[str, float] = {}
    for name, layers in per_layer(model_chunks, names, num_layers, group).items():
        flat[name] = sum(layers.values()) / len(layers)
        for layer, value in layers.items():
            flat[f"{name}/layer_{layer:03d}"] = value
    if reset_after:
        for state in routing_states(model_chunks):
            state.reset()
    return flat


# --- activation memory of routed layers ------------------------------------------------------------
def recompute_phase(training: bool) -> Optional[str]:
    """"first" in the no-grad first pass of megatron's full recompute, "replay" when the chunk is
    recomputed inside the backward pass, None otherwise."""
    from megatron.core.tensor_parallel.random import is_checkpointing

    if not (training and is_checkpointing()):
        return None
    return "replay" if torch.is_grad_enabled() else "first"


class RecomputeReplay:
    """The carried token-choice bias of every checkpointed layer, from the first pass to its replay."""

    def __init__(self):
        self._queues: dict[int, deque] = defaultdict(deque)

    def push(self, layer_number: int, carried) -> None:
        self._queues[layer_number].append(carried)

    def pop(self, layer_number: int):
        queue = self._queues.get(layer_number)
        if not queue:
            raise RuntimeError(
                f"recompute: sparse layer {layer_number} is being recomputed but its first pass left no "
                "token-choice bias; the forward and the recompute must run under megatron's CheckpointFunction")
        return queue.popleft()

    def clear(self) -> None:
        self._queues.clear()


def _fingerprint(x: torch.Tensor) -> tuple:
    return (x.data_ptr(), tuple(x.shape), x.stride(), x._version, x.device)


class ChainLink(NamedTuple):
    """What one routed layer of a chain changed in its input: the flat rows ``index`` [k*b] of the [s*b, h]
    view, their values after the layer (``after``, read from the next layer's input) and before it
    (``before``, the layer's own gathered input rows)."""
    index: torch.Tensor
    after: torch.Tensor
    before: torch.Tensor


class RouterInputChain:
    """Hands the router-input chain of a block from one routed layer to the next (weak references only)."""

    def __init__(self):
        self._layer_number: Optional[int] = None
        self._base: Optional[weakref.ref] = None
        self._links: list[tuple[weakref.ref, weakref.ref, weakref.ref]] = []  # weak ChainLinks
        self._cursor: Optional[ChainCursor] = None
        self._output: Optional[weakref.ref] = None
        self._output_fingerprint: Optional[tuple] = None
        self._written: Optional[torch.Tensor] = None  # flat rows the previous layer wrote
        self._before: Optional[torch.Tensor] = None  # their values before it wrote them

    def take(self, layer_number: int, x: torch.Tensor):
        """(base, [ChainLink, ...], cursor) from which ``x`` is rebuilt, or None: ``x`` starts a chain."""
        if not self.follows(layer_number, x) or self._base is None:
            return None
        output, base = self._output(), self._base()
        if output is None or base is None:
            return None
        links = []
        for refs in self._links:
            link = ChainLink(*(ref() for ref in refs))
            if any(t is None for t in link):
                return None
            links.append(link)
        # The rows the previous layer wrote, read from its output (this layer's input): exact.
        written = self._written
        links.append(ChainLink(written, x.detach().reshape(-1, x.shape[-1]).index_select(0, written), self._before))
        return base, links, self._cursor

    def put(self, layer_number: int, chain, output: torch.Tensor, written: torch.Tensor, before: torch.Tensor) -> None:
        """After routed layer ``layer_number`` (its chain from :func:`router_logits`) wrote the flat
        rows ``written`` of ``output``; ``before``: those rows of its input ([k*b, h], in ``written``'s order)."""
        base, links, cursor = chain
        self._layer_number = layer_number
        self._base = weakref.ref(base)
        self._links = [tuple(weakref.ref(t) for t in link) for link in links]
        self._cursor = cursor
        self._output = weakref.ref(output)
        self._output_fingerprint = _fingerprint(output)
        self._written, self._before = written, before

    def follows(self, layer_number: int, x: torch.Tensor) -> bool:
        """Whether ``x`` is the output of routed layer ``layer_number - 1`` as it left that layer (same tensor
        storage and version): the residual stream the routed layers of a block update in place."""
        output = None if self._output is None else self._output()
        return (self._layer_number == layer_number - 1 and output is not None
                and _fingerprint(x) == self._output_fingerprint)

    def note_output(self, layer_number: int, output: torch.Tensor) -> None:
        """Without autograd (no chain to save): routed layer ``layer_number`` wrote ``output``, which the next
        routed layer may then update in place (:meth:`follows`)."""
        self.clear()
        self._layer_number = layer_number
        self._output, self._output_fingerprint = weakref.ref(output), _fingerprint(output)

    def clear(self) -> None:
        self.__init__()


class ChainCursor:
    """The router inputs of one chain rebuilt in backward: one buffer holding x_p (the base with the first
    ``p`` links applied), moved to the layer asked for by copying rows, forward (``after``) or back
    (``before``). Backward visits a chain's layers last to first, so each layer costs one row copy (the
    whole chain O(N) copies, where rebuilding every layer from the base cost O(N^2)); any other order
    stays exact, at the cost of the distance moved. Copies only, no arithmetic: bit-exact."""

    def __init__(self):
        self._buffer: Optional[torch.Tensor] = None
        self._applied: list[ChainLink] = []  # the links in the buffer, in order (dropped as it steps back)
        # the residual stream's gradient buffer the chain's in-place updates made and write in backward
        # (megatron_xmod.xmod.permute.reference.StreamGrad)
        self.stream_grad: Optional[torch.Tensor] = None

    def input(self, base: torch.Tensor, links: list[ChainLink]) -> torch.Tensor:
        """x_l for a layer whose chain is ``links`` (l = len(links)); valid until the next call."""
        target = len(links)
        if target == 0:  # the chain's first layer: its input is the base itself
            self._buffer, self._applied = None, []
            return base
        if self._buffer is None:
            self._buffer = base.clone()
        flat = self._buffer.view(-1, self._buffer.shape[-1])
        for link in links[len(self._applied):]:
            flat.index_copy_(0, link.index, link.after)
            self._applied.append(link)
        while len(self._applied) > target:
            link = self._applied.pop()
            flat.index_copy_(0, link.index, link.before)
        return self._buffer


class RouterLogits(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` of the d -> 1 router, saving the chain (base + rows) instead of x.

    Inputs: x [s, b, h], weight [1, h], bias [1] (or None), the chain's base (x.detach() itself when x
    starts the chain), its :class:`ChainCursor`, then the chain's links, flattened. Outputs: the logits
    and x itself again (an alias), which the layer's routed update reads: the alias's gradient then
    arrives here and the router's d x (the outer product d logits w) is added to it in one pass (``addcmul``),
    where the autograd engine would spend an ``mm`` and an ``add`` (issue 28's backward launch count), and
    ``addmm`` would copy the gradient before adding.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, base, cursor, stream_grad, *links):
        ctx.x_shape, ctx.has_bias, ctx.cursor, ctx.stream_grad = x.shape, bias is not None, cursor, stream_grad
        ctx.save_for_backward(weight, base, *links)
        return F.linear(x, weight, bias), None if stream_grad is not None else x.view_as(x)

    @staticmethod
    def backward(ctx, grad_output, grad_alias):
        weight, base, *flat_links = ctx.saved_tensors
        width = len(ChainLink._fields)
        links = [ChainLink(*flat_links[i:i + width]) for i in range(0, len(flat_links), width)]
        grad = grad_output.reshape(-1, grad_output.shape[-1])  # [s*b, 1]
        grad_x = grad_weight = grad_bias = None
        stream = None
        if ctx.stream_grad is not None:  # an in-place update's: the chain's own buffer, written in place
            stream, ctx.stream_grad.grad = ctx.stream_grad.grad, None
            if not ctx.stream_grad.continues:  # the chain's first layer: the buffer leaves the chain as x's gradient
                ctx.cursor.stream_grad = None
        if ctx.needs_input_grad[0]:
            if stream is not None:
                stream.view(grad.shape[0], -1).addcmul_(grad, weight)
                grad_x = stream  # the buffer itself, not a view: the next update down the chain knows it by identity
            else:
                grad_x = (grad * weight if grad_alias is None else
                          torch.addcmul(grad_alias.reshape(grad.shape[0], -1), grad, weight)).view(ctx.x_shape)
        if ctx.needs_input_grad[1]:  # as addmm's backward computes it: (x^T g)^T
            x = ctx.cursor.input(base, links)
            grad_weight = x.reshape(-1, x.shape[-1]).t().mm(grad).t()
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad.sum(0)
        return (grad_x, grad_weight, grad_bias, None, None, None) + (None,) * len(flat_links)


def router_logits(router: torch.nn.Linear, x: torch.Tensor, chain_handover: Optional[RouterInputChain], layer_number: int,
                  stream_grad=None):
    """(router logits x w [s, b, 1] without the router's bias (the routing step adds it:
    megatron_xmod.xmod.kernels.routing_step), the chain for :meth:`RouterInputChain.put` or None (no
    ``chain_handover``, e.g. under CUDA graphs, or nothing to save: no autograd, where a plain linear
    does), and the tensor the layer's routed update should read x from: :class:`RouterLogits`'s alias of
    x, or x itself).

    ``stream_grad``: the gradient hand-over of a layer whose update is in place
    (megatron_xmod.xmod.permute.reference.StreamGrad), which this call wires to the chain (``continues``:
    x is the previous routed layer's output); the router's backward then adds its part of x's gradient
    into the chain's buffer in place and returns it, and no alias is returned (None)."""
    if not (torch.is_grad_enabled() and router.weight.requires_grad):
        if stream_grad is not None and chain_handover is not None:  # no chain to save; x may still be the stream
            stream_grad.continues = chain_handover.follows(layer_number, x)
        return F.linear(x, router.weight), None, x
    chain = None if chain_handover is None else chain_handover.take(layer_number, x)
    continues = chain is not None
    if chain is None:  # x starts a chain (or saves itself): it is its own base
        chain = (x.detach(), [], ChainCursor())
    base, links, cursor = chain
    if stream_grad is not None:
        stream_grad.chain, stream_grad.continues = cursor, continues
    flat = [t for link in links for t in link]
    logits, alias = RouterLogits.apply(x, router.weight, None, base, cursor, stream_grad, *flat)
    return logits, None if chain_handover is None else chain, alias


def flat_rows(indices: torch.Tensor, batch: int) -> torch.Tensor:
    """Rows of an [s, b, h] tensor viewed as [s*b, h] at positions ``indices`` [k, b] of each sequence."""
    return (indices * batch + torch.arange(batch, device=indices.device)).reshape(-1)
