"""LM z-loss (DTop-p paper Eq.10): lambda_z * (log sum_v exp z_v)^2 per token, on the output logits.

Megatron's GPTModel computes the cross-entropy itself when given labels; to add the z-loss the
loss function asks for logits (``labels=None``) and calls :func:`lm_cross_entropy_and_z_loss`.
"""
from __future__ import annotations

import torch
from megatron.core import parallel_state, tensor_parallel


def lm_z_loss(logits: torch.Tensor, tp_group=None) -> torch.Tensor:
    """(logsumexp over the vocabulary)^2 per position; ``logits`` may be vocab-parallel over TP."""
    logits = logits.float()
    if tp_group is None and parallel_state.model_parallel_is_initialized():
        tp_group = parallel_state.get_tensor_model_parallel_group()
    if tp_group is None or tp_group.size() == 1:
        return torch.logsumexp(logits, dim=-1) ** 2
    with torch.no_grad():
        shift = logits.max(dim=-1, keepdim=True).values
        torch.distributed.all_reduce(shift, op=torch.distributed.ReduceOp.MAX, group=tp_group)
    local = torch.exp(logits - shift).sum(dim=-1)
    total = tensor_parallel.reduce_from_tensor_model_parallel_region(local, tp_group)
    return (shift.squeeze(-1) + torch.log(total)) ** 2


def lm_cross_entropy_and_z_loss(logits: torch.Tensor, labels: torch.Tensor, tp_group=None):
    """Per-token cross-entropy and z-loss from GPTModel logits [b, s, V(/TP)] and labels [b, s];
    the caller weights the z-loss by ``config.lm_z_loss_coeff`` and logs both separately."""
    ce = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), labels, tp_group=tp_group)
    return ce, lm_z_loss(logits, tp_group)
