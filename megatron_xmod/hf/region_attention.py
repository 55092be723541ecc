"""Decode attention of a batch over one flat key/value buffer of per-sequence regions (a sparse layer's
fixed-shape cache, static_decode.py): query ``r`` attends to the slots ``starts[r] .. ends[r] - 1`` of
the buffer, bounds that live on the device.

- :func:`region_attention_torch`: the reference, and the path off the GPU: the batch's queries as one
  sequence of queries over the whole buffer with a mask (SDPA), so it reads every slot, the regions'
  room for later entries included.
- :func:`region_attention_triton`: one program per (sequence, query head) walks its own region only,
  in blocks, with an online softmax; the loop's bounds are read from device memory, so a CUDA graph
  replays it for any fill, and a step reads the keys and values the sequences hold, not the room
  after them.

This file is copied verbatim into exported model folders: it imports only torch (and Triton where it
is installed).
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU install: the torch path only
    triton = None


def region_attention_torch(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, starts: torch.Tensor,
                           ends: torch.Tensor, scale: float) -> torch.Tensor:
    """``q`` ``[b, heads, 1, d]``, ``keys`` / ``values`` ``[1, kv_heads, slots, d]``, ``starts`` / ``ends``
    ``[b]`` (ends exclusive, ends > starts) -> ``[b, heads, 1, d]``."""
    slots = torch.arange(keys.shape[2], device=keys.device)
    allowed = (slots[None, :] >= starts[:, None]) & (slots[None, :] < ends[:, None])  # [b, slots]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 2), keys, values, attn_mask=allowed[None, None], scale=scale,
        enable_gqa=q.shape[1] != keys.shape[1])
    return out.transpose(0, 2)


def triton_usable(device: torch.device) -> bool:
    """The Triton kernel runs here: a CUDA device, or TRITON_INTERPRET=1 (tests)."""
    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


if triton is not None:
    # ``slots`` differs from layer to layer: a specialisation on it would compile a variant per buffer size,
    # some of them first during a CUDA-graph capture
    @triton.jit(do_not_specialize=["slots"])
    def _region_attention_kernel(q_ptr, k_ptr, v_ptr, starts_ptr, ends_ptr, out_ptr, scale, slots, heads,
                                 group, head_dim, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
        row = tl.program_id(0)
        head = tl.program_id(1)
        kv_head = head // group
        dims = tl.arange(0, BLOCK_D)
        in_dim = dims < head_dim
        query = tl.load(q_ptr + (row * heads + head) * head_dim + dims, mask=in_dim, other=0.0).to(tl.float32)
        start = tl.load(starts_ptr + row)
        end = tl.load(ends_ptr + row)
        base = kv_head.to(tl.int64) * slots * head_dim  # past 2^31 elements at long contexts and large batches
        best = float("-inf")
        total = 0.0
        acc = tl.zeros((BLOCK_D,), tl.float32)
        for first in range(start, end, BLOCK):
            at = first + tl.arange(0, BLOCK)
            inside = at < end
            offsets = base + at[:, None] * head_dim + dims[None, :]
            both = inside[:, None] & in_dim[None, :]
            k = tl.load(k_ptr + offsets, mask=both, other=0.0).to(tl.float32)
            score = tl.sum(k * query[None, :], axis=1) * scale
            score = tl.where(inside, score, float("-inf"))
            new_best = tl.maximum(best, tl.max(score, axis=0))
            weight = tl.exp(score - new_best)
            rescale = tl.exp(best - new_best)
            v = tl.load(v_ptr + offsets, mask=both, other=0.0).to(tl.float32)
            acc = acc * rescale + tl.sum(weight[:, None] * v, axis=0)
            total = total * rescale + tl.sum(weight, axis=0)
            best = new_best
        out = acc / total
        tl.store(out_ptr + (row * heads + head) * head_dim + dims, out.to(out_ptr.dtype.element_ty), mask=in_dim)


def region_attention_triton(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, starts: torch.Tensor,
                            ends: torch.Tensor, scale: float, block: int = 64) -> torch.Tensor:
    """As :func:`region_attention_torch`, reading each region's slots only."""
    b, heads, _, dim = q.shape
    _, kv_heads, slots, _ = keys.shape
    q, keys, values = q.contiguous(), keys.contiguous(), values.contiguous()
    out = torch.empty_like(q)
    block_d = triton.next_power_of_2(dim)
    # 8 warps from head dim 128: with 4, a thread holds 64 of each 64 x 128 key and value block and the bf16
    # kernel spills registers on sm_90 (tests/triton_targets.py)
    _region_attention_kernel[(b, heads)](q, keys, values, starts, ends, out, scale, slots, heads, heads // kv_heads,
                                         dim, BLOCK=block, BLOCK_D=block_d, num_warps=8 if block_d >= 128 else 4)
    return out


def region_attention(q, keys, values, starts, ends, scale: float, backend: str = "auto") -> torch.Tensor:
    """``backend``: "auto" (Triton on a CUDA device where it is installed, else torch), "torch" or "triton"."""
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"backend: {backend!r} is not one of auto, torch, triton")
    usable = triton_usable(q.device)
    if backend == "triton" and not usable:
        raise ValueError("backend: the Triton region attention needs a CUDA device with Triton installed, or "
                         "TRITON_INTERPRET=1; use backend='torch'")
    if backend == "triton" or (backend == "auto" and usable and q.device.type == "cuda"):
        return region_attention_triton(q, keys, values, starts, ends, scale)
    return region_attention_torch(q, keys, values, starts, ends, scale)
