"""DTop-p router: Top-p selection vs a plain reference, the PI controller on a drifting stream,
the layer-wise variant, DRN, losses, checkpointing and dispatcher rules."""
import io
import math

import pytest
import torch

from megatron_xmod.moe.config import MoEConfig
from megatron_xmod.moe.router import THRESHOLD_EPS, DTopPRouter, top_p_routing, update_dtopp_controllers
from megatron_xmod.xmod.routing_state import attach_routing_state, report

pytestmark = pytest.mark.usefixtures("fresh_moe_tracker")


def reference_top_p(probs: torch.Tensor, p: float):
    """Plain per-token loop: experts by decreasing probability (ties: lower index first), added
    while the mass collected so far is below p; weights renormalised over the chosen set."""
    weights = torch.zeros_like(probs)
    chosen = torch.zeros(probs.shape, dtype=torch.bool)
    for t, row in enumerate(probs.tolist()):
        order = sorted(range(len(row)), key=lambda i: (-row[i], i))
        mass, picked = 0.0, []
        for i in order:
            if picked and mass >= p:
                break
            picked.append(i)
            mass += row[i]
        total = sum(row[i] for i in picked)
        for i in picked:
            chosen[t, i] = True
            weights[t, i] = row[i] / total
    return weights, chosen


def _probs(tokens=64, experts=16, seed=0, ties=False):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=g, dtype=torch.float64) * 2
    if ties:  # several experts share each logit value, including at the cut
        logits = torch.round(logits)
    return torch.softmax(logits, dim=-1)


@pytest.mark.parametrize("p", [1e-9, 0.1, 0.25, 0.5, 0.8, 0.95, 1 - 1e-9, 1.0])
@pytest.mark.parametrize("ties", [False, True])
def test_top_p_matches_plain_reference(p, ties):
    probs = _probs(ties=ties, seed=int(p * 1000) + ties)
    weights, routing_map = top_p_routing(probs, p)
    ref_weights, ref_map = reference_top_p(probs, p)
    assert torch.equal(routing_map, ref_map)
    torch.testing.assert_close(weights, ref_weights, rtol=0, atol=1e-12)
    assert torch.allclose(weights.sum(-1), torch.ones(len(probs), dtype=probs.dtype))


def test_top_p_limits_and_monotonicity():
    probs = _probs(tokens=256, experts=32, seed=3)
    assert (top_p_routing(probs, 1e-9)[1].sum(-1) == 1).all()  # p -> 0: the best expert only
    assert torch.equal(top_p_routing(probs, 1e-9)[1].float().argmax(-1), probs.argmax(-1))
    assert (top_p_routing(probs, 1.0)[1].sum(-1) >= 31).all()  # p -> 1: (almost) all experts
    counts = [top_p_routing(probs, p)[1].sum().item() for p in (0.1, 0.3, 0.5, 0.7, 0.9)]
    assert counts == sorted(counts) and counts[0] < counts[-1]  # the controller relies on this
    threshold = torch.tensor([0.5], dtype=torch.float64)  # a tensor threshold (the router's buffer)
    assert torch.equal(top_p_routing(probs, threshold)[1], top_p_routing(probs, 0.5)[1])


def make_config(**overrides):
    fields = dict(num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, num_moe_experts=64,
                  moe_router_type="dtopp", dtopp_target_experts=8.0, dtopp_routing_norm="none",
                  moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="aux_loss",
                  moe_aux_loss_coeff=1e-4, use_cpu_initialization=True, add_bias_linear=False)
    fields.update(overrides)
    return MoEConfig(**fields)


def make_routers(config, layers=1):
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    routers = torch.nn.ModuleList()
    for layer in range(1, layers + 1):
        router = DTopPRouter(config, pg_collection=get_default_pg_collection())
        router.set_layer_number(layer)
        routers.append(router)
    attach_routing_state(routers)
    return routers


