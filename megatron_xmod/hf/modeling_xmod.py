"""Hugging Face model of the megatron_xmod models: the same math as megatron's GPTModel with the X-MoD
layers in eval mode, in plain torch, with generation over a sparse KV cache.

- Dense layers are megatron's pre-norm layers: x + a, then + f (RMSNorm, GQA attention with
  optional QK-norm and RoPE, SwiGLU MLP or MoE).
- Sparse layers ("X-MoD: Practical Scaling Laws for Sparse-Depth Routing Beyond Mixture-of-Depths",
  Eq.6-8) route with the rules of ``routing.py`` (megatron_xmod's own file, copied verbatim into an
  exported folder): a d->1 router scores every token, the token-choice bias b of the previous
  sparse layers of the block is subtracted (tau * b), and under the default threshold rule a token
  is processed when s - tau*b >= 0, which depends on nothing but the token itself, so generation
  token by token routes exactly as a full-sequence pass. The routed tokens run attention (causal
  among themselves, RoPE at their original positions) and the MLP, and come back gated:
  X-MoD x + varsigma*r*(a + f), MoD x + a + r*f, r = sigmoid(s - tau*b). ``routing_rule="topk"``
  (config or forward kwarg) routes the top L/K of each sequence instead, for full-sequence scoring.
- MoE layers route with the rules of ``moe_scores.py`` (megatron_xmod/moe/scores.py, copied):
  megatron's Top-k (softmax, or sigmoid with the expert bias) or Top-p with the threshold the DTop-p
  controller reached and the DRN temperature theta_l.

Shapes are batch-first ``[b, s, h]`` here; the routing functions take megatron's ``[s, b]``.
"""
from __future__ import annotations

import functools
import math
import warnings
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

try:  # an exported folder: the verbatim copies next to this file
    from .cache import XModCache
    from .configuration_xmod import XModHFConfig
    from .moe_scores import normalize_routing_logits, top_p_routing, topk_routing
    from .routing import adjusted_logits, gated_residual, route, update_token_choice_bias
    from .static_decode import StaticDecodeState
except ImportError:  # inside the megatron_xmod package
    from megatron_xmod.hf.cache import XModCache
    from megatron_xmod.hf.configuration_xmod import XModHFConfig
    from megatron_xmod.hf.static_decode import StaticDecodeState
    from megatron_xmod.moe.scores import normalize_routing_logits, top_p_routing, topk_routing
    from megatron_xmod.xmod.routing import (
        adjusted_logits,
        gated_residual,
        route,
        update_token_choice_bias,
    )

PREFILL_ATTENTION = ("auto", "batched", "per_sequence")  # XModModel.prefill_attention
# transformers 5 names the cache "cache"; 4.x named it "past_key_values".
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def packed_documents(position_ids: torch.Tensor) -> Optional[torch.Tensor]:
    """The document of every token of a packed input, transformers' convention for packing (e.g.
    ``DataCollatorWithFlattening``): ``position_ids`` fall back for each new document of a row (as in
    transformers, a fall, not a repeat: the clamped zeros of left padding are one document). Returns
    ``[b, n]`` document numbers, or None when no row falls back (one document a row: plain causal
    attention). One read of the positions (a prefill's)."""
    restarts = position_ids[..., 1:] < position_ids[..., :-1]
    if not bool(restarts.any()):
        return None
    return torch.cat([torch.zeros_like(restarts[..., :1]), restarts], dim=-1).long().cumsum(-1)


class XModRMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rotary_frequencies(config: XModHFConfig, positions: torch.Tensor) -> torch.Tensor:
    """megatron's RoPE angles ``[..., rot_dim]`` at integer ``positions`` (rot_dim = head_dim * rotary_percent)."""
    dim = config.head_dim if config.rotary_percent >= 1.0 else int(config.head_dim * config.rotary_percent)
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device) / dim))
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq
    if config.rotary_interleaved:
        return torch.stack((freqs, freqs), dim=-1).flatten(-2)
    return torch.cat((freqs, freqs), dim=-1)


