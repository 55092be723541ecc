"""Routed-token permutation ops: reference vs a naive loop, every backend vs fp64 truth, dispatch.

Triton runs on CPU only under TRITON_INTERPRET=1, which must be set before the kernels are
defined; test_triton_interpreter re-runs this file's ``triton_interp`` tests in a subprocess
with it set (kept small: the interpreter executes one program at a time). CUDA tests skip
without a GPU.
"""
import glob
import logging
import os
import shutil

import pytest
import torch
from helpers import run_triton_interp_tests
from torch.utils._python_dispatch import TorchDispatchMode
from triton_targets import binary_resource_usage

import megatron_xmod
from megatron_xmod.xmod import permute
from megatron_xmod.xmod.permute import dispatch, reference

INTERP = os.environ.get("TRITON_INTERPRET", "0") == "1"
HAS_GPU = torch.cuda.is_available()
PKG_DIR = os.path.dirname(megatron_xmod.__file__)

# Shapes (s, b, h, k): k = s, k = 1, b > 1, odd h, and k = 0.
SHAPES = [(8, 1, 16, 8), (9, 3, 7, 1), (12, 2, 33, 5), (5, 2, 3, 0), (6, 4, 1, 3)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Allowed error as a multiple of each output's magnitude bound (the op applied to |inputs|):
# a few rounding units of the dtype; fp32 also leaves room for reduction order over h.
RTOL = {torch.float32: 5e-5, torch.float16: 3 * 2.0**-11, torch.bfloat16: 3 * 2.0**-8}


def make_indices(s, b, k, gen):
    cols = [torch.randperm(s, generator=gen)[:k].sort().values for _ in range(b)]
    return torch.stack(cols, 1) if k else torch.empty(0, b, dtype=torch.int64)


def make_inputs(shape, dtype, seed=0, device="cpu"):
    s, b, h, k = shape
    gen = torch.Generator().manual_seed(seed)
    idx = make_indices(s, b, k, gen)
    x = torch.randn(s, b, h, generator=gen, dtype=torch.float64)
    x[0, 0, 0] = -0.0  # a pass-through token must keep its sign bit
    y = torch.randn(k, b, h, generator=gen, dtype=torch.float64)
    gate = torch.rand(k, b, generator=gen, dtype=torch.float64)
    go_full = torch.randn(s, b, h, generator=gen, dtype=torch.float64)
    go_k = torch.randn(k, b, h, generator=gen, dtype=torch.float64)
    cast = lambda t: t.to(dtype).to(device)  # noqa: E731
    return cast(x), cast(y), cast(gate), idx.to(device), cast(go_full), cast(go_k)


# ---------------------------------------------------------------- naive loop (independent reference)

def naive_gather(x, idx):
    k, b = idx.shape
    if k == 0:
        return x[:0]
    return torch.stack([torch.stack([x[int(idx[j, c]), c] for c in range(b)]) for j in range(k)])


def naive_scatter(x, y, gate, idx):
    out = x.clone()
    for j in range(idx.shape[0]):
        for c in range(idx.shape[1]):
            t = int(idx[j, c])
            out[t, c] = x[t, c] + gate[j, c] * y[j, c]
    return out


def leaf(*ts):
    return [t.detach().clone().requires_grad_(True) for t in ts]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_reference_matches_naive_loop(shape, dtype):
    x, y, gate, idx, go_full, go_k = make_inputs(shape, dtype, seed=1)
    xr, xn = leaf(x, x)
    out_r, out_n = reference.gather_tokens(xr, idx), naive_gather(xn, idx)
    assert torch.equal(out_r, out_n)
    out_r.backward(go_k)
    out_n.backward(go_k)
    assert torch.equal(xr.grad, xn.grad)

    (xr, yr, gr), (xn, yn, gn) = leaf(x, y, gate), leaf(x, y, gate)
    out_r, out_n = reference.scatter_gated(xr, yr, gr, idx), naive_scatter(xn, yn, gn, idx)
    assert torch.equal(out_r, out_n)
    out_r.backward(go_full)
    out_n.backward(go_full)
    for a, b in ((xr, xn), (yr, yn), (gr, gn)):
        # With k = 0 the loop never touches y or gate, so autograd leaves their grad at None.
        gb = b.grad if b.grad is not None else torch.zeros_like(b)
        torch.testing.assert_close(a.grad, gb, rtol=1e-12 if dtype == torch.float64 else 1e-6, atol=1e-12)


@pytest.mark.parametrize("shape", [(6, 2, 3, 3), (5, 1, 4, 5), (7, 3, 1, 1)])
def test_reference_gradcheck_fp64(shape):
    x, y, gate, idx, _, _ = make_inputs(shape, torch.float64, seed=2)
    x, y, gate = leaf(x, y, gate)
    assert torch.autograd.gradcheck(lambda a: reference.gather_tokens(a, idx), (x,))
    assert torch.autograd.gradcheck(lambda a, b_, g: reference.scatter_gated(a, b_, g, idx), (x, y, gate))


class FullLengthOutputs(TorchDispatchMode):
    """The aten ops that make a new buffer as large as x (views and in-place ops make none)."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.names = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in args if isinstance(t, torch.Tensor)}
        if (isinstance(out, torch.Tensor) and out.numel() == self.numel
                and out.untyped_storage().data_ptr() not in inputs):
            self.names.append(str(func.overloadpacket))
        return out


def _chain_of_updates(x, weights, rows, in_place, loss_shared_with=None):
    """Routed layers in series on x [s, b, h], each: logits = x w (the chained router of
    megatron_xmod.xmod.routing_state), x[rows] += sigmoid(logits[rows]) * tanh(x[rows]); in place along the
    router-input chain (permute.reference.rows_for_update / add_rows_) or out of place (gather + scatter).
    Returns (output, full-length buffers made forward, backward, the layers' StreamGrads)."""
    from megatron_xmod.xmod.routing_state import RouterInputChain, router_logits

    chain_handover, handovers = RouterInputChain(), []
    with FullLengthOutputs(x.numel()) as forward_ops:
        h = x
        for n, (weight, layer_rows) in enumerate(zip(weights, rows), start=1):
            router = torch.nn.Linear(x.shape[-1], 1, bias=False)
            router.weight = weight
            stream_grad = reference.StreamGrad() if in_place else None
            logits, chain, alias = router_logits(router, h, chain_handover, n, stream_grad)
            gate = torch.sigmoid(logits.reshape(-1)[layer_rows]).unsqueeze(-1)
            if in_place:
                stream = h if stream_grad.continues else h.clone()
                routed = reference.rows_for_update(stream, layer_rows, stream_grad, logits)
                h = reference.add_rows_(stream, layer_rows, gate * routed.tanh(), stream_grad)
                handovers.append(stream_grad)
            else:
                flat = alias.reshape(-1, x.shape[-1])
                routed = flat.index_select(0, layer_rows)
                h = flat.index_add(0, layer_rows, gate * routed.tanh()).view_as(x)
            chain_handover.put(n, chain, h, layer_rows, routed.detach())
    out = h if loss_shared_with is None else h + loss_shared_with  # an add's backward: one tensor, both summands
    with FullLengthOutputs(x.numel()) as backward_ops:
        (out * torch.linspace(-1, 1, x.shape[-1], dtype=x.dtype)).sum().backward()
    return out.detach(), forward_ops.names, backward_ops.names, handovers


@pytest.mark.parametrize("shared", [False, True])
def test_in_place_routed_updates_equal_out_of_place_with_one_full_length_buffer_a_chain(shared):
    """Three routed updates along a router-input chain, in place (the compiled layers' path): the output and
    every gradient equal the out-of-place updates'; the chain's first layer copies its input and later ones
    write into that copy (one storage), and backward makes one gradient buffer for the chain (the rows' and the
    routers' gradients added in place), where out of place each layer makes one forward and three backward.
    ``shared``: the output's gradient is also another tensor's (an add), which must not be written into."""
    s, b, h = 32, 2, 8
    g = torch.Generator().manual_seed(5)
    x0 = torch.randn(s, b, h, dtype=torch.float64, generator=g)
    w0 = [torch.randn(1, h, dtype=torch.float64, generator=g) for _ in range(3)]
    rows = [torch.randperm(s * b, generator=g)[:12].sort().values for _ in range(3)]
    other0 = torch.randn(s, b, h, dtype=torch.float64, generator=g)
    results = {}
    for in_place in (True, False):
        x = x0.clone().requires_grad_(True)
        weights = [torch.nn.Parameter(w.clone()) for w in w0]
        other = other0.clone().requires_grad_(True) if shared else None
        out, forward_ops, backward_ops, handovers = _chain_of_updates(x, weights, rows, in_place, other)
        grads = [x.grad] + [w.grad for w in weights] + ([other.grad] if shared else [])
        results[in_place] = (out, grads, forward_ops, backward_ops, handovers)
    out, grads, forward_ops, backward_ops, handovers = results[True]
    torch.testing.assert_close(out, results[False][0], rtol=0, atol=0)
    for got, want in zip(grads, results[False][1]):
        torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-14)
    if shared:  # the other summand's gradient is the loss's own, untouched
        torch.testing.assert_close(grads[-1], torch.linspace(-1, 1, h, dtype=torch.float64).expand(s, b, h))
    assert [handover.continues for handover in handovers] == [False, True, True]
    assert forward_ops == ["aten.clone"], forward_ops  # the chain's copy of its input; the later layers write into it
    # Backward, the chain's full-length buffers: the output's gradient copied once (the chain's one gradient
    # buffer, into which the rows' gradients are then added in place) and the router-input rebuild buffer (both
    # clones); every router adds its outer product into the one buffer. Out of place, each layer makes a
    # zero-filled rows' gradient, adds it, and adds its router's outer product into a fresh buffer.
    assert backward_ops.count("aten.clone") == 2 and "aten.index_put" not in backward_ops, backward_ops
    assert not {"aten.index_add", "aten.new_zeros", "aten.addcmul", "aten.add"} & set(backward_ops), backward_ops
    assert len(results[False][2]) == 3 and len(results[False][3]) - len(backward_ops) >= 10, results[False][2:4]


# ---------------------------------------------------------------- backend vs fp64 truth

def run_backend(backend, x, y, gate, idx, go_full, go_k, need=(True, True, True)):
    """Forward outputs and all input grads of both ops through the public dispatching functions."""
    res = {}
    (xg,) = leaf(x)
    out = permute.gather_tokens(xg, idx, backend=backend)
    out.backward(go_k)
    res["gather"], res["gather.dx"] = out.detach(), xg.grad
    xs, ys, gs = leaf(x, y, gate)
    for t, n in zip((xs, ys, gs), need):
        t.requires_grad_(n)
    out = permute.scatter_gated(xs, ys, gs, idx, backend=backend)
    out.backward(go_full)
    res["scatter"] = out.detach()
    for name, t in (("dx", xs), ("dy", ys), ("dgate", gs)):
        res[f"scatter.{name}"] = t.grad
    return res


def truth_and_scale(x, y, gate, idx, go_full, go_k):
    """fp64 truth, and the same ops on |inputs| as the magnitude each error is measured against."""
    def ops(x, y, gate, go_full, go_k):
        x, y, gate = leaf(x, y, gate)
        r = {}
        out = reference.gather_tokens(x, idx)
        out.backward(go_k)
        r["gather"], r["gather.dx"] = out.detach(), x.grad
        x.grad = None
        out = reference.scatter_gated(x, y, gate, idx)
        out.backward(go_full)
        r["scatter"] = out.detach()
        r["scatter.dx"], r["scatter.dy"], r["scatter.dgate"] = x.grad, y.grad, gate.grad
        return r

    d = [t.detach().cpu().double() for t in (x, y, gate, go_full, go_k)]
    return ops(*d), ops(*[t.abs() for t in d])


def check_against_truth(res, x, y, gate, idx, go_full, go_k, need=(True, True, True)):
    dtype = x.dtype
    truth, scale = truth_and_scale(x, y, gate, idx, go_full, go_k)
    skip = {"scatter.dx": not need[0], "scatter.dy": not need[1], "scatter.dgate": not need[2]}
    for key, want in truth.items():
        got = res[key]
        if skip.get(key):
            assert got is None, f"{key}: gradient computed for an input that does not require it"
            continue
        assert got is not None and got.dtype == dtype and got.shape == want.shape, key
        err = (got.detach().cpu().double() - want).abs()
        # Plus the subnormal spacing: fp16 products like gate * grad can land below its normal range.
        fi = torch.finfo(dtype)
        bound = RTOL[dtype] * scale[key] + 2 * fi.smallest_normal * fi.eps
        assert bool((err <= bound).all()), (
            f"{key} ({dtype}): max err {err.max().item():.3g}, worst err/bound "
            f"{(err / bound).max().item():.3g}")
    # Pure data movement must be exact, and untouched tokens bit-identical (incl. -0.0).
    assert torch.equal(res["gather"].cpu(), reference.gather_tokens(x, idx).cpu())
    cols = torch.arange(idx.shape[1]).expand_as(idx.cpu())
    want_dx = torch.zeros_like(x.cpu()).index_put_((idx.cpu(), cols), go_k.cpu())
    assert torch.equal(res["gather.dx"].cpu(), want_dx)
    if need[0]:
        assert torch.equal(res["scatter.dx"], go_full)
    routed = torch.zeros(x.shape[:2], dtype=torch.bool)
    routed[idx.cpu(), cols] = True
    bits = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[dtype]
    assert torch.equal(res["scatter"].cpu()[~routed].view(bits), x.cpu()[~routed].view(bits))


# ---------------------------------------------------------------- Triton (CPU interpreter, subprocess)

needs_interp = pytest.mark.skipif(
    not INTERP, reason="runs inside test_triton_interpreter's TRITON_INTERPRET=1 subprocess")


@needs_interp
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_interp_vs_reference(shape, dtype):
    inputs = make_inputs(shape, dtype, seed=3)
    check_against_truth(run_backend("triton", *inputs), *inputs)


@needs_interp
@pytest.mark.parametrize("need", [(False, True, False), (True, False, True)])
def test_triton_interp_partial_grads(need):
    inputs = make_inputs((7, 2, 5, 3), torch.float32, seed=4)
    check_against_truth(run_backend("triton", *inputs, need=need), *inputs, need=need)


@needs_interp
@pytest.mark.parametrize("h", [2048, 8192])
def test_triton_interp_at_model_widths(h):
    # the 1.65b backbone's width (one 2048-element block, 8 warps) and a wider one (two 4096-element chunks):
    # test_triton_interpreter compiles these launches for the GPUs, at the block sizes they train with
    inputs = make_inputs((4, 1, h, 2), torch.bfloat16, seed=6)
    check_against_truth(run_backend("triton", *inputs), *inputs)


@needs_interp
def test_triton_interp_chunked_rows(monkeypatch):
    # Rows wider than one program block take the multi-chunk loop (h > 4096 on real shapes).
    from megatron_xmod.xmod.permute import triton_ops

    monkeypatch.setattr(triton_ops, "_MAX_BLOCK_H", 16)
    inputs = make_inputs((6, 2, 37, 4), torch.bfloat16, seed=5)
    check_against_truth(run_backend("triton", *inputs), *inputs)


@needs_interp
def test_triton_interp_is_selected_when_forced(caplog):
    x, _, _, idx, _, _ = make_inputs((4, 1, 2, 2), torch.float32)
    with caplog.at_level(logging.INFO, logger="megatron_xmod.xmod.permute"):
        assert permute.selected_backend(x, "triton") == "triton"
        assert permute.selected_backend(x) == "torch"  # auto never interprets on CPU


def routed_update(backend, x, gate, idx, go_full, residual):
    """x updated at ``idx`` by gate * tanh(its own gathered tokens): the routed layer's pattern, one gather
    and one scatter of the same x. Returns (output, d x) for the output gradient ``go_full``."""
    (x,) = leaf(x)
    routed = permute.gather_tokens(x, idx, backend=backend, residual=residual)
    out = permute.scatter_gated(x, torch.tanh(routed), gate, idx, backend=backend, residual=residual)
    out.backward(go_full)
    return out.detach(), x.grad


@needs_interp
@pytest.mark.parametrize("shape", [(9, 3, 7, 2), (8, 1, 16, 8), (5, 2, 3, 0)])
def test_triton_interp_residual_gradient_goes_to_the_gather(shape):
    """With a ResidualGrad the scatter hands its identity gradient to the gather, whose one backward launch
    adds the scattered rows onto it: d x as plain torch autograd computes it, and no separate add."""
    from torch.profiler import profile

    x, _, gate, idx, go_full, _ = make_inputs(shape, torch.float32, seed=6)
    want_out, want_dx = routed_update("torch", x, gate, idx, go_full, None)
    with profile() as prof:
        out, dx = routed_update("triton", x, gate, idx, go_full, permute.ResidualGrad())
    assert torch.equal(out, want_out)
    torch.testing.assert_close(dx, want_dx, rtol=1e-6, atol=1e-6)
    names = [ev.name for ev in prof.events()]
    assert "aten::add" not in names and "aten::add_" not in names, names  # the engine summed nothing
    # without the hand-over the same gradient takes the engine's add of the two contributions
    with profile() as prof:
        _, unlinked = routed_update("triton", x, gate, idx, go_full, None)
    torch.testing.assert_close(unlinked, want_dx, rtol=1e-6, atol=1e-6)
    assert {"aten::add", "aten::add_"} & {ev.name for ev in prof.events()}


@needs_interp
def test_triton_interp_residual_is_handed_over_only_for_the_gathered_x():
    x, y, gate, idx, go_full, _ = make_inputs((6, 2, 4, 3), torch.float32, seed=7)
    residual = permute.ResidualGrad()
    (xa,) = leaf(x)
    routed = permute.gather_tokens(xa, idx, backend="triton", residual=residual)
    with pytest.raises(ValueError, match="residual: a ResidualGrad serves one gather"):
        permute.gather_tokens(xa, idx, backend="triton", residual=residual)
    (other,) = leaf(x)  # another x: its scatter keeps its own identity gradient
    out = permute.scatter_gated(other, torch.tanh(routed), gate, idx, backend="triton", residual=residual)
    out.backward(go_full)
    assert torch.equal(other.grad, go_full) and residual.grad is None
    cols = torch.arange(idx.shape[1]).expand_as(idx)
    assert xa.grad.abs().sum() > 0 and torch.equal(xa.grad[~torch.zeros(6, 2, dtype=torch.bool).index_put_(
        (idx, cols), torch.tensor(True))], torch.zeros(6 * 2 - idx.numel(), 4))


def test_triton_interpreter():
    """This file's ``triton_interp_`` tests under TRITON_INTERPRET=1; then every launch they made compiles for
    A100 and H100 (sm_80, sm_90) to a cubin that fits a block's registers and shared memory."""
    pytest.importorskip("triton")
    if INTERP:
        pytest.skip("already inside the interpreter run")
    run_triton_interp_tests(__file__, {"_gather_kernel", "_scatter_add_gated_kernel", "_scatter_backward_kernel"},
                            drop_env=(dispatch.ENV_BACKEND,), timeout=240)


# ---------------------------------------------------------------- CUDA extension

def _nvcc_present():
    home = os.environ.get("CUDA_HOME")
    return bool((home and os.path.isfile(os.path.join(home, "bin", "nvcc"))) or shutil.which("nvcc"))


def _built_ext():
    return glob.glob(os.path.join(PKG_DIR, "_permute_cuda*.so"))


@pytest.mark.skipif(not _nvcc_present() or torch.version.cuda is None
                    or os.environ.get("XMOD_BUILD_CUDA_EXT", "auto") in ("0", "false", "off"),
                    reason="no nvcc or CPU-only torch: setup.py skips the extension here")
def test_cuda_extension_was_built():
    assert _built_ext(), (f"nvcc and CUDA torch {torch.version.cuda} are present but {PKG_DIR} has no "
                          "_permute_cuda*.so; run scripts/setup_env.sh (pip install --no-build-isolation -e .)")


def test_cuda_extension_imports_and_fails_clearly_without_gpu():
    from megatron_xmod.xmod.permute import cuda_ops

    if not _built_ext():
        pytest.skip("extension not built (no CUDA toolkit at install time)")
    assert cuda_ops.is_built()
    x, _, _, idx, _, _ = make_inputs((4, 1, 8, 2), torch.float32)
    with pytest.raises(RuntimeError, match="CUDA"):
        cuda_ops.gather(x, idx)
    from megatron_xmod import _permute_cuda

    with pytest.raises(RuntimeError, match="x must be a CUDA tensor"):  # the extension's own check
        _permute_cuda.gather(x, idx)
    # The extension and its wrapper expose the three primitives the dispatcher calls.
    for name in ("gather", "scatter_add_gated", "scatter_backward"):
        assert callable(getattr(_permute_cuda, name)) and callable(getattr(cuda_ops, name)), name


def test_cuda_extension_holds_both_targets_kernels_without_spills():
    """scripts/setup_env.sh builds for sm_80 and sm_90 (TORCH_CUDA_ARCH_LIST "8.0;9.0" unless set): both cubins
    hold the three kernels for each dtype, and none has a stack frame, where ptxas would spill registers
    (read with the Triton wheel's cuobjdump)."""
    pytest.importorskip("triton")
    if not _built_ext():
        pytest.skip("extension not built (no CUDA toolkit at install time)")
    kernels = binary_resource_usage(_built_ext()[0])
    for arch in (80, 90):
        names = [k["kernel"] for k in kernels if k["arch"] == arch]
        for kernel in ("gather_rows_kernel", "scatter_add_gated_rows_kernel", "scatter_backward_kernel"):
            for dtype in ("__nv_bfloat16", "__half", "If"):
                assert any(kernel in name and dtype in name for name in names), (arch, kernel, dtype, names)
    assert kernels and all(k["stack"] == 0 and k["local"] == 0 for k in kernels), kernels


needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU")
GPU_SHAPES = [SHAPES[0], SHAPES[1], SHAPES[3], (512, 2, 2048, 64), (1000, 1, 1024, 1000), (300, 3, 1030, 37), (64, 2, 4097, 9)]


@needs_gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_backend_vs_reference(backend, shape, dtype):
    if backend == "cuda" and not _built_ext():
        pytest.skip("extension not built")
    inputs = make_inputs(shape, dtype, seed=6, device="cuda")
    assert permute.selected_backend(inputs[0], backend) == backend
    check_against_truth(run_backend(backend, *inputs), *inputs)


@needs_gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_residual_gradient_goes_to_the_gather(backend, dtype):
    if backend == "cuda" and not _built_ext():
        pytest.skip("extension not built")
    x, _, gate, idx, go_full, _ = make_inputs((300, 3, 1030, 37), dtype, seed=8, device="cuda")
    want_out, want_dx = routed_update("torch", x, gate, idx, go_full, None)
    out, dx = routed_update(backend, x, gate, idx, go_full, permute.ResidualGrad())
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(dx, want_dx)


@needs_gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_partial_grads_and_unaligned_views(backend):
    if backend == "cuda" and not _built_ext():
        pytest.skip("extension not built")
    x, y, gate, idx, go_full, go_k = make_inputs((40, 2, 64, 9), torch.bfloat16, seed=7, device="cuda")
    # An odd storage offset defeats 16-byte vector loads: the scalar path must handle it.
    x = torch.cat([x.new_zeros(1), x.flatten()])[1:].view(x.shape)
    for need in [(False, True, False), (True, False, True)]:
        inputs = (x, y, gate, idx, go_full, go_k)
        check_against_truth(run_backend(backend, *inputs, need=need), *inputs, need=need)


@needs_gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_large_case_L32768_b8_h8192_bf16(backend):
    """The paper's length at a wide hidden size (4 GiB per [L, b, h] tensor): 64-bit row offsets and
    the multi-chunk row loop, against the reference."""
    if backend == "cuda" and not _built_ext():
        pytest.skip("extension not built")
    L, b, h, k = 32768, 8, 8192, 32768 // 8
    gen = torch.Generator(device="cuda").manual_seed(0)
    idx = torch.rand(L, b, device="cuda", generator=gen).topk(k, dim=0).indices.sort(dim=0).values
    x = torch.randn(L, b, h, device="cuda", generator=gen, dtype=torch.bfloat16)
    y = torch.randn(k, b, h, device="cuda", generator=gen, dtype=torch.bfloat16)
    gate = torch.rand(k, b, device="cuda", generator=gen).to(torch.bfloat16)
    ops = dispatch._ops(backend)
    assert torch.equal(ops.gather(x, idx), reference.gather_tokens(x, idx))
    out = ops.scatter_add_gated(x, y, gate, idx, L)
    routed = torch.zeros(L, b, dtype=torch.bool, device="cuda").scatter_(0, idx, True)
    assert torch.equal(out[~routed].view(torch.int16), x[~routed].view(torch.int16))  # pass-through bits
    want = reference.gather_tokens(x, idx).float() + gate.float().unsqueeze(-1) * y.float()
    got = reference.gather_tokens(out, idx).float()
    assert ((got - want).abs() <= 2.0**-8 * want.abs() + 1e-30).all()  # one bf16 rounding
    del out, got, want
    grad_x = ops.scatter_add_gated(None, y, None, idx, L)  # the gather's backward
    assert torch.equal(reference.gather_tokens(grad_x, idx), y) and not grad_x[~routed].any()
    del grad_x
    go = x  # any [L, b, h] gradient
    gy, gg = ops.scatter_backward(go, y, gate, idx, True, True)
    rows = reference.gather_tokens(go, idx).float()
    want_gy = gate.float().unsqueeze(-1) * rows
    assert ((gy.float() - want_gy).abs() <= 2.0**-8 * want_gy.abs() + 1e-30).all()
    want_gg = (rows * y.float()).sum(-1)
    scale = (rows.abs() * y.float().abs()).sum(-1)
    assert ((gg.float() - want_gg).abs() <= 1e-5 * scale + 2.0**-8 * want_gg.abs()).all()


@needs_gpu
def test_gpu_auto_prefers_fastest(fresh_dispatch):
    x = torch.zeros(4, 1, 8, device="cuda")
    want = "cuda" if _built_ext() else "triton"
    assert permute.selected_backend(x) == want


# ---------------------------------------------------------------- dispatch and input checks

@pytest.fixture
def fresh_dispatch(monkeypatch):
    monkeypatch.setattr(dispatch, "_logged", set())
    monkeypatch.setattr(dispatch, "_configured", None)
    monkeypatch.delenv(dispatch.ENV_BACKEND, raising=False)


def test_cpu_dispatch_uses_torch_and_logs_once(fresh_dispatch, caplog):
    x, y, gate, idx, _, _ = make_inputs((6, 2, 4, 3), torch.float32)
    with caplog.at_level(logging.INFO, logger="megatron_xmod.xmod.permute"):
        for _ in range(3):
            out = permute.gather_tokens(x, idx)
    assert torch.equal(out, reference.gather_tokens(x, idx))
    lines = [r.getMessage() for r in caplog.records if r.name == "megatron_xmod.xmod.permute"]
    assert lines == ["gather_tokens: using the torch backend on cpu"]


@pytest.mark.parametrize("how", ["argument", "env", "set_backend"])
def test_forced_cuda_on_cpu_falls_back_with_reason(fresh_dispatch, monkeypatch, caplog, how):
    x, y, gate, idx, _, _ = make_inputs((6, 2, 4, 3), torch.float32)
    kw = {}
    if how == "argument":
        kw["backend"] = "cuda"
    elif how == "env":
        monkeypatch.setenv(dispatch.ENV_BACKEND, "CUDA")
    else:
        permute.set_backend("cuda")
    with caplog.at_level(logging.INFO, logger="megatron_xmod.xmod.permute"):
        out = permute.scatter_gated(x, y, gate, idx, **kw)
    assert torch.equal(out, reference.scatter_gated(x, y, gate, idx))
    warn = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warn) == 1 and "cuda backend requested" in warn[0] and "falling back to torch" in warn[0]
    assert "cuda:" in warn[0]  # carries the reason


