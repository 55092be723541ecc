"""Compile the package's Triton kernels for real GPU targets on a machine without a GPU (a test tool).

The CPU tests run the kernels under ``TRITON_INTERPRET=1``, which executes them as numpy and accepts code
the GPU compiler rejects (a name a runtime branch rebinds to another type, a call of a plain Python
function), and says nothing of what a launch needs on a device (registers, shared memory). Triton's
compiler runs without a GPU once its driver is told the target, and ptxas comes with the Triton wheel,
so this tool compiles every kernel
launch the interpreted tests made, down to a cubin, for A100 (sm_80) and H100/H200 (sm_90), and reads
each cubin's registers and stack frame with the wheel's ``cuobjdump`` (and, where there is a frame, the
bytes ptxas spills registers to, with ``ptxas -v``):

1. :func:`record_launches` (installed by ``conftest.py`` when ``XMOD_TRITON_LAUNCHES`` names a file, in
   the child pytest of ``helpers.run_triton_interp_tests``) writes one descriptor per distinct
   specialisation of each launch: the kernel, its arguments as Triton specialises them (a tensor's dtype
   and 16-byte alignment, an integer's 1-ness, 16-divisibility and width, a float as fp32), constexprs and
   launch options by value.
2. ``python tests/triton_targets.py LAUNCHES.json`` (:func:`compile_for_gpus` runs it in a process of
   its own: without ``TRITON_INTERPRET`` the kernels are real ``JITFunction`` objects) rebuilds each
   launch with stand-in CPU tensors of the recorded dtypes and alignment, compiles it with
   ``JITFunction.warmup`` (compile only, nothing launched) per target, and prints one JSON line per
   compiled kernel. ``--all-flag-combinations`` compiles, for sm_90, each kernel's first launch with
   every combination of its boolean constexprs instead (192 for the two routing kernels: 70-80 s on 2
   cores, which is why the suite compiles what the tests launch).
"""
from __future__ import annotations

import atexit
import importlib
import inspect
import json
import os
import re
import subprocess
import sys

TARGETS = {80: "A100", 90: "H100/H200"}
# the most a block may use (dynamic shared memory opted in); registers per block are 64K 32-bit on both
SHARED_LIMIT = {80: 166912, 90: 232448}
REGISTERS_PER_BLOCK = 65536


def _describe(value):
    import torch

    if isinstance(value, torch.Tensor):
        return {"tensor": str(value.dtype).removeprefix("torch."), "misaligned": value.data_ptr() % 16}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    raise TypeError(f"triton_targets: cannot record a kernel argument of type {type(value).__name__}")


def _specialisation(described, constexpr: bool):
    """What Triton compiles a distinct kernel for: a constexpr's value; an integer argument's 1-ness,
    16-divisibility and width, not its value; a float argument's type only (fp32)."""
    value = described.get("value")
    if not constexpr and isinstance(value, int) and not isinstance(value, bool):
        return ["int", value == 1, value % 16 == 0, -2**31 <= value < 2**31]
    if not constexpr and isinstance(value, float):
        return ["fp32"]
    return described


def record_launches(path: str) -> None:
    """Record every launch of an interpreted kernel from now on; the distinct ones go to ``path`` at exit."""
    from triton.runtime.interpreter import InterpretedFunction

    seen: dict[str, dict] = {}
    constexprs: dict = {}  # kernel function -> which of its parameters are constexpr
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        launch = {"module": self.fn.__module__, "kernel": self.fn.__qualname__,
                  "args": [_describe(a) for a in args],
                  "kwargs": {name: _describe(value) for name, value in sorted(kwargs.items())}}
        if self.fn not in constexprs:
            constexprs[self.fn] = ["constexpr" in str(p.annotation) for p in inspect.signature(self.fn).parameters.values()]
        constexpr = constexprs[self.fn]
        # keyword arguments are the kernels' constexprs and the launch options (num_warps): kept by value
        key = json.dumps([launch["module"], launch["kernel"],
                          [_specialisation(a, c) for a, c in zip(launch["args"], constexpr)], launch["kwargs"]])
        seen.setdefault(key, launch)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    def write():
        with open(path, "w") as handle:
            json.dump(list(seen.values()), handle, indent=1)

    InterpretedFunction.run = recording_run
    atexit.register(write)


