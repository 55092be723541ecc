"""torchrun worker for test_dtopp_dist.py (no tests of its own): EP=2 x DP=2 on 2 gloo processes; every rank sees its
own data, and after every step p_t must be the same on all ranks. Usage: <steps> <dispatcher>..."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from megatron_xmod import cpu_compat  # noqa: E402

cpu_compat.install(training=False)


def run(dispatcher: str, steps: int) -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from helpers import TINY
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
        gathered = [torch.empty_like(state) for _ in range(world)]
        torch.distributed.all_gather(gathered, state)
        assert all(torch.equal(gathered[0], other) for other in gathered[1:]), (step, gathered)
        thresholds.append(state[0, 0].item())
    rates = [torch.empty(steps, dtype=torch.float64) for _ in range(world)]
    torch.distributed.all_gather(rates, torch.tensor(local_rates, dtype=torch.float64))
    assert not torch.equal(rates[0], rates[1]), "ranks saw identical activations: the test would prove nothing"
    assert thresholds[-1] != config.dtopp_p0
    if rank == 0:
        print(f"OK {dispatcher} thresholds={[round(t, 4) for t in thresholds]}", flush=True)


def main(steps: int, dispatchers: list[str]) -> None:
    from megatron.core import parallel_state

    torch.distributed.init_process_group("gloo")
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=torch.distributed.get_world_size())
    for dispatcher in dispatchers:
        run(dispatcher, steps)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2:])
