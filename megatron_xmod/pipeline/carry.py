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
gradient flows through it: its channels are detached and get zero gradient back. The receive
buffers are widened by numbered patch 18 (:func:`megatron_xmod.training.patches.widen_pipeline_messages`),
which reads the channel count from the model config (:func:`carry_channels`).

Precision: the channels travel in megatron's ``pipeline_dtype``; with bf16 the bias is exact while
it stays an integer <= 256 (integer increments, blocks of up to 256 sparse layers).
"""
from __future__ import annotations

import torch

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


def attach_boundary_carry(model: torch.nn.Module) -> torch.nn.Module:
    """Make the GPT model chunk ``model`` (built by :mod:`megatron_xmod.model`) send and receive the
    token-choice bias at its pipeline boundaries; a no-op without sparse layers or pipelining."""
    config = model.config
    channels = carry_channels(config)
    if not channels or getattr(model, "_xmod_boundary_carry", False):
        return model
    from megatron_xmod.training.patches import widen_pipeline_messages

    widen_pipeline_messages()
    state, hidden = model.routing_state, config.hidden_size
    layout = config.layer_layout.layers
    first = _first_layer_number(model)  # 1-based megatron layer numbers
    last = first + len(model.decoder.layers) - 1
    receives = first > 1 and layout[first - 2].is_sparse  # the layer before this chunk is sparse
    # Sequence parallelism: activations are a 1/TP shard of the sequence while every TP rank holds the
    # whole [s, b] bias (routing ranks the whole sequence): send the own shard, all-gather on receipt.
    tp_group = _tp_group(model) if config.sequence_parallel else None

    if not model.pre_process:
        set_input_tensor = model.set_input_tensor

        def set_input_with_carry(input_tensor):
            tensors = input_tensor if isinstance(input_tensor, list) else [input_tensor]
            received = tensors[0]
            if received is not None and received.shape[-1] == hidden + channels:
                carried = received[..., hidden:].detach().float()
                if tp_group is not None and receives:
                    carried = _gather_along_first_dim(carried.contiguous(), tp_group)
                if receives:
                    state.put_bias(first - 1, carried[..., 0].contiguous(), carried[..., 1] > 0.5)
                tensors = [received[..., :hidden].contiguous(), *tensors[1:]]
            return set_input_tensor(tensors)

        model.set_input_tensor = set_input_with_carry

    if not model.post_process:
        def append_carry(module, args, output):
            if not torch.is_tensor(output) or output.shape[-1] != hidden:
                return output
            rows, batch = output.shape[:2]
            shards = 1 if tp_group is None else tp_group.size()
            bias, selected = state.take_bias(last + 1, (rows * shards, batch))
            if bias is None:
                extra = output.new_zeros(rows, batch, channels)
            else:
                extra = torch.stack([bias, selected.float()], dim=-1).to(output.dtype)
                if shards > 1:  # this rank's sequence shard
                    extra = extra[tp_group.rank() * rows : (tp_group.rank() + 1) * rows]
            return torch.cat([output, extra.detach()], dim=-1)

        model.register_forward_hook(append_carry)
    model._xmod_boundary_carry = True
    return model
