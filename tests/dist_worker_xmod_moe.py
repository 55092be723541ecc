"""torchrun worker for tests/test_xmod_moe.py (not collected: no test_ prefix), 2 gloo processes.

A routed layer with megatron's MoE feed-forward at TP 2 with sequence parallelism: L = 60 at K = 4
routes 15 tokens a sequence, padded to 16 so that each rank holds 8 routed rows, one of them padding.
One training forward and backward; rank 0 prints ``RESULT {json}``: per routed layer, the expert-bias
loads summed over the TP ranks, and what routing the real tokens alone would load (top-k x 15 x b).
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from megatron_xmod.cpu_shim import cpu_patches  # noqa: E402

SEQ, BATCH, LAYOUT = 60, 2, "D + (S4*2 + D)"


def main() -> None:
    from helpers import TINY
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_xmod.model import sparse_layers
    from megatron_xmod.moe.model import build_moe_gpt_model, moe_config_from_backbone

    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    config = moe_config_from_backbone(TINY, LAYOUT + "+moe-8x64", use_cpu_initialization=True,
                                      tensor_model_parallel_size=2, sequence_parallel=True)
    model = build_moe_gpt_model(config, TINY.vocab_size, SEQ, rotary_base=TINY.rotary_base)
    model.train()
    tokens = torch.randint(0, TINY.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    model(tokens, torch.arange(SEQ).expand(BATCH, SEQ), None, labels=tokens).mean().backward()
    loads = []
    for layer in sparse_layers(model):
        counted = layer.mlp.router.local_tokens_per_expert.sum().clone()
        torch.distributed.all_reduce(counted)  # each TP rank counts the routed rows it holds
        loads.append(int(counted))
    if rank == 0:
        print("RESULT " + json.dumps({"loads": loads, "real": config.moe_router_topk * (SEQ // 4) * BATCH}), flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    with cpu_patches(training=False):  # megatron-core on CPU, as tests/conftest.py
        main()
