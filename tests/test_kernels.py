"""Fused routing step (megatron_xmod.kernels) vs the torch reference built from routing.py.

The Triton kernels run on CPU only under TRITON_INTERPRET=1, which must be set before they are
defined: test_triton_routing_interpreter re-runs this file's ``triton_interp`` tests in a subprocess
with it set. ``gpu_`` tests run the native kernels (bench/gpu_check.sh) and skip without a GPU.
"""
import logging
import os
import subprocess
import sys

import pytest
import torch

from megatron_xmod import kernels
from megatron_xmod.kernels import routing_step
from megatron_xmod.kernels.routing_step import routing_step_torch

INTERP = os.environ.get("TRITON_INTERPRET", "0") == "1"
HAS_GPU = torch.cuda.is_available()
needs_interp = pytest.mark.skipif(not INTERP, reason="runs inside test_triton_routing_interpreter's subprocess")
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")

# (s, b, h, K): several sequences, k = s (K = 1), h over one chunk (600 > 512), s over one selection
# chunk (1100 > 1024), a single routed token (K = s).
SHAPES = [(64, 3, 40, 8), (16, 1, 7, 1), (48, 2, 600, 16), (1100, 1, 8, 4), (32, 2, 16, 32)]


def make_case(shape, dtype, carried=True, seed=0, device="cpu"):
    s, b, h, _ = shape
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(s, b, h, generator=gen).to(dtype)
    router = torch.nn.Linear(h, 1)
    with torch.no_grad():
        router.weight.copy_(torch.randn(1, h, generator=gen) / h**0.5)
        router.bias.fill_(0.1)
    bias = (torch.rand(s, b, generator=gen) < 0.3).float() * 2 if carried else None
    grads = torch.randn(s, b, generator=gen), torch.randn(s // shape[3], b, generator=gen)
    x, router = x.to(device).requires_grad_(True), router.to(device=device, dtype=dtype)
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return x, router, move(bias), tuple(move(g) for g in grads)


def run(step_fn, x, router, bias, grads, K, tau=0.5, increment=1.0, **kw):
    out = step_fn(x, router, K, "topk", bias, tau, increment, **kw)
    loss = (out.scores * grads[0]).sum() + (out.gate * grads[1]).sum()
    dx, dw, dw0 = torch.autograd.grad(loss, [x, router.weight, router.bias])
    return out, (dx, dw, dw0)


def check_equal(shape, dtype, carried=True, tau=0.5, device="cpu", backend="triton"):
    x, router, bias, grads = make_case(shape, dtype, carried, device=device)
    ref, ref_grads = run(routing_step_torch, x, router, bias, grads, shape[3], tau)
    before = kernels.launch_counts["triton"]
    out, out_grads = run(routing_step, x, router, bias, grads, shape[3], tau, backend=backend)
    assert kernels.launch_counts["triton"] == before + 1  # the fused path ran, not the fallback
    # The routing decision: the same routed set, in position order, and the same bias after it.
    assert torch.equal(out.indices, ref.indices)
    assert torch.equal(out.selected, ref.selected)
    assert torch.equal(out.bias, ref.bias)
    # Scores and gates: the logit is rounded to x's dtype in both; the sum order differs.
    atol = 1e-5 if dtype == torch.float32 else 2 * 2.0**-8 * (ref.scores.abs().max().item() + 1)
    torch.testing.assert_close(out.scores, ref.scores, atol=atol, rtol=0)
    torch.testing.assert_close(out.gate, ref.gate, atol=atol / 4, rtol=0)
    for name, a, r in zip(("dx", "dweight", "dbias"), out_grads, ref_grads):
        scale = r.abs().max().item() + 1e-6
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert (a.float() - r.float()).abs().max().item() <= tol * scale, name


@needs_interp
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_interp_matches_reference(shape):
    check_equal(shape, torch.float32)


@needs_interp
def test_triton_interp_without_carried_bias_and_tau_zero():
    check_equal(SHAPES[0], torch.float32, carried=False)
    check_equal(SHAPES[0], torch.float32, carried=True, tau=0.0)


@needs_interp
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_interp_half_precision(dtype):
    check_equal((64, 2, 24, 4), dtype)


@needs_interp
def test_triton_interp_ties_go_to_the_earliest_positions():
    # Every logit equal (zero router): the k routed tokens are the first k; the carried bias breaks
    # the ties of the tokens it lowers.
    s, b, h, K = 24, 2, 8, 4
    router = torch.nn.Linear(h, 1)
    torch.nn.init.zeros_(router.weight)
    torch.nn.init.zeros_(router.bias)
    x = torch.randn(s, b, h)
    out = routing_step(x, router, K, "topk", backend="triton")
    assert torch.equal(out.indices, torch.arange(s // K).unsqueeze(1).expand(-1, b))
    carried = torch.zeros(s, b)
    carried[:3] = 1.0
    out = routing_step(x, router, K, "topk", carried, 0.5, backend="triton")
    assert torch.equal(out.indices, torch.arange(3, 3 + s // K).unsqueeze(1).expand(-1, b))
    assert torch.equal(out.bias, carried + out.selected.float())


@needs_interp
def test_triton_interp_threshold_rule_takes_the_torch_path():
    x, router, bias, _ = make_case(SHAPES[0], torch.float32)
    before = dict(kernels.launch_counts)
    out = routing_step(x, router, 8, "threshold", bias, 0.5, backend="triton")
    assert kernels.launch_counts["torch"] == before.get("torch", 0) + 1
    assert kernels.launch_counts["triton"] == before.get("triton", 0)
    assert out.indices is None and torch.equal(out.selected, out.scores >= 0)


def test_triton_routing_interpreter():
    pytest.importorskip("triton")
    if INTERP:
        pytest.skip("already inside the interpreter run")
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop(kernels.ENV_BACKEND, None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "triton_interp_"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert " passed" in last and "skipped" not in last, last


# ---------------------------------------------------------------- dispatch (no interpreter needed)

def test_cpu_auto_uses_torch_and_forced_triton_falls_back_with_reason(monkeypatch, caplog):
    if INTERP:
        pytest.skip("outside the interpreter only")
    monkeypatch.delenv(kernels.ENV_BACKEND, raising=False)
    x, router, bias, _ = make_case(SHAPES[0], torch.float32)
    before = dict(kernels.launch_counts)
    ref = routing_step_torch(x, router, 8, "topk", bias, 0.5, 1.0)
    out = routing_step(x, router, 8, "topk", bias, 0.5)
    assert torch.equal(out.indices, ref.indices) and torch.equal(out.gate, ref.gate)
    monkeypatch.setattr(sys.modules["megatron_xmod.kernels.routing_step"], "_logged", set())
    with caplog.at_level(logging.WARNING, logger="megatron_xmod.kernels"):
        routing_step(x, router, 8, "topk", bias, 0.5, backend="triton")
    assert kernels.launch_counts["torch"] == before.get("torch", 0) + 2
    assert kernels.launch_counts["triton"] == before.get("triton", 0)
    assert any("cannot run (triton needs CUDA tensors" in r.getMessage() for r in caplog.records)


def test_unknown_backend_is_a_clear_error(monkeypatch):
    x, router, bias, _ = make_case(SHAPES[0], torch.float32)
    with pytest.raises(ValueError, match="argument='cuda': expected one of auto, triton, torch"):
        routing_step(x, router, 8, "topk", bias, 0.5, backend="cuda")
    monkeypatch.setenv(kernels.ENV_BACKEND, "fast")
    with pytest.raises(ValueError, match="XMOD_ROUTING_BACKEND='fast'"):
        routing_step(x, router, 8, "topk", bias, 0.5)


# ---------------------------------------------------------------- native GPU (bench/gpu_check.sh)

@needs_gpu
@pytest.mark.parametrize("shape", SHAPES + [(4096, 4, 1024, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_triton_matches_reference(shape, dtype):
    check_equal(shape, dtype, device="cuda")


@needs_gpu
def test_gpu_routing_step_is_cuda_graph_capturable():
    """Static shapes, no host sync: captured once, replayed on new inputs copied into the static
    ones, the graph gives the eager torch path's decision."""
    shape = (2048, 2, 256, 8)
    x, router, bias, _ = make_case(shape, torch.float32, device="cuda")
    x = x.detach()
    static_x, static_bias = x.clone(), bias.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        routing_step(static_x, router, shape[3], "topk", static_bias, 0.5, backend="triton")  # warm-up/compile
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        out = routing_step(static_x, router, shape[3], "topk", static_bias, 0.5, backend="triton")
    for seed in (1, 2):
        new_x, _, new_bias, _ = make_case(shape, torch.float32, seed=seed, device="cuda")
        static_x.copy_(new_x.detach())
        static_bias.copy_(new_bias)
        graph.replay()
        with torch.no_grad():
            ref = routing_step_torch(static_x, router, shape[3], "topk", static_bias, 0.5, 1.0)
        assert torch.equal(out.indices, ref.indices) and torch.equal(out.bias, ref.bias)
