"""Shared fixtures: one gloo process group and megatron's model-parallel state, on CPU."""
import os

import pytest
import torch

from megatron_xmod.cpu_shim import cpu_patches

if os.environ.get("XMOD_TRITON_LAUNCHES") and os.environ.get("TRITON_INTERPRET") == "1":
    from triton_targets import record_launches  # the interpreted run of helpers.run_triton_interp_tests

    record_launches(os.environ["XMOD_TRITON_LAUNCHES"])


@pytest.fixture(scope="session", autouse=True)
def megatron_on_cpu():
    """megatron-core on CPU for the whole session (a no-op with a GPU)."""
    with cpu_patches(training=False):
        yield


@pytest.fixture(scope="session")
def megatron_parallel():
    from megatron.core import parallel_state

    if not torch.distributed.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    yield parallel_state


@pytest.fixture
def seeded(megatron_parallel):
    """Seed torch and megatron's model-parallel RNG tracker identically for every test."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)
    yield


@pytest.fixture
def fresh_moe_tracker():
    """megatron's MoE metrics tracker sizes its per-layer buffers on first use, and the aux-loss
    scale is created lazily as a 0-d tensor that megatron's schedule later copies a [1] tensor
    into: start each test with neither."""
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    destroy_moe_metrics_tracker()
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    yield
