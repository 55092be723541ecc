"""torchrun worker for test_sequence_parallel.py and test_host_syncs.py (not collected: no test_ prefix),
2 gloo processes. Usage: <family> <steps>

Trains the same tiny routed model twice from the same weights on the same batches: first at TP1 (the
two processes are data-parallel replicas with identical data), then at TP2 with sequence parallelism
(each rank holds half of every sequence); both through megatron's DistributedDataParallel and
finalize_model_grads. The local spec's norms run under sequence parallelism through numbered patch 21
(megatron_xmod.training.patches, part of cpu_patches). Rank 0 prints one JSON line per run: the
losses, the routed sets of every sparse layer at every step (training top-k, then evaluation
threshold), the eval loss, and per sparse-layer call whether it updated its input in place.

Usage: syncs <steps> (tests/test_host_syncs.py): TP2 with sequence parallelism only, X-MoD and MoD; every
rank counts the host syncs (tests/sync_counter.py) of each training step's forward and backward, and of an
evaluation forward under the threshold rule and under top-k; rank 0 prints one ``SYNCS [json per rank]`` line.
"""
import hashlib
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from megatron_xmod.cpu_shim import cpu_patches  # noqa: E402

SEQ, BATCH, LAYOUT = 32, 2, "D + (S4 + S2 + S4 + D)"  # S2: k = L/2 is every row of a TP2 shard


def _build(family, tp, full_state=None):
    from helpers import TINY
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_xmod.model import build_gpt_model, config_from_backbone

    config = config_from_backbone(TINY, LAYOUT, use_cpu_initialization=True, xmod_routing_family=family,
                                  tensor_model_parallel_size=tp, sequence_parallel=tp > 1)
    model = build_gpt_model(config, TINY.vocab_size, SEQ, rotary_base=TINY.rotary_base)
    if full_state is not None:
        model.load_state_dict(_shard(full_state, model.state_dict(), tp))
    return DistributedDataParallel(config, DistributedDataParallelConfig(), model), model


def _shard(full, local, tp):
    """This TP rank's part of a TP1 state dict (megatron's partitioning: the one dimension that differs;
    SwiGLU's fc1 holds [gate; up] and each rank gets its slice of both)."""
    from megatron.core import parallel_state

    rank = parallel_state.get_tensor_model_parallel_rank()
    out = {}
    for name, tensor in local.items():
        if not torch.is_tensor(tensor):  # megatron's _extra_state entries
            out[name] = tensor
            continue
        source = full[name]
        if tensor.shape == source.shape:
            out[name] = source
            continue
        if name.endswith("linear_fc1.weight"):
            out[name] = torch.cat([half.chunk(tp, 0)[rank] for half in source.chunk(2, 0)])
            continue
        dim = next(d for d in range(tensor.dim()) if tensor.shape[d] != source.shape[d])
        out[name] = source.chunk(tp, dim)[rank]
    return out


def _train(ddp, model, steps):
    from helpers import record_in_place
    from megatron.core.distributed import finalize_model_grads

    from megatron_xmod.model import sparse_layers

    routed = []
    in_place = record_in_place(sparse_layers(model))  # per call: did the layer write into its input's storage
    state = sparse_layers(model)[0].routing_state
    state.observers.append(lambda layer, logits, decision: routed.append(
        hashlib.sha1(decision.selected.cpu().numpy().tobytes()).hexdigest()[:12]))
    g = torch.Generator().manual_seed(7)
    losses = []
    model.train()
    for _ in range(steps):
        tokens = torch.randint(0, 256, (BATCH, SEQ), generator=g)
        ddp.zero_grad_buffer()
        loss = model(tokens, torch.arange(SEQ).expand_as(tokens), None, labels=tokens).float().mean()
        loss.backward()
        finalize_model_grads([ddp])
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.5 * p.main_grad
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():  # evaluation: the threshold rule
        tokens = torch.randint(0, 256, (BATCH, SEQ), generator=g)
        eval_loss = model(tokens, torch.arange(SEQ).expand_as(tokens), None, labels=tokens).float().mean().item()
    return dict(losses=losses, routed=routed, eval_loss=eval_loss, in_place=in_place)


def main(family: str, steps: int) -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_xmod.model import sparse_layers

    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    ddp, model = _build(family, 1)
    with torch.no_grad():  # content-dependent routing with margins (fp32 reduction order cannot flip it)
        for layer in sparse_layers(model):
            layer.router.weight.mul_(20.0)
    initial = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    tp1 = _train(ddp, model, steps)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    model_parallel_cuda_manual_seed(0)
    ddp, model = _build(family, 2, initial)
    tp2 = _train(ddp, model, steps)
    if rank == 0:
        print("RESULT " + json.dumps(dict(family=family, tp1=tp1, tp2_sp=tp2)), flush=True)
    torch.distributed.destroy_process_group()


def _count_syncs(family, steps):
    from sync_counter import SyncCounter

    from megatron_xmod.model import sparse_layers
    from megatron_xmod.xmod.routing_state import eval_routing

    ddp, model = _build(family, 2)
    with torch.no_grad():
        for layer in sparse_layers(model):
            layer.router.weight.mul_(20.0)
    g = torch.Generator().manual_seed(7)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    out = dict(train=[], sparse_layers=len(sparse_layers(model)))
    model.train()
    for _ in range(steps):
        tokens = torch.randint(0, 256, (BATCH, SEQ), generator=g)
        ddp.zero_grad_buffer()
        with SyncCounter() as syncs:
            loss = model(tokens, positions, None, labels=tokens).float().mean()
            loss.backward()
        out["train"].append([str(hit) for hit in syncs.hits])
    model.eval()
    tokens = torch.randint(0, 256, (BATCH, SEQ), generator=g)
    state = sparse_layers(model)[0].routing_state
    state.eval_capacity_factor = 1.0  # --xmod-eval-capacity-factor 1
    for rule in ("threshold", "threshold", "topk"):  # the first threshold pass sizes the second's widths
        with torch.no_grad(), eval_routing(model, rule), SyncCounter() as syncs:
            loss = model(tokens, positions, None, labels=tokens)
        out["eval_" + rule] = [str(hit) for hit in syncs.hits]
        if rule == "threshold":
            out["eval_threshold_loss"] = loss.float().sum().item()
    state.eval_capacity_factor = 0  # exact widths
    with torch.no_grad():
        out["eval_exact_loss"] = model(tokens, positions, None, labels=tokens).float().sum().item()
    return out


def main_syncs(steps: int) -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    # The permutation ops' index checks read the indices back on CPU tensors only (megatron_xmod.xmod.permute):
    # off, as they are on a GPU, so that the counts are a GPU run's.
    os.environ["XMOD_PERMUTE_CHECK"] = "0"
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    result = dict(rank=rank, **{family: _count_syncs(family, steps) for family in ("xmod", "mod")})
    ranks = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(ranks, result)
    if rank == 0:
        print("SYNCS " + json.dumps(ranks), flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    with cpu_patches(training=False):  # megatron-core on CPU, as tests/conftest.py
        if sys.argv[1] == "syncs":
            main_syncs(int(sys.argv[2]))
        else:
            main(sys.argv[1], int(sys.argv[2]))
