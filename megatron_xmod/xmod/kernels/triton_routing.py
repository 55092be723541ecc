"""Triton kernels of the fused training routing step (top-k rule); the torch reference is
:func:`megatron_xmod.xmod.kernels.routing_step.routing_step_torch`, built from :mod:`megatron_xmod.xmod.routing`.

Imported lazily by the dispatcher: ``TRITON_INTERPRET=1`` is read when the ``@triton.jit`` kernels
below are defined, so the CPU interpreter only works if it is set before this import.

One launch forward, one backward, instead of the torch path's ops (top-k, sort, mask, bias update,
gate, statistics, router BCE, and their backward):

- ``_select_kernel`` (one program per sequence): the bias-adjusted score x w + c - tau*b (Eq.8, c the
  router's bias when the step was handed it), the
  exact top-k of the scores by a radix search on their order-preserving integer keys (8 passes of
  4 bits; no sort: ties at the k-th value go to the earliest positions), then one pass in position order
  that writes the scores, the sorted indices and their flat rows t*b + c, the selected mask, the
  updated bias b + increment*selected (into the routing state's hand-over buffer, possibly the
  carried bias itself), the gate r = sigmoid(score) of every routed token (times varsigma, when
  handed), each token's slot j in
  the routed list (-1 if not routed; the backward reads it) and, when asked, the routed set into the
  hand-over buffer and the router BCE (Eq.9) per sequence. The sequence's statistics (finite logits,
  covered tokens, |previous & selected| and |previous | selected|, the BCE) go into the routing
  state's table by atomic adds at offsets the state keeps (routing_state.StepStatistics); program 0
  also adds the call's constants. Nothing is left for torch ops to record;
- ``_scores_backward_kernel`` (grid: token blocks): d logit = d score + [routed]
  d gate * varsigma * r(1-r) + d loss * coeff (sigmoid(score) - q) / (s b). When the gradients of the
  router's bias (the sum of d logit) or of varsigma (the sum of d gate * r) are wanted, one program
  walks every token and writes them too: no partial sums, no reduction launch, and the same sum in
  the same order on every run.

The router logits themselves come from the layer (megatron_xmod.xmod.routing_state.router_logits keeps one
saved router input per block), so this kernel saves nothing of size [s, b, h].
"""
import torch
import triton
import triton.language as tl

_SELECT_BLOCK = 2048  # tokens per chunk of the selection passes
_BLOCK_S = 256  # tokens per program of the backward
_REDUCE_BLOCK = 2048  # tokens per step of the backward's single program when it also sums the scalar gradients


@triton.jit
def _score(logits_ptr, carry_ptr, row, tm, tau, rbias, HAS_CARRY: tl.constexpr):
    score = tl.load(logits_ptr + row, mask=tm, other=0.0) + rbias
    if HAS_CARRY:
        score = score - tau * tl.load(carry_ptr + row, mask=tm, other=0.0)
    return score


@triton.jit
def _order_key(v):
    """fp32 -> int64 in [0, 2^32) with the same order as the floats (negatives flipped)."""
    bits = v.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64) + 2147483648


