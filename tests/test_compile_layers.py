"""``--xmod-compile-layers``: every layer's compute is one compiled region (megatron_xmod.xmod.compile) that
equals the eager layer, is what the step runs, and is shared by the layers of one kind (a routed layer's update
written into the block's residual stream in place along a chain); what it does not
cover is refused by field name before anything is built. And the fused CPU Adam that megatron's optimizer
gets on CPU (cpu_shim patch 29) steps as torch's loop implementation does."""
import os
import sys

import pytest
import torch
from helpers import TINY, record_in_place, tiny_model

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_xmod.model import config_from_backbone, sparse_layers
from megatron_xmod.xmod.compile import CompiledDenseForward
from megatron_xmod.xmod.layout import parse_layout
from megatron_xmod.xmod.routing_state import report

LAYOUT = "D + (S4*3 + D) + S4*2"
SEQ, BATCH = 64, 2


def _step(model, tokens):
    """One top-k training forward and backward: (logits, {name: grad})."""
    model.train()
    for p in model.parameters():
        p.grad = None
    positions = torch.arange(SEQ).expand_as(tokens)
    logits = model(tokens, positions, None)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens.reshape(-1))
    loss.backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


class _Counting:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


def test_compiled_layers_equal_eager_and_run_as_shared_graphs(seeded):
    import torch._dynamo
    import torch._dynamo.utils

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager, _ = tiny_model(LAYOUT)
    compiled, _ = tiny_model(LAYOUT, xmod_compile_layers=True)
    compiled.load_state_dict(eager.state_dict())
    layers = list(compiled.decoder.layers)
    routed = sparse_layers(compiled)
    dense = [layer for layer in layers if layer not in routed]
    layout = parse_layout(LAYOUT)
    assert len(routed) == layout.num_sparse_layers == 5 and len(dense) == layout.num_layers - 5
    routed_calls, dense_calls = _Counting(routed[0].compiled_update), _Counting(dense[0].forward.compiled)
    for layer in routed:
        layer.compiled_update = routed_calls
    for layer in dense:
        assert isinstance(layer.forward, CompiledDenseForward)
        layer.forward.compiled = dense_calls
    in_place = record_in_place(routed)  # per routed layer call: did it write its update into its input's storage?
    tokens = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    for _ in range(2):  # the second step runs the compiled graphs, and the routing state carries over
        ref_logits, ref_grads = _step(eager, tokens)
        logits, grads = _step(compiled, tokens)
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
        assert grads.keys() == ref_grads.keys() and any("router" in name for name in grads)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-5, msg=name)
    # every layer ran its compiled region, each step; the routing state (bias hand-over, statistics) equals eager's
    assert routed_calls.calls == 2 * len(routed) and dense_calls.calls == 2 * len(dense)
    # The chains S4*3 and S4*2: each chain's first layer updates a copy of its input, the later ones write into it
    assert in_place == [False, True, True, False, True] * 2
    assert report(compiled) == pytest.approx(report(eager), abs=1e-6)
    # One graph per layer kind for training, not one per layer (fullgraph: a graph break would have raised).
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2
    assert not torch._dynamo.utils.counters["graph_break"]


def test_top_k_evaluation_runs_compiled_and_in_place(seeded):
    """Evaluation under the top-k rule, no autograd: the compiled region runs, the routed layers after a chain's
    first write into its copy of the stream (as in training), and the logits equal the eager model's."""
    from megatron_xmod.xmod.routing_state import eval_routing

    eager, _ = tiny_model(LAYOUT)
    compiled, _ = tiny_model(LAYOUT, xmod_compile_layers=True)
    compiled.load_state_dict(eager.state_dict())
    routed = sparse_layers(compiled)
    counting = _Counting(routed[0].compiled_update)
    in_place = record_in_place(routed)
    for layer in routed:
        layer.compiled_update = counting
    tokens = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    logits = {}
    for name, model in (("eager", eager), ("compiled", compiled)):
        model.eval()
        with eval_routing(model, "topk"), torch.no_grad():
            logits[name] = model(tokens, torch.arange(SEQ).expand_as(tokens), None)
    torch.testing.assert_close(logits["compiled"], logits["eager"], rtol=1e-5, atol=1e-5)
    assert counting.calls == len(routed) and in_place == [False, True, True, False, True]


def test_the_threshold_rule_runs_routed_layers_eagerly(seeded):
    """Evaluation under the threshold rule routes a data-dependent number of tokens: no compiled call."""
    model, _ = tiny_model(LAYOUT, xmod_compile_layers=True)
    counting = _Counting(sparse_layers(model)[0].compiled_update)
    for layer in sparse_layers(model):
        layer.compiled_update = counting
    model.eval()
    tokens = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits = model(tokens, torch.arange(SEQ).expand_as(tokens), None)
    assert torch.isfinite(logits).all() and counting.calls == 0


@pytest.mark.parametrize("field, value, fix", [
    ("tensor_model_parallel_size", 2, "--tensor-model-parallel-size 1"),
    ("recompute_granularity", "full", "drop --recompute-granularity"),
    ("num_moe_experts", 4, "a dense feed-forward"),
])
def test_what_the_compiled_region_does_not_cover_is_refused_by_field(field, value, fix):
    overrides = {field: value}
    if field == "recompute_granularity":
        overrides.update(recompute_method="uniform", recompute_num_layers=1)
    if field == "num_moe_experts":
        overrides.update(moe_ffn_hidden_size=32)
    with pytest.raises(ValueError, match=rf"^{field}: --xmod-compile-layers: .*{fix}"):
        config_from_backbone(TINY, LAYOUT, use_cpu_initialization=True, xmod_compile_layers=True, **overrides)


def test_megatrons_cpu_adam_is_fused_and_steps_as_the_loop_does(seeded):
    """The optimizer megatron builds for a CPU model (the bench's build: DDP + distributed optimizer) steps
    with torch's fused kernel, and fusing changes the update by float rounding only."""
    from bench.throughput import TINY_BACKBONE, build_training
    from megatron_xmod.cpu_shim import fuse_cpu_adam

    _model, optimizer, _config = build_training(TINY_BACKBONE, "dense", 64, torch.device("cpu"), False)
    inner = [opt.optimizer for opt in getattr(optimizer, "chained_optimizers", [optimizer])]
    assert inner and all(isinstance(opt, torch.optim.Adam) for opt in inner)  # AdamW subclasses Adam
    assert all(group["fused"] and not group["foreach"] for opt in inner for group in opt.param_groups)

    torch.manual_seed(0)
    fused_params = [torch.nn.Parameter(torch.randn(n)) for n in (300, 17, 1)]
    loop_params = [torch.nn.Parameter(p.detach().clone()) for p in fused_params]
    fused = torch.optim.AdamW(fused_params, lr=1e-2, weight_decay=0.1)
    assert fuse_cpu_adam(fused)
    loop = torch.optim.AdamW(loop_params, lr=1e-2, weight_decay=0.1, foreach=False)
    for _ in range(3):
        grads = [torch.randn_like(p) for p in fused_params]
        for params in (fused_params, loop_params):
            for p, g in zip(params, grads):
                p.grad = g.clone()
        fused.step()
        loop.step()
    for p, q in zip(fused_params, loop_params):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
    assert not fuse_cpu_adam(torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], capturable=True))
