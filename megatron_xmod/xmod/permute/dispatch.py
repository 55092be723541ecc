"""One entry point per op over three backends (CUDA extension, Triton, plain torch), with autograd.

Selection, highest priority first: the ``backend=`` argument, :func:`set_backend`, the
``XMOD_PERMUTE_BACKEND`` environment variable (``auto|cuda|triton|torch``), then ``auto``:
cuda extension > triton > torch for GPU tensors, torch for CPU tensors. A backend that was asked
for but cannot run here (extension not built, tensors on CPU, ...) is replaced by the best
available one with a WARNING that says why; the backend actually used is logged once (INFO) per
op and device type on the ``megatron_xmod.xmod.permute`` logger.

Triton on CPU tensors only works under ``TRITON_INTERPRET=1`` (the interpreter, for tests), so
``auto`` never picks it there; forcing ``triton`` with the interpreter on does.
"""
import importlib
import logging
import os
import weakref
from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from megatron_xmod.xmod.permute import reference

logger = logging.getLogger("megatron_xmod.xmod.permute")

ENV_BACKEND = "XMOD_PERMUTE_BACKEND"
ENV_CHECK = "XMOD_PERMUTE_CHECK"
BACKENDS = ("cuda", "triton", "torch")
FAST_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

_configured: Optional[str] = None
_logged: set = set()


def set_backend(name: Optional[str]) -> None:
    """Process-wide default (``None`` or ``"auto"`` restores automatic selection)."""
    global _configured
    _configured = None if name is None else _normalize(name, "set_backend(name)")


def _normalize(name: str, origin: str) -> str:
    name = str(name).strip().lower()
    if name not in ("auto",) + BACKENDS:
        raise ValueError(f"{origin}={name!r}: expected one of auto, {', '.join(BACKENDS)}")
    return name


class LazyTriton:
    """A Triton kernel module imported on first use (a broken triton must not break the import of
    this package); remembers why it could not be imported. Shared by the permutation kernels and the
    fused routing step."""

    def __init__(self, module: str):
        self.name, self._module, self.error = module, None, None

    def module(self):
        if self._module is None and self.error is None:
            try:
                self._module = importlib.import_module(self.name)
            except Exception as e:  # ImportError, or a triton that fails to initialise
                self.error = f"triton is not usable ({type(e).__name__}: {e})"
        return self._module

    def unavailable(self, device: torch.device) -> Optional[str]:
        """None if the kernels can run on ``device``, else the reason they cannot."""
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            return f"triton needs CUDA tensors (these are on {device}) or TRITON_INTERPRET=1"
        return self.error if self.module() is None else None


_triton = LazyTriton("megatron_xmod.xmod.permute.triton_ops")


def _unavailable(name: str, device: torch.device, dtype: torch.dtype) -> Optional[str]:
    """None if backend ``name`` can run these tensors, else the reason it cannot."""
    if name == "torch":
        return None
    if dtype not in FAST_DTYPES:
        return f"the {name} backend supports float32/float16/bfloat16, not {dtype}"
    if name == "cuda":
        from megatron_xmod.xmod.permute import cuda_ops

        return cuda_ops.unavailable_reason(device)
    return _triton.unavailable(device)


def _select(op: str, requested: Optional[str], device: torch.device, dtype: torch.dtype) -> str:
    if requested is not None:
        want, origin = _normalize(requested, "backend"), "argument"
    elif _configured is not None:
        want, origin = _configured, "set_backend()"
    else:
        want, origin = _normalize(os.environ.get(ENV_BACKEND) or "auto", ENV_BACKEND), ENV_BACKEND
    skipped = []
    if want != "auto":
        why = _unavailable(want, device, dtype)
        if why is None:
            _log_once(logging.INFO, (op, want, device.type, "forced"),
                      "%s: using the %s backend on %s (requested by %s)", op, want, device.type, origin)
            return want
        skipped.append(f"{want}: {why}")
    candidates = ("cuda", "triton", "torch") if device.type == "cuda" else ("torch",)
    for name in candidates:
        if name == want:
            continue
        why = _unavailable(name, device, dtype)
        if why is None:
            break
        skipped.append(f"{name}: {why}")
    if want != "auto":
        _log_once(logging.WARNING, (op, want, name, device.type, "fallback"),
                  "%s: the %s backend requested by %s cannot run (%s); falling back to %s",
                  op, want, origin, "; ".join(skipped), name)
    else:
        _log_once(logging.INFO, (op, name, device.type, "auto"), "%s: using the %s backend on %s%s",
                  op, name, device.type, f" (skipped {'; '.join(skipped)})" if skipped else "")
    return name


