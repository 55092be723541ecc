"""Routed layers save their full-length router input once per block (megatron_xmod.memory), with the
gradients of today's ``nn.Linear`` router bit for bit; the memory estimate's per-layer activation
formulas against the bytes autograd actually saves."""
import pytest
import torch
from helpers import tiny_model

from megatron_xmod.layers import XModSparseLayer
from megatron_xmod.model import sparse_layers

SEQ = 32
LAYOUT = "D + (S4*3 + D)*2"


def _plain_router(self, hidden_states):
    """Today's router (before megatron_xmod.memory): nn.Linear on the full input, which autograd saves."""
    return self.router(hidden_states).squeeze(-1).float(), None


def _step(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 256, (2, SEQ), generator=g)
    positions = torch.arange(SEQ).expand_as(tokens)
    loss = model(tokens, positions, None, labels=tokens).float().mean()
    model.zero_grad()
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _sharpen(model):
    with torch.no_grad():  # content-dependent routing, and a block bias that matters
        for layer in sparse_layers(model):
            layer.router.weight.mul_(20.0)


@pytest.mark.parametrize("family", ["xmod", "mod"])
def test_chained_router_gradients_equal_plain_linear_bit_for_bit(seeded, monkeypatch, family):
    model, _ = tiny_model(LAYOUT, seq_len=SEQ, xmod_routing_family=family)
    _sharpen(model)
    model.train()
    loss, grads = _step(model)
    with monkeypatch.context() as patch:
        patch.setattr(XModSparseLayer, "_router_logits", _plain_router)
        reference_loss, reference_grads = _step(model)
    assert torch.equal(loss, reference_loss)
    assert grads.keys() == reference_grads.keys()
    routers = [name for name in grads if "router.weight" in name]
    assert len(routers) == 6
    for name, grad in grads.items():
        assert torch.equal(grad, reference_grads[name]), name
    assert all(grads[name].abs().sum() > 0 for name in routers)


def _saved_storages(model, run):
    """{storage pointer: (shape, bytes)} of every tensor autograd saves while ``run`` runs (no parameters)."""
    params = {p.data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = (tuple(t.shape), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return saved, out


def test_one_full_length_router_input_per_block(seeded):
    """A block of three routed layers saves exactly one [L, b, h] tensor beyond its routed rows,
    where nn.Linear routers saved one per layer."""
    model, config = tiny_model("S4*3", seq_len=SEQ)
    model.train()
    layers = sparse_layers(model)
    x = torch.randn(SEQ, 2, config.hidden_size, requires_grad=True)
    rope = model.rotary_pos_emb(SEQ)

    def block():
        h = x
        for layer in layers:
            h, _ = layer(h, rotary_pos_emb=rope)
        return h

    def full_length(saved):
        h = config.hidden_size  # the layer input as saved by any op (nn.Linear flattens it)
        return [shape for shape, _ in saved.values() if shape in ((SEQ, 2, h), (SEQ * 2, h))]

    saved, out = _saved_storages(model, block)
    assert len(full_length(saved)) == 1  # the block input, shared by the three routers
    out.square().sum().backward()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(XModSparseLayer, "_router_logits", _plain_router)
        saved_before, _ = _saved_storages(model, block)
    assert len(full_length(saved_before)) == 3
