"""The forward step and loss of one micro-batch, as megatron's schedules call them.

The loss dictionary carries ``lm loss``, ``router bce loss`` (the mean over this stage's sparse
layers, taken from the model chunk's routing state), ``lm z loss`` for DTop-p models, and at
validation ``lm loss topk routing``: the same batch under top-k routing, the comparison the X-MoD
paper's Table 10 makes with the deployable threshold rule.

Non-finite router logits: the sparse layers and the DTop-p router count them on the device
(``nonfinite_router_logits`` in the routing state, no host sync per layer). The forward step takes
the micro-batch's counts and a non-zero one makes the loss NaN, so megatron's NaN handling
(``--check-for-nan-in-loss-and-grad``, on by default) counts and stops the iteration, and the
message names the layer. The counts are read from the device only when the loss is NaN (megatron's
check reads the loss anyway), so a micro-batch costs no host read beyond megatron's own. Routing on NaN logits would otherwise go unnoticed: top-k picks the NaN
positions, the threshold rule routes no token and the layer is silently skipped.
"""
from __future__ import annotations

from functools import partial
from typing import Optional

import torch

from megatron_xmod.xmod.routing_state import (
    eval_routing,
    routing_states,
    set_iteration,
    statistics_paused,
    take_microbatch_loss,
)

NONFINITE = "nonfinite_router_logits"


def nonfinite_totals(model) -> dict[int, torch.Tensor]:
    """{layer number: running count of non-finite router logits} of ``model``'s routing states (a
    snapshot on the device, no host sync)."""
    totals = {}
    for state in routing_states(model):
        layers, sums = state.nonfinite_sums()
        totals.update(zip(layers, sums.unbind()) if layers else ())
    return totals


def nonfinite_since(model, before: dict[int, torch.Tensor]) -> Optional[tuple[list[int], torch.Tensor]]:
    """(layers, counts on the device) recorded since ``before`` (a :func:`nonfinite_totals`)."""
    after = nonfinite_totals(model)
    if not after:
        return None
    layers = sorted(after)
    return layers, torch.stack([after[layer] - before[layer] if layer in before else after[layer] for layer in layers])


def _nan_check() -> tuple[bool, bool]:
    """(megatron's NaN check is on, megatron's training globals exist)."""
    try:
        from megatron.training import get_args

        return bool(get_args().check_for_nan_in_loss_and_grad), True
    except (AssertionError, ImportError, AttributeError):  # outside megatron's training loop
        return True, False


def nonfinite_message(layers: list[int], counts: list[float]) -> Optional[str]:
    bad = [f"layer {layer} ({int(count)} values)" for layer, count in zip(layers, counts) if count > 0]
    if not bad:
        return None
    return (f"non-finite router logits in {', '.join(bad)}: this micro-batch's loss is set to NaN. A NaN/Inf router "
            "weight or layer input in the first of these layers; resume from the last checkpoint (`xmod ckpt verify` checks it) with a "
            "lower --lr (with --no-load-optim) or --clip-grad")


def loss_func(loss_mask: torch.Tensor, router_bce: Optional[torch.Tensor], topk_losses: Optional[torch.Tensor],
              lm_z_loss: Optional[tuple], output_tensor: torch.Tensor,
              nonfinite: Optional[tuple[list[int], torch.Tensor]] = None):
    """``lm_z_loss``: (labels, coefficient) when the model returned logits for the DTop-p LM z-loss;
    ``nonfinite``: (layers, counts) of non-finite router logits in this micro-batch."""
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
    if nonfinite is not None:
        layers, counts = nonfinite
        poison = torch.where(counts.sum() > 0, float("nan"), 0.0).to(loss.dtype)  # on the device
        loss, lm_sum = loss + poison, lm_sum + poison
        check, in_megatron = _nan_check()
        if check and in_megatron:
            _validate_loss(loss, _NonfiniteReport(layers, counts))
        elif check:  # outside megatron's training loop (tests, tools): read the counts now
            _NonfiniteReport(layers, counts).announce()
    reports = {"lm loss": torch.cat([lm_sum.view(1), num_tokens.view(1)])}
    if z_report is not None:
        reports["lm z loss"] = z_report
    if router_bce is not None:
        reports["router bce loss"] = torch.cat([(router_bce.detach() * num_tokens).view(1), num_tokens.view(1)])
    if topk_losses is not None:
        topk = torch.sum(topk_losses.float().view(-1) * mask)
        reports["lm loss topk routing"] = torch.cat([topk.view(1), num_tokens.view(1)])
    return loss, num_tokens, reports


NAN_LOSS = "found NaN in local forward loss calculation"


class _NonfiniteMessage(str):
    """megatron's message for the NaN check of a routed model's loss: equal to (and hashed as) its default
    message, so that megatron's rerun machine keys the check the same in every micro-batch, run and
    rerun; formatted (which megatron does only when it rejects the loss, or in its end-of-run
    determinism report) it names the layers with non-finite router logits, reading their counts then."""

    def __new__(cls, report: _NonfiniteReport):
        message = super().__new__(cls, NAN_LOSS)
        message.report = report
        return message

    def __str__(self) -> str:
        return self.report.message() or NAN_LOSS

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


class _NonfiniteReport:
    """The non-finite router-logit counts of one micro-batch, read from the device only when needed:
    when megatron's NaN check finds the loss NaN (the check reads the loss anyway), or outside megatron."""

    def __init__(self, layers: list[int], counts: torch.Tensor):
        self.layers, self.counts = layers, counts
        self._message: Optional[str] = None
        self._read = self._announced = False

    def message(self) -> Optional[str]:
        if not self._read:
            self._message, self._read = nonfinite_message(self.layers, self.counts.tolist()), True
        return self._message

    def announce(self) -> None:
        if not self._announced and self.message() is not None:
            self._announced = True
            print(f"[xmod] {self._message}", flush=True)

    def rejects(self, loss: torch.Tensor) -> bool:
        """megatron's rejection test (torch.isnan), read here so that the counts follow only on a NaN."""
        rejected = bool(torch.isnan(loss))  # the host read megatron's check makes of every loss it validates
        if rejected:
            self.announce()
        return rejected


