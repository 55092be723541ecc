"""Triton kernels of the fused training routing step (top-k rule); the torch reference is
:func:`megatron_xmod.xmod.kernels.routing_step.routing_step_torch`, built from :mod:`megatron_xmod.xmod.routing`.

Imported lazily by the dispatcher: ``TRITON_INTERPRET=1`` is read when the ``@triton.jit`` kernels
below are defined, so the CPU interpreter only works if it is set before this import.

One launch forward, one backward, instead of the torch path's ~12 ops forward and ~6 backward:

- ``_select_kernel`` (one program per sequence): the bias-adjusted score s - tau*b (Eq.8), the
  exact top-k of the scores by a radix search on their order-preserving integer keys (8 passes of
  4 bits; no sort: ties at the k-th value go to the earliest positions), then one pass in position order
  that writes the scores, the sorted indices, the selected mask, the updated bias
  b + increment*selected, the gate r = sigmoid(score) of every routed token and each token's slot
  j in the routed list (-1 if not routed; the backward reads it);
- ``_scores_backward_kernel`` (grid: token blocks x sequences): d logit = d score + [routed]
  d r * r(1-r).

The router logits themselves come from the layer (megatron_xmod.xmod.routing_state.router_logits keeps one
saved router input per block), so this kernel saves nothing of size [s, b, h].
"""
import torch
import triton
import triton.language as tl

_SELECT_BLOCK = 2048  # tokens per chunk of the selection passes
_BLOCK_S = 256  # tokens per program of the backward


@triton.jit
def _score(logits_ptr, carry_ptr, row, tm, tau, HAS_CARRY: tl.constexpr):
    score = tl.load(logits_ptr + row, mask=tm, other=0.0)
    if HAS_CARRY:
        score = score - tau * tl.load(carry_ptr + row, mask=tm, other=0.0)
    return score


@triton.jit
def _order_key(v):
    """fp32 -> int64 in [0, 2^32) with the same order as the floats (negatives flipped)."""
    bits = v.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64) + 2147483648


@triton.jit
def _select_kernel(logits_ptr, carry_ptr, scores_ptr, idx_ptr, gate_ptr, mask_ptr, bias_ptr, slot_ptr,
                   s, b, k, tau, increment, HAS_CARRY: tl.constexpr, BLOCK: tl.constexpr):
    c = tl.program_id(0).to(tl.int64)
    # The k-th largest key T: the largest T with #{key >= T} >= k, built 4 bits a pass (8 passes):
    # each pass counts the keys above 16 candidate digits at once and keeps the largest that
    # still leaves k keys (digit 0 always does).
    digits = tl.arange(0, 16).to(tl.int64)
    thresh = tl.zeros([], dtype=tl.int64)
    for i in tl.static_range(8):
        cands = thresh + (digits << (28 - 4 * i))
        counts = tl.zeros([16], dtype=tl.int32)
        for s0 in range(0, s, BLOCK):
            t = s0 + tl.arange(0, BLOCK).to(tl.int64)
            tm = t < s
            key = _order_key(_score(logits_ptr, carry_ptr, t * b + c, tm, tau, HAS_CARRY))
            counts += tl.sum(((key[:, None] >= cands[None, :]) & tm[:, None]).to(tl.int32), axis=0)
        best = tl.max(tl.where(counts >= k, digits, 0), axis=0)
        thresh = thresh + (best << (28 - 4 * i))
    above = tl.zeros([], dtype=tl.int64)
    for s0 in range(0, s, BLOCK):
        t = s0 + tl.arange(0, BLOCK).to(tl.int64)
        tm = t < s
        key = _order_key(_score(logits_ptr, carry_ptr, t * b + c, tm, tau, HAS_CARRY))
        above += tl.sum((tm & (key > thresh)).to(tl.int64), axis=0)
    ties_wanted = k - above
    ties_seen = tl.zeros([], dtype=tl.int64)
    placed = tl.zeros([], dtype=tl.int64)
    for s0 in range(0, s, BLOCK):
        t = s0 + tl.arange(0, BLOCK).to(tl.int64)
        tm = t < s
        row = t * b + c
        score = _score(logits_ptr, carry_ptr, row, tm, tau, HAS_CARRY)
        key = _order_key(score)
        tie = (tm & (key == thresh)).to(tl.int64)
        tie_rank = ties_seen + tl.cumsum(tie, axis=0) - tie
        sel = tm & ((key > thresh) | ((tie > 0) & (tie_rank < ties_wanted)))
        sel_i = sel.to(tl.int64)
        slot = placed + tl.cumsum(sel_i, axis=0) - sel_i
        tl.store(scores_ptr + row, score, mask=tm)
        tl.store(idx_ptr + slot * b + c, t, mask=sel)
        tl.store(gate_ptr + slot * b + c, tl.sigmoid(score), mask=sel)
        tl.store(slot_ptr + row, tl.where(sel, slot, -1).to(tl.int32), mask=tm)
        tl.store(mask_ptr + row, sel.to(tl.int8), mask=tm)
        new_bias = sel.to(tl.float32) * increment
        if HAS_CARRY:
            new_bias += tl.load(carry_ptr + row, mask=tm, other=0.0)
        tl.store(bias_ptr + row, new_bias, mask=tm)
        ties_seen += tl.sum(tie, axis=0)
        placed += tl.sum(sel_i, axis=0)


