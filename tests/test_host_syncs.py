"""No host synchronisation in a training step, in any mode (issue 28, item 3).

Forward + backward of tiny routed models under tests/sync_counter.py's ``SyncCounter``, which counts the
ops that make the host wait for a GPU (``.item()``, ``nonzero``, boolean-mask indexing, ...; see its
docstring for the list and what a CPU run can see). Training: zero in every mode (X-MoD and MoD with
the router BCE, full recompute, DTop-p's router, the token-choice bias carried across a pipeline
boundary, TP2 with sequence parallelism on two ranks), and the forward step's NaN check reads nothing
beyond megatron's own check of the loss. Evaluation: none under top-k; under the threshold rule one per
sparse layer at exact widths (the default), one per forward pass with --xmod-eval-capacity-factor > 0
(docs/routing.md, "Host synchronisation").

The permutation ops check their index values on CPU tensors only (megatron_xmod/xmod/permute/dispatch.py,
``XMOD_PERMUTE_CHECK``), a host read that a GPU run does not make: the tests turn the checks off, as
bench/ops.py does, so that the CPU counts are a GPU run's (test_the_counter_sees_the_permutation_checks
shows that the counter sees them when they are on).
"""
import dataclasses
import os
import socket
import subprocess
import sys
import unittest.mock

import pytest
import torch
from entry_point_helpers import tagged_json
from helpers import TINY, tiny_model
from sync_counter import SyncCounter

from megatron_xmod.model import sparse_layers

SEQ = 32
LAYOUT = "D + (S4*2 + D)"  # D S S D: one sparse block of two layers, so the bias is carried between them
WORKER = os.path.join(os.path.dirname(__file__), "dist_worker_sp.py")


@pytest.fixture(autouse=True)
def gpu_like_permutation(monkeypatch):
    monkeypatch.setenv("XMOD_PERMUTE_CHECK", "0")


def _batch(seed=0):
    tokens = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(seed))
    return tokens, torch.arange(SEQ).expand_as(tokens)


def _routed(model):
    with torch.no_grad():  # content-dependent routing (the carried bias then changes the selection)
        for layer in sparse_layers(model):
            layer.router.weight.mul_(20.0)
    return model


def _train_step_syncs(model) -> SyncCounter:
    tokens, positions = _batch()
    model.train()
    with SyncCounter() as syncs:
        loss = model(tokens, positions, None, labels=tokens).float().mean()
        loss.backward()
    return syncs


def _eval_syncs(model, rule) -> SyncCounter:
    from megatron_xmod.xmod.routing_state import eval_routing

    tokens, positions = _batch(1)
    model.eval()
    with torch.no_grad(), eval_routing(model, rule), SyncCounter() as syncs:
        model(tokens, positions, None, labels=tokens)
    return syncs


def test_the_counter_counts_each_kind():
    x, mask = torch.arange(6.0), torch.arange(6) % 2 == 0
    repeats = torch.tensor([1, 2, 0, 1, 1, 1])
    expected = {
        "_local_scalar_dense": lambda: (x.sum().item(), float(x[0]), bool(mask.any())),
        "nonzero": lambda: (mask.nonzero(), torch.where(mask)),
        "masked_select": lambda: x.masked_select(mask),
        "_unique2": lambda: torch.unique(x),
        "repeat_interleave without output_size": lambda: x.repeat_interleave(repeats),
        "index with a boolean mask": lambda: x[mask],
        "index_put_ with a boolean mask": lambda: x.clone().__setitem__(mask, x[:3] * 0),
        "Tensor.tolist()": lambda: x.tolist(),
    }
    for op, run in expected.items():
        with SyncCounter() as syncs:
            run()
        assert {hit.op for hit in syncs.hits} == {op}, (op, syncs.summary())
    with SyncCounter() as syncs:  # static shapes, and what aten runs as masked_fill_
        x.repeat_interleave(repeats, output_size=6)
        x.clone()[mask] = 0.0
        torch.where(mask, x, -0.0)
        x.cpu()
        x.index_select(0, repeats)
    assert syncs.count == 0, syncs.summary()


MODES = {
    "xmod": dict(),  # router BCE on (default 1e-4), token-choice bias tau 0.5
    "mod": dict(xmod_routing_family="mod"),
    "xmod-recompute": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "xmod-segments": dict(xmod_routing_segments=2),  # top-k per half of the sequence (--xmod-routing-segments)
}