def _log_once(level, key, msg, *args):
    if key not in _logged:
        _logged.add(key)
        logger.log(level, msg, *args)


def selected_backend(x: torch.Tensor, backend: Optional[str] = None, op: str = "gather_tokens") -> str:
    """The backend a call with these tensors would use (logs like a real call)."""
    return _select(op, backend, x.device, x.dtype)


def _ops(name: str):
    if name == "cuda":
        from megatron_xmod.xmod.permute import cuda_ops

        return cuda_ops
    return _triton.module()


# ---------------------------------------------------------------- input checks

def _check_common(fn: str, x: torch.Tensor, indices: torch.Tensor, check: Optional[bool]):
    if not isinstance(x, torch.Tensor) or x.dim() != 3:
        raise ValueError(f"{fn}: x must be a [s, b, h] tensor, got shape "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{fn}: x must be a floating-point tensor, got {x.dtype}")
    if not isinstance(indices, torch.Tensor) or indices.dim() != 2:
        raise ValueError(f"{fn}: indices must be a [k, b] tensor, got shape "
                         f"{tuple(indices.shape) if isinstance(indices, torch.Tensor) else type(indices).__name__}")
    if indices.dtype != torch.int64:
        raise TypeError(f"{fn}: indices must be int64, got {indices.dtype}")
    if indices.device != x.device:
        raise ValueError(f"{fn}: indices is on {indices.device} but x is on {x.device}")
    s, b, _ = x.shape
    k = indices.shape[0]
    if indices.shape[1] != b:
        raise ValueError(f"{fn}: indices has b={indices.shape[1]} columns but x has batch b={b}")
    if k > s:
        raise ValueError(f"{fn}: indices selects k={k} tokens per sequence but x has only s={s}")
    # Value checks read the indices back, which is a device sync on GPU: default on for CPU
    # tensors only; XMOD_PERMUTE_CHECK=1 or check=True turns them on everywhere, XMOD_PERMUTE_CHECK=0
    # off everywhere (bench/ops.py: a CPU run that issues the ops a GPU run does).
    if check is None:
        env = os.environ.get(ENV_CHECK, "")
        check = x.device.type == "cpu" if env == "" else env != "0"
    if check and indices.numel():
        if bool((indices < 0).any()) or bool((indices >= s).any()):
            raise IndexError(f"{fn}: indices out of range [0, {s}): min {int(indices.min())}, "
                             f"max {int(indices.max())}")
        if k > 1 and not bool((indices[1:] > indices[:-1]).all()):
            raise ValueError(f"{fn}: indices must be strictly increasing along dim 0 "
                             "(sorted ascending, unique per sequence)")


# ---------------------------------------------------------------- autograd over a kernel backend

class ResidualGrad:
    """Hands the gradient of the gated scatter's residual input (d out / d x = 1: out's gradient itself) to
    the gather of the same x, whose backward adds its scattered rows onto it in the one launch it makes.
    Without it the gather scatters into zeros and the autograd engine adds the two (issue 28's backward
    launch count). One per routed update, made by the caller and passed to both ops; the kernel backends
    use it, the torch reference ignores it. Safe because the scatter's update depends on the gathered
    tokens: autograd runs the scatter's backward before the gather's."""

    __slots__ = ("source", "grad")

    def __init__(self):
        self.source: Optional[weakref.ref] = None  # the x the gather read (the scatter must update that x)
        self.grad: Optional[torch.Tensor] = None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, indices, ops, residual):
        ctx.ops, ctx.s, ctx.residual = ops, x.shape[0], residual
        ctx.save_for_backward(indices)
        return ops.gather(x.contiguous(), indices.contiguous())

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        (indices,) = ctx.saved_tensors
        gx = None
        base = None
        if ctx.residual is not None:
            base, ctx.residual.grad = ctx.residual.grad, None
        if ctx.needs_input_grad[0]:
            # The scattered rows onto the residual gradient, or into fresh zeros (the same kernel without x).
            gx = ctx.ops.scatter_add_gated(None if base is None else base.contiguous(), grad.contiguous(), None,
                                           indices.contiguous(), ctx.s)
        return gx, None, None, None


