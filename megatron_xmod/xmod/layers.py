"""Sparse (routed) transformer layers for MoD (Eq.6) and X-MoD (Eq.7) as megatron TransformerLayers.

A sparse layer is a standard megatron ``TransformerLayer`` (same submodules, same specs, same
checkpoint keys) plus a d->1 router and, for X-MoD, the learnable gate scale varsigma. Its forward
gathers the routed tokens with their original positions, runs the layer's own attention (causal
among routed tokens only, RoPE at the real positions; with megatron's document mask of
--reset-attention-mask, among the routed tokens of the token's own document) and MLP on that
subsequence, and scatters the gated update back; every other token passes through bit-identical.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import sys
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.utils import make_viewless_tensor

from megatron_xmod.xmod.config import check_cuda_graph_compatibility, check_routing_compatibility
from megatron_xmod.xmod.kernels import routing_step
from megatron_xmod.xmod.permute import ResidualGrad, gather_tokens, scatter_gated, selected_backend
from megatron_xmod.xmod.permute import reference as reference_permute
from megatron_xmod.xmod.permute.reference import StreamGrad
from megatron_xmod.xmod.routing import (
    SparseLayerRouting,
    capacity_selection,
    context_parallel_width,
    gated_residual,
    jaccard_tensor,
    router_bce_loss,
    topk_count,
)
from megatron_xmod.xmod.routing_state import RoutingState, flat_rows, recompute_phase, router_logits


class SDPAttention(DotProductAttention):
    """Core attention for the local (non-TransformerEngine) path on torch SDPA.

    megatron's local ``DotProductAttention`` materialises the full [b, heads, s, s] score matrix, which
    rules out the paper's L = 32k on GPU; SDPA dispatches to flash / memory-efficient kernels there and
    to the math kernel on CPU. Same constructor and forward contract as DotProductAttention, and it
    takes megatron's packed sequences (THD, ``packed_seq_params``), which DotProductAttention refuses:
    causal attention inside each document of ``cu_seqlens``, through an explicit [t, t] mask (the CPU
    and test path; GPU runs of packed sequences use TransformerEngine's varlen kernels).

    Context parallelism (``context_parallel_size`` C > 1) with megatron's semantics for this path (on GPU
    TransformerEngine's attention implements them; this class lets dense and routed layers run under CP
    without it): every rank holds its rows of megatron's load-balanced layout (:func:`load_balanced_positions`),
    the keys and values are all-gathered over the CP group (the backward reduce-scatters their
    gradients) and a query attends causally by real sequence position. An explicit ``attention_mask``
    is then [b or 1, 1, sq, C*sk] over the gathered keys, in rank order (a routed layer builds one for
    its routed tokens, XModSparseLayer._context_parallel_batch)."""

    def __init__(self, config, *args, pg_collection=None, **kwargs):
        # megatron's DotProductAttention refuses context parallelism (only TransformerEngine's implements
        # it there); this class implements it itself, so the parent is built at CP 1 and the real config kept.
        parent = config
        if config.context_parallel_size > 1:
            parent = copy.copy(config)
            parent.context_parallel_size = 1
        super().__init__(parent, *args, pg_collection=pg_collection, **kwargs)
        self.config = config
        self.cp_group = context_parallel_group(config, pg_collection)

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
        packed = packed_seq_params is not None
        if packed:  # THD: [t, heads, d], the micro-batch's documents one after another
            if self.cp_group is not None:
                raise ValueError("packed_seq_params: packed sequences under context parallelism need TransformerEngine "
                                 "attention; use --reset-attention-mask (document masks) with --transformer-impl local")
            query, key, value = (t.unsqueeze(1) for t in (query, key, value))
            attention_mask = packed_document_mask(packed_seq_params, query.shape[0])
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
        if self.cp_group is not None:
            key, value, attention_mask = self._context_parallel_keys(key, value, attention_mask, mask_type)
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
        return context.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)  # THD: [t, 1, h]

    def _context_parallel_keys(self, key, value, attention_mask, mask_type):
        """Keys and values of the whole CP group ([C*sk, b, groups, d], rank order) and the mask over them:
        the given one, or causal by position in megatron's load-balanced layout (no mask: no causal type)."""
        group = self.cp_group
        key, value = (gather_from_sequence_parallel_region(t, tensor_parallel_output_grad=True, group=group)
                      for t in (key, value))
        if attention_mask is None and mask_type == AttnMaskType.causal:
            attention_mask = _load_balanced_causal_mask(key.shape[0], group.size(), group.rank(), str(key.device))
        return key, value, attention_mask


def context_parallel_group(config, pg_collection=None):
    """The CP process group of a layer built with ``config`` (None at context_parallel_size 1)."""
    if config.context_parallel_size <= 1:
        return None
    group = getattr(pg_collection, "cp", None)
    return group if group is not None else parallel_state.get_context_parallel_group()


@functools.lru_cache(maxsize=64)
def load_balanced_positions(seq_len: int, cp_size: int, device: str = "cpu") -> torch.Tensor:
    """[C, L/C] int64: the sequence positions of each CP rank's rows in megatron's load-balanced layout
    (megatron.core.utils.get_batch_on_this_cp_rank: 2C chunks, rank r holding chunks r and 2C-1-r, so
    that every rank gets the same causal attention work). Cached: a constant of (L, C, device)."""
    if seq_len % (2 * cp_size):
        raise ValueError(f"seq_length: context parallelism splits a sequence into 2 x context_parallel_size = "
                         f"{2 * cp_size} equal chunks, {seq_len} tokens do not; use a multiple of {2 * cp_size}")
    chunk = seq_len // (2 * cp_size)
    ranks = torch.arange(cp_size, device=device)
    chunks = torch.stack([ranks, 2 * cp_size - 1 - ranks], 1)  # [C, 2]
    return (chunks.unsqueeze(-1) * chunk + torch.arange(chunk, device=device)).reshape(cp_size, -1)


@functools.lru_cache(maxsize=64)
def _sequence_order(seq_len: int, cp_size: int, device: str) -> torch.Tensor:
    """[L]: the row of the rank-order gathered sequence that holds each position (the inverse layout)."""
    return torch.argsort(load_balanced_positions(seq_len, cp_size, device).reshape(-1))


