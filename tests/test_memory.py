"""Routed layers save their full-length router input once per block (megatron_xmod.xmod.routing_state), with the
gradients of today's ``nn.Linear`` router (up to float rounding); the memory estimate's per-layer activation
formulas against the bytes autograd actually saves."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from helpers import record_in_place, tiny_model

from bench.memory import saved_bytes_per_layer
from megatron_xmod.model import sparse_layers
from megatron_xmod.xmod.layers import XModSparseLayer

SEQ = 32
LAYOUT = "D + (S4*3 + D)*2"


def _plain_router(self, hidden_states, stream_grad=None):
    """Today's router (before megatron_xmod.xmod.routing_state): nn.Linear on the full input, which autograd saves."""
    return F.linear(hidden_states, self.router.weight).squeeze(-1).float(), None, hidden_states  # the step adds the bias


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


@pytest.mark.parametrize("family,layout", [("xmod", LAYOUT), ("mod", LAYOUT), ("xmod", "S4*8 + D")])
def test_chained_router_gradients_equal_plain_linear(seeded, monkeypatch, family, layout):
    model, _ = tiny_model(layout, seq_len=SEQ, xmod_routing_family=family)
    _sharpen(model)
    model.train()
    loss, grads = _step(model)
    with monkeypatch.context() as patch:
        patch.setattr(XModSparseLayer, "_router_logits", _plain_router)
        reference_loss, reference_grads = _step(model)
    assert torch.equal(loss, reference_loss)
    assert grads.keys() == reference_grads.keys()
    routers = [name for name in grads if "router.weight" in name]
    assert len(routers) == (6 if layout == LAYOUT else 8)
    # The chain adds a router's input-gradient term to the rows' gradient in one addcmul where autograd sums two
    # tensors: a sum in another order (fused or not), bit for bit or not depending on the CPU's vector path (on
    # an AVX-512 machine the last bits differ, ~3e-8 relative, and reach the routers of the layers below).
    for name, grad in grads.items():
        scale = float(reference_grads[name].abs().max())
        torch.testing.assert_close(grad, reference_grads[name], rtol=1e-5, atol=1e-6 * scale, msg=name)
    assert all(grads[name].abs().sum() > 0 for name in routers)


def _saved_storages(model, run):
    """{storage pointer: (shape, bytes)} of every tensor autograd saves while ``run`` runs (no parameters)."""
    params = {p.data_ptr() for p in model.parameters()}
    saved, kept = {}, []  # the graph keeps indices into ``kept`` (a saved output returned by the hook is a cycle)

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = (tuple(t.shape), t.untyped_storage().nbytes())
        kept.append(t)
        return len(kept) - 1

    with torch.autograd.graph.saved_tensors_hooks(pack, kept.__getitem__):
        out = run()
    return saved, out


@pytest.mark.parametrize("family", ["xmod", "mod"])
def test_eager_in_place_update_equals_the_gather_and_scatter_path(seeded, monkeypatch, family):
    """On CPU (torch permutation backend) the eager routed layers add their update into the block's residual stream
    in place after each chain's first layer; loss and gradients equal the kernel backends' path (gather, gated
    scatter into a new stream), which the layer takes when told the kernels were selected."""
    import megatron_xmod.xmod.layers as layers

    model, _ = tiny_model(LAYOUT, seq_len=SEQ, xmod_routing_family=family)
    _sharpen(model)
    model.train()
    in_place = record_in_place(sparse_layers(model))
    loss, grads = _step(model)
    assert in_place == [False, True, True] * 2  # D + (S4*3 + D)*2: two chains of three
    with monkeypatch.context() as patch:
        patch.setattr(layers, "selected_backend", lambda x: "triton")
        reference_loss, reference_grads = _step(model)
    assert in_place[6:] == [False] * 6
    torch.testing.assert_close(loss, reference_loss, rtol=1e-6, atol=0)
    assert grads.keys() == reference_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference_grads[name], rtol=1e-5,
                                   atol=1e-6 * float(reference_grads[name].abs().max()), msg=name)


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