@triton.jit
def _select_kernel(logits_ptr, rbias_ptr, scale_ptr, carry_ptr, prev_ptr, scores_ptr, idx_ptr, flat_ptr, gate_ptr,
                   mask_ptr, mask_out_ptr, bias_ptr, slot_ptr, loss_ptr, stats_ptr, offsets_ptr, constants_ptr,
                   n_counted, n_constants, s, b, k, tau, increment, inv_tokens, bce_coeff, HAS_RBIAS: tl.constexpr,
                   HAS_SCALE: tl.constexpr, HAS_CARRY: tl.constexpr, HAS_PREV: tl.constexpr,
                   HAS_MASK_OUT: tl.constexpr, HAS_BCE: tl.constexpr, HAS_STATS: tl.constexpr,
                   BLOCK: tl.constexpr, CONST_BLOCK: tl.constexpr):
    c = tl.program_id(0).to(tl.int64)
    rbias = tl.load(rbias_ptr).to(tl.float32) if HAS_RBIAS else 0.0
    scale = tl.load(scale_ptr).to(tl.float32) if HAS_SCALE else 1.0
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
            key = _order_key(_score(logits_ptr, carry_ptr, t * b + c, tm, tau, rbias, HAS_CARRY))
            counts += tl.sum(((key[:, None] >= cands[None, :]) & tm[:, None]).to(tl.int32), axis=0)
        best = tl.max(tl.where(counts >= k, digits, 0), axis=0)
        thresh = thresh + (best << (28 - 4 * i))
    above = tl.zeros([], dtype=tl.int64)
    for s0 in range(0, s, BLOCK):
        t = s0 + tl.arange(0, BLOCK).to(tl.int64)
        tm = t < s
        key = _order_key(_score(logits_ptr, carry_ptr, t * b + c, tm, tau, rbias, HAS_CARRY))
        above += tl.sum((tm & (key > thresh)).to(tl.int64), axis=0)
    ties_wanted = k - above
    ties_seen = tl.zeros([], dtype=tl.int64)
    placed = tl.zeros([], dtype=tl.int64)
    # This sequence's share of the call's statistics (integer counts: exact in the fp32 table).
    finite = tl.zeros([], dtype=tl.int64)
    covered = tl.zeros([], dtype=tl.int64)
    inter = tl.zeros([], dtype=tl.int64)
    union = tl.zeros([], dtype=tl.int64)
    bce = tl.zeros([], dtype=tl.float32)
    # The last pass writes every output in position order. Each chunk reads its rows of the carried bias
    # and of the previous routed set before it writes them: the hand-over buffers may be both input and
    # output (in place), and no other program touches this sequence's rows.
    for s0 in range(0, s, BLOCK):
        t = s0 + tl.arange(0, BLOCK).to(tl.int64)
        tm = t < s
        row = t * b + c
        logit = tl.load(logits_ptr + row, mask=tm, other=0.0) + rbias
        score = logit
        carried = tl.zeros([BLOCK], dtype=tl.float32)
        if HAS_CARRY:
            carried = tl.load(carry_ptr + row, mask=tm, other=0.0)
            score = logit - tau * carried
        key = _order_key(score)
        tie = (tm & (key == thresh)).to(tl.int64)
        tie_rank = ties_seen + tl.cumsum(tie, axis=0) - tie
        sel = tm & ((key > thresh) | ((tie > 0) & (tie_rank < ties_wanted)))
        sel_i = sel.to(tl.int64)
        slot = placed + tl.cumsum(sel_i, axis=0) - sel_i
        new_bias = carried + sel.to(tl.float32) * increment
        if HAS_STATS:
            exponent = logit.to(tl.int32, bitcast=True) & 0x7F800000  # all ones: inf or NaN
            finite += tl.sum((tm & (exponent != 0x7F800000)).to(tl.int64), axis=0)
            covered += tl.sum((tm & (new_bias > 0)).to(tl.int64), axis=0)
            if HAS_PREV:
                prev = tm & (tl.load(prev_ptr + row, mask=tm, other=0) != 0)
                inter += tl.sum((prev & sel).to(tl.int64), axis=0)
                union += tl.sum((prev | sel).to(tl.int64), axis=0)
        if HAS_BCE:  # Eq.(9) with logits: max(x, 0) - x q + log(1 + exp(-|x|)), q the top-k choice
            q = sel.to(tl.float32)
            term = tl.maximum(score, 0.0) - score * q + tl.log(1.0 + tl.exp(-tl.abs(score)))
            bce += tl.sum(tl.where(tm, term, 0.0), axis=0)
        tl.store(scores_ptr + row, score, mask=tm)
        tl.store(idx_ptr + slot * b + c, t, mask=sel)
        tl.store(flat_ptr + slot * b + c, row, mask=sel)
        tl.store(gate_ptr + slot * b + c, scale * tl.sigmoid(score), mask=sel)
        tl.store(slot_ptr + row, tl.where(sel, slot, -1).to(tl.int32), mask=tm)
        tl.store(mask_ptr + row, sel.to(tl.int8), mask=tm)
        if HAS_MASK_OUT:
            tl.store(mask_out_ptr + row, sel.to(tl.int8), mask=tm)
        tl.store(bias_ptr + row, new_bias, mask=tm)
        ties_seen += tl.sum(tie, axis=0)
        placed += tl.sum(sel_i, axis=0)
    if HAS_BCE:  # this sequence's part of coeff * mean BCE: the parts sum to the router loss
        tl.store(loss_ptr + c, bce_coeff * (bce * inv_tokens))
    if HAS_STATS:
        # Into the routing state's table (offsets: routing_state.StepStatistics), one atomic add per value.
        tl.atomic_add(stats_ptr + tl.load(offsets_ptr), finite.to(tl.float32))
        tl.atomic_add(stats_ptr + tl.load(offsets_ptr + 1), covered.to(tl.float32))
        if HAS_PREV:
            tl.atomic_add(stats_ptr + tl.load(offsets_ptr + 2), inter.to(tl.float32))
            tl.atomic_add(stats_ptr + tl.load(offsets_ptr + 3), union.to(tl.float32))
        if HAS_BCE:
            bce_at = offsets_ptr + n_counted - 2  # the BCE's metric, then the micro-batch loss
            tl.atomic_add(stats_ptr + tl.load(bce_at), bce * inv_tokens)
            tl.atomic_add(stats_ptr + tl.load(bce_at + 1), bce * inv_tokens)
        if c == 0:  # the call's constants, once
            # (a name of its own: the GPU compiler refuses a name a runtime branch rebinds to another type)
            j = tl.arange(0, CONST_BLOCK)
            jm = j < n_constants
            constant_at = tl.load(offsets_ptr + n_counted + j, mask=jm, other=0)
            tl.atomic_add(stats_ptr + constant_at, tl.load(constants_ptr + j, mask=jm, other=0.0), mask=jm)