@functools.lru_cache(maxsize=16)
def _load_balanced_causal_mask(keys: int, cp_size: int, rank: int, device: str) -> torch.Tensor:
    """[1, 1, L/C, L] megatron's mask (True = masked) of rank ``rank``'s queries over the gathered keys."""
    positions = load_balanced_positions(keys, cp_size, device)
    return (positions.reshape(1, -1) > positions[rank].unsqueeze(1)).view(1, 1, keys // cp_size, keys)


def gather_context_parallel(x: torch.Tensor, group) -> torch.Tensor:
    """This CP rank's rows ``x`` [L/C, ...] of megatron's load-balanced layout -> the whole sequence
    [L, ...] in position order, on every rank of ``group``; the backward hands each rank the summed
    gradient of its own rows (all-gather, reduce-scatter)."""
    gathered = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True, group=group)
    return gathered.index_select(0, _sequence_order(gathered.shape[0], group.size(), str(x.device)))


def _num_microbatches() -> int:
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    try:
        return get_num_microbatches()
    except AttributeError:  # no calculator outside megatron's training loop: one micro-batch
        return 1


class RouterLossAutoScaler(torch.autograd.Function):
    """Attach the router BCE loss to the layer output so that it is back-propagated with the LM loss.

    megatron's MoEAuxLossAutoScaler gets its scale from the pipeline schedule only for MoE models;
    this one derives the same scale itself, so the layer works unchanged inside any megatron
    training loop: the fp16 loss scale, and either 1 / number of micro-batches (losses averaged
    per micro-batch) or the micro-batch's token count (``calculate_per_token_loss``: megatron sums
    the LM loss over tokens and divides the gradients by the global token count at the end, so a
    per-token mean must be turned back into a sum, as megatron does for its MoE auxiliary losses).
    """

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux_loss: torch.Tensor, config, num_tokens: int,
                state: Optional[RoutingState] = None) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        ctx.config, ctx.num_tokens, ctx.state = config, num_tokens, state
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        """d aux_loss (any shape: the loss is the sum of its elements) = the scale."""
        (aux_loss,) = ctx.saved_tensors
        config = ctx.config
        if config.grad_scale_func is None and ctx.state is not None:
            # A known number: the routing state's cached device constant, expanded (a view), no launch.
            value = ctx.num_tokens if config.calculate_per_token_loss else 1.0 / _num_microbatches()
            return grad_output, ctx.state.constant(value, aux_loss.device).expand_as(aux_loss), None, None, None
        scale = torch.ones_like(aux_loss)
        if config.grad_scale_func is not None:
            scale = config.grad_scale_func(scale)
        if config.calculate_per_token_loss:
            scale = scale * ctx.num_tokens
        else:
            scale = scale / _num_microbatches()
        return grad_output, scale, None, None, None


def packed_documents(packed_seq_params, tokens: int):
    """(document id [t], position inside its document [t]) of the ``tokens`` of megatron's packed
    sequences (THD: ``cu_seqlens``, the padded ones when given, as megatron's RoPE reads them)."""
    cu = packed_seq_params.cu_seqlens_q_padded
    cu = packed_seq_params.cu_seqlens_q if cu is None else cu
    cu = cu.to(torch.long)
    positions = torch.arange(tokens, device=cu.device)
    ids = torch.searchsorted(cu[1:], positions, right=True)
    return ids, positions - cu[ids]


def packed_document_mask(packed_seq_params, tokens: int) -> torch.Tensor:
    """megatron's mask (True = masked) [1, 1, t, t] of packed sequences: causal inside each document."""
    ids, _ = packed_documents(packed_seq_params, tokens)
    causal = torch.ones(tokens, tokens, dtype=torch.bool, device=ids.device).tril()
    return ~(causal & (ids.unsqueeze(1) == ids.unsqueeze(0))).view(1, 1, tokens, tokens)


def _gather_positions(rotary_pos_emb, indices: torch.Tensor):
    """RoPE frequencies ``[s, 1, 1, d]`` -> per-sequence ``[k, b, 1, d]`` at the routed positions."""
    if rotary_pos_emb is None:
        return None
    if isinstance(rotary_pos_emb, tuple):
        return tuple(_gather_positions(freqs, indices) for freqs in rotary_pos_emb)
    return rotary_pos_emb[:, 0, 0][indices].unsqueeze(2)


def _routed_document_mask(document_mask: Optional[torch.Tensor], indices: torch.Tensor):
    """The attention mask of a routed batch, megatron's convention (True = masked), [b, 1, k, k]; None
    (no ``document_mask``): plain causal, the core attention's own mask type.

    A routed batch lists each sequence's routed tokens in position order, then any padding (the threshold
    rule's, capacity_selection; sequence parallelism's end padding), so causal order alone keeps real
    tokens causal and blind to the padding. ``document_mask`` is megatron's [b or 1, 1, s, s] mask of the
    whole sequence (e.g. the block-diagonal causal mask of --reset-attention-mask): a routed token at
    position ``indices[q, j]`` then also sees only the routed keys ``indices[:, j]`` that mask allows it.
    A token always sees itself, so no row is all masked (SDPA would return NaN there): a routed token
    that is the first routed one of its document attends to itself only."""
    if document_mask is None:
        return None
    k = indices.shape[0]
    eye = torch.eye(k, dtype=torch.bool, device=indices.device)
    allowed = torch.ones(k, k, dtype=torch.bool, device=indices.device).tril().unsqueeze(0)  # [1, k, k]
    allowed = allowed & ~_gather_document_mask(document_mask, indices)
    return ~(allowed | eye).unsqueeze(1)