def test_chain_backward_copies_rows_linearly_in_block_length(seeded):
    """Backward rebuilds the N router inputs of a block walking one buffer back a layer at a time: 2N - 3
    row copies for N = 8 (N - 1 to build the last layer's input, one per earlier layer to step back),
    where rebuilding each layer's input from the block base took N(N - 1)/2 = 28."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class RowCopies(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.index_copy_.default:
                RowCopies.count += 1
            return func(*args, **(kwargs or {}))

    model, _ = tiny_model("S4*8", seq_len=SEQ)
    _sharpen(model)
    model.train()
    tokens = torch.randint(0, 256, (2, SEQ))
    loss = model(tokens, torch.arange(SEQ).expand_as(tokens), None, labels=tokens).float().mean()
    with RowCopies():
        loss.backward()
    assert RowCopies.count == 2 * 8 - 3
    assert all(layer.router.weight.grad.abs().sum() > 0 for layer in sparse_layers(model))


def test_chain_cursor_rebuilds_any_layer_in_any_order():
    """ChainCursor against rebuilding from the base (clone, then every earlier layer's rows in order), with
    rows that later layers overwrite again, for layers asked in an arbitrary order."""
    from megatron_xmod.xmod.routing_state import ChainCursor, ChainLink

    g = torch.Generator().manual_seed(0)
    base = torch.randn(16, 2, 4, generator=g)
    links, x = [], base.clone()
    for _ in range(6):  # each "layer" overwrites 5 random flat rows of its input
        index = torch.randperm(32, generator=g)[:5]
        flat = x.view(-1, 4)
        before = flat.index_select(0, index)
        flat.index_copy_(0, index, torch.randn(5, 4, generator=g))
        links.append(ChainLink(index, flat.index_select(0, index), before))

    def reference(layer):
        y = base.clone()
        for link in links[:layer]:
            y.view(-1, 4).index_copy_(0, link.index, link.after)
        return y

    cursor = ChainCursor()
    for layer in (6, 5, 2, 4, 0, 3, 6, 1):
        assert torch.equal(cursor.input(base, links[:layer]), reference(layer)), layer
    assert cursor.input(base, []) is base


# ------------------------------------------------------------------ the estimate's per-layer formulas
def _measure_layers(layout, family="xmod", seq=64):
    from helpers import TINY

    model, config = tiny_model(layout, seq_len=seq, xmod_routing_family=family) if "S" in layout else tiny_model(layout, seq_len=seq)
    model.train()
    x = torch.randn(seq, 1, config.hidden_size, requires_grad=True)
    # the counter bench/memory.py reports with: each distinct non-parameter storage once
    return TINY, saved_bytes_per_layer(model, x, model.rotary_pos_emb(seq))


@pytest.mark.parametrize("family", ["xmod", "mod"])
def test_activation_formulas_match_saved_bytes(seeded, family):
    """What ``xmod count --memory`` assumes per layer, against what autograd saves (within 10%)."""
    from megatron_xmod.training.memory_estimate import block_base_bytes, dense_layer_bytes, routed_layer_bytes

    backbone, (dense,) = _measure_layers("D")
    assert dense == pytest.approx(dense_layer_bytes(backbone, 64), rel=0.1)
    _, (first, second) = _measure_layers("S4*2", family)
    routed = routed_layer_bytes(backbone, 64, 4, family)
    assert second == pytest.approx(routed, rel=0.1)
    # the first routed layer of a block holds the block's base instead of the previous layer's rows
    assert first == pytest.approx(routed + block_base_bytes(backbone, 64) - 64 / 4 * backbone.hidden_size * 4, rel=0.1)


def test_count_memory_prints_parts_and_refuses_above_the_gpu_memory(capsys):
    import argparse

    from megatron_xmod.presets import get_backbone, parse_model
    from megatron_xmod.training.memory_estimate import Parallel, add_memory_arguments, estimate, print_memory

    parser = argparse.ArgumentParser()
    parser.add_argument("--dense-prefix", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--seq-len", type=int, default=32768)
    add_memory_arguments(parser)
    b = get_backbone("1.65b")
    args = parser.parse_args(["--memory", "--tp", "8", "--dp", "8", "--recompute", "selective", "--distributed-optimizer"])
    assert print_memory(args, b, ["dense", "xmod-a3k16"]) == 0
    out = capsys.readouterr().out
    for part in ("weights", "gradients", "optimizer state", "activations: routed layers", "logits", "total"):
        assert part in out
    args.gpu_mem_gb = 10.0
    assert print_memory(args, b, ["xmod-a3k16"]) == 1
    assert "gpu_mem_gb" in capsys.readouterr().out
    # sequence parallelism divides the activations by TP; the distributed optimizer the state by DP
    model = parse_model("xmod-a3k16", b)
    plain = estimate(model, 32768, Parallel(tp=8, dp=8))
    sp = estimate(model, 32768, Parallel(tp=8, dp=8, sequence_parallel=True, distributed_optimizer=True))
    assert sp.activations_routed_layers < 0.5 * plain.activations_routed_layers
    assert sp.optimizer_state == pytest.approx(plain.optimizer_state / 8)
    with pytest.raises(ValueError, match="recompute"):
        Parallel(recompute="some")


def test_count_memory_under_context_parallelism():
    """--cp: dense layers, block bases and logits at L/CP positions (plus the dense layers' gathered keys and
    values); routed layers at their static CP width min(L/K, L/CP) per sequence, so at K >= CP they do not shrink."""
    from megatron_xmod.presets import get_backbone, parse_model
    from megatron_xmod.training.memory_estimate import Parallel, dense_layer_bytes, estimate, gathered_kv_bytes

    b = get_backbone("1.65b")
    base = Parallel(tp=8, dp=8, sequence_parallel=True, recompute="selective")
    one, two = (estimate(parse_model("xmod-a3k16", b), 32768, dataclasses.replace(base, cp=cp)) for cp in (1, 2))
    assert two.logits == pytest.approx(one.logits / 2)
    assert two.activations_block_bases == pytest.approx(one.activations_block_bases / 2)
    assert two.activations_routed_layers >= one.activations_routed_layers  # K = 16 >= CP: the same width
    dense_one = estimate(parse_model("dense", b), 32768, base).activations_dense_layers
    dense_two = estimate(parse_model("dense", b), 32768, dataclasses.replace(base, cp=2)).activations_dense_layers
    per_layer = dense_layer_bytes(b, 16384, 2, 8, True, "selective") + gathered_kv_bytes(b, 16384, 2, 8, 2)
    assert dense_two == pytest.approx(dense_one * per_layer / dense_layer_bytes(b, 32768, 2, 8, True, "selective"))
    with pytest.raises(ValueError, match="seq_len: context parallelism"):
        estimate(parse_model("dense", b), 32766, Parallel(cp=2))
    with pytest.raises(ValueError, match="cp: must be >= 1"):
        Parallel(cp=0)


@pytest.mark.parametrize("tp, sp, seq, ok", [(1, False, 64, True), (1, False, 66, False), (2, True, 76, False),
                                             (2, True, 80, True)])
def test_preflight_checks_the_sequence_split_of_context_parallelism(tp, sp, seq, ok):
    import types

    from megatron_xmod.training.preflight import check_context_parallel

    args = types.SimpleNamespace(context_parallel_size=2, tensor_model_parallel_size=tp, sequence_parallel=sp,
                                 seq_length=seq)
    if ok:
        check_context_parallel(args)
    else:
        with pytest.raises(ValueError, match="seq_length: context parallelism splits a sequence into"):
            check_context_parallel(args)