def simulate(routers, steps, tokens, scale_of, seed=0):
    """Feed each router a stream of hidden states whose scale (hence logit entropy) follows
    ``scale_of(step, layer)``; one controller update per step. Returns per-step mean activations."""
    g = torch.Generator().manual_seed(seed)
    hidden = routers[0].config.hidden_size
    with torch.no_grad():
        for router in routers:
            router.weight.copy_(torch.randn(router.weight.shape, generator=g) / math.sqrt(hidden))
    curve = []
    for step in range(steps):
        row = []
        for layer, router in enumerate(routers):
            x = torch.randn(tokens, 1, hidden, generator=g) * scale_of(step, layer)
            _, routing_map = router(x)
            row.append(routing_map.sum().item() / tokens)
        update_dtopp_controllers(routers)
        curve.append(row)
    return curve


def _windows(curve, size):
    return [round(sum(curve[i:i + size]) / size, 3) for i in range(0, len(curve), size)]


def test_pi_controller_paper_gains_converge(seeded):
    """Paper settings (K_pro = K_int = 0.1, p_0 = 0.25), 64 experts, T = 8: from p_0 the mean
    activation reaches the target and stays within +-2%."""
    (router,) = make_routers(make_config())
    curve = [row[0] for row in simulate([router], 300, 256, lambda step, layer: 1.5)]
    print("paper gains, mean active experts per 50 steps:", _windows(curve, 50))
    assert curve[0] < 0.8 * 8  # p_0 = 0.25 starts well below the target
    assert abs(sum(curve[-150:]) / 150 - 8) <= 0.02 * 8


def test_pi_controller_tracks_target_while_entropy_drifts(seeded):
    """The logit scale drifts from 1 to 2.5 and back (the routing entropy falls and rises) over
    800 steps; every 50-step window after the first 100 steps stays within +-2% of T = 8.
    Gains 1.0 (10x the paper's) let 800 simulated steps stand for a long training run; the loop
    gain is K_int * (d a / d p) / N, which stays below 1 here (flat logits: d a / d p ~ N).
    DRN is off (``make_config``): it would normalise a pure scale drift away."""
    (router,) = make_routers(make_config(dtopp_kp=1.0, dtopp_ki=1.0))

    def scale(step, layer):
        return 1.0 + 1.5 * 0.5 * (1 - math.cos(2 * math.pi * step / 800))

    curve = [row[0] for row in simulate([router], 800, 256, scale)]
    windows = _windows(curve, 50)
    print("drifting entropy, mean active experts per 50 steps:", windows)
    assert all(abs(w - 8) <= 0.02 * 8 for w in windows[2:]), windows
    assert 0 < router.dtopp_threshold.item() < 1


def test_layerwise_variant_tracks_every_layer_target(seeded):
    targets = (2.0, 6.0, 12.0)
    config = make_config(num_layers=3, dtopp_layerwise=True, dtopp_layer_targets=targets, dtopp_kp=0.5, dtopp_ki=0.5)
    routers = make_routers(config, layers=3)
    # Layers see different entropies (scale 0.5, 1.5, 3): one global threshold could not fit all.
    curve = simulate(routers, 300, 512, lambda step, layer: (0.5, 1.5, 3.0)[layer])
    for layer, target in enumerate(targets):
        tail = sum(row[layer] for row in curve[-100:]) / 100
        assert abs(tail - target) <= 0.02 * target, (layer, tail, target)
    thresholds = [r.dtopp_threshold.item() for r in routers]
    assert len(set(thresholds)) == 3


def test_global_controller_keeps_one_threshold_for_all_layers(seeded):
    config = make_config(num_layers=3, dtopp_kp=0.5, dtopp_ki=0.5)
    routers = make_routers(config, layers=3)
    curve = simulate(routers, 300, 256, lambda step, layer: (0.5, 1.5, 3.0)[layer])
    thresholds = {r.dtopp_threshold.item() for r in routers}
    assert len(thresholds) == 1
    mean = sum(sum(row) / 3 for row in curve[-100:]) / 100  # the mean over layers is what it controls
    assert abs(mean - 8) <= 0.02 * 8
    per_layer = [sum(row[i] for row in curve[-100:]) / 100 for i in range(3)]
    assert per_layer[0] > per_layer[2]  # flatter logits (layer 1) recruit more experts


