"""The token-choice bias across pipeline stages: an adapter beside the model, not inside it.

Within a stage the sparse layers of a block hand the bias b (Eq.8 of the X-MoD paper) and their
routed set to the next layer through the chunk's :class:`~megatron_xmod.xmod.routing_state.RoutingState`.
When a pipeline boundary falls inside a sparse block, b must travel with that micro-batch's
activations. It does so as extra channels of the activation tensor megatron's schedules already
send: a chunk that is not the last stage appends ``[b, routed set]`` to its output
(``[s, b, h] -> [s, b, h + 2]``), and a chunk that is not the first splits them off its input and
puts them into its routing state as if its previous layer had run locally. Because the channels are
part of the activation, every schedule (1F1B, interleaved, forward-only) pairs them with the right
micro-batch and model chunk, and in-flight micro-batches each keep their own. b is a count, so no
gradient flows through it: its channels are detached and get zero gradient back. Both ends are
torch module hooks on the chunk (a forward hook appends, a forward pre-hook on its decoder splits what
megatron's ``set_input_tensor`` handed it); megatron's receive buffers are widened by
:func:`widened_communicate`, which the entry point installs as numbered patch 18
(:mod:`megatron_xmod.training.patches`) and which reads the channel count from the model config
(:func:`carry_channels`).

Precision: the channels travel in megatron's ``pipeline_dtype``; with bf16 the bias is exact while
it stays an integer <= 256 (integer increments, blocks of up to 256 sparse layers).
"""
from __future__ import annotations

import functools

import torch

from megatron_xmod.xmod.layers import context_parallel_group, gather_context_parallel, load_balanced_positions

CHANNELS = ("token_choice_bias", "previous_selected")


def carry_channels(config) -> int:
    """Channels appended to the pipeline's activations for ``config``'s model: 2 when it has sparse
    layers and is pipelined, else 0."""
    layout = getattr(config, "layer_layout", None)
    if layout is None or not layout.num_sparse_layers or (config.pipeline_model_parallel_size or 1) < 2:
        return 0
    return len(CHANNELS)


def _tp_group(model):
    layers = model.decoder.layers
    if len(layers) and getattr(layers[0], "tp_group", None) is not None:
        return layers[0].tp_group
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def _gather_along_first_dim(tensor: torch.Tensor, group) -> torch.Tensor:
    from megatron.core.tensor_parallel.mappings import _gather_along_first_dim as gather

    return gather(tensor, group)


def _first_layer_number(model) -> int:
    layers = model.decoder.layers
    if len(layers):
        return layers[0].layer_number
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    return get_transformer_layer_offset(model.config, vp_stage=getattr(model, "vp_stage", None)) + 1


def widened_communicate(original):
    """Patch 18's wrapper of megatron's ``P2PCommunicator._communicate``: a receive buffer of shape
    (seq, micro-batch, hidden_size) gets the :func:`carry_channels` of the communicator's model config
    appended; other models' messages are unchanged."""

    @functools.wraps(original)
    def _communicate(self, *, tensor_shape, **kwargs):
        extra = carry_channels(self.config)
        if extra and tensor_shape is not None and len(tensor_shape) == 3 and tensor_shape[-1] == self.config.hidden_size:
            tensor_shape = (*tensor_shape[:-1], tensor_shape[-1] + extra)
        return original(self, tensor_shape=tensor_shape, **kwargs)

    return _communicate


def attach_boundary_carry(model: torch.nn.Module) -> torch.nn.Module:
    """Make the GPT model chunk ``model`` (built by :mod:`megatron_xmod.model`) send and receive the
    token-choice bias at its pipeline boundaries; a no-op without sparse layers or pipelining. The
    receive buffers must be widened too (patch 18, installed by the entry point)."""
    config = model.config
    channels = carry_channels(config)
    if not channels or getattr(model, "_xmod_boundary_carry", False):
        return model
    state, hidden = model.routing_state, config.hidden_size
    layout = config.layer_layout.layers
    first = _first_layer_number(model)  # 1-based megatron layer numbers
    last = first + len(model.decoder.layers) - 1
    receives = first > 1 and layout[first - 2].is_sparse  # the layer before this chunk is sparse
    # Sequence parallelism: activations are a 1/TP shard of the sequence while every TP rank holds the
    # whole [s, b] bias (routing ranks the whole sequence): send the own shard, all-gather on receipt.
    tp_group = _tp_group(model) if config.sequence_parallel else None
    # Context parallelism likewise: a CP rank holds its rows of megatron's load-balanced layout; it sends
    # those (then their sequence-parallel shard) and reassembles the whole sequence on receipt.
    cp_group = context_parallel_group(config)

    if not model.pre_process:
        def split_carry(decoder, args):
            # megatron's schedule handed the received activation to set_input_tensor; the decoder reads
            # it as decoder.input_tensor in its forward. Slicing keeps autograd's path to the received
            # tensor, so its gradient gets zeros in the bias channels.
            received = decoder.input_tensor
            if received is None or received.shape[-1] != hidden + channels:
                return None
            carried = received[..., hidden:].detach().float()
            if tp_group is not None and receives:
                carried = _gather_along_first_dim(carried.contiguous(), tp_group)
            if cp_group is not None and receives:
                carried = gather_context_parallel(carried.contiguous(), cp_group)
            if receives:
                state.put_bias(first - 1, carried[..., 0].contiguous(), carried[..., 1] > 0.5)
            decoder.input_tensor = received[..., :hidden].contiguous()
            return None

        model.decoder.register_forward_pre_hook(split_carry)

    if not model.post_process:
        def append_carry(module, args, output):
            if not torch.is_tensor(output) or output.shape[-1] != hidden:
                return output
            rows, batch = output.shape[:2]
            shards = 1 if tp_group is None else tp_group.size()
            cp = 1 if cp_group is None else cp_group.size()
            bias, selected = state.take_bias(last + 1, (rows * shards * cp, batch))
            if bias is None:
                extra = output.new_zeros(rows, batch, channels)
            else:
                extra = torch.stack([bias, selected.float()], dim=-1).to(output.dtype)
                if cp > 1:  # this CP rank's rows, in megatron's load-balanced order
                    positions = load_balanced_positions(rows * shards * cp, cp, str(extra.device))
                    extra = extra.index_select(0, positions[cp_group.rank()])
                if shards > 1:  # this rank's sequence shard
                    extra = extra[tp_group.rank() * rows : (tp_group.rank() + 1) * rows]
            return torch.cat([output, extra.detach()], dim=-1)

        model.register_forward_hook(append_carry)
    model._xmod_boundary_carry = True
    return model
