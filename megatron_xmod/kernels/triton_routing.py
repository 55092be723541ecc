"""Triton kernels of the fused training routing step (top-k rule); the torch reference is
:mod:`megatron_xmod.routing` and :func:`megatron_xmod.kernels.routing_step.routing_step_torch`.

Imported lazily by the dispatcher: ``TRITON_INTERPRET=1`` is read when the ``@triton.jit`` kernels
below are defined, so the CPU interpreter only works if it is set before this import.

Three launches replace the ~20 framework ops of the torch path:

- ``_router_scores_kernel`` (grid: token blocks x sequences): router logit x.w + w0, rounded to
  x's dtype as ``nn.Linear`` would, and the bias adjustment s - tau*b (Eq.8);
- ``_select_kernel`` (one program per sequence): exact top-k of the scores by a 32-step bisection
  on their order-preserving integer keys (no sort: ties at the k-th value go to the earliest
  positions), then one pass in position order that writes the sorted indices, the selected mask,
  the updated bias b + increment*selected, the gate r = sigmoid(score) of every routed token and
  each token's slot j in the routed list (-1 if not routed; the backward reads it);
- ``_router_backward_kernel`` (grid: token blocks x sequences): d logit = d score + [routed]
  d r * r(1-r), then d x = d logit * w, and d w, d w0 accumulated atomically in fp32.
"""
import torch
import triton
import triton.language as tl

_MAX_BLOCK_H = 512  # h is walked in chunks of at most this many elements
_BLOCK_S = 32  # tokens per program of the score/backward kernels
_SELECT_BLOCK = 1024  # tokens per chunk of the selection passes


@triton.jit
def _router_scores_kernel(x_ptr, w_ptr, w0_ptr, carry_ptr, scores_ptr, s, b, h, tau,
                          HAS_CARRY: tl.constexpr, ROUND_BF16: tl.constexpr, ROUND_FP16: tl.constexpr,
                          BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr):
    pid_s = tl.program_id(0)
    c = tl.program_id(1).to(tl.int64)
    t = pid_s.to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S).to(tl.int64)
    tm = t < s
    row = t * b + c
    acc = tl.zeros([BLOCK_S], dtype=tl.float32)
    for h0 in range(0, h, BLOCK_H):
        offs = h0 + tl.arange(0, BLOCK_H)
        hm = offs < h
        w = tl.load(w_ptr + offs, mask=hm, other=0.0).to(tl.float32)
        xv = tl.load(x_ptr + row[:, None] * h + offs[None, :], mask=tm[:, None] & hm[None, :], other=0.0)
        acc += tl.sum(xv.to(tl.float32) * w[None, :], axis=1)
    logit = acc + tl.load(w0_ptr).to(tl.float32)
    # nn.Linear returns x's dtype: the routing decision is made on those rounded logits.
    if ROUND_BF16:
        logit = logit.to(tl.bfloat16).to(tl.float32)
    if ROUND_FP16:
        logit = logit.to(tl.float16).to(tl.float32)
    if HAS_CARRY:
        logit = logit - tau * tl.load(carry_ptr + row, mask=tm, other=0.0)
    tl.store(scores_ptr + row, logit, mask=tm)


@triton.jit
def _order_key(v):
    """fp32 -> int64 in [0, 2^32) with the same order as the floats (negatives flipped)."""
    bits = v.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64) + 2147483648


