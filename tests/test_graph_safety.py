"""Routed layers are graph-safe: an emulated CUDA-graph capture and replay (tests/graph_replay.py) of a
training forward and backward leaves the outputs, gradients and routing state of an eager run."""
import pytest
import torch
from graph_replay import NotCapturable, record, zero_grads


def _linear_step(linear, x, grad):
    out = linear(x)
    loss = (out * grad).sum() + out.pow(2).mean()
    loss.backward()
    return out, loss


def test_the_replay_tool_reproduces_a_linear_layer_and_its_loss():
    torch.manual_seed(0)
    linear = torch.nn.Linear(8, 4)
    params = list(linear.parameters())
    x, grad = torch.randn(5, 8, requires_grad=True), torch.randn(5, 4)
    zero_grads(params + [x])
    recording = record(lambda x, grad: _linear_step(linear, x, grad), x=x, grad=grad)
    names = recording.op_names()
    assert "aten.addmm.default" in names and "aten.mm.default" in names  # forward and backward ops
    assert sum(name == "aten.add_.Tensor" for name in names) >= 3  # grads accumulate in place
    zero_grads(params + [x])
    new_x, new_grad = torch.randn(5, 8), torch.randn(5, 4)
    recording.set_inputs(x=new_x, grad=new_grad)
    out, loss = recording.replay()
    replayed = [p.grad.clone() for p in params] + [x.grad.clone()]

    eager_x = new_x.clone().requires_grad_(True)
    zero_grads(params + [eager_x])
    eager_out, eager_loss = _linear_step(linear, eager_x, new_grad)
    torch.testing.assert_close(out, eager_out, rtol=0, atol=0)
    torch.testing.assert_close(loss, eager_loss, rtol=0, atol=0)
    for got, want in zip(replayed, [p.grad for p in params] + [eager_x.grad]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # a replay that drops an op (a broken tool) does not pass: the last gradient accumulation
    last = max(i for i, op in enumerate(recording.ops) if str(op.func) == "aten.add_.Tensor")
    del recording.ops[last]
    zero_grads(params + [x])
    recording.replay()
    assert not all(torch.equal(got, want) for got, want in
                   zip([p.grad for p in params] + [x.grad], [p.grad for p in params] + [eager_x.grad]) if True) or \
        any(not torch.equal(p.grad, r) for p, r in zip(params + [x], replayed))


def test_the_replay_tool_refuses_a_host_synchronisation():
    x = torch.randn(4)
    with pytest.raises(NotCapturable, match="host synchronisation"):
        record(lambda x: x * float(x.sum()), x=x)
    with pytest.raises(NotCapturable, match="depends on the data"):
        record(lambda x: x.nonzero(), x=x)
