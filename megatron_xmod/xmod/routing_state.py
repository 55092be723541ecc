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
their flat indices; backward rebuilds x_l by copying rows (no arithmetic, so bit-exact) and computes
the router gradients with the same matmuls as ``nn.Linear``'s backward. Memory per routed layer:
O(L/K), plus one O(L) base per block.

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
import weakref
from collections import defaultdict, deque
from collections.abc import Callable, Iterable
from typing import Optional

import torch
import torch.nn.functional as F

from megatron_xmod.xmod.routing import check_eval_rule


class RoutingState:
    def __init__(self, eval_rule: str = "threshold"):
        self.eval_rule = check_eval_rule(eval_rule)
        self._bias_handover: Optional[tuple[int, torch.Tensor, torch.Tensor]] = None
        self._sums: dict[tuple[str, int], torch.Tensor] = {}
        self._counts: dict[tuple[str, int], int] = defaultdict(int)
        self._microbatch_losses: list[torch.Tensor] = []
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

    # --- token-choice bias hand-over ---------------------------------------------------------------
    def take_bias(self, layer_number: int, shape: tuple[int, ...]):
        """(b, routed set) left by the layer directly before ``layer_number``, else (None, None).

        Consecutive sparse layers of a block are adjacent, so an anchor in between, or the start of
        the next forward pass (which begins at a lower layer number), resets b.
        """
        if self._bias_handover is not None:
            number, bias, selected = self._bias_handover
            if number == layer_number - 1 and tuple(bias.shape) == shape:
                return bias, selected
        return None, None

    def put_bias(self, layer_number: int, bias: torch.Tensor, selected: torch.Tensor) -> None:
        self._bias_handover = (layer_number, bias, selected)

    def observe(self, layer_number: int, logits: torch.Tensor, decision) -> None:
        for observer in self.observers:
            observer(layer_number, logits, decision)

    # --- statistics ---------------------------------------------------------------------------------
    def record(self, name: str, layer_number: int, value: torch.Tensor) -> None:
        if not self.recording:
            return
        key = (name, layer_number)
        value = value.detach().float()
        self._sums[key] = value if key not in self._sums else self._sums[key] + value
        self._counts[key] += 1

    def add_microbatch_loss(self, loss: torch.Tensor) -> None:
        self._microbatch_losses.append(loss.detach().float())

    def take_microbatch_losses(self) -> list[torch.Tensor]:
        losses, self._microbatch_losses = self._microbatch_losses, []
        return losses

    def reset(self) -> None:
        self._bias_handover = None
        self.router_inputs.clear()
        self._sums.clear()
        self._counts.clear()
        self._microbatch_losses.clear()

    def forget(self, names) -> None:
        """Drop the interval statistics of the metrics ``names`` only (e.g. the eval_* ones after a
        validation, leaving the training interval's for the next log line)."""
        for key in [key for key in self._sums if key[0] in names]:
            del self._sums[key]
            self._counts.pop(key, None)

    def items(self):
        """((name, layer_number), (sum, count)) of the interval so far."""
        return ((key, (value, self._counts[key])) for key, value in self._sums.items())


def is_recorder(module: torch.nn.Module) -> bool:
    return hasattr(type(module), "ROUTING_METRICS")


def attach_routing_state(model: torch.nn.Module, eval_rule: str = "threshold") -> RoutingState:
    """Give every recorder of the built model chunk ``model`` one shared :class:`RoutingState`
    (kept as ``model.routing_state``); idempotent."""
    state = getattr(model, "routing_state", None)
    if not isinstance(state, RoutingState):
        state = RoutingState(eval_rule)
        model.routing_state = state
    for module in model.modules():
        if is_recorder(module):
            module.routing_state = state
    return state


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
    losses = [loss for state in routing_states(model_chunks) for loss in state.take_microbatch_losses()]
    return torch.stack(losses).mean() if losses else None


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