@triton.jit
def _select_kernel(scores_ptr, carry_ptr, idx_ptr, gate_ptr, mask_ptr, bias_ptr, slot_ptr,
                   s, b, k, increment, HAS_CARRY: tl.constexpr, BLOCK: tl.constexpr):
    c = tl.program_id(0).to(tl.int64)
    # The k-th largest key T: the largest T with #{key >= T} >= k, built bit by bit.
    thresh = tl.zeros([], dtype=tl.int64)
    for i in tl.static_range(32):
        cand = thresh + (1 << (31 - i))
        count = tl.zeros([], dtype=tl.int64)
        for s0 in range(0, s, BLOCK):
            t = s0 + tl.arange(0, BLOCK).to(tl.int64)
            tm = t < s
            key = _order_key(tl.load(scores_ptr + t * b + c, mask=tm, other=0.0))
            count += tl.sum((tm & (key >= cand)).to(tl.int64), axis=0)
        thresh = tl.where(count >= k, cand, thresh)
    above = tl.zeros([], dtype=tl.int64)
    for s0 in range(0, s, BLOCK):
        t = s0 + tl.arange(0, BLOCK).to(tl.int64)
        tm = t < s
        key = _order_key(tl.load(scores_ptr + t * b + c, mask=tm, other=0.0))
        above += tl.sum((tm & (key > thresh)).to(tl.int64), axis=0)
    ties_wanted = k - above
    ties_seen = tl.zeros([], dtype=tl.int64)
    placed = tl.zeros([], dtype=tl.int64)
    for s0 in range(0, s, BLOCK):
        t = s0 + tl.arange(0, BLOCK).to(tl.int64)
        tm = t < s
        row = t * b + c
        score = tl.load(scores_ptr + row, mask=tm, other=0.0)
        key = _order_key(score)
        tie = (tm & (key == thresh)).to(tl.int64)
        tie_rank = ties_seen + tl.cumsum(tie, axis=0) - tie
        sel = tm & ((key > thresh) | ((tie > 0) & (tie_rank < ties_wanted)))
        sel_i = sel.to(tl.int64)
        slot = placed + tl.cumsum(sel_i, axis=0) - sel_i
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
def _router_backward_kernel(x_ptr, w_ptr, dscores_ptr, dgate_ptr, gate_ptr, slot_ptr, dx_ptr, dw_ptr,
                            dw0_ptr, s, b, h, HAS_DSCORES: tl.constexpr, HAS_DGATE: tl.constexpr,
                            NEED_DX: tl.constexpr, NEED_DW: tl.constexpr,
                            BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr):
    pid_s = tl.program_id(0)
    c = tl.program_id(1).to(tl.int64)
    t = pid_s.to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S).to(tl.int64)
    tm = t < s
    row = t * b + c
    dlogit = tl.zeros([BLOCK_S], dtype=tl.float32)
    if HAS_DSCORES:
        dlogit += tl.load(dscores_ptr + row, mask=tm, other=0.0)
    if HAS_DGATE:
        slot = tl.load(slot_ptr + row, mask=tm, other=-1).to(tl.int64)
        routed = tm & (slot >= 0)
        gslot = tl.where(routed, slot, 0) * b + c
        r = tl.load(gate_ptr + gslot, mask=routed, other=0.0)
        dlogit += tl.load(dgate_ptr + gslot, mask=routed, other=0.0) * r * (1.0 - r)
    if NEED_DW:
        tl.atomic_add(dw0_ptr, tl.sum(dlogit, axis=0))
    for h0 in range(0, h, BLOCK_H):
        offs = h0 + tl.arange(0, BLOCK_H)
        hm = offs < h
        m2 = tm[:, None] & hm[None, :]
        if NEED_DX:
            w = tl.load(w_ptr + offs, mask=hm, other=0.0).to(tl.float32)
            tl.store(dx_ptr + row[:, None] * h + offs[None, :],
                     (dlogit[:, None] * w[None, :]).to(dx_ptr.dtype.element_ty), mask=m2)
        if NEED_DW:
            xv = tl.load(x_ptr + row[:, None] * h + offs[None, :], mask=m2, other=0.0).to(tl.float32)
            tl.atomic_add(dw_ptr + offs, tl.sum(xv * dlogit[:, None], axis=0), mask=hm)


def _block_h(h: int) -> int:
    return max(16, min(triton.next_power_of_2(max(h, 1)), _MAX_BLOCK_H))


def forward(x, weight, w0, carried, tau: float, k: int, increment: float):
    """x [s,b,h] contiguous, weight [h], w0 [1], carried [s,b] fp32 or None ->
    (indices [k,b] int64, selected [s,b] bool, scores [s,b] fp32, gate [k,b] fp32,
    bias [s,b] fp32, slot [s,b] int32)."""
    s, b, h = x.shape
    dev = x.device
    scores = torch.empty((s, b), dtype=torch.float32, device=dev)
    indices = torch.empty((k, b), dtype=torch.int64, device=dev)
    gate = torch.empty((k, b), dtype=torch.float32, device=dev)
    selected = torch.empty((s, b), dtype=torch.int8, device=dev)
    bias = torch.empty((s, b), dtype=torch.float32, device=dev)
    slot = torch.empty((s, b), dtype=torch.int32, device=dev)
    carry = carried if carried is not None else scores
    if s * b:
        _router_scores_kernel[(triton.cdiv(s, _BLOCK_S), b)](
            x, weight, w0, carry, scores, s, b, h, float(tau), HAS_CARRY=carried is not None and tau != 0,
            ROUND_BF16=x.dtype == torch.bfloat16, ROUND_FP16=x.dtype == torch.float16,
            BLOCK_S=_BLOCK_S, BLOCK_H=_block_h(h))
        _select_kernel[(b,)](scores, carry, indices, gate, selected, bias, slot, s, b, k, float(increment),
                             HAS_CARRY=carried is not None, BLOCK=min(_SELECT_BLOCK, triton.next_power_of_2(s)))
    return indices, selected.view(torch.bool), scores, gate, bias, slot


def backward(x, weight, dscores, dgate, gate, slot, need_dx: bool, need_dw: bool):
    """(d x in x's dtype | None, d weight fp32 [h] | None, d w0 fp32 [1] | None)."""
    s, b, h = x.shape
    dx = torch.empty_like(x) if need_dx else None
    dw = torch.zeros(h, dtype=torch.float32, device=x.device) if need_dw else None
    dw0 = torch.zeros(1, dtype=torch.float32, device=x.device) if need_dw else None
    if s * b and (need_dx or need_dw):
        _router_backward_kernel[(triton.cdiv(s, _BLOCK_S), b)](
            x, weight, dscores if dscores is not None else gate, dgate if dgate is not None else gate, gate, slot,
            dx if need_dx else x, dw if need_dw else gate, dw0 if need_dw else gate, s, b, h,
            HAS_DSCORES=dscores is not None, HAS_DGATE=dgate is not None, NEED_DX=need_dx, NEED_DW=need_dw,
            BLOCK_S=_BLOCK_S, BLOCK_H=_block_h(h))
    return dx, dw, dw0
