"""A timing simulation of megatron's pipeline schedules (1F1B and interleaved 1F1B) for given chunk
times: step time and bubble of a layout, for the benchmark (``bench/pipeline.py``).

Each rank runs its forward (F) and backward (B) steps in megatron's order
(``schedules.forward_backward_pipelining_with(out)_interleaving``: warm-up forwards, then one
forward and one backward in turn, then the remaining backwards; micro-batches visit the virtual
stages in groups of ``pp``), a step starts when its rank is free and its input is ready (F of the
previous chunk, B of the next chunk), communication is free. Forward takes 1/3 of a chunk's
forward+backward time and backward 2/3.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Simulation:
    step_time: float
    busy: tuple[float, ...]  # per rank

    @property
    def bubble(self) -> float:
        """Idle share of the pipeline's device time: 1 - mean busy / step time."""
        return 1 - sum(self.busy) / (len(self.busy) * self.step_time)


def _rank_order(rank: int, pp: int, vpp: int, microbatches: int) -> list[tuple[str, int, int]]:
    """megatron's order of (F|B, micro-batch, virtual stage) on ``rank``."""
    total = microbatches * vpp

    def virtual(k, forward):
        stage = (k // pp) % vpp
        return stage if forward else vpp - 1 - stage

    def micro(k):
        return (k // (pp * vpp)) * pp + k % pp

    if vpp == 1:
        warmup = min(pp - rank - 1, microbatches)
    else:
        warmup = min(2 * (pp - rank - 1) + (vpp - 1) * pp, total)
    order, f, b = [], 0, 0
    for _ in range(warmup):
        order.append(("F", micro(f), virtual(f, True)))
        f += 1
    while f < total:
        order.append(("F", micro(f), virtual(f, True)))
        f += 1
        order.append(("B", micro(b), virtual(b, False)))
        b += 1
    while b < total:
        order.append(("B", micro(b), virtual(b, False)))
        b += 1
    return order


def simulate(chunk_times: list[float], pp: int, microbatches: int) -> Simulation:
    """``chunk_times``: forward+backward seconds of the ``pp * vpp`` chunks in layer order (chunk c on
    rank c % pp); ``microbatches`` a multiple of ``pp`` for the interleaved schedule."""
    chunks = len(chunk_times)
    vpp = chunks // pp
    if chunks != pp * vpp or (vpp > 1 and microbatches % pp):
        raise ValueError(f"chunk_times/microbatches: {chunks} chunks on {pp} ranks with {microbatches} micro-batches; "
                         "give pp * vpp chunks and, interleaved, a multiple of pp micro-batches")
    orders = [_rank_order(rank, pp, vpp, microbatches) for rank in range(pp)]
    done: dict[tuple[str, int, int], float] = {}  # (F|B, micro-batch, chunk) -> finish time
    free = [0.0] * pp
    position = [0] * pp
    busy = [0.0] * pp
    remaining = sum(len(order) for order in orders)
    while remaining:
        progressed = False
        for rank in range(pp):
            while position[rank] < len(orders[rank]):
                kind, mb, vp = orders[rank][position[rank]]
                chunk = vp * pp + rank
                if kind == "F":
                    needs = [("F", mb, chunk - 1)] if chunk > 0 else []
                    duration = chunk_times[chunk] / 3
                else:
                    needs = [("F", mb, chunk)] + ([("B", mb, chunk + 1)] if chunk < chunks - 1 else [])
                    duration = 2 * chunk_times[chunk] / 3
                if any(need not in done for need in needs):
                    break
                start = max([free[rank]] + [done[need] for need in needs])
                free[rank] = done[(kind, mb, chunk)] = start + duration
                busy[rank] += duration
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("pipeline schedule deadlocked")  # an ordering bug, not a user error
    return Simulation(max(free), tuple(busy))
