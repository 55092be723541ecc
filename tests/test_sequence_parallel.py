"""Routed layers under tensor parallelism 2 with sequence parallelism equal tensor parallelism 1: the
top-k ranks the whole sequence although each rank holds half of it. torchrun --nproc_per_node=2 on
gloo (worker: tests/dist_worker_sp.py): the same weights and batches, 6 SGD steps through megatron's
DistributedDataParallel and finalize_model_grads; the losses agree to fp32 tolerance, every sparse
layer routes the same tokens at every step, and so does the threshold rule of evaluation; both update the
residual stream in place.
megatron's local-spec norm runs under sequence parallelism through numbered patch 21 (cpu_patches)."""
import os
import socket
import subprocess
import sys

import pytest
import torch
from entry_point_helpers import tagged_json

from megatron_xmod.cpu_shim import cpu_mode

WORKER = os.path.join(os.path.dirname(__file__), "dist_worker_sp.py")
STEPS = 6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _norm_config(**overrides):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(**dict(dict(num_layers=1, hidden_size=8, num_attention_heads=2, tensor_model_parallel_size=2,
                                         sequence_parallel=True, normalization="RMSNorm"), **overrides))


@pytest.mark.skipif(not cpu_mode(), reason="patch 21 is a CPU patch; GPU runs use TENorm")
@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
def test_local_norm_under_sequence_parallel_is_torch_norm_tagged_for_tp_grad_reduction(normalization):
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    norm = WrappedTorchNorm(_norm_config(normalization=normalization), 8, eps=1e-6)
    reference = dict(RMSNorm=torch.nn.RMSNorm, LayerNorm=torch.nn.LayerNorm)[normalization]
    assert type(norm) is reference
    assert norm.weight.shape == (8,) and all(p.sequence_parallel is True for p in norm.parameters())
    with torch.no_grad():
        for p in norm.parameters():
            p.uniform_(0.5, 1.5)
    x = torch.randn(3, 2, 8)  # a sequence shard: the norm is per token, so the shard's output is the whole's rows
    if normalization == "RMSNorm":
        expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight
    else:
        centred = x - x.mean(-1, keepdim=True)
        expected = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight + norm.bias
    torch.testing.assert_close(norm(x), expected)
    # without sequence parallelism: megatron's own behaviour, untagged parameters
    plain = WrappedTorchNorm(_norm_config(normalization=normalization, sequence_parallel=False), 8)
    assert not any(hasattr(p, "sequence_parallel") for p in plain.parameters())
    # megatron's other refusals stand
    with pytest.raises(AssertionError, match="zero_centered_gamma"):
        WrappedTorchNorm(_norm_config(normalization=normalization, layernorm_zero_centered_gamma=True), 8)


@pytest.mark.slow  # torchrun workers
@pytest.mark.parametrize("family", ["xmod", "mod"])
def test_tp2_sequence_parallel_equals_tp1(family):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port", str(_free_port()),
         WORKER, family, str(STEPS)], capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    runs = tagged_json(result.stdout, "RESULT")
    tp1, tp2 = runs["tp1"], runs["tp2_sp"]
    assert len(tp1["losses"]) == STEPS
    assert tp2["losses"] == pytest.approx(tp1["losses"], rel=1e-5)
    assert tp1["losses"][-1] < tp1["losses"][0]  # it trained
    # routed sets: 3 sparse layers per training step, then the evaluation's threshold routing
    assert len(tp1["routed"]) == 3 * STEPS + 3
    assert tp2["routed"] == tp1["routed"]
    assert tp2["eval_loss"] == pytest.approx(tp1["eval_loss"], rel=1e-5)
    # Both update the residual stream in place along the block's chain of 3 sparse layers (TP1: the torch
    # permutation backend; TP2: sequence parallelism's update, with the other rank's tokens at row 0): the chain's
    # first layer writes into a copy, the next two into their input; the threshold rule of evaluation does not.
    assert tp1["in_place"] == tp2["in_place"] == [False, True, True] * STEPS + [False] * 3
