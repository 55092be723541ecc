"""An emulated CUDA-graph capture and replay on CPU (a test tool, not product code).

A CUDA graph records the kernels that one run of a region launched, with the addresses they read
and wrote, and a replay relaunches exactly those kernels: no Python runs, tensors that existed
before the capture (parameters, static inputs, state buffers, ``.grad`` buffers) are the same memory,
and everything the region allocated is the graph's private memory. A module is graph-safe when a
replay leaves the same outputs, gradients and state as an eager run on the same inputs.

:func:`record` runs a callable (e.g. one training forward and backward) under a
``TorchDispatchMode`` and keeps every aten op it dispatched (the autograd engine's backward ops
included: the mode is propagated to it) with its arguments and outputs. :meth:`Recording.replay`
runs those ops again, op by op, under ``torch.no_grad()``: an argument that a recorded op produced is
replaced by that op's replayed output, every other tensor is the same object (a CUDA graph's fixed
address). Copy new values into the recorded inputs first (:meth:`Recording.set_inputs`).

What a CUDA graph cannot hold is refused while recording (:class:`NotCapturable`): a host
synchronisation (``aten._local_scalar_dense``: ``.item()``, ``int(t)``, Python control flow on a
tensor; ``.tolist()`` / ``.numpy()``, which read the data without a dispatched op, through a
``TorchFunctionMode``) and data-dependent output shapes (``nonzero``, ``unique``, ...). Python
side effects are invisible to the replay by construction: that is what the test of a module checks.

Conditional nodes (CUDA >= 12.4: a child graph that the device runs when a flag tensor is true):
:meth:`_Recorder.branch` has the signature of ``StaticDecodeState.branch`` (``branch(pred, body)``) and
records ``body``'s ops as a child of the recording, without reading ``pred``; the replay runs them when
the replayed ``pred`` is true (the emulator plays the device there). As a capture, the recording runs
the body whatever ``pred`` says, so the state it leaves is not a step's: restore it after recording.

``tensor.data = other`` (megatron's ``make_viewless_tensor``) re-points a tensor's storage without
an aten op; the recording notices a tensor whose storage changed after it was produced and replays
it as an alias of the recorded tensor that owns that storage now.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

HOST_SYNC = {"aten._local_scalar_dense.default", "aten.item.default", "aten.equal.default", "aten.is_nonzero.default"}
DYNAMIC_SHAPE = {"aten.nonzero.default", "aten.nonzero_static.default", "aten.unique.default", "aten._unique.default",
                 "aten._unique2.default", "aten.unique_dim.default", "aten.unique_consecutive.default",
                 "aten.masked_select.default", "aten.bincount.default"}


class NotCapturable(RuntimeError):
    """The recorded region did something a CUDA graph cannot capture."""


class _HostReads(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in ("tolist", "numpy"):
            raise NotCapturable(f"Tensor.{func.__name__}(): a host synchronisation cannot be captured in a CUDA graph")
        return func(*args, **(kwargs or {}))


def _storage_key(t: torch.Tensor):
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


@dataclasses.dataclass
class _Op:
    func: Any
    args: tuple
    kwargs: dict
    outputs: list  # flattened recorded outputs (tensors or other values)
    aliases: list  # (recorded tensor, recorded source tensor) resolved just before this op


@dataclasses.dataclass
class _Conditional:
    pred: torch.Tensor  # a recorded 0-dim bool tensor
    ops: list  # the child's ops (_Op or _Conditional)


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[_Op] = []
        self.produced: dict[int, tuple] = {}  # id(recorded tensor) -> storage key when produced
        self.keep: list = []  # strong references: ids stay unique while the recording lives
        self.by_storage: dict[tuple, torch.Tensor] = {}
        self.outer: list = []  # (enclosing op list, flag) of each open conditional node

    def _check_aliases(self, tensors) -> list:
        aliases = []
        for t in tensors:
            key = self.produced.get(id(t))
            if key is not None and key != _storage_key(t):  # re-pointed by `t.data = ...`
                source = self.by_storage.get(_storage_key(t))
                if source is None or source is t:
                    raise NotCapturable(f"a tensor of shape {tuple(t.shape)} changed its storage outside any aten op, "
                                        "to memory no recorded op produced")
                aliases.append((t, source))
                self.produced[id(t)] = _storage_key(t)
        return aliases

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if name in HOST_SYNC:
            raise NotCapturable(f"{name}: a host synchronisation (.item(), int(tensor), .tolist(), Python control flow "
                                "on a tensor) cannot be captured in a CUDA graph")
        if name in DYNAMIC_SHAPE:
            raise NotCapturable(f"{name}: its output shape depends on the data, which a CUDA graph cannot replay")
        flat_in = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        aliases = self._check_aliases(flat_in)
        out = func(*args, **kwargs)
        flat_out = pytree.tree_leaves(out)
        for t in flat_out:
            if isinstance(t, torch.Tensor):
                self.produced[id(t)] = _storage_key(t)
                self.by_storage[_storage_key(t)] = t
        self.keep.append((args, kwargs, flat_out))
        self.ops.append(_Op(func, args, kwargs, flat_out, aliases))
        return out

    def begin_conditional(self, pred: torch.Tensor) -> None:
        """The ops from here to :meth:`end_conditional` form a conditional node on ``pred`` (not read)."""
        self.outer.append((self.ops, pred))
        self.keep.append(pred)
        self.ops = []

    def end_conditional(self) -> None:
        (outer, pred), child = self.outer.pop(), self.ops
        self.ops = outer
        self.ops.append(_Conditional(pred, child))

    def branch(self, pred: torch.Tensor, body: Callable[[], None]) -> None:
        """Record ``body()``'s ops as a conditional node on ``pred`` (not read)."""
        self.begin_conditional(pred)
        try:
            body()
        finally:
            self.end_conditional()


