"""Count the operations that force a host synchronisation (test tool, not collected: no test_ prefix).

:class:`SyncCounter` is a ``TorchDispatchMode`` (plus a small ``TorchFunctionMode`` for the reads
that never reach the dispatcher) that records every op which, on a GPU, makes the host wait for the
device:

- ``aten._local_scalar_dense``: what ``.item()``, ``int(t)``, ``float(t)`` and ``bool(t)`` (an ``if``
  on a tensor) dispatch to;
- ops whose output shape depends on tensor values: ``aten.nonzero`` (also ``torch.where(cond)``,
  ``argwhere``), ``aten.masked_select``, ``aten.unique*`` / ``aten._unique*``,
  ``aten.repeat_interleave.Tensor`` without ``output_size``, ``aten.bincount`` (its length is the
  maximum), boolean-mask indexing (``aten.index.Tensor`` / ``aten.index_put`` with a bool index tensor,
  except ``x[mask] = scalar``, which aten runs as ``masked_fill_``);
- ``aten.equal`` (a bool on the host);
- device -> host copies (``aten._to_copy`` / ``aten.copy_`` to the CPU from a non-CPU tensor);
- ``Tensor.tolist()`` and ``Tensor.numpy()``: they read the data directly in C++ without a dispatched op
  (on a device tensor they first copy it to the host), so the function mode counts them.

Not counted: ``x[mask] = scalar`` (aten runs it as ``masked_fill_``), and megatron's RNG tracker
comparing the CPU generator's state in ``fork`` (host tensors on a GPU too).

On CPU, where the tests run, every tensor is a host tensor: a device -> host copy cannot occur and
``.cpu()`` of a CPU tensor is no sync; ``.item()`` still shows up as ``_local_scalar_dense`` and the
value-dependent shapes as their ops, and ``.tolist()`` / ``.numpy()`` are counted whatever the
tensor's device (on CPU there is no telling which of them would be device tensors on a GPU). So a run
on CPU counts what the same code would synchronise on a GPU.

Each hit records the op and where it came from: ``site``, the innermost Python frame inside
``megatron_xmod/`` (the plugin's line that caused it, possibly through megatron), and ``origin``, the
innermost frame outside torch (megatron's own line when megatron issues the op).
"""
from __future__ import annotations

import collections
import os
import traceback
from dataclasses import dataclass
from typing import Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_xmod import cpu_shim

aten = torch.ops.aten

_PACKAGE = os.sep + "megatron_xmod" + os.sep
_TORCH = os.path.dirname(torch.__file__) + os.sep
_HERE = os.path.abspath(__file__)
# The CPU shim's torch-function mode (megatron_xmod/cpu_shim.py) sits between every call and torch on
# CPU: its frame is no caller.
_TRANSPARENT = (_HERE, os.path.abspath(cpu_shim.__file__))

ALWAYS = {  # packets (overload packets): every overload syncs
    aten._local_scalar_dense, aten.nonzero, aten.masked_select, aten.unique_dim, aten.unique_consecutive,
    aten.unique_dim_consecutive, aten._unique, aten._unique2, aten.bincount, aten.equal,
}
BOOL_INDEXED = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}
HOST_READS = {"tolist", "numpy"}
# Reads of tensors that live on the host on a GPU too (not counted): megatron's RNG tracker compares
# the CPU generator's state before and after a fork (tensor_parallel/random.py, CudaRNGStatesTracker.fork).
HOST_TENSOR_SITES = ((os.path.join("megatron", "core", "tensor_parallel", "random.py"), "fork"),)


@dataclass(frozen=True)
class Hit:
    op: str
    site: Optional[str]  # innermost frame in megatron_xmod/: "path:line in function"
    origin: Optional[str]  # innermost frame outside torch

    def __str__(self) -> str:
        where = self.site or "outside megatron_xmod"
        if self.origin and self.origin != self.site:
            where += f" (via {self.origin})"
        return f"{self.op} at {where}"


def _frame(entry) -> str:
    path = entry.filename
    short = path[path.rfind(_PACKAGE) + 1:] if _PACKAGE in path else path
    return f"{short}:{entry.lineno} in {entry.name}"