def _document_mask(attention_mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The mask a routed layer applies among its routed tokens: megatron's ``attention_mask``, except
    in a megatron training run without --reset-attention-mask. There the dataloader's mask (megatron
    creates one unless --no-create-attention-mask-in-dataloader) is the plain causal mask that every
    core attention applies itself: it is dropped, so SDPA keeps its causal kernels and backends that
    ignore explicit masks (TransformerEngine's causal type) keep working. Outside megatron's training
    loop (no parsed arguments) a given mask is always applied."""
    if attention_mask is None:
        return None
    global_vars = sys.modules.get("megatron.training.global_vars")
    args = getattr(global_vars, "_GLOBAL_ARGS", None)
    if args is not None and not getattr(args, "reset_attention_mask", False):
        return None
    return attention_mask


def _gather_document_mask(document_mask: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """megatron's [b or 1, 1, s, s] mask (True = masked) at the routed positions ``indices`` [k, b]:
    [b, k, k], rows the routed queries, columns the routed keys of the same sequence. A 1-D
    ``document_mask`` is the positions' document ids instead (packed sequences, :func:`packed_documents`):
    masked where query and key lie in different documents."""
    if document_mask.dim() == 1:
        ids = document_mask[indices.t()]  # [b, k]
        return ids.unsqueeze(2) != ids.unsqueeze(1)
    if document_mask.dim() != 4 or document_mask.shape[1] != 1 or document_mask.shape[2] != document_mask.shape[3]:
        raise ValueError(f"attention_mask: routed layers take megatron's [b, 1, s, s] mask, got shape "
                         f"{tuple(document_mask.shape)}; pass a [b or 1, 1, s, s] boolean mask (True = masked)")
    positions = indices.t()  # [b, k]
    return _mask_at(document_mask, positions, positions)


def _mask_at(document_mask: torch.Tensor, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """megatron's mask [b or 1, 1, sq, sk] at the query rows ``queries`` [b, q] and key columns ``keys``
    [b, k] of each sequence: [b, q, k], read element by element (no [b, q, sk] intermediate)."""
    batch = queries.shape[0]
    sequence = torch.arange(batch, device=queries.device) if document_mask.shape[0] > 1 else \
        torch.zeros(batch, dtype=torch.long, device=queries.device)
    return document_mask[:, 0].bool()[sequence.view(-1, 1, 1), queries.unsqueeze(2), keys.unsqueeze(1)]


def _context_parallel_document_mask(document_mask: torch.Tensor, rows: torch.Tensor, rank: int,
                                    cp_len: int) -> torch.Tensor:
    """megatron's mask of this CP rank's queries ([b or 1, 1, L/C, L], key columns in the gathered rank order)
    at the routed batches ``rows`` [w, C, b] (every rank's rows of its own slice): [b, w, C*w], rows this
    rank's routed queries, columns every rank's routed keys in rank order (True = masked)."""
    cp, batch = rows.shape[1], rows.shape[2]
    if document_mask.dim() != 4 or document_mask.shape[1] != 1 or tuple(document_mask.shape[2:]) != (cp_len, cp_len * cp):
        raise ValueError(f"attention_mask: a routed layer under context parallelism takes this rank's rows of "
                         f"megatron's mask, [b, 1, {cp_len}, {cp_len * cp}], got shape {tuple(document_mask.shape)}; "
                         "split the batch with megatron_xmod.training.step.context_parallel_batch")
    offsets = torch.arange(cp, device=rows.device).view(1, cp, 1) * cp_len
    keys = (rows + offsets).permute(2, 1, 0).reshape(batch, -1)  # [b, C*w]: rank c's row j at c*w + j
    return _mask_at(document_mask, rows[:, rank].t(), keys)


def plain_routed_rows(layer: XModSparseLayer, routed, indices, gate, rotary_pos_emb):
    """``layer``'s top-k update of its routed rows in plain torch ops: gate * delta [k*b, h] of the gathered
    rows ``routed`` [k*b, h] at positions ``indices`` [k, b] (sequence order), as ``_routed_update`` computes
    it without sequence or context parallelism, padding or a document mask; ``gate``: the routing step's
    [k, b] (varsigma included). What ``--xmod-compile-layers`` compiles (megatron_xmod.xmod.compile): the
    rows are gathered and the update added to the residual stream outside (``_routed_update_in_place``)."""
    k, b = indices.shape
    attention, mlp = layer._attention_and_mlp(routed.view(k, b, -1), _gather_positions(rotary_pos_emb, indices))
    delta, gate = gated_residual(layer.routing.family, attention, mlp, gate.to(routed.dtype))
    return (gate.unsqueeze(-1) * delta).view(k * b, -1)


def _stream_and_rows(hidden_states, rows, stream_grad: StreamGrad, logits):
    """(the residual stream an in-place update writes, its flat rows ``rows`` read for the update): ``hidden_states``
    itself where it continues the router-input chain (``stream_grad.continues``), else a copy (the chain's first
    layer); ``logits`` orders the router's backward after the rows' where the chain is wired."""
    stream = hidden_states if stream_grad.continues else hidden_states.clone(memory_format=torch.contiguous_format)
    return stream, reference_permute.rows_for_update(stream, rows, stream_grad,
                                                     logits if stream_grad.chain is not None else None)


def _cuda_graphs(config) -> bool:
    return getattr(config, "cuda_graph_impl", "none") not in (None, "none")


class XModSparseLayer(TransformerLayer):
    """``routing`` (spec params) says how this layer routes; ``routing_state`` is the built model
    chunk's :class:`~megatron_xmod.xmod.routing_state.RoutingState`, attached after the build."""

    ROUTING_METRICS = ("selected_fraction", "coverage", "adjacent_jaccard", "router_bce_loss",
                       "eval_selected_fraction", "eval_coverage", "eval_adjacent_jaccard", "nonfinite_router_logits")

    def __init__(self, config, submodules, layer_number: int = 1, *, routing: SparseLayerRouting, **kwargs):
        if not isinstance(routing, SparseLayerRouting):
            raise TypeError(f"routing: expected a SparseLayerRouting in the layer spec params, got {type(routing).__name__}")
        check_cuda_graph_compatibility(config, routing.token_choice_bias_tau_warmup)  # before megatron's graph setup
        super().__init__(config=config, submodules=submodules, layer_number=layer_number, **kwargs)
        check_routing_compatibility(config, routing.token_choice_bias_tau)
        self.routing = routing
        self.routing_state: Optional[RoutingState] = None
        # plain_routed_update compiled (megatron_xmod.xmod.compile, --xmod-compile-layers), shared by the layers
        self.compiled_update = None
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.router = torch.nn.Linear(config.hidden_size, 1, bias=True, device=device, dtype=config.params_dtype)
        with torch.no_grad():
            if config.perform_initialization:
                config.init_method(self.router.weight)
            self.router.bias.zero_()
        if routing.family == "xmod":
            self.gate_scale = torch.nn.Parameter(
                torch.full((1,), float(routing.gate_scale_init), device=device, dtype=config.params_dtype),
                requires_grad=routing.gate_scale_learnable,  # frozen: the fixed-varsigma ablation (same checkpoint keys)
            )
        for param in self._routing_parameters():
            # Replicated on the TP ranks but, under sequence parallelism, fed by this rank's tokens only:
            # megatron all-reduces the gradients of parameters tagged so (as for the layer norms).
            param.sequence_parallel = config.sequence_parallel
        self.cp_group = context_parallel_group(config, getattr(self, "pg_collection", None))
        if self.cp_group is not None and not isinstance(self.self_attention.core_attention, SDPAttention):
            raise ValueError(
                f"context_parallel_size: a routed layer under context parallelism attends among its routed tokens "
                f"with the SDPA core attention, this layer's is {type(self.self_attention.core_attention).__name__}; "
                "build the sparse layers with megatron_xmod's block spec (get_xmod_decoder_block_spec), which gives "
                "them SDPAttention under CP, or use --context-parallel-size 1")

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, context=None, context_mask=None,
                rotary_pos_emb=None, inference_context=None, packed_seq_params=None, **unused):
        if inference_context is not None:
            raise ValueError("inference_context: megatron's inference is not supported by routed layers; export the "
                             "checkpoint (xmod export-hf) and generate with transformers, docs/hf.md")
        attention_mask = _document_mask(attention_mask)
        samples = 1  # sequences the routed rows hold one after another (packed sequences: the micro-batch's)
        if packed_seq_params is not None:
            attention_mask, rotary_pos_emb, samples = self._packed_sequences(packed_seq_params, attention_mask,
                                                                             rotary_pos_emb, hidden_states)
        if attention_mask is not None and not isinstance(self.self_attention.core_attention, SDPAttention):
            raise ValueError(
                f"attention_mask: routed layers apply a document mask (--reset-attention-mask, packed sequences) "
                f"with the SDPA core attention of --transformer-impl local only, this layer's is "
                f"{type(self.self_attention.core_attention).__name__}, which would ignore it; train with "
                "--transformer-impl local, or pass attention_mask=None for plain causal attention")
        state = self.routing_state
        if state is None:
            raise RuntimeError(
                f"routing_state: sparse layer {self.layer_number} has no routing state; build the model with "
                "megatron_xmod's builders, or call megatron_xmod.xmod.routing_state.attach_routing_state(model) after "
                "building it")
        routing = self.routing
        seq_len, batch = hidden_states.shape[:2]
        seq_len *= self._sequence_shards() * self._cp_size()  # under SP and CP routing ranks the whole sequence
        phase = recompute_phase(self.training)  # "first" / "replay" under full recompute, else None
        rule = "topk" if self.training else state.eval_rule
        # The top-k update in plain torch ops (compiled, the torch permutation backend: CPU, or sequence
        # parallelism's, on every device) adds its rows to the block's residual stream in place
        # (_routed_update_in_place, _routed_update_sequence_parallel); the kernel backends' fused gated scatter
        # writes a new stream, and so does sequence parallelism under CUDA graphs (not verified on a GPU). Not
        # in full recompute's first pass: megatron's checkpoint keeps each chunk's input for the replay, which a
        # later layer would otherwise write into.
        in_place_sp = self.config.sequence_parallel and not _cuda_graphs(self.config)
        stream_grad = StreamGrad() if (rule == "topk" and phase != "first" and attention_mask is None and samples == 1
                                       and self.cp_group is None
                                       and (in_place_sp or self.compiled_update is not None
                                            or selected_backend(hidden_states) == "torch")) else None
        # [s, b] x w over the whole sequence (the routing step adds the bias), and x as the routed update reads it
        logits, chain, routed_input = self._router_logits(hidden_states, stream_grad)
        carried_bias, previous_selected = self._take_bias(state, (seq_len, batch), phase)
        tau = routing.effective_tau(state.iteration)  # during a training run the warm-up's value, else the full tau
        # Eq.(8) adjustment, top-k in position order, bias update: one fused kernel on GPU (megatron_xmod.xmod.kernels).
        # It writes into the routing state's buffers itself (a recompute replay writes none of them): the
        # updated bias (in place) and, under top-k, the routed set and the call's statistics.
        # The router's bias and varsigma enter the step, whose backward sums their gradients in its one launch.
        step = routing_step(logits, routing.sparsity_k, rule, carried_bias, tau, routing.token_choice_bias_increment,
                            segments=routing.routing_segments * samples, router_bias=self.router.bias,
                            gate_scale=self._gate_scale(),
                            **self._step_destinations(state, rule, phase, (seq_len, batch), previous_selected,
                                                      logits.device))
        decision, bias, gate = step.decision, step.bias, step.gate
        if state.observers:  # the routing report reads the router's logits, bias included
            state.observe(self.layer_number, logits + self.router.bias.float(), decision)

        indices = decision.topk_indices
        written = None  # the flat rows an in-place update read and wrote, in the order of its gathered rows
        if stream_grad is not None and self.config.sequence_parallel:
            output, routed, written = self._routed_update_sequence_parallel(
                hidden_states, indices, decision.scores, rotary_pos_emb, gate=gate, stream_grad=stream_grad, logits=logits)
        elif stream_grad is not None:
            output, routed = self._routed_update_in_place(hidden_states, indices, step.flat_rows, gate, rotary_pos_emb,
                                                          stream_grad, logits)
        elif indices is not None:
            output, routed = self._routed_update(routed_input, indices, decision.scores, rotary_pos_emb,
                                                 gate=gate, document_mask=attention_mask)
        else:
            # The threshold rule (evaluation) selects a different number of tokens per sequence: batch them
            # at the pass's static capacity (the decoder checks for overflow once, RoutingState.eval_capacity)
            # or at the exact largest selection (one host read), real tokens first, padding last.
            capacity = state.eval_capacity(self.layer_number, seq_len, routing.sparsity_k, logits.device)
            indices, valid, width = capacity_selection(decision.selected, capacity)
            state.note_width(self.layer_number, width)
            output, routed = (hidden_states, None) if indices is None else self._routed_update(
                routed_input, indices, decision.scores, rotary_pos_emb, valid, document_mask=attention_mask)

        if self.training and routing.router_bce_coeff > 0:
            loss, bce = step.router_loss, None  # the routing step's (coeff * BCE; recorded already), if it has it
            if loss is None:  # sequence parallel, or statistics paused: the BCE in torch ops
                bce = router_bce_loss(decision.scores, decision.selected)
                loss = routing.router_bce_coeff * self._local_share(bce, decision)
                if phase != "replay":
                    state.record_values(self.layer_number, ("router_bce_loss",), [bce], microbatch_loss=bce)
            output = RouterLossAutoScaler.apply(output, loss, self.config, seq_len * batch, state)
        if phase != "replay":  # a recomputed layer was recorded in its first pass
            if decision.topk_indices is None:  # the threshold rule; top-k's routing step recorded itself
                self._record_metrics(state, decision.scores, decision, bias, previous_selected)
            # bias is the buffer; the routing step wrote the top-k routed set into its buffer too
            state.put_bias(self.layer_number, bias, None if decision.topk_indices is not None else decision.selected)
        # What megatron's TransformerLayer returns: a tensor that is no view (the autoscaler above hands
        # its input back as a view of it, the sequence-parallel path reshapes, a layer that routes nothing
        # returns its input, which may be one). Megatron's pipeline frees a stage's output with deallocate_output_tensor,
        # which refuses a view. Same storage, same values; the router-input chain is handed this object.
        output = make_viewless_tensor(inp=output, requires_grad=output.requires_grad, keep_graph=True)
        if chain is not None:  # the next routed layer of the block rebuilds its router input from these rows
            if written is None:
                flat = step.flat_rows if decision.topk_indices is not None else None  # the routing step's, under top-k
                written = self._written_rows(indices, hidden_states.shape[0], flat)
            # The written rows' values before this layer (backward walks the chain back with them): the
            # gathered routed input itself where it lists exactly those rows, else read from the input.
            before = (routed.detach().reshape(-1, routed.shape[-1]) if routed is not None else
                      hidden_states.detach().reshape(-1, hidden_states.shape[-1]).index_select(0, written))
            state.router_inputs.put(self.layer_number, chain, output, written, before)
        elif stream_grad is not None and not _cuda_graphs(self.config):  # no autograd: the stream is all there is
            state.router_inputs.note_output(self.layer_number, output)
        return output, context

    def _packed_sequences(self, packed_seq_params, attention_mask, rotary_pos_emb, hidden_states):
        """megatron's packed sequences (THD: the micro-batch's samples, and their documents, one after
        another in a [t, 1, h] batch) as this layer routes them: (the tokens' document ids, which
        _routed_document_mask turns into the routed batch's mask; RoPE frequencies at each token's position
        inside its document, as megatron's THD RoPE applies them, indexed by packed position; the number
        of samples, each of which top-k ranks on its own, as in an [s, b] batch)."""
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"packed_seq_params: routed layers take megatron's THD packed sequences, got qkv_format "
                             f"{packed_seq_params.qkv_format!r}")
        if self.cp_group is not None:
            raise ValueError("packed_seq_params: packed sequences under context parallelism are not supported by routed "
                             "layers (megatron balances them per document over the CP ranks); drop "
                             "--dataloader-inter-document-masking and use --reset-attention-mask")
        if attention_mask is not None or hidden_states.shape[1] != 1:
            raise ValueError(f"packed_seq_params: a packed batch is one row [t, 1, h] without an attention mask, got "
                             f"shape {tuple(hidden_states.shape)}" + (" and a mask" if attention_mask is not None else ""))
        tokens = hidden_states.shape[0] * self._sequence_shards()
        ids, inside = packed_documents(packed_seq_params, tokens)
        per_sample = packed_seq_params.tokens_per_sample
        samples = tokens // per_sample if per_sample and tokens % per_sample == 0 else 1
        if rotary_pos_emb is not None:
            rotary_pos_emb = (tuple(freqs.index_select(0, inside) for freqs in rotary_pos_emb)
                              if isinstance(rotary_pos_emb, tuple) else rotary_pos_emb.index_select(0, inside))
        return ids, rotary_pos_emb, samples

    # --- megatron's CUDA graphs (--cuda-graph-impl local | transformer_engine) -----------------------
    # What the layer reads and writes besides its inputs and outputs lives in the routing state's
    # preallocated buffers, written in place (megatron_xmod.xmod.routing_state), so megatron may capture
    # the whole layer and replay it; the configurations it cannot replay are refused when the layer is
    # built (check_cuda_graph_compatibility). Evaluation (the threshold rule) runs eagerly.
    def _should_call_local_cudagraph(self, *args, **kwargs):
        return self.training and super()._should_call_local_cudagraph(*args, **kwargs)

    def _te_cuda_graph_capture(self, *args, **kwargs):
        """TE captures the layer's forward as a whole (TransformerLayer's splits attention and MLP)."""
        output, _ = self.forward(*args, **kwargs)
        return (output,)

    def _te_cuda_graph_replay(self, *args, **kwargs):
        from megatron.core.transformer.module import GraphableMegatronModule

        outputs = GraphableMegatronModule._te_cuda_graph_replay(self, *args, **kwargs)
        return (outputs[0] if isinstance(outputs, (tuple, list)) else outputs), None

    # --- router, token-choice bias, sequence parallelism -------------------------------------------
    def _routing_parameters(self):
        return [self.router.weight, self.router.bias] + ([self.gate_scale] if hasattr(self, "gate_scale") else [])

    def _sequence_shards(self) -> int:
        return self.tp_group.size() if self.config.sequence_parallel else 1

    def _router_logits(self, hidden_states, stream_grad=None):
        """(router logits x w [s, b] in fp32 over the whole sequence, without the router's bias (the routing
        step adds it); the router-input chain of the block (megatron_xmod.xmod.routing_state: the
        full-length input is saved once per block, not per layer); x as the routed update reads it
        (routing_state.router_logits; None when ``stream_grad``, an in-place update's hand-over, is given))."""
        # Under CUDA graphs each layer is captured on its own, from a static input buffer: the chain (weak
        # references checked in Python) cannot cross graphs, so every layer saves its own router input.
        chain_handover = None if _cuda_graphs(self.config) else self.routing_state.router_inputs
        logits, chain, routed_input = router_logits(self.router, hidden_states, chain_handover, self.layer_number,
                                                    stream_grad)
        logits = logits.squeeze(-1).float()
        if self.config.sequence_parallel:
            # L scalars per sequence: every TP rank gets them all and makes the same selection; the
            # backward reduce-scatters the score gradients to the rank that holds each token.
            logits = gather_from_sequence_parallel_region(logits, tensor_parallel_output_grad=True, group=self.tp_group)
        if self.cp_group is not None:
            # The same for the CP ranks: L scalars per sequence, reassembled in position order from megatron's
            # load-balanced chunks, so that every CP rank routes the whole sequence identically.
            logits = gather_context_parallel(logits, self.cp_group)
        return logits, chain, routed_input

    def _step_destinations(self, state: RoutingState, rule: str, phase, shape, previous_selected, device) -> dict:
        """What the routing step writes into the routing state (routing_step's keyword arguments): the
        bias hand-over always (but in a recompute replay); under top-k also the routed-set hand-over,
        the call's statistics and, in training without sequence parallelism, the router BCE (its
        per-sequence parts: sequence and context parallelism back-propagate each rank's share, _local_share)."""
        fold_bce = (self.training and self.routing.router_bce_coeff > 0 and not self.config.sequence_parallel
                    and self.cp_group is None)
        if phase == "replay":  # recorded in the first pass; only the router loss is needed again
            return dict(bce_coeff=self.routing.router_bce_coeff if fold_bce else 0.0)
        bias_out, selected_out = state.bias_buffers(shape, device)
        if rule != "topk":
            return dict(bias_out=bias_out)
        # Paused statistics (state.recording False) record only the micro-batch loss: the layer does that.
        fold_bce = fold_bce and state.recording
        routed = topk_count(shape[0], self.routing.sparsity_k) * shape[1]
        statistics = state.step_statistics(self.layer_number, "" if self.training else "eval_", shape, routed,
                                           previous_selected is not None, fold_bce, device)
        return dict(bias_out=bias_out, selected_out=selected_out, statistics=statistics,
                    previous_selected=previous_selected if statistics is not None else None,
                    bce_coeff=self.routing.router_bce_coeff if fold_bce else 0.0)

    def _take_bias(self, state: RoutingState, shape, phase):
        """The carried token-choice bias and routed set of the previous sparse layer of the block (the
        routing state's hand-over buffers; (None, None) for the block's first sparse layer); under full
        recompute the replay gets a copy of what the first pass took."""
        if phase == "replay":
            return state.recompute_replay.pop(self.layer_number)
        carried = state.take_bias(self.layer_number, shape)
        if phase == "first":  # the buffers are overwritten by the next micro-batch: the replay keeps a copy
            state.recompute_replay.push(self.layer_number, tuple(None if t is None else t.clone() for t in carried))
        return carried

    def _local_share(self, loss, decision):
        """What this rank back-propagates of a loss averaged over all [s, b] scores: all of it, or under
        sequence and context parallelism its own tokens' part (the ranks' score gradients are summed)."""
        shards = self._sequence_shards() * self._cp_size()
        if shards == 1:
            return loss
        own = self._own_positions(decision.scores.shape[0])
        share = router_bce_loss(decision.scores[own], decision.selected[own]) / shards
        if self.cp_group is not None and not self.config.calculate_per_token_loss:
            # megatron averages gradients over the CP ranks too (dp x cp), and its LM loss is a per-rank
            # mean for that reason (divided by the rank's token count): the router loss follows suit.
            share = share * self._cp_size()
        return share

    def _own_positions(self, seq_len: int):
        """The sequence positions of this rank's rows: a slice (sequence parallelism alone) or an index."""
        local_len = seq_len // (self._sequence_shards() * self._cp_size())
        start = self.tp_group.rank() * local_len if self.config.sequence_parallel else 0
        if self.cp_group is None:
            return slice(start, start + local_len)
        positions = load_balanced_positions(seq_len, self._cp_size(), str(self.router.weight.device))
        return positions[self.cp_group.rank(), start:start + local_len]

    def _cp_size(self) -> int:
        return 1 if self.cp_group is None else self.cp_group.size()

    def _written_rows(self, indices: Optional[torch.Tensor], local_len: int,
                      flat: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Flat rows ([s*b, h] view) of this rank's slice that the layer may have changed, from the
        positions ``indices`` [k, b] of the batch it ran (None: it ran none); ``flat``: those rows as the
        routing step wrote them (top-k), used as they are without sequence parallelism.

        A static [k*b] index, no host sync. The chain (routing_state.RouterInputChain) reads every
        listed row from this layer's output and copies it back into the rebuilt input, so a row listed
        twice, or one the layer did not change (the padding of a threshold batch), gets its own current
        value: exact. Under sequence parallelism the routed positions that another rank holds point at
        row 0 of their sequence instead; the cost is min(k, s/T)*b rows per layer on every rank instead
        of this rank's share (when k >= s/T, all of its rows)."""
        if flat is not None and not self.config.sequence_parallel and self.cp_group is None:
            return flat
        if indices is None:
            return torch.empty(0, dtype=torch.long, device=self.router.weight.device)
        if self.cp_group is not None:  # positions -> rows of this CP rank's slice (others' tokens: row 0)
            cp_len = local_len * self._sequence_shards()
            gathered = _sequence_order(cp_len * self._cp_size(), self._cp_size(), str(indices.device))[indices]
            local = gathered - self.cp_group.rank() * cp_len  # the gathered order is rank-major
            indices = torch.where((local >= 0) & (local < cp_len), local, 0)
        if self.config.sequence_parallel and indices.shape[0] >= local_len:
            return torch.arange(local_len * indices.shape[1], device=indices.device)
        if self.config.sequence_parallel:
            local = indices - self.tp_group.rank() * local_len
            indices = torch.where((local >= 0) & (local < local_len), local, 0)
        return flat_rows(indices, indices.shape[1])

    def _gate_scale(self):
        return getattr(self, "gate_scale", None)  # varsigma of Eq.(7); MoD has none

    def _routed_update(self, hidden_states, indices, scores, rotary_pos_emb, valid=None, gate=None,
                       document_mask=None, batch_mask=None):
        """(x with the routed tokens ``indices`` updated, the gathered routed input [k, b, h], or None under
        sequence or context parallelism, where the rows it gathers are not those ``indices`` name);
        ``gate``: their gate as the routing step returns it (sigmoid(score), times varsigma for X-MoD), when
        it has one (top-k training);
        ``document_mask``: megatron's [b or 1, 1, s, s] attention mask of the whole sequence (True =
        masked), applied among the routed tokens; ``batch_mask``: the routed batch's own attention mask
        instead (context parallelism's)."""
        if self.cp_group is not None and batch_mask is None:
            return self._routed_update_context_parallel(hidden_states, indices, scores, rotary_pos_emb, valid,
                                                        document_mask), None
        if self.config.sequence_parallel:
            return self._routed_update_sequence_parallel(hidden_states, indices, scores, rotary_pos_emb, valid, gate,
                                                         document_mask, batch_mask)[0], None
        # A threshold batch (valid given) is not sorted past its real tokens: plain-torch permutation, and
        # no check of the sorted order the other backends need.
        backend, check = (None, None) if valid is None else ("torch", False)
        residual = ResidualGrad()  # the scatter's residual gradient goes to the gather's backward launch
        routed = gather_tokens(hidden_states, indices, backend=backend, check=check, residual=residual)
        attention_mask = _routed_document_mask(document_mask, indices) if batch_mask is None else batch_mask
        attention, mlp = self._attention_and_mlp(routed, _gather_positions(rotary_pos_emb, indices), attention_mask,
                                                 None if valid is None else ~valid)
        scale = None  # varsigma, unless the gate carries it already
        if gate is None:
            gate, scale = torch.sigmoid(torch.gather(scores, 0, indices)), self._gate_scale()
        r = gate.to(hidden_states.dtype)  # [k, b]
        keep = None if valid is None else valid.to(r.dtype)  # None: no padding, no multiply
        delta, gate = gated_residual(self.routing.family, attention, mlp, r, scale, keep)
        return scatter_gated(hidden_states, delta, gate, indices, backend=backend, check=check,
                             residual=residual), routed

    def _routed_update_in_place(self, hidden_states, indices, rows, gate, rotary_pos_emb, stream_grad, logits=None):
        """The top-k update of the routed rows (:func:`plain_routed_rows`, compiled with ``--xmod-compile-layers``)
        added to the residual stream in place: (the stream with the flat rows ``rows`` [k*b] updated, the gathered
        rows [k*b, h]). The stream is ``hidden_states`` itself where it continues the router-input chain
        (``stream_grad.continues``, wired by ``_router_logits``: the previous routed layer's output, which nothing
        saved; without autograd, the previous routed layer's output), else a copy of it (the chain's first
        layer). The router's backward completes the input's gradient after the gather's, which ``logits`` orders.
        Full-length buffers: one a chain forward (the copy) and one a chain backward (permute.reference.StreamGrad),
        where the out-of-place update made one forward and two to four backward a layer."""
        stream, routed = _stream_and_rows(hidden_states, rows, stream_grad, logits)
        update = (self.compiled_update or plain_routed_rows)(self, routed, indices, gate, rotary_pos_emb)
        return reference_permute.add_rows_(stream, rows, update, stream_grad), routed

    def _routed_update_sequence_parallel(self, hidden_states, indices, scores, rotary_pos_emb, valid=None, gate=None,
                                         document_mask=None, batch_mask=None, stream_grad=None, logits=None):
        """Sequence parallel: ``hidden_states`` is this rank's slice [s/T, b, h] of the sequence and
        ``indices`` [k, b] are positions in the whole sequence (the same on every rank). The routed
        subsequence, padded to a multiple of T at its end (causal attention keeps real tokens from
        seeing the padding), is split across the ranks like any sequence-parallel activation: each rank
        contributes the routed tokens it holds (reduce-scatter), attention and MLP run in megatron's
        sequence-parallel pattern, and the gated updates are all-gathered so that every rank adds those
        of its own tokens. Static shapes, no host sync: every rank adds all k*b gathered updates, those
        of tokens it does not hold replaced by -0.0 and sent to row 0 of their sequence.
        ``gate``: the routing step's gate of the routed tokens ([k, b], varsigma included), when it has one.
        ``document_mask``: megatron's mask of the whole sequence ([b or 1, 1, s, s], the same on every
        rank), gathered at the padded routed positions; the end padding is masked out as a key.
        ``batch_mask``: the padded batch's own mask instead (context parallelism's, which pads to T itself).
        ``stream_grad``: the top-k update adds its rows to the residual stream in place, as
        :meth:`_routed_update_in_place` does (``logits`` orders the router's backward after the gather's); this
        rank's rows then hold the others' tokens and the padding at row 0 of their sequence, each listed once a
        routed slot, which the in-place add and its backward sum like any row (adding -0.0 and 0).
        Returns (the stream with this rank's routed rows updated, the rows read before the update [(k + pad) * b, h]
        or None, their flat rows or None: both only when ``stream_grad`` is given)."""
        group = self.tp_group
        shards, rank = group.size(), group.rank()
        local_len, batch, hidden = hidden_states.shape
        k, pad = indices.shape[0], -indices.shape[0] % shards
        real = torch.ones_like(indices, dtype=torch.bool) if valid is None else valid
        if pad:
            indices = torch.cat([indices, indices[-1:].expand(pad, batch)])  # padding: any position for RoPE
            real = torch.cat([real, real.new_zeros(pad, batch)])
        local = indices - rank * local_len
        mine = (local >= 0) & (local < local_len)
        mine[k:] = False
        local = torch.where(mine, local, 0)
        written = flat_rows(local, batch)
        if stream_grad is None:
            read = hidden_states.reshape(-1, hidden).index_select(0, written)
        else:
            stream, read = _stream_and_rows(hidden_states, written, stream_grad, logits)
        rows = torch.where(mine.unsqueeze(-1), read.view(-1, batch, hidden), 0)
        routed = reduce_scatter_to_sequence_parallel_region(rows, group=group)  # [(k + pad) / T, b, h]
        # the end padding comes last: causal suffices
        attention_mask = _routed_document_mask(document_mask, indices) if batch_mask is None else batch_mask
        part = slice(rank * routed.shape[0], (rank + 1) * routed.shape[0])
        padding = None if valid is None and not pad else ~real[part]
        attention, mlp = self._attention_and_mlp(routed, _gather_positions(rotary_pos_emb, indices), attention_mask,
                                                 padding)
        r = (torch.sigmoid(torch.gather(scores, 0, indices[part])) if gate is None else
             torch.cat([gate, gate.new_zeros(pad, batch)])[part]).to(hidden_states.dtype)
        keep = real[part].to(r.dtype)
        delta, gate = gated_residual(self.routing.family, attention, mlp, r, self._gate_scale() if gate is None else None,
                                     keep)
        update = gate.unsqueeze(-1).to(delta.dtype) * delta  # as scatter_gated applies it
        update = gather_from_sequence_parallel_region(update, tensor_parallel_output_grad=True, group=group)
        # Others' tokens and the end padding add -0.0: x + (-0.0) is x bit for bit (also for x = +-0.0).
        update = torch.where(mine.unsqueeze(-1), update, -0.0).reshape(-1, hidden)
        if stream_grad is not None:
            return reference_permute.add_rows_(stream, written, update, stream_grad), read, written
        return hidden_states.reshape(-1, hidden).index_add(0, written, update).view_as(hidden_states), None, None

    def _routed_update_context_parallel(self, hidden_states, indices, scores, rotary_pos_emb, valid=None,
                                        document_mask=None):
        """Context parallel: ``hidden_states`` holds this CP rank's rows of megatron's load-balanced layout
        ([L/C, b, h]; under sequence parallelism its 1/T shard of them) and ``indices`` [k, b] are positions
        in the whole sequence, the same on every CP rank (``valid``: False for a threshold batch's padding).
        Each rank runs attention and MLP on the routed tokens it holds, a batch of static width; the core
        attention all-gathers their keys and values over the CP group (only that batch travels, not the
        sequence: C x min(L/K, L/C) rows against a dense layer's L, or L/K with segment-local routing,
        bench/cp.py) and the mask built here keeps every routed token causal among the routed tokens by real
        position (and, with ``document_mask``, inside its document). The gated update lands on the rank's
        own rows: nothing else is sent back."""
        local, real, mask = self._context_parallel_batch(indices, valid, hidden_states.shape[0], document_mask)
        positions = load_balanced_positions(scores.shape[0], self._cp_size(), str(scores.device))
        own = positions[self.cp_group.rank()].gather(0, local.reshape(-1)).view_as(local)  # [w, b] positions
        gate = torch.sigmoid(torch.gather(scores, 0, own))  # padding: any finite gate, zeroed by ``real``
        if self._gate_scale() is not None:  # _routed_update takes a gate as the routing step gives it
            gate = self._gate_scale().float() * gate
        return self._routed_update(hidden_states, local, scores, rotary_pos_emb, real, gate, batch_mask=mask)[0]

    def _context_parallel_batch(self, indices, valid, local_len: int, document_mask=None):
        """This CP rank's routed batch and its attention mask, from the routed positions ``indices`` [k, b].

        Every rank derives every rank's batch from the same routed set (no communication): rank c's rows
        [w, b] of its slice holding routed tokens, in position order, then padding (unrouted rows of its
        slice, unique), at the static width w of context_parallel_width (rounded up to a multiple of T under
        sequence parallelism, whose routed update splits the batch across the TP ranks): min(k, L/C) when
        top-k ranks whole sequences (a rank may hold any number of a sequence's routed tokens, none
        included); exactly k/C, no padding, when it ranks segments that megatron's CP chunks hold whole.
        Returns (rows [w, b] of this rank's slice, real [w, b], mask [b, 1, w, C*w] over the keys gathered
        in rank order, True = masked): a real query sees the real keys at positions up to its own, and every
        row sees itself (no row is all masked; padding gets a zero gate and is seen by nothing else).
        ``document_mask``: this rank's rows of megatron's mask under CP ([b or 1, 1, L/C, L], True = masked,
        key columns in the gathered rank order: training/step.py's context_parallel_batch), read at the
        routed queries and keys, so a routed token sees only the routed keys of its own document."""
        cp, rank, shards = self._cp_size(), self.cp_group.rank(), self._sequence_shards()
        cp_len = local_len * shards  # this CP rank's rows of every sequence (all its TP ranks)
        seq_len, batch = cp_len * cp, indices.shape[1]
        routed = torch.zeros(seq_len, batch, dtype=torch.bool, device=indices.device)
        routed.scatter_(0, indices, True if valid is None else valid)
        positions = load_balanced_positions(seq_len, cp, str(indices.device))  # [C, L/C]
        held = routed.index_select(0, positions.reshape(-1)).view(cp, cp_len, batch)
        width = context_parallel_width(indices.shape[0], seq_len, cp, self.routing.routing_segments
                                       if valid is None else 1)
        width += -width % shards
        rows, real, _ = capacity_selection(held.permute(1, 0, 2).reshape(cp_len, cp * batch), width)
        rows, real = rows.view(width, cp, batch), real.view(width, cp, batch)
        at = positions.gather(1, rows.permute(1, 0, 2).reshape(cp, -1)).view(cp, width, batch)
        keys = torch.where(real.permute(1, 0, 2), at, seq_len).reshape(cp * width, batch).t()  # [b, C*w]
        queries = torch.where(real[:, rank], at[rank], -1).t()  # [b, w]
        allowed = keys.unsqueeze(1) <= queries.unsqueeze(2)  # [b, w, C*w]
        if document_mask is not None:
            allowed &= ~_context_parallel_document_mask(document_mask, rows, rank, cp_len)
        own = torch.arange(width, device=indices.device)
        allowed[:, own, rank * width + own] = True
        return rows[:, rank], real[:, rank], ~allowed.unsqueeze(1)

    def _attention_and_mlp(self, x, rotary_pos_emb, attention_mask=None, padding=None):
        """The attention update a and MLP update f of this layer on the routed subsequence x; ``padding``
        [k, b] (True: a padding row of x), which a megatron MoE feed-forward leaves out of its router
        losses and expert-bias loads."""
        normed = self.input_layernorm(x)
        normed = normed[0] if isinstance(normed, tuple) else normed
        attention, attention_bias = self.self_attention(normed, attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb)
        attention = self._dropout(attention, attention_bias)
        normed = self.pre_mlp_layernorm(x + attention)
        normed = normed[0] if isinstance(normed, tuple) else normed
        moe_padding = dict(padding_mask=padding.t()) if padding is not None and self.is_moe_layer else {}
        mlp, mlp_bias = self.mlp(normed, **moe_padding)  # megatron's MoELayer takes the mask as [b, k]
        return attention, self._dropout(mlp, mlp_bias)

    def _dropout(self, output, bias):
        if bias is not None:
            output = output + bias
        return F.dropout(output, p=self.hidden_dropout, training=self.training)

    def _record_metrics(self, state: RoutingState, logits, decision, bias, previous_selected) -> None:
        """The routing statistics of a threshold-rule call (evaluation; the top-k routing step records its
        own) in one write to the routing state's table (one stack, one ``index_add_``), no host sync: the
        non-finite router-logit count, selected fraction, coverage and adjacent-layer Jaccard (per call:
        the mean of the calls' |a & b| / |a | b|, 1 when both are empty)."""
        prefix = "" if self.training else "eval_"  # eval_*: the deployable (threshold) rule at validation
        selected, device = decision.selected, logits.device
        names, values = state.nonfinite_values(logits)
        names += (prefix + "selected_fraction", prefix + "coverage")
        total = state.constant(bias.numel(), device)
        # Fractions as (tokens, total) pairs: the table divides when it is read (the mean over tokens).
        values += [selected.sum(), torch.count_nonzero(bias)]  # b >= 0: the covered tokens are those with b > 0
        counts = [None, None, total, total]
        if previous_selected is not None:
            names += (prefix + "adjacent_jaccard",)
            values.append(jaccard_tensor(previous_selected, selected))
            counts.append(None)
        state.record_values(self.layer_number, names, values, counts=counts)