def _validate_loss(loss: torch.Tensor, report: Optional[_NonfiniteReport] = None) -> None:
    """megatron's NaN/Inf check of the local loss, as Megatron-LM's pretrain_gpt.py loss_func makes it.

    With ``report``: the counts of non-finite router logits are read only when the loss is NaN, so a
    micro-batch costs no host read beyond megatron's own. megatron skips the check in the first iteration
    after a start (rerun_state_machine.py: first_iteration_complete); there the counts are read as before,
    so that a NaN there is still named (its update reaches the weights, the check fires at the next one)."""
    from megatron.core.rerun_state_machine import RerunMode, get_rerun_state_machine

    machine = get_rerun_state_machine()
    rejection, message = torch.isnan, NAN_LOSS
    if report is not None:
        rejection, message = report.rejects, _NonfiniteMessage(report)
        if machine.mode != RerunMode.DISABLED and not machine.first_iteration_complete:
            report.announce()
    machine.validate_result(result=loss, rejection_func=rejection, tolerance=0.0, fatal=True, message=message)
    machine.validate_result(result=loss, rejection_func=torch.isinf, tolerance=0.0, fatal=True,
                            message="found Inf in local forward loss calculation")


def packed_batch(batch: dict):
    """(batch, packed_seq_params): a batch with the dataset's document boundaries (``cu_seqlens``,
    --dataloader-inter-document-masking) packed into one row of THD tokens with megatron's own
    flatten_batch_for_packed_sequences, and megatron's PackedSeqParams for it, as Megatron-LM's
    pretrain_gpt.py builds them; (batch, None) for any other batch."""
    if batch.get("cu_seqlens") is None:
        return batch, None
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.utils import flatten_batch_for_packed_sequences

    seq_length = batch["tokens"].shape[1]  # a sample's tokens, before the micro-batch becomes one row
    batch = flatten_batch_for_packed_sequences(dict(batch))
    cu_seqlens = batch["cu_seqlens"].squeeze(0)
    longest = int(batch["max_seqlen"].max())  # the host read Megatron-LM makes too (FlashAttention's varlen bound)
    return batch, PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                                  max_seqlen_q=longest, max_seqlen_kv=longest, tokens_per_sample=seq_length)


def context_parallel_batch(batch: dict) -> dict:
    """This CP rank's part of ``batch``: megatron's load-balanced split (get_batch_on_this_cp_rank, as
    Megatron-LM's pretrain_gpt.py makes it), the attention mask's key columns then put in the order
    in which the SDPA core attention gathers the keys over the CP group (rank order, layers.SDPAttention);
    the whole batch at CP 1."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank

    from megatron_xmod.xmod.layers import load_balanced_positions

    if parallel_state.get_context_parallel_world_size() == 1:
        return batch
    group = parallel_state.get_context_parallel_group()
    batch = get_batch_on_this_cp_rank(dict(batch), is_hybrid_cp=False, cp_group=group)
    mask = batch.get("attention_mask")
    if mask is not None:
        order = load_balanced_positions(mask.shape[-1], group.size(), str(mask.device)).reshape(-1)
        batch["attention_mask"] = mask.index_select(-1, order)
    return batch


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    from megatron.core import parallel_state
    from megatron.core.utils import get_attr_wrapped_model
    from megatron.training import get_args

    from megatron_xmod.model import sparse_layers

    if data_iterator is None:  # megatron sets do_valid for a split it built no loader for
        raise ValueError("split: megatron asked for a batch of a split that has no data (a --split weight of 0, or "
                         "no --valid-data-path, with --eval-iters > 0); pass --eval-iters 0 or give that split data")
    if model.training:  # megatron sets curr_iteration before each train step, restored on resume
        set_iteration(model, get_args().curr_iteration)
    before = nonfinite_totals(model)
    batch, packed = packed_batch(context_parallel_batch(next(data_iterator)))
    tokens, labels = batch["tokens"], batch["labels"]
    loss_mask, position_ids = batch["loss_mask"], batch["position_ids"]
    attention_mask = batch.get("attention_mask")
    z_coefficient = getattr(get_attr_wrapped_model(model, "config"), "lm_z_loss_coeff", 0.0)
    if z_coefficient > 0 and model.training:
        # the z-loss needs the logits, so the loss is computed here instead of inside GPTModel
        output = model(tokens, position_ids, attention_mask, packed_seq_params=packed)
        lm_z_loss = (labels, z_coefficient)
    else:
        output = model(tokens, position_ids, attention_mask, labels=labels, packed_seq_params=packed)
        lm_z_loss = None
    router_bce = take_microbatch_loss(model) if model.training else None

    topk_losses = None
    routed = [] if model.training or get_args().xmod_no_topk_validation else sparse_layers(model)
    if routed and parallel_state.get_pipeline_model_parallel_world_size() == 1:
        rule = "topk" if routed[0].routing_state.eval_rule == "threshold" else "threshold"
        # statistics_paused: the eval_* routing statistics describe the evaluation rule, not this comparison.
        with eval_routing(model, rule), statistics_paused(model), torch.no_grad():
            topk_losses = model(tokens, position_ids, attention_mask, labels=labels, packed_seq_params=packed)
    return output, partial(loss_func, loss_mask, router_bce, topk_losses, lm_z_loss,
                           nonfinite=nonfinite_since(model, before))
