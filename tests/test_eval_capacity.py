"""Threshold-rule evaluation at static widths (RoutingState.eval_capacity, install_capacity_check).

Sparse layers batch their threshold selections at a capacity sized from L/K and from their widest
selection in the previous pass; the decoder reads once per pass whether a sequence selected more and
then runs the pass again at exact widths. The claim tested here: that machinery changes nothing a
user sees beyond the rounding of other shapes. Logits and the routing statistics equal those of exact
widths (--xmod-eval-capacity-factor 0, the default: one host read per sparse layer) pass after pass,
also when a pass overflows and is run again.
"""
import pytest
import torch
from helpers import tiny_model

from megatron_xmod.model import sparse_layers
from megatron_xmod.xmod.config import XModConfig
from megatron_xmod.xmod.routing_state import eval_routing

SEQ = 32
LAYOUT = "D + (S4*3 + D)"  # three sparse layers in one block: the bias is carried between them


def _pair():
    """(capacity model, exact-width model) with the same weights and saturated routers (content-dependent
    selections of very different sizes per sequence)."""
    torch.manual_seed(0)
    model, _ = tiny_model(LAYOUT, seq_len=SEQ, xmod_eval_capacity_factor=1.0)
    exact, _ = tiny_model(LAYOUT, seq_len=SEQ)  # the default: exact widths
    exact.load_state_dict(model.state_dict())
    for m in (model, exact):
        with torch.no_grad():
            for layer in sparse_layers(m):
                layer.router.weight.mul_(20.0)
        m.eval()
    return model, exact


def _logits(model, tokens):
    with torch.no_grad(), eval_routing(model, "threshold"):
        return model(tokens, torch.arange(SEQ).expand_as(tokens), None)


def _statistics(model):
    state = sparse_layers(model)[0].routing_state
    return {key: (float(value), count) for key, (value, count) in state.items()}


def test_static_widths_give_the_logits_and_statistics_of_exact_widths(seeded):
    model, exact = _pair()
    state = sparse_layers(model)[0].routing_state
    assert state.capacity_checked and not sparse_layers(exact)[0].routing_state.eval_capacity_factor
    generator = torch.Generator().manual_seed(1)
    for step in range(3):
        tokens = torch.randint(0, 256, (3, SEQ), generator=generator)
        if step == 2:  # every token routed: wider than the previous pass sized, so the pass runs again
            for m in (model, exact):
                with torch.no_grad():
                    for layer in sparse_layers(m):
                        layer.router.bias.fill_(100.0)
        reruns = state.capacity_reruns
        torch.testing.assert_close(_logits(model, tokens), _logits(exact, tokens), atol=1e-5, rtol=1e-5)
        # pass 0 is sized from L/K alone and overflows; pass 1 fits the widths pass 0 saw; pass 2 overflows
        assert state.capacity_reruns - reruns == [1, 0, 1][step], step
        assert _statistics(model) == _statistics(exact), step  # counts, and ratios of the same counts
    widths = {layer: width for (layer, _), width in state._widest.items()}
    assert widths == {layer.layer_number: SEQ for layer in sparse_layers(model)}  # the last pass routed all


def test_the_widths_follow_the_router(seeded):
    """A narrower selection than the previous pass's gives a narrower batch next time: the capacity is
    max(F x L/K, 1.25 x the widest selection last pass), rounded up to 8, not a high-water mark."""
    model, _ = _pair()
    state = sparse_layers(model)[0].routing_state
    layer = sparse_layers(model)[0]
    tokens = torch.randint(0, 256, (3, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        layer.router.bias.fill_(100.0)  # layer 1 routes all 32 tokens
    _logits(model, tokens)
    assert state.eval_capacity(layer.layer_number, SEQ, 4, "cpu") == SEQ
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.bias.fill_(-100.0)  # then none
    _logits(model, tokens)
    assert state.eval_capacity(layer.layer_number, SEQ, 4, "cpu") == 8  # F x L/K = 8
    state._before_pass = None  # the probes above started a pass that no decoder ended


def test_observers_see_exact_widths(seeded):
    """The routing report's observers get each layer's decision once: no pass is run twice for them."""
    model, _ = _pair()
    state = sparse_layers(model)[0].routing_state
    seen = []
    state.observers.append(lambda layer, logits, decision: seen.append(layer))
    _logits(model, torch.randint(0, 256, (3, SEQ), generator=torch.Generator().manual_seed(3)))
    assert seen == [layer.layer_number for layer in sparse_layers(model)] and state.capacity_reruns == 0


def test_capacity_factor_is_checked():
    with pytest.raises(ValueError, match=r"xmod_eval_capacity_factor: must be a finite number >= 0"):
        XModConfig(num_layers=2, hidden_size=32, num_attention_heads=4, xmod_routing_family="xmod",
                   xmod_layout="D + S4", xmod_eval_capacity_factor=-1.0)
