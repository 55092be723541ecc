"""The forward step and loss of one micro-batch, as megatron's schedules call them.

The loss dictionary carries ``lm loss``, ``router bce loss`` (the mean over this stage's sparse
layers, taken from the model chunk's routing state), ``lm z loss`` for DTop-p models, and at
validation ``lm loss topk routing``: the same batch under top-k routing, the comparison the X-MoD
paper's Table 10 makes with the deployable threshold rule.
"""
from __future__ import annotations

from functools import partial
from typing import Optional

import torch

from megatron_xmod.routing_state import eval_routing, take_microbatch_loss


def loss_func(loss_mask: torch.Tensor, router_bce: Optional[torch.Tensor], topk_losses: Optional[torch.Tensor],
              lm_z_loss: Optional[tuple], output_tensor: torch.Tensor):
    """``lm_z_loss``: (labels, coefficient) when the model returned logits for the DTop-p LM z-loss."""
    mask = loss_mask.view(-1).float()
    num_tokens = mask.sum().detach().to(torch.int)
    z_report = None
    if lm_z_loss is not None:
        from megatron_xmod.moe.losses import lm_cross_entropy_and_z_loss

        labels, coefficient = lm_z_loss
        cross_entropy, z_loss = lm_cross_entropy_and_z_loss(output_tensor, labels)
        losses = cross_entropy.float().view(-1)
        z_sum = torch.sum(z_loss.float().view(-1) * mask)
        z_report = torch.cat([z_sum.detach().view(1), num_tokens.view(1)])
        loss = torch.sum(losses * mask) + coefficient * z_sum
        lm_sum = torch.sum(losses * mask).detach()
    else:
        losses = output_tensor.float().view(-1)
        loss = torch.sum(losses * mask)
        lm_sum = loss.detach()
    reports = {"lm loss": torch.cat([lm_sum.view(1), num_tokens.view(1)])}
    if z_report is not None:
        reports["lm z loss"] = z_report
    if router_bce is not None:
        reports["router bce loss"] = torch.cat([(router_bce.detach() * num_tokens).view(1), num_tokens.view(1)])
    if topk_losses is not None:
        topk = torch.sum(topk_losses.float().view(-1) * mask)
        reports["lm loss topk routing"] = torch.cat([topk.view(1), num_tokens.view(1)])
    return loss, num_tokens, reports


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    from megatron.core import parallel_state
    from megatron.core.utils import get_attr_wrapped_model
    from megatron.training import get_args

    from megatron_xmod.model import sparse_layers

    batch = next(data_iterator)
    tokens, labels = batch["tokens"], batch["labels"]
    loss_mask, position_ids = batch["loss_mask"], batch["position_ids"]
    attention_mask = batch.get("attention_mask")
    z_coefficient = getattr(get_attr_wrapped_model(model, "config"), "lm_z_loss_coeff", 0.0)
    if z_coefficient > 0 and model.training:
        # the z-loss needs the logits, so the loss is computed here instead of inside GPTModel
        output = model(tokens, position_ids, attention_mask)
        lm_z_loss = (labels, z_coefficient)
    else:
        output = model(tokens, position_ids, attention_mask, labels=labels)
        lm_z_loss = None
    router_bce = take_microbatch_loss(model) if model.training else None

    topk_losses = None
    routed = [] if model.training or get_args().xmod_no_topk_validation else sparse_layers(model)
    if routed and parallel_state.get_pipeline_model_parallel_world_size() == 1:
        rule = "topk" if routed[0].routing_state.eval_rule == "threshold" else "threshold"
        with eval_routing(model, rule), torch.no_grad():
            topk_losses = model(tokens, position_ids, attention_mask, labels=labels)
    return output, partial(loss_func, loss_mask, router_bce, topk_losses, lm_z_loss)
