"""DTop-p router (DTop-p MoE paper, section 4) and the Top-k baseline router, as megatron-core MoE routers.

:class:`DTopPRouter` plugs into ``MoESubmodules.router`` of a layer spec and hands megatron's
dispatchers the same ``(probs, routing_map)`` pair as ``TopKRouter``, except that each token has
its own number of experts: the smallest set, in order of routing probability, whose cumulative
probability reaches the threshold p_t; the weights are renormalised over that set.

The threshold of ``moe_router_type='dtopp'`` follows a PI controller (Eq. p_{t+1} = p_0 +
K_pro e_t + K_int sum e_i, e_t = (T - a_t) / N), updated once per global batch by
:func:`update_dtopp_controllers`, which the training loop calls right after
``finalize_model_grads`` (or use :func:`dtopp_finalize_model_grads` as
``config.finalize_model_grads_func``; :func:`~megatron_xmod.moe.model.build_moe_gpt_model` installs
it). This mirrors how megatron updates its own expert bias: forward passes only accumulate device
counters (no host synchronisation per micro-batch), and one small all-reduce per global batch
turns them into the new threshold, identical on every rank.

:class:`BaselineTopKRouter` is megatron's ``TopKRouter`` for the Top-k baselines, with the fixed
routing normalisation of the DTop-p paper's Top-k baseline and a guard for micro-batches that are
entirely padding.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region
from megatron.core.transformer.moe.moe_utils import (
    MoEAuxLossAutoScaler,
    apply_router_token_dropping,
    get_tokens_per_expert_and_token_count,
    switch_load_balancing_loss_func,
)
from megatron.core.transformer.moe.router import TopKRouter

from megatron_xmod.moe.config import MoEConfig, check_topp_compatibility
from megatron_xmod.moe.scores import normalize_routing_logits, top_p_routing  # noqa: F401 (plain torch, shared with the HF model)

# The threshold is clipped to the open interval (0, 1) (paper, "Controller Stability").
THRESHOLD_EPS = 1e-6


def pi_update(p0: float, kp: float, ki: float, integral: torch.Tensor, error: torch.Tensor):
    """One PI step: returns (new threshold clipped to (0, 1), new integral)."""
    integral = integral + error
    threshold = torch.clamp(p0 + kp * error + ki * integral, THRESHOLD_EPS, 1 - THRESHOLD_EPS)
    return threshold, integral


class DTopPRouter(TopKRouter):
    """Top-p router with a PI-controlled (dtopp) or fixed (topp-fixed) threshold.

    Reuses ``TopKRouter`` for the gate (``weight``), the router z-loss (``moe_z_loss_coeff``) and
    the logging of the load-balancing loss; replaces the selection.

    State:
      - ``dtopp_threshold`` / ``dtopp_integral``: persistent buffers (checkpointed);
      - ``drn_scale``: theta_l, a parameter when ``dtopp_routing_norm='learnable'``;
      - ``dtopp_active_sum`` / ``dtopp_token_count``: the global batch's activation counters,
        non-persistent, reset by :func:`update_dtopp_controllers`.
    """

    ROUTING_METRICS = ("dtopp_active_experts", "dtopp_threshold", "dtopp_dynamic_loss", "nonfinite_router_logits")

    def __init__(self, config: MoEConfig, pg_collection=None, is_mtp_layer: bool = False) -> None:
        if not isinstance(config, MoEConfig) or not config.is_topp:
            raise ValueError("moe_router_type: DTopPRouter needs a MoEConfig with moe_router_type 'dtopp' or 'topp-fixed'")
        check_topp_compatibility(config)  # the config was validated, but it may have been edited since
        super().__init__(config=config, pg_collection=pg_collection, is_mtp_layer=is_mtp_layer)
        self.controlled = config.moe_router_type == "dtopp"
        # The built model chunk's RoutingState (megatron_xmod.xmod.routing_state), attached after the
        # build; without one (a router used on its own) nothing is recorded.
        self.routing_state = None
        norm = config.dtopp_routing_norm
        if norm == "learnable":
            self.drn_scale = torch.nn.Parameter(torch.full((1,), config.dtopp_routing_norm_init, dtype=torch.float32))
            # Replicated over TP like the gate weight, but under sequence parallelism each TP rank
            # routes its own slice of the sequence, so its gradient is partial: the tag makes
            # megatron's finalize_model_grads sum it over TP, as Router.reset_parameters does for
            # the weight (untagged, the copies of theta_l drift apart across TP ranks).
            self.drn_scale.sequence_parallel = config.sequence_parallel
        else:
            self.drn_scale = None
        device = torch.cuda.current_device()
        self.register_buffer("dtopp_threshold", torch.full((1,), config.dtopp_p0, dtype=torch.float32, device=device))
        self.register_buffer("dtopp_integral", torch.zeros(1, dtype=torch.float32, device=device))
        self.register_buffer("dtopp_active_sum", torch.zeros(1, dtype=torch.float32, device=device), persistent=False)
        self.register_buffer("dtopp_token_count", torch.zeros(1, dtype=torch.float32, device=device), persistent=False)

    # --- numerics --------------------------------------------------------------------------------

    def _maintain_float32_expert_bias(self):
        # Float16Module casts buffers to bf16/fp16; the controller state must stay exact.
        super()._maintain_float32_expert_bias()
        for name in ("dtopp_threshold", "dtopp_integral", "dtopp_active_sum", "dtopp_token_count"):
            buffer = getattr(self, name)
            if buffer.dtype != torch.float32:
                setattr(self, name, buffer.float())

    def routing_scores(self, logits: torch.Tensor) -> torch.Tensor:
        """P(x): softmax over experts, after Dynamic Routing Normalisation when enabled."""
        logits = logits.float()
        norm = self.config.dtopp_routing_norm
        if norm != "none":
            theta = self.drn_scale if norm == "learnable" else self.config.dtopp_routing_norm_init
            logits = normalize_routing_logits(logits, theta)
        return torch.softmax(logits, dim=-1)

    @property
    def target(self) -> float:
        return self.config.layer_target(self.layer_number or 1)

    # --- routing ---------------------------------------------------------------------------------

    def routing(self, logits: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        seq_length, bsz = logits.shape[:2]
        logits = logits.view(-1, self.config.num_moe_experts)
        if padding_mask is not None:
            padding_mask = padding_mask.reshape(-1)
        state = self.routing_state if self.layer_number is not None else None
        if state is not None:
            # NaN/Inf gate logits route silently (softmax -> NaN, top-p keeps the first expert); counted
            # on the device, turned into a NaN loss naming the layer by the forward step.
            names, values = state.nonfinite_values(logits)
        # Router z-loss acts on the raw gate logits W x (paper Eq.14); megatron's, coefficient
        # moe_z_loss_coeff, logged as "z_loss".
        logits = self.apply_z_loss(logits, padding_mask=padding_mask)
        scores = self.routing_scores(logits)
        probs, routing_map = top_p_routing(scores, self.dtopp_threshold)
        valid = None if padding_mask is None else (~padding_mask).unsqueeze(-1)
        selected = routing_map if valid is None else routing_map & valid
        training_step = self.training and torch.is_grad_enabled()
        dynamic = None
        if training_step:
            probs, dynamic = self._apply_topp_losses(probs, scores, selected, valid)
        if training_step and self.controlled:
            with torch.no_grad():
                # The process variable counts selections before any capacity drop: it is what p controls.
                self.dtopp_active_sum += selected.sum()
                self.dtopp_token_count += selected.shape[0] if valid is None else valid.sum()
        if state is not None:  # this call's statistics in one write (one stack, one index_add_), no host sync
            tokens = selected.shape[0] if valid is None else valid.sum().clamp(min=1)
            names += ("dtopp_active_experts", "dtopp_threshold")
            values += [selected.sum() / tokens, self.dtopp_threshold[0]]
            if dynamic is not None:
                names += ("dtopp_dynamic_loss",)
                values.append(dynamic)
            state.record_values(self.layer_number, names, values)
        if self.config.moe_expert_capacity_factor is not None:
            probs, routing_map = apply_router_token_dropping(
                probs, routing_map, router_topk=self.topk, capacity_factor=self.config.moe_expert_capacity_factor,
                drop_policy=self.config.moe_token_drop_policy, pad_to_capacity=False)
        return probs.type_as(logits), routing_map

    def _apply_topp_losses(self, probs, scores, selected, valid):
        num_tokens = selected.shape[0] if valid is None else valid.sum()
        scores_valid = scores if valid is None else scores * valid
        lb_coeff = self.get_aux_loss_coeff("aux_loss")
        if lb_coeff > 0:
            # Load-balancing loss N * sum_i f_i Q_i (paper Eq.11) with f_i the share of all
            # (token, expert) assignments that went to expert i: with a variable number of experts
            # per token, "topk" in megatron's normalisation is the mean number of experts.
            local_counts = selected.sum(dim=0).float()
            counts = reduce_from_tensor_model_parallel_region(local_counts, self.tp_cp_group)
            total_tokens = reduce_from_tensor_model_parallel_region(
                torch.as_tensor(num_tokens, dtype=torch.float32, device=scores.device).reshape(1), self.tp_cp_group)[0]
            # Both go into megatron's denominator (topk * tokens^2). With no valid token in the
            # TP x CP group (a micro-batch of padding) both are 0 and 0/0 makes the router
            # gradients NaN; clamped, the loss is 0 (no counts, masked scores) with a finite,
            # zero gradient. Otherwise both are >= 1 (a valid token keeps at least one expert),
            # so the clamps change nothing.
            total_tokens = total_tokens.clamp(min=1)
            mean_experts = (counts.sum() / total_tokens).clamp(min=1)
            lb_loss = switch_load_balancing_loss_func(
                probs=scores_valid, tokens_per_expert=counts, total_num_tokens=total_tokens, topk=mean_experts,
                num_experts=self.config.num_moe_experts, moe_aux_loss_coeff=lb_coeff)
            probs = self.attach_and_log_load_balancing_loss(
                probs, lb_coeff, lb_loss, "load_balancing_loss", self.tp_cp_group, valid_token_count=num_tokens)
        dl_coeff = self.config.dtopp_dynamic_loss_coeff
        if dl_coeff > 0:
            # Dynamic loss (paper Eq.13): the mean routing entropy, pushing each token to be decisive.
            entropy = -(scores * torch.log(scores.clamp(min=1e-20))).sum(dim=-1, keepdim=True)
            if valid is not None:
                entropy = entropy * valid
            mean_entropy = entropy.sum() / torch.as_tensor(num_tokens, dtype=torch.float32).clamp(min=1)
            # Each TP/CP rank holds a slice of the tokens: average over them, as megatron's z-loss.
            dynamic_loss = mean_entropy * (dl_coeff / self.tp_cp_group.size())
            if self.calculate_per_token_loss:
                dynamic_loss = dynamic_loss * num_tokens * self.tp_cp_group.size()
            probs = MoEAuxLossAutoScaler.apply(probs, dynamic_loss)
            return probs, mean_entropy * dl_coeff
        return probs, None


def _at_least_one(num_tokens):
    """The token count of megatron's load-balancing denominators, at least 1. A micro-batch that
    is entirely padding has 0 valid tokens, and megatron's 0/0 there makes the router gradients
    NaN; with 0 tokens the counts and the masked scores are 0 too, so the clamped loss is 0 with a
    zero gradient. A real count is >= 1 already, so the numerics of every other batch are unchanged."""
    return num_tokens.clamp(min=1) if torch.is_tensor(num_tokens) else max(num_tokens, 1)


class BaselineTopKRouter(TopKRouter):
    """megatron's ``TopKRouter`` (the Top-k baselines), plus:

    - ``dtopp_routing_norm='fixed'``: the logits are normalised to theta * (z - mu) / sigma with
      theta = ``dtopp_routing_norm_init`` before megatron scores them, the "Global 1.0" routing
      normalisation of the DTop-p paper's Top-k baseline (Table 6). The router z-loss, if any,
      still sees the raw gate logits, as with DTop-p;
    - a micro-batch that is entirely padding gets zero load-balancing losses with finite
      gradients instead of megatron's NaN (:func:`_at_least_one`);
    - the expert-bias token counts exclude padding tokens: megatron 0.19 masks the
      [tokens, experts] routing map with a [tokens] padding mask, which does not broadcast.

    Without padding and without the normalisation it computes exactly what ``TopKRouter`` does.
    """

    def __init__(self, config: MoEConfig, pg_collection=None, is_mtp_layer: bool = False) -> None:
        norm = getattr(config, "dtopp_routing_norm", "none")
        if norm not in ("none", "fixed"):
            raise ValueError(f"dtopp_routing_norm: {norm!r} is not available with Top-k routing (a learnable theta "
                             "is DTop-p's DRN); use 'fixed' or 'none'")
        super().__init__(config=config, pg_collection=pg_collection, is_mtp_layer=is_mtp_layer)
        self.routing_theta = config.dtopp_routing_norm_init if norm == "fixed" else None

    def apply_z_loss(self, logits, padding_mask=None):
        # megatron's routing() scores whatever this returns, right after the z-loss: normalising
        # here keeps the z-loss on the raw logits and feeds the normalised ones to the top-k
        # selection, the routing weights and the load-balancing scores alike.
        logits = super().apply_z_loss(logits, padding_mask=padding_mask)
        if self.routing_theta is None:
            return logits
        return normalize_routing_logits(logits, self.routing_theta)

    def _apply_expert_bias(self, routing_map, padding_mask=None):
        if padding_mask is not None:
            padding_mask = padding_mask.unsqueeze(-1)  # [tokens, 1]: masks whole rows of the routing map
        return super()._apply_expert_bias(routing_map, padding_mask=padding_mask)

    # The three load-balancing losses below are megatron's (TopKRouter._apply_aux_loss,
    # _apply_seq_aux_loss, _apply_global_aux_loss), with the token count through _at_least_one.

    def _apply_aux_loss(self, probs, scores_for_aux_loss, routing_map, with_padding_mask=False):
        coeff = self.get_aux_loss_coeff("aux_loss")
        if coeff == 0:
            return probs
        tokens_per_expert, local_num_tokens, total_num_tokens = get_tokens_per_expert_and_token_count(
            routing_map=routing_map, reduce_group=self.tp_cp_group, topk=self.topk, with_padding_mask=with_padding_mask)
        aux_loss = switch_load_balancing_loss_func(
            probs=scores_for_aux_loss, tokens_per_expert=tokens_per_expert,
            total_num_tokens=_at_least_one(total_num_tokens), topk=self.topk,
            num_experts=self.config.num_moe_experts, moe_aux_loss_coeff=coeff, fused=self.config.moe_router_fusion)
        return self.attach_and_log_load_balancing_loss(
            probs, coeff, aux_loss, "load_balancing_loss", self.tp_cp_group, valid_token_count=local_num_tokens)

    def _apply_seq_aux_loss(self, probs, scores_for_aux_loss, routing_map, seq_length, bsz, with_padding_mask=False):
        coeff = self.get_aux_loss_coeff("seq_aux_loss")
        if coeff == 0:
            return probs
        # One "expert" per (sequence, expert): the loss sums over the sequences.
        scores_for_aux_loss = scores_for_aux_loss.reshape(seq_length, -1)
        routing_map = routing_map.reshape(seq_length, -1)
        tokens_per_expert, local_num_tokens, total_num_tokens = get_tokens_per_expert_and_token_count(
            routing_map=routing_map, reduce_group=self.tp_cp_group, with_padding_mask=with_padding_mask,
            topk=self.topk * bsz)
        aux_loss = switch_load_balancing_loss_func(
            probs=scores_for_aux_loss, tokens_per_expert=tokens_per_expert,
            total_num_tokens=_at_least_one(total_num_tokens), topk=self.topk,
            num_experts=self.config.num_moe_experts, moe_aux_loss_coeff=coeff,
            fused=self.config.moe_router_fusion) / bsz
        return self.attach_and_log_load_balancing_loss(
            probs, coeff, aux_loss, "seq_load_balancing_loss", self.tp_cp_group,
            valid_token_count=local_num_tokens * bsz)

    def _apply_global_aux_loss(self, probs, scores_for_aux_loss, routing_map, with_padding_mask=False):
        coeff = self.get_aux_loss_coeff("global_aux_loss")
        if coeff == 0:
            return probs
        tokens_per_expert, local_num_tokens, total_num_tokens = get_tokens_per_expert_and_token_count(
            routing_map=routing_map, reduce_group=self.tp_dp_cp_group, with_padding_mask=with_padding_mask,
            topk=self.topk)
        self.global_tokens_per_expert += tokens_per_expert
        self.ga_steps += 1
        aux_loss = switch_load_balancing_loss_func(
            probs=scores_for_aux_loss, tokens_per_expert=self.global_tokens_per_expert / self.ga_steps,
            total_num_tokens=_at_least_one(total_num_tokens), topk=self.topk,
            num_experts=self.config.num_moe_experts, moe_aux_loss_coeff=coeff, fused=self.config.moe_router_fusion)
        return self.attach_and_log_load_balancing_loss(
            probs, coeff, aux_loss, "global_load_balancing_loss", self.tp_dp_cp_group, needs_dp_avg=False,
            valid_token_count=local_num_tokens)


def dtopp_routers(model_chunks: Iterable[torch.nn.Module], training_only: bool = True) -> list[DTopPRouter]:
    if isinstance(model_chunks, torch.nn.Module):
        model_chunks = [model_chunks]
    return [m for chunk in model_chunks for m in chunk.modules()
            if isinstance(m, DTopPRouter) and m.controlled and (m.training or not training_only)]


@torch.no_grad()
def update_dtopp_controllers(model_chunks, config: Optional[MoEConfig] = None) -> None:
    """Advance every DTop-p controller by one step; call once per global batch after
    ``finalize_model_grads`` (megatron's expert-bias update point).

    The activation counters of all micro-batches are all-reduced over the tensor/data/context
    parallel group (which also spans the expert-parallel ranks, since megatron carves EP out of
    DP for the dense parameters, routers included), and, for the global controller, over the
    pipeline stages too, so that p_t is the same on every rank. The update stays on the device:
    no host synchronisation. A step without training tokens leaves the state unchanged.

    Every pipeline stage must hold at least one DTop-p layer (all presets put MoE in every layer),
    otherwise the pipeline all-reduce of the global controller has a missing participant.
    """
    routers = dtopp_routers(model_chunks)
    if not routers:
        return
    config = config or routers[0].config
    stats = torch.stack([torch.cat([r.dtopp_active_sum, r.dtopp_token_count]) for r in routers])
    group = routers[0].tp_dp_cp_group
    if group is not None and torch.distributed.is_initialized() and group.size() > 1:
        torch.distributed.all_reduce(stats, group=group)
    if not config.dtopp_layerwise:
        stats = stats.sum(dim=0, keepdim=True)
        if parallel_state.model_parallel_is_initialized() and parallel_state.get_pipeline_model_parallel_world_size() > 1:
            torch.distributed.all_reduce(stats, group=parallel_state.get_pipeline_model_parallel_group())
        stats = stats.expand(len(routers), 2)
    seen = stats[:, 1] > 0
    active = stats[:, 0] / stats[:, 1].clamp(min=1)
    num_experts = config.num_moe_experts
    for router, a, has_tokens in zip(routers, active, seen):
        # Error normalised by the number of experts (paper, "Controller Stability").
        error = (router.target - a) / num_experts
        threshold, integral = pi_update(config.dtopp_p0, config.dtopp_kp, config.dtopp_ki, router.dtopp_integral, error)
        router.dtopp_threshold.copy_(torch.where(has_tokens, threshold, router.dtopp_threshold))
        router.dtopp_integral.copy_(torch.where(has_tokens, integral, router.dtopp_integral))
        router.dtopp_active_sum.zero_()
        router.dtopp_token_count.zero_()


def dtopp_finalize_model_grads(model, *args, **kwargs):
    """Megatron's ``finalize_model_grads`` followed by :func:`update_dtopp_controllers`; a drop-in
    ``config.finalize_model_grads_func``."""
    from megatron.core.distributed import finalize_model_grads

    result = finalize_model_grads(model, *args, **kwargs)
    update_dtopp_controllers(model)
    return result