@triton.jit
def _scores_backward_kernel(dscores_ptr, dgate_ptr, gate_ptr, slot_ptr, scores_ptr, dloss_ptr, dloss_stride, scale_ptr,
                            dlogits_ptr, dbias_ptr, dscale_ptr, n, b, span, bce_scale, HAS_DSCORES: tl.constexpr,
                            HAS_DGATE: tl.constexpr, HAS_DLOSS: tl.constexpr, HAS_SCALE: tl.constexpr,
                            SUM_BIAS: tl.constexpr, SUM_SCALE: tl.constexpr, BLOCK_S: tl.constexpr):
    """Rows [pid * span, (pid + 1) * span) of the flat [s*b] tokens, BLOCK_S at a time; with SUM_BIAS or
    SUM_SCALE one program (span = n) that also writes the sums."""
    scale = tl.load(scale_ptr).to(tl.float32) if HAS_SCALE else 1.0
    sum_dlogit = tl.zeros([BLOCK_S], dtype=tl.float32)
    sum_dscale = tl.zeros([BLOCK_S], dtype=tl.float32)
    first = tl.program_id(0).to(tl.int64) * span
    for off in range(0, span, BLOCK_S):
        row = first + off + tl.arange(0, BLOCK_S).to(tl.int64)  # t*b + c
        tm = row < n
        dlogit = tl.zeros([BLOCK_S], dtype=tl.float32)
        if HAS_DSCORES:
            dlogit += tl.load(dscores_ptr + row, mask=tm, other=0.0)
        slot = tl.load(slot_ptr + row, mask=tm, other=-1).to(tl.int64)
        routed = tm & (slot >= 0)
        if HAS_DGATE:
            gslot = tl.where(routed, slot, 0) * b + row % b
            if HAS_SCALE:  # the gate is varsigma * r: r from the saved score
                r = tl.sigmoid(tl.load(scores_ptr + row, mask=routed, other=0.0))
            else:
                r = tl.load(gate_ptr + gslot, mask=routed, other=0.0)
            dgate = tl.load(dgate_ptr + gslot, mask=routed, other=0.0)
            dlogit += dgate * scale * r * (1.0 - r)
            if SUM_SCALE:
                sum_dscale += tl.where(routed, dgate * r, 0.0)
        if HAS_DLOSS:  # d (coeff * mean BCE) / d score = coeff (sigmoid(score) - q) / (s b), times the sequence's d loss
            p = tl.sigmoid(tl.load(scores_ptr + row, mask=tm, other=0.0))
            d = tl.load(dloss_ptr + (row % b) * dloss_stride, mask=tm, other=0.0)
            dlogit += d * bce_scale * (p - routed.to(tl.float32))
        tl.store(dlogits_ptr + row, dlogit, mask=tm)
        if SUM_BIAS:
            sum_dlogit += dlogit  # masked rows hold 0
    if SUM_BIAS:
        tl.store(dbias_ptr, tl.sum(sum_dlogit, axis=0).to(dbias_ptr.dtype.element_ty))
    if SUM_SCALE:
        tl.store(dscale_ptr, tl.sum(sum_dscale, axis=0).to(dscale_ptr.dtype.element_ty))


class Destinations:
    """Buffers the forward writes besides its own outputs (the routing state's, written in place):
    ``bias`` [s, b] fp32 (always; it may be the carried bias itself), ``selected`` [s, b] int8 view of the
    hand-over routed set or None, ``previous`` [s, b] int8 view of the previous layer's routed set (it
    may be ``selected``) or None, ``statistics`` a routing_state.StepStatistics or None. A plain object,
    not a tuple, so that autograd does not take its tensors for inputs."""

    def __init__(self, bias, selected=None, previous=None, statistics=None):
        self.bias, self.selected, self.previous, self.statistics = bias, selected, previous, statistics


