"""torchrun worker for test_context_parallel.py (not collected: no test_ prefix), 2 gloo processes.
Usage: <family> <steps> [full-recompute | segments]

Trains the same tiny routed model twice from the same weights on the same batches through megatron's
DistributedDataParallel and finalize_model_grads: first at CP1 (the two processes are data-parallel
replicas with identical data), then at CP2 (each rank holds its two of megatron's four load-balanced
chunks of every sequence, split by megatron's get_batch_on_this_cp_rank layout). The layout's S32 layer
routes k = L/32 = 1 token a sequence, so in every sequence one CP rank holds none of its routed tokens.
Rank 0 prints one JSON line: per run the losses, the per-token losses of the first step (the model's
output, in sequence order), the routed sets of every sparse layer at every step (training top-k, then
evaluation threshold), the routing statistics (selected fraction, coverage, adjacent Jaccard, router
BCE, non-finite logits; training and evaluation), the threshold-rule eval loss, the router BCE of the first step; the largest
relative difference of any parameter's first-step gradient (floored at 1e-6) between the runs; and the host syncs of a
CP2 training step's forward and backward (tests/sync_counter.py).
"""
import hashlib
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from megatron_xmod.cpu_shim import cpu_patches  # noqa: E402

SEQ, BATCH, LAYOUT = 32, 2, "D + (S4 + S32 + S4 + D)"
# "segments": top-k within 4 segments of 8 tokens (--xmod-routing-segments 4 = 2 x CP): every CP rank holds
# exactly k/2 routed tokens of each sequence, its routed batch has no padding (recorded: "cp_batches")
SEGMENTS_LAYOUT = "D + (S4 + S8 + S4 + D)"


RECOMPUTE = {}  # config fields of a run under megatron's full recompute (argument "full-recompute")
SEGMENTS = {}  # config fields of a run with segment-local top-k (argument "segments")


def _build(family, cp, full_state=None):
    from helpers import TINY
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_xmod.model import build_gpt_model, config_from_backbone

    config = config_from_backbone(TINY, SEGMENTS_LAYOUT if SEGMENTS else LAYOUT, use_cpu_initialization=True,
                                  xmod_routing_family=family, context_parallel_size=cp, **RECOMPUTE, **SEGMENTS)
    model = build_gpt_model(config, TINY.vocab_size, SEQ, rotary_base=TINY.rotary_base)
    if full_state is not None:
        model.load_state_dict(full_state, strict=False)
    return DistributedDataParallel(config, DistributedDataParallelConfig(), model), model


def _own_positions(cp):
    from megatron.core import parallel_state

    from megatron_xmod.xmod.layers import load_balanced_positions

    if cp == 1:
        return torch.arange(SEQ)
    return load_balanced_positions(SEQ, cp)[parallel_state.get_context_parallel_rank()]


def _whole(local, cp):
    """[b, L/C] per-token values of every CP rank -> [b, L] in sequence order."""
    from megatron.core import parallel_state

    if cp == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(cp)]
    torch.distributed.all_gather(parts, local.contiguous(), group=parallel_state.get_context_parallel_group())
    out = torch.empty(local.shape[0], SEQ, dtype=local.dtype)
    for rank, part in enumerate(parts):
        out[:, _positions_of(rank, cp)] = part
    return out


def _positions_of(rank, cp):
    from megatron_xmod.xmod.layers import load_balanced_positions

    return load_balanced_positions(SEQ, cp)[rank]


