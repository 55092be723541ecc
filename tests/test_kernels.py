"""Fused routing step (megatron_xmod.xmod.kernels) vs the torch reference built from routing.py.

The Triton kernels run on CPU only under TRITON_INTERPRET=1, which must be set before they are
defined: test_triton_routing_interpreter re-runs this file's ``triton_interp`` tests in a subprocess
with it set. ``gpu_`` tests run the native kernels (bench/gpu_check.sh) and skip without a GPU.
"""
import logging
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from helpers import run_triton_interp_tests

from megatron_xmod.xmod import kernels
from megatron_xmod.xmod.kernels import routing_step
from megatron_xmod.xmod.kernels.routing_step import routing_step_torch

INTERP = os.environ.get("TRITON_INTERPRET", "0") == "1"
HAS_GPU = torch.cuda.is_available()
needs_interp = pytest.mark.skipif(not INTERP, reason="runs inside test_triton_routing_interpreter's subprocess")
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")

# (s, K, b): several sequences, k = s (K = 1), s over one selection chunk (2100 > 2048), a single
# routed token (K = s).
SHAPES = [(64, 8, 3), (16, 1, 1), (2100, 4, 1), (32, 32, 2)]


def make_case(shape, carried=True, seed=0, device="cpu"):
    s, K, b = shape
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(s, b, generator=gen)
    bias = (torch.rand(s, b, generator=gen) < 0.3).float() * 2 if carried else None
    grads = torch.randn(s, b, generator=gen), torch.randn(s // K, b, generator=gen)
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return move(logits).requires_grad_(True), move(bias), tuple(move(g) for g in grads)


def run(step_fn, logits, bias, grads, K, tau=0.5, increment=1.0, **kw):
    step = step_fn(logits, K, "topk", bias, tau, increment, **kw)
    loss = (step.decision.scores * grads[0]).sum() + (step.gate * grads[1]).sum()
    (dlogits,) = torch.autograd.grad(loss, [logits])
    return step, dlogits


def check_equal(shape, carried=True, tau=0.5, increment=1.0, device="cpu", backend="triton", logits_dtype=None):
    logits, bias, grads = make_case(shape, carried, device=device)
    if logits_dtype is not None:
        logits = logits.detach().to(logits_dtype).requires_grad_(True)
    ref, ref_grad = run(routing_step_torch, logits, bias, grads, shape[1], tau, increment)
    before = kernels.launch_counts["triton"]
    out, out_grad = run(routing_step, logits, bias, grads, shape[1], tau, increment, backend=backend)
    assert kernels.launch_counts["triton"] == before + 1  # the fused path ran, not the fallback
    # The routing decision: the same routed set, in position order, and the same bias after it.
    assert torch.equal(out.decision.topk_indices, ref.decision.topk_indices)
    assert torch.equal(out.decision.selected, ref.decision.selected)
    assert torch.equal(out.bias, ref.bias)
    # Scores s - tau*b and gates sigmoid(s): one fp32 multiply-subtract, the same rounding.
    torch.testing.assert_close(out.decision.scores, ref.decision.scores, atol=1e-6, rtol=0)
    torch.testing.assert_close(out.gate, ref.gate, atol=1e-6, rtol=1e-6)
    assert out_grad.dtype == ref_grad.dtype
    torch.testing.assert_close(out_grad, ref_grad, atol=1e-6, rtol=1e-5)


@needs_interp
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_interp_matches_reference(shape):
    check_equal(shape)


@needs_interp
def test_triton_interp_without_carried_bias_tau_zero_and_other_increment():
    check_equal(SHAPES[0], carried=False)
    check_equal(SHAPES[0], carried=True, tau=0.0)
    check_equal(SHAPES[0], carried=True, tau=0.25, increment=3.0)


def check_router_bias_and_gate_scale(step_fn, dtype=torch.float32, bce_coeff=0.0, device="cpu", s=64, **kw):
    """The router's bias and varsigma handed to the step: the routed set, the gate varsigma * sigmoid(x w + c -
    tau*b) and the gradients of x w, c and varsigma equal plain torch autograd over the paper's equations."""
    K, b = 8, 3
    gen = torch.Generator().manual_seed(3)
    xw = torch.randn(s, b, generator=gen).to(device).requires_grad_(True)
    carried = ((torch.rand(s, b, generator=gen) < 0.3).float() * 2).to(device)
    router_bias = torch.tensor([0.3], dtype=dtype, device=device, requires_grad=True)
    scale = torch.tensor([1.7], dtype=dtype, device=device, requires_grad=True)
    d_scores, d_gate = (torch.randn(n, b, generator=gen).to(device) for n in (s, s // K))
    step = step_fn(xw, K, "topk", carried, 0.5, 1.0, router_bias=router_bias, gate_scale=scale, bce_coeff=bce_coeff,
                   **kw)
    loss = (step.decision.scores * d_scores).sum() + (step.gate * d_gate).sum()
    if bce_coeff:
        loss = loss + step.router_loss.sum()
    grads = torch.autograd.grad(loss, [xw, router_bias, scale])
    # the reference: Eq.(8) scores, top-k by torch.topk, Eq.(7)'s gate, autograd
    x2, c2, v2 = (t.detach().clone().requires_grad_(True) for t in (xw, router_bias, scale))
    scores = x2 + c2.float() - 0.5 * carried
    indices = scores.detach().topk(s // K, dim=0).indices.sort(dim=0).values
    gate = v2.float() * torch.sigmoid(scores.gather(0, indices))
    ref_loss = (scores * d_scores).sum() + (gate * d_gate).sum()
    if bce_coeff:
        q = torch.zeros_like(scores).scatter(0, indices, 1.0)
        ref_loss = ref_loss + bce_coeff * F.binary_cross_entropy_with_logits(scores, q)
    ref_grads = torch.autograd.grad(ref_loss, [x2, c2, v2])
    assert torch.equal(step.decision.topk_indices, indices)
    torch.testing.assert_close(step.gate, gate.detach(), atol=1e-6, rtol=1e-6)
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else {}
    for got, want, name in zip(grads, ref_grads, ("x w", "router bias", "varsigma")):
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert want.abs().sum() > 0, name
        torch.testing.assert_close(got, want, msg=name, **tol)


@pytest.mark.parametrize("bce_coeff", [0.0, 0.5])
def test_torch_step_takes_router_bias_and_gate_scale(bce_coeff):
    check_router_bias_and_gate_scale(routing_step_torch, bce_coeff=bce_coeff)


@needs_interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bce_coeff", [0.0, 0.5])
def test_triton_interp_router_bias_and_gate_scale(dtype, bce_coeff):
    before = kernels.launch_counts["triton"]
    check_router_bias_and_gate_scale(routing_step, dtype, bce_coeff, backend="triton")
    assert kernels.launch_counts["triton"] == before + 1


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("s", [64, 32768])  # one program of the backward walks all s*b tokens for the sums
def test_gpu_router_bias_and_gate_scale(dtype, s):
    check_router_bias_and_gate_scale(routing_step, dtype, 0.5, device="cuda", s=s, backend="triton")


@needs_interp
def test_triton_interp_routed_layer_launch_budget(seeded):
    """Issue 28's budget on the fused path (bench/ops.py's count of what a GPU launches): an X-MoD routed
    layer issues at most 8 kernels more than a dense layer, forward and backward, and the fused kernels are
    among them."""
    from bench import ops

    rows = {(r["layer"], r["phase"]): r for r in ops.measure(["fused"])}
    for phase in ("forward", "backward"):
        extra = rows[("xmod_sparse", phase)]["kernels"] - rows[("dense", phase)]["kernels"]
        assert 0 < extra <= 8, (phase, extra, rows[("xmod_sparse", phase)]["by_name"])
    assert "triton::routing_select" in rows[("xmod_sparse", "forward")]["by_name"]
    assert "triton::routing_backward" in rows[("xmod_sparse", "backward")]["by_name"]


@needs_interp
def test_triton_interp_bf16_logits():
    # A bf16 model's router returns bf16 logits: the gradient goes back in bf16 (values distinct).
    s, K, b = 64, 8, 2
    logits = (torch.randperm(s * b).reshape(s, b).float() / 8 - 4).to(torch.bfloat16).requires_grad_(True)
    grads = torch.randn(s, b), torch.randn(s // K, b)
    ref, ref_grad = run(routing_step_torch, logits, None, grads, K)
    out, out_grad = run(routing_step, logits, None, grads, K, backend="triton")
    assert torch.equal(out.decision.topk_indices, ref.decision.topk_indices)
    assert out_grad.dtype == torch.bfloat16
    torch.testing.assert_close(out_grad, ref_grad)


@needs_interp
def test_triton_interp_ties_go_to_the_earliest_positions():
    # Every logit equal: the k routed tokens are the first k; the carried bias lowers the tokens it
    # marks, so the next ones take their place.
    s, K, b = 24, 4, 2
    logits = torch.zeros(s, b)
    step = routing_step(logits, K, "topk", backend="triton")
    assert torch.equal(step.decision.topk_indices, torch.arange(s // K).unsqueeze(1).expand(-1, b))
    carried = torch.zeros(s, b)
    carried[:3] = 1.0
    step = routing_step(logits, K, "topk", carried, 0.5, backend="triton")
    assert torch.equal(step.decision.topk_indices, torch.arange(3, 3 + s // K).unsqueeze(1).expand(-1, b))
    assert torch.equal(step.bias, carried + step.decision.selected.float())


@needs_interp
def test_triton_interp_order_key_handles_signs_and_extremes():
    # Negative, positive, +-0, huge and tiny values: top-k by value, exactly as torch.topk.
    values = torch.tensor([-3e38, -1.0, -1e-30, -0.0, 0.5, 1e-30, 2.0, 3e38, -2.0, 7.0, -7.0, 1.5])
    logits = values[torch.randperm(12, generator=torch.Generator().manual_seed(1))].unsqueeze(1)
    for K in (1, 2, 3, 4, 6, 12):
        ref = routing_step_torch(logits, K, "topk", None, 0.0, 1.0)
        out = routing_step(logits, K, "topk", backend="triton")
        assert torch.equal(out.decision.topk_indices, ref.decision.topk_indices), K


@needs_interp
def test_triton_interp_threshold_rule_takes_the_torch_path():
    logits, bias, _ = make_case(SHAPES[0])
    before = dict(kernels.launch_counts)
    step = routing_step(logits, 8, "threshold", bias, 0.5, backend="triton")
    assert kernels.launch_counts["torch"] == before.get("torch", 0) + 1
    assert kernels.launch_counts["triton"] == before.get("triton", 0)
    assert step.gate is None and torch.equal(step.decision.selected, step.decision.scores >= 0)


# ---------------------------------------------------------------- statistics and hand-over buffers

def step_into_state(backend, logits, carried, previous, K, bce_coeff=0.0, tau=0.5, layer=3):
    """One routing step writing into a fresh RoutingState's buffers as a sparse layer does: the carried
    bias and the previous routed set are the hand-over buffers themselves (written in place)."""
    from megatron_xmod.xmod.routing_state import RoutingState

    state = RoutingState()
    s, b = logits.shape
    bias_buffer, selected_buffer = state.bias_buffers((s, b), logits.device)
    if carried is not None:
        bias_buffer.copy_(carried)
    if previous is not None:
        selected_buffer.copy_(previous)
    stats = state.step_statistics(layer, "", (s, b), (s // K) * b, previous is not None, bce_coeff > 0, logits.device)
    x = logits.detach().clone().requires_grad_(True)
    step = (routing_step_torch if backend == "torch" else routing_step)(
        x, K, "topk", bias_buffer if carried is not None else None, tau, 1.0, bias_out=bias_buffer,
        selected_out=selected_buffer, previous_selected=selected_buffer if previous is not None else None,
        statistics=stats, bce_coeff=bce_coeff, **({} if backend == "torch" else dict(backend=backend)))
    return state, stats, step, x


def check_state_equal(case, bce_coeff):
    s, K, b = 64, 8, 3
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(s, b, generator=gen)
    if case["nonfinite"]:  # a NaN (routed first: the largest key) and +-inf logits
        logits[5, 0], logits[9, 1], logits[2, 2] = float("nan"), float("inf"), float("-inf")
    carried = (torch.rand(s, b, generator=gen) < 0.3).float() * 2 if case["carried"] else None
    previous = torch.rand(s, b, generator=gen) < 0.125 if case["previous"] else None
    grads = torch.randn(s, b, generator=gen), torch.randn(s // K, b, generator=gen)
    results = {}
    for backend in ("torch", "triton"):
        state, stats, step, x = step_into_state(backend, logits, carried, previous, K, bce_coeff)
        loss = (step.decision.scores * grads[0]).sum() + (step.gate * grads[1]).sum()
        if bce_coeff:
            loss = loss + step.router_loss.sum()
        (dx,) = torch.autograd.grad(loss, [x])
        results[backend] = state, stats, step, dx
    (ref_state, stats, ref, ref_dx), (state, _, out, dx) = results["torch"], results["triton"]
    ref_bias, ref_selected = ref_state.bias_buffers((s, b), "cpu")
    bias, selected = state.bias_buffers((s, b), "cpu")
    assert out.bias is bias and ref.bias is ref_bias  # written into the hand-over buffer, in place
    assert torch.equal(bias, ref_bias) and torch.equal(selected, ref_selected)
    assert torch.equal(selected, out.decision.selected)
    assert torch.equal(out.flat_rows, ref.flat_rows)
    assert torch.equal(out.flat_rows, (out.decision.topk_indices * b + torch.arange(b)).reshape(-1))
    # Counts are integers in fp32: the tables agree exactly but for the BCE (a float sum, other order).
    table, ref_table = state._stats, ref_state._stats
    bce_at = stats.offsets[stats.offsets.numel() - stats.constants.numel() - 2:][:2] if bce_coeff else []
    exact = torch.ones_like(table, dtype=torch.bool)
    exact[bce_at] = False
    assert torch.equal(table[exact], ref_table[exact]), (table, ref_table)
    assert table[exact].sum() > 0
    if bce_coeff:
        torch.testing.assert_close(table[~exact], ref_table[~exact], rtol=1e-6, atol=1e-7, equal_nan=True)
        torch.testing.assert_close(out.router_loss.sum(), ref.router_loss, rtol=1e-6, atol=1e-8, equal_nan=True)
    torch.testing.assert_close(dx, ref_dx, atol=1e-6, rtol=1e-5, equal_nan=True)


STATE_CASES = [dict(carried=c, previous=p, nonfinite=n) for c, p, n in
               [(False, False, False), (True, True, False), (True, False, True), (True, True, True)]]


@needs_interp
@pytest.mark.parametrize("case", STATE_CASES, ids=lambda c: "-".join(k for k, v in c.items() if v) or "plain")
@pytest.mark.parametrize("bce_coeff", [0.0, 0.5])
def test_triton_interp_statistics_and_handover_match_torch(case, bce_coeff):
    check_state_equal(case, bce_coeff)


def check_pooled_statistics(backend):
    """Two calls of one layer: the table holds what plain torch computes from the masks, the adjacent
    Jaccard pooled (sum of intersections over sum of unions), coverage and selected fraction per token."""
    s, K, b = 48, 4, 2
    gen = torch.Generator().manual_seed(3)
    from megatron_xmod.xmod.routing_state import RoutingState

    state = RoutingState()
    bias_buffer, selected_buffer = state.bias_buffers((s, b), "cpu")
    inter = union = covered = 0
    nonfinite = 0
    for call in range(2):
        logits = torch.randn(s, b, generator=gen)
        logits[call, 0] = float("nan") if call else float("inf")
        nonfinite += 1
        carried = (torch.rand(s, b, generator=gen) < 0.4).float()
        previous = torch.rand(s, b, generator=gen) < 0.3
        bias_buffer.copy_(carried)
        selected_buffer.copy_(previous)
        stats = state.step_statistics(2, "", (s, b), (s // K) * b, True, False, "cpu")
        kw = {} if backend == "torch" else dict(backend=backend)
        step = (routing_step_torch if backend == "torch" else routing_step)(
            logits, K, "topk", bias_buffer, 0.5, 1.0, bias_out=bias_buffer, selected_out=selected_buffer,
            previous_selected=selected_buffer, statistics=stats, **kw)
        selected = step.decision.selected
        assert selected.sum() == (s // K) * b
        inter += (previous & selected).sum().item()
        union += (previous | selected).sum().item()
        covered += ((carried + selected.float()) > 0).sum().item()
    got = {name: (value.item(), count) for (name, layer), (value, count) in state.items()}
    assert got["adjacent_jaccard"] == (inter, union)
    assert got["coverage"] == (covered, 2 * s * b)
    assert got["selected_fraction"] == (2 * (s // K) * b, 2 * s * b)
    assert got["nonfinite_router_logits"] == (nonfinite, 2)


def test_torch_statistics_are_pooled():
    check_pooled_statistics("torch")


@needs_interp
def test_triton_interp_statistics_are_pooled():
    check_pooled_statistics("triton")


def test_destinations_are_for_the_topk_rule():
    logits, bias, _ = make_case(SHAPES[0])
    with pytest.raises(ValueError, match="rule='threshold': selected_out, statistics and bce_coeff"):
        routing_step(logits, 8, "threshold", bias, 0.5, bce_coeff=0.1)


def test_triton_routing_interpreter():
    """This file's ``triton_interp_`` tests under TRITON_INTERPRET=1; then every launch they made compiles for
    A100 and H100 (sm_80, sm_90) to a cubin that fits a block's registers and shared memory."""
    pytest.importorskip("triton")
    if INTERP:
        pytest.skip("already inside the interpreter run")
    run_triton_interp_tests(__file__, {"_select_kernel", "_scores_backward_kernel"}, drop_env=(kernels.ENV_BACKEND,))


# ---------------------------------------------------------------- dispatch (no interpreter needed)

def test_cpu_auto_uses_torch_and_forced_triton_falls_back_with_reason(monkeypatch, caplog):
    if INTERP:
        pytest.skip("outside the interpreter only")
    monkeypatch.delenv(kernels.ENV_BACKEND, raising=False)
    logits, bias, _ = make_case(SHAPES[0])
    before = dict(kernels.launch_counts)
    ref = routing_step_torch(logits, 8, "topk", bias, 0.5, 1.0)
    out = routing_step(logits, 8, "topk", bias, 0.5)
    assert torch.equal(out.decision.topk_indices, ref.decision.topk_indices) and torch.equal(out.gate, ref.gate)
    monkeypatch.setattr(sys.modules["megatron_xmod.xmod.kernels.routing_step"], "_logged", set())
    with caplog.at_level(logging.WARNING, logger="megatron_xmod.xmod.kernels"):
        routing_step(logits, 8, "topk", bias, 0.5, backend="triton")
    assert kernels.launch_counts["torch"] == before.get("torch", 0) + 2
    assert kernels.launch_counts["triton"] == before.get("triton", 0)
    assert any("cannot run (triton needs CUDA tensors" in r.getMessage() for r in caplog.records)


def test_unknown_backend_is_a_clear_error(monkeypatch):
    logits, bias, _ = make_case(SHAPES[0])
    with pytest.raises(ValueError, match="argument='cuda': expected one of auto, triton, torch"):
        routing_step(logits, 8, "topk", bias, 0.5, backend="cuda")
    monkeypatch.setenv(kernels.ENV_BACKEND, "fast")
    with pytest.raises(ValueError, match="XMOD_ROUTING_BACKEND='fast'"):
        routing_step(logits, 8, "topk", bias, 0.5)


# ---------------------------------------------------------------- native GPU (bench/gpu_check.sh)

@needs_gpu
@pytest.mark.parametrize("shape", SHAPES + [(32768, 8, 8), (32768, 16, 1), (4096, 8, 4)])
def test_gpu_triton_matches_reference(shape):
    check_equal(shape, device="cuda")


@needs_gpu
def test_gpu_routing_step_is_cuda_graph_capturable():
    """Static shapes, no host sync: captured once, replayed on new inputs copied into the static
    ones, the graph gives the eager torch path's decision."""
    shape = (32768, 8, 4)
    logits, bias, _ = make_case(shape, device="cuda")
    static_logits, static_bias = logits.detach().clone(), bias.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        routing_step(static_logits, shape[1], "topk", static_bias, 0.5, backend="triton")  # compile
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        out = routing_step(static_logits, shape[1], "topk", static_bias, 0.5, backend="triton")
    for seed in (1, 2):
        new_logits, new_bias, _ = make_case(shape, seed=seed, device="cuda")
        static_logits.copy_(new_logits.detach())
        static_bias.copy_(new_bias)
        graph.replay()
        ref = routing_step_torch(static_logits, shape[1], "topk", static_bias, 0.5, 1.0)
        assert torch.equal(out.decision.topk_indices, ref.decision.topk_indices)
        assert torch.equal(out.bias, ref.bias)


@needs_gpu
def test_gpu_routing_step_into_the_state_is_cuda_graph_capturable():
    """Captured with the routing state's destinations (hand-over buffers, statistics table, router BCE)
    and replayed twice on new logits: the buffers and the table are those of two eager torch-path calls
    (not verified on a GPU when written: no device was available)."""
    from megatron_xmod.xmod.routing_state import RoutingState

    s, K, b = shape = (4096, 8, 4)
    logits, bias, _ = make_case(shape, device="cuda")
    previous = torch.rand(s, b, device="cuda") < 1 / K

    def destinations(state):
        bias_buffer, selected_buffer = state.bias_buffers((s, b), "cuda")
        stats = state.step_statistics(3, "", (s, b), (s // K) * b, True, True, "cuda")
        return bias_buffer, dict(bias_out=bias_buffer, selected_out=selected_buffer,
                                 previous_selected=selected_buffer, statistics=stats, bce_coeff=0.1)

    def reset(state):
        state._stats.zero_()
        bias_buffer, selected_buffer = state.bias_buffers((s, b), "cuda")
        bias_buffer.copy_(bias)
        selected_buffer.copy_(previous)

    fused, ref = RoutingState(), RoutingState()
    static_logits = logits.detach().clone()
    carried, kw = destinations(fused)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        routing_step(static_logits, K, "topk", carried, 0.5, backend="triton", **kw)  # compile
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        routing_step(static_logits, K, "topk", carried, 0.5, backend="triton", **kw)
    ref_carried, ref_kw = destinations(ref)
    reset(fused)
    reset(ref)
    for seed in (1, 2):
        new_logits = make_case(shape, seed=seed, device="cuda")[0].detach()
        static_logits.copy_(new_logits)
        graph.replay()
        with torch.no_grad():
            routing_step_torch(new_logits, K, "topk", ref_carried, 0.5, 1.0, **ref_kw)
    torch.cuda.synchronize()
    for got, want in zip(fused.bias_buffers((s, b), "cuda"), ref.bias_buffers((s, b), "cuda")):
        assert torch.equal(got, want)
    stats = kw["statistics"]
    bce_at = stats.offsets[stats.offsets.numel() - stats.constants.numel() - 2:][:2]
    exact = torch.ones_like(fused._stats, dtype=torch.bool)
    exact[bce_at] = False
    assert torch.equal(fused._stats[exact], ref._stats[exact])
    torch.testing.assert_close(fused._stats[~exact], ref._stats[~exact], rtol=1e-5, atol=1e-7)


@needs_interp
def test_triton_interp_sparse_layer_trains_the_same(seeded, monkeypatch):
    """A tiny X-MoD model through megatron: loss, every gradient and the recorded routing statistics
    agree between the fused routing step and the torch path, and the fused one really ran in the
    sparse layers."""
    from helpers import tiny_model

    from megatron_xmod.xmod.routing_state import report, take_microbatch_loss

    def loss_and_grads(backend):
        monkeypatch.setenv(kernels.ENV_BACKEND, backend)
        torch.manual_seed(0)
        model, _ = tiny_model("D + S4*2 + D", seq_len=32)
        tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
        loss = model(tokens, torch.arange(32).expand(2, 32), None, labels=tokens).float().mean()
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return loss.detach(), grads, take_microbatch_loss(model), report(model)

    before = kernels.launch_counts["triton"]
    fused_loss, fused_grads, fused_router_loss, fused_stats = loss_and_grads("triton")
    assert kernels.launch_counts["triton"] == before + 2  # two sparse layers
    torch_loss, torch_grads, torch_router_loss, torch_stats = loss_and_grads("torch")
    torch.testing.assert_close(fused_loss, torch_loss)
    torch.testing.assert_close(fused_router_loss, torch_router_loss)
    assert fused_stats.keys() == torch_stats.keys() and "adjacent_jaccard/layer_003" in fused_stats, fused_stats
    assert fused_stats == pytest.approx(torch_stats, rel=1e-6), (fused_stats, torch_stats)
    assert fused_grads.keys() == torch_grads.keys() and any("router" in n for n in fused_grads)
    for name in torch_grads:
        torch.testing.assert_close(fused_grads[name], torch_grads[name], msg=name)
