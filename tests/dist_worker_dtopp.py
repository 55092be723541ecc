"""torchrun worker for test_dtopp_dist.py (no tests of its own; not named test_* so that pytest does
not collect it), on 2 gloo processes. Usage: <mode> <steps> [<dispatcher>...]

- ``ep``: expert-parallel 2 x data-parallel 2, every rank sees its own data; after every step p_t
  must be the same on all ranks, for each dispatcher given.
- ``tp-sp``: tensor-parallel 2 with sequence parallelism, both ranks see the same batch but route
  different halves of the sequence; after megatron's finalize_model_grads the gradient of every
  DRN temperature theta_l (and of the gate weight) must be the same on both ranks, and so must
  theta_l after the update.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from megatron_xmod.cpu_shim import cpu_patches  # noqa: E402


def _same_on_all_ranks(tensor: torch.Tensor) -> bool:
    gathered = [torch.empty_like(tensor) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(gathered, tensor.contiguous())
    return all(torch.equal(gathered[0], other) for other in gathered[1:])


def run_ep(dispatcher: str, steps: int) -> None:
    from helpers import TINY
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_xmod.moe.model import build_moe_gpt_model, moe_config_from_backbone
    from megatron_xmod.moe.router import dtopp_routers, update_dtopp_controllers

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    assert parallel_state.get_data_parallel_world_size() == world  # dense params (routers): DP = 2
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    overrides = dict(use_cpu_initialization=True, expert_model_parallel_size=world, moe_token_dispatcher_type=dispatcher,
                     dtopp_kp=0.5, dtopp_ki=0.5, moe_shared_expert_intermediate_size=None)
    if dispatcher == "alltoall":
        overrides["moe_expert_capacity_factor"] = 8.0  # >= experts / moe_router_topk: never drops
    config = moe_config_from_backbone(TINY, "dtopp-t2-e8", **overrides)
    model = build_moe_gpt_model(config, TINY.vocab_size, 16, rotary_base=TINY.rotary_base)
    routers = dtopp_routers(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(100 + rank)  # different tokens on every rank
    local_rates, thresholds = [], []
    for step in range(steps):
        tokens = torch.randint(0, TINY.vocab_size, (2, 16), generator=g)
        loss = model(tokens, torch.arange(16).expand(2, 16), None, labels=tokens).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()  # no gradient all-reduce: the ranks' routers drift apart on purpose
        local_rates.append(sum(r.dtopp_active_sum.item() for r in routers) / sum(r.dtopp_token_count.item() for r in routers))
        update_dtopp_controllers(model)
        state = torch.stack([torch.cat([r.dtopp_threshold, r.dtopp_integral]) for r in routers])
        assert _same_on_all_ranks(state), (step, state)
        thresholds.append(state[0, 0].item())
    rates = [torch.empty(steps, dtype=torch.float64) for _ in range(world)]
    torch.distributed.all_gather(rates, torch.tensor(local_rates, dtype=torch.float64))
    assert not torch.equal(rates[0], rates[1]), "ranks saw identical activations: the test would prove nothing"
    assert thresholds[-1] != config.dtopp_p0
    if rank == 0:
        print(f"OK {dispatcher} thresholds={[round(t, 4) for t in thresholds]}", flush=True)


def run_tp_sp(steps: int) -> None:
    from helpers import TINY
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    from megatron_xmod.moe.model import get_moe_layer_spec, moe_config_from_backbone
    from megatron_xmod.moe.router import DTopPRouter, dtopp_finalize_model_grads

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    # The MoE config must accept TP2 + SP (megatron's MoE layer refuses TP > 1 without SP in training).
    config = moe_config_from_backbone(TINY, "dtopp-t2-e8", use_cpu_initialization=True,
                                      tensor_model_parallel_size=world, sequence_parallel=True)
    # megatron's MoE layer (router, TP-sharded experts and shared experts, allgather dispatcher) as
    # the layer spec builds it. Not a whole GPT: without Transformer Engine or apex the local spec's
    # torch norms refuse sequence parallelism, while the MoE layer is all this test needs.
    moe = get_moe_layer_spec(config).submodules.mlp(config=config, pg_collection=get_default_pg_collection())
    moe.set_layer_number(1)
    model = DistributedDataParallel(config, DistributedDataParallelConfig(), moe)
    router = moe.router
    assert isinstance(router, DTopPRouter) and router.drn_scale is not None
    # Sequence parallel: each TP rank holds its own slice of the sequence [s / TP, b, h].
    g = torch.Generator().manual_seed(100 + rank)
    local_grads_differ = False
    for step in range(steps):
        model.zero_grad_buffer()
        hidden = torch.randn(8, 2, TINY.hidden_size, generator=g)
        output, _ = model(hidden)
        output.float().square().mean().backward()
        local_grads_differ |= not _same_on_all_ranks(router.drn_scale.main_grad.clone())
        # megatron's finalize_model_grads, then the controller update: build_moe_gpt_model installs
        # it as config.finalize_model_grads_func, which megatron's training loop calls.
        dtopp_finalize_model_grads([model])
        theta_grad = router.drn_scale.main_grad
        assert _same_on_all_ranks(theta_grad), f"step {step}: the theta_l gradients differ across TP ranks"
        assert _same_on_all_ranks(router.weight.main_grad)  # megatron's own tag, for comparison
        assert theta_grad.abs().item() > 0
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.5 * p.main_grad
        assert _same_on_all_ranks(router.drn_scale.detach()), f"step {step}: theta_l differs across TP ranks"
        assert _same_on_all_ranks(router.dtopp_threshold)
    assert local_grads_differ, "both TP ranks had the same local theta_l gradient: the test would prove nothing"
    assert router.drn_scale.item() != config.dtopp_routing_norm_init
    if rank == 0:
        print(f"OK tp-sp theta={router.drn_scale.item():.6f}", flush=True)


def main(mode: str, steps: int, dispatchers: list[str]) -> None:
    from megatron.core import parallel_state

    torch.distributed.init_process_group("gloo")
    world = torch.distributed.get_world_size()
    if mode == "ep":
        parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=world)
        for dispatcher in dispatchers:
            run_ep(dispatcher, steps)
    elif mode == "tp-sp":
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
        run_tp_sp(steps)
    else:
        raise ValueError(f"mode: {mode!r} is not 'ep' or 'tp-sp'")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    with cpu_patches(training=False):  # megatron-core on CPU, as tests/conftest.py
        main(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
