"""Per-layer routing metrics collected during forward passes (no host sync until report time).

Sparse layers call :func:`record`; the training loop calls :func:`report` once per log interval.
Values are summed over micro-batches and averaged at report time.
"""
from __future__ import annotations

from collections import defaultdict

import torch

_sums: dict[tuple[str, int], torch.Tensor] = {}
_counts: dict[tuple[str, int], int] = defaultdict(int)


def record(name: str, layer_number: int, value: torch.Tensor) -> None:
    key = (name, layer_number)
    value = value.detach().float()
    _sums[key] = value if key not in _sums else _sums[key] + value
    _counts[key] += 1


def reset() -> None:
    _sums.clear()
    _counts.clear()


def per_layer(reduce_group=None) -> dict[str, dict[int, float]]:
    """{metric: {layer_number: mean over recorded micro-batches}}; averaged over ``reduce_group``."""
    out: dict[str, dict[int, float]] = defaultdict(dict)
    if not _sums:
        return out
    keys = sorted(_sums)
    values = torch.stack([_sums[k] / _counts[k] for k in keys])
    if reduce_group is not None and torch.distributed.is_initialized():
        torch.distributed.all_reduce(values, group=reduce_group)
        values /= torch.distributed.get_world_size(reduce_group)
    for (name, layer), value in zip(keys, values.tolist()):
        out[name][layer] = value
    return out


def report(reset_after: bool = True, reduce_group=None) -> dict[str, float]:
    """Flat dict: ``<metric>`` (mean over layers) and ``<metric>/layer_<n>`` entries."""
    flat: dict[str, float] = {}
    for name, layers in per_layer(reduce_group).items():
        flat[name] = sum(layers.values()) / len(layers)
        for layer, value in layers.items():
            flat[f"{name}/layer_{layer:03d}"] = value
    if reset_after:
        reset()
    return flat