def test_controller_update_rule_and_clipping(seeded):
    config = make_config(dtopp_kp=0.3, dtopp_ki=0.2, dtopp_p0=0.4)
    (router,) = make_routers(config)
    router.dtopp_active_sum.fill_(3 * 100.0)  # a = 3 experts per token over 100 tokens
    router.dtopp_token_count.fill_(100.0)
    update_dtopp_controllers([router])
    e = (8 - 3) / 64
    assert router.dtopp_integral.item() == pytest.approx(e)
    assert router.dtopp_threshold.item() == pytest.approx(0.4 + 0.3 * e + 0.2 * e)
    assert router.dtopp_active_sum.item() == 0 and router.dtopp_token_count.item() == 0
    before = router.dtopp_threshold.clone()
    update_dtopp_controllers([router])  # no tokens seen: the state must not move
    assert torch.equal(router.dtopp_threshold, before)
    router.dtopp_integral.fill_(100.0)
    router.dtopp_active_sum.fill_(1.0)
    router.dtopp_token_count.fill_(1.0)
    update_dtopp_controllers([router])
    assert router.dtopp_threshold.item() == pytest.approx(1 - THRESHOLD_EPS)  # clipped into (0, 1)


def test_fixed_threshold_ablation_never_moves(seeded):
    config = make_config(moe_router_type="topp-fixed", dtopp_target_experts=None, dtopp_p0=0.3, dtopp_routing_norm=None)
    assert config.dtopp_routing_norm == "fixed"  # the paper's Top-p baseline: 'Global 1.0'
    routers = make_routers(config)
    simulate(routers, 5, 64, lambda step, layer: 1.0)
    assert routers[0].dtopp_threshold.item() == pytest.approx(0.3)


def test_drn_theta_moves_activation_and_gets_gradient(seeded):
    config = make_config(dtopp_routing_norm="learnable", dtopp_p0=0.5)
    (router,) = make_routers(config)
    x = torch.randn(256, 1, 32)
    counts = {}
    for theta in (0.5, 1.0, 2.0, 4.0):
        with torch.no_grad():
            router.drn_scale.fill_(theta)
        router.eval()
        counts[theta] = router(x)[1].sum().item()
    # A larger theta sharpens the distribution: fewer experts reach the same mass.
    assert counts[0.5] > counts[1.0] > counts[2.0] > counts[4.0]
    router.train()
    with torch.no_grad():
        router.drn_scale.fill_(1.0)
    probs, routing_map = router(x)
    (probs * torch.randn_like(probs)).sum().backward()
    assert router.drn_scale.grad is not None and router.drn_scale.grad.abs().item() > 0
    assert router.weight.grad.abs().sum() > 0


def test_losses_are_attached_and_reported_separately(seeded):
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    config = make_config(dtopp_dynamic_loss_coeff=1e-3, moe_z_loss_coeff=1e-3)
    (router,) = make_routers(config)
    get_moe_metrics_tracker().clear()
    probs, _ = router(torch.randn(128, 1, 32))
    tracked = get_moe_metrics_tracker().metrics
    assert tracked["load_balancing_loss"].values.sum() > 0
    assert tracked["z_loss"].values.sum() > 0
    reported = report(router)
    assert reported["dtopp_dynamic_loss"] > 0 and "dtopp_active_experts" in reported and "dtopp_threshold" in reported
    # The dynamic loss is the entropy: its gradient flows into the router weight even if the
    # model output ignores the routing weights.
    probs.sum().backward()
    assert router.weight.grad.abs().sum() > 0