@pytest.mark.parametrize("mode", list(MODES))
def test_training_step_has_no_host_sync(seeded, mode):
    from megatron_xmod.xmod.routing_state import RecomputeReplay

    model = _routed(tiny_model(LAYOUT, seq_len=SEQ, **MODES[mode])[0])
    assert all(layer.routing.router_bce_coeff == 1e-4 for layer in sparse_layers(model))
    pushed = []
    push = RecomputeReplay.push
    with unittest.mock.patch.object(RecomputeReplay, "push", lambda self, *a: (pushed.append(a[0]), push(self, *a))):
        syncs = _train_step_syncs(model)
    assert syncs.count == 0, syncs.summary()
    assert all(p.grad is not None for layer in sparse_layers(model) for p in layer.router.parameters())
    assert pushed == ([2, 3] if mode.endswith("recompute") else [])  # the recompute really ran
    assert all(layer.routing.routing_segments == MODES[mode].get("xmod_routing_segments", 1)
               for layer in sparse_layers(model))


def test_the_counter_sees_the_permutation_checks(seeded, monkeypatch):
    """The counter's positive control: the CPU-only index checks of the permutation ops read the indices (on the
    kernel backends' path, the gather and the gated scatter, which a CPU run takes with the torch backend when
    the layer is told the kernels were selected; it otherwise updates the stream in place without them)."""
    import megatron_xmod.xmod.layers as layers

    monkeypatch.delenv("XMOD_PERMUTE_CHECK")
    monkeypatch.setattr(layers, "selected_backend", lambda x: "triton")
    syncs = _train_step_syncs(_routed(tiny_model(LAYOUT, seq_len=SEQ)[0]))
    assert syncs.count > 0 and all(hit.site.startswith("megatron_xmod/xmod/permute/dispatch.py")
                                   for hit in syncs.hits), syncs.summary()


def test_evaluation_syncs(seeded):
    """top-k: none. threshold with --xmod-eval-capacity-factor 1: one per forward pass, where the decoder
    reads the sparse layers' widest selections (RoutingState.end_capacity_pass) and sizes the next pass's
    static widths; the first pass, sized from L/K alone, overflows here (saturated routers select about
    half the tokens) and runs again at exact widths, one read per sparse layer. With the default factor
    0 (exact widths): one per sparse layer, every pass."""
    model = _routed(tiny_model(LAYOUT, seq_len=SEQ, xmod_eval_capacity_factor=1.0)[0])
    state = sparse_layers(model)[0].routing_state
    topk = _eval_syncs(model, "topk")
    assert topk.count == 0, topk.summary()
    first = _eval_syncs(model, "threshold")
    assert state.capacity_reruns == 1 and first.count == 1 + len(sparse_layers(model)), first.summary()
    threshold = _eval_syncs(model, "threshold")
    assert state.capacity_reruns == 1 and threshold.count == 1, threshold.summary()
    assert threshold.hits[0].site.endswith("in end_capacity_pass"), threshold.summary()
    state.eval_capacity_factor = 0  # the default
    exact = _eval_syncs(model, "threshold")
    assert exact.count == len(sparse_layers(model)) == 2, exact.summary()
    assert all(hit.site.startswith("megatron_xmod/xmod/routing.py") and hit.site.endswith("in capacity_selection")
               for hit in exact.hits), exact.summary()


def test_dtopp_adds_no_host_sync(seeded, fresh_moe_tracker):
    """The DTop-p router itself: none. In a whole MoE model megatron's dropless dispatcher and
    sequential experts read the token counts per expert (their shapes depend on them): megatron's,
    not the router's; none of the hits comes from megatron_xmod."""
    from megatron_xmod.moe.model import build_moe_gpt_model, moe_config_from_backbone
    from megatron_xmod.moe.router import DTopPRouter

    backbone = dataclasses.replace(TINY, num_layers=2)
    config = moe_config_from_backbone(backbone, "dtopp-t2-e8", use_cpu_initialization=True,
                                      dtopp_dynamic_loss_coeff=1e-3, moe_z_loss_coeff=1e-3)
    model = build_moe_gpt_model(config, backbone.vocab_size, SEQ, rotary_base=backbone.rotary_base)
    routers = [m for m in model.modules() if isinstance(m, DTopPRouter)]
    router_syncs = []
    forward = DTopPRouter.forward

    def counted(self, *args, **kwargs):
        with SyncCounter() as syncs:
            out = forward(self, *args, **kwargs)
        router_syncs.append(syncs)
        return out

    with unittest.mock.patch.object(DTopPRouter, "forward", counted):
        syncs = _train_step_syncs(model)
    assert len(router_syncs) == len(routers) == 2
    assert all(s.count == 0 for s in router_syncs), [s.summary() for s in router_syncs]
    assert syncs.in_plugin() == [] and all(hit.site is None for hit in syncs.hits), syncs.summary()
    assert routers[0].dtopp_token_count.item() > 0  # the controller's counters were fed

    from megatron_xmod.moe.router import update_dtopp_controllers

    with SyncCounter() as update:
        update_dtopp_controllers(model)
    assert update.count == 0, update.summary()


