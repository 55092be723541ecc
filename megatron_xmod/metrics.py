"""Per-layer routing metrics collected during forward passes (no host sync until report time).

Sparse layers call :func:`record` (interval statistics) and :func:`add_microbatch_loss` (the
router BCE of the current micro-batch, for the loss dictionary). The training loop calls
:func:`report` once per log interval; it averages over micro-batches and, when given a process
group, over ranks (pipeline stages contribute their own layers, data-parallel replicas average).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Optional

import torch

METRICS = ("selected_fraction", "coverage", "adjacent_jaccard", "router_bce_loss",
           "eval_selected_fraction", "eval_coverage", "eval_adjacent_jaccard",
           "dtopp_active_experts", "dtopp_threshold", "dtopp_dynamic_loss")

_sums: dict[tuple[str, int], torch.Tensor] = {}
_counts: dict[tuple[str, int], int] = defaultdict(int)
_microbatch_losses: list[torch.Tensor] = []


def record(name: str, layer_number: int, value: torch.Tensor) -> None:
    key = (name, layer_number)
    value = value.detach().float()
    _sums[key] = value if key not in _sums else _sums[key] + value
    _counts[key] += 1


def add_microbatch_loss(loss: torch.Tensor) -> None:
    _microbatch_losses.append(loss.detach().float())


def take_microbatch_losses() -> Optional[torch.Tensor]:
    """Mean router BCE over this stage's sparse layers for the micro-batch just run (then cleared)."""
    if not _microbatch_losses:
        return None
    value = torch.stack(_microbatch_losses).mean()
    _microbatch_losses.clear()
    return value


def reset() -> None:
    _sums.clear()
    _counts.clear()
    _microbatch_losses.clear()


def per_layer(num_layers: Optional[int] = None, group=None) -> dict[str, dict[int, float]]:
    """{metric: {layer_number: mean}}. With ``group``, every rank of it must call this together."""
    # Ranks reduce one tensor together, so with a group its shape is fixed by METRICS alone.
    names = list(METRICS) if group is not None else sorted({name for name, _ in _sums})
    if num_layers is None:
        num_layers = max((layer for _, layer in _sums), default=0)
    totals = torch.zeros(len(names), num_layers + 1, 2)
    for (name, layer), value in _sums.items():
        if name not in names:
            continue
        totals[names.index(name), layer] = torch.stack([value.cpu(), torch.tensor(float(_counts[(name, layer)]))])
    if group is not None and torch.distributed.is_initialized():
        device = "cuda" if torch.cuda.is_available() else "cpu"
        totals = totals.to(device)
        torch.distributed.all_reduce(totals, group=group)
        totals = totals.cpu()
    out: dict[str, dict[int, float]] = defaultdict(dict)
    for i, name in enumerate(names):
        for layer in range(num_layers + 1):
            total, count = totals[i, layer].tolist()
            if count:
                out[name][layer] = total / count
    return out


def report(num_layers: Optional[int] = None, group=None, reset_after: bool = True) -> dict[str, float]:
    """Flat dict: ``<metric>`` (mean over layers) and ``<metric>/layer_<n>`` entries."""
    flat: dict[str, float] = {}
    for name, layers in per_layer(num_layers, group).items():
        flat[name] = sum(layers.values()) / len(layers)
        for layer, value in layers.items():
            flat[f"{name}/layer_{layer:03d}"] = value
    if reset_after:
        reset()
    return flat