def _rotate_half(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if not interleaved:
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def rotary_tables(config: XModHFConfig, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the RoPE angles at ``positions`` ``[b, s]``: ``[b, s, rot_dim]`` each, in ``dtype``. The
    model computes them once a pass; each layer picks its tokens' rows."""
    freqs = rotary_frequencies(config, positions)
    return torch.cos(freqs).to(dtype), torch.sin(freqs).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """``x`` ``[b, s, heads, d]``, ``cos`` / ``sin`` ``[b, s, rot_dim]``; the dimensions past rot_dim pass unchanged."""
    rot_dim = cos.shape[-1]
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    if rot_dim == x.shape[-1]:
        return x * cos + _rotate_half(x, interleaved) * sin
    x, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    x = x * cos + _rotate_half(x, interleaved) * sin
    return torch.cat((x, x_pass), dim=-1)


class XModAttention(nn.Module):
    def __init__(self, config: XModHFConfig, layer_idx: int):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        h, d = config.hidden_size, config.head_dim
        self.heads, self.groups, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.groups * d, bias=False)
        self.v_proj = nn.Linear(h, self.groups * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)
        if config.qk_layernorm:
            self.q_norm = XModRMSNorm(d, config.rms_norm_eps)
            self.k_norm = XModRMSNorm(d, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, valid: Optional[torch.Tensor],
                cache: Optional[XModCache] = None, documents: Optional[torch.Tensor] = None,
                rows: Optional[list[int]] = None, rope: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                causal: bool = False) -> torch.Tensor:
        """``x`` ``[b, m, h]``: the tokens this layer processes, in order; ``valid`` ``[b, m]``: which of
        them other tokens may attend to (not padding; None: all of them). Each token attends causally to
        the valid tokens of this layer before it (cached ones included) and to itself; with ``documents``
        ``[b, m]`` (packed inputs, no cache: :func:`packed_documents`) only to those of its own document.
        ``rows``: the batch rows of the cache that ``x`` belongs to (None: all); ``rope``:
        :func:`rotary_tables` at ``positions`` (None: computed here). ``causal``: nothing cached before
        this pass and every token before a valid one is valid (a prefill without padding, whose
        padding, if any, comes after the valid tokens): plain causal attention, without a mask, which
        lets the attention kernel skip the blocks above the diagonal."""
        b, m, _ = x.shape
        q, k, v = self.project(x, rope if rope is not None else rotary_tables(self.config, positions, x.dtype))
        if cache is not None and m == 1 and b > 1 and cache.layers[self.layer_idx].sparse:
            # A decode step's tokens of several sequences in a sparse layer: each attends to its own
            # sequence's buffer as it is (a view). One padded batch would copy every sequence's entries
            # into it at every step (the buffers differ in length).
            rows = range(b) if rows is None else rows
            out = torch.cat([self._attend(q[i:i + 1], k[i:i + 1], v[i:i + 1], None if valid is None else valid[i:i + 1],
                                          positions[i:i + 1], cache, None, [row]) for i, row in enumerate(rows)])
        else:
            out = self._attend(q, k, v, valid, positions, cache, documents, rows, causal)
        return self.o_proj(out.transpose(1, 2).reshape(b, m, self.heads * self.head_dim))

    def attend_packed(self, x: torch.Tensor, counts: list[int], slots: torch.Tensor, positions: torch.Tensor,
                      rope: tuple[torch.Tensor, torch.Tensor], documents: Optional[torch.Tensor] = None,
                      cache: Optional[XModCache] = None) -> torch.Tensor:
        """Attention of a first pass's routed tokens ``x`` ``[t, h]``, packed sequence by sequence (``counts[i]``
        tokens of sequence i, in order; nothing cached before this pass), in one attention call: projections,
        norms and RoPE on the packed tokens, then ``scaled_dot_product_attention`` over a batch of the
        sequences that route a token, padded to the busiest (``slots`` ``[t]``: each packed token's place in
        that ``[rows, max(counts)]`` batch, row-major, a sequence's tokens first), so that plain causal
        attention keeps them causal and away from the padding after them; with ``documents`` ``[t]`` also
        inside their document. The cache, if any, appends each sequence's entries as they are (no padding).
        Returns ``[t, h]``."""
        rows, width = sum(count > 0 for count in counts), max(counts)
        q, k, v = (t[0].transpose(0, 1) for t in self.project(x[None], tuple(t[None] for t in rope)))  # [t, heads, d]
        if cache is not None:
            start = 0
            for row, count in enumerate(counts):
                if count:  # views of the packed entries: the cache copies them into its buffer of the sequence
                    entries = slice(start, start + count)
                    cache.update(k[entries].transpose(0, 1)[None], v[entries].transpose(0, 1)[None], self.layer_idx,
                                 None, positions[None, entries], [row])
                    start += count

        def batched(t: torch.Tensor) -> torch.Tensor:  # [t, ...] -> [rows, width, ...], zeros in the padding
            return t.new_zeros(rows * width, *t.shape[1:]).index_copy_(0, slots, t).view(rows, width, *t.shape[1:])

        # a padding place's document (0) matters not: no real token attends past its sequence's own tokens
        out = self._attend(*(batched(t).transpose(1, 2) for t in (q, k, v)), None, None, None,
                           None if documents is None else batched(documents), causal=documents is None)
        return self.o_proj(out.transpose(1, 2).reshape(rows * width, self.heads * self.head_dim).index_select(0, slots))

    def project(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Queries, keys and values ``[b, heads, m, d]`` of ``x`` ``[b, m, h]`` (QK-norm, then RoPE ``(cos, sin)``)."""
        b, m, _ = x.shape
        q = self.q_proj(x).view(b, m, self.heads, self.head_dim)
        k = self.k_proj(x).view(b, m, self.groups, self.head_dim)
        v = self.v_proj(x).view(b, m, self.groups, self.head_dim)
        if self.config.qk_layernorm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope
        q = apply_rotary(q, cos, sin, self.config.rotary_interleaved)
        k = apply_rotary(k, cos, sin, self.config.rotary_interleaved)
        return tuple(t.transpose(1, 2) for t in (q, k, v))

    def decode_static(self, x: torch.Tensor, rope, state: StaticDecodeState) -> torch.Tensor:
        """A fixed-shape decode step's attention (``x`` ``[b, 1, h]``): appends this step's key and value to
        ``state``'s buffers of this layer and attends over them, masked (static_decode.py)."""
        b = x.shape[0]
        out = state.attention(self.layer_idx, *self.project(x, rope), scale=1.0 / math.sqrt(self.head_dim))
        return self.o_proj(out.transpose(1, 2).reshape(b, 1, self.heads * self.head_dim))

    def _attend(self, q, k, v, valid, positions, cache, documents=None, rows=None, causal=False):
        """Appends ``k`` / ``v`` ``[b, groups, m, d]`` to the cache (if any) and returns SDPA's ``[b, heads, m, d]``."""
        b, _, m, _ = q.shape
        if cache is not None:
            k, v, key_valid, new_columns = cache.update(k, v, self.layer_idx, valid, positions, rows)
        else:
            key_valid, new_columns = valid, None
        keys = k.shape[2]
        if causal or (m == 1 and documents is None and (key_valid is None or keys == 1)):
            allowed = None  # a first pass's causal attention, or one new token that sees every key there is
        elif key_valid is None and documents is None:
            # every key valid and this pass's tokens the last ones: causal, aligned to the last key
            allowed = torch.ones(m, keys, dtype=torch.bool, device=q.device).tril(keys - m)
        elif m == 1 and documents is None:  # one new token: the valid keys and itself
            allowed = key_valid.scatter(1, new_columns, True)[:, None, None, :]
        else:
            if key_valid is None:
                key_valid = torch.ones(b, keys, dtype=torch.bool, device=q.device)
            if new_columns is None:
                new_columns = torch.arange(keys - m, keys, device=q.device).expand(b, m)
            allowed = attention_mask(key_valid, new_columns)
            if documents is not None:
                allowed = allowed & (documents[:, :, None] == documents[:, None, :])
            allowed = allowed.unsqueeze(1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, is_causal=causal,
                                              scale=1.0 / math.sqrt(self.head_dim), enable_gqa=self.heads != self.groups)


def attention_mask(key_valid: torch.Tensor, new_columns: torch.Tensor) -> torch.Tensor:
    """``[b, m, keys]``: new token i (at key column ``new_columns[:, i]``) may attend to every valid key
    that is not a new token, to the valid new tokens before it, and always to itself (a padding
    token attends to itself only, so that no row of the softmax is empty)."""
    b, m = new_columns.shape
    steps = torch.arange(m, device=new_columns.device)
    order = torch.full_like(key_valid, -1, dtype=torch.long).scatter_(1, new_columns, steps.expand(b, m))
    order, query = order[:, None, :], steps[None, :, None]  # [b, 1, keys]: -1 for a cached key
    return ((order <= query) & key_valid[:, None, :]) | (order == query)


class XModMLP(nn.Module):
    def __init__(self, config: XModHFConfig, intermediate_size: int):
        super().__init__()
        h = config.hidden_size
        self.gated = config.gated_linear_unit
        self.act = F.silu if config.hidden_act == "silu" else F.gelu
        if self.gated:
            self.gate_proj = nn.Linear(h, intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(self.act(self.up_proj(x)))


class XModMoERouter(nn.Module):
    """The router state megatron checkpoints: gate weight, expert bias (Top-k), DTop-p threshold and
    integral, DRN theta_l."""

    def __init__(self, config: XModHFConfig):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        if config.moe_router_type == "topk":
            if config.moe_expert_bias:
                self.register_buffer("expert_bias", torch.zeros(config.num_experts))
        else:
            self.register_buffer("dtopp_threshold", torch.full((1,), 0.25))
            self.register_buffer("dtopp_integral", torch.zeros(1))
            if config.moe_routing_norm == "learnable":
                self.drn_scale = nn.Parameter(torch.ones(1))

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``tokens`` ``[t, h]`` -> (weights ``[t, experts]``, boolean routing map ``[t, experts]``)."""
        c = self.config
        logits = F.linear(tokens.float(), self.weight.float())  # megatron's fp32 router (moe_router_dtype)
        if c.moe_router_type == "topk":
            if c.moe_routing_norm == "fixed":
                logits = normalize_routing_logits(logits, c.moe_routing_norm_theta)
            probs, indices = topk_routing(logits, c.moe_router_topk, c.moe_score_function, c.moe_router_pre_softmax,
                                          getattr(self, "expert_bias", None), c.moe_router_topk_scaling_factor)
            weights = torch.zeros_like(logits).scatter(1, indices, probs)
            return weights, torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True)
        if c.moe_routing_norm != "none":
            theta = self.drn_scale if c.moe_routing_norm == "learnable" else c.moe_routing_norm_theta
            logits = normalize_routing_logits(logits, theta)
        return top_p_routing(torch.softmax(logits, dim=-1), self.dtopp_threshold)


class XModMoE(nn.Module):
    def __init__(self, config: XModHFConfig):
        super().__init__()
        self.router = XModMoERouter(config)
        self.experts = nn.ModuleList(XModMLP(config, config.moe_intermediate_size) for _ in range(config.num_experts))
        self.shared_experts = (XModMLP(config, config.shared_expert_intermediate_size)
                               if config.shared_expert_intermediate_size else None)

    def forward(self, x: torch.Tensor, every_expert: bool = False) -> torch.Tensor:
        """``every_expert``: run every expert on every token (weighted 0 where not routed): fixed shapes,
        no device read (a fixed-shape decode step's choice)."""
        tokens = x.reshape(-1, x.shape[-1])
        weights, routing_map = self.router(tokens)
        if every_expert or tokens.shape[0] <= len(self.experts) <= tokens.shape[0] * self.router.config.moe_router_topk:
            # A decode step's tokens, enough of them to reach about every expert: every expert runs on
            # all of them, weighted 0 where not routed. At decode an expert's cost is reading its
            # weights, which those tokens read anyway; in exchange no device read decides which run.
            # (Fewer tokens, e.g. batch 1 with top-2 of 8: each routed expert alone, one read each.)
            gates = (weights * routing_map).to(tokens.dtype)
            out = sum(expert(tokens) * gates[:, e, None] for e, expert in enumerate(self.experts))
        else:
            out = self._routed_experts(tokens, weights, routing_map)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        return out.view_as(x)

    def _routed_experts(self, tokens, weights, routing_map):
        """Each expert on its routed tokens only. One device read for the whole layer (the tokens per
        expert): the routed (expert, token) pairs are sorted expert by expert on the device, and the
        host cuts them at those counts."""
        t = tokens.shape[0]
        counts = routing_map.sum(0).tolist()  # the one device read
        expert_major = routing_map.t().reshape(-1)
        # a stable sort of "not routed" puts the routed pairs first, expert by expert, tokens in order
        pairs = torch.argsort(~expert_major, stable=True)[:sum(counts)]
        rows = pairs % t
        gates = weights.t().reshape(-1)[pairs, None].to(tokens.dtype)
        outputs = [self.experts[e](chunk) for e, chunk in enumerate(tokens[rows].split(counts)) if counts[e]]
        out = torch.zeros_like(tokens)
        return out if not outputs else out.index_add_(0, rows, torch.cat(outputs) * gates)


class XModDecoderLayer(nn.Module):
    """A dense layer, or (``config.is_sparse(layer_idx)``) a routed MoD / X-MoD layer."""

    def __init__(self, config: XModHFConfig, layer_idx: int):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.sparse = config.is_sparse(layer_idx)
        self.sparsity_k = config.layer_sparsity_k[layer_idx]
        self.input_layernorm = XModRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = XModAttention(config, layer_idx)
        self.post_attention_layernorm = XModRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = XModMoE(config) if config.is_moe else XModMLP(config, config.intermediate_size)
        if self.sparse:
            self.router = nn.Linear(config.hidden_size, 1, bias=True)
            if config.routing_family == "xmod":
                self.gate_scale = nn.Parameter(torch.ones(1))

    def router_logits(self, x) -> torch.Tensor:
        """[b, n] fp32 router logits of a sparse layer as megatron's routed layer computes them: x w in x's
        dtype, then the router's bias added in fp32 (its routing step adds the bias)."""
        return F.linear(x, self.router.weight).squeeze(-1).float() + self.router.bias.float()

    def _attention_and_mlp(self, x, positions, valid, cache, documents=None, rows=None, rope=None, causal=False):
        attention = self.self_attn(self.input_layernorm(x), positions, valid, cache, documents, rows, rope, causal)
        return attention, self.mlp(self.post_attention_layernorm(x + attention))

    def decode_static(self, x, rope, state: StaticDecodeState):
        """(attention, MLP) of every row of a fixed-shape decode step (static_decode.py): the attention appends
        to ``state``'s buffers of this layer; MoE runs every expert (no device read decides which)."""
        attention = self.self_attn.decode_static(self.input_layernorm(x), rope, state)
        normed = self.post_attention_layernorm(x + attention)
        return attention, self.mlp(normed, every_expert=True) if self.config.is_moe else self.mlp(normed)

    def forward(self, x, positions, valid, cache=None, carried_bias=None, rule="threshold", routes_one=False,
                documents=None, rope=None, routed=None, causal=False, in_place=False, batched_attention=False):
        """Returns (x, token-choice bias after this layer or None for a dense layer). ``documents``:
        the document of each token of a packed input (attention stays inside it). ``causal``: a pass
        with nothing cached before it and no padding (:meth:`XModAttention.forward`).

        ``routes_one``: a decode step (one new token per sequence) known to route at least one of them
        here (:meth:`XModModel._decode_sparse_run`): the batch takes the static one-entry shape
        without reading the selection back from the device. ``routed``: ``(selected, rows, row_index)`` of a
        decode step whose routing the model decided already (:meth:`_forward_routed`). ``in_place``: the caller
        owns ``x`` and needs no gradient: the residual update is written into ``x`` (a sparse layer's routed
        rows without a copy of every row). ``batched_attention``: a pass's threshold-routed tokens of several
        sequences attend in one call (:meth:`_forward_ragged`)."""
        if routed is not None:
            return self._forward_routed(x, positions, valid, cache, carried_bias, rope, *routed, in_place=in_place)
        if not self.sparse:
            attention, mlp = self._attention_and_mlp(x, positions, valid, cache, documents, rope=rope, causal=causal)
            return (x.add_(attention).add_(mlp) if in_place else x + attention + mlp), None
        cfg = self.config
        logits = self.router_logits(x)  # [b, n]
        carried = None if carried_bias is None else carried_bias.t()
        decision = route(logits.t(), self.sparsity_k, rule, carried, cfg.token_choice_bias_tau,
                         getattr(cfg, "routing_segments", 1))
        bias = update_token_choice_bias(carried, decision.selected, cfg.token_choice_bias_increment).t()
        if decision.topk_indices is not None:
            indices, keep = decision.topk_indices, None
        elif routes_one and x.shape[1] == 1:
            indices, keep = torch.zeros_like(decision.selected, dtype=torch.long), decision.selected
        else:
            first_pass = documents is None and (cache is None or cache.get_seq_length() == 0)
            return self._forward_ragged(x, positions, valid, cache, decision, documents, rope, first_pass,
                                        in_place, batched_attention), bias
        indices = indices.t()  # [b, k]
        keep = torch.ones_like(indices, dtype=torch.bool) if keep is None else keep.t()
        routed = torch.gather(x, 1, indices.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
        if rope is not None:
            rows_of = indices.unsqueeze(-1).expand(-1, -1, rope[0].shape[-1])
            rope = (torch.gather(rope[0], 1, rows_of), torch.gather(rope[1], 1, rows_of))
        attention, mlp = self._attention_and_mlp(routed, torch.gather(positions, 1, indices),
                                                 keep if valid is None else keep & torch.gather(valid, 1, indices), cache,
                                                 None if documents is None else torch.gather(documents, 1, indices),
                                                 rope=rope, causal=causal)
        r = torch.sigmoid(torch.gather(decision.scores.t(), 1, indices)).to(x.dtype)
        # Eq.(7) x + varsigma * r * (a + f), or Eq.(6) x + a + r * f (MoD)
        delta, gate = gated_residual(cfg.routing_family, attention, mlp, r, getattr(self, "gate_scale", None),
                                     keep.to(x.dtype))
        update = gate.unsqueeze(-1) * delta
        rows = indices.unsqueeze(-1).expand(-1, -1, x.shape[-1])
        return (x.scatter_add_(1, rows, update) if in_place else x.scatter_add(1, rows, update)), bias

    def _forward_ragged(self, x, positions, valid, cache, decision, documents, rope, first_pass, in_place=False,
                        batched=False):
        """The threshold rule's routed tokens of a pass, each sequence's own (padding tokens, ``valid``
        False, take no part): the norms, projections and MLP run on all of them packed, so no sequence
        computes padding up to the busiest one's count (at batch 8 a sparse layer's busiest sequence routed
        up to ~3x the mean); attention runs sequence by sequence on its routed tokens (the cache appends
        its entries), or, ``batched`` and nothing cached before this pass, in one attention call over the
        sequences that route a token, padded to the busiest (:meth:`XModAttention.attend_packed`).
        One device read: the routed tokens a sequence. ``first_pass``: nothing cached before this pass and
        one document a row, so each sequence's routed tokens attend causally without a mask."""
        cfg = self.config
        b, n, h = x.shape
        selected = decision.selected.t() if valid is None else decision.selected.t() & valid  # [b, n]
        counts = selected.sum(1).tolist()  # the one device read
        total = sum(counts)
        if total == 0:  # no token of this pass is routed here: nothing to attend, nothing cached
            return x
        # a stable sort of "not routed" puts the routed tokens first, sequence by sequence, in order
        picked = torch.argsort(~selected.reshape(-1), stable=True)[:total]
        tokens = x.reshape(b * n, h).index_select(0, picked)
        token_positions = positions.reshape(-1).index_select(0, picked)
        rope = rotary_tables(cfg, positions, x.dtype) if rope is None else rope
        cos, sin = (t.reshape(b * n, -1).index_select(0, picked) for t in rope)
        token_documents = None if documents is None else documents.reshape(-1).index_select(0, picked)
        normed = self.input_layernorm(tokens)
        if batched and sum(count > 0 for count in counts) > 1 and (cache is None or cache.get_seq_length() == 0):
            # each routed token's place in the [sequences that route, max(counts)] batch: the row of its sequence
            # among those, its rank among the sequence's routed tokens (in the packed order; on the device)
            rows = selected.any(1).cumsum(0) - 1
            slots = (selected.cumsum(1) - 1 + rows[:, None] * max(counts)).reshape(-1).index_select(0, picked)
            attention = self.self_attn.attend_packed(normed, counts, slots, token_positions, (cos, sin),
                                                     token_documents, cache)
        else:
            attention, start = [], 0
            for row, count in enumerate(counts):
                if count:
                    part = slice(start, start + count)
                    attention.append(self.self_attn(
                        normed[None, part], token_positions[None, part], None, cache,
                        None if token_documents is None else token_documents[None, part], rows=[row],
                        rope=(cos[None, part], sin[None, part]), causal=first_pass))
                    start += count
            attention = torch.cat(attention, dim=1)[0]  # [routed tokens, h]
        mlp = self.mlp(self.post_attention_layernorm(tokens + attention))
        r = torch.sigmoid(decision.scores.t().reshape(-1).index_select(0, picked)).to(x.dtype)
        # Eq.(7) x + varsigma * r * (a + f), or Eq.(6) x + a + r * f (MoD)
        delta, gate = gated_residual(cfg.routing_family, attention, mlp, r, getattr(self, "gate_scale", None))
        update = gate.unsqueeze(-1) * delta
        if in_place:
            x.view(b * n, h).index_add_(0, picked, update)
            return x
        return x.reshape(b * n, h).index_add(0, picked, update).view(b, n, h)

    def _forward_routed(self, x, positions, valid, cache, carried_bias, rope, selected, rows=None, row_index=None,
                        in_place=False):
        """A decode step (one new token a sequence) whose routing is known: ``selected`` ``[b, 1]``, the
        sequences ``rows`` (ascending; ``row_index`` the same on the device; None: all of them).
        Attention and MLP run for those sequences alone, and the cache appends for them alone.
        Returns (x, token-choice bias after this layer)."""
        cfg = self.config
        rope = rotary_tables(cfg, positions, x.dtype) if rope is None else rope
        pick = (lambda t: t) if rows is None else (lambda t: t.index_select(0, row_index))
        routed = pick(x)
        carried = None if carried_bias is None else pick(carried_bias)
        scores = adjusted_logits(self.router_logits(routed), carried, cfg.token_choice_bias_tau)
        # the run-ahead routes no padding token: the routed rows are valid
        attention, mlp = self._attention_and_mlp(routed, pick(positions), None, cache, rows=rows,
                                                 rope=tuple(pick(t) for t in rope))
        delta, gate = gated_residual(cfg.routing_family, attention, mlp, torch.sigmoid(scores).to(x.dtype),
                                     getattr(self, "gate_scale", None))
        update = gate.unsqueeze(-1) * delta
        if in_place:
            x = x.add_(update) if rows is None else x.index_add_(0, row_index, update)
        else:
            x = x + update if rows is None else x.index_add(0, row_index, update)
        return x, update_token_choice_bias(carried_bias, selected, cfg.token_choice_bias_increment)


class XModPreTrainedModel(PreTrainedModel):
    config_class = XModHFConfig
    base_model_prefix = "model"
    _no_split_modules = ["XModDecoderLayer"]
    # The MoE router state decides routing by comparisons (Top-p threshold, expert bias): fp32 whatever
    # the load dtype, as megatron keeps it (its router also computes in fp32 from these weights).
    _keep_in_fp32_modules_strict = ["mlp.router"]
    supports_gradient_checkpointing = False

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the model makes its own XModCache (generate must not hand it a DynamicCache)

    @torch.no_grad()
    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            module.weight.normal_(0.0, std)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, nn.Embedding):
            module.weight.normal_(0.0, std)
        elif isinstance(module, XModRMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, XModMoERouter):
            module.weight.normal_(0.0, std)
            for name, value in (("expert_bias", 0.0), ("dtopp_threshold", 0.25), ("dtopp_integral", 0.0),
                                ("drn_scale", self.config.moe_routing_norm_theta)):
                if getattr(module, name, None) is not None:
                    getattr(module, name).fill_(value)
        elif isinstance(module, XModDecoderLayer) and getattr(module, "gate_scale", None) is not None:
            module.gate_scale.fill_(1.0)


class XModModel(XModPreTrainedModel):
    def __init__(self, config: XModHFConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(XModDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = XModRMSNorm(config.hidden_size, config.rms_norm_eps)
        self._sparse_run_end = {first: end for first, end in self.sparse_runs()}
        # Decode steps skip the sparse layers that route none of the new tokens (_decode_sparse_run);
        # False runs every sparse layer's own routing at every step (the path before it, for comparison).
        self.decode_skips_unrouted = True
        # How a pass's threshold-routed tokens of several sequences attend in a sparse layer: "batched" (one
        # call over the sequences that route a token, padded to the busiest: one launch a layer, what a GPU pays
        # for), "per_sequence" (one call a sequence: no padding's FLOPs, what a CPU pays for), "auto": batched on CUDA
        self.prefill_attention = "auto"
        # The last fixed-shape decode's buffers and CUDA graph (static_decode.py), refilled by the next
        # generation where they fit it, as transformers keeps a model's static cache; None drops the model's
        # reference (the cache that holds the state keeps it). Not copied or pickled with the model.
        self.static_decode_state: Optional[StaticDecodeState] = None
        self.post_init()

    def __getstate__(self):
        state = dict(super().__getstate__())
        state["static_decode_state"] = None  # device buffers and a CUDA graph: a copy starts without them
        return state

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                use_cache=None, routing_rule=None, **kwargs):
        """Returns (hidden states after the final norm, cache or None)."""
        cfg = self.config
        cache = kwargs.pop("past_key_values", None) if cache is None else cache
        rule = routing_rule or cfg.routing_rule
        if rule not in ("threshold", "topk"):
            raise ValueError(f"routing_rule: {rule!r} is not one of threshold, topk")
        if self.prefill_attention not in PREFILL_ATTENTION:
            raise ValueError(f"prefill_attention: {self.prefill_attention!r} is not one of "
                             f"{', '.join(PREFILL_ATTENTION)}")
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        batched = self.prefill_attention == "batched" or (self.prefill_attention == "auto" and x.is_cuda)
        # Without autograd the layers write their residual updates into x (a sparse layer's routed rows, not
        # a copy of all of them a layer): x must be the model's own
        in_place = not torch.is_grad_enabled()
        if in_place and inputs_embeds is not None:
            x = inputs_embeds.clone(memory_format=torch.contiguous_format)
        b, n = x.shape[:2]
        use_cache = cfg.use_cache if use_cache is None else use_cache
        if cache is not None and not isinstance(cache, XModCache):
            if cache.get_seq_length() > 0:
                raise ValueError(f"cache: a routed model needs its own XModCache, got a filled {type(cache).__name__}")
            cache = None
        if rule == "topk":
            if cache is not None and cache.get_seq_length() > 0:
                raise ValueError("routing_rule: topk ranks every token of a sequence at once, so it cannot decode "
                                 "incrementally; generate with routing_rule='threshold'")
            if attention_mask is not None and not bool(attention_mask.all()):
                raise ValueError("routing_rule: topk ranks all tokens of each sequence, padding included; score "
                                 "unpadded sequences or use routing_rule='threshold'")
            cache, use_cache = None, False
        if use_cache and cache is None:
            cache = XModCache(cfg)
        elif not use_cache:
            cache = None
        past = cache.get_seq_length() if cache is not None else 0
        valid = None  # which new tokens are not padding; None: all of them
        if attention_mask is not None:
            if attention_mask.dim() != 2:
                raise ValueError("attention_mask: a 2-D [batch, past + new tokens] padding mask is expected")
            valid = attention_mask[:, -n:].bool()
            if past == 0 and n > 1 and bool(valid.all()):  # a prefill's one read: no padding, no masks to build
                valid = None
        documents = None
        if position_ids is None:
            if attention_mask is not None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -n:]
            else:
                position_ids = torch.arange(past, past + n, device=x.device).expand(b, n)
        elif past == 0 and n > 1:
            documents = packed_documents(position_ids)
            if documents is not None:  # several documents in a row: scored one by one, nothing to decode from
                cache, documents = None, documents.expand(b, n)
        position_ids = position_ids.expand(b, n)
        if cache is not None and cache.static is not None and not (n == 1 and rule == "threshold"):
            raise ValueError("cache: a fixed-shape cache (max_cache_len) decodes one token a step with the threshold "
                             f"rule after its prefill, got {n} tokens ({rule}); start a new XModCache for a new prompt, "
                             "or use one without max_cache_len (assisted decoding, several tokens a pass)")
        if cache is not None and cache.max_cache_len is not None and n == 1 and past > 0 and rule == "threshold":
            if input_ids is None:
                raise ValueError("inputs_embeds: a fixed-shape decode step (XModCache(max_cache_len=...)) takes "
                                 "input_ids; decode with a cache without max_cache_len to pass embeddings")
            state = cache.static or cache.static_state(one_device=len({p.device for p in self.parameters()}) == 1,
                                                       reuse=self.static_decode_state, model=self)
            self.static_decode_state = state  # the next generation refills it: its buffers and graph are kept
            hidden = state.step(self.decode_static, input_ids, position_ids, valid)
            cache.advance(1)
            return hidden.clone(), cache
        if cache is not None:
            cache.begin_pass(b, position_ids, valid)
        rope = rotary_tables(cfg, position_ids, x.dtype)
        # a first pass over one document a row without padding: causal attention without a mask
        causal = past == 0 and n > 1 and documents is None and valid is None
        decoding = self.decode_skips_unrouted and cache is not None and n == 1 and rule == "threshold"
        bias = None  # token-choice bias of this pass's tokens, from the sparse layer just run
        i = 0
        while i < len(self.layers):
            if decoding and self.layers[i].sparse:
                i, x, bias = self._decode_sparse_run(i, x, position_ids, valid, cache, rope, in_place)
                continue
            x, bias = self.layers[i](x, position_ids, valid, cache, bias if cfg.carries_bias(i) else None, rule,
                                     documents=documents, rope=rope, causal=causal, in_place=in_place,
                                     batched_attention=batched)
            i += 1
        if cache is not None:
            cache.advance(n)
        return self.norm(x), cache

    def decode_static(self, state: StaticDecodeState) -> torch.Tensor:
        """One decode step on ``state``'s fixed buffers (static_decode.py): no host read outside
        ``state.branch``, no shape that depends on the routing. Each sparse layer decides on the device
        and runs attention and MLP under ``state.branch`` (skipped when it routes no token of the batch);
        the routed rows get the gated update, the others keep x. Returns the hidden states after the final
        norm ``[b, 1, h]``."""
        cfg = self.config
        x = self.embed_tokens(state.input_ids)
        rope = rotary_tables(cfg, state.positions, x.dtype)
        bias = None  # token-choice bias [b, 1] of the sparse layer just run
        for i, layer in enumerate(self.layers):
            carried = bias if cfg.carries_bias(i) else None
            if not layer.sparse:
                attention, mlp = layer.decode_static(x, rope, state)
                x = x + attention + mlp
                bias = None
                continue
            decision = route(layer.router_logits(x).t(), layer.sparsity_k, "threshold",
                             None if carried is None else carried.t(), cfg.token_choice_bias_tau)
            scores, routed = decision.scores.t(), decision.selected.t() & state.valid  # [b, 1]
            state.branch(routed.any(), functools.partial(self._decode_static_sparse, layer, state, x, rope, scores, routed))
            bias = update_token_choice_bias(carried, decision.selected.t(), cfg.token_choice_bias_increment)
        state.column.add_(1)
        return self.norm(x)

    def _decode_static_sparse(self, layer, state: StaticDecodeState, x, rope, scores, routed) -> None:
        """A sparse layer's attention and MLP for every row of a fixed-shape decode step; the gated update
        goes into the routed rows of ``x`` (in place), and ``state`` keeps their cache entries."""
        attention, mlp = layer.decode_static(x, rope, state)
        delta, gate = gated_residual(self.config.routing_family, attention, mlp, torch.sigmoid(scores).to(x.dtype),
                                     getattr(layer, "gate_scale", None), routed.to(x.dtype))
        x.add_(gate.unsqueeze(-1) * delta)
        state.advance_sparse(layer.layer_idx, routed)

    def sparse_runs(self) -> list[tuple[int, int]]:
        """(first, end) of every run of consecutive sparse layers (one token-choice-bias chain each)."""
        runs, kinds = [], [layer.sparse for layer in self.layers]
        for i, sparse in enumerate(kinds):
            if sparse and (i == 0 or not kinds[i - 1]):
                end = i
                while end < len(kinds) and kinds[end]:
                    end += 1
                runs.append((i, end))
        return runs

    def _decode_sparse_run(self, start: int, x, positions, valid, cache, rope, in_place=False):
        """One decode step through the sparse layers ``start`` .. end of its run; returns (end, x, bias).

        A layer that routes none of the new tokens leaves x and the token-choice bias as they were, so
        the router scores of every remaining layer of the run, up to the first one that routes a token,
        are those of the same x: one matmul scores them all and one device read (the only host sync of
        a run without routed tokens) tells the host, for each sequence and layer left, routed / not /
        too close to call; the layers before the first that may route run nothing, not even their
        routers, and that layer runs attention and MLP for the sequences it routes only. The decision
        stays the layer's own: the matmul's scores may differ from the layer's router in the last bits
        (another summation order), so a token counts as routed or not only when its score is beyond 0
        by more than a bound on that difference; when one is that close to 0 the layer runs its own
        routing for the whole batch."""
        end = self._sparse_run_end[start]
        weight, weight_abs, router_bias, router_bias_abs = self._router_stacks(start, end)
        tau, bias, i = self.config.token_choice_bias_tau, None, start  # bias [b, 1]: None until a layer routes
        b, h = x.shape[0], x.shape[-1]
        while i < end:
            x32 = x[:, 0].float()  # [b, h]
            logits = F.linear(x32, weight[i - start:], router_bias[i - start:])  # [b, layers left]
            scores = logits if bias is None or tau == 0 else logits - tau * bias
            bound = F.linear(x32.abs(), weight_abs[i - start:], router_bias_abs[i - start:])
            margin = run_ahead_margin(logits, scores, bound, router_bias[i - start:], h, x.dtype)
            # 2: routed, 1: too close to call, 0: not routed (or padding)
            state = (scores >= -margin).to(torch.int8) + (scores >= margin)
            state = state if valid is None else state * valid
            states = state.tolist()  # the one device read
            columns = [max(column) for column in zip(*states)]
            first = next((j for j, top in enumerate(columns) if top > 0), None)
            if first is None:
                break
            i += first
            layer = self.layers[i]
            column = [row[first] for row in states]
            if 1 in column:  # a score within rounding of 0: the layer's own routing decides
                x, bias = layer(x, positions, valid, cache, bias, "threshold", routes_one=2 in column, rope=rope,
                                in_place=in_place)
            else:
                selected = state[:, first:first + 1] == 2
                rows = [r for r in range(b) if column[r] == 2]
                if len(rows) == b:
                    routed = (selected, None, None)
                else:  # their indices on the device without a read: the state there is 2 (routed) or 0
                    routed = (selected, rows, torch.topk(state[:, first], len(rows)).indices.sort().values)
                x, bias = layer(x, positions, valid, cache, bias, rope=rope, routed=routed, in_place=in_place)
            i += 1
        return end, x, bias

    def _router_stacks(self, start: int, end: int):
        """The routers of layers start..end as one fp32 [layers, h] weight and [layers] bias, and their absolute values."""
        weight = torch.cat([self.layers[i].router.weight for i in range(start, end)]).float()
        router_bias = torch.cat([self.layers[i].router.bias for i in range(start, end)]).float()
        return weight, weight.abs(), router_bias, router_bias.abs()


def run_ahead_margin(logits, scores, bound, router_bias, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """How far the decode run-ahead's fp32 score of a layer may lie from the layer's own
    (:meth:`XModDecoderLayer.router_logits`: x w rounded to ``dtype``, the bias and s - tau b in fp32): the
    matmuls' summation (relative to |W||x| + |bias|, twice h fp32 ulps), the rounding of x w to ``dtype``
    (at most eps/2 of it: one eps here) and the fp32 additions (relative to the logit and the score).
    Measured in bf16 and fp16 (tests/test_hf_decode.py): the difference stays within half of it."""
    rounding = torch.finfo(dtype).eps
    return (2 * hidden * 2.0 ** -24 * bound + rounding * (logits - router_bias).abs()
            + 2.0 ** -22 * (logits.abs() + scores.abs()))


class XModForCausalLM(XModPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: XModHFConfig):
        super().__init__(config)
        self.model = XModModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """``generate`` starts with an XModCache (its default, transformers' DynamicCache, cannot hold a sparse
        layer's entries): assisted decoding needs the cache before the first pass, to crop rejected drafts.
        ``cache_implementation="static"``: the fixed-shape decode (static_decode.py), for greedy search and
        sampling, sized by ``generate``'s ``max_cache_length`` (the tokens ever fed to the model)."""
        if model_kwargs.get(_CACHE_FIELD) is None and generation_config.use_cache is not False:
            implementation = getattr(generation_config, "cache_implementation", None)
            if implementation == "static":
                mode = kwargs.get("generation_mode", args[0] if args else None)
                if mode is not None and str(getattr(mode, "value", mode)) not in ("greedy_search", "sample"):
                    raise ValueError(f"cache_implementation: 'static' (the fixed-shape decode) serves greedy search "
                                     f"and sampling; {getattr(mode, 'value', mode)} needs the default XModCache: "
                                     "drop cache_implementation")
                length = kwargs.get("max_cache_length", args[2] if len(args) > 2 else generation_config.max_length)
                model_kwargs[_CACHE_FIELD] = XModCache(self.config, max_cache_len=int(length))
                return None
            if implementation is not None:
                warnings.warn(f"cache_implementation: a routed model generates with its XModCache (or, with "
                              f"'static', its fixed-shape decode); {implementation!r} is ignored", stacklevel=2)
            model_kwargs[_CACHE_FIELD] = XModCache(self.config)
            return None
        return super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                labels=None, use_cache=None, routing_rule=None, logits_to_keep=0, return_dict=None, **kwargs):
        """``routing_rule``: "threshold" (default of the config; causal, what generation uses) or "topk"."""
        cache = kwargs.pop("past_key_values", None) if cache is None else cache
        hidden, cache = self.model(input_ids, attention_mask, position_ids, cache, inputs_embeds, use_cache, routing_rule)
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1),
                                   ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: cache})

    def sparse_cache_bytes(self, cache: XModCache) -> dict:
        """Bytes held by ``cache`` (see :meth:`XModCache.nbytes`)."""
        return cache.nbytes()
