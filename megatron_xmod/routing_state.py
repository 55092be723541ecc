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
  dictionary.

Nothing here is global: two models in one process share nothing, and a spec stays data.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Optional

import torch

from megatron_xmod.memory import RecomputeReplay, RouterInputCarry

EVAL_ROUTING_RULES = ("threshold", "topk")


class RoutingState:
    def __init__(self, eval_rule: str = "threshold"):
        self.eval_rule = check_eval_rule(eval_rule)
        self._carry: Optional[tuple[int, torch.Tensor, torch.Tensor]] = None
        self._sums: dict[tuple[str, int], torch.Tensor] = {}
        self._counts: dict[tuple[str, int], int] = defaultdict(int)
        self._microbatch_losses: list[torch.Tensor] = []
        # Training iteration being run (set before each train step by patch 15 of training/patches.py):
        # the token-choice bias warm-up reads it. None outside training: a trained model, full tau.
        self.iteration: Optional[int] = None
        # Callables (layer_number, router logits, RoutingDecision) that see every sparse layer's routing
        # as it happens (the routing report's recorder, megatron_xmod.diagnostics); empty in training.
        self.observers: list[Callable] = []
        # False while a pass runs that must not count in the interval statistics (the top-k comparison
        # pass of validation, training/step.py): see :func:`statistics_paused`.
        self.recording = True
        # Routed layers' activation-memory and full-recompute hand-overs (megatron_xmod.memory).
        self.router_inputs = RouterInputCarry()
        self.recompute_replay = RecomputeReplay()

    # --- token-choice bias hand-over ---------------------------------------------------------------
    def take_bias(self, layer_number: int, shape: tuple[int, ...]):
        """(b, routed set) left by the layer directly before ``layer_number``, else (None, None).

        Consecutive sparse layers of a block are adjacent, so an anchor in between, or the start of
        the next forward pass (which begins at a lower layer number), resets b.
        """
        if self._carry is not None:
            number, bias, selected = self._carry
            if number == layer_number - 1 and tuple(bias.shape) == shape:
                return bias, selected
        return None, None

    def put_bias(self, layer_number: int, bias: torch.Tensor, selected: torch.Tensor) -> None:
        self._carry = (layer_number, bias, selected)

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
        self._carry = None
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


def check_eval_rule(rule: str) -> str:
    if rule not in EVAL_ROUTING_RULES:
        raise ValueError(f"xmod_eval_routing: {rule!r} is not one of {', '.join(EVAL_ROUTING_RULES)}")
    return rule


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