class _ScatterGated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y, gate, indices, ops, residual):
        ctx.ops, ctx.residual = ops, residual
        y, gate, indices = y.contiguous(), gate.contiguous(), indices.contiguous()
        ctx.save_for_backward(y, gate, indices)
        return ops.scatter_add_gated(x.contiguous(), y, gate, indices, x.shape[0])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        y, gate, indices = ctx.saved_tensors
        need_x, need_y, need_gate = ctx.needs_input_grad[:3]
        # d(out)/dx is the identity: every token of x reaches out with weight 1.
        gx = grad if need_x else None
        if gx is not None and ctx.residual is not None:  # the gather of x adds it (ResidualGrad)
            ctx.residual.grad, gx = gx, None
        gy = gg = None
        if need_y or need_gate:
            gy, gg = ctx.ops.scatter_backward(grad.contiguous(), y, gate, indices, need_y, need_gate)
        return gx, gy, gg, None, None, None


# ---------------------------------------------------------------- public ops

def gather_tokens(x: torch.Tensor, indices: torch.Tensor, *, backend: Optional[str] = None,
                  check: Optional[bool] = None, residual: Optional[ResidualGrad] = None) -> torch.Tensor:
    """``[s, b, h]`` + sorted unique ``[k, b]`` int64 indices -> ``[k, b, h]`` routed tokens.

    ``backend``: ``auto|cuda|triton|torch`` (see module docstring). ``check``: validate index
    values (range, strictly increasing); default on for CPU tensors, off on GPU (it syncs).
    ``residual``: a fresh :class:`ResidualGrad`, passed again to the :func:`scatter_gated` that updates
    ``x`` with what these tokens become.
    """
    _check_common("gather_tokens", x, indices, check)
    name = _select("gather_tokens", backend, x.device, x.dtype)
    if name == "torch":
        return reference.gather_tokens(x, indices)
    if residual is not None:
        if residual.source is not None:
            raise ValueError("residual: a ResidualGrad serves one gather and its scatter; make a new one per update")
        residual.source = weakref.ref(x)
    return _Gather.apply(x, indices, _ops(name), residual)


def scatter_gated(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor, indices: torch.Tensor, *,
                  backend: Optional[str] = None, check: Optional[bool] = None,
                  residual: Optional[ResidualGrad] = None) -> torch.Tensor:
    """``x`` with ``x + gate * y`` at ``indices``; all other tokens pass through bit-identically.

    ``y``: ``[k, b, h]`` in x's dtype, ``gate``: ``[k, b]`` (any float dtype; it is cast to y's
    dtype, as the reference does, and its gradient flows back through the cast). ``residual``: the
    :class:`ResidualGrad` of the :func:`gather_tokens` of this ``x`` whose tokens ``y`` is computed from
    (ignored unless both ran on a kernel backend).
    """
    fn = "scatter_gated"
    _check_common(fn, x, indices, check)
    k, b = indices.shape
    if not isinstance(y, torch.Tensor) or tuple(y.shape) != (k, b, x.shape[2]):
        raise ValueError(f"{fn}: y must be [k, b, h] = {(k, b, x.shape[2])}, got "
                         f"{tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__}")
    if y.dtype != x.dtype:
        raise TypeError(f"{fn}: y dtype {y.dtype} must equal x dtype {x.dtype}")
    if not isinstance(gate, torch.Tensor) or tuple(gate.shape) != (k, b):
        raise ValueError(f"{fn}: gate must be [k, b] = {(k, b)}, got "
                         f"{tuple(gate.shape) if isinstance(gate, torch.Tensor) else type(gate).__name__}")
    if not gate.is_floating_point():
        raise TypeError(f"{fn}: gate must be floating point, got {gate.dtype}")
    for nm, t in (("y", y), ("gate", gate)):
        if t.device != x.device:
            raise ValueError(f"{fn}: {nm} is on {t.device} but x is on {x.device}")
    name = _select(fn, backend, x.device, x.dtype)
    if name == "torch":
        return reference.scatter_gated(x, y, gate, indices)
    # Handed over only when the gather read this very x and y can carry the gradient back to it.
    linked = residual is not None and residual.source is not None and residual.source() is x and y.requires_grad
    return _ScatterGated.apply(x, y, gate.to(y.dtype), indices, _ops(name), residual if linked else None)