@triton.jit
def _scores_backward_kernel(dscores_ptr, dgate_ptr, gate_ptr, slot_ptr, dlogits_ptr, n, b,
                            HAS_DSCORES: tl.constexpr, HAS_DGATE: tl.constexpr, BLOCK_S: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S).to(tl.int64)  # t*b + c
    tm = row < n
    dlogit = tl.zeros([BLOCK_S], dtype=tl.float32)
    if HAS_DSCORES:
        dlogit += tl.load(dscores_ptr + row, mask=tm, other=0.0)
    if HAS_DGATE:
        slot = tl.load(slot_ptr + row, mask=tm, other=-1).to(tl.int64)
        routed = tm & (slot >= 0)
        gslot = tl.where(routed, slot, 0) * b + row % b
        r = tl.load(gate_ptr + gslot, mask=routed, other=0.0)
        dlogit += tl.load(dgate_ptr + gslot, mask=routed, other=0.0) * r * (1.0 - r)
    tl.store(dlogits_ptr + row, dlogit, mask=tm)


def forward(logits, carried, tau: float, k: int, increment: float):
    """logits [s,b] fp32 contiguous, carried [s,b] fp32 or None -> (indices [k,b] int64,
    selected [s,b] bool, scores [s,b] fp32, gate [k,b] fp32, bias [s,b] fp32, slot [s,b] int32)."""
    s, b = logits.shape
    dev = logits.device
    scores = torch.empty((s, b), dtype=torch.float32, device=dev)
    indices = torch.empty((k, b), dtype=torch.int64, device=dev)
    gate = torch.empty((k, b), dtype=torch.float32, device=dev)
    selected = torch.empty((s, b), dtype=torch.int8, device=dev)
    bias = torch.empty((s, b), dtype=torch.float32, device=dev)
    slot = torch.empty((s, b), dtype=torch.int32, device=dev)
    if s * b:
        with torch.profiler.record_function("triton::routing_select"):  # bench/ops.py counts launches
            _select_kernel[(b,)](logits, carried if carried is not None else logits, scores, indices, gate, selected,
                                 bias, slot, s, b, k, float(tau), float(increment), HAS_CARRY=carried is not None,
                                 BLOCK=min(_SELECT_BLOCK, triton.next_power_of_2(s)), num_warps=8)
    return indices, selected.view(torch.bool), scores, gate, bias, slot


def backward(dscores, dgate, gate, slot):
    """d logits [s,b] fp32 from d scores [s,b] and d gate [k,b] (either may be None)."""
    s, b = slot.shape
    dlogits = torch.empty((s, b), dtype=torch.float32, device=slot.device)
    if s * b:
        with torch.profiler.record_function("triton::routing_backward"):
            _scores_backward_kernel[(triton.cdiv(s * b, _BLOCK_S),)](
                dscores if dscores is not None else dlogits, dgate if dgate is not None else gate, gate, slot,
                dlogits, s * b, b, HAS_DSCORES=dscores is not None, HAS_DGATE=dgate is not None, BLOCK_S=_BLOCK_S)
    return dlogits
