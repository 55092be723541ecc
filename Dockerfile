# megatron_xmod on NVIDIA's NGC PyTorch image: the plugin, its CUDA permutation extension (csrc/)
# and the pinned versions of requirements/constraints.txt, on the container's own torch.
#
#   docker build -t megatron-xmod .                    # or: --build-arg BASE_IMAGE=nvcr.io/nvidia/pytorch:<tag>
#   enroot import -o megatron-xmod.sqsh dockerd://megatron-xmod
#   srun --container-image=./megatron-xmod.sqsh --container-mounts=/data:/data ...   (docs/cluster.md)
#
# Base image. Our pins (requirements/constraints.txt) are torch 2.13.0 built for CUDA 13. NGC's
# monthly PyTorch images carry NVIDIA's own torch build (versioned like 2.13.0a0+<commit>), a full
# CUDA toolkit with nvcc (needed for csrc/), Transformer Engine, cuDNN and NCCL matched to it;
# 26.07 is the release expected to be the first on torch 2.13 with CUDA 13 (torch 2.13.0 was
# released in July 2026; NGC images track the upcoming torch). This could not be checked offline:
# compare NVIDIA's PyTorch release notes for the tag you pull. The first RUN stops the build,
# naming the versions found, when the image does not carry torch 2.13 with CUDA 13.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:26.07-py3
FROM ${BASE_IMAGE}

ARG TORCH_CUDA_ARCH_LIST="8.0;9.0;10.0"
ARG MAX_JOBS=8
ENV TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST} \
    MAX_JOBS=${MAX_JOBS} \
    XMOD_BUILD_CUDA_EXT=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    CUDA_DEVICE_MAX_CONNECTIONS=1

RUN python -c "import sys, torch; v, c = torch.__version__, torch.version.cuda or 'none'; \
ok = v.startswith('2.13') and c.startswith('13'); \
print(f'base image: torch {v}, CUDA {c}'); \
sys.exit(0 if ok else f'BASE_IMAGE: torch {v} / CUDA {c} found; this Dockerfile expects torch 2.13 with CUDA 13 (requirements/constraints.txt)')"

WORKDIR /opt/megatron_xmod
COPY requirements/ requirements/
COPY setup.py pyproject.toml README.md ./
COPY csrc/ csrc/
COPY megatron_xmod/ megatron_xmod/
COPY examples/ examples/
COPY slurm/ slurm/

# Pinned versions from requirements/constraints.txt, except torch itself: the image's torch
# (2.13.0a0+<commit>, CUDA 13) is the one to keep, and pip would otherwise replace it with PyPI's
# 2.13.0 wheel. No build isolation: setup.py imports torch to build the CUDA extension
# (XMOD_BUILD_CUDA_EXT=1 makes a missing toolkit an error instead of a silent skip).
RUN rm -f megatron_xmod/*.so \
 && grep -v '^torch==' requirements/constraints.txt > /tmp/constraints-ngc.txt \
 && pip install --no-cache-dir --no-build-isolation -c /tmp/constraints-ngc.txt ".[train,export,scaling]" \
 && pip install --no-cache-dir -c /tmp/constraints-ngc.txt tiktoken \
 && pip install --no-cache-dir -c /tmp/constraints-ngc.txt --no-deps openai-whisper \
 && python -c "import megatron_xmod._permute_cuda, megatron.core, megatron_xmod.spec; print('megatron_xmod ready')"

WORKDIR /workspace
