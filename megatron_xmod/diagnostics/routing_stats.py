"""Routing statistics as pure functions of selection masks (the X-MoD paper, Table 10 and Figure 5).

A *block* is a run of consecutive sparse layers between two dense layers (for X-MoD the A*K layers
before an anchor, for MoD a single layer). Its selections are a boolean tensor ``[T, s, b]``: T
sparse layers, s positions, b sequences. Definitions follow the paper's routing diagnostics:

- selected fraction: tokens a layer routes, against the nominal p = 1/K;
- coverage: tokens selected at least once within the block;
- adjacent-layer overlap: the Jaccard index of the routed sets of consecutive layers, averaged over
  the pairs with a non-empty union within each (sequence, block) observation, then over the
  observations where it is defined;
- update counts: per token, the number of the block's layers that selected it (Figure 5), with the
  two analytic references at p and T: the same subset repeated (0 with probability 1 - p, T with
  probability p) and independent random subsets (Binomial(T, p); coverage 1 - (1 - p)^T, Jaccard
  p / (2 - p) for long sequences);
- mask agreement: at the same scores, the threshold rule's mask against top-k's (precision, recall,
  and the paper's agreement over all token-layer positions, co-skipped ones included).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

import torch

from megatron_xmod.xmod.routing import indices_to_mask, select_threshold, select_topk


@dataclass(frozen=True)
class BlockStats:
    num_layers: int  # T
    sparsity_k: int
    selected_fraction: list[float]  # per layer
    coverage: float
    adjacent_jaccard: Optional[float]  # None when T = 1 or no pair has a non-empty union
    update_count_distribution: list[float]  # P(count = c), c = 0..T
    mean_update_count: float

    def to_dict(self) -> dict:
        return asdict(self)


def check_block(selected: torch.Tensor) -> torch.Tensor:
    if selected.dtype != torch.bool or selected.dim() != 3:
        raise ValueError(f"selected: expected a bool tensor [layers, positions, sequences], got {selected.dtype} "
                         f"of shape {tuple(selected.shape)}")
    return selected


def coverage(selected: torch.Tensor) -> float:
    """Fraction of the block's tokens selected by at least one of its layers."""
    return check_block(selected).any(0).float().mean().item()


def update_counts(selected: torch.Tensor) -> torch.Tensor:
    """``[s, b]``: how many of the block's layers selected each token."""
    return check_block(selected).sum(0)


def update_count_distribution(selected: torch.Tensor) -> list[float]:
    """P(count = c) for c = 0..T over the block's tokens (Figure 5)."""
    counts = update_counts(selected).flatten()
    histogram = torch.bincount(counts, minlength=selected.shape[0] + 1).double()
    return (histogram / counts.numel()).tolist()


def adjacent_jaccard(selected: torch.Tensor) -> Optional[float]:
    """The paper's adjacent-layer overlap: per sequence, the mean Jaccard over consecutive layer pairs
    whose union is non-empty; then the mean over sequences where at least one pair was defined."""
    selected = check_block(selected)
    if selected.shape[0] < 2:
        return None
    first, second = selected[:-1], selected[1:]
    intersection = (first & second).sum(1).double()  # [T-1, b]
    union = (first | second).sum(1).double()
    defined = union > 0
    per_pair = torch.where(defined, intersection / union.clamp(min=1), torch.zeros_like(union))
    pairs = defined.sum(0)  # [b]
    observed = pairs > 0
    if not observed.any():
        return None
    per_sequence = per_pair.sum(0)[observed] / pairs[observed]
    return per_sequence.mean().item()


def block_stats(selected: torch.Tensor, sparsity_k: int) -> BlockStats:
    selected = check_block(selected)
    counts = update_counts(selected)
    return BlockStats(
        num_layers=selected.shape[0], sparsity_k=sparsity_k,
        selected_fraction=selected.flatten(1).float().mean(1).tolist(),
        coverage=coverage(selected), adjacent_jaccard=adjacent_jaccard(selected),
        update_count_distribution=update_count_distribution(selected),
        mean_update_count=counts.double().mean().item(),
    )


# ----------------------------------------------------------------------------------- analytic references
def random_coverage(p: float, num_layers: int) -> float:
    """Independent random subsets of rate p: 1 - (1 - p)^T."""
    return 1.0 - (1.0 - p) ** num_layers


def random_jaccard(p: float) -> float:
    """Independent random subsets of rate p, long sequences: E|a&b| / E|a|b| = p^2 / (2p - p^2)."""
    return p / (2.0 - p)


def binomial_distribution(p: float, num_layers: int) -> list[float]:
    """Update counts of independent random subsets: Binomial(T, p)."""
    return [math.comb(num_layers, c) * p**c * (1 - p) ** (num_layers - c) for c in range(num_layers + 1)]


def repeated_subset_distribution(p: float, num_layers: int) -> list[float]:
    """Update counts when every layer picks the same subset: 0 w.p. 1 - p, T w.p. p."""
    out = [0.0] * (num_layers + 1)
    out[0] += 1 - p
    out[num_layers] += p
    return out


def references(sparsity_k: int, num_layers: int) -> dict:
    p = 1.0 / sparsity_k
    return {
        "p": p,
        "repeated_subset": {"coverage": p, "adjacent_jaccard": 1.0,
                            "update_count_distribution": repeated_subset_distribution(p, num_layers)},
        "independent_random": {"coverage": random_coverage(p, num_layers), "adjacent_jaccard": random_jaccard(p),
                               "update_count_distribution": binomial_distribution(p, num_layers)},
    }


# ----------------------------------------------------------------------------------------- mask agreement
@dataclass
class MaskAgreement:
    """Counts over token-layer positions of the threshold mask against the top-k mask at the same scores."""

    both: int = 0
    threshold_only: int = 0
    topk_only: int = 0
    neither: int = 0

    def add(self, threshold: torch.Tensor, topk: torch.Tensor) -> MaskAgreement:
        self.both += int((threshold & topk).sum())
        self.threshold_only += int((threshold & ~topk).sum())
        self.topk_only += int((~threshold & topk).sum())
        self.neither += int((~threshold & ~topk).sum())
        return self

    @property
    def total(self) -> int:
        return self.both + self.threshold_only + self.topk_only + self.neither

    def to_dict(self) -> dict:
        selected_threshold = self.both + self.threshold_only
        selected_topk = self.both + self.topk_only
        return {
            "agreement": (self.both + self.neither) / self.total if self.total else None,
            "precision": self.both / selected_threshold if selected_threshold else None,
            "recall": self.both / selected_topk if selected_topk else None,
            "threshold_selected_fraction": selected_threshold / self.total if self.total else None,
            "positions": self.total,
        }


def masks_at_scores(scores: torch.Tensor, sparsity_k: int, segments: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(threshold mask, top-k mask) of one layer's bias-adjusted scores ``[s, b]``; ``segments``: the
    layer's routing segments (top-k per segment, as it trained)."""
    topk = indices_to_mask(select_topk(scores, sparsity_k, segments), scores.shape[0])
    return select_threshold(scores), topk
