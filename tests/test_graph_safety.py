"""Routed layers are graph-safe: an emulated CUDA-graph capture and replay (tests/graph_replay.py) of one
training forward and backward of a sparse block leaves the outputs, gradients and routing state
(token-choice bias hand-over, interval statistics, micro-batch router loss) of an eager run on the same
inputs, without running any Python module code; and a configuration that cannot be captured is refused."""
import pytest
import torch
from graph_replay import NotCapturable, record, zero_grads
from helpers import TINY, tiny_model

from megatron_xmod.model import sparse_layers
from megatron_xmod.xmod.routing_state import report, take_microbatch_loss

SEQ, BATCH = 64, 2


def _linear_step(linear, x, grad):
    out = linear(x)
    loss = (out * grad).sum() + out.pow(2).mean()
    loss.backward()
    return out, loss


def test_the_replay_tool_reproduces_a_linear_layer_and_its_loss():
    """The tool itself: replay equals eager on new inputs, and a replay missing one op does not."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(8, 4)
    params = list(linear.parameters())
    x, grad = torch.randn(5, 8, requires_grad=True), torch.randn(5, 4)
    zero_grads(params + [x])
    recording = record(lambda x, grad: _linear_step(linear, x, grad), x=x, grad=grad)
    names = recording.op_names()
    assert "aten.addmm.default" in names and "aten.mm.default" in names  # forward and backward ops
    assert sum(name == "aten.add_.Tensor" for name in names) == 3  # the grads accumulate in place
    new_x, new_grad = torch.randn(5, 8), torch.randn(5, 4)

    def replay():
        zero_grads(params + [x])
        recording.set_inputs(x=new_x, grad=new_grad)
        out, loss = recording.replay()
        return [out, loss] + [p.grad.clone() for p in params + [x]]

    replayed = replay()
    eager_x = new_x.clone().requires_grad_(True)
    zero_grads(params + [eager_x])
    eager = list(_linear_step(linear, eager_x, new_grad)) + [p.grad.clone() for p in params + [eager_x]]
    assert not torch.equal(replayed[0], recording.result[0])  # it computed on the new inputs
    for got, want in zip(replayed, eager):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    last = max(i for i, op in enumerate(recording.ops) if str(op.func) == "aten.add_.Tensor")
    del recording.ops[last]  # a broken tool: one gradient is not accumulated
    broken = replay()
    assert any(not torch.equal(got, want) for got, want in zip(broken[2:], eager[2:]))


def test_the_replay_tool_refuses_what_a_graph_cannot_capture():
    x = torch.randn(4)
    with pytest.raises(NotCapturable, match="host synchronisation"):
        record(lambda x: x * float(x.sum()), x=x)
    with pytest.raises(NotCapturable, match="depends on the data"):
        record(lambda x: x.nonzero(), x=x)


def _block_step(decoder, rope, x, grad):
    out = decoder(hidden_states=x, attention_mask=None, rotary_pos_emb=rope)
    out.backward(grad)
    return out


def _clear(model, tensors):
    """What a capture leaves: nothing (a CUDA graph capture launches no kernel)."""
    model.routing_state.reset()
    take_microbatch_loss(model)
    zero_grads(tensors)


def _observed(model, tensors, last_sparse):
    state = model.routing_state
    bias, selected = state.take_bias(last_sparse + 1, (SEQ, BATCH))
    handover = None if bias is None else (bias.clone(), selected.clone())
    loss = take_microbatch_loss(model)
    return dict(grads=[t.grad.clone() for t in tensors], statistics=report(model, reset_after=False),
                microbatch_loss=None if loss is None else loss.clone(), handover=handover)


def test_a_replayed_sparse_block_leaves_the_state_of_an_eager_run(seeded, monkeypatch):
    """One training forward + backward of the decoder of a tiny X-MoD model (a block of three sparse
    layers between dense ones, tau > 0 so the bias hand-over changes the routing) is recorded on fixed
    inputs, then replayed on new ones, op by op, with no Python module code: outputs, gradients and the
    routing state must be those of an eager run on the new inputs."""
    from megatron_xmod.xmod.permute import dispatch

    monkeypatch.setenv(dispatch.ENV_CHECK, "0")  # the permutation ops' index checks run on CPU tensors only
    model, _ = tiny_model("D + (S4*3 + D)", seq_len=SEQ, xmod_token_choice_bias_tau=0.5)
    model.train()
    decoder = model.decoder
    routed = sparse_layers(model)
    last_sparse = routed[-1].layer_number
    with torch.no_grad():  # decisive routers, so that the carried bias changes the routed sets
        for layer in routed:
            layer.router.weight.mul_(20)
    rope = model.rotary_pos_emb(SEQ)
    x = torch.randn(SEQ, BATCH, TINY.hidden_size, requires_grad=True)
    grad = torch.randn(SEQ, BATCH, TINY.hidden_size)
    tensors = [p for p in decoder.parameters() if p.requires_grad] + [x]
    zero_grads(tensors)
    _block_step(decoder, rope, x, grad)  # warm-up (megatron's cuda_graph_warmup_steps): buffers exist
    _clear(model, tensors)
    recording = record(lambda x, grad: _block_step(decoder, rope, x, grad), x=x, grad=grad)
    _clear(model, tensors)

    calls = []
    hooks = [m.register_forward_pre_hook(lambda *_: calls.append(1)) for m in decoder.modules()]
    new_x = torch.randn(SEQ, BATCH, TINY.hidden_size, generator=torch.Generator().manual_seed(1))
    new_grad = torch.randn(SEQ, BATCH, TINY.hidden_size, generator=torch.Generator().manual_seed(2))
    recording.set_inputs(x=new_x, grad=new_grad)
    out = recording.replay().clone()
    assert not calls  # the replay ran no module code
    for hook in hooks:
        hook.remove()
    replayed = _observed(model, tensors, last_sparse)

    _clear(model, tensors)
    eager_x = new_x.clone().requires_grad_(True)
    zero_grads([eager_x])
    eager_out = _block_step(decoder, rope, eager_x, new_grad)
    eager = _observed(model, tensors[:-1] + [eager_x], last_sparse)

    assert not torch.equal(out, recording.result)  # new inputs, new outputs
    torch.testing.assert_close(out, eager_out, rtol=0, atol=0)
    for got, want in zip(replayed["grads"], eager["grads"]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert eager["statistics"] and eager["microbatch_loss"] is not None and eager["handover"] is not None
    wrong = []  # the routing state, all of it reported at once
    if replayed["statistics"] != eager["statistics"]:
        wrong.append(f"interval statistics: replay {replayed['statistics'] or 'none'}")
    if replayed["microbatch_loss"] is None or not torch.equal(replayed["microbatch_loss"], eager["microbatch_loss"]):
        wrong.append(f"micro-batch router loss: replay {replayed['microbatch_loss']}, eager {eager['microbatch_loss']}")
    if replayed["handover"] is None or not all(torch.equal(a, b) for a, b in zip(replayed["handover"], eager["handover"])):
        wrong.append("token-choice bias hand-over: " + ("the replay left none" if replayed["handover"] is None
                                                        else "different bias or routed set"))
    assert not wrong, "the replay left another routing state than an eager run: " + "; ".join(wrong)


@pytest.mark.parametrize("overrides, field", [
    (dict(cuda_graph_impl="local", recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
     "recompute_granularity"),
    (dict(cuda_graph_impl="transformer_engine", xmod_token_choice_bias_tau_warmup=10), "xmod_token_choice_bias_tau_warmup"),
    (dict(cuda_graph_impl="local", cuda_graph_modules=["attn"]), "cuda_graph_modules"),
    (dict(cuda_graph_impl="full_iteration"), "cuda_graph_impl"),
])
def test_a_configuration_that_cannot_be_captured_is_refused_with_the_reason(overrides, field):
    from megatron_xmod.model import config_from_backbone

    with pytest.raises(ValueError, match=rf"^{field}: .+; .*(drop --cuda-graph-impl|use --cuda-graph-impl)"):
        config_from_backbone(TINY, "D + S4*2 + D", use_cpu_initialization=True, **overrides)


def test_routed_layers_are_graphable_in_training_and_eager_in_evaluation(seeded, capsys):
    """Under --cuda-graph-impl the routed layers say that evaluation runs eagerly, take megatron's graph
    path in training only, are captured whole by TE (one output tensor), and save their own router input
    (the router-input chain's weak references cannot cross graphs). megatron's local CudaGraphManager
    needs a CUDA RNG tracker, so its path is checked through the layer's hook only."""
    from megatron_xmod.xmod.config import _GRAPH_NOTE

    _GRAPH_NOTE.discard("transformer_engine")
    model, _ = tiny_model("D + S4*2 + D", cuda_graph_impl="transformer_engine")
    assert "evaluation runs them eagerly" in capsys.readouterr().out
    layer = sparse_layers(model)[0]
    layer.cudagraph_manager = object()  # what GraphableMegatronModule gives a layer under "local"
    layer.train()
    assert layer._should_call_local_cudagraph(torch.zeros(1), attention_mask=None)
    layer.eval()
    assert not layer._should_call_local_cudagraph(torch.zeros(1), attention_mask=None)
    del layer.cudagraph_manager
    layer.train()
    x = torch.randn(SEQ, BATCH, TINY.hidden_size, requires_grad=True)
    (out,) = layer._te_cuda_graph_capture(x, attention_mask=None, rotary_pos_emb=model.rotary_pos_emb(SEQ))
    assert out.shape == x.shape
    assert layer.routing_state.router_inputs._layer_number is None  # no chain handed on
    out.sum().backward()
    assert layer.router.weight.grad is not None


def _routing_state_now(model) -> list[torch.Tensor]:
    """The routing state's buffers, and megatron's MoE metrics."""
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    state = model.routing_state
    return ([state._stats.clone()] + [t.clone() for pair in state._handover.values() for t in pair]
            + [entry.values.clone() for entry in get_moe_metrics_tracker().metrics.values()])


def test_megatrons_graph_capture_leaves_the_routing_state_of_the_training_data(seeded, monkeypatch, fresh_moe_tracker):
    """megatron's capture runs the captured layers on sample inputs (warm-up iterations, then the capture):
    without patches 27 / 28 those runs add to the interval statistics, the micro-batch router loss, the
    hand-over and megatron's MoE metrics; with them both capture entry points (``--cuda-graph-impl local``
    and ``transformer_engine``) leave all of it exactly as the training step left it, in the same buffers.
    The captures themselves need CUDA: here each runs what it does to the layers, forward and backward on
    new inputs (and adds to an MoE metric, as an MoE layer's run would)."""
    from types import SimpleNamespace

    from megatron.core.transformer import cuda_graphs
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    from megatron_xmod.training import patches
    from megatron_xmod.xmod.permute import dispatch
    from megatron_xmod.xmod.routing_state import kept_through

    monkeypatch.setenv(dispatch.ENV_CHECK, "0")
    model, _ = tiny_model("D + (S4*3 + D)", seq_len=SEQ, xmod_token_choice_bias_tau=0.5,
                          cuda_graph_impl="transformer_engine")
    model.train()
    rope = model.rotary_pos_emb(SEQ)
    generator = torch.Generator().manual_seed(5)

    def training_step():
        x = torch.randn(SEQ, BATCH, TINY.hidden_size, generator=generator, requires_grad=True)
        _block_step(model.decoder, rope, x, torch.randn(SEQ, BATCH, TINY.hidden_size, generator=generator))

    tracker = get_moe_metrics_tracker()
    tracker.ensure_initialized("load_balancing_loss", 4, "cpu")
    moe_metric = tracker.metrics["load_balancing_loss"].values
    runs = []

    def warm_up_and_capture(*_):
        for _ in range(3):
            training_step()
            moe_metric.add_(1.0)
            runs.append(1)

    record, helper = cuda_graphs._CudagraphGlobalRecord, cuda_graphs.TECudaGraphHelper
    monkeypatch.setattr(record, "create_cudagraphs", record.__dict__["create_cudagraphs"])  # put back afterwards
    monkeypatch.setattr(record, "_create_cudagraphs", classmethod(warm_up_and_capture))
    monkeypatch.setattr(record, "cudagraph_record", [(SimpleNamespace(base_module=layer), "fwd")
                                                     for layer in model.decoder.layers])
    monkeypatch.setattr(helper, "create_cudagraphs", warm_up_and_capture)
    training_step()  # the training data's statistics, router loss and hand-over
    moe_metric.fill_(0.5)
    state = model.routing_state
    stats_buffer = state._stats.data_ptr()

    before = _routing_state_now(model)
    record.create_cudagraphs()  # megatron's own: the capture's runs count as training data
    assert len(runs) == 3 and any(not torch.equal(a, b) for a, b in zip(_routing_state_now(model), before))

    before = _routing_state_now(model)
    patches.routing_state_kept_through_graph_capture(kept_through)
    try:
        record.create_cudagraphs()
        after_local = _routing_state_now(model)
        helper.create_cudagraphs(SimpleNamespace(model=[model]))
        after_te = _routing_state_now(model)
    finally:
        patches.uninstall(27, record, "create_cudagraphs")
        patches.uninstall(28, helper, "create_cudagraphs")
    assert len(runs) == 9  # both captures ran the layers
    for after in (after_local, after_te):
        assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before))
    assert state._stats.data_ptr() == stats_buffer  # in place: a captured graph keeps writing there
    assert 27 not in patches.installed() and getattr(record.create_cudagraphs, "_xmod_patch", None) is None