def _where():
    """(site, origin, origin's FrameSummary) of the op being dispatched."""
    site = origin = None
    for entry in reversed(traceback.extract_stack()):
        path = os.path.abspath(entry.filename)
        if path in _TRANSPARENT:
            continue
        if origin is None and not path.startswith(_TORCH):
            origin = entry
        if _PACKAGE in path:
            site = _frame(entry)
            break
    return site, None if origin is None else _frame(origin), origin


def _is_bool_index(indices) -> bool:
    return any(isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8) for t in indices or ())


def _is_masked_fill(func, args, kwargs) -> bool:
    """``x[mask] = scalar``: aten's index_put with one boolean index and a one-element host value runs
    ``masked_fill_`` (canDispatchToMaskedFill in ATen's TensorAdvancedIndexing.cpp), no sync. A Python
    scalar arrives as a 0-dim host tensor; a 0-dim device tensor would sync, but on CPU the two look
    alike, so every 0-dim value is taken for a Python scalar."""
    if func.overloadpacket is aten.index:
        return False
    indices = args[1] if len(args) > 1 else kwargs.get("indices")
    values = args[2] if len(args) > 2 else kwargs.get("values")
    accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
    tensors = [t for t in indices or () if t is not None]
    return (not accumulate and len(tensors) == 1 and isinstance(values, torch.Tensor) and values.dim() == 0
            and values.device.type == "cpu")


def _device_to_host(func, args, kwargs) -> bool:
    packet = func.overloadpacket
    if packet is aten._to_copy:
        device = kwargs.get("device")
        return device is not None and torch.device(device).type == "cpu" and args[0].device.type != "cpu"
    if packet is aten.copy_:
        return args[0].device.type == "cpu" and isinstance(args[1], torch.Tensor) and args[1].device.type != "cpu"
    return False


def sync_reason(func, args, kwargs) -> Optional[str]:
    """The name under which the aten call ``func(*args, **kwargs)`` counts as a sync, else None."""
    packet = func.overloadpacket
    name = str(packet).replace("aten.", "", 1)
    if packet in ALWAYS or name.startswith("unique"):
        return name
    if func is aten.repeat_interleave.Tensor and kwargs.get("output_size", args[1] if len(args) > 1 else None) is None:
        return "repeat_interleave without output_size"
    if (packet in BOOL_INDEXED and _is_bool_index(args[1] if len(args) > 1 else kwargs.get("indices"))
            and not _is_masked_fill(func, args, kwargs)):
        return f"{name} with a boolean mask"
    if _device_to_host(func, args, kwargs):
        return "device -> host copy"
    return None


class _HostReads(TorchFunctionMode):
    def __init__(self, counter: SyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in HOST_READS:
            self.counter._hit(f"Tensor.{func.__name__}()")
        return func(*args, **(kwargs or {}))


class SyncCounter(TorchDispatchMode):
    """``with SyncCounter() as syncs: ...``; then ``syncs.count``, ``syncs.hits``, ``syncs.summary()``."""

    def __init__(self):
        super().__init__()
        self.hits: list[Hit] = []
        self._reads = _HostReads(self)

    def _hit(self, op: str) -> None:
        site, origin, origin_frame = _where()
        if origin_frame is not None and any(origin_frame.filename.endswith(path) and origin_frame.name == name
                                            for path, name in HOST_TENSOR_SITES):
            return
        self.hits.append(Hit(op, site, origin))

    def __enter__(self):
        self._reads.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._reads.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reason = sync_reason(func, args, kwargs)
        if reason is not None:
            self._hit(reason)
        return func(*args, **kwargs)

    @property
    def count(self) -> int:
        return len(self.hits)

    def in_plugin(self) -> list[Hit]:
        """The hits whose op megatron_xmod's own code issued (not megatron's, not the test's)."""
        return [hit for hit in self.hits if hit.site is not None and hit.site == hit.origin]

    def summary(self, hits: Optional[list[Hit]] = None) -> str:
        hits = self.hits if hits is None else hits
        counts = collections.Counter(str(hit) for hit in hits)
        return "; ".join(f"{n} x {where}" for where, n in counts.most_common()) or "no host syncs"
