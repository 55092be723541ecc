"""megatron's full activation recompute (uniform and block) with the token-choice bias on: the replay
of a checkpointed chunk routes exactly as the first pass did (megatron_xmod.xmod.routing_state.RecomputeReplay), so
losses and gradients equal those without recompute."""
import pytest
import torch
from helpers import tiny_model

from megatron_xmod.model import sparse_layers
from megatron_xmod.xmod.layers import XModSparseLayer
from megatron_xmod.xmod.routing_state import report

SEQ = 32
LAYOUT = "D + (S4*3 + D)*2"
RECOMPUTE = {
    "uniform-1": dict(recompute_method="uniform", recompute_num_layers=1),
    "uniform-2": dict(recompute_method="uniform", recompute_num_layers=2),
    "block-5": dict(recompute_method="block", recompute_num_layers=5),
}


def _steps(model, steps=2):
    """Two micro-batches, each forward + backward (gradients accumulate, as in a training step)."""
    losses = []
    model.zero_grad()
    for seed in range(steps):
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, 256, (2, SEQ), generator=g)
        loss = model(tokens, torch.arange(SEQ).expand_as(tokens), None, labels=tokens).float().mean()
        loss.backward()
        losses.append(loss.detach())
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return torch.stack(losses), grads, report(model)


def _models(recompute):
    reference, _ = tiny_model(LAYOUT, seq_len=SEQ, xmod_token_choice_bias_tau=2.0)
    with torch.no_grad():  # content-dependent routing, where the carried bias changes the selection
        for layer in sparse_layers(reference):
            layer.router.weight.mul_(20.0)
    model, _ = tiny_model(LAYOUT, seq_len=SEQ, xmod_token_choice_bias_tau=2.0, recompute_granularity="full",
                          **RECOMPUTE[recompute])
    model.load_state_dict(reference.state_dict())
    reference.train()
    model.train()
    return reference, model


@pytest.mark.parametrize("recompute", [name if name == "uniform-1" else pytest.param(name, marks=pytest.mark.slow)
                                       for name in RECOMPUTE])
def test_full_recompute_equals_no_recompute(seeded, recompute):
    reference, model = _models(recompute)
    losses, grads, stats = _steps(model)
    ref_losses, ref_grads, ref_stats = _steps(reference)
    torch.testing.assert_close(losses, ref_losses, rtol=0, atol=0)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-6, atol=1e-7, msg=name)
    # same routing statistics, each recorded once per micro-batch (the replay records nothing)
    assert stats.keys() == ref_stats.keys()
    for name, value in stats.items():
        assert value == pytest.approx(ref_stats[name], rel=1e-6), name


def test_recompute_without_the_replayed_bias_would_route_differently(seeded, monkeypatch):
    """The check above can fail: a replay that takes the carried bias like a normal forward (what
    megatron's replay order hands it) gives different gradients."""
    reference, model = _models("uniform-1")
    ref_losses, ref_grads, _ = _steps(reference)

    def naive_take_bias(self, state, shape, phase):
        return state.take_bias(self.layer_number, shape)

    monkeypatch.setattr(XModSparseLayer, "_take_bias", naive_take_bias)
    _, grads, _ = _steps(model)
    assert any(not torch.allclose(grads[name], ref_grads[name]) for name in grads)
