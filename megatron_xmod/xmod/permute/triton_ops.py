"""Triton routed-token permutation kernels (same three primitives as the CUDA extension).

Imported lazily by the dispatcher: ``TRITON_INTERPRET=1`` is read when the ``@triton.jit``
kernels below are defined, so the CPU interpreter only works if it is set before this import.

Primitives (all tensors contiguous, rows are the (s*b) or (k*b) token rows of h elements):
  gather(x, idx)                                   -> [k,b,h]
  scatter_add_gated(x|None, y, gate|None, idx, s)  -> [s,b,h] = x (or 0) + gate (or 1) * y at idx
  scatter_backward(go, y, gate, idx, need_y, need_gate) -> (grad_y|None, grad_gate|None)
"""
import torch
import triton
import triton.language as tl

# One program walks a row in chunks of at most this many elements (keeps register use bounded
# for wide h while letting h <= 4096 finish in one chunk).
_MAX_BLOCK_H = 4096


def _block_h(h: int) -> int:
    return max(16, min(triton.next_power_of_2(max(h, 1)), _MAX_BLOCK_H))


def _num_warps(block_h: int) -> int:
    return 8 if block_h >= 2048 else 4


@triton.jit
def _gather_kernel(x_ptr, idx_ptr, out_ptr, s, b, h, BLOCK_H: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    t = tl.load(idx_ptr + r)
    valid = (t >= 0) & (t < s)
    # An unchecked out-of-range index must not read outside x: it yields a zero row instead.
    t = tl.where(valid, t, 0)
    src = x_ptr + (t * b + r % b) * h
    dst = out_ptr + r * h
    for h0 in range(0, h, BLOCK_H):
        offs = h0 + tl.arange(0, BLOCK_H)
        m = offs < h
        v = tl.load(src + offs, mask=m & valid, other=0.0)
        tl.store(dst + offs, v, mask=m)


@triton.jit
def _scatter_add_gated_kernel(x_ptr, y_ptr, gate_ptr, idx_ptr, out_ptr, s, k, b, h,
                              HAS_X: tl.constexpr, HAS_GATE: tl.constexpr, LOG_K: tl.constexpr,
                              BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # output token row t*b + c
    t = row // b
    c = row % b
    # lower_bound(t) in the sorted column c, with a fixed trip count (k.bit_length() steps) so
    # the loop has no data-dependent exit.
    lo = t * 0
    hi = lo + k
    for _ in tl.static_range(LOG_K):
        active = lo < hi
        mid = (lo + hi) // 2
        v = tl.load(idx_ptr + mid * b + c, mask=active & (mid < k), other=0)
        right = active & (v < t)
        left = active & (v >= t)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(left, mid, hi)
    j = lo
    jc = tl.where(j < k, j, 0)
    # Masked: with k == 0 the index tensor has no element to read at all.
    routed = tl.load(idx_ptr + jc * b + c, mask=j < k, other=-1) == t
    yrow = jc * b + c
    if HAS_GATE:
        g = tl.load(gate_ptr + yrow, mask=routed, other=0.0).to(tl.float32)
    else:
        g = 1.0
    for h0 in range(0, h, BLOCK_H):
        offs = h0 + tl.arange(0, BLOCK_H)
        m = offs < h
        yv = tl.load(y_ptr + yrow * h + offs, mask=m & routed, other=0.0)
        if HAS_X:
            xv = tl.load(x_ptr + row * h + offs, mask=m, other=0.0)
            upd = (xv.to(tl.float32) + g * yv.to(tl.float32)).to(xv.dtype)
            # where(), not x + 0: unrouted tokens must pass through bit-identically (e.g. -0.0).
            o = tl.where(routed, upd, xv)
        elif HAS_GATE:
            o = tl.where(routed, (g * yv.to(tl.float32)).to(yv.dtype), tl.zeros_like(yv))
        else:
            o = yv  # masked load already gave zeros for unrouted tokens
        tl.store(out_ptr + row * h + offs, o, mask=m)


@triton.jit
def _scatter_backward_kernel(go_ptr, y_ptr, gate_ptr, idx_ptr, gy_ptr, gg_ptr, s, b, h,
                             NEED_Y: tl.constexpr, NEED_GATE: tl.constexpr,
                             BLOCK_H: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)  # routed row j*b + c
    t = tl.load(idx_ptr + r)
    valid = (t >= 0) & (t < s)
    t = tl.where(valid, t, 0)
    grow = t * b + r % b
    g = tl.load(gate_ptr + r).to(tl.float32)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for h0 in range(0, h, BLOCK_H):
        offs = h0 + tl.arange(0, BLOCK_H)
        m = offs < h
        go = tl.load(go_ptr + grow * h + offs, mask=m & valid, other=0.0)
        if NEED_GATE:
            yv = tl.load(y_ptr + r * h + offs, mask=m, other=0.0)
            acc += go.to(tl.float32) * yv.to(tl.float32)
        if NEED_Y:
            tl.store(gy_ptr + r * h + offs, (g * go.to(tl.float32)).to(go.dtype), mask=m)
    if NEED_GATE:
        tl.store(gg_ptr + r, tl.sum(acc, axis=0).to(gg_ptr.dtype.element_ty))


def gather(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    s, b, h = x.shape
    k = idx.shape[0]
    out = torch.empty((k, b, h), dtype=x.dtype, device=x.device)
    if k * b and h:
        bh = _block_h(h)
        with torch.profiler.record_function("triton::gather"):  # bench/ops.py counts these launches
            _gather_kernel[(k * b,)](x, idx, out, s, b, h, BLOCK_H=bh, num_warps=_num_warps(bh))
    return out


def scatter_add_gated(x, y: torch.Tensor, gate, idx: torch.Tensor, s: int) -> torch.Tensor:
    k, b, h = y.shape
    out = torch.empty((s, b, h), dtype=y.dtype, device=y.device)
    if s * b and h:
        bh = _block_h(h)
        with torch.profiler.record_function("triton::scatter_add_gated"):
            _scatter_add_gated_kernel[(s * b,)](
                x if x is not None else y, y, gate if gate is not None else y, idx, out, s, k, b, h,
                HAS_X=x is not None, HAS_GATE=gate is not None, LOG_K=max(int(k).bit_length(), 1),
                BLOCK_H=bh, num_warps=_num_warps(bh))
    return out


def scatter_backward(go, y, gate, idx, need_y: bool, need_gate: bool):
    k, b, h = y.shape
    launch = bool(k * b and h)
    gy = torch.empty_like(y) if need_y else None
    # Every program writes its row's gate gradient: zeros only when no program runs (h == 0).
    gg = (torch.empty_like(gate) if launch else torch.zeros_like(gate)) if need_gate else None
    if (need_y or need_gate) and launch:
        bh = _block_h(h)
        with torch.profiler.record_function("triton::scatter_backward"):
            _scatter_backward_kernel[(k * b,)](
                go, y, gate, idx, gy if need_y else y, gg if need_gate else gate, go.shape[0], b, h,
                NEED_Y=need_y, NEED_GATE=need_gate, BLOCK_H=bh, num_warps=_num_warps(bh))
    return gy, gg