def forward(logits, carried, tau: float, k: int, increment: float, bce_coeff: float, dest: Destinations,
            router_bias=None, gate_scale=None):
    """logits [s,b] fp32 contiguous, carried [s,b] fp32 or None -> (indices [k,b] int64, selected [s,b]
    bool, scores [s,b] fp32, gate [k,b] fp32, slot [s,b] int32, flat rows [k*b] int64 (indices*b + column),
    router loss parts [b] fp32 (coeff * mean BCE summed over them) or None without ``bce_coeff``); the
    updated bias goes to ``dest.bias``. ``router_bias`` / ``gate_scale``: one-element tensors (any float
    dtype) added to the logits / multiplied into the gate, or None."""
    s, b = logits.shape
    dev = logits.device
    scores = torch.empty((s, b), dtype=torch.float32, device=dev)
    indices = torch.empty((k, b), dtype=torch.int64, device=dev)
    flat = torch.empty((k * b,), dtype=torch.int64, device=dev)
    gate = torch.empty((k, b), dtype=torch.float32, device=dev)
    selected = torch.empty((s, b), dtype=torch.int8, device=dev)
    slot = torch.empty((s, b), dtype=torch.int32, device=dev)
    loss = torch.empty((b,), dtype=torch.float32, device=dev) if bce_coeff else None
    stats = dest.statistics
    n_constants = 0 if stats is None else stats.constants.numel()
    if s * b:
        with torch.profiler.record_function("triton::routing_select"):  # bench/ops.py counts launches
            _select_kernel[(b,)](
                logits, router_bias if router_bias is not None else logits,
                gate_scale if gate_scale is not None else logits, carried if carried is not None else logits,
                dest.previous if dest.previous is not None else selected, scores, indices, flat, gate, selected,
                dest.selected if dest.selected is not None else selected, dest.bias, slot,
                loss if loss is not None else scores, stats.table if stats is not None else scores,
                stats.offsets if stats is not None else indices, stats.constants if stats is not None else scores,
                0 if stats is None else stats.offsets.numel() - n_constants, n_constants,
                s, b, k, float(tau), float(increment), 1.0 / (s * b), float(bce_coeff),
                HAS_RBIAS=router_bias is not None, HAS_SCALE=gate_scale is not None,
                HAS_CARRY=carried is not None, HAS_PREV=dest.previous is not None,
                HAS_MASK_OUT=dest.selected is not None, HAS_BCE=loss is not None, HAS_STATS=stats is not None,
                BLOCK=min(_SELECT_BLOCK, triton.next_power_of_2(s)),
                CONST_BLOCK=triton.next_power_of_2(max(n_constants, 1)), num_warps=8)
    return indices, selected.view(torch.bool), scores, gate, slot, flat, loss


def backward(dscores, dgate, gate, slot, scores=None, dloss=None, bce_coeff: float = 0.0, gate_scale=None,
             sum_bias_like=None, sum_scale_like=None):
    """(d logits [s,b] fp32, d router bias, d varsigma) from d scores [s,b], d gate [k,b] and d router-loss
    parts [b] (any may be None; ``dloss`` may be an expanded view: it is read with its stride).
    ``gate_scale``: the varsigma the forward multiplied into the gate (then ``scores`` is needed);
    ``sum_bias_like`` / ``sum_scale_like``: the router bias / varsigma whose gradient to return (shape and
    dtype), else that gradient is None."""
    s, b = slot.shape
    n = s * b
    dlogits = torch.empty((s, b), dtype=torch.float32, device=slot.device)
    dbias = None if sum_bias_like is None else torch.empty_like(sum_bias_like)
    dscale = None if sum_scale_like is None else torch.empty_like(sum_scale_like)
    reduce = dbias is not None or dscale is not None
    if n or reduce:
        block = min(_REDUCE_BLOCK, triton.next_power_of_2(max(n, 1))) if reduce else _BLOCK_S
        span = max(n, 1) if reduce else block
        with torch.profiler.record_function("triton::routing_backward"):
            _scores_backward_kernel[(1 if reduce else triton.cdiv(n, block),)](
                dscores if dscores is not None else dlogits, dgate if dgate is not None else gate, gate, slot,
                scores if scores is not None else dlogits, dloss if dloss is not None else dlogits,
                dloss.stride(0) if dloss is not None else 0, gate_scale if gate_scale is not None else dlogits,
                dlogits, dbias if dbias is not None else dlogits, dscale if dscale is not None else dlogits,
                n, b, span, float(bce_coeff) / max(n, 1),
                HAS_DSCORES=dscores is not None, HAS_DGATE=dgate is not None, HAS_DLOSS=dloss is not None,
                HAS_SCALE=gate_scale is not None, SUM_BIAS=dbias is not None, SUM_SCALE=dscale is not None,
                BLOCK_S=block, num_warps=8 if reduce else 4)
    return dlogits, dbias, dscale
