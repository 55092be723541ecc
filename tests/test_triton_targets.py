"""The GPU-target compile of recorded Triton launches (tests/triton_targets.py) catches what the interpreter
accepts and a GPU compiler refuses, and reports a compiled kernel's resources."""
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

from triton_targets import check_compiled, compile_for_gpus, flag_combinations  # noqa: E402

KERNELS = textwrap.dedent('''
    import torch
    import triton
    import triton.language as tl


    def _twice(v):  # not @triton.jit: the interpreter calls it as Python, a GPU compiler cannot
        return v * 2


    @triton.jit
    def copy_twice_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        m = offs < n
        tl.store(out_ptr + offs, _twice(tl.load(x_ptr + offs, mask=m)), mask=m)


    @triton.jit
    def copy_scaled_kernel(x_ptr, out_ptr, n, scale, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        m = offs < n
        tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=m) * scale, mask=m)


    @triton.jit
    def crowded_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):  # four 4096-element blocks live in one warp
        offs = tl.arange(0, BLOCK)
        a, b = tl.load(x_ptr + offs), tl.load(x_ptr + BLOCK + offs)
        c, d = tl.load(x_ptr + 2 * BLOCK + offs), tl.load(x_ptr + 3 * BLOCK + offs)
        tl.store(out_ptr + offs, a * tl.sum(b * c, axis=0) + d * tl.sum(a * b, axis=0))
        tl.store(out_ptr + BLOCK + offs, b * tl.sum(c * d, axis=0) + c * tl.sum(a * d, axis=0))


    def run():
        x = torch.arange(24.0)
        out, scaled = torch.empty(24), torch.empty(24, dtype=torch.bfloat16)
        copy_twice_kernel[(1,)](x, out, 24, BLOCK=32)
        copy_scaled_kernel[(1,)](x, scaled, 24, 0.5, BLOCK=32)
        copy_scaled_kernel[(1,)](x, scaled, 24, 0.5, BLOCK=32)  # the same specialisation: recorded once
        crowded_kernel[(1,)](torch.ones(4 * 4096), torch.empty(2 * 4096), BLOCK=4096, num_warps=1)
        return out, scaled
''')


def test_interpreted_launches_that_no_gpu_compiles_are_named(tmp_path, monkeypatch):
    (tmp_path / "toy_kernels.py").write_text(KERNELS)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p))
    launches = tmp_path / "launches.json"
    script = ("import sys; sys.path.insert(0, sys.argv[1]); from triton_targets import record_launches; "
              "record_launches(sys.argv[2]); import toy_kernels; out, scaled = toy_kernels.run(); "
              "assert out[5] == 10 and scaled[5] == 2.5, (out, scaled)")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", script, os.path.dirname(__file__), str(launches)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]  # the interpreter runs both kernels correctly

    results = compile_for_gpus(launches)
    by_kernel = {}
    for result in results:
        by_kernel.setdefault(result["kernel"], []).append(result)
    assert sorted(by_kernel) == ["copy_scaled_kernel", "copy_twice_kernel", "crowded_kernel"]
    assert [r["arch"] for r in by_kernel["copy_scaled_kernel"]] == [80, 90]  # once per target
    for good in by_kernel["copy_scaled_kernel"]:
        assert "error" not in good, good
        assert good["registers"] > 0 and good["cubin_bytes"] > 0 and good["spill_stores"] == 0, good
    for bad in by_kernel["copy_twice_kernel"]:
        assert "_twice" in bad["error"], bad
    for crowded in by_kernel["crowded_kernel"]:  # compiles, but spills registers (into its stack frame)
        assert "error" not in crowded and crowded["stack"] > 0 and crowded["spill_stores"] > 0, crowded
    with pytest.raises(AssertionError, match="crowded_kernel spills registers on sm_80"):
        check_compiled(by_kernel["crowded_kernel"], {"crowded_kernel"})
    with pytest.raises(AssertionError, match=r"copy_twice_kernel sm_80: .*_twice"):
        check_compiled(results, {"copy_scaled_kernel"})
    check_compiled(by_kernel["copy_scaled_kernel"], {"copy_scaled_kernel"})
    with pytest.raises(AssertionError, match="no interpreted test launched"):
        check_compiled(by_kernel["copy_scaled_kernel"], {"copy_scaled_kernel", "never_launched_kernel"})


def test_flag_combinations_vary_only_the_boolean_constexprs():
    launch = {"module": "m", "kernel": "k", "args": [{"value": 3}],
              "kwargs": {"HAS_X": {"value": True}, "NEED_Y": {"value": False}, "BLOCK": {"value": 64}}}
    combined = flag_combinations([launch, dict(launch, args=[{"value": 5}])])  # the kernel's first launch only
    assert sorted((c["kwargs"]["HAS_X"]["value"], c["kwargs"]["NEED_Y"]["value"]) for c in combined) == [
        (False, False), (False, True), (True, False), (True, True)]
    assert all(c["kwargs"]["BLOCK"] == {"value": 64} and c["args"] == [{"value": 3}] for c in combined)
