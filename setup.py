"""megatron_xmod: sparse-depth routed transformers (X-MoD, MoD) as megatron-core layer specs.

Requirements here are ranges on purpose: users bring their own torch/megatron-core (NGC containers).
The exact versions this repository is tested with live in requirements/constraints.txt.

The CUDA extension ``megatron_xmod._permute_cuda`` (csrc/, routed-token permutation kernels) is
built only when a CUDA toolkit (nvcc) is found and the installed torch is a CUDA build; otherwise
the package installs without it and the permute ops use Triton or plain torch.
XMOD_BUILD_CUDA_EXT=0 skips it, =1 makes a missing toolkit an error (CI).
It needs torch at build time, so install with build isolation off
(``PIP_NO_BUILD_ISOLATION=0 pip install -e .`` / ``--no-build-isolation``, as scripts/setup_env.sh does).
"""
import os
import shutil
import sys

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _log(msg):
    print(f"[megatron_xmod setup] {msg}", file=sys.stderr)


def _find_cuda_home():
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    # torch derives CUDA_HOME from `which nvcc`; a wrapper script at /usr/local/bin/nvcc would make
    # that /usr/local, which has no CUDA headers. Prefer a real toolkit directory.
    for cand in ["/usr/local/cuda"] + sorted(
        (os.path.join("/usr/local", d) for d in os.listdir("/usr/local") if d.startswith("cuda-")),
        reverse=True,
    ):
        if os.path.isfile(os.path.join(cand, "bin", "nvcc")):
            return cand
    nvcc = shutil.which("nvcc")
    cand = os.path.dirname(os.path.dirname(os.path.realpath(nvcc))) if nvcc else None
    return cand if cand and os.path.isfile(os.path.join(cand, "include", "cuda_runtime.h")) else None


def _cuda_extension():
    """Return (ext_modules, cmdclass) for the permute extension, or ([], {}) with a reason logged."""
    mode = os.environ.get("XMOD_BUILD_CUDA_EXT", "auto").lower()
    if mode in ("0", "false", "no", "off"):
        _log("XMOD_BUILD_CUDA_EXT=0: skipping the CUDA permute extension")
        return [], {}
    required = mode in ("1", "true", "yes", "on")

    def skip(reason):
        if required:
            raise RuntimeError(f"XMOD_BUILD_CUDA_EXT=1 but the CUDA extension cannot be built: {reason}")
        _log(f"skipping the CUDA permute extension: {reason}")
        return [], {}

    cuda_home = _find_cuda_home()
    if not cuda_home or not os.path.isfile(os.path.join(cuda_home, "bin", "nvcc")):
        return skip("no CUDA toolkit (nvcc) found; set CUDA_HOME")
    os.environ["CUDA_HOME"] = cuda_home
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CUDAExtension
    except ImportError as e:  # e.g. pip's isolated build env, which has no torch
        return skip(f"torch is not importable at build time ({e}); install with --no-build-isolation")
    if torch.version.cuda is None:
        return skip(f"torch {torch.__version__} is a CPU-only build")
    # Without a visible GPU torch cannot infer the arch list (and crashes on an empty one).
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    include_dirs = [os.path.join(HERE, "csrc")]
    try:  # cuBLAS/cuSPARSE headers that ATen's CUDA headers pull in ship in the nvidia-* wheels
        import nvidia

        for sub in ("cu13/include", "cu12/include"):
            for root in nvidia.__path__:
                if os.path.isdir(os.path.join(root, sub)):
                    include_dirs.append(os.path.join(root, sub))
    except ImportError:
        pass
    _log(f"building the CUDA permute extension with CUDA_HOME={cuda_home} "
         f"TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']}")
    ext = CUDAExtension(
        name="megatron_xmod._permute_cuda",
        sources=["csrc/permute_bindings.cpp", "csrc/permute_kernels.cu", "csrc/graph_if_node_bindings.cpp",
                 "csrc/graph_if_node.cu"],
        include_dirs=include_dirs,
        extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3"]},
    )
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = _cuda_extension()

setup(
    name="megatron_xmod",
    version="0.1.0",
    description="X-MoD / MoD sparse-depth routing and DTop-p MoE for megatron-core",
    packages=find_packages(include=["megatron_xmod", "megatron_xmod.*"]),
    # the lm-eval task definitions; the seed spread `xmod demo` prints (bench/quality.py writes it)
    package_data={"megatron_xmod.hf.eval_tasks": ["*.yaml"], "megatron_xmod.data": ["*.json"]},
    python_requires=">=3.12",
    install_requires=[
        "torch>=2.6",
        "megatron-core>=0.19.2,<0.20",
        "numpy>=1.26",
    ],
    extras_require={
        "train": ["tensorboard>=2.15", "tqdm>=4.66", "sentencepiece>=0.2", "matplotlib>=3.8",
                  "emerging-optimizers>=0.3", "psutil>=5.9"],
        "export": ["transformers>=5.0", "safetensors>=0.4", "tokenizers>=0.21", "huggingface-hub>=1.0"],
        "eval": ["lm-eval[hf]>=0.4.9,<0.5"],
        "scaling": ["scipy>=1.11", "matplotlib>=3.8"],
        "test": ["pytest>=8", "ruff>=0.6"],
    },
    entry_points={"console_scripts": ["xmod=megatron_xmod.cli:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
