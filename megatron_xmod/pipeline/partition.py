"""The pipeline layout that minimises the slowest stage, and megatron's default split to compare with.

With ``pp`` pipeline ranks and ``vpp`` virtual stages per rank, the item sequence ``[E, layers, L]``
(:mod:`megatron_xmod.pipeline.cost`) is cut into ``pp * vpp`` contiguous chunks; chunk ``c`` runs on
rank ``c % pp`` as its virtual stage ``c // pp`` (megatron's round-robin order). Every chunk is one
unit of the (interleaved) 1F1B schedule, so the layout minimises the slowest chunk. This is the
classic min-max contiguous partition, solved exactly by dynamic programming over prefix sums
(:func:`min_max_split`, O(chunks * items^2) vectorised: 300 layers x 64 stages in milliseconds).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Optional

import numpy as np

from megatron_xmod.pipeline.cost import Item


def min_max_split(costs: list[float], chunks: int, no_start: Sequence[int] = ()) -> list[int]:
    """Sizes of ``chunks`` non-empty contiguous parts of ``costs`` minimising the largest part's sum
    (exact: dp[c][j] = min_i max(dp[c-1][i], sum(costs[i:j]))); among the optimal splits, the one
    with the least sum of squared part sums, so the parts below the bottleneck are balanced too.
    No part starts at an index of ``no_start``."""
    n = len(costs)
    if chunks < 1 or chunks > n:
        raise ValueError(f"chunks: must be between 1 and the {n} items, got {chunks}")
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(costs, dtype=np.float64))])
    segment = prefix[None, :] - prefix[:, None]  # segment[i, j] = sum(costs[i:j])
    segment[np.tril_indices(n + 1)] = np.inf  # parts are non-empty: j > i
    segment[list(no_start), :] = np.inf
    worst = _chunked_dp(segment, chunks, lambda best, seg: np.maximum(best[:, None], seg))[0]
    if not np.isfinite(worst):
        raise ValueError(f"pp/vpp: {chunks} stages cannot all start at an allowed item ({n - len(set(no_start))} of "
                         f"{n} allowed); use fewer stages")
    squares = np.where(segment <= worst * (1 + 1e-9), segment, np.inf) ** 2
    return _chunked_dp(squares, chunks, lambda best, seg: best[:, None] + seg)[1]


def _chunked_dp(segment, chunks, combine):
    """DP over ``chunks`` contiguous parts with part values ``segment[i, j]`` (items i..j-1) combined
    by ``combine``: the value of the best split of all items and its part sizes."""
    n = segment.shape[0] - 1
    best = segment[0].copy()  # one part: items 0..j-1
    cuts = []
    for _ in range(chunks - 1):
        candidates = combine(best, segment)  # [i, j]: the last part is items[i:j]
        argmin = candidates.argmin(axis=0)
        cuts.append(argmin)
        best = candidates[argmin, np.arange(n + 1)]
    sizes, end = [], n
    for argmin in reversed(cuts):
        start = int(argmin[end])
        sizes.append(end - start)
        end = start
    sizes.append(end)
    return best[n], sizes[::-1]


def default_split(num_layers: int, chunks: int) -> list[int]:
    """megatron's default: layers split evenly by count (``num_layers / chunks`` each; where that is
    not whole, chunk c gets layers floor(c n / C) .. floor((c+1) n / C)), the embedding on the first
    chunk and the loss on the last. Returned as item counts (E and L included)."""
    bounds = [c * num_layers // chunks for c in range(chunks + 1)]
    sizes = [bounds[c + 1] - bounds[c] for c in range(chunks)]
    sizes[0] += 1
    sizes[-1] += 1
    return sizes


def in_flight_microbatches(pp: int, vpp: int, num_microbatches: Optional[int] = None) -> list[list[int]]:
    """[rank][virtual stage]: micro-batches whose activations a chunk holds at the schedule's peak.

    1F1B: rank r runs ``pp - r - 1`` warm-up forwards, then one more before its first backward.
    Interleaved (megatron's get_pp_rank_microbatches): ``2 (pp - r - 1) + (vpp - 1) pp`` warm-up
    forwards, issued in groups of ``pp`` micro-batches per virtual stage in turn.
    """
    counts = []
    for rank in range(pp):
        held = [0] * vpp
        if vpp == 1:
            warmup = pp - rank - 1
        else:
            warmup = 2 * (pp - rank - 1) + (vpp - 1) * pp
        total = warmup + 1
        if num_microbatches is not None:
            total = min(total, num_microbatches * vpp)
        for k in range(total):
            held[(k // pp) % vpp] += 1
        counts.append(held)
    return counts


@dataclass(frozen=True)
class Stage:
    pp_rank: int
    vp_stage: int
    layers: int  # decoder layers
    items: str  # megatron layout letters of this chunk, compressed (e.g. "Et*3")
    time_s: float
    flops: float
    params: int
    activation_bytes: float  # held at the schedule's peak: per micro-batch x in-flight micro-batches
    activation_bytes_per_microbatch: float
    in_flight: int


@dataclass(frozen=True)
class Partition:
    pp: int
    vpp: int
    sizes: tuple[int, ...]  # items per chunk, in layer order
    stages: tuple[Stage, ...]

    @property
    def layout(self) -> str:
        """megatron's --pipeline-model-parallel-layout string."""
        return "|".join(stage.items for stage in self.stages)

    @property
    def chunk_times(self) -> list[float]:
        return [stage.time_s for stage in self.stages]

    @property
    def rank_times(self) -> list[float]:
        times = [0.0] * self.pp
        for stage in self.stages:
            times[stage.pp_rank] += stage.time_s
        return times

    @property
    def max_over_mean(self) -> float:
        times = self.chunk_times
        return max(times) / (sum(times) / len(times))

    @property
    def rank_max_over_mean(self) -> float:
        times = self.rank_times
        return max(times) / (sum(times) / len(times))

    def to_dict(self) -> dict:
        return dict(layout=self.layout, pp=self.pp, vpp=self.vpp, max_over_mean=self.max_over_mean,
                    rank_max_over_mean=self.rank_max_over_mean, stages=[asdict(s) for s in self.stages])


def _letters(items: list[Item]) -> str:
    out, layers = [], sum(item.letter == "t" for item in items)
    if items and items[0].letter == "E":
        out.append("E")
    if layers:
        out.append("t" if layers == 1 else f"t*{layers}")
    if items and items[-1].letter == "L":
        out.append("L")
    return "".join(out)


def build_partition(items: list[Item], sizes: list[int], pp: int, vpp: int,
                    num_microbatches: Optional[int] = None) -> Partition:
    if sum(sizes) != len(items) or len(sizes) != pp * vpp:
        raise ValueError(f"sizes: {len(sizes)} chunks of {sum(sizes)} items; expected {pp * vpp} chunks of {len(items)}")
    held = in_flight_microbatches(pp, vpp, num_microbatches)
    stages, start = [], 0
    for chunk, size in enumerate(sizes):
        part = items[start:start + size]
        start += size
        rank, vp = chunk % pp, chunk // pp
        per_microbatch = sum(item.activation_bytes for item in part)
        stages.append(Stage(
            pp_rank=rank, vp_stage=vp, layers=sum(item.letter == "t" for item in part), items=_letters(part),
            time_s=sum(item.time_s for item in part), flops=sum(item.flops for item in part),
            params=sum(item.params for item in part), activation_bytes=per_microbatch * held[rank][vp],
            activation_bytes_per_microbatch=per_microbatch, in_flight=held[rank][vp]))
    return Partition(pp, vpp, tuple(sizes), tuple(stages))


def check_parallel_sizes(num_layers: int, pp: int, vpp: int) -> None:
    if pp < 1:
        raise ValueError(f"pp: must be >= 1, got {pp}")
    if vpp < 1:
        raise ValueError(f"vpp: must be >= 1, got {vpp}")
    if vpp > 1 and pp == 1:
        raise ValueError("vpp: virtual pipeline stages need --pp > 1; set --pp 2 or more, or --vpp 1")


def balanced_partition(items: list[Item], pp: int, vpp: int = 1, num_microbatches: Optional[int] = None,
                       no_start: Sequence[int] = ()) -> Partition:
    """The layout minimising the slowest of the ``pp * vpp`` chunks; no chunk starts at an item index
    of ``no_start``."""
    check_parallel_sizes(len(items) - 2, pp, vpp)
    sizes = min_max_split([item.time_s for item in items], pp * vpp, no_start)
    return build_partition(items, sizes, pp, vpp, num_microbatches)


def default_partition(items: list[Item], pp: int, vpp: int = 1, num_microbatches: Optional[int] = None) -> Partition:
    check_parallel_sizes(len(items) - 2, pp, vpp)
    return build_partition(items, default_split(len(items) - 2, pp * vpp), pp, vpp, num_microbatches)