def _stand_in(described):
    import torch

    if "tensor" not in described:
        return described["value"]
    dtype = getattr(torch, described["tensor"])
    size = torch.empty((), dtype=dtype).element_size()
    base = torch.empty(64 // size + 16, dtype=dtype)  # CPU storage is 64-byte aligned
    skip = (-base.data_ptr() % 64 + described["misaligned"]) // size
    return base[skip:skip + 16]


def _target_only_driver(arch: int):
    """Triton's CUDA driver with the device questions answered for ``arch`` (nothing is launched)."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.driver import CudaDriver

    class TargetOnly(CudaDriver):
        def __init__(self):  # CudaDriver's would load libcuda
            self.target = GPUTarget("cuda", arch, 32)

        def get_current_target(self):
            return self.target

        def get_current_device(self):
            return arch  # the JIT keeps one kernel cache per device: one per target here

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

    return TargetOnly()


def _nvidia_tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


_USAGE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def binary_resource_usage(path: str) -> list[dict]:
    """Each kernel of each cubin in ``path`` (a cubin, or a host binary that embeds some: a CUDA extension's
    .so): its arch, (mangled) name, registers, stack frame, shared and local memory, as cuobjdump reads them."""
    text = subprocess.run([_nvidia_tool("cuobjdump"), "--dump-resource-usage", path], capture_output=True,
                          text=True, check=True).stdout
    kernels, arch = [], None
    for line in text.splitlines():
        if line.startswith("arch = sm_"):
            arch = int(line.removeprefix("arch = sm_"))
        elif line.strip().startswith("Function "):
            kernels.append({"arch": arch, "kernel": line.strip().removeprefix("Function ").rstrip(":")})
        elif (usage := _USAGE.search(line)) and kernels:
            kernels[-1].update(registers=int(usage[1]), stack=int(usage[2]), shared=int(usage[3]),
                               local=int(usage[4]))
    return kernels


def _resource_usage(compiled, arch: int) -> dict:
    """Registers and stack frame of a compiled kernel; where it has a stack frame, the bytes ptxas spills
    registers to (cuobjdump counts spills in the frame, not as local memory)."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        cubin, ptx = os.path.join(folder, "kernel.cubin"), os.path.join(folder, "kernel.ptx")
        with open(cubin, "wb") as handle:
            handle.write(compiled.asm["cubin"])
        (usage,) = binary_resource_usage(cubin)
        spill_stores = 0
        if usage["stack"]:
            with open(ptx, "w") as handle:
                handle.write(compiled.asm["ptx"])
            log = subprocess.run([_nvidia_tool("ptxas"), f"-arch=sm_{arch}{'a' if arch >= 90 else ''}", "-v", ptx,
                                  "-o", cubin], capture_output=True, text=True, check=True).stderr
            spill_stores = sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", log))
    return {"registers": usage["registers"], "stack": usage["stack"], "spill_stores": spill_stores}


def compile_launches(launches: list[dict], archs=tuple(TARGETS)) -> list[dict]:
    """Compile each recorded launch for each of ``archs``: one result per (launch, arch)."""
    from triton.runtime import driver

    results = []
    for arch in archs:  # the process ends after: no driver to reset to on a machine without a GPU
        driver.set_active(_target_only_driver(arch))
        for launch in launches:
            kernel = getattr(importlib.import_module(launch["module"]), launch["kernel"])
            args = [_stand_in(a) for a in launch["args"]]
            kwargs = {name: _stand_in(v) for name, v in launch["kwargs"].items()}
            result = {"kernel": launch["kernel"], "arch": arch}
            try:
                compiled = kernel.warmup(*args, grid=(1,), **kwargs)
            except Exception as error:  # reported, not raised: the test names every failing launch
                result["error"] = f"{type(error).__name__}: {error}"[:2000]
            else:
                meta = compiled.metadata
                result.update(num_warps=meta.num_warps, shared=meta.shared, cubin_bytes=len(compiled.asm["cubin"]),
                              **_resource_usage(compiled, arch))
            results.append(result)
    return results


def compile_for_gpus(launches_path: str, timeout: int = 600) -> list[dict]:
    """Run :func:`compile_launches` on the launches recorded in ``launches_path`` in a fresh process (without
    TRITON_INTERPRET: the kernels must be real JIT functions) on this checkout's package, as the tests
    import it. Returns its results."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "XMOD_TRITON_LAUNCHES")}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, __file__, launches_path], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def check_compiled(results: list[dict], kernels: set[str]) -> None:
    """Every launch compiled for every target and fits a block's registers and shared memory there without
    spilling registers; every kernel of ``kernels`` was among them."""
    failed = [f"{r['kernel']} sm_{r['arch']}: {r['error']}" for r in results if "error" in r]
    assert not failed, "\n".join(failed)
    for r in results:
        assert r["shared"] <= SHARED_LIMIT[r["arch"]], r
        assert r["registers"] * 32 * r["num_warps"] <= REGISTERS_PER_BLOCK, r
        assert r["spill_stores"] == 0, f"{r['kernel']} spills registers on sm_{r['arch']}: {r}"
    assert {r["arch"] for r in results} == set(TARGETS), results
    missing = kernels - {r["kernel"] for r in results}
    assert not missing, f"no interpreted test launched {sorted(missing)}"


def flag_combinations(launches: list[dict]) -> list[dict]:
    """Each kernel's first launch with every combination of its boolean keyword arguments (constexprs)."""
    import itertools

    first = {}
    for launch in launches:
        first.setdefault((launch["module"], launch["kernel"]), launch)
    combined = []
    for launch in first.values():
        flags = [name for name, value in launch["kwargs"].items() if isinstance(value.get("value"), bool)]
        for values in itertools.product([False, True], repeat=len(flags)):
            kwargs = dict(launch["kwargs"], **{name: {"value": v} for name, v in zip(flags, values)})
            combined.append(dict(launch, kwargs=kwargs))
    return combined


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Compile recorded Triton launches for GPU targets, no GPU needed.")
    parser.add_argument("launches", help="a file written by record_launches")
    parser.add_argument("--all-flag-combinations", action="store_true",
                        help="every combination of each kernel's boolean constexprs, for sm_90")
    options = parser.parse_args()
    with open(options.launches) as handle:
        recorded = json.load(handle)
    if options.all_flag_combinations:
        results = compile_launches(flag_combinations(recorded), archs=(90,))
    else:
        results = compile_launches(recorded)
    for line in results:
        print(json.dumps(line), flush=True)