def test_bias_carried_across_a_pipeline_boundary_has_no_host_sync(seeded):
    """Two pipeline stages of D S | S D in one process (megatron's schedule replaced by handing the
    first stage's output to the second): the token-choice bias travels in the activation's extra channels
    (megatron_xmod.pipeline.carry) with no host sync."""
    from megatron.core import parallel_state
    from megatron.core.transformer import transformer_block, transformer_layer
    from megatron.core.utils import get_pg_rank

    from megatron_xmod.model import build_gpt_model, config_from_backbone
    from megatron_xmod.pipeline.carry import attach_boundary_carry

    config = config_from_backbone(TINY, LAYOUT, use_cpu_initialization=True, pipeline_model_parallel_size=2,
                                  pipeline_dtype=torch.float32)
    first = build_gpt_model(config, TINY.vocab_size, SEQ, post_process=False, rotary_base=TINY.rotary_base)
    pp = parallel_state.get_pipeline_model_parallel_group()

    def rank(group):
        return 1 if group is pp else get_pg_rank(group)

    with unittest.mock.patch.object(parallel_state, "get_pipeline_model_parallel_rank", lambda *a, **k: 1), \
         unittest.mock.patch.object(transformer_layer, "get_pg_rank", rank), \
         unittest.mock.patch.object(transformer_block, "get_pg_rank", rank):  # build it as the second stage
        second = build_gpt_model(config, TINY.vocab_size, SEQ, pre_process=False, rotary_base=TINY.rotary_base)
    assert [layer.layer_number for layer in second.decoder.layers] == [3, 4]
    for chunk in (first, second):
        _routed(attach_boundary_carry(chunk)).train()
    tokens, positions = _batch()
    with SyncCounter() as syncs:
        sent = first(tokens, positions, None)
        received = sent.detach().requires_grad_()
        second.set_input_tensor(received)
        loss = second(None, positions, None, labels=tokens).float().mean()
        loss.backward()
        sent.backward(received.grad)
    assert syncs.count == 0, syncs.summary()
    assert sent.shape == (SEQ, 2, TINY.hidden_size + 2)
    bias, _ = second.routing_state.take_bias(4, (SEQ, 2))
    assert bias.sum() == 2 * (SEQ // 4) * 2  # layers 2 and 3 each raised k = L/4 tokens per sequence: the carry arrived


@pytest.mark.parametrize("nonfinite", [0.0, 16.0])
def test_nan_check_reads_the_counts_only_for_a_nan_loss(megatron_parallel, capsys, nonfinite):
    """Inside megatron's loop with its NaN check on, the forward step's loss makes the two reads of
    megatron's check (NaN, Inf) and no other; the non-finite counts are read when the loss is NaN."""
    from megatron_xmod.training import step

    mask, output = torch.ones(2, 8), torch.rand(2, 8)
    counts = torch.tensor([0.0, nonfinite])
    with unittest.mock.patch.object(step, "_nan_check", lambda: (True, True)), SyncCounter() as syncs:
        if nonfinite:
            with pytest.raises(RuntimeError, match=r"non-finite router logits in layer 3 \(16 values\)"):
                step.loss_func(mask, None, None, None, output, nonfinite=([2, 3], counts))
        else:
            step.loss_func(mask, None, None, None, output, nonfinite=([2, 3], counts))
    reads = [hit.op for hit in syncs.hits]
    if nonfinite:  # megatron's NaN read, then the counts (then megatron prints the loss in its error)
        assert reads[:2] == ["_local_scalar_dense", "Tensor.tolist()"], syncs.summary()
        assert "[xmod] non-finite router logits in layer 3 (16 values)" in capsys.readouterr().out
    else:
        assert reads == ["_local_scalar_dense"] * 2, syncs.summary()
        assert "non-finite" not in capsys.readouterr().out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # torchrun workers
def test_tp2_sequence_parallel_training_has_no_host_sync():
    """Two ranks, TP2 with sequence parallelism, X-MoD and MoD: no sync in a training step on either
    rank; evaluation as on one rank (threshold: one per forward pass, the same loss as at exact widths; top-k: none). Before the fix each
    sparse layer's sequence-parallel update and its written rows called nonzero: 2 per sparse layer, step and rank."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port", str(_free_port()),
         WORKER, "syncs", "1"], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    ranks = tagged_json(result.stdout, "SYNCS")
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    for r in ranks:
        for family in ("xmod", "mod"):
            run = r[family]
            assert run["train"] == [[]], (r["rank"], family, run["train"])
            assert run["eval_topk"] == [], (r["rank"], family, run["eval_topk"])
            # the second threshold pass: one read, its widths sized by the first
            assert len(run["eval_threshold"]) == 1, run["eval_threshold"]
            assert "in end_capacity_pass" in run["eval_threshold"][0], run["eval_threshold"]
            assert run["eval_threshold_loss"] == run["eval_exact_loss"], run
