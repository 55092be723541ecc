"""The CPU shim's patches 27, 28 and 31: megatron's DDP buffer collectives over a one-rank group are the copy they
are; megatron's import-time torch.compile decorations build nothing until a compiled function is called; the
transformer block runs without the device-rewriting mode."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["dist_reduce_scatter_func", "dist_all_gather_func"])
def test_one_rank_buffer_collective_is_a_copy(megatron_parallel, name):
    import megatron.core.distributed.param_and_grad_buffer as buffers

    if torch.cuda.is_available():
        pytest.skip("the CPU shim is not installed where CUDA is available")
    patched = getattr(buffers, name)
    group = megatron_parallel.get_data_parallel_group()
    assert torch.distributed.get_world_size(group) == 1
    buffer = torch.randn(64)
    shard = buffer.view(-1)  # megatron's shard of a one-rank group: the whole buffer
    expected = buffer.clone()
    kwargs = dict(group=group, async_op=False)
    if name == "dist_reduce_scatter_func":
        kwargs["op"] = torch.distributed.ReduceOp.SUM
    output, input = (shard, buffer) if name == "dist_reduce_scatter_func" else (buffer, shard)

    with _Ops() as ops:  # the patched call: no collective, no op at all when the memory is shared
        assert patched(output, input, **kwargs) is None
    assert ops.names == [] and torch.equal(buffer, expected)

    elsewhere = torch.empty(64)
    with _Ops() as ops:  # a separate output receives the input (the sum over one rank)
        patched(elsewhere, buffer, **kwargs)
    assert [n for n in ops.names if n != "aten.view"] == ["aten.copy_"] and torch.equal(elsewhere, expected)

    with _Ops() as ops:  # what megatron would call without the patch: gloo's collective
        patched.__wrapped__(output, input, **kwargs)
    assert any(n.startswith("c10d.") for n in ops.names), ops.names
    assert torch.equal(buffer, expected)


def test_megatron_imports_without_building_compile_wrappers():
    """Patch 28: megatron's import-time ``torch.compile`` decorations build nothing (no TorchInductor import,
    ~4 s of every process's start-up), and a compiled function still computes what it did."""
    import subprocess
    import sys

    if torch.cuda.is_available():
        pytest.skip("the CPU shim is not installed where CUDA is available")
    probe = ("import sys, torch\n"
             "{first}\n"
             "import megatron.core.models.gpt, megatron.core.transformer.moe.router\n"
             "f = torch.compile(lambda x: x * 2 + 1)\n"
             "print(sorted(m for m in ('torch._inductor', 'torch._dynamo') if m in sys.modules), "
             "f(torch.ones(2)).tolist(), type(torch.compile(torch.nn.Linear(2, 2))).__name__)\n")
    shimmed = subprocess.run([sys.executable, "-c", probe.format(first="import megatron_xmod.cpu_shim")],
                             capture_output=True, text=True, timeout=300)
    assert shimmed.returncode == 0, shimmed.stderr[-3000:]
    assert shimmed.stdout.split("\n")[-2] == "[] [3.0, 3.0] OptimizedModule"
    plain = subprocess.run([sys.executable, "-c", probe.format(first="pass")], capture_output=True, text=True,
                           timeout=300)
    assert plain.returncode == 0 and plain.stdout.split("\n")[-2].startswith("['torch._dynamo', 'torch._inductor']")


def test_transformer_block_runs_without_the_device_mode(seeded):
    """Patch 31: megatron's TransformerBlock.forward runs its layers without the shim's torch-function mode
    (its per-call cost), which stays in force around the block (the embedding) and after it; the block
    computes what its own forward computes under the mode."""
    from megatron_xmod.cpu_shim import _CudaDeviceToCpu
    from tests.helpers import tiny_model

    if torch.cuda.is_available():
        pytest.skip("the CPU shim is not installed where CUDA is available")
    current = torch.overrides._get_current_function_mode
    assert isinstance(current(), _CudaDeviceToCpu)  # the session's cpu_patches
    model, _ = tiny_model("D + S4*2 + D")
    model.eval()
    seen = {}

    def record(name):
        def hook(module, args):
            seen.setdefault(name, current())
        return hook

    model.decoder.layers[1].register_forward_pre_hook(record("layer"))
    model.embedding.register_forward_pre_hook(record("embedding"))
    tokens = torch.randint(0, 256, (2, 64))
    with torch.no_grad():
        hidden = model.embedding(tokens, torch.arange(64).expand(2, -1))
        rope = model.rotary_pos_emb(64)
        patched = model.decoder(hidden, None, rotary_pos_emb=rope)
        under_mode = type(model.decoder).forward.__wrapped__(model.decoder, hidden, None, rotary_pos_emb=rope)
    assert seen["layer"] is None, seen
    assert isinstance(seen["embedding"], _CudaDeviceToCpu) and isinstance(current(), _CudaDeviceToCpu)
    torch.testing.assert_close(patched, under_mode, rtol=0, atol=0)