class RouterInputChain:
    """Hands the router-input chain of a block from one routed layer to the next (weak references only)."""

    def __init__(self):
        self._layer_number: Optional[int] = None
        self._base: Optional[weakref.ref] = None
        self._links: list[tuple[torch.Tensor, weakref.ref]] = []  # (flat row indices, weakref to rows)
        self._output: Optional[weakref.ref] = None
        self._output_fingerprint: Optional[tuple] = None
        self._written: Optional[torch.Tensor] = None  # flat rows the previous layer wrote

    def take(self, layer_number: int, x: torch.Tensor):
        """(base, [(flat indices, rows), ...]) from which ``x`` is rebuilt, or None: ``x`` starts a chain."""
        if self._layer_number != layer_number - 1 or self._output is None:
            return None
        output, base = self._output(), self._base()
        if output is None or base is None or _fingerprint(x) != self._output_fingerprint:
            return None
        links = []
        for index, rows in self._links:
            rows = rows()
            if rows is None:
                return None
            links.append((index, rows))
        # The rows the previous layer wrote, read from its output (this layer's input): exact.
        written = self._written
        links.append((written, x.detach().reshape(-1, x.shape[-1]).index_select(0, written)))
        return base, links

    def put(self, layer_number: int, chain, output: torch.Tensor, written: torch.Tensor) -> None:
        """After routed layer ``layer_number`` (its chain from :func:`router_logits`) wrote the flat
        rows ``written`` of ``output``."""
        base, links = chain
        self._layer_number = layer_number
        self._base = weakref.ref(base)
        self._links = [(index, weakref.ref(rows)) for index, rows in links]
        self._output = weakref.ref(output)
        self._output_fingerprint = _fingerprint(output)
        self._written = written

    def clear(self) -> None:
        self.__init__()


def rebuild_input(base: torch.Tensor, links) -> torch.Tensor:
    """x_l: the chain's base with every earlier layer's written rows copied in, in layer order."""
    if not links:
        return base
    x = base.clone()
    flat = x.view(-1, x.shape[-1])
    for index, rows in links:
        flat.index_copy_(0, index, rows)
    return x


class RouterLogits(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` of the d -> 1 router, saving the chain (base + rows) instead of x.

    Inputs: x [s, b, h], weight [1, h], bias [1] (or None), the chain's base (x.detach() itself when x
    starts the chain), then the chain's (flat indices, rows) pairs, flattened.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, base, *links):
        ctx.x_shape, ctx.has_bias = x.shape, bias is not None
        ctx.save_for_backward(weight, base, *links)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        weight, base, *flat_links = ctx.saved_tensors
        links = list(zip(flat_links[0::2], flat_links[1::2]))
        grad = grad_output.reshape(-1, grad_output.shape[-1])  # [s*b, 1]
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = grad.mm(weight).view(ctx.x_shape)
        if ctx.needs_input_grad[1]:  # as addmm's backward computes it: (x^T g)^T
            x = rebuild_input(base, links)
            grad_weight = x.reshape(-1, x.shape[-1]).t().mm(grad).t()
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad.sum(0)
        return (grad_x, grad_weight, grad_bias, None) + (None,) * len(flat_links)


def router_logits(router: torch.nn.Linear, x: torch.Tensor, chain_handover: Optional[RouterInputChain], layer_number: int):
    """Router logits [s, b, 1] and the chain (for :meth:`RouterInputChain.put`), or (logits, None)
    when nothing needs saving (no autograd) and a plain ``nn.Linear`` call does."""
    if chain_handover is None or not (torch.is_grad_enabled() and router.weight.requires_grad):
        return router(x), None
    chain = chain_handover.take(layer_number, x)
    if chain is None:  # x starts a chain: it is its own base (the same object that the handover refers to)
        chain = (x.detach(), [])
    base, links = chain
    flat = [t for pair in links for t in pair]
    return RouterLogits.apply(x, router.weight, router.bias, base, *flat), chain


def flat_rows(indices: torch.Tensor, batch: int) -> torch.Tensor:
    """Rows of an [s, b, h] tensor viewed as [s*b, h] at positions ``indices`` [k, b] of each sequence."""
    return (indices * batch + torch.arange(batch, device=indices.device)).reshape(-1)