def test_unknown_backend_name_is_an_error(fresh_dispatch, monkeypatch):
    x, _, _, idx, _, _ = make_inputs((4, 1, 2, 2), torch.float32)
    with pytest.raises(ValueError, match="backend='tpu'"):
        permute.gather_tokens(x, idx, backend="tpu")
    monkeypatch.setenv(dispatch.ENV_BACKEND, "fast")
    with pytest.raises(ValueError, match="XMOD_PERMUTE_BACKEND='fast'"):
        permute.gather_tokens(x, idx)


def test_fp64_on_fast_backend_falls_back_to_torch(fresh_dispatch, caplog):
    x, _, _, idx, _, _ = make_inputs((4, 1, 2, 2), torch.float64)
    with caplog.at_level(logging.WARNING, logger="megatron_xmod.xmod.permute"):
        assert permute.selected_backend(x, "triton") == "torch"
    assert "float64" in caplog.records[-1].getMessage()


def test_gate_dtype_is_cast_like_the_reference(fresh_dispatch):
    x, y, gate, idx, go, _ = make_inputs((6, 2, 4, 3), torch.bfloat16)
    g32 = gate.float().requires_grad_(True)
    out = permute.scatter_gated(x, y, g32, idx)
    assert out.dtype == torch.bfloat16
    out.backward(go)
    assert g32.grad.dtype == torch.float32