def test_controller_state_checkpoint_roundtrip(seeded):
    config = make_config(num_layers=2, dtopp_layerwise=True, dtopp_routing_norm="learnable")
    routers = make_routers(config, layers=2)
    simulate(routers, 7, 64, lambda step, layer: 1.0 + layer)
    buffer = io.BytesIO()
    torch.save(routers.state_dict(), buffer)
    restored = make_routers(config, layers=2)
    buffer.seek(0)
    restored.load_state_dict(torch.load(buffer))
    for a, b in zip(routers, restored):
        assert a.dtopp_threshold.item() != config.dtopp_p0
        assert torch.equal(a.dtopp_threshold, b.dtopp_threshold) and torch.equal(a.dtopp_integral, b.dtopp_integral)
    # Megatron's distributed checkpoint sees the same state (replicated on every rank).
    keys = routers[0].sharded_state_dict(prefix="router.").keys()
    assert {"router.dtopp_threshold", "router.dtopp_integral", "router.drn_scale"} <= set(keys)
    # The counters are per global batch, not state.
    assert "dtopp_active_sum" not in routers[0].state_dict()


@pytest.mark.parametrize("overrides, field", [
    (dict(moe_token_dispatcher_type="alltoall"), "moe_expert_capacity_factor"),
    (dict(moe_token_dispatcher_type="flex"), "moe_token_dispatcher_type"),
    (dict(moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid"), "moe_router_enable_expert_bias"),
    (dict(moe_router_score_function="sigmoid"), "moe_router_score_function"),
    (dict(moe_router_load_balancing_type="seq_aux_loss"), "moe_router_load_balancing_type"),
    (dict(moe_router_type="topp"), "moe_router_type"),
    (dict(dtopp_target_experts=None), "dtopp_target_experts"),
    (dict(dtopp_target_experts=65.0), "dtopp_target_experts"),
    (dict(dtopp_p0=1.0), "dtopp_p0"),
    (dict(dtopp_kp=-1.0), "dtopp_kp"),
    (dict(dtopp_routing_norm="layer"), "dtopp_routing_norm"),
    (dict(dtopp_layer_targets=(8.0,)), "dtopp_layer_targets"),
    (dict(dtopp_layerwise=True, dtopp_layer_targets=(8.0, 8.0)), "dtopp_layer_targets"),
])
def test_config_rejects_unsupported_combinations(overrides, field):
    with pytest.raises(ValueError, match=field):
        make_config(**overrides)


def test_alltoall_with_capacity_is_accepted():
    config = make_config(moe_token_dispatcher_type="alltoall", moe_expert_capacity_factor=64.0)
    assert config.moe_token_dispatcher_type == "alltoall"


def test_drn_temperature_is_tagged_for_sequence_parallel(seeded):
    """theta_l is replicated over TP like the gate weight; under sequence parallelism each TP rank
    routes its own tokens, so megatron's finalize_model_grads must sum its gradient over TP, which it
    does for parameters tagged ``sequence_parallel`` (tests/test_dtopp_dist.py runs it on 2 ranks)."""
    config = make_config(dtopp_routing_norm="learnable", tensor_model_parallel_size=2, sequence_parallel=True)
    (router,) = make_routers(config)
    assert router.drn_scale.sequence_parallel is True and router.weight.sequence_parallel is True
    (router,) = make_routers(make_config(dtopp_routing_norm="learnable"))
    assert router.drn_scale.sequence_parallel is False  # as megatron tags the weight without SP


def _tracked(name):
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    return get_moe_metrics_tracker().metrics[name].values.sum()


@pytest.mark.parametrize("per_token_loss", [False, True])
def test_all_padding_micro_batch_gives_zero_losses_and_finite_gradients(seeded, per_token_loss):
    """A micro-batch of padding only: megatron's load-balancing formula would divide 0 by 0 (no
    valid token, no expert count); the losses must be 0 and the router gradients finite."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    config = make_config(dtopp_routing_norm="learnable", dtopp_dynamic_loss_coeff=1e-3, moe_z_loss_coeff=1e-3,
                         calculate_per_token_loss=per_token_loss)
    (router,) = make_routers(config)
    get_moe_metrics_tracker().clear()
    probs, _ = router(torch.randn(16, 2, 32), padding_mask=torch.ones(16, 2, dtype=torch.bool))
    probs.sum().backward()
    for name, param in router.named_parameters():
        assert torch.isfinite(param.grad).all(), name
    assert _tracked("load_balancing_loss") == 0 and _tracked("z_loss") == 0
    assert report(router)["dtopp_dynamic_loss"] == 0
    assert router.dtopp_token_count.item() == 0  # and the controller saw no token


def test_load_balancing_loss_with_padding_matches_the_formula(seeded):
    """N * sum_i f_i Q_i over the valid tokens only, f_i the share of all (token, expert) assignments
    that went to expert i and Q_i the mean routing probability: the padding guard leaves a batch
    with valid tokens exactly as before."""
    config = make_config(num_moe_experts=8, dtopp_target_experts=2.0, dtopp_p0=0.6, moe_aux_loss_coeff=1e-2)
    (router,) = make_routers(config)
    router.eval()  # no losses attached: the reference scores
    x = torch.randn(12, 2, 32)
    padding = torch.zeros(12, 2, dtype=torch.bool)
    padding[9:] = True  # the last 3 positions of both sequences
    with torch.no_grad():
        scores = router.routing_scores(router.gating(x).view(-1, 8))
    valid = ~padding.reshape(-1)
    _, routing_map = top_p_routing(scores, router.dtopp_threshold)
    counts = routing_map[valid].sum(dim=0).double()
    expected = 8 * (counts / counts.sum() * scores[valid].double().mean(dim=0)).sum()
    router.train()
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    get_moe_metrics_tracker().clear()
    router(x, padding_mask=padding)
    assert _tracked("load_balancing_loss").item() == pytest.approx(expected.item(), rel=1e-5)


def test_graph_capture_runs_leave_the_controller_counters_and_statistics_alone(seeded):
    """What megatron's CUDA-graph capture runs through a DTop-p layer (routing_state.kept_through, patches 27
    / 28) adds nothing to the activation counters the controller reads at the end of the step, nor to
    the interval statistics; the counters stay the same tensors. Also when the capture's forward is the
    router's first, which replaces the counters that Float16Module cast to bf16 with fp32 ones: the
    counters then in use get the values back."""
    from megatron_xmod.xmod.routing_state import kept_through

    (router,) = routers = make_routers(make_config())
    hidden = router.config.hidden_size
    with torch.no_grad():
        router.dtopp_active_sum.fill_(24.0)
        router.dtopp_token_count.fill_(3.0)
    cast = {name: getattr(router, name) for name in ("dtopp_active_sum", "dtopp_token_count")}
    for name, buffer in cast.items():
        setattr(router, name, buffer.to(torch.bfloat16))  # what Float16Module does to buffers
    with kept_through(routers):
        router(torch.randn(64, 1, hidden))
        assert router.dtopp_token_count.dtype == torch.float32 and router.dtopp_token_count.item() == 3.0 + 64
    for name, want in cast.items():
        torch.testing.assert_close(getattr(router, name), want, rtol=0, atol=0)
    router(torch.randn(64, 1, hidden))  # the training data's
    counters = [router.dtopp_active_sum, router.dtopp_token_count]
    before = [t.clone() for t in counters] + [routers.routing_state._stats.clone()]
    with kept_through(routers):
        router(torch.randn(64, 1, hidden))
        assert not torch.equal(router.dtopp_token_count, before[1])  # the capture's run counted
    for got, want in zip([router.dtopp_active_sum, router.dtopp_token_count, routers.routing_state._stats], before):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert router.dtopp_active_sum is counters[0] and router.dtopp_token_count is counters[1]