def _train(ddp, model, steps, cp, count_syncs=False):
    from megatron.core.distributed import finalize_model_grads
    from sync_counter import SyncCounter

    from megatron_xmod.model import sparse_layers
    from megatron_xmod.xmod.routing_state import report, take_microbatch_loss

    routed = []
    state = sparse_layers(model)[0].routing_state
    state.observers.append(lambda layer, logits, decision: routed.append(decision.selected.clone()))  # no host read
    own = _own_positions(cp)
    g = torch.Generator().manual_seed(7)
    out = dict(losses=[], syncs=None)
    grads = None
    model.train()
    for step in range(steps):
        tokens = torch.randint(0, 256, (BATCH, SEQ), generator=g)[:, own]
        ddp.zero_grad_buffer()
        with SyncCounter() as syncs:
            per_token = model(tokens, own.expand_as(tokens), None, labels=tokens).float()
            # megatron's LM loss under CP: this rank's mean (the DDP averages the gradients over dp x cp)
            per_token.mean().backward()
        if count_syncs and step == 1:
            out["syncs"] = [str(hit) for hit in syncs.hits]
        bce = take_microbatch_loss(model)
        finalize_model_grads([ddp])
        if step == 0:
            grads = {name: p.main_grad.clone() for name, p in model.named_parameters()}
            out["first_step_tokens"] = _whole(per_token.detach(), cp).tolist()
            out["first_step_router_bce"] = float(bce)
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.5 * p.main_grad
        out["losses"].append(_whole(per_token.detach(), cp).mean().item())
    out["statistics"] = report(model)  # this rank's routing statistics of the training steps (every CP rank routes all)
    model.eval()
    with torch.no_grad():  # evaluation: the threshold rule
        tokens = torch.randint(0, 256, (BATCH, SEQ), generator=g)[:, own]
        out["eval_loss"] = _whole(model(tokens, own.expand_as(tokens), None, labels=tokens).float(), cp).mean().item()
    out["eval_statistics"] = report(model)
    out["routed"] = [hashlib.sha1(selected.numpy().tobytes()).hexdigest()[:12] for selected in routed]
    return out, grads


def main(family: str, steps: int) -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_xmod.model import sparse_layers

    os.environ["XMOD_PERMUTE_CHECK"] = "0"  # the permutation ops' CPU index checks read indices back (a GPU run's counts)
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    parallel_state.initialize_model_parallel()
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    ddp, model = _build(family, 1)
    with torch.no_grad():  # content-dependent routing with margins (fp32 reduction order cannot flip it)
        for layer in sparse_layers(model):
            layer.router.weight.mul_(20.0)
    initial = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    cp1, grads1 = _train(ddp, model, steps, 1)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(context_parallel_size=2)
    model_parallel_cuda_manual_seed(0)
    ddp, model = _build(family, 2, initial)
    batches = []
    if SEGMENTS:  # the CP routed batches of the training steps: (K, width, all rows real)
        from megatron_xmod.xmod.layers import XModSparseLayer

        original = XModSparseLayer._context_parallel_batch

        def recorded(layer, indices, valid, *rest):
            rows, real, mask = original(layer, indices, valid, *rest)
            if layer.training:
                batches.append((layer.routing.sparsity_k, rows.shape[0], real.all()))  # read after the sync count
            return rows, real, mask
        XModSparseLayer._context_parallel_batch = recorded
    cp2, grads2 = _train(ddp, model, steps, 2, count_syncs=True)
    cp2["cp_batches"] = sorted({(k, width, bool(real)) for k, width, real in batches})
    # relative to the gradient's size, floored at 1e-6: with k = 1 a routed token attends to itself only, so
    # the q/k norms of the S32 layer get gradients of rounding size (~1e-11) in both runs
    worst = max(((grads2[n] - g).abs().max() / g.abs().max().clamp(min=1e-6)).item() for n, g in grads1.items())
    if rank == 0:
        print("RESULT " + json.dumps(dict(family=family, cp1=cp1, cp2=cp2, grad_rel_diff=worst)), flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    with cpu_patches(training=False):  # megatron-core on CPU, as tests/conftest.py
        if sys.argv[3:] == ["full-recompute"]:  # each layer checkpointed: its CP collectives run again in backward
            RECOMPUTE.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        if sys.argv[3:] == ["segments"]:
            SEGMENTS.update(xmod_routing_segments=4)
        main(sys.argv[1], int(sys.argv[2]))
