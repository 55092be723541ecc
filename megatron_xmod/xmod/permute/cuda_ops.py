"""Thin wrapper around the compiled extension ``megatron_xmod._permute_cuda`` (csrc/).

Importing this module never fails: on a machine without the built extension (no CUDA toolkit at
install time) or without a GPU, ``unavailable_reason()`` says why and the primitives raise a
RuntimeError that says so, so the dispatcher can fall back.
"""
import importlib
from typing import Optional

import torch

EXTENSION = "megatron_xmod._permute_cuda"
_ext = None
_load_error: Optional[str] = None
_tried = False


def _load():
    global _ext, _load_error, _tried
    if not _tried:
        _tried = True
        try:
            _ext = importlib.import_module(EXTENSION)
        except ImportError as e:
            _load_error = (f"the CUDA extension {EXTENSION} is not importable ({e}); it is built by "
                           "`pip install --no-build-isolation -e .` when nvcc and a CUDA build of "
                           "torch are present")
    return _ext


def is_built() -> bool:
    return _load() is not None


def unavailable_reason(device: Optional[torch.device] = None) -> Optional[str]:
    """None if the extension can run on ``device``; otherwise a sentence saying why not."""
    if _load() is None:
        return _load_error
    if device is not None and device.type != "cuda":
        return f"the CUDA extension only runs on CUDA tensors, these are on {device}"
    if not torch.cuda.is_available():
        return "the CUDA extension is built but no CUDA device is available"
    return None


def _ext_or_raise(device: torch.device):
    why = unavailable_reason(device)
    if why is not None:
        raise RuntimeError(f"megatron_xmod.xmod.permute cuda backend: {why}")
    return _ext


def gather(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return _ext_or_raise(x.device).gather(x, idx)


def scatter_add_gated(x, y: torch.Tensor, gate, idx: torch.Tensor, s: int) -> torch.Tensor:
    return _ext_or_raise(y.device).scatter_add_gated(x, y, gate, idx, s)


def scatter_backward(go, y, gate, idx, need_y: bool, need_gate: bool):
    gy, gg = _ext_or_raise(y.device).scatter_backward(go, y, gate, idx, need_y, need_gate)
    return gy, gg