class Recording:
    """The aten ops of one recorded run; see the module docstring."""

    def __init__(self, recorder: _Recorder, inputs: dict[str, torch.Tensor], result):
        self.ops = recorder.ops
        self.inputs = inputs
        self.result = result
        self._recorder = recorder
        self._final_aliases = recorder._check_aliases(
            [t for t in pytree.tree_leaves(result) if isinstance(t, torch.Tensor)])

    def __len__(self) -> int:
        return len(self.ops)

    def op_names(self) -> list[str]:
        return [str(op.func) for op in self.ops if isinstance(op, _Op)]

    def conditionals(self) -> int:
        """Conditional nodes at the top level of the recording."""
        return sum(isinstance(op, _Conditional) for op in self.ops)

    def set_inputs(self, **values: torch.Tensor) -> None:
        """Copy new values into the recorded input tensors (a graph's static inputs)."""
        with torch.no_grad():
            for name, value in values.items():
                self.inputs[name].copy_(value)

    def replay(self):
        """Run the recorded ops again; returns the replayed ``result`` of the recorded callable."""
        env: dict[int, torch.Tensor] = {}

        def look_up(x):
            return env.get(id(x), x) if isinstance(x, torch.Tensor) else x

        def run(ops):
            for op in ops:
                if isinstance(op, _Conditional):
                    if bool(look_up(op.pred)):  # the device's decision, emulated
                        run(op.ops)
                    continue
                for alias, source in op.aliases:
                    env[id(alias)] = look_up(source)
                args, kwargs = pytree.tree_map(look_up, (op.args, op.kwargs))
                out = pytree.tree_leaves(op.func(*args, **kwargs))
                if len(out) != len(op.outputs):
                    raise NotCapturable(f"{op.func}: {len(out)} outputs in the replay, {len(op.outputs)} recorded")
                for recorded, replayed in zip(op.outputs, out):
                    if isinstance(recorded, torch.Tensor):
                        env[id(recorded)] = replayed

        with torch.no_grad():
            run(self.ops)
            for alias, source in self._final_aliases:
                env[id(alias)] = look_up(source)
        return pytree.tree_map(look_up, self.result)


def record(fn: Callable[..., Any], branch_owner: Any = None, **inputs: torch.Tensor) -> Recording:
    """Run ``fn(**inputs)`` once, recording its aten ops. ``inputs`` are the static input tensors.
    ``branch_owner``: an object whose ``branch(pred, body)`` the recording replaces meanwhile, to record
    conditional nodes (module docstring)."""
    recorder = _Recorder()
    if branch_owner is not None:
        branch_owner.branch = recorder.branch
    try:
        with _HostReads(), recorder:
            result = fn(**inputs)
    finally:
        if branch_owner is not None:
            del branch_owner.branch
    return Recording(recorder, inputs, result)


def zero_grads(params) -> None:
    """Give every parameter a zero ``.grad`` (so that backward accumulates in place, into memory that
    exists before the capture, as megatron's gradient buffers do), or zero the existing one."""
    for p in params:
        if p.requires_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            else:
                p.grad.zero_()


class EmulatedCUDAGraph:
    """Stands in for ``torch.cuda.CUDAGraph`` on CPU, with :func:`emulated_graph` for ``torch.cuda.graph``
    (monkeypatched into ``torch.cuda`` by a test): a capture records the region instead, IF nodes
    (``begin_capture_to_if_node`` / ``end_capture_to_conditional_node``) become conditional nodes, and
    ``replay`` replays the recording. So the code that captures and replays a real graph runs here."""

    captures = 0  # captures so far, every instance

    def __init__(self):
        self.recorder: _Recorder | None = None
        self.recording: Recording | None = None
        self.capture_error_mode: str | None = None

    def begin_capture_to_if_node(self, pred: torch.Tensor) -> None:
        self.recorder.begin_conditional(pred)

    def end_capture_to_conditional_node(self) -> None:
        self.recorder.end_conditional()

    def replay(self) -> None:
        self.recording.replay()


def emulated_graph(state: Callable[[], list[torch.Tensor]]):
    """A ``torch.cuda.graph`` for :class:`EmulatedCUDAGraph`. The recording runs the region's ops, which a
    CUDA capture does not: ``state()`` lists the tensors that outlive the region, restored afterwards."""
    import contextlib

    @contextlib.contextmanager
    def graph(cuda_graph: EmulatedCUDAGraph, pool=None, stream=None, capture_error_mode: str = "global"):
        saved = [t.clone() for t in state()]
        cuda_graph.recorder, cuda_graph.capture_error_mode = _Recorder(), capture_error_mode
        with _HostReads(), cuda_graph.recorder:
            yield
        if cuda_graph.recorder.outer:
            raise NotCapturable("a conditional node was opened and not closed")
        cuda_graph.recording = Recording(cuda_graph.recorder, {}, None)
        EmulatedCUDAGraph.captures += 1
        with torch.no_grad():
            for tensor, value in zip(state(), saved):
                tensor.copy_(value)

    return graph
