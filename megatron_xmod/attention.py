"""Core attention for the local (non-TransformerEngine) path on torch SDPA.

megatron's local ``DotProductAttention`` materialises the full [b, heads, s, s] score matrix, which
rules out the paper's L = 32k on GPU; SDPA dispatches to flash / memory-efficient kernels there and
to the math kernel on CPU. Same constructor and forward contract as DotProductAttention.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


class SDPAttention(DotProductAttention):
    def forward(
        self,
        query: torch.Tensor,  # [sq, b, heads, head_dim]
        key: torch.Tensor,  # [sk, b, groups, head_dim]
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if packed_seq_params is not None:
            raise ValueError("packed_seq_params: packed sequences need TransformerEngine attention (--transformer-impl transformer_engine)")
        if attention_bias is not None:
            raise ValueError("attention_bias: not supported by SDPAttention")
        if self.config.apply_query_key_layer_scaling:
            # megatron folds 1/layer_number into softmax_scale and restores it inside its fp32
            # softmax; SDPA has no second half of that trick.
            raise ValueError("apply_query_key_layer_scaling: not supported by SDPAttention")
        if self.softmax_offset is not None:
            raise ValueError(f"softmax_type: SDPAttention supports 'vanilla' only, got {self.config.softmax_type!r}")
        mask_type = attn_mask_type or self.attn_mask_type
        sq, b = query.shape[0], query.shape[1]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        # megatron masks are True where attention is *forbidden*; SDPA's boolean masks are True
        # where it is allowed. As in megatron's local path, an explicit mask wins over the type.
        sdpa_mask = None if attention_mask is None else ~attention_mask.bool()
        is_causal = sdpa_mask is None and mask_type == AttnMaskType.causal
        dropout = self.attention_dropout.p if self.training else 0.0
        # Same RNG discipline as megatron: attention dropout differs across TP ranks by design.
        use_tracker = dropout and not self.config.sequence_parallel
        with tensor_parallel.get_cuda_rng_tracker().fork() if use_tracker else contextlib.nullcontext():
            context = F.scaled_dot_product_attention(
                q, k, v, attn_mask=sdpa_mask, dropout_p=dropout, is_causal=is_causal,
                scale=self.softmax_scale, enable_gqa=q.shape[1] != k.shape[1],
            )
        return context.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)
