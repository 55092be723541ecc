"""From (K, A, N0) to a concrete layout and its counts: the bridge between the law and the real model.

N(K, A) is read from the layout the project would actually build (layout.py, accounting.py), not
from a closed form, so that A-sweeps at fixed N_act change the number of blocks as Eq.(14)-(16) say.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

from megatron_xmod.accounting import ModelCount, count_model, embedding_params
from megatron_xmod.presets import BACKBONES, Backbone, resolve_backbone
from megatron_xmod.xmod.layout import NAMED_LAYOUTS, Layout, LayoutError, parse_layout, resolve_layout


@dataclass(frozen=True)
class Design:
    K: int
    A: Optional[float]  # None for the dense reference (K = 1)
    layout: Layout
    count: ModelCount
    capacity_ratio: float  # N(K,A)/N_act of Eq.(4)/(5): layer stack only
    note: str = ""

    @property
    def n_act(self) -> int:
        return self.count.active_params


def capacity_ratio(backbone: Backbone, count: ModelCount) -> float:
    emb = embedding_params(backbone)
    return (count.total_params - emb) / (count.active_params - emb)


def _named_irregular(K: int, A: float, dense_prefix: int, depth: int) -> Optional[str]:
    # The paper's A4K8 cannot be written as Eq.(3) with N0 = 4 (N1 = 24/5); it used a shorter first
    # block instead (Eq.35). Reuse exactly the named layouts, never invent new irregular ones.
    name = f"xmod-a{A:g}k{K}"
    if depth == 28 and dense_prefix == 4 and name in NAMED_LAYOUTS:
        return name
    return None


@lru_cache(maxsize=4096)
def _layout(K: int, A: float, dense_prefix: int, depth: int) -> tuple[Layout, str]:
    if K == 1:
        return resolve_layout("dense", activated_depth=depth), "dense reference"
    try:
        return resolve_layout("xmod", sparsity_k=K, anchor_stride=A, dense_prefix=dense_prefix,
                              activated_depth=depth), ""
    except LayoutError:
        name = _named_irregular(K, A, dense_prefix, depth)
        if name is None:
            raise
        return parse_layout(NAMED_LAYOUTS[name][1], NAMED_LAYOUTS[name][0]), f"paper's irregular layout {name}"


def design(backbone: Backbone | str, K: int, A: Optional[float], seq_len: int, dense_prefix: int = 4,
           layout: Optional[str] = None) -> Design:
    if isinstance(backbone, str):
        backbone = _backbone(backbone)
    return _design(backbone, K, A, seq_len, dense_prefix, layout)


@lru_cache(maxsize=8192)  # planners and plots count the same few hundred layouts over and over
def _design(backbone: Backbone, K: int, A: Optional[float], seq_len: int, dense_prefix: int,
            layout: Optional[str]) -> Design:
    """Raises LayoutError (a ValueError naming the field) when (K, A, N0) is not a whole layout."""
    if not isinstance(K, int) or K < 1:
        raise LayoutError(f"K: must be an integer >= 1, got {K!r}")
    if K > 1 and (A is None or not A > 0):
        raise LayoutError(f"A: must be > 0 for a sparse model (K={K}), got {A!r}")
    if layout:
        lay, note = parse_layout(layout), "explicit layout"
        if lay.activated_depth != backbone.num_layers:
            raise LayoutError(f"layout: {layout!r} activates {float(lay.activated_depth):g} layers, "
                              f"the {backbone.name} backbone has {backbone.num_layers}; the law compares models of "
                              "equal activated depth (set the backbone's num_layers, or fix the layout)")
        ks = {layer.sparsity_k for layer in lay.layers if layer.is_sparse}
        if ks and ks != {K}:
            raise LayoutError(f"layout: {layout!r} routes with K = {', '.join(map(str, sorted(ks)))}, the row says "
                              f"K = {K}; make them agree")
    else:
        lay, note = _layout(K, float(A) if A is not None else 1.0, dense_prefix, backbone.num_layers)
    count = count_model(backbone, lay, seq_len)
    return Design(K, None if K == 1 else float(A), lay, count, capacity_ratio(backbone, count), note)


@lru_cache(maxsize=256)
def _backbone(spec: str) -> Backbone:
    return resolve_backbone(spec)


def backbone_for(n_act: float, name: Optional[str] = None) -> Backbone:
    """The backbone a run used: named (a preset or a JSON file), or the preset whose activated size
    (counted or nominal) is within 5%."""
    if name:
        return _backbone(name)
    for b in BACKBONES.values():
        nominal = float(b.name[:-1]) * (1e9 if b.name.endswith("b") else 1e6)
        counted = count_model(b, f"D*{b.num_layers}", 2048).active_params
        if any(abs(n_act - ref) <= 0.05 * ref for ref in (nominal, counted)):
            return b
    raise ValueError(f"N_act: {n_act:g} matches no backbone preset ({', '.join(BACKBONES)}); "
                     "add a 'backbone' column naming one")