@pytest.mark.parametrize("case, exc, match", [
    ("x_2d", ValueError, "x must be a \\[s, b, h\\]"),
    ("x_int", TypeError, "x must be a floating-point"),
    ("idx_1d", ValueError, "indices must be a \\[k, b\\]"),
    ("idx_int32", TypeError, "indices must be int64"),
    ("idx_b", ValueError, "indices has b=3"),
    ("idx_k_gt_s", ValueError, "k=7 tokens"),
    ("idx_unsorted", ValueError, "strictly increasing"),
    ("idx_dup", ValueError, "strictly increasing"),
    ("idx_range", IndexError, "out of range"),
    ("idx_negative", IndexError, "out of range"),
    ("y_shape", ValueError, "y must be \\[k, b, h\\]"),
    ("y_dtype", TypeError, "y dtype torch.float16 must equal x dtype torch.float32"),
    ("gate_shape", ValueError, "gate must be \\[k, b\\]"),
    ("gate_int", TypeError, "gate must be floating point"),
])
def test_bad_inputs_raise_clear_errors(fresh_dispatch, case, exc, match):
    x, y, gate, idx, _, _ = make_inputs((6, 2, 4, 3), torch.float32)
    bad = {
        "x_2d": dict(x=x[:, 0]), "x_int": dict(x=x.long()), "idx_1d": dict(idx=idx[:, 0]),
        "idx_int32": dict(idx=idx.int()), "idx_b": dict(idx=torch.zeros(3, 3, dtype=torch.long)),
        "idx_k_gt_s": dict(idx=torch.zeros(7, 2, dtype=torch.long)),
        "idx_unsorted": dict(idx=idx.flip(0)), "idx_dup": dict(idx=torch.tensor([[0, 1], [0, 1], [2, 2]])),
        "idx_range": dict(idx=torch.tensor([[0, 1], [2, 3], [6, 5]])),
        "idx_negative": dict(idx=torch.tensor([[-1, 1], [2, 3], [4, 5]])),
        "y_shape": dict(y=y[:2]), "y_dtype": dict(y=y.half()), "gate_shape": dict(gate=gate[:, :1]),
        "gate_int": dict(gate=gate.long()),
    }[case]
    args = dict(x=x, y=y, gate=gate, idx=idx) | bad
    with pytest.raises(exc, match=match):
        if case.startswith(("x_", "idx_")):
            permute.gather_tokens(args["x"], args["idx"])
        permute.scatter_gated(args["x"], args["y"], args["gate"], args["idx"])


def test_index_value_checks_can_be_disabled(fresh_dispatch):
    x, _, _, idx, _, _ = make_inputs((6, 2, 4, 3), torch.float32)
    permute.gather_tokens(x, idx.flip(0), check=False)  # caller vouches for the indices
